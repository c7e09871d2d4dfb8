"""`python -m labs.grade` on synthetic submissions made from the student release.

One grading run (lab 00, short timeouts, small sandbox limits, two students at a time, public and
hidden tests in one pytest as the grader does by default) serves every slow test here. Its
students:

* eight ways a submission goes right or wrong by accident: the reference code (all points), the
  stubs untouched, an infinite loop, ``sys.exit`` or an exception on import, edited tests and
  configuration, reference code that deletes files and leaves a daemon, a missing notebook;
* ``TestHostileSubmissions``: one student per attack of issue 21 and a few more, each built on
  the stubs (so the score it deserves is 0) with the attack appended to its module or notebook.
  The attacks on ``--conceal-hidden``'s separate hidden run are graded with it, in
  tests/test_grade_concealed.py (which runs ``hostile_grading`` too).

The students, their attacks and the grading run are built in tests/grading_harness.py.

The rest checks the pieces without running a submission.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest

from labs.grade import (
    _inside_repository,
    cpu_slots,
    discover_labs,
    notebooks,
    processes,
    sandbox,
    submission,
)
from labs.grade.report import (
    FEEDBACK_LIMIT,
    NOT_ISOLATED,
    Result,
    csv_cell,
    feedback_page,
    md_block,
    md_code,
    write_atomic,
    write_reports,
)
from labs.grade.results import check_id, interleave, read_test_run
from labs.release import build_release
from tests.grading_harness import (
    CSV_NAME,
    DEEP,
    MARK,
    NOTEBOOK,
    TOKEN,
    exited_0_and_left_nothing_changed_or_running,
    feedback,
    hostile_grading,
    item_log,
    markdown_blocks,
    processes_with,
    remove_deep,
    report_texts,
    scores_json,
)
from tests.helpers import ROOT, junit_outcomes, run_cli

# One grading run of some forty submissions serves the slow tests; on a busy 2-core machine it takes
# a quarter of an hour: the first test to use it waits that long (its own timeout is 1800 s)
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    with hostile_grading(tmp_path_factory.mktemp("grading")) as run:
        yield run


# ---- the run as a whole, and the accidents
# --------------------------------------------------------------


@pytest.mark.slow
def test_grading_finishes_and_scores_every_student(graded):
    proc = graded["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = {submission.display(p.name) for p in graded["subs"].iterdir()}
    assert set(graded["rows"]) == expected
    for student, row in graded["rows"].items():
        assert row["lab"] == "collectives" and int(row["tests_total"]) >= 16, row
        assert int(row["hidden_total"]) >= 3, row
        folder = next(
            p.name for p in graded["subs"].iterdir() if submission.display(p.name) == student
        )
        assert student == "scores.csv" or (graded["report"] / folder / "feedback.md").exists()


@pytest.mark.slow
def test_reference_code_gets_every_point_and_runs_its_notebook(graded):
    row = graded["rows"]["correct"]
    assert (
        row["tests_passed"] == row["tests_total"] and row["hidden_passed"] == row["hidden_total"]
    ), row
    assert row["notebook_executed"] == "yes" and row["notebook_detail"] == "ok", row
    assert not row["grading_error"], row
    assert "failed" not in feedback(graded, "correct")
    assert (graded["report"] / "correct" / "notebooks" / NOTEBOOK).exists()
    cost = scores_json(graded)["correct"]  # each item imports torch: more than a CPU second
    assert cost["tests_cpu_s"] > 1 and cost["notebook_cpu_s"] > 1, cost
    total = cost["tests_cpu_s"] + cost["notebook_cpu_s"]
    line = rf"^correct: done in [0-9.]+ s \({total:.0f} CPU-s in its sandboxes\)$"
    assert re.search(line, graded["proc"].stdout, re.M), graded["proc"].stdout[-2000:]
    summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
    assert re.search(rf"^\| `correct` \|.* \| [0-9]+ \| {total:.0f} \|$", summary, re.M), summary


@pytest.mark.slow
def test_untouched_stubs_get_no_points_and_say_what_to_write(graded):
    """The stub, byte for byte, and the course's notebook: the lab is not started. Its tests are not
    run (no log, no time), every one fails saying which functions to write; nor is its notebook
    (``all_raises`` has a cell of its own: its notebook runs, and stops at the stub)."""
    row = graded["rows"]["stubs"]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert row["tests_total"] == graded["rows"]["correct"]["tests_total"], row
    assert float(row["tests_time_s"]) == 0 and float(row["notebook_time_s"]) == 0, row
    assert not (graded["report"] / "stubs" / "logs" / "collectives.tests.log").exists()
    assert not (graded["report"] / "stubs" / "notebooks" / NOTEBOOK).exists()
    assert row["notebook_detail"].startswith(
        "not run, the lab is not started: labs/collectives.py is the course's stub, unchanged; "
    ), row
    text = feedback(graded, "stubs")
    assert "(each raises NotImplementedError until then); the notebook has no code of yours" in text
    said = "not run: labs/collectives.py is the course's stub, unchanged; write "
    [line] = {line for line in text.splitlines() if line.startswith(said)}
    assert "ring_all_reduce" in line and "NotImplementedError" in line, line
    assert "### collectives: hidden checks\n\n0 of 4 passed.\n" in text  # not concealed


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
    assert row["tests_passed"] == "0", row
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
    """Deleting files of the course it is graded in (a test run's course is read-only: nothing
    goes) and leaving a daemon: the daemon is killed, others unaffected."""
    assert graded["left"] == [], "a process the submission started outlived grading"
    assert scores_json(graded)["deletes_and_daemon"]["leftover_processes"] >= 1
    row = graded["rows"]["deletes_and_daemon"]
    assert row["tests_passed"] == row["tests_total"], row
    text = feedback(graded, "deletes_and_daemon")
    assert "process(es) started while grading this lab were still running" in text


@pytest.mark.slow
def test_missing_notebook_costs_the_notebook_only(graded):
    row = graded["rows"]["missing_notebook"]
    assert row["tests_passed"] == row["tests_total"], row
    assert row["notebook_executed"] == "no" and row["notebook_detail"].startswith("missing"), row


@pytest.mark.slow
def test_reports_are_complete_files(graded):
    """scores.csv, scores.json and summary.md are whole (written by rename), nothing temporary is
    left, and summary.md starts with the scorecard (the sandbox was on)."""
    report = graded["report"]
    assert not [p for p in report.iterdir() if p.name.endswith(".tmp")]
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert summary.startswith("# Scorecard") and NOT_ISOLATED not in summary
    assert json.loads((report / "scores.json").read_text())["isolated"] is True


# ---- hostile submissions
# ----------------------------------------------------------------------------------


@pytest.mark.slow
class TestHostileSubmissions:
    """Each attack of issue 21 (and a few more) against the sandboxed grader. For every one:
    the score it deserves (0: each is built on the stubs), nothing outside its sandbox changed
    (the instructor repository, the other submissions, the virtual environment, $HOME, the report
    after the grader exited), no process left, grader exit 0 (``test_the_grader_...``), and the
    reference code beside them still gets every point
    (``test_reference_code_gets_every_point_and_runs_its_notebook``)."""

    def row(self, graded, student):
        row = graded["rows"][student]
        assert row["tests_passed"] == "0" and row["hidden_passed"] == "0", row
        return row

    def test_the_grader_exits_0_and_leaves_nothing_changed_or_running(self, graded):
        exited_0_and_left_nothing_changed_or_running(graded)

    def test_forging_the_results_channel_and_killing_its_session(self, graded):
        """Its lines reach every descriptor it has, the log among them, never the results
        channel (not inherited): the run's results stand, all failed."""
        row = self.row(graded, "- forger")
        assert not row["grading_error"], row
        assert "ATTACK forge" in item_log(graded, "- forger")

    def test_a_pytest_hook_and_patched_comparisons_stay_in_the_rank(self, graded):
        """The rank's pytest and torch are copies: the test process judges with its own."""
        row = self.row(graded, "hook_forger")
        assert "ATTACK hook registered" in item_log(graded, "hook_forger")
        assert not row["grading_error"], row

    def test_reading_the_answers_through_proc_or_the_editable_install(self, graded):
        self.row(graded, "lecteur réponses ü")
        assert "ATTACK answers None" in item_log(graded, "lecteur réponses ü")

    @pytest.mark.parametrize("student", ["labs_to_solutions", "labs_to_classmate"])
    def test_a_labs_folder_linked_to_the_answers_or_a_classmate(self, graded, student):
        self.row(graded, student)
        text = feedback(graded, student)
        assert "`labs` -> `" in text and "not followed" in text
        if student == "labs_to_solutions":
            assert "points outside your folder" in text
        else:
            summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
            assert "`labs` of `labs_to_classmate` is a symlink into `correct`'s folder" in summary

    def test_writing_outside_its_sandbox(self, graded):
        """The instructor repository, hidden_tests/, $HOME, another student's submission and
        feedback, scores.csv, the virtual environment (a .pth) and the grader's plugin on
        PYTHONPATH: every write is refused, and nothing else changed (first test)."""
        self.row(graded, "vandal")
        log = item_log(graded, "vandal")
        assert "ATTACK vandal WROTE" not in log
        assert log.count("ATTACK vandal blocked") >= 10, log[-3000:]
        for path, text in report_texts(graded):
            assert MARK not in text, path
        assert graded["rows"]["correct"]["tests_passed"] == graded["rows"]["correct"]["tests_total"]
        assert graded["rows"]["stubs"]["tests_passed"] == "0"

    def test_a_fork_hopping_daemon_and_tmux_do_not_escape(self, graded):
        row = self.row(graded, "escaper")
        log = item_log(graded, "escaper")
        assert "ATTACK escape tmux" in log and "TMUX in env: False" in log
        assert graded["left"] == []
        with open(graded["report"] / "scores.csv", encoding="utf-8") as f:
            escaper_rows = [r for r in csv.DictReader(f) if r["student"] == "escaper"]
        assert escaper_rows == [row]
        if graded["tmux"]:
            assert graded["after"]["tmux"] == graded["before"]["tmux"] == ["grading"]

    def test_a_malformed_results_line_cannot_even_be_written(self, graded):
        row = self.row(graded, "malformed-\ufffd")
        assert not row["grading_error"], row
        text = feedback(graded, os.fsdecode(b"malformed-\xff"))
        assert "raised KeyError" in text and "'LABS_GRADE_FD'" in text, "the variable is not there"
        assert (graded["report"] / os.fsdecode(b"malformed-\xff") / "feedback.md").exists()

    def test_a_notebook_that_kills_its_runner(self, graded):
        row = self.row(graded, "runner_killer")
        assert row["notebook_executed"] == "no", row
        assert "without a report" in row["notebook_detail"], row
        executed = graded["report"] / "runner_killer" / "notebooks" / NOTEBOOK
        assert not executed.exists(), "the runner was killed: there is no executed notebook"

    def test_raises_exception_on_every_cell_does_not_make_it_executed(self, graded):
        row = self.row(graded, "all_raises")
        assert row["notebook_executed"] == "no", row
        assert "NotImplementedError" in row["notebook_detail"], row
        assert "is not written yet" in row["notebook_detail"], row
        assert float(row["notebook_time_s"]) > 0, row  # it ran

    def test_a_folder_named_scores_csv(self, graded):
        row = graded["rows"]["scores.csv"]
        assert "grading error" in row["grading_error"] and row["tests_passed"] == "0", row
        assert (graded["report"] / "scores.csv").is_file()

    def test_a_folder_1500_deep(self, graded):
        self.row(graded, "deep")
        assert "more than 32 folders deep" in feedback(graded, "deep")

    @pytest.mark.parametrize(
        "student, limit",
        [
            ("memory_bomb", "memory: more than 1.5 GiB"),
            ("disk_bomb", "disk: more than 128 MiB"),
            ("disk_bomb", "file size: a file over 32 MiB"),
            ("fork_bomb", "processes: more than 128"),
        ],
    )
    def test_bombs_stop_at_a_limit_the_feedback_names(self, graded, student, limit):
        self.row(graded, student)
        assert f"**limit hit**: {limit}" in feedback(graded, student)

    def test_an_output_bomb_is_cut(self, graded):
        row = self.row(graded, "output_bomb")
        assert row["notebook_executed"] == "no", row
        folder = graded["report"] / "output_bomb"
        assert (folder / "logs" / "collectives.tests.log").stat().st_size < 300_000
        assert (folder / "notebooks" / NOTEBOOK).stat().st_size < 3_000_000
        text = feedback(graded, "output_bomb")
        printed = re.search(r"your code printed ([0-9.]+) MB", text)
        assert printed and float(printed.group(1)) >= 30, text
        assert "**limit hit**: notebook output" in text

    # ---- issue 29: each attack as the issue describes it

    def public_passed(self, graded, student) -> int:
        row = graded["rows"][student]
        return int(row["tests_passed"]) - int(row["hidden_passed"])

    def test_a_rank_pickling_code_for_its_parent_gains_nothing(self, graded):
        """The bytes are refused where they arrive (no launcher message): its tests fail."""
        row = self.row(graded, "pickler")
        assert not row["grading_error"], row
        # refused as bytes, before anything in them is looked up (labs.runtime.wire)
        assert "sent a result the launcher refused" in feedback(graded, "pickler")

    def test_a_rank_cannot_use_the_results_descriptor_or_the_check_token(self, graded):
        self.row(graded, "fd_forger")
        assert "ATTACK fd: LABS_GRADE_FD=None token=False" in item_log(graded, "fd_forger")

    def test_a_rank_cannot_reach_its_parents_descriptors_memory_or_ptrace(self, graded):
        self.row(graded, "proc_parent")
        log = item_log(graded, "proc_parent")
        assert "ATTACK proc: reached []" in log, log[-3000:]
        for what in ("/proc/ppid/fd", "/proc/ppid/mem", "ptrace"):
            assert f"ATTACK proc: {what} refused" in log, what

    def test_a_lone_surrogate_in_a_message_is_written_escaped(self, graded):
        proc = graded["proc"]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        self.row(graded, "zz_surrogate")
        assert "a lone surrogate: \ufffd, and more" in feedback(graded, "zz_surrogate")

    def test_memory_held_in_a_memfd_counts_against_the_limit(self, graded):
        self.row(graded, "memfd")
        held = [
            int(n) for n in re.findall(r"ATTACK memfd held (\d+) MiB", item_log(graded, "memfd"))
        ]
        assert held and max(held) < 1536, f"held {max(held, default=0)} MiB under a 1.5 GiB limit"
        assert "**limit hit**: memory" in feedback(graded, "memfd")

    def test_calling_torchs_collective_scores_no_public_check(self, graded):
        assert self.public_passed(graded, "torch_collective") == 0, graded["rows"][
            "torch_collective"
        ]

    def test_a_notebook_of_empty_cells_costs_the_grader_little(self, graded):
        """The grader's own time for this student, outside its sandboxed items, is no more than
        for the others (give or take 10 s of a busy machine): a limited child refuses the notebook
        before anything runs. (The grader that parsed it itself spent 155 s more.)"""
        row = self.row(graded, "notebook_bomb")
        assert row["notebook_executed"] == "no" and "more than the 2000" in row["notebook_detail"]
        done = dict(re.findall(r"^(.+): done in ([0-9.]+) s \(", graded["proc"].stdout, re.M))
        rows = scores_json(graded)
        outside = {
            s: float(t) - rows[s]["tests_time_s"] - rows[s]["notebook_time_s"]
            for s, t in done.items()
            if s in rows
        }
        others = sorted(t for s, t in outside.items() if s != "notebook_bomb")
        typical = others[len(others) // 2]
        assert outside["notebook_bomb"] < typical + 10, (outside["notebook_bomb"], typical)

    def test_outputs_updated_in_place_count_against_the_output_cap(self, graded):
        self.row(graded, "display_updates")
        executed = graded["report"] / "display_updates" / "notebooks" / NOTEBOOK
        assert executed.stat().st_size < 3_000_000
        assert "**limit hit**: notebook output" in feedback(graded, "display_updates")

    def test_a_file_name_holding_markdown_stays_one_inline_name(self, graded):
        """Parsed as CommonMark with tables: no HTML, one heading, one table row per student."""
        self.row(graded, "markdown_name")
        for name in ("summary.md", "markdown_name/feedback.md"):
            text = (graded["report"] / name).read_text(encoding="utf-8")
            tokens = markdown_blocks(text)
            assert not [t for t in tokens if t.type.startswith("html")], name
            assert [t.tag for t in tokens if t.type == "heading_open"].count("h1") == 1, name
            inline = " ".join(t.content for t in tokens if t.type == "inline")
            assert "fake" in inline, f"{name}: the name is not shown"
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        tokens = markdown_blocks(summary)
        grid = tokens[: next(i for i, t in enumerate(tokens) if t.type == "table_close")]
        rows = [t for t in grid if t.type == "tr_open"]  # the scorecard, the summary's first table
        assert len(rows) == 1 + len(graded["rows"]), "a table row more or less than students"
        assert "is a symlink into `correct`'s folder" in summary

    def test_no_scores_csv_cell_starts_a_formula(self, graded):
        with open(graded["report"] / "scores.csv", encoding="utf-8", newline="") as f:
            cells = [cell for row in csv.reader(f) for cell in row]
        formulas = [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r") and c != "-"]
        assert formulas == []  # (a lone "-", no notebook, is no formula)
        self.row(graded, CSV_NAME)
        assert "'" + CSV_NAME in cells and "'- forger" in cells

    def test_a_flood_of_symlinks_stays_within_the_reports_budget(self, graded):
        self.row(graded, "link_flood")
        report = graded["report"]
        for path in ("link_flood/feedback.md", "summary.md", "scores.json", "scores.csv"):
            assert (report / path).stat().st_size < 1_000_000, path
        assert "more symlinks" in feedback(graded, "link_flood")

    def test_released_cells_replaced_by_pass_count_as_not_run(self, graded):
        row = self.row(graded, "cells_replaced")
        assert row["notebook_executed"] == "no", row
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        line = next(x for x in summary.splitlines() if "cells" in x and "replaced" in x)
        assert " yes" not in line, line
        assert "changed" in feedback(graded, "cells_replaced")

    def test_identical_and_hard_linked_exercise_files_are_flagged(self, graded):
        self.row(graded, "copycat")
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        assert "`labs/collectives.py` is identical in: `- forger`, `copycat`" in summary
        assert "`labs/collectives.py` is one file hard-linked in: `- forger`, `copycat`" in summary
        assert "`labs/collectives.py` is identical to the reference solution in:" in summary


# ---- the pieces, without running submissions
# -------------------------------------------------------------------------


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
            "--tb=line",  # a line per failure: the outcomes are what this reads
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


def test_labs_are_discovered_from_the_course(tmp_path):
    template = tmp_path / "t"
    build_release(template)
    (template / "hidden_tests").mkdir()
    (template / "hidden_tests" / "test_collectives_hidden.py").write_text("")
    (template / "tests" / "test_extra_checks.py").write_text(
        'pytestmark = pytest.mark.exercise\nexercise("collectives")\n'
    )
    labs = {lab.name: lab for lab in discover_labs(template)}
    lab = labs["collectives"]
    assert lab.notebook == NOTEBOOK
    assert lab.test_files == (
        "tests/test_collectives.py",
        "tests/test_extra_checks.py",
        "hidden_tests/test_collectives_hidden.py",
    )
    released = {p.name for p in (template / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert {lab.notebook for lab in labs.values()} - {None} == released, (
        "every released notebook is graded"
    )


def unwritten_stub(path: Path) -> bytes:
    """A stub as ``labs.stubs`` writes one: ``f`` raises that it is not written yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        'def f():\n    raise NotImplementedError("exercise f is not written yet: see 00.ipynb")\n'
    )
    return path.read_bytes()


def test_hidden_tests_share_the_public_pytest_unless_concealed(tmp_path, monkeypatch):
    """Without --conceal-hidden a lab's public and hidden tests run in one pytest (one interpreter
    less per lab), the hidden ones counted apart; with it, the hidden tests run on their own."""
    import types

    import labs.grade as grade
    from labs.grade.processes import Finished
    from labs.grade.results import TestRun

    public, hidden = "tests/test_x.py::test_a", "hidden_tests/test_x_hidden.py::test_b"
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_x_hidden.py").write_text("")
    runs = []

    def fake_run(session, item, argv_for, **kw):
        layout = types.SimpleNamespace(course="/c")
        runs.append((argv_for(layout), sorted(p.name for p in item.rglob("test_*.py"))))
        return Finished(0, None, False, 1.0, 0, None, b"", False, 0)

    def fake_read(results, graded, token, why, overflow):
        return TestRun(passed=list(graded))

    monkeypatch.setattr(grade, "run_sandboxed", fake_run)
    monkeypatch.setattr(grade, "read_test_run", fake_read)
    monkeypatch.setattr(grade, "_new_item", lambda *a: Path(tempfile.mkdtemp(dir=tmp_path)))
    lab = grade.Lab("x", None, ("tests/test_x.py", "hidden_tests/test_x_hidden.py"), ())
    for conceal, expected_runs in ((False, 1), (True, 2)):
        runs.clear()
        args = types.SimpleNamespace(
            conceal_hidden=conceal,
            no_notebooks=True,
            lab_timeout=100.0,
            test_timeout=10.0,
            max_timeouts=3,
        )
        session = types.SimpleNamespace(
            expected={"x": [public, hidden]},
            args=args,
            release=tmp_path,  # labs/x.py: the stub (unwritten_stub)
            hidden=tmp_path / "hidden",
            token="t",
            lock=threading.Lock(),
            quiet=True,
            sandbox=types.SimpleNamespace(
                limits=sandbox.Limits(),
                layout=lambda item: types.SimpleNamespace(course="/c", tools="/t"),
            ),
        )
        unwritten_stub(tmp_path / "labs" / "x.py")
        student = types.SimpleNamespace(shown="ann", modules={"x": b"def f():\n    return 1\n"})
        monkeypatch.setattr(grade, "_say", lambda *a: None)
        res = grade._grade_lab(session, student, lab, tmp_path, None)
        assert len(runs) == expected_runs, (runs, res.grading_error)
        assert (res.tests_passed, res.tests_total, res.hidden_passed, res.hidden_total) == (
            2,
            2,
            1,
            1,
        )
        files = [f for argv, _ in runs for f in argv if f.endswith(".py")]
        assert files == ["tests/test_x.py", "hidden_tests/test_x_hidden.py"], files
        copied = [names for _, names in runs]
        # the hidden file reaches only the run that has the hidden tests
        assert copied == ([["test_x_hidden.py"]] if not conceal else [[], ["test_x_hidden.py"]])


def test_a_stub_left_unchanged_is_not_run_and_a_changed_one_is(tmp_path):
    """The stub byte for byte, or no module at all: the lab is not started (its tests are not run,
    and each says which functions to write); a single byte changed and it is. A notebook-only row
    has no module to start."""
    import types

    import labs.grade as grade

    stub = unwritten_stub(tmp_path / "labs" / "x.py")
    session = types.SimpleNamespace(release=tmp_path)
    lab = grade.Lab("x", None, ("tests/test_x.py",), ())

    def why(**modules):
        return grade.not_started(session, types.SimpleNamespace(modules=modules), lab)

    assert why(x=stub) == (
        "labs/x.py is the course's stub, unchanged; write f "
        "(each raises NotImplementedError until then)"
    )
    assert why().startswith("your submission has no labs/x.py that could be read")
    assert why(x=stub.replace(b"\n", b"\r\n")) == why(x=stub)  # git's Windows line endings
    assert why(x=stub + b"\n") == why(x=stub.replace(b"raise", b"return")) == ""
    notebook_only = grade.Lab("12_x", "12_x.ipynb", ())
    assert grade.not_started(session, types.SimpleNamespace(modules={}), notebook_only) == ""


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
    assert "secret" not in page and "hidden checks\n\n0 of 1 passed (their names" in page
    assert "ValueError: bad" in page and "`pytest.ini`" in page and "0/3 checks passed" in page


def test_every_string_a_submission_controls_is_escaped_for_its_format():
    assert csv_cell('=HYPERLINK("x","y")') == '\'=HYPERLINK("x","y")'
    assert [csv_cell(x) for x in ("+1", "-1", "@a", "\tx", "ok")] == [
        "'+1",
        "'-1",
        "'@a",
        "\\tx",
        "ok",
    ]
    assert csv_cell("a\udcffb\nc") == "a\ufffdb\\nc"
    name = "x`\n\n| fake |\n# Scorecard\n<!--"
    tokens = markdown_blocks(
        f"* {md_code(name)}\n\n| a |\n|---|\n| {md_code(name, table=True)} |\n"
    )
    assert [t.type for t in tokens if t.type.endswith("_open")] == [
        "bullet_list_open", "list_item_open", "paragraph_open", "table_open", "thead_open",
        "tr_open", "th_open", "tbody_open", "tr_open", "td_open",
    ]  # fmt: skip
    block = md_block("line\n```\n</pre><!--\n```` x")
    assert block[0] == block[-1] == "`````" and markdown_blocks("\n".join(block))[0].type == "fence"


def test_a_lone_surrogate_or_a_flood_cannot_stop_the_reports(tmp_path):
    r = Result("ann\udcff", "collectives", "00.ipynb", failures=[["tests/t.py::a", "bad \udcff"]])
    r.notes = ["x" * 1000] * 2000
    page = feedback_page("ann\udcff", [r], [], {"graded_at": "now", "commit": "\udcff"})
    assert len(page) <= FEEDBACK_LIMIT + 200 and "the grader cut this page" in page
    write_atomic(tmp_path / "feedback.md", page)
    write_reports(tmp_path, [r], {"graded_at": "now", "commit": None}, ["`a` \udcff"])
    assert (
        "bad \ufffd"
        in json.loads((tmp_path / "scores.json").read_text())["results"][0]["failures"][0][1]
    )
    assert "ann\ufffd" in (tmp_path / "summary.md").read_text(encoding="utf-8")


def test_the_guards_lines_are_read_apart_and_say_what_was_refused():
    raw = _stream(GRADED, ["passed", "failed", "passed"])
    guard = json.dumps({"guard": "import of `labs.ddp`", "during": GRADED[1]}).encode()
    lines = raw.split(b"\n")
    run = read_test_run(b"\n".join([lines[0], guard, *lines[1:]]), GRADED, "check_x", "not run")
    assert run.problem is None and run.passed == [GRADED[0], GRADED[2]]
    assert run.guarded == [f"import of `labs.ddp` (during {GRADED[1]})"]
    bad = raw.replace(b'"outcome": "failed"', b'"outcome": "LEAK-subgroup_case"', 1)
    run = read_test_run(bad, GRADED, "check_x", "not run")
    assert "LEAK" not in run.problem and "has an outcome that is none of" in run.problem


def test_the_cores_of_each_job():
    assert cpu_slots(1, [0, 1]) == [{0, 1}]
    assert cpu_slots(2, [0, 1]) == [{0}, {1}]
    assert cpu_slots(2, [0, 1, 2, 3, 4]) == [{0, 1, 2}, {3, 4}]
    assert cpu_slots(3, [0, 1]) == [{0}, {1}, {0}]  # more jobs than cores: shared (warned)


BURN_IN_A_GRANDCHILD = """
import subprocess, sys
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
subprocess.run([sys.executable, "-c", burn], check=True)
"""


def test_the_sandbox_init_counts_the_cpu_time_of_the_item_and_of_what_it_reaped(tmp_path):
    """The CPU-s the grader prints per lab and student come from the sandbox's init (inside.py):
    an item whose child burns 0.5 s of CPU reports at least that, and not much more (two
    interpreters' start); a report without the figure (the init was killed) counts as unknown."""
    read_end, write_end = os.pipe()
    spec = {
        "sandboxed": False,
        "copy": [],
        "mkdir": [],
        "cwd": str(tmp_path),
        "argv": [sys.executable, "-I", "-S", "-c", BURN_IN_A_GRANDCHILD],
        "limits": sandbox.Limits().rlimits(),
        "watch_memory": False,
        "poll_s": 0.05,
        "status_fd": write_end,
        "results_fd": None,
    }
    inside = ROOT / "labs" / "grade" / "inside.py"
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", str(inside), json.dumps(spec)],
            pass_fds=(write_end,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as status:
        report = json.loads(status.readline())
    assert proc.returncode == 0 and report["exit"] == 0, (proc.stderr, report)
    assert 0.5 <= processes._cpu(report) < 2.0, report
    assert processes._cpu({}) is None and processes._cpu({"cpu_s": "1"}) is None


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_seccomp_filter_refuses_what_it_says(tmp_path):
    program = sandbox.seccomp_filter(("sched_setaffinity", "memfd_create", "shmget"))
    if program is None:
        pytest.skip("no seccomp program for this architecture")
    read_end, write_end = os.pipe()
    os.write(write_end, program)
    os.close(write_end)
    code = (
        "import ctypes, os\n"
        "for f, a in ((os.sched_setaffinity, (0, {0})), (os.memfd_create, ('x',))):\n"
        "    try:\n        f(*a); print('allowed')\n"
        "    except OSError as e:\n        print(e.errno)\n"
        "print(ctypes.CDLL(None, use_errno=True).shmget(0, 4096, 0o1600), ctypes.get_errno())\n"
        "print(os.getpid() > 0)\n"
    )
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--dev", "/dev"]
    proc = subprocess.run(
        [*argv, "--seccomp", str(read_end), sys.executable, "-I", "-S", "-c", code],
        pass_fds=(read_end,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.close(read_end)
    assert proc.stdout.split() == ["1", "1", "-1", "1", "True"], proc.stderr


def _record(nodeid, when, outcome="passed", message=""):
    record = {"nodeid": nodeid, "when": when, "outcome": outcome, "message": message}
    return json.dumps({**record, "duration": 0.1}) + "\n"


def _stream(tests, outcomes, cut=""):
    """A results channel as the plugin writes it: the tests of ``GRADED`` collected, then
    ``tests`` run with ``outcomes[i]`` in their call, each followed by its check, failing."""
    lines = [json.dumps({"collected": interleave(GRADED, "check_x")}) + "\n"]
    for i, (nodeid, outcome) in enumerate(zip(tests, outcomes)):
        for test, result in ((nodeid, outcome), (check_id(nodeid, "check_x", i), "failed")):
            lines += [_record(test, "setup"), _record(test, "call", result, "boom")]
            lines += [_record(test, "teardown")]
    return ("".join(lines) + cut).encode()


GRADED = ["tests/t.py::a", "tests/t.py::TestB::b[x::y]", "tests/u.py::c"]


def test_an_honest_results_channel_is_read_test_by_test():
    assert check_id(GRADED[1], "check_x", 1) == "tests/t.py::TestB::check_x_1"
    raw = _stream(GRADED, ["passed", "failed", "passed"])
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.problem is None and run.passed == [GRADED[0], GRADED[2]]
    assert run.failed == {GRADED[1]: "boom"}
    cut = _stream(GRADED[:2], ["passed", "passed"], cut='{"nodeid": "tests/u.py::c')
    run = read_test_run(cut, GRADED, "check_x", "not run: killed")
    assert run.problem is None and run.passed == GRADED[:2]
    assert run.failed == {GRADED[2]: "not run: killed"}


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda raw: raw + _record(GRADED[0], "call").encode(), "comes after the last"),
        (lambda raw: raw.replace(b'"outcome": "failed"', b'"outcome": "passed"'), "check"),
        (lambda raw: raw.replace(b', "outcome": "passed"', b"", 1), "not a test report"),
        (lambda raw: raw.replace(b"\n", b"\nnot json\n", 2), "is not JSON"),
        (lambda raw: b'{"collected": []}\n' + raw, "collected other tests"),
    ],
)
def test_a_tampered_results_channel_counts_nothing(tamper, why):
    raw = tamper(_stream(GRADED, ["passed", "passed", "passed"]))
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.passed == [] and why in run.problem
    assert all(message.startswith("not counted") for message in run.failed.values())


def test_a_test_passed_before_a_run_ends_counts_only_once_its_check_failed():
    raw = _stream(GRADED[:1], ["passed"])
    raw += (_record(GRADED[1], "setup") + _record(GRADED[1], "call")).encode()
    raw += _record(GRADED[1], "teardown").encode()
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.passed == GRADED[:1]
    assert "before the grader's check" in run.failed[GRADED[1]]


def _released_notebook() -> dict:
    nb = nbformat.v4.new_notebook()
    for i, source in enumerate(["a = 1", "raise ValueError('allowed')", "b = a + 1"]):
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = f"cell{i}"
        nb.cells.append(cell)
    nb.cells[1].metadata["tags"] = ["raises-exception"]
    return json.loads(nbformat.writes(nb))


def test_a_notebook_runs_with_the_releases_tags_matched_by_cell_id():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    mine.cells[0].metadata["tags"] = ["raises-exception"]  # a tag the student added: ignored
    mine.cells[1].metadata["tags"] = []  # a tag the student removed: restored
    mine.cells[2].source = "b = a + 1  # mine\n"  # a comment and a newline: the same code
    extra = nbformat.v4.new_code_cell("print('mine')")
    extra.metadata["tags"] = ["raises-exception", "skip-execution"]
    mine.cells.insert(1, extra)
    prepared, nb = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.problems == [] and prepared.changed == 0 and prepared.own_code == 1
    as_released, _ = notebooks.prepare(
        nbformat.writes(nbformat.from_dict(released)).encode(), released
    )
    assert as_released.own_code == 0  # the course's code only: a lab with its stub is not started
    tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
    assert tags == [[], [], ["raises-exception"], []]
    nbformat.validate(nbformat.from_dict(nb))  # what the runner reads
    ran = {"cell": 3, "ran": {0: True, 1: True, 2: False, 3: True}, "malformed": None}
    report = {**ran, "end": {"end": "ok", "ename": "", "evalue": "", "cut": 0}}
    assert notebooks.judge(prepared, report) == (True, "ok")
    report["ran"][3] = False  # a cell the release does not allow to raise
    assert notebooks.judge(prepared, report)[0] is False


def test_a_notebook_missing_a_released_cell_or_not_a_notebook():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    del mine.cells[2]
    prepared, _ = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.problems == [
        "cell 3 (`b = a + 1`) of the course's notebook is not in yours (cells are matched by id)"
    ]
    for junk in (b"{not json", b"\xff\xfe", b"[" * 100_000, b'{"cells": [1]}'):
        prepared, nb = notebooks.prepare(junk, released)
        assert nb is None and not prepared.runnable
        assert prepared.problems[0].startswith("the notebook cannot be parsed")
    report, _ = notebooks.read_report(b'{"cell": 0}\n{"end": "ok"\n')
    assert report["malformed"] == "line 2"


def test_a_released_cell_replaced_by_pass_is_changed_so_the_notebook_did_not_run():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    mine.cells[2].source = "pass"
    prepared, nb = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.changed == 1 and prepared.runnable
    assert prepared.problems == [
        "cell 3 (`b = a + 1`) of the course's notebook was changed in yours: the course's cells "
        "must run as released (your own code goes in cells of your own)"
    ]
    ran = {"cell": 2, "ran": {0: True, 1: False, 2: True}, "malformed": None}
    report = {**ran, "end": {"end": "ok", "ename": "", "evalue": "", "cut": 0}}
    assert notebooks.judge(prepared, report)[0] is False


def test_a_huge_notebook_is_refused_by_a_limited_child_in_little_time(tmp_path):
    released = tmp_path / "released.ipynb"
    released.write_text(json.dumps(_released_notebook()))
    mine = tmp_path / "mine.ipynb"
    cell = '{"cell_type": "code", "id": "c%07d", "metadata": {}, "outputs": [], "source": ""}'
    mine.write_text('{"cells": [' + ",".join(cell % i for i in range(200_000)) + "]}")
    t0 = time.perf_counter()
    prepared = notebooks.prepare_limited(str(mine), str(released), str(tmp_path / "out.ipynb"))
    assert time.perf_counter() - t0 < 30
    assert not prepared.runnable and "more than the 2000 graded" in prepared.problems[0]
    fine = tmp_path / "fine.ipynb"
    fine.write_text(json.dumps(_released_notebook()))
    prepared = notebooks.prepare_limited(str(fine), str(released), str(tmp_path / "out.ipynb"))
    assert prepared.runnable and prepared.problems == [] and prepared.required[1] == (1, True)
    assert json.loads((tmp_path / "out.ipynb").read_text())["cells"][1]["id"] == "cell1"


def test_a_submission_is_read_without_following_links_or_recursing(tmp_path):
    folder = tmp_path / "ann"
    (folder / "labs").mkdir(parents=True)
    (folder / "labs" / "ddp.py").write_text("x = 1\n")
    (folder / "labs" / "zero.py").symlink_to(ROOT / "solutions" / "zero.py")
    (folder / "notebooks").symlink_to("../bob/notebooks")
    (folder / "inside").symlink_to("labs/ddp.py")
    deep = folder / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(DEEP):
        os.mkdir("d", dir_fd=fd)
        fd_next = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = fd_next
    os.close(fd)
    try:
        found = submission.scan(folder)
        assert list(found.files) == ["labs/ddp.py"]
        assert found.not_looked_at == [
            "deep/" + "d/" * (submission.MAX_DEPTH - 2) + "d/ (more than 32 folders deep)"
        ]
        notes = submission.link_notes(found.links, folder)
        assert any("`labs/zero.py` -> `/" in n and "outside" in n for n in notes)
        assert any("`notebooks` -> `../bob/notebooks`" in n and "outside" in n for n in notes)
        assert any("`inside` -> `labs/ddp.py`" in n and "inside your folder" in n for n in notes)
        assert submission.read_file(folder, "labs/ddp.py")[0] == b"x = 1\n"
        for rel in ("labs/zero.py", "notebooks/00.ipynb", "inside", "labs/none.py"):
            with pytest.raises(submission.Unreadable):
                submission.read_file(folder, rel)
    finally:
        remove_deep(deep)


def test_reports_are_replaced_whole(tmp_path):
    target = tmp_path / "scores.csv"
    target.write_text("old\n")
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["scores.csv"]


DAEMON_SCRIPT = """
import subprocess, sys, time
from labs.grade.processes import become_subreaper, descendants, kill_leftovers
assert become_subreaper()
# a child that starts a daemon in its own session and exits: the daemon is re-parented to us
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen("
                "[sys.executable, '-c', 'import time; time.sleep(60)', '%s'], "
                "start_new_session=True)"])
time.sleep(0.5)
print(len(descendants()), kill_leftovers(), len(descendants()))
"""


def test_a_daemon_comes_back_to_the_grader_and_is_killed():
    proc = run_cli("-c", DAEMON_SCRIPT % TOKEN, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1", "0"], proc.stdout
    assert processes_with(TOKEN) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--out", "{tmp}/r"], "is not a folder"),
        (["{tmp}", "--out", "{tmp}/r"], "must not contain each other"),
        (["{subs}", "--out", str(ROOT / "labs" / "r")], "inside the course repository's labs/"),
        (["{subs}", "--out", "{tmp}/r", "--labs", "nope"], "--labs: unknown ['nope']; choose from"),
        (["{subs}", "--out", "{tmp}/r", "--cell-timeout", "0"], "--cell-timeout must be > 0"),
        (["{subs}", "--out", "{tmp}/r", "--memory-limit", "0"], "memory_gib=0.0 must be > 0"),
        (
            ["{subs}", "--out", "{tmp}/r", "--jobs", "2", "--unsafe-no-sandbox"],
            "--jobs > 1 needs the sandbox",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, args, message):
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    args = [a.format(missing=tmp_path / "nope", tmp=tmp_path, subs=tmp_path / "subs") for a in args]
    proc = run_cli("-m", "labs.grade", *args, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (ROOT / "labs" / "r").exists()


def test_a_report_folder_of_its_own_may_be_inside_the_repository():
    """The README's `--out report/` from the repository root; not inside a folder of the course."""
    assert _inside_repository(ROOT / "report") is None
    assert _inside_repository(ROOT.parent / "elsewhere") is None
    assert "labs/" in _inside_repository(ROOT / "labs" / "r")
    assert "is the course repository itself" in _inside_repository(ROOT)


def test_without_bubblewrap_the_grader_refuses(tmp_path):
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    proc = run_cli(
        "-m",
        "labs.grade",
        str(tmp_path / "subs"),
        "--out",
        str(tmp_path / "r"),
        env={"PATH": str(Path(sys.executable).parent)},  # no bwrap on it
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "bubblewrap (bwrap) is not installed" in proc.stderr
    assert "--unsafe-no-sandbox" in proc.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_without_a_sandbox_the_report_says_so_first(tmp_path):
    """--unsafe-no-sandbox: the summary's first line says nothing was isolated. (The one student
    is a folder named scores.csv, a grading error, so no submission code runs.)"""
    subs = tmp_path / "subs"
    (subs / "scores.csv").mkdir(parents=True)
    proc = run_cli(
        "-m",
        "labs.grade",
        str(subs),
        "--out",
        str(tmp_path / "r"),
        "--labs",
        "collectives",
        "--unsafe-no-sandbox",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.splitlines()[0] == NOT_ISOLATED
    assert "Nothing was isolated" in proc.stderr
    assert json.loads((tmp_path / "r" / "scores.json").read_text())["isolated"] is False


def test_a_virtual_environment_under_tmp_stays_visible_in_the_sandbox(tmp_path, monkeypatch):
    # bubblewrap mounts in order: a clone under /tmp has its .venv there, and the sandbox's
    # private /tmp must not cover it (bwrap: execvp /tmp/.../.venv/bin/python: no such file)
    venv = Path("/tmp/clone/.venv")
    monkeypatch.setattr(sandbox, "python_prefixes", lambda: [venv])
    box = sandbox.Sandbox(tmp_path, sandbox.Limits(), isolated=True, hide=[])
    argv = box.command(
        tmp_path / "item", ["true"], cwd="/tmp", results_fd=None, status_fd=3, info_fd=None
    )
    private_tmp = max(i for i, a in enumerate(argv) if a == "--tmpfs" and argv[i + 1] == "/tmp")
    venv_bind = argv.index(str(venv))
    assert argv[venv_bind - 1] == "--ro-bind" and private_tmp < venv_bind
