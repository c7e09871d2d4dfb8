"""`python -m labs.grade --conceal-hidden`: the hidden tests in a pytest of their own, of which a
student learns only how many passed.

Two grading runs, in a file of their own (the grading files run in turn: ../conftest.py):

* the reference, the stubs and the attacks on the concealed run (``CONCEALED_RUN``), with the
  checks every hostile student gets there: the score it deserves, nothing outside its sandbox
  changed, no process left, the grader exits 0;
* one student spinning 30 processes beside the reference (``--jobs 2`` on this machine's cores).
"""

from __future__ import annotations

import base64
import csv
import re
import shutil
import time

import pytest

from labs.release import build_release
from tests.grading_harness import (
    HIDDEN_SECRET,
    NOTEBOOK,
    SPINNER,
    exited_0_and_left_nothing_changed_or_running,
    feedback,
    hostile_grading,
    report_texts,
    scores_json,
)
from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def concealed(tmp_path_factory):
    with hostile_grading(tmp_path_factory.mktemp("concealed"), concealed=True) as run:
        yield run


def row(concealed, student) -> dict:
    """``student``'s row, which must score nothing (each is built on the stubs)."""
    found = concealed["rows"][student]
    assert found["tests_passed"] == "0" and found["hidden_passed"] == "0", found
    return found


@pytest.mark.slow
def test_the_grader_exits_0_and_leaves_nothing_changed_or_running(concealed):
    exited_0_and_left_nothing_changed_or_running(concealed)


@pytest.mark.slow
def test_the_reference_gets_every_point_and_the_stubs_none(concealed):
    correct = concealed["rows"]["correct"]
    assert int(correct["hidden_total"]) >= 3, correct
    assert correct["tests_passed"] == correct["tests_total"], correct
    assert correct["hidden_passed"] == correct["hidden_total"] and not correct["grading_error"]
    row(concealed, "stubs")
    text = feedback(concealed, "stubs")
    assert "not run: labs/collectives.py is the course's stub, unchanged; write " in text
    assert "ring_all_reduce" in text
    assert "### collectives: hidden checks\n\n0 of 4 passed (their names" in text


@pytest.mark.slow
def test_hidden_tests_do_not_leak_through_failure_messages(concealed):
    row(concealed, "leaker")
    assert "LOOT" in feedback(concealed, "leaker"), "the attack did not run"
    assert not (concealed["report"] / "leaker" / "logs" / "collectives.hidden.log").exists()
    for path, text in report_texts(concealed):
        assert HIDDEN_SECRET not in text, path
        assert "test_ring_all_reduce_on_a_subgroup" not in text, path
        for run in re.findall(r"[A-Za-z0-9+/]{100,}", text):
            decoded = base64.b64decode(run[: len(run) // 4 * 4])
            assert HIDDEN_SECRET.encode() not in decoded, path
    for line in feedback(concealed, "leaker").splitlines():
        assert len(line) < 1200, "a failure message longer than the grader's bound"


@pytest.mark.slow
def test_a_concealed_hidden_run_quotes_nothing_it_wrote(concealed):
    row(concealed, "hidden_outcome")
    for path, text in report_texts(concealed):
        assert "LEAK-" not in text, path


@pytest.mark.slow
def test_a_concealed_hidden_run_does_not_say_how_many_processes_it_left(concealed):
    row(concealed, "hidden_leftover")
    assert scores_json(concealed)["hidden_leftover"]["leftover_processes"] == 0
    assert "process(es)" not in feedback(concealed, "hidden_leftover")


# ---- one student spinning the CPU beside the reference: --jobs 2 on this machine's cores
# ----

INTERFERENCE_OPTIONS = [
    "--labs",
    "collectives",
    "--jobs",
    "2",
    "--conceal-hidden",
    "--test-timeout",
    "30",
    "--cell-timeout",
    "60",
    "--notebook-timeout",
    "150",
    "--lab-timeout",
    "90",  # the spinner's tests spin until this; the reference's tests and notebook (16 s alone,
    # 37 s in the busy suite, measured) run beside them, start to end, with room to spare
]


@pytest.fixture(scope="module")
def interference(tmp_path_factory):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    root = tmp_path_factory.mktemp("interference")
    release = root / "release"
    build_release(release)
    subs = root / "subs"
    shutil.copytree(release, subs / "correct")
    (subs / "correct" / "labs" / "collectives.py").write_bytes(
        (ROOT / "solutions" / "collectives.py").read_bytes()
    )
    shutil.copytree(release, subs / "spinner")
    stub = (release / "labs" / "collectives.py").read_text()
    (subs / "spinner" / "labs" / "collectives.py").write_text(stub + SPINNER)
    # No notebook: it would spin for another cell timeout after the reference is done, on a core
    # the rest of the suite needs (92 s measured), and prove nothing the tests' spinning does not.
    (subs / "spinner" / "notebooks" / NOTEBOOK).unlink()
    report = root / "report"
    t0 = time.perf_counter()
    proc = run_cli(
        "-m", "labs.grade", str(subs), "--out", str(report), *INTERFERENCE_OPTIONS, timeout=1800
    )
    with open(report / "scores.csv", encoding="utf-8") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    return {"proc": proc, "rows": rows, "seconds": time.perf_counter() - t0}


@pytest.mark.slow
def test_a_student_spinning_30_processes_does_not_slow_the_one_beside_it(interference):
    proc = interference["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = interference["rows"]["correct"]
    assert row["tests_passed"] == row["tests_total"], row
    assert row["notebook_executed"] == "yes", row
    spinner = interference["rows"]["spinner"]
    assert spinner["tests_passed"] == "0"
    # both started at once (--jobs 2): the reference was graded, tests and notebook, while the
    # spinner's processes spun
    reference_s = float(row["tests_time_s"]) + float(row["notebook_time_s"])
    assert reference_s < float(spinner["tests_time_s"]), (row, spinner)
