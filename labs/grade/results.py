"""What a graded test run proves: its results channel, checked line by line.

The pytest plugin (``pytest_plugin.py``) writes the channel from the pytest process, which never
runs the student's code (its guard refuses it) and which no process running that code can reach
(see the plugin). The grader still accepts a run's results only when they hold together:

1. **the protocol, exactly.** First the collected node ids: the grader's own list (the tests it
   collected from the instructor's copy; pytest may order them differently in a run of one lab,
   for its module-scoped fixtures), each followed by its check (``check_id``); then, for each
   test in that order, its setup, its call (when the setup passed) and its teardown, each once,
   with the keys and types the plugin writes. A stray, repeated, reordered or malformed
   line throws the whole run away: none of its tests count, and the row says why.
2. **the checks failed.** After every graded test the grader's check test runs and must fail
   (it asserts that zeros equal ones through ``torch.equal``, ``torch.allclose`` and ``==``). A
   check that passes or skips means the process judges tests differently now: the run is thrown
   away. A graded test counts as passed only when its setup, call and teardown passed *and* the
   check after it ran and failed, so code that forges passes and then ends the run before the next
   check gains at most nothing.
3. **what was cut.** A last line without its newline (the run was killed while writing it) is
   dropped; tests after the stream's end did not run and fail with the reason the caller gives.
4. **the guard.** ``{"guard": what, "during": nodeid}`` lines (anywhere) say the plugin refused to
   run exercise code, or to unpickle more than data, in the pytest process: the test named failed
   for it (a bug in the course's test, which the grader reports as such); the rest stands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MESSAGE_LIMIT = 1000  # characters of one failure message that reach the feedback
TIMEOUT_MARK = "Timeout (>"  # in pytest-timeout's failure message
RECORD_KEYS = {"nodeid": str, "when": str, "outcome": str, "message": str, "duration": (int, float)}
PHASES = ("setup", "call", "teardown")
OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class TestRun:
    """The verdict on one run's graded tests."""

    passed: list[str] = field(default_factory=list)  # node ids that passed
    failed: dict[str, str] = field(default_factory=dict)  # node id -> why not
    timeouts: int = 0  # tests that ran out of time (pytest-timeout)
    problem: str | None = None  # why the run's results were thrown away, if they were
    guarded: list[str] = field(default_factory=list)  # "what (during test)" the guard refused


class Untrusted(ValueError):
    """The stream breaks the protocol."""


def check_id(test: str, token: str, i: int) -> str:
    """The node id of the check the plugin puts after ``test``, the i-th test of the run: beside
    it, in its module or class."""
    parent = test.split("[", 1)[0].rsplit("::", 1)[0]
    return f"{parent}::{token}_{i}"


def interleave(tests: list[str], token: str) -> list[str]:
    """The order the plugin runs ``tests`` in: test i, then its check."""
    return [nodeid for i, test in enumerate(tests) for nodeid in (test, check_id(test, token, i))]


def short(text: str, limit: int = MESSAGE_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit] + " [... cut by the grader]"


def read_test_run(
    raw: bytes, graded: list[str], token: str, why_unrun: str, overflow: bool = False
) -> TestRun:
    """Judge one run from its channel ``raw``: ``graded`` are the tests that count, ``token`` the
    name of the grader's checks, ``why_unrun`` the message of tests the run never reached."""
    try:
        if overflow:
            raise Untrusted("it sent more results than any honest run does")
        records, guarded = _records(raw)
        order = _collected(records, graded, token)
        phases = _phases(records[1:], order)
    except Untrusted as exc:
        problem = f"the test run's results cannot be trusted ({exc}); none of its tests count"
        return TestRun(failed={n: f"not counted: {problem}" for n in graded}, problem=problem)
    run = TestRun(guarded=guarded)
    checks = dict(zip(order[0::2], order[1::2]))
    for nodeid in graded:
        check = checks[nodeid]
        seen = phases.get(nodeid, {})
        bad = [(when, seen[when]) for when in PHASES if when in seen and seen[when][0] != "passed"]
        confirmed = phases.get(check, {}).get("call", ("", ""))[0] == "failed"
        run.timeouts += any(TIMEOUT_MARK in message for _, (_, message) in bad)
        if bad:
            when, (outcome, message) = bad[0]
            where = "" if when == "call" else f"in {when}: "
            skipped = "skipped: " if outcome == "skipped" else ""
            run.failed[nodeid] = short(where + skipped + message)
        elif "teardown" not in seen:
            run.failed[nodeid] = why_unrun
        elif not confirmed:
            run.failed[nodeid] = f"{why_unrun} (before the grader's check after this test)"
        else:
            run.passed.append(nodeid)
    return run


def _records(raw: bytes) -> tuple[list[dict], list[str]]:
    """The JSON lines of the stream (a last line cut short is dropped), and the guard's lines
    apart, each as "what (during what)"."""
    lines = raw.split(b"\n")
    lines.pop()  # after the last newline: empty, or a line cut short by a kill
    records = []
    guarded = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise Untrusted(f"line {number} is not JSON") from None
        if not isinstance(record, dict):
            raise Untrusted(f"line {number} is not a record")
        if set(record) == {"guard", "during"}:
            guarded.append(f"{record['guard']} (during {record['during']})"[:500])
            continue
        records.append(record)
    return records, guarded


def _collected(records: list[dict], graded: list[str], token: str) -> list[str]:
    """The run's order of tests and checks, after checking it is the course's tests, each
    followed by its check."""
    if not records or set(records[0]) != {"collected"}:
        raise Untrusted("it does not start with the collected tests")
    order = records[0]["collected"]
    if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
        raise Untrusted("its collected tests are not a list of names")
    tests = order[0::2]
    if sorted(tests) != sorted(graded) or order != interleave(tests, token):
        raise Untrusted("it collected other tests than the course's")
    return order


def _phases(records: list[dict], order: list[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """node id -> phase -> (outcome, message), after checking the reports follow ``order``."""
    phases: dict[str, dict[str, tuple[str, str]]] = {}
    position = 0
    expected = "setup"
    for number, record in enumerate(records, 2):
        if set(record) != set(RECORD_KEYS) or not all(
            isinstance(record[k], t) for k, t in RECORD_KEYS.items()
        ):
            raise Untrusted(f"line {number} is not a test report")
        if record["outcome"] not in OUTCOMES:
            raise Untrusted(f"line {number} has an outcome that is none of {OUTCOMES}")
        if position >= len(order):
            raise Untrusted(f"line {number} comes after the last test")
        nodeid = order[position]
        if (record["nodeid"], record["when"]) != (nodeid, expected):
            raise Untrusted(f"line {number} is not the {expected} of the test due then")
        phases.setdefault(nodeid, {})[expected] = (record["outcome"], record["message"])
        if expected == "setup" and record["outcome"] == "passed":
            expected = "call"
        elif expected in ("setup", "call"):
            expected = "teardown"
        else:
            position += 1
            expected = "setup"
    for nodeid in order[1::2]:  # the checks: each must fail in its call, if it got that far
        outcome = phases.get(nodeid, {}).get("call", ("failed",))[0]
        if outcome != "failed":
            raise Untrusted(f"the grader's check {nodeid.split('::')[-1]} {outcome}")
    return phases
