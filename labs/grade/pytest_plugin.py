"""pytest plugin for grading: one JSON line per test phase, sent to the grader as the run goes.

Loaded with ``-p labs_grade_plugin`` by ``labs.grade`` inside the sandbox (from the read-only
``/grading/tools``). Environment:

* ``LABS_GRADE_FD``: the file descriptor of the results channel, a pipe the grader reads;
* ``LABS_GRADE_CHECK``: a random name: after every test, a check of that name runs (see below);
* ``LABS_GRADE_MAX_TIMEOUTS``: after that many tests time out (pytest-timeout), the remaining tests
  fail without running (a submission that hangs costs the lab's time budget once, not once per
  test); ``LABS_GRADE_TIMEOUTS_SO_FAR``: timeouts already spent by this lab's other run.

Lines: ``{"collected": [nodeid, ...]}`` once, then ``{"nodeid", "when", "outcome", "message",
"duration"}`` for every setup/call/teardown report. The grader checks the stream against the
tests it collected itself (``labs.grade.results``).

The checks: once the tests are selected and ordered, a check item ``<parent>::<name>_<i>`` is
put right after test ``i``, beside it (same module or class, so no fixture of the test's module
is torn down for it). Each check must fail: it asserts that ``torch.equal``, ``torch.allclose``
and ``==`` find zeros equal to ones. A check that passes means code in this process changed how
tests are judged (a hook that marks failures as passed, a patched comparison), and the grader
throws the whole run's results away.
"""

from __future__ import annotations

import json
import os

import pytest

MAX_MESSAGE = 1000
TIMEOUT_MARK = "Timeout (>"  # in pytest-timeout's failure message
_state = {"timeouts": int(os.environ.get("LABS_GRADE_TIMEOUTS_SO_FAR", "0"))}


def _write(record: dict) -> None:
    os.write(int(os.environ["LABS_GRADE_FD"]), (json.dumps(record) + "\n").encode())


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " [...]"


def grader_check():
    """Fails, unless comparisons or the reporting of tests were tampered with."""
    import torch

    zeros = torch.zeros(3)
    ones = torch.ones(3)
    same = torch.equal(zeros, ones) or torch.allclose(zeros, ones) or bool((zeros == ones).all())
    if not same:
        pytest.fail("the grader's check after each test: failing is what it should do", False)


def _is_check(item) -> bool:
    name = os.environ.get("LABS_GRADE_CHECK")
    return bool(name) and item.name.startswith(f"{name}_")


@pytest.hookimpl(trylast=True)  # after -m has deselected and fixtures have reordered the tests
def pytest_collection_modifyitems(session, config, items):
    """Graded test i, then check i beside it, for every i."""
    name = os.environ.get("LABS_GRADE_CHECK")
    if not name:
        return
    paired = []
    for i, item in enumerate(items):
        check = pytest.Function.from_parent(item.parent, name=f"{name}_{i}", callobj=grader_check)
        paired += [item, check]
    items[:] = paired


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_setup(item):
    limit = int(os.environ.get("LABS_GRADE_MAX_TIMEOUTS", "0"))
    if limit and _state["timeouts"] >= limit and not _is_check(item):
        done = _state["timeouts"]
        pytest.fail(f"not run: {done} earlier tests of this lab timed out", pytrace=False)


def pytest_runtest_logreport(report):
    message = _message(report) if report.failed or report.skipped else ""
    if report.failed and TIMEOUT_MARK in message:
        _state["timeouts"] += 1
    _write(
        {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "message": message,
            "duration": round(report.duration, 3),
        }
    )
