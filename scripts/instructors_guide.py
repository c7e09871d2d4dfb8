"""Write the generated parts of the instructor's guide, ``docs/instructors.md``: the mistakes
students make, per lab, from the classic-bug catalogue; and the size of every exercise, from
``solutions/``. The rest of the guide is written by hand.

    python scripts/instructors_guide.py           # rewrite the generated regions in place
    python scripts/instructors_guide.py --check   # exit 1 (and say so) when they are stale

Each region sits between two markers in the guide, and only its inside is rewritten:

    <!-- BEGIN GENERATED mistakes: python scripts/instructors_guide.py -->
    ...
    <!-- END GENERATED mistakes -->

``mistakes``: for each lab of ``tests/classic_bugs.py``, in notebook order, a row per planted bug:
the mistake (the bug's id), what fails (the check of the lab's verdict that reads FAIL, and the
run options under which it shows), and the hint that check prints (the part the catalogue's test
asserts, ``Bug.hint``). ``sizes``: for each exercise module, the functions a learner writes (those
with a solution block) and the lines of each solution block (not blank, not comments).
``tests/test_instructors_guide.py`` fails when either region differs from what this gives, as
``tests/test_stubs.py`` does for the stubs.

What it reads, kept small so the catalogue can change shape: ``all_bugs()`` ((lab, bug) pairs with
``id``, ``check``, ``hint``, ``options``), the labs' declarations (each lab's notebook, from
``labs.experiments.spec.listings``), and each solution's ``NOTEBOOK``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ``tests.classic_bugs`` is not an installed package

import nbformat  # noqa: E402

from labs import stubs  # noqa: E402
from labs.experiments.spec import listings  # noqa: E402
from labs.release import exercise_names, exercise_notebook  # noqa: E402
from tests.classic_bugs import all_bugs  # noqa: E402

GUIDE = ROOT / "docs" / "instructors.md"
COMMAND = "python scripts/instructors_guide.py"
REGION = re.compile(
    r"(<!-- BEGIN GENERATED (?P<name>\w+): [^>]*-->\n)"  # group 1: the opening marker
    r"(?P<body>.*?)"
    r"(<!-- END GENERATED (?P=name) -->)",  # group 4: the closing marker
    re.S,
)


def notebook_title(notebook: str) -> str:
    """The first line of the notebook's first cell, without its "# " ("00 · Setup, ...")."""
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    return nb.cells[0].source.splitlines()[0].lstrip("# ").strip()


def lab_notebook(lab: str) -> str:
    """The notebook of the lab ``python -m labs.run LAB`` runs, as the lab declares it."""
    return {x.name: f"{x.notebook}.ipynb" for x in listings()}[lab]


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _options(options: dict) -> str:
    return ", ".join(f"`{key}={value!r}`" for key, value in options.items())


def mistakes() -> str:
    """The ``mistakes`` region: one table per lab, in notebook order."""
    by_lab: dict[str, list] = {}
    for lab, bug in all_bugs():
        by_lab.setdefault(lab, []).append(bug)
    parts = []
    for lab in sorted(by_lab, key=lambda lab: (lab_notebook(lab), lab)):
        notebook = lab_notebook(lab)
        bugs = by_lab[lab]
        parts.append(
            f"#### {notebook_title(notebook)}: `python -m labs.run {lab}`, {len(bugs)} mistakes\n\n"
            "| the mistake | what reads FAIL | the hint it prints (contains) |\n|---|---|---|\n"
            + "".join(
                f"| {_cell(bug.id)} | `{_cell(bug.check)}`"
                + (f" (with {_options(bug.options)})" if bug.options else "")
                + f' | "{_cell(bug.hint)}" |\n'
                for bug in bugs
            )
        )
    total = sum(len(bugs) for bugs in by_lab.values())
    return (
        f"{total} mistakes in {len(by_lab)} labs, each planted in the reference code by "
        "`tests/test_classic_bugs.py`, which checks that the named check fails with this hint.\n\n"
        + "\n".join(parts)
    )


def solution_functions(source: str) -> list[tuple[str, int]]:
    """(function, lines of its solution blocks) for every function of ``source`` that has one;
    methods as ``Class.method``. Lines: neither blank nor comments."""
    lines = source.splitlines()
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                inside = False
                count = 0
                for line in lines[child.lineno - 1 : child.end_lineno]:
                    text = line.strip()
                    if text in (stubs.BEGIN, stubs.END):
                        inside = text == stubs.BEGIN
                    elif inside and text and not text.startswith("#"):
                        count += 1
                if count:
                    found.append((prefix + child.name, count))

    visit(ast.parse(source), "")
    return found


def sizes() -> str:
    """The ``sizes`` region: one row per exercise module, in notebook order."""
    rows = []
    for name in sorted(exercise_names(), key=lambda n: (exercise_notebook(n) or "", n)):
        functions = solution_functions((ROOT / "solutions" / f"{name}.py").read_text())
        rows.append(
            f"| {(exercise_notebook(name) or '')[:2]} | `labs/{name}.py` | {len(functions)} | "
            f"{sum(n for _, n in functions)} | "
            + ", ".join(f"`{function}` {n}" for function, n in functions)
            + " |\n"
        )
    return (
        "| notebook | exercise module | functions to write | solution lines | each function's "
        "lines |\n|---|---|---|---|---|\n" + "".join(rows)
    )


GENERATORS = {"mistakes": mistakes, "sizes": sizes}


def updated(text: str) -> str:
    """``text`` with every generated region rewritten; ValueError when one is missing."""
    names = [m.group("name") for m in REGION.finditer(text)]
    missing = sorted(set(GENERATORS) - set(names))
    if missing:
        raise ValueError(
            f"{GUIDE.relative_to(ROOT)} has no region {missing}: add "
            f"'<!-- BEGIN GENERATED NAME: {COMMAND} -->' and '<!-- END GENERATED NAME -->'"
        )
    bodies = {name: GENERATORS[name]() for name in set(names)}
    return REGION.sub(lambda m: m.group(1) + bodies[m.group("name")] + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the guide's generated parts are stale"
    )
    args = parser.parse_args(argv)
    text = GUIDE.read_text()
    new = updated(text)
    if args.check:
        if new != text:
            print(f"{GUIDE.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        print(f"{GUIDE.relative_to(ROOT)} is up to date")
        return 0
    if new != text:
        GUIDE.write_text(new)
        print(f"rewrote the generated regions of {GUIDE.relative_to(ROOT)}")
    else:
        print(f"{GUIDE.relative_to(ROOT)} was up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
