"""pytest plugin for grading: one JSON line per test phase, written as the run goes.

Loaded with ``-p`` by ``labs.grade`` (copied next to the submission, never into it). Environment:
``LABS_GRADE_RESULTS`` the file to append to; ``LABS_GRADE_MAX_TIMEOUTS`` after that many tests
time out (pytest-timeout), the lab's remaining tests fail without running (a submission that
hangs costs the lab's time budget once, not once per test).

Lines: ``{"collected": [nodeid, ...]}`` first, then ``{"nodeid", "when", "outcome", "message",
"duration"}`` for every setup/call/teardown report.
"""

from __future__ import annotations

import json
import os

import pytest

MAX_MESSAGE = 1500
TIMEOUT_MARK = "Timeout (>"  # in pytest-timeout's failure message
_state = {"timeouts": 0}


def _write(record: dict) -> None:
    with open(os.environ["LABS_GRADE_RESULTS"], "a") as f:
        f.write(json.dumps(record) + "\n")


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " [...]"


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_setup(item):
    limit = int(os.environ.get("LABS_GRADE_MAX_TIMEOUTS", "0"))
    if limit and _state["timeouts"] >= limit:
        pytest.fail(
            f"not run: {_state['timeouts']} earlier tests of this lab timed out", pytrace=False
        )


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
