"""What grading produces: one ``Result`` per student and lab, written as a CSV scorecard, a Markdown
summary, a JSON dump, and a feedback page per student.

Every file is written whole to a temporary name and renamed into place (``write_atomic``), after
each student: a run that is interrupted keeps every row it finished, and a reader never sees half
a file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CSV_FIELDS = (
    "student",
    "lab",
    "tests_passed",
    "tests_total",
    "hidden_passed",
    "hidden_total",
    "notebook",
    "notebook_executed",
    "notebook_detail",
    "tests_time_s",
    "notebook_time_s",
    "grading_error",
)
MAX_QUOTED_LINES = 25
NOT_ISOLATED = (
    "**Nothing was isolated:** graded with `--unsafe-no-sandbox`, so every submission's code ran "
    "as the grader's user with the whole machine in reach; do not trust these scores for code you "
    "do not trust."
)


@dataclass
class Result:
    """One student's result on one lab (or on a notebook-only row)."""

    student: str
    lab: str
    notebook: str | None
    tests_passed: int = 0
    tests_total: int = 0  # tests marked exercise, public + hidden
    hidden_passed: int = 0
    hidden_total: int = 0
    failures: list = field(default_factory=list)  # [nodeid, message] per public test not passed
    tests_time_s: float = 0.0
    notebook_executed: str = "-"  # yes / no / "-" (no notebook, or notebooks not run)
    notebook_detail: str = ""  # ok, or what stopped it (status: cell N `source`: error)
    notebook_time_s: float = 0.0
    cells_changed: int = 0  # code cells of the released notebook not in the student's verbatim
    leftover_processes: int = 0  # processes still running after the item ended (killed)
    notes: list = field(default_factory=list)  # limits hit, output cut: one line each
    grading_error: str = ""  # "grading error: ..." when the grader could not grade this lab


def _quote(text: str) -> list[str]:
    lines = text.rstrip().splitlines() or [""]
    cut = lines[:MAX_QUOTED_LINES] + (["[...]"] if len(lines) > MAX_QUOTED_LINES else [])
    return ["```", *[line.replace("```", "'''") for line in cut], "```"]


def _failed_checks(r: Result, conceal: bool) -> list[str]:
    """Failed tests, grouped by message (a stub fails every test the same way: say it once)."""
    by_message: dict[str, list[str]] = {}
    for nodeid, message in r.failures:
        if conceal and nodeid.startswith("hidden_tests/"):
            continue
        by_message.setdefault(message, []).append(nodeid)
    lines = []
    for message, nodeids in by_message.items():
        lines += ["* **failed**: " + ", ".join(f"`{n}`" for n in nodeids), ""]
        lines += _quote(message) + [""]
    if conceal and r.hidden_total:
        lines += [
            f"* **hidden checks**: {r.hidden_passed} of {r.hidden_total} passed "
            "(their names and messages are not shown)",
            "",
        ]
    return lines


def feedback_page(
    student: str,
    results: list[Result],
    ignored: list[str],
    meta: dict,
    conceal: bool = False,
    notes: list[str] = (),
) -> str:
    """The Markdown page a student gets: the score per lab, then every failed check with its
    message."""
    passed = sum(r.tests_passed for r in results)
    total = sum(r.tests_total for r in results)
    ran = sum(r.notebook_executed == "yes" for r in results)
    notebooks = sum(r.notebook_executed != "-" for r in results)
    lines = [
        f"# Feedback for {student}",
        "",
        f"Graded {meta['graded_at']} against the course at commit {meta['commit'] or 'unknown'}: "
        f"**{passed}/{total} checks passed, {ran}/{notebooks} notebooks ran to the end.**",
        "",
        *[f"{note}\n" for note in notes],
        "| lab | checks passed | notebook | ran to the end |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r.lab} | {r.tests_passed}/{r.tests_total} | {r.notebook or '-'} | "
        f"{r.notebook_executed} |"
        for r in results
    ]
    for r in results:
        quiet = not (r.failures or r.leftover_processes or r.cells_changed or r.notes)
        if quiet and r.notebook_executed != "no" and not r.grading_error and not r.hidden_total:
            continue
        section = _failed_checks(r, conceal)
        if r.grading_error:
            section += [f"* **{r.grading_error}**", ""]
        if r.notebook_executed == "no":
            section += [f"* **notebook** `notebooks/{r.notebook}` did not run to the end:", ""]
            section += _quote(r.notebook_detail) + [""]
        if r.cells_changed:
            section.append(
                f"* {r.cells_changed} code cell(s) of the course's notebook are not in yours "
                "unchanged."
            )
        if r.leftover_processes:
            section.append(
                f"* {r.leftover_processes} process(es) started while grading this lab were still "
                "running at its end (left by your code, or by a run stopped for time); the "
                "grader killed them."
            )
        section += [f"* {note}" for note in r.notes]
        if section:
            lines += ["", f"## {r.lab}", "", *section]
    if ignored:
        lines += [
            "",
            "## Files not graded",
            "",
            "These files differ from the course release; grading used the course's copies "
            "(only `labs/<exercise>.py` and the notebooks are taken from a submission):",
            "",
        ]
        lines += [f"* `{name}`" for name in ignored[:50]]
        lines += [f"* ... and {len(ignored) - 50} more"] if len(ignored) > 50 else []
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def write_reports(report: Path, results: list[Result], meta: dict, copies: list[str] = ()) -> None:
    """``scores.csv`` (one row per student and lab), ``scores.json`` (everything), ``summary.md`` (a
    grid, then the exercise files that look copied)."""
    rows = io.StringIO(newline="")
    writer = csv.DictWriter(rows, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for r in results:
        writer.writerow(
            {
                **asdict(r),
                "notebook": r.notebook or "",
                "notebook_detail": (r.notebook_detail.splitlines() or [""])[0][:200],
                "tests_time_s": f"{r.tests_time_s:.1f}",
                "notebook_time_s": f"{r.notebook_time_s:.1f}",
                "grading_error": r.grading_error[:300],
            }
        )
    write_atomic(report / "scores.csv", rows.getvalue())
    dump = {**meta, "results": [asdict(r) for r in results], "copies": list(copies)}
    write_atomic(report / "scores.json", json.dumps(dump, indent=1))
    labs = list(dict.fromkeys(r.lab for r in results))
    lines = [NOT_ISOLATED, ""] if not meta.get("isolated", True) else []
    lines += [
        "# Scorecard",
        "",
        f"Graded {meta['graded_at']}, course commit {meta['commit'] or 'unknown'}. "
        "Each cell: checks passed/total, then whether the notebook ran to the end.",
        "",
        "| student | " + " | ".join(labs) + " | time (s) |",
        "|---" * (len(labs) + 2) + "|",
    ]
    for student in dict.fromkeys(r.student for r in results):
        mine = {r.lab: r for r in results if r.student == student}
        cells = [
            f"{mine[lab].tests_passed}/{mine[lab].tests_total} {mine[lab].notebook_executed}"
            + (" (grading error)" if mine[lab].grading_error else "")
            if lab in mine
            else "-"
            for lab in labs
        ]
        seconds = sum(r.tests_time_s + r.notebook_time_s for r in mine.values())
        lines.append(f"| {_cell(student)} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    if copies:
        lines += ["", "## Exercise files that look copied", ""]
        lines += [f"* {line}" for line in copies]
    write_atomic(report / "summary.md", "\n".join(lines) + "\n")
