"""Where the suite's time goes: ``--cpu-profile PATH`` (``bash scripts/test.sh --cpu-profile
out/cpu.json``) writes the CPU time of every test, notebook cell and test file to PATH and prints
the costliest files.

A test's CPU time is the user and system time of its pytest process and of every process it
reaped (rank processes, subprocesses, a notebook's kernel and its ranks) from the start of its
setup to the end of its teardown, so a module-scoped fixture counts in the test that builds it
and the one that tears it down. Wall time on a busy machine says little about cost; CPU time
(what ``/usr/bin/time`` sums for the whole run) is what two workers on 2 cores share. A process
that is killed and never waited for is not counted, and a notebook's kernel is reaped when its
last cell is done: a notebook's time shows on that cell, so read notebooks per file. Under
pytest-xdist each worker measures its own tests and sends the figures with the test's report; the
controller writes the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

START = pytest.StashKey[tuple[float, float]]()
TOP = 15  # files listed in the terminal summary


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-profile",
        metavar="PATH",
        help="write the CPU time (user + sys, reaped children included) of every test, notebook"
        " cell and test file to PATH (JSON), and list the costliest files",
    )


def cpu_seconds() -> tuple[float, float]:
    """(user, sys) seconds of this process and of the children it has waited for."""
    import resource  # Unix only, as the option

    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + reaped.ru_utime, own.ru_stime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.config.getoption("cpu_profile"):
        item.stash[START] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "teardown" or START not in item.stash:
        return
    user, sys_ = (now - then for now, then in zip(cpu_seconds(), item.stash[START]))
    # the teardown report's own copy of the test's properties: pytest-xdist sends it to the
    # controller, and --junitxml writes it
    outcome.get_result().user_properties += [
        ("cpu_user_s", round(user, 3)),
        ("cpu_sys_s", round(sys_, 3)),
    ]


def _cpu(row: dict) -> float:
    return row["user_s"] + row["sys_s"]


def _costliest_first(rows: dict[str, dict]) -> dict[str, dict]:
    """The rows by CPU time, costliest first, in milliseconds' precision."""
    rounded = {k: {f: round(v, 3) for f, v in row.items()} for k, row in rows.items()}
    return dict(sorted(rounded.items(), key=lambda kv: -_cpu(kv[1])))


class Profile:
    """The controller's tally: per test, the CPU figures of its teardown report and the wall
    time of its three phases."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        row = self.tests.setdefault(report.nodeid, {"user_s": 0.0, "sys_s": 0.0, "wall_s": 0.0})
        row["wall_s"] += report.duration
        props = dict(report.user_properties) if report.when == "teardown" else {}
        row["user_s"] += props.get("cpu_user_s", 0.0)
        row["sys_s"] += props.get("cpu_sys_s", 0.0)

    def files(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for nodeid, row in self.tests.items():
            f = out.setdefault(
                nodeid.split("::")[0], {"tests": 0, "user_s": 0.0, "sys_s": 0.0, "wall_s": 0.0}
            )
            f["tests"] += 1
            for key in ("user_s", "sys_s", "wall_s"):
                f[key] += row[key]
        return out

    def pytest_sessionfinish(self, session):
        files = self.files()
        data = {
            "user_s": round(sum(f["user_s"] for f in files.values()), 3),
            "sys_s": round(sum(f["sys_s"] for f in files.values()), 3),
            "files": _costliest_first(files),
            "tests": _costliest_first(self.tests),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=1) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        files = _costliest_first(self.files())
        tr = terminalreporter
        tr.section("CPU time per file (user + sys, reaped children included)")
        tr.write_line(f"{'CPU-s':>8} {'wall s':>8} {'tests':>5}  file")
        for name, f in list(files.items())[:TOP]:
            tr.write_line(f"{_cpu(f):8.1f} {f['wall_s']:8.1f} {f['tests']:5d}  {name}")
        total = sum(map(_cpu, files.values()))
        tr.write_line(f"{total:8.1f} CPU-s in {len(self.tests)} tests; every test in {self.path}")


def pytest_configure(config):
    path = config.getoption("cpu_profile")
    if not path or hasattr(config, "workerinput"):  # an xdist worker measures, never writes
        return
    if os.name != "posix":
        raise pytest.UsageError("--cpu-profile reads getrusage, which Windows does not have")
    config.pluginmanager.register(Profile(path), "cpu_profile_tally")
