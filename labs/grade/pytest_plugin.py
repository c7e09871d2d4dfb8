"""pytest plugin for grading: one JSON line per test phase, sent to the grader as the run goes, from
a pytest process that never runs the student's code itself.

Loaded with ``-p labs_grade_plugin`` by ``labs.grade`` inside the sandbox (from the read-only
``/grading/tools``), before any conftest or test module. Environment, read once and removed:

* ``LABS_GRADE_FD``: the file descriptor of the results channel, a pipe the grader reads;
* ``LABS_GRADE_CHECK``: a random name: after every test, a check of that name runs (see below);
* ``LABS_GRADE_MAX_TIMEOUTS``: after that many tests time out (pytest-timeout), the remaining tests
  fail without running (a submission that hangs costs the lab's time budget once, not once per
  test); ``LABS_GRADE_TIMEOUTS_SO_FAR``: timeouts already spent by this lab's other run.

Lines: ``{"collected": [nodeid, ...]}`` once, then ``{"nodeid", "when", "outcome", "message",
"duration"}`` for every setup/call/teardown report, and ``{"guard": module, "during": nodeid}``
when the guard below refused something. The grader checks the stream against the tests it
collected itself (``labs.grade.results``).

**Why the stream can be trusted.** The student's code runs only in processes this one starts
(``launch`` forks its ranks; a CLI the test runs is a child too), never in this process, and none
of those children can write a result:

* the results descriptor is close-on-exec and closed in every forked child at the fork
  (``os.register_at_fork``), and both variables are taken out of the environment (and their
  values wiped from the process's original environment block) before any test runs;
* this process is not dumpable (``prctl(PR_SET_DUMPABLE, 0)``): a child of the same user cannot
  ptrace it, read or write its memory (``/proc/<ppid>/mem``, ``process_vm_*``) or open its
  descriptors through ``/proc/<ppid>/fd``;
* **the guard**: in this process (only this pid: forked children inherit the hooks), importing an
  exercise module (``labs.<exercise>``) or compiling or executing its file fails loudly (a course
  test that does it is a bug in the course: the line ``{"guard": ...}`` makes the grader say so),
  and unpickling resolves only plain data (tensors, numbers, containers, dtypes and the course's
  own dataclasses), so the bytes a rank sends back (``launch``'s channel, a file it saved) can
  never run code here: the test they came to fails.

The checks: once the tests are selected and ordered, a check item ``<parent>::<name>_<i>`` is
put right after test ``i``, beside it (same module or class, so no fixture of the test's module
is torn down for it). Each check must fail: it asserts that ``torch.equal``, ``torch.allclose``
and ``==`` find zeros equal to ones. A check that passes means something changed how this process
judges tests (which the guard should have made impossible), and the grader throws the whole run's
results away.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import importlib
import json
import os
import sys

import pytest

MAX_MESSAGE = 1000
TIMEOUT_MARK = "Timeout (>"  # in pytest-timeout's failure message
GUARD_MARK = "grading guard:"  # starts every message of the guard
PR_SET_DUMPABLE = 4
_state = {
    "timeouts": int(os.environ.get("LABS_GRADE_TIMEOUTS_SO_FAR", "0")),
    "pid": os.getpid(),  # the pytest process: the guard holds here only
    "during": "collection",  # the test running now (what a guard line names)
}


def _take_from_environment(name: str) -> str | None:
    """Remove ``name`` from the environment, and wipe its value in the process's own copy of the
    environment too (what ``/proc/<pid>/environ`` and a forked child's memory would show)."""
    value = os.environ.pop(name, None)
    if value is None:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        address = libc.getenv(name.encode())
        if address:
            ctypes.memset(address, 0, len(value.encode()))
        libc.unsetenv(name.encode())
    except (OSError, AttributeError):  # not glibc: os.environ.pop already unset it
        pass
    return value


def _secrets() -> tuple[int | None, str | None]:
    fd = _take_from_environment("LABS_GRADE_FD")
    token = _take_from_environment("LABS_GRADE_CHECK")
    if fd is None:
        return None, token
    fd = int(fd)
    os.set_inheritable(fd, False)  # an exec'd child (a CLI, a spawned rank) does not get it
    return fd, token


_state["fd"], _state["token"] = _secrets()


def _forget_in_child() -> None:
    """After a fork, in the child (which runs the student's code): no results channel, no token."""
    fd = _state.get("fd")
    _state["fd"] = None
    _state["token"] = None
    if fd is not None and not _state.get("kept"):
        try:
            os.close(fd)
        except OSError:
            pass


def _keep_from_ranks(fd: int) -> None:
    """Out of reach of every process that runs the student's code: this process is not dumpable,
    and each child forked from it loses the results descriptor at the fork. The course's
    ``labs.runtime.isolation`` (helper h4's change) does both where it exists; until it is merged,
    the same by hand here."""
    try:
        from labs.runtime.isolation import keep_from_ranks, protect_from_ranks
    except ImportError:
        keep_from_ranks = protect_from_ranks = None
    if keep_from_ranks is not None:
        keep_from_ranks(fds=[fd])  # in a forked child the number is /dev/null, read-only
        protect_from_ranks()
        _state["kept"] = True
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


os.register_at_fork(after_in_child=_forget_in_child)
if _state["fd"] is not None:
    _keep_from_ranks(_state["fd"])


def _write(record: dict) -> None:
    fd = _state.get("fd")
    if fd is None or os.getpid() != _state["pid"]:
        return
    data = (json.dumps(record) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


# ---- the guard: no student code in this process, no code from a child's bytes
# --------------------------------------------------------------------------------


class GuardError(ImportError):
    """Something tried to run a student's code, or to unpickle more than data, in the process
    that reports the results."""


def _refuse(what: str, advice: str, course: bool = True) -> None:
    """Fail loudly. ``course``: only the course's own test can have done it (a rank cannot make
    this process import or run anything), so a guard line tells the grader; bytes a rank sent
    that are more than data fail the test they came to, and that is all."""
    if course:
        _write({"guard": what, "during": _state["during"]})
    raise GuardError(f"{GUARD_MARK} {what} in the grading test process; {advice}")


class _Guard:
    """The meta path finder and audit hook of the guard (only in the pytest process's pid)."""

    def __init__(self, exercises: tuple[str, ...], labs_dir: str) -> None:
        self.modules = {
            f"{package}.{name}" for package in ("labs", "solutions") for name in exercises
        }
        self.files = {os.path.realpath(os.path.join(labs_dir, f"{name}.py")) for name in exercises}

    # meta path finder: refuses before anything of the module is read
    def find_spec(self, name, path=None, target=None):
        if name in self.modules and os.getpid() == _state["pid"]:
            _refuse(f"import of the exercise module `{name}`", _RUN_IN_A_CHILD)
        return None

    def audit(self, event: str, args: tuple) -> None:
        if event not in ("compile", "exec", "pickle.find_class"):
            return
        if os.getpid() != _state["pid"]:
            return
        if event == "pickle.find_class":
            if not _allowed_global(*args):
                module, name = args
                why = "only plain data may come back from a rank"
                _refuse(f"unpickling `{module}.{name}`", why, course=False)
            return
        filename = args[1] if event == "compile" else getattr(args[0], "co_filename", None)
        if isinstance(filename, str) and os.path.realpath(filename) in self.files:
            _refuse(f"running `{filename}`", _RUN_IN_A_CHILD)


_RUN_IN_A_CHILD = (
    "a test must run exercise code in a child (labs.launch forks one) and get plain data back"
)
_PLAIN = (
    {
        ("builtins", name)
        for name in ("complex", "set", "frozenset", "slice", "range", "bytearray", "list", "dict")
    }
    | {("builtins", name) for name in ("tuple", "int", "float", "str", "bool", "bytes")}
    | {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        # a storage's bytes: a nested torch.load, whose globals come back through this guard too
        ("torch.storage", "_load_from_bytes"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
    }
)


def _allowed_global(module: str, name: str) -> bool:
    """May unpickling in the pytest process resolve ``module.name``? Plain data only: the pairs of
    ``_PLAIN``, torch's dtypes, and the dataclasses, named tuples and enums of the course's own
    modules (never an exercise module, never a function). (Until the launcher decodes what ranks
    send by itself (helper h4's change): then its decoder's list of types is the one to keep.)"""
    if (module, name) in _PLAIN:
        return True
    if module == "torch":
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    if not module.startswith("labs.") or module.startswith("labs.grade"):
        return False
    if module in _state["guard"].modules:
        return False
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    if not isinstance(found, type):
        return False
    named_tuple = issubclass(found, tuple) and hasattr(found, "_fields")
    return dataclasses.is_dataclass(found) or named_tuple or issubclass(found, enum.Enum)


def _install_guard() -> None:
    import labs
    from labs.runtime.impl import EXERCISES

    guard = _Guard(EXERCISES, os.path.dirname(labs.__file__))
    _state["guard"] = guard
    sys.meta_path.insert(0, guard)
    sys.addaudithook(guard.audit)


if _state["fd"] is not None:  # grading: before any conftest or test module is imported
    _install_guard()


# ---- the checks, the timeouts, the stream
# -----------------------------------------------------------------------------------


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
    name = _state["token"]
    return bool(name) and item.name.startswith(f"{name}_")


@pytest.hookimpl(trylast=True)  # after -m has deselected and fixtures have reordered the tests
def pytest_collection_modifyitems(session, config, items):
    """Graded test i, then check i beside it, for every i."""
    name = _state["token"]
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
    _state["during"] = item.nodeid
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
