"""What the class got wrong: per lab, the distribution of scores (a table and a plot) and the most
common failing checks with their hints and how many students hit each, so that an instructor
knows what to re-teach.

A failing check is a test, its parameters left out (``test_x[2-gpipe]`` and ``test_x[4-1f1b]``
are one check), counted once per student; the table quotes the message most of them got (its
first line, numbers written ``N`` to compare them) and the hints: the ``hint (check): ...`` lines
a lab's verdict prints (``labs.experiments.checks.verdict_table``), else the message itself, which
the course's assertions write as advice. A test that failed on unwritten code
(``NotImplementedError``, "is not written yet") is unwritten work, not a mistake: those students
are counted apart. Hidden tests count when they are
not concealed (their failures are not recorded otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from labs.grade.report import Result, cut, md_code, printable

TOP = 5  # mistakes listed per lab
BUCKETS = ((0, 25), (25, 50), (50, 75), (75, 100), (100, 101))  # percent of the lab's checks
PLOT = "class_scores.png"
_HINT = re.compile(r"^\s*hint \(([^)]*)\): (.+)$", re.M)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
_PREFIX = re.compile(r"^(?:E\s+)?(?:[\w.]+(?:Error|Exception|Failed)):\s*")
UNWRITTEN = ("NotImplementedError", "is not written yet")  # what a stub's failure says


@dataclass
class Mistake:
    """One failing check, and the students who hit it."""

    test: str  # the test function, e.g. tests/test_ddp.py::test_losses_match
    hints: list[str] = field(default_factory=list)  # "check: hint" lines
    students: set = field(default_factory=set)
    messages: dict = field(default_factory=dict)  # first line, numbers as N -> (line, students)

    @property
    def message(self) -> str:
        """The first line of the message most students got (one of them, as it was)."""
        line, _ = max(self.messages.values(), key=lambda seen: len(seen[1]))
        return line


def is_unwritten(message: str) -> bool:
    return any(mark in message for mark in UNWRITTEN)


def test_function(nodeid: str) -> str:
    """``tests/t.py::test_x[2-gpipe]`` -> ``tests/t.py::test_x``."""
    return re.sub(r"\[.*\]$", "", nodeid)


def first_line(message: str) -> str:
    for line in str(message).splitlines():
        line = _PREFIX.sub("", line.strip())
        if line:
            return line
    return "(no message)"


def common_mistakes(results: list[Result]) -> dict[str, list[Mistake]]:
    """lab -> its failing checks, most students first."""
    found: dict[str, dict[str, Mistake]] = {}
    for r in results:
        for nodeid, message in r.failures:
            if is_unwritten(message):
                continue
            test = test_function(nodeid)
            mistake = found.setdefault(r.lab, {}).setdefault(test, Mistake(test))
            mistake.students.add(r.student)
            line = first_line(message)
            seen = mistake.messages.setdefault(_NUMBER.sub("N", line), (line, set()))
            seen[1].add(r.student)
            for check, hint in _HINT.findall(message):
                if f"{check}: {hint}" not in mistake.hints:
                    mistake.hints.append(f"{check}: {hint}")
    return {
        lab: sorted(by_key.values(), key=lambda m: (-len(m.students), m.test))
        for lab, by_key in found.items()
    }


def unwritten(results: list[Result], lab: str) -> int:
    """How many students left part of ``lab`` unwritten (a test failed on unwritten code)."""
    return sum(
        r.lab == lab and any(is_unwritten(message) for _, message in r.failures) for r in results
    )


def percent(r: Result) -> float:
    return 100.0 * r.tests_passed / r.tests_total if r.tests_total else 0.0


def summary_lines(results: list[Result], plot: str | None) -> list[str]:
    """The summary's "what the class got wrong" section (Markdown, every string escaped)."""
    labs = list(dict.fromkeys(r.lab for r in results if r.tests_total))
    if not labs:
        return []
    students = len({r.student for r in results})
    lines = [
        "",
        "## What the class got wrong",
        "",
        f"{students} students. Scores: the share of each lab's checks passed, students per range.",
        "",
        "| lab | mean | " + " | ".join(_bucket_name(b) for b in BUCKETS) + " | notebook ran |",
        "|---" * (len(BUCKETS) + 3) + "|",
    ]
    for lab in labs:
        mine = [r for r in results if r.lab == lab]
        scores = [percent(r) for r in mine]
        counts = [sum(low <= s < high for s in scores) for low, high in BUCKETS]
        ran = sum(r.notebook_executed == "yes" for r in mine)
        with_notebook = sum(r.notebook_executed != "-" for r in mine)
        notebook = f"{ran} of {with_notebook}" if with_notebook else "-"
        mean = sum(scores) / len(scores)
        cells = " | ".join(map(str, counts))
        lines.append(f"| {lab} | {mean:.0f}% | {cells} | {notebook} |")
    if plot:
        lines += ["", f"![scores per lab]({plot})"]
    mistakes = common_mistakes(results)
    lines += ["", "### Most common mistakes", ""]
    lines += [
        "Per lab, the checks (tests, parameters left out) most students failed, the message most "
        "of them got and the hint the check gives. Unwritten work (NotImplementedError) is "
        "counted apart.",
        "",
        "| lab | students | check | message | hint |",
        "|---|---|---|---|---|",
    ]
    for lab in labs:
        for m in mistakes.get(lab, [])[:TOP]:
            hint = "; ".join(m.hints) or "-"
            lines.append(
                f"| {lab} | {len(m.students)} of {students} | {md_code(m.test, table=True)} | "
                f"{md_code(cut(m.message, 160), table=True)} | "
                f"{md_code(cut(hint, 300), table=True)} |"
            )
        left = unwritten(results, lab)
        if left:
            lines.append(
                f"| {lab} | {left} of {students} | (unwritten) | `NotImplementedError` | "
                "parts of the exercise not written yet |"
            )
    return lines


def _bucket_name(bucket: tuple[int, int]) -> str:
    low, high = bucket
    return "100%" if low == 100 else f"{low}–{high - 1}%"


def plot_scores(results: list[Result], path: Path) -> bool:
    """A histogram of scores per lab (percent of checks passed), one panel each, saved as a PNG at
    ``path``; False when there is nothing to plot or matplotlib is missing."""
    labs = list(dict.fromkeys(r.lab for r in results if r.tests_total))
    if not labs:
        return False
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    columns = min(4, len(labs))
    rows = -(-len(labs) // columns)
    figure = Figure(figsize=(3.2 * columns, 2.4 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    edges = [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99.99, 100.01]
    for i, lab in enumerate(labs):
        ax = axes[i // columns][i % columns]
        scores = [min(percent(r), 100.0) for r in results if r.lab == lab]
        ax.hist(scores, bins=edges, color="tab:blue", edgecolor="white")
        ax.set_title(printable(lab, newlines=False)[:40], fontsize=10)
        ax.set_xlim(0, 101)
        ax.set_xlabel("% of checks passed", fontsize=8)
        ax.set_ylabel("students", fontsize=8)
        ax.yaxis.get_major_locator().set_params(integer=True)
    for j in range(len(labs), rows * columns):
        axes[j // columns][j % columns].set_visible(False)
    temporary = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temporary, dpi=80)
    temporary.replace(path)
    return True
