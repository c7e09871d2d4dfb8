"""Check one exercise: run its tests on your code and print a verdict per test.

    python -m labs.check collectives          # your labs/collectives.py
    python -m labs.check ddp -k naive         # only the tests whose name matches "naive"
    python -m labs.check ddp --impl solutions # the reference, to see what passing looks like
    python -m labs.check mesh --reference pipeline_parallel
                                              # your mesh on the reference's pipeline parallelism
    python -m labs.check ddp --part core      # only the core: what the next notebooks need
    python -m labs.check ddp --part buckets   # only one extension
    python -m labs.check ddp --list           # the tests of each part, run none

The learner's loop: edit ``labs/<exercise>.py``, re-run the notebook's check cell or this
command, read each failing test's reason (and its hint, when the check gives one), repeat.

Which tests run: the tests marked ``exercise`` in ``tests/test_<exercise>.py`` and
``tests/test_<exercise>_*.py`` (:func:`lab_of_test_file` is the rule; ``labs.release`` and
``labs.grade`` use the same one), with ``LABS_IMPL=labs``: on **your** code, whatever the
environment says, unless ``--impl`` asks for the reference. ``--reference EX[,EX...]`` (or
``LABS_REFERENCE``) runs the reference for those earlier exercises alone, so that a lab can be
checked before the ones it builds on are written; when tests stop in an earlier exercise's
unwritten code, the closing lines name it and this option (or, in a student release without its
reference, what to ask the instructor for).

Each lab has a core part and, in most notebooks, extensions after it (``PARTS`` in the exercise
module, ``Part:`` in each function's docstring: ``labs.check.parts``). ``--part NAME`` runs the
tests of that part alone; the tests of a part pass once it and the parts before it are written.
Without ``--part`` every part runs, and the summary says how each part stands.

What it prints, one line per test as it ends, then a summary::

    PASS  test_collectives.py::test_ring_all_reduce_equals_dist_all_reduce[2]
    FAIL  test_ddp.py::test_naive_ddp_matches_reference[4]: gradients differ at step 1 ...
          hint: gradients are 4x the reference: did you divide by the world size?
    FAIL  test_zero.py::test_zero1[4]: not written yet: FlatUnit.flatten

The reason is the first line of the failure's message; a line of that message that starts
with ``hint:`` is printed under it.

Exit status: 0 when every test passes; 1 when a test fails; 2 for bad arguments (an unknown
exercise, a ``-k`` that selects nothing); 3 when the only failures are exercises not written yet
(``NotImplementedError``), as ``python -m labs.run`` does.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from labs.check.parts import CORE, module_parts
from labs.runtime.impl import EXERCISES, IMPL_ENV, IMPLEMENTATIONS, REFERENCE_ENV, set_reference

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
UNWRITTEN = re.compile(r"exercise (\S+) is not written yet")
HINT = re.compile(r"^\s*hint:\s*(.+)$", re.M)


def lab_of_test_file(path: Path, exercises: list[str]) -> str | None:
    """The exercise a test file belongs to, by name: ``test_<exercise>.py`` or
    ``test_<exercise>_<more>.py`` (``test_<exercise>_hidden.py`` in hidden tests). The longest
    matching name wins (``tensor_parallel`` before a shorter one that prefixes it)."""
    for name in sorted(exercises, key=len, reverse=True):
        if path.stem == f"test_{name}" or path.stem.startswith(f"test_{name}_"):
            return name
    return None


def exercise_test_files(name: str, tests: Path = TESTS) -> list[Path]:
    """The test files of exercise ``name`` in the folder ``tests``."""
    return [
        path
        for path in sorted(tests.glob("test_*.py"))
        if lab_of_test_file(path, list(EXERCISES)) == name
    ]


@dataclass(frozen=True)
class Verdict:
    """How one test ended."""

    test: str  # "test_ddp.py::test_naive[4]"
    outcome: str  # "PASS", "FAIL" or "SKIP"
    reason: str = ""  # the first line of the failure's message, or why it was skipped
    hint: str = ""  # the message's "hint:" line, if it has one
    unwritten: str = ""  # the exercise function that raised NotImplementedError
    part: str = CORE  # the lab part the test checks (its ``part`` mark)

    def lines(self) -> list[str]:
        """The verdict as printed: one line, and the hint under it."""
        head = f"{self.outcome}  {self.test}" + (f": {self.reason}" if self.reason else "")
        return [head] + ([f"      hint: {self.hint}"] if self.hint else [])


def part_of_test(item) -> str:
    """The part a collected test checks: its closest ``part`` mark, else the core."""
    mark = item.get_closest_marker("part")
    return mark.args[0] if mark else CORE


def exercise_parts(name: str, impl: str = "labs") -> dict[str, int]:
    """Exercise ``name``'s parts (``PARTS`` of its module in ``impl``, else in ``labs``, which a
    student release always has): name -> minutes."""
    path = ROOT / impl / f"{name}.py"
    return module_parts((path if path.exists() else ROOT / "labs" / f"{name}.py").read_text())


def _short(nodeid: str) -> str:
    return nodeid.rsplit("/", 1)[-1]


def verdict_of(nodeid: str, outcome: str, message: str) -> Verdict:
    """A test's verdict from pytest's outcome ("passed", "failed", "skipped") and the message of
    what ended it (a failure's exception, a skip's reason)."""
    test = _short(nodeid)
    if outcome == "passed":
        return Verdict(test, "PASS")
    if outcome == "skipped":
        return Verdict(test, "SKIP", message.strip().removeprefix("Skipped: "))
    unwritten = UNWRITTEN.search(message)
    if unwritten and "NotImplementedError" in message:
        function = unwritten.group(1)
        return Verdict(test, "FAIL", f"not written yet: {function}", unwritten=function)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0] if lines else "failed (no message)"
    hint = HINT.search(message)
    return Verdict(
        test,
        "FAIL",
        first.removeprefix("AssertionError: "),
        hint=hint.group(1).strip() if hint else "",
    )


def _message(report) -> str:
    """The message of what ended a test: the exception's, or a skip's reason."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[-1])
    return report.longreprtext


class VerdictPrinter:
    """pytest plugin: a verdict for every test (and every file that fails to collect), printed
    the moment it is known."""

    def __init__(self, out=None, part: str | None = None):
        self.out = out or sys.stdout
        self.part = part  # run only this part's tests (None: every part)
        self.verdicts: list[Verdict] = []
        self.collected = 0
        self.parts: dict[str, str] = {}  # test -> its part

    def pytest_configure(self, config) -> None:
        config.addinivalue_line("markers", "part(name): the lab part the test checks")

    def pytest_collection_modifyitems(self, config, items) -> None:
        if self.part is None:
            return
        other = [item for item in items if part_of_test(item) != self.part]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if part_of_test(item) == self.part]

    def _add(self, verdict: Verdict) -> None:
        name = verdict.test.removesuffix(" (teardown)")
        verdict = replace(verdict, part=self.parts.get(name, CORE))
        self.verdicts.append(verdict)
        for line in verdict.lines():
            print(line, file=self.out, flush=True)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            first = _message(report).strip().splitlines() or ["cannot be collected"]
            self._add(Verdict(_short(report.nodeid) or "tests", "FAIL", first[-1]))

    def pytest_collection_finish(self, session) -> None:
        self.collected = len(session.items)
        self.parts = {_short(item.nodeid): part_of_test(item) for item in session.items}

    def pytest_runtest_logreport(self, report) -> None:
        # one verdict per test: its call, or the setup that stopped it; a failed teardown adds one
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self._add(verdict_of(report.nodeid, report.outcome, _message(report)))
        elif report.when == "teardown" and report.failed:
            failed = verdict_of(report.nodeid, "failed", _message(report))
            self._add(Verdict(failed.test + " (teardown)", "FAIL", failed.reason, failed.hint))


def exit_status(verdicts: list[Verdict]) -> int:
    """0: all pass; 1: a test fails for a reason other than unwritten code; 3: only unwritten
    exercises fail."""
    failed = [v for v in verdicts if v.outcome == "FAIL"]
    if any(not v.unwritten for v in failed):
        return 1
    return 3 if failed else 0


def part_lines(verdicts: list[Verdict], parts: dict[str, int]) -> list[str]:
    """One line per part that ran, in the lab's order: passes, fails, or waits for code."""
    lines = []
    for part in [*parts, *sorted({v.part for v in verdicts} - set(parts))]:
        mine = [v for v in verdicts if v.part == part]
        if not mine:
            continue
        status = exit_status(mine)
        word = {0: "PASS", 1: "FAIL", 3: "not written yet"}[status]
        kind = "core" if part == CORE else f"{part} (extension)"
        minutes = f", about {parts[part]} min" if parts.get(part) else ""
        lines.append(f"  {kind}: {word} ({len(mine)} tests{minutes})")
    return lines


def summary(
    name: str,
    impl: str,
    verdicts: list[Verdict],
    parts: dict[str, int] | None = None,
    part: str | None = None,
) -> list[str]:
    """The closing lines: counts, how each part stands, then what to do next (``part``: the one
    part that ran, if one was asked for)."""
    module = f"{impl}/{name}.py"
    parts = parts or {CORE: 0}
    passed = sum(v.outcome == "PASS" for v in verdicts)
    unwritten = sorted({v.unwritten for v in verdicts if v.unwritten})
    failed = sum(v.outcome == "FAIL" and not v.unwritten for v in verdicts)
    lines = [
        f"{name}: {passed} passed, {failed} failed, "
        f"{sum(bool(v.unwritten) for v in verdicts)} waiting for code not written yet "
        f"(tests run on {module})"
    ]
    if len({v.part for v in verdicts}) > 1:
        lines += part_lines(verdicts, parts)
    status = exit_status(verdicts)
    core = [v for v in verdicts if v.part == CORE]
    if status != 0 and core and exit_status(core) == 0:
        lines.append(
            "The core passes: the next notebooks can run on your code. The extensions are yours"
            " to write when you have the time."
        )
    # unwritten functions of earlier exercises the tests ran into, by exercise
    earlier = _earlier_unwritten(name, unwritten) if impl == "labs" and unwritten else {}
    if status == 0:
        what = "this exercise" if part is None else f"part {part}"
        lines.append(f"PASS: every check of {what} passes.")
    elif status == 3:
        own = [f for f in unwritten if not any(f in fs for fs in earlier.values())]
        if own:
            lines.append(
                f"Not written yet in {module}: {', '.join(own)}. Each docstring is the task; "
                f"write them, then run `python -m labs.check {name}` again."
            )
    else:
        lines.append(
            f"FAIL: edit {module} (read the reasons and hints above), then re-run the "
            f"notebook's check cell or `python -m labs.check {name}`."
        )
    lines += [_waiting_on(name, exercise, functions) for exercise, functions in earlier.items()]
    return lines


def _earlier_unwritten(name: str, functions: list[str]) -> dict[str, list[str]]:
    """The unwritten ``functions`` the tests of ``name`` met in earlier exercises, by exercise:
    those still raising the stub's NotImplementedError in ``labs/<earlier>.py`` (read from the
    files) and not in ``labs/<name>.py``."""
    from labs.runtime.impl import builds_on
    from labs.runtime.prerequisites import unwritten

    own = set(unwritten(name))
    out = {}
    for earlier in builds_on(name):
        found = [f for f in functions if f in set(unwritten(earlier)) and f not in own]
        if found:
            out[earlier] = found
    return out


def _waiting_on(name: str, earlier: str, functions: list[str]) -> str:
    """What to do when the tests of ``name`` stop in earlier exercise ``earlier``."""
    from labs.runtime.prerequisites import reference_available

    head = (
        f"Waiting on an earlier exercise, labs/{earlier}.py ({', '.join(functions)} not written"
        " yet):"
    )
    if reference_available(earlier):
        return (
            f"{head} check {name} on its reference with `python -m labs.check {name} --reference"
            f" {earlier}`, or write it (`python -m labs.check {earlier}`)."
        )
    return (
        f"{head} its reference is not in this copy of the course; write it (`python -m"
        f" labs.check {earlier}`), or ask your instructor to reveal it (python -m labs.release"
        f" OUT --reveal {earlier})."
    )


def check(
    name: str,
    impl: str = "labs",
    keyword: str | None = None,
    timeout: float | None = None,
    tests: Path = TESTS,
    reference: str | None = None,
    part: str | None = None,
) -> tuple[int, list[Verdict]]:
    """Run exercise ``name``'s tests (from the folder ``tests``) on ``impl``'s code in this
    process, printing each verdict; returns (exit status, verdicts). ``reference``: exercises
    whose reference stands in for the learner's ("zero,pipeline_parallel"; None: as
    ``LABS_REFERENCE`` says). ``part``: only the tests of that part of the lab (None: all)."""
    import pytest

    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; choose from {', '.join(EXERCISES)}")
    parts = exercise_parts(name, impl)
    if part is not None and part not in parts:
        raise ValueError(
            f"exercise {name!r} has no part {part!r}; its parts: {', '.join(parts)}"
            f" (PARTS in {impl}/{name}.py)"
        )
    if reference is None:
        reference = os.environ.get(REFERENCE_ENV, "")
    chosen = set_reference(reference)
    if name in chosen:
        raise ValueError(
            f"--reference names {name!r}, the exercise being checked: to see the reference pass,"
            " use --impl solutions"
        )
    files = exercise_test_files(name, tests)
    if not files:
        raise ValueError(
            f"no test file covers exercise {name!r} (looked for {tests}/test_{name}*.py)"
        )
    os.environ[IMPL_ENV] = impl  # the tests, and every rank they launch, run this implementation
    args = [*map(str, files), "-m", "exercise", "-p", "no:terminal", "-p", "no:cacheprovider"]
    args += ["-k", keyword] if keyword else []
    args += [f"--timeout={timeout:g}"] if timeout else []
    printer = VerdictPrinter(part=part)
    which = "" if part is None else f", part {part}" + (" (extension)" if part != CORE else "")
    print(
        f"checking {name}{which}: the tests marked exercise in {', '.join(f.name for f in files)}"
    )
    if chosen:
        print(f"with the reference for {', '.join(chosen)} (LABS_REFERENCE)")
    code = pytest.main(args, plugins=[printer])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED or (not printer.verdicts and code == 0):
        if keyword:
            raise ValueError(f"no test of exercise {name!r} matches -k {keyword!r}")
        raise ValueError(f"no test of exercise {name!r} checks part {part!r}")
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):
        raise RuntimeError(f"pytest could not run the tests (exit code {int(code)})")
    if code == pytest.ExitCode.INTERRUPTED:
        printer.verdicts.append(Verdict("(the rest)", "FAIL", "interrupted before the end"))
    return exit_status(printer.verdicts), printer.verdicts


def test_parts(name: str, tests: Path = TESTS) -> dict[str, str]:
    """Exercise ``name``'s tests (its files in ``tests``, marked exercise) -> the part each checks,
    collected by pytest without running any."""
    import pytest

    printer = VerdictPrinter()
    files = exercise_test_files(name, tests)
    args = [*map(str, files), "-m", "exercise", "--collect-only", "-p", "no:terminal"]
    code = pytest.main([*args, "-p", "no:cacheprovider"], plugins=[printer])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise RuntimeError(
            f"pytest could not collect the tests of {name!r} (exit code {int(code)})"
        )
    return printer.parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labs.check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("exercise", choices=EXERCISES, help="the exercise module to check")
    parser.add_argument(
        "--impl",
        choices=IMPLEMENTATIONS,
        default="labs",
        help="whose code the tests run: labs (yours, the default) or solutions (the reference)",
    )
    parser.add_argument(
        "--reference",
        metavar="EX[,EX...]",
        default=None,
        help="run the reference for these earlier exercises alone (default: LABS_REFERENCE)",
    )
    parser.add_argument(
        "--part",
        metavar="NAME",
        help="only the tests of this part of the lab: core, or an extension (PARTS in the module)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the tests of each part and run none"
    )
    parser.add_argument("-k", dest="keyword", help="only tests whose name matches (pytest -k)")
    parser.add_argument("--timeout", type=float, help="seconds per test (default: pyproject's)")
    parser.add_argument(
        "--tests",
        type=Path,
        default=TESTS,
        help="the folder of test files (default: the course's tests/; e.g. hidden_tests/)",
    )
    args = parser.parse_args(argv)
    if args.list:
        parts = exercise_parts(args.exercise, args.impl)
        listed = test_parts(args.exercise, args.tests)
        for part in [*parts, *sorted(set(listed.values()) - set(parts))]:
            if args.part in (None, part):
                kind = "core" if part == CORE else f"{part} (extension)"
                minutes = f", about {parts[part]} min" if parts.get(part) else ""
                names = [test for test, p in listed.items() if p == part]
                print(f"{kind}{minutes}: {len(names)} tests")
                print("\n".join(f"  {test}" for test in names))
        return 0
    try:
        status, verdicts = check(
            args.exercise,
            args.impl,
            args.keyword,
            args.timeout,
            args.tests,
            args.reference,
            args.part,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print()
    parts = exercise_parts(args.exercise, args.impl)
    print("\n".join(summary(args.exercise, args.impl, verdicts, parts, args.part)))
    return status
