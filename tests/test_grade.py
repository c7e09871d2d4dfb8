"""`python -m labs.grade` on synthetic submissions made from the student release.

Eight students, one per way a submission goes right or wrong: the reference code (all points), the
stubs untouched (no points, no crash), an infinite loop, ``sys.exit`` on import, an exception on
import, edited tests (and conftest, pytest config, runtime) with the stubs, reference code that
deletes files and leaves a daemon running, and a missing notebook. One grading run
(collectives lab, short timeouts) serves every test of the slow part; the rest checks the pieces
without running anything.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from labs.grade import discover_labs
from labs.grading.report import Result, feedback_page
from labs.release import build_release
from tests.helpers import ROOT, junit_outcomes, run_cli

TOKEN = f"labs-grade-orphan-{uuid.uuid4().hex[:12]}"
INFINITE = "\n\ndef ring_all_reduce(tensor, group=None):\n    while True:\n        pass\n"
EXITS = "\nimport sys\nsys.exit(0)\n"
RAISES = '\nraise RuntimeError("this module is broken on purpose")\n'
VANDAL = f'''
import pathlib, shutil, subprocess, sys
_here = pathlib.Path(__file__).resolve().parents[1]
if not (_here / ".spawned").exists():  # once per graded copy: a daemon in its own session
    (_here / ".spawned").touch()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{TOKEN}"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
shutil.rmtree(_here / "tests", ignore_errors=True)
shutil.rmtree(_here / "hidden_tests", ignore_errors=True)
'''
CHEAT_TEST = "import pytest\n\npytestmark = pytest.mark.exercise\n\n\ndef test_ring_all_reduce():\n    pass\n"
CHEAT_CONFTEST = """import os
import pytest
os.environ["LABS_IMPL"] = "solutions"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
REWRITES_TESTS = """
import pathlib
for _f in (pathlib.Path(__file__).resolve().parents[1] / "tests").glob("test_*.py"):
    _f.write_text("def test_nothing():\\n    pass\\n")
"""


def make_submissions(root: Path) -> Path:
    """A student release under ``root/release`` and one folder per synthetic student under
    ``root/subs``."""
    release = root / "release"
    build_release(release)
    solution = (ROOT / "solutions" / "collectives.py").read_text()
    stub = (release / "labs" / "collectives.py").read_text()
    subs = root / "subs"
    modules = {
        "correct": solution,
        "stubs": None,
        "infinite_loop": solution + INFINITE,
        "sys_exit": solution + EXITS,
        "import_error": stub + RAISES,
        "edits_tests": stub + REWRITES_TESTS,
        "deletes_and_daemon": solution + VANDAL,
        "missing_notebook": solution,
    }
    for student, module in modules.items():
        shutil.copytree(release, subs / student)
        if module is not None:
            (subs / student / "labs" / "collectives.py").write_text(module)
    cheat = subs / "edits_tests"
    (cheat / "tests" / "test_collectives.py").write_text(CHEAT_TEST)
    (cheat / "conftest.py").write_text(CHEAT_CONFTEST)
    (cheat / "pytest.ini").write_text("[pytest]\naddopts = -p no:labs_grade_plugin\n")
    (cheat / "hidden_tests").mkdir()
    (cheat / "hidden_tests" / "test_collectives_hidden.py").write_text(CHEAT_TEST)
    impl = cheat / "labs" / "runtime" / "impl.py"
    impl.write_text(impl.read_text().replace('os.environ.get(IMPL_ENV, "labs")', '"solutions"'))
    (subs / "missing_notebook" / "notebooks" / "00_setup_and_collectives.ipynb").unlink()
    return subs


def snapshot(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def orphans() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and TOKEN.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


INSTRUCTOR_FILES = [
    "labs/collectives.py",
    "tests/test_collectives.py",
    "notebooks/00_setup_and_collectives.ipynb",
    "hidden_tests/test_collectives_hidden.py",
    "conftest.py",
    "labs/runtime/impl.py",
]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading")
    subs = make_submissions(root)
    before = snapshot(subs)
    instructor = {rel: (ROOT / rel).read_bytes() for rel in INSTRUCTOR_FILES}
    listing = sorted(p.name for p in (ROOT / "hidden_tests").iterdir() if p.name != "__pycache__")
    proc = run_cli(
        "-m",
        "labs.grade",
        str(subs),
        "--out",
        str(root / "report"),
        "--labs",
        "collectives",
        "--test-timeout",
        "10",
        "--cell-timeout",
        "20",
        "--notebook-timeout",
        "120",
        "--lab-timeout",
        "180",
        timeout=1800,
    )
    rows = {}
    if (root / "report" / "scores.csv").exists():
        with open(root / "report" / "scores.csv") as f:
            rows = {row["student"]: row for row in csv.DictReader(f)}
    yield {
        "proc": proc,
        "rows": rows,
        "report": root / "report",
        "subs": subs,
        "before": before,
        "instructor": instructor,
        "listing": listing,
        "orphans": orphans(),
    }
    # only if the grader failed to; test_deleting_files_and_leaving_a_daemon_is_contained says so
    for pid in orphans():
        os.kill(pid, signal.SIGKILL)


def feedback(graded, student) -> str:
    return (graded["report"] / student / "feedback.md").read_text()


def scores_json(graded) -> dict:
    return {
        r["student"]: r
        for r in json.loads((graded["report"] / "scores.json").read_text())["results"]
    }


@pytest.mark.slow
def test_grading_finishes_and_scores_every_student(graded):
    proc = graded["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(graded["rows"]) == sorted(p.name for p in graded["subs"].iterdir())
    for student, row in graded["rows"].items():
        assert row["lab"] == "collectives" and int(row["tests_total"]) >= 16, row
        assert int(row["hidden_total"]) >= 3, row
        assert (graded["report"] / student / "feedback.md").exists()


@pytest.mark.slow
def test_reference_code_gets_every_point_and_runs_its_notebook(graded):
    row = graded["rows"]["correct"]
    assert (
        row["tests_passed"] == row["tests_total"] and row["hidden_passed"] == row["hidden_total"]
    ), row
    assert row["notebook_executed"] == "yes" and row["notebook_detail"] == "ok", row
    assert "failed" not in feedback(graded, "correct")
    assert (graded["report"] / "correct" / "notebooks" / "00_setup_and_collectives.ipynb").exists()


@pytest.mark.slow
def test_untouched_stubs_get_no_points_and_say_what_to_write(graded):
    row = graded["rows"]["stubs"]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert "NotImplementedError" in row["notebook_detail"]
    assert "exercise ring_all_reduce is not written yet" in feedback(graded, "stubs")


@pytest.mark.slow
def test_infinite_loop_costs_the_time_budget_once(graded):
    row = graded["rows"]["infinite_loop"]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert row["notebook_detail"].startswith("cell-timeout"), row
    text = feedback(graded, "infinite_loop")
    assert "Timeout (>10.0s)" in text and "earlier tests of this lab timed out" in text
    assert float(row["tests_time_s"]) < 100, (
        "after 2 timeouts the other tests must fail without running"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "student, message",
    [("sys_exit", "SystemExit"), ("import_error", "this module is broken on purpose")],
)
def test_exit_or_exception_on_import_gets_no_points(graded, student, message):
    row = graded["rows"][student]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert message in feedback(graded, student)


@pytest.mark.slow
def test_edited_tests_config_and_runtime_are_ignored(graded):
    row = graded["rows"]["edits_tests"]
    assert row["tests_passed"] == "0", row
    ignored = feedback(graded, "edits_tests").split("## Files not graded")[1]
    for rel in (
        "tests/test_collectives.py",
        "conftest.py",
        "pytest.ini",
        "hidden_tests/test_collectives_hidden.py",
        "labs/runtime/impl.py",
    ):
        assert f"`{rel}`" in ignored, rel


@pytest.mark.slow
def test_deleting_files_and_leaving_a_daemon_is_contained(graded):
    """Deleting files in its graded copy and leaving a daemon: the daemon is killed, others
    unaffected."""
    assert graded["orphans"] == [], "a process the submission started outlived grading"
    assert scores_json(graded)["deletes_and_daemon"]["leftover_processes"] >= 1
    text = feedback(graded, "deletes_and_daemon")
    assert "process(es) started while grading this lab were still running" in text
    students = sorted(graded["rows"])
    after = students[students.index("deletes_and_daemon") + 1 :]
    assert after, "this student should not be graded last"
    assert all(
        int(graded["rows"][s]["tests_total"]) == int(graded["rows"]["correct"]["tests_total"])
        for s in after
    )


@pytest.mark.slow
def test_missing_notebook_costs_the_notebook_only(graded):
    row = graded["rows"]["missing_notebook"]
    assert row["tests_passed"] == row["tests_total"], row
    assert row["notebook_executed"] == "no" and row["notebook_detail"].startswith("missing"), row


@pytest.mark.slow
def test_grading_writes_nothing_into_submissions_or_the_course(graded):
    assert snapshot(graded["subs"]) == graded["before"]
    for rel, content in graded["instructor"].items():
        assert (ROOT / rel).read_bytes() == content, f"grading changed {rel}"
    assert (
        sorted(p.name for p in (ROOT / "hidden_tests").iterdir() if p.name != "__pycache__")
        == graded["listing"]
    )


@pytest.mark.slow
def test_hidden_tests_pass_on_the_solutions_and_fail_on_the_stubs(tmp_path):
    """The honesty rule of tests/test_stubs.py, for the tests students never see."""
    for impl, expect in (("solutions", "passed"), ("labs", "failed")):
        report = tmp_path / f"{impl}.xml"
        run_cli(
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-m",
            "exercise",
            "--timeout",
            "120",
            f"--junitxml={report}",
            "hidden_tests",
            env={"LABS_IMPL": impl},
            timeout=900,
        )
        outcomes = junit_outcomes(report)
        assert outcomes, "no hidden test ran"
        for name, outcome in outcomes.items():
            outcome = "failed" if outcome in ("failure", "error") else outcome
            assert outcome == expect, f"LABS_IMPL={impl}: {name} {outcome}"


# ---- without running submissions
# ---------------------------------------------------------------------------


def test_labs_are_discovered_from_the_course(tmp_path):
    template = tmp_path / "t"
    build_release(template)
    (template / "hidden_tests").mkdir()
    (template / "hidden_tests" / "test_collectives_hidden.py").write_text("")
    (template / "tests" / "test_extra_checks.py").write_text('exercise("collectives")\n')
    labs = {lab.name: lab for lab in discover_labs(template)}
    lab = labs["collectives"]
    assert lab.notebook == "00_setup_and_collectives.ipynb"
    assert lab.test_files == (
        "tests/test_collectives.py",
        "tests/test_extra_checks.py",
        "hidden_tests/test_collectives_hidden.py",
    )
    released = {p.name for p in (template / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert {lab.notebook for lab in labs.values()} - {None} == released, (
        "every released notebook is graded"
    )


def test_feedback_groups_identical_failures_and_can_conceal_hidden_tests():
    r = Result(
        "ann",
        "collectives",
        "00.ipynb",
        tests_total=3,
        hidden_total=1,
        notebook_executed="no",
        notebook_detail="error in cell 3: ValueError: bad",
        failures=[
            ["tests/t.py::a", "NotImplementedError: x"],
            ["tests/t.py::b", "NotImplementedError: x"],
            ["hidden_tests/h.py::secret_name", "AssertionError: secret detail"],
        ],
    )
    page = feedback_page(
        "ann", [r], ["pytest.ini"], {"graded_at": "now", "commit": "abc"}, conceal=True
    )
    assert page.count("NotImplementedError: x") == 1 and "`tests/t.py::a`, `tests/t.py::b`" in page
    assert "secret" not in page and "hidden check 3" in page
    assert "ValueError: bad" in page and "`pytest.ini`" in page and "0/3 checks passed" in page


DAEMON_SCRIPT = """
import subprocess, sys, time
from labs.grading.processes import become_subreaper, descendants, kill_leftovers
assert become_subreaper()
# a child that starts a daemon in its own session and exits: the daemon is re-parented to us
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(60)', '%s'], start_new_session=True)"])
time.sleep(0.5)
print(len(descendants()), kill_leftovers(), len(descendants()))
"""


def test_a_daemon_comes_back_to_the_grader_and_is_killed():
    proc = run_cli("-c", DAEMON_SCRIPT % TOKEN, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1", "0"], proc.stdout
    assert orphans() == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--out", "{tmp}/r"], "is not a folder"),
        (["{tmp}", "--out", "{tmp}/r"], "must not contain each other"),
        (["{subs}", "--out", str(ROOT / "labs" / "r")], "inside the course repository"),
        (["{subs}", "--out", "{tmp}/r", "--labs", "nope"], "--labs: unknown ['nope']; choose from"),
        (["{subs}", "--out", "{tmp}/r", "--cell-timeout", "0"], "--cell-timeout must be > 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, args, message):
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    args = [a.format(missing=tmp_path / "nope", tmp=tmp_path, subs=tmp_path / "subs") for a in args]
    proc = run_cli("-m", "labs.grade", *args, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (ROOT / "labs" / "r").exists()
