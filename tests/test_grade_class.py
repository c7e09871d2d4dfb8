"""Grading a synthetic class (issue 28 item 3, issue 30 items 3 and 5): each exercise graded on its
own with the references of what it builds on standing in, the grades written for Gradescope, Canvas
and Moodle, and what the class got wrong. Apart from tests/test_grade.py (the hostile submissions);
the grading files run in turn on one pytest worker (../conftest.py)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from labs.grade import discover_labs, lms, mistakes
from labs.grade.report import FORMULA_START, Result
from labs.release import build_release
from tests.helpers import ROOT, require_bubblewrap, run_cli

# ---- a synthetic class: each exercise on its own, grades for the LMS, what the class got wrong
# --------------------------------------------------------------------------------------------

CLASS_LABS = ["collectives", "pipeline_parallel", "mesh"]
CLASS_BUGS = {  # student -> the classic mistake planted in their collectives (tests/classic_bugs)
    "adds_not_1": "reduce-scatter overwrites instead of adding",
    "adds_not_2": "reduce-scatter overwrites instead of adding",
    "wrong_chunk": "reduce-scatter sends the chunk it is about to receive",
}


def make_class(root: Path) -> Path:
    """``mesh_without_pp``: the reference for every exercise but pipeline_parallel, left a stub;
    ``stubs``: the release untouched; one student per planted collectives mistake (the rest
    stubs)."""
    from tests.classic_bugs import CATALOG, edited_source

    release = root / "release"
    build_release(release)
    subs = root / "subs"
    for student in ("mesh_without_pp", "stubs", *CLASS_BUGS):
        shutil.copytree(release, subs / student)
    for name in ("collectives", "zero", "tensor_parallel_comm", "tensor_parallel", "mesh"):
        source = (ROOT / "solutions" / f"{name}.py").read_text()
        (subs / "mesh_without_pp" / "labs" / f"{name}.py").write_text(source)
    bugs = {bug.id: bug for bug in CATALOG["collectives"]}
    for student, bug in CLASS_BUGS.items():
        (subs / student / "labs" / "collectives.py").write_text(edited_source(bugs[bug]))
    return subs


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    require_bubblewrap()
    root = tmp_path_factory.mktemp("class")
    subs = make_class(root)
    report = root / "report"
    proc = run_cli(
        "-m",
        "labs.grade",
        str(subs),
        "--out",
        str(report),
        "--labs",
        *CLASS_LABS,
        "--no-notebooks",
        "--jobs",
        "2",
        "--lab-points",
        "12",
        env={"TMPDIR": str(root)},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"report": report, "rows": _rows_by(report / "scores.csv"), "subs": subs}


def _rows_by(path: Path) -> dict[tuple[str, str], dict]:
    with open(path, encoding="utf-8", newline="") as f:
        return {(r["student"], r["lab"]): r for r in csv.DictReader(f)}


@pytest.mark.slow
def test_each_exercise_is_graded_on_its_own(graded_class):
    """A correct mesh beside an unwritten pipeline_parallel: full marks on mesh (the references
    of the exercises mesh builds on stood in, and the feedback says so), none on PP."""
    rows = graded_class["rows"]
    mesh = rows["mesh_without_pp", "mesh"]
    pp = rows["mesh_without_pp", "pipeline_parallel"]
    assert int(mesh["tests_total"]) > 0 and mesh["tests_passed"] == mesh["tests_total"], mesh
    assert int(mesh["hidden_total"]) > 0 and mesh["hidden_passed"] == mesh["hidden_total"], mesh
    assert pp["tests_passed"] == "0" and int(pp["tests_total"]) > 0, pp
    assert float(pp["tests_time_s"]) == 0, pp  # the stub, unchanged: its tests are not run
    assert rows["stubs", "mesh"]["tests_passed"] == "0"
    page = (graded_class["report"] / "mesh_without_pp" / "feedback.md").read_text()
    stand_ins = "zero, tensor_parallel, pipeline_parallel, context_parallel"
    assert f"| mesh | {mesh['tests_passed']}/{mesh['tests_total']} | " in page
    assert f"| - | {stand_ins} |" in page, page[:2000]
    assert "| pipeline_parallel | 0/" in page and "| collectives | " in page
    assert "not run: labs/pipeline_parallel.py is the course's stub, unchanged; write " in page


def validate_gradescope(results: dict) -> None:
    """``results.json`` against Gradescope's published format
    (https://gradescope-autograders.readthedocs.io/en/latest/specs/#output-format): its keys and
    their types, a score at the top or on every test, visibility among the four it knows."""
    top = {
        "score": (int, float),
        "execution_time": (int, float),
        "output": str,
        "output_format": str,
        "test_output_format": str,
        "test_name_format": str,
        "visibility": str,
        "stdout_visibility": str,
        "extra_data": dict,
        "tests": list,
        "leaderboard": list,
    }
    per_test = {
        "score": (int, float),
        "max_score": (int, float),
        "status": str,
        "name": str,
        "name_format": str,
        "number": str,
        "output": str,
        "output_format": str,
        "tags": list,
        "visibility": str,
        "extra_data": dict,
    }
    formats = {"text", "html", "simple_format", "md", "ansi"}
    visibilities = {"hidden", "after_due_date", "after_published", "visible"}
    for key, value in results.items():
        assert key in top, f"results.json: {key!r} is not in Gradescope's format"
        assert isinstance(value, top[key]), f"results.json: {key} is {type(value).__name__}"
    for key in ("visibility", "stdout_visibility"):
        assert results.get(key, "visible") in visibilities, results.get(key)
    assert results.get("output_format", "text") in formats
    tests = results.get("tests", [])
    assert "score" in results or all("score" in t for t in tests), "no score anywhere"
    for test in tests:
        for key, value in test.items():
            assert key in per_test, f"a test's {key!r} is not in Gradescope's format"
            assert isinstance(value, per_test[key]), f"a test's {key} is {type(value).__name__}"
        assert test.get("visibility", "visible") in visibilities, test
        assert test.get("status", "passed") in ("passed", "failed"), test
        assert test.get("output_format", "text") in formats
        assert all(isinstance(tag, str) for tag in test.get("tags", []))
        if "max_score" in test:
            assert 0 <= test["score"] <= test["max_score"] + 1e-9, test


@pytest.mark.slow
def test_grades_reach_gradescope_canvas_and_moodle(graded_class):
    report = graded_class["report"]
    rows = graded_class["rows"]
    students = sorted({student for student, _ in rows})
    for student in students:
        results = json.loads((report / student / "results.json").read_text())
        validate_gradescope(results)
        tests = results["tests"]
        assert abs(results["score"] - sum(t["score"] for t in tests)) < 0.01
        for lab in CLASS_LABS:
            row = rows[student, lab]
            mine = [t for t in tests if t["tags"] == [lab]]
            hidden = [t for t in mine if t["name"].startswith("hidden_tests/")]
            assert len(mine) == int(row["tests_total"]) and len(hidden) == int(row["hidden_total"])
            assert all(t["visibility"] == "after_published" for t in hidden)
            assert all(t["visibility"] == "visible" for t in mine if t not in hidden)
            assert sum(t["status"] == "passed" for t in mine) == int(row["tests_passed"])
            assert abs(sum(t["max_score"] for t in mine) - 12) < 0.01
    failed = [t for t in json.loads((report / "stubs" / "results.json").read_text())["tests"]]
    unwritten = ("NotImplementedError", "is not written yet")
    assert all(t["status"] == "failed" for t in failed)
    assert all(any(mark in t["output"] for mark in unwritten) for t in failed)
    validate_gradebook(report / "gradebook.csv", students, CLASS_LABS, rows, points=12)


def validate_gradebook(path: Path, students, labs, rows, points: float) -> None:
    """``gradebook.csv`` as Canvas's Gradebook import reads it (a header row; Student, ID, SIS
    User ID, SIS Login ID, Section first; one column per assignment after them; numbers) and
    Moodle's CSV grade import (an identifier column, one column per grade item, numbers)."""
    text = path.read_text(encoding="utf-8")
    table = list(csv.reader(text.splitlines()))
    header = table[0]
    assert header[:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"], header
    assert header[5:] == [*labs, "Final Points"], header
    assert len(set(header)) == len(header), "a column name twice"
    body = {row[3]: row for row in table[1:]}
    assert sorted(body) == sorted(students) and len(table) == len(students) + 1
    for student, row in body.items():
        assert len(row) == len(header) and row[0] == student
        scores = [float(cell) for cell in row[5:-1]]
        assert all(0 <= s <= points for s in scores)
        assert abs(float(row[-1]) - sum(scores)) < 0.02
        for lab, score in zip(labs, scores):
            r = rows[student, lab]
            share = points * int(r["tests_passed"]) / int(r["tests_total"])
            assert abs(score - share) < 0.006, (student, lab, score, share)
        assert not any(cell.startswith(FORMULA_START) for cell in row)


@pytest.mark.slow
def test_the_summary_says_what_the_class_got_wrong(graded_class):
    report = graded_class["report"]
    text = (report / "summary.md").read_text()
    section = text.split("## What the class got wrong", 1)[1]
    assert (report / "class_scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![scores per lab](class_scores.png)" in section
    table = [line for line in section.splitlines() if line.startswith("| collectives | ")]
    distribution, mistakes = table[0], table[1:]
    # mesh_without_pp full; the three planted mistakes part; stubs nothing: five students
    assert distribution.split(" | ")[2:-1] == ["1", "3", "0", "0", "1"], distribution
    exact = (
        "| collectives | 3 of 5 | `tests/test_collectives.py::test_integer_all_reduce_is_exact` |"
    )
    assert any(m.startswith(exact) for m in mistakes), mistakes
    assert any(m.startswith("| collectives | 1 of 5 | (unwritten) |") for m in mistakes)
    lines = section.splitlines()
    assert "| pipeline_parallel | 5 of 5 | (unwritten) | `NotImplementedError` |" in "\n".join(
        lines
    )
    assert any(m.startswith("| mesh | 4 of 5 | (unwritten) |") for m in lines), lines


def test_a_lab_names_the_references_that_stand_in_for_its_earlier_exercises(tmp_path):
    from labs.runtime.impl import builds_on

    template = tmp_path / "t"
    build_release(template)
    labs = {lab.name: lab for lab in discover_labs(template)}
    assert labs["mesh"].stand_ins == builds_on("mesh") and "pipeline_parallel" in builds_on("mesh")
    assert labs["tensor_parallel"].stand_ins == ("tensor_parallel_comm",)
    assert labs["collectives"].stand_ins == () and labs["pipeline_parallel"].stand_ins == ()
    chained = discover_labs(template, stand_ins=False)
    assert all(lab.stand_ins == () for lab in chained)


def _class_results() -> tuple[list[Result], dict[str, list[str]]]:
    """Four students on one lab of two public tests and one hidden one: all passed; one mistake
    and a hidden failure; unwritten; not graded."""
    expected = {"ddp": ["tests/t.py::a[2]", "tests/t.py::b", "hidden_tests/h.py::c"]}
    bug = "AssertionError: gradient w at step 1: 2.0 vs 1.0\n"
    bug += "  hint (grads): divide by the world size"
    a, _, c = expected["ddp"]
    rows = [
        Result("ann", "ddp", None, 3, 3, 1, 1),
        Result("bob", "ddp", None, 1, 3, 0, 1, failures=[[a, bug], [c, "AssertionError: secret"]]),
        Result("=cy", "ddp", None, 0, 3, 0, 1),
        Result("dan", "ddp", None, 0, 3, 0, 1, grading_error="grading error: no"),
    ]
    rows[2].failures = [[n, "NotImplementedError: write it"] for n in expected["ddp"]]
    return rows, expected


def test_gradescope_results_follow_its_published_format():
    rows, expected = _class_results()
    for conceal in (False, True):
        out = lms.gradescope_results(
            [rows[1]], expected, lab_points=9, conceal=conceal, headline="1/3"
        )
        validate_gradescope(out)
        json.dumps(out)
        public = [t for t in out["tests"] if t["visibility"] == "visible"]
        assert out["score"] == 3 and [t["status"] for t in public] == ["failed", "passed"]
        assert public[0]["score"] == 0 and public[1]["score"] == public[1]["max_score"] == 3
        hidden = [t for t in out["tests"] if t["visibility"] == "after_published"]
        assert len(hidden) == 1 and hidden[0]["max_score"] == 3 and hidden[0]["score"] == 0
        assert ("secret" in json.dumps(out)) is not conceal
        assert (hidden[0]["name"] == "hidden_tests/h.py::c") is not conceal
    out = lms.gradescope_results([rows[3]], expected, lab_points=9, conceal=False, headline="")
    assert out["score"] == 0 and all(t["output"] == "no" for t in out["tests"])
    with pytest.raises(AssertionError):
        validate_gradescope({"tests": [{"name": "x", "visibility": "after_lunch", "score": 1}]})
    with pytest.raises(AssertionError):
        validate_gradescope({"score": 1, "grade": 2})


def test_the_gradebook_imports_into_canvas_and_moodle(tmp_path):
    rows, _ = _class_results()
    (tmp_path / "gradebook.csv").write_text(lms.gradebook_csv(rows, ["ddp"], lab_points=9))
    table = list(csv.reader((tmp_path / "gradebook.csv").read_text().splitlines()))
    assert table[1][5:] == ["9", "9"] and table[2][5:] == ["3", "3"]
    assert table[3][0] == "'=cy" and table[4][5:] == ["", "0"]  # not graded: empty, not zero
    with pytest.raises(AssertionError):  # the validator is not blind: a gradebook without IDs
        validate_gradebook(tmp_path / "gradebook.csv", ["x"], ["ddp"], {}, points=9)


def test_the_class_summary_counts_mistakes_by_check_with_their_hints(tmp_path):
    rows, _ = _class_results()
    twin = Result("eve", "ddp", None, 1, 3, 0, 1, failures=[list(f) for f in rows[1].failures])
    twin.failures[0][1] = twin.failures[0][1].replace("2.0", "8.0")  # the same mistake
    found = mistakes.common_mistakes([*rows, twin])["ddp"]
    assert [(m.test, len(m.students)) for m in found] == [
        ("hidden_tests/h.py::c", 2),
        ("tests/t.py::a", 2),
    ]
    assert found[1].hints == ["grads: divide by the world size"]
    text = "\n".join(mistakes.summary_lines([*rows, twin], "class_scores.png"))
    row = "| ddp | 2 of 5 | `tests/t.py::a` | `gradient w at step 1: 2.0 vs 1.0` | "
    assert row + "`grads: divide by the world size` |" in text, text
    assert "| ddp | 1 of 5 | (unwritten) |" in text
    assert "| ddp | 33% | 2 | 2 | 0 | 0 | 1 | - |" in text, text  # 100, 33, 0, 0, 33
    assert "![scores per lab](class_scores.png)" in text
    assert mistakes.plot_scores([*rows, twin], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
