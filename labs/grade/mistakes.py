"""What the class got wrong: per lab, the distribution of scores (a table and a plot) and the most
common failing checks with their hints and how many students hit each, so that an instructor
knows what to re-teach.

A failing check is a test (its function, parameters left out) failing with one kind of message:
the message's first line with every number written ``N`` (``gpipe P=2 M=2 step 0: loss`` and
``gpipe P=4 M=4 step 0: loss`` are one mistake). Its hints are the ``hint (check): ...`` lines a
lab's verdict prints (``labs.experiments.checks.verdict_table``), else the message itself, which
the course's assertions write as advice. A test that failed with ``NotImplementedError`` is
unwritten work, not a mistake: those students are counted apart. Hidden tests count when they are
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
UNWRITTEN = "NotImplementedError"


@dataclass
class Mistake:
    """One failing check, and the students who hit it."""

    test: str  # the test function, e.g. tests/test_ddp.py::test_losses_match
    message: str  # the first line of one student's message, as it was
    hints: list[str] = field(default_factory=list)  # "check: hint" lines
    students: set = field(default_factory=set)


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
    found: dict[str, dict[tuple, Mistake]] = {}
    for r in results:
        for nodeid, message in r.failures:
            if UNWRITTEN in message:
                continue
            line = first_line(message)
            key = (test_function(nodeid), _NUMBER.sub("N", line))
            mistake = found.setdefault(r.lab, {}).setdefault(key, Mistake(key[0], line))
            mistake.students.add(r.student)
            for check, hint in _HINT.findall(message):
                if f"{check}: {hint}" not in mistake.hints:
                    mistake.hints.append(f"{check}: {hint}")
    return {
        lab: sorted(by_key.values(), key=lambda m: (-len(m.students), m.test))
        for lab, by_key in found.items()
    }


def unwritten(results: list[Result], lab: str) -> int:
    """How many students left part of ``lab`` unwritten (a test failed on NotImplementedError)."""
    return sum(
        r.lab == lab and any(UNWRITTEN in message for _, message in r.failures) for r in results
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
        "Per lab, the checks most students failed (numbers in a message written N), with the "
        "hint each check gives. Unwritten work (NotImplementedError) is counted apart.",
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
