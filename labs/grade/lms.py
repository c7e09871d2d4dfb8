"""Grades where instructors keep them: Gradescope's autograder ``results.json`` per student and a
gradebook CSV that Canvas and Moodle import.

Points: each lab is worth ``lab_points`` (``--lab-points``, 10 by default), shared equally by its
tests (public and hidden); a lab's score is ``lab_points * passed / total``. The notebook earns no
points (it is reported beside them), as in ``scores.csv``.

``<student>/results.json``: Gradescope's format
(https://gradescope-autograders.readthedocs.io/en/latest/specs/, "Output format"):

==================  ========================================================================
``score``           the student's points, all labs
``execution_time``  seconds of grading (tests and notebooks)
``output``          one line, the feedback page's headline (``output_format``: ``text``)
``visibility``      ``visible``; ``stdout_visibility``: ``hidden``
``tests``           one entry per test: ``name`` (its node id), ``number`` (lab.test),
                    ``score``, ``max_score``, ``status`` (``passed``/``failed``), ``output``
                    (the failure's message), ``tags`` (the lab), ``visibility``: ``visible``
                    for public tests, ``after_published`` for hidden ones; with
                    ``--conceal-hidden`` one entry per lab for its hidden tests (how many passed,
                    no names), also ``after_published``; per notebook an entry of 0 points saying
                    whether it ran to the end
==================  ========================================================================

``gradebook.csv``: one row per student, UTF-8, a header row, then::

    Student,ID,SIS User ID,SIS Login ID,Section,collectives,ddp,...,Final Points

Canvas (Grades > Import) matches a row to a student by ``ID``, ``SIS User ID`` or ``SIS Login
ID`` (the student's folder name goes in ``SIS Login ID``: name the folders by login) and reads
every other column after ``Section`` as an assignment, creating those it does not have; it ignores
its read-only ``Final Points``. Moodle (Grades > Import > CSV file) asks which column identifies
the user (map ``SIS Login ID`` to username) and which column goes to which grade item (map each
lab, ignore the rest). Cells are numbers with at most two decimals, or empty when a student could
not be graded (not a zero: a grading error is the instructor's to look at), and no cell starts a
formula (``report.csv_cell``).
"""

from __future__ import annotations

import csv
import io
import re

from labs.grade.report import HIDDEN, Result, csv_cell, cut, printable

GRADESCOPE_VISIBILITY = ("hidden", "after_due_date", "after_published", "visible")
GRADEBOOK_IDENTITY = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
GRADEBOOK_TOTAL = "Final Points"  # a read-only column of Canvas's own export: ignored on import
OUTPUT_LIMIT = 8000  # characters of one test's output


def lab_score(r: Result, lab_points: float) -> float:
    """The lab's points: ``lab_points`` shared by its tests, for those passed."""
    return round(lab_points * r.tests_passed / r.tests_total, 2) if r.tests_total else 0.0


def gradescope_results(
    results: list[Result],
    expected: dict[str, list[str]],
    *,
    lab_points: float,
    conceal: bool,
    headline: str,
) -> dict:
    """One student's ``results.json`` (see the module docstring); ``expected``: lab -> the node
    ids of its graded tests, public and hidden."""
    tests = []
    for r in results:
        graded = expected.get(r.lab, [])
        each = lab_points / len(graded) if graded else 0.0
        failed = dict((nodeid, message) for nodeid, message in r.failures)
        why = r.grading_error.removeprefix("grading error: ")
        hidden = [n for n in graded if n.startswith(HIDDEN)]
        for i, nodeid in enumerate(n for n in graded if not (conceal and n.startswith(HIDDEN))):
            passed = _passed(nodeid, r, failed)
            message = failed.get(nodeid, why if not passed else "")
            tests.append(
                {
                    "name": printable(nodeid, newlines=False),
                    "number": f"{r.lab}.{i + 1}",
                    "score": round(each, 4) if passed else 0.0,
                    "max_score": round(each, 4),
                    "status": "passed" if passed else "failed",
                    "output": cut(printable(message), OUTPUT_LIMIT),
                    "tags": [r.lab],
                    "visibility": "after_published" if nodeid.startswith(HIDDEN) else "visible",
                }
            )
        if conceal and hidden:
            tests.append(
                {
                    "name": f"{r.lab}: hidden tests",
                    "number": f"{r.lab}.hidden",
                    "score": round(each * r.hidden_passed, 4),
                    "max_score": round(each * len(hidden), 4),
                    "status": "passed" if r.hidden_passed == len(hidden) else "failed",
                    "output": f"{r.hidden_passed} of {len(hidden)} hidden tests passed",
                    "tags": [r.lab],
                    "visibility": "after_published",
                }
            )
        if r.notebook_executed in ("yes", "no"):
            tests.append(
                {
                    "name": f"{r.lab}: notebooks/{r.notebook} runs to the end",
                    "number": f"{r.lab}.notebook",
                    "score": 0.0,
                    "max_score": 0.0,
                    "status": "passed" if r.notebook_executed == "yes" else "failed",
                    "output": cut(printable(r.notebook_detail), OUTPUT_LIMIT),
                    "tags": [r.lab, "notebook"],
                    "visibility": "visible",
                }
            )
    return {
        "score": round(sum(lab_score(r, lab_points) for r in results), 2),
        "execution_time": round(sum(r.seconds for r in results)),
        "output": printable(headline),
        "output_format": "text",
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def _passed(nodeid: str, r: Result, failed: dict) -> bool:
    """Whether test ``nodeid`` passed: every test not passed is in the failures (with why it did
    not run), unless the whole row is a grading error with nothing passed."""
    return nodeid not in failed and not (r.grading_error and r.tests_passed == 0)


def gradebook_csv(results: list[Result], labs: list[str], *, lab_points: float) -> str:
    """``gradebook.csv`` (see the module docstring): one row per student, in ``results``'s
    order."""
    rows = io.StringIO(newline="")
    writer = csv.writer(rows)
    writer.writerow([*GRADEBOOK_IDENTITY, *[_column(lab) for lab in labs], GRADEBOOK_TOTAL])
    for student in dict.fromkeys(r.student for r in results):
        mine = {r.lab: r for r in results if r.student == student}
        cells = []
        for lab in labs:
            r = mine.get(lab)
            graded = r is not None and not (r.grading_error and r.tests_passed == 0)
            cells.append(_number(lab_score(r, lab_points)) if graded else "")
        total = sum(float(c) for c in cells if c)
        name = csv_cell(student, 200)
        writer.writerow([name, "", "", name, "", *cells, _number(total)])
    return rows.getvalue()


def _column(lab: str) -> str:
    """A lab's column: its name, never one Canvas reads as an assignment's id (``Name (123)``)."""
    return re.sub(r"\s*\((\d+)\)$", r" [\1]", csv_cell(lab, 100))


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if value else "0"
