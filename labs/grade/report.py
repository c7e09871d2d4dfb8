"""What grading produces: one ``Result`` per student and lab, written as a CSV scorecard, a Markdown
summary, a JSON dump, and a feedback page per student.

Every file is written whole to a temporary name and renamed into place (``write_atomic``), after
each student: a run that is interrupted keeps every row it finished, and a reader never sees half
a file.

Every string a submission controls (a folder or file name, a symlink's target, a failure message,
a notebook cell's code or error, a commit it claims) is treated as data, escaped for the format it
goes into:

=========  =====================================================================================
any file   valid UTF-8: a lone surrogate (``"\\udcff"``) becomes U+FFFD; control characters other
           than a message's newlines are shown as ``\\xNN`` (``printable``)
CSV        one line per cell; a cell that would start with ``= + - @`` (or a tab or carriage
           return) gets a leading ``'``, so a spreadsheet never reads it as a formula (``csv_cell``)
Markdown   a name is one inline code span whose fence is longer than any run of backticks in it,
           ``|`` escaped in tables (``md_code``); a message is a fenced block whose fence is longer
           than any run of backticks in it (``md_block``): neither can end early, open a block,
           a heading, a table row, a link or an HTML comment
JSON       ``json.dumps`` of the cleaned strings
=========  =====================================================================================

And every report has a budget per student: a name is cut at ``NAME_LIMIT`` characters, a
feedback page at ``FEEDBACK_LIMIT``, the summary lists a bounded number of lines per student.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
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
HIDDEN = "hidden_tests/"  # where a hidden test's node id starts
NAME_LIMIT = 200  # characters of a name (file, folder, symlink target) as a report shows it
FEEDBACK_LIMIT = 512_000  # characters of one student's feedback page
JSON_STRING_LIMIT = 5000  # characters of one string in scores.json
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet cell a formula
NOT_ISOLATED = (
    "**Nothing was isolated:** graded with `--unsafe-no-sandbox`, so every submission's code ran "
    "as the grader's user with the whole machine in reach; do not trust these scores for code you "
    "do not trust."
)
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NEWLINES = re.compile("\r\n|\n")


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
    tests_time_s: float = 0.0  # public tests, and hidden ones unless concealed
    notebook_executed: str = "-"  # yes / no / "-" (no notebook, or notebooks not run)
    notebook_detail: str = ""  # ok, or what stopped it (status: cell N `source`: error)
    notebook_time_s: float = 0.0
    # CPU seconds (user + sys) of the items' processes, counted as the time is; what a student costs
    tests_cpu_s: float = 0.0
    notebook_cpu_s: float = 0.0
    cells_changed: int = 0  # code cells of the released notebook not in the student's as released
    leftover_processes: int = 0  # processes still running after the item ended (killed)
    notes: list = field(default_factory=list)  # limits hit, output cut: one Markdown line each
    grading_error: str = ""  # "grading error: ..." when the grader could not grade this lab
    stand_ins: list = field(default_factory=list)  # earlier exercises run from the reference

    @property
    def seconds(self) -> float:
        """Wall time of the lab's items: its tests and its notebook."""
        return self.tests_time_s + self.notebook_time_s

    @property
    def cpu_seconds(self) -> float:
        """CPU time of the lab's items: its tests and its notebook."""
        return self.tests_cpu_s + self.notebook_cpu_s


# ---- escaping
# -------------------------------------------------------------------------------------------


def _show(match: re.Match) -> str:
    char = match.group()
    if "\ud800" <= char <= "\udfff":
        return "\ufffd"
    return f"\\u{ord(char):04x}" if ord(char) > 0xFF else f"\\x{ord(char):02x}"


def printable(text, *, newlines: bool = True) -> str:
    """``text`` as valid UTF-8 with no control characters: lone surrogates become U+FFFD, other
    control characters ``\\xNN``; newlines are kept (``newlines``) or shown as ``\\n``."""
    text = str(text)
    if not newlines:
        text = _NEWLINES.sub("\\\\n", text).replace("\t", "\\t")
    else:
        text = _NEWLINES.sub("\n", text)
    return _UNPRINTABLE.sub(_show, text)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def md_code(text, *, limit: int = NAME_LIMIT, table: bool = False) -> str:
    """``text`` as one Markdown inline code span, whatever it holds."""
    text = cut(printable(text, newlines=False), limit) or " "
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    if table:
        text = text.replace("|", "\\|")
    return f"{fence}{pad}{text}{pad}{fence}"


def md_block(text, *, max_lines: int = MAX_QUOTED_LINES) -> list[str]:
    """``text`` as the lines of a fenced Markdown code block, whatever it holds."""
    lines = printable(text).rstrip().split("\n") or [""]
    cut_lines = lines[:max_lines] + (["[...]"] if len(lines) > max_lines else [])
    longest = max((len(run) for run in re.findall("`+", "\n".join(cut_lines))), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *cut_lines, fence]


def csv_cell(text, limit: int = 300) -> str:
    """One line, never read as a formula by a spreadsheet."""
    text = cut(printable(text, newlines=False), limit)
    return "'" + text if text.startswith(FORMULA_START) else text


def _clean_json(value):
    if isinstance(value, str):
        return cut(printable(value), JSON_STRING_LIMIT)
    if isinstance(value, dict):
        return {_clean_json(k): _clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_json(v) for v in value]
    return value


# ---- the feedback page
# ----------------------------------------------------------------------------------


def _grouped(failures: list) -> list[str]:
    """Failed tests, grouped by message (a stub fails every test the same way: say it once)."""
    by_message: dict[str, list[str]] = {}
    for nodeid, message in failures:
        by_message.setdefault(message, []).append(nodeid)
    lines = []
    for message, nodeids in by_message.items():
        lines += ["* **failed**: " + ", ".join(md_code(n, limit=300) for n in nodeids), ""]
        lines += md_block(message) + [""]
    return lines


def _failed_checks(r: Result, conceal: bool) -> list[str]:
    """The public tests that failed, then the hidden tests in a section of their own: how many
    passed, and (unless concealed) each failure with its message."""
    public = [f for f in r.failures if not f[0].startswith(HIDDEN)]
    hidden = [f for f in r.failures if f[0].startswith(HIDDEN)]
    lines = _grouped(public)
    if not r.hidden_total:
        return lines
    lines += [f"### {r.lab}: hidden checks", ""]
    if conceal:
        return lines + [
            f"{r.hidden_passed} of {r.hidden_total} passed (their names and messages are not "
            "shown)",
            "",
        ]
    lines += [f"{r.hidden_passed} of {r.hidden_total} passed.", ""]
    return lines + _grouped(hidden)


def feedback_page(
    student: str,
    results: list[Result],
    ignored: list[str],
    meta: dict,
    conceal: bool = False,
    notes: list[str] = (),
) -> str:
    """The Markdown page a student gets: the score per lab, then every failed check with its
    message. ``notes`` are Markdown lines the grader built (names in them already escaped)."""
    passed = sum(r.tests_passed for r in results)
    total = sum(r.tests_total for r in results)
    ran = sum(r.notebook_executed == "yes" for r in results)
    notebooks = sum(r.notebook_executed != "-" for r in results)
    commit = md_code(meta["commit"] or "unknown")
    lines = [
        f"# Feedback for {md_code(student)}",
        "",
        f"Graded {meta['graded_at']} against the course at commit {commit}: "
        f"**{passed}/{total} checks passed, {ran}/{notebooks} notebooks ran to the end.**",
        "",
        *[f"{printable(note, newlines=False)}\n" for note in notes],
        "| lab | checks passed | notebook | ran to the end | reference standing in for |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.lab} | {r.tests_passed}/{r.tests_total} | {r.notebook or '-'} | "
        f"{r.notebook_executed} | {', '.join(r.stand_ins) or '-'} |"
        for r in results
    ]
    if any(r.stand_ins for r in results):
        lines += [
            "",
            "Each exercise is graded on its own: where a lab builds on earlier exercises, the "
            "course's reference for them stood in for yours (last column), so a mistake in an "
            "earlier exercise costs its own lab only.",
        ]
    for r in results:
        quiet = not (r.failures or r.leftover_processes or r.cells_changed or r.notes)
        if quiet and r.notebook_executed != "no" and not r.grading_error and not r.hidden_total:
            continue
        section = _failed_checks(r, conceal)
        if r.grading_error:
            why = r.grading_error.removeprefix("grading error: ")
            section += ["* **grading error**:", ""] + md_block(why) + [""]
        if r.notebook_executed == "no":
            section += [f"* **notebook** `notebooks/{r.notebook}` did not run to the end:", ""]
            section += md_block(r.notebook_detail) + [""]
        if r.cells_changed:
            section.append(
                f"* {r.cells_changed} code cell(s) of the course's notebook are not in yours as "
                "released (changed, emptied or missing): the course's cells must run as released "
                "(your own code goes in cells of your own)."
            )
        if r.leftover_processes:
            section.append(
                f"* {r.leftover_processes} process(es) started while grading this lab were still "
                "running at its end (left by your code, or by a run stopped for time); the "
                "grader killed them."
            )
        section += [f"* {printable(note, newlines=False)}" for note in r.notes]
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
        lines += [f"* {md_code(name)}" for name in ignored[:50]]
        lines += [f"* ... and {len(ignored) - 50} more"] if len(ignored) > 50 else []
    return _within_budget("\n".join(lines) + "\n", FEEDBACK_LIMIT)


def _within_budget(page: str, limit: int) -> str:
    """The page, cut at a line before ``limit`` characters with a note saying so."""
    if len(page) <= limit:
        return page
    head = page[:limit].rsplit("\n", 1)[0]
    fence = None  # the fenced block the cut falls in, if it does: closed
    for line in head.split("\n"):
        if re.fullmatch("`{3,}", line) and (fence is None or len(line) >= len(fence)):
            fence = None if fence else line
    if fence:
        head += "\n" + fence
    return head + f"\n\n*[the grader cut this page at {limit:,} characters of {len(page):,}]*\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8", errors="replace")
    os.replace(temporary, path)


# ---- scores.csv, scores.json, summary.md
# ----------------------------------------------------------------------------


def write_reports(
    report: Path,
    results: list[Result],
    meta: dict,
    copies: list[str] = (),
    class_lines: list[str] = (),
) -> None:
    """``scores.csv`` (one row per student and lab), ``scores.json`` (everything), ``summary.md`` (a
    grid, the exercise files that look copied: ``copies`` are Markdown lines the grader built,
    names in them escaped; then ``class_lines``, what the class got wrong, which the grader gets
    from ``labs.grade.mistakes``). The grader writes ``gradebook.csv`` beside them."""
    rows = io.StringIO(newline="")
    writer = csv.DictWriter(rows, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for r in results:
        writer.writerow(
            {
                **asdict(r),
                "student": csv_cell(r.student),
                "lab": csv_cell(r.lab),
                "notebook": csv_cell(r.notebook or ""),
                "notebook_detail": csv_cell((r.notebook_detail.splitlines() or [""])[0], 200),
                "tests_time_s": f"{r.tests_time_s:.1f}",
                "notebook_time_s": f"{r.notebook_time_s:.1f}",
                "grading_error": csv_cell(r.grading_error),
            }
        )
    write_atomic(report / "scores.csv", rows.getvalue())
    dump = {**meta, "results": [asdict(r) for r in results], "copies": list(copies)}
    write_atomic(report / "scores.json", json.dumps(_clean_json(dump), indent=1))
    labs = list(dict.fromkeys(r.lab for r in results))
    lines = [NOT_ISOLATED, ""] if not meta.get("isolated", True) else []
    lines += [
        "# Scorecard",
        "",
        f"Graded {meta['graded_at']}, course commit {md_code(meta['commit'] or 'unknown')}. "
        "Each cell: checks passed/total, then whether the notebook ran to the end.",
        "",
        "| student | " + " | ".join(labs) + " | time (s) | CPU (s) |",
        "|---" * (len(labs) + 3) + "|",
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
        seconds = sum(r.seconds for r in mine.values())
        cpu = sum(r.cpu_seconds for r in mine.values())
        name = md_code(student, table=True)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {seconds:.0f} | {cpu:.0f} |")
    if copies:
        lines += ["", "## Exercise files that look copied", ""]
        lines += [f"* {printable(line, newlines=False)}" for line in copies]
    lines += list(class_lines)
    write_atomic(report / "summary.md", "\n".join(lines) + "\n")
