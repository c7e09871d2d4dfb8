"""Generate the learner's exercise modules in ``labs/`` from the reference in ``solutions/``.

    python -m labs.stubs            # rewrite labs/<exercise>.py from solutions/<exercise>.py
    python -m labs.stubs ddp zero   # only these exercises
    python -m labs.stubs --check    # exit 1 if labs/ differs from what generation gives
    python -m labs.stubs --keep core --out /tmp/core   # labs/ with only the core written

``solutions/`` is the single source. In a solution module, code between the markers

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

is the learner's to write. Generation replaces each marked block with a
``raise NotImplementedError`` that names the function and its notebook; everything
else (signatures, docstrings that state the task, helpers) is copied unchanged.
The markers are nbgrader's, so an nbgrader user reads them at a glance.

Each function holding a block names its part in its docstring (``Part: core``; see
``labs.check.parts``). ``--keep core`` keeps the blocks of the core's functions and cuts the
extensions' only: a learner who has written the core, which ``tests/test_parts.py`` checks with
``python -m labs.check EX --part core``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from labs.check.parts import function_parts

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
LABS = ROOT / "labs"
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
HEADER = (
    "# Your exercise module, generated from solutions/{name} by `python -m labs.stubs`.\n"
    "# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.\n"
)


def _enclosing_functions(source: str) -> dict[int, str]:
    """Line number -> qualified name of the innermost function containing it."""
    owner: dict[int, str] = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    for line in range(child.lineno, child.end_lineno + 1):
                        owner[line] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return owner


def notebook_name(source: str) -> str | None:
    """The notebook file a solution module names in ``NOTEBOOK = "..."``."""
    match = re.search(r'^NOTEBOOK = "([^"]+)"', source, re.M)
    return match.group(1) if match else None


def _notebook(source: str) -> str:
    name = notebook_name(source)
    return f"notebooks/{name}" if name else "its notebook"


def block_parts(source: str) -> dict[str, str | None]:
    """Each function holding a solution block -> the part its docstring names (None: none)."""
    owners = _enclosing_functions(source)
    lines = source.splitlines()
    holders = {
        owners[i] for i, line in enumerate(lines, 1) if line.strip() == BEGIN and i in owners
    }
    return function_parts(source, holders)


def make_stub(source: str, name: str, keep: Iterable[str] = ()) -> str:
    """The learner version of one solution module's source. ``keep``: parts whose functions keep
    their solution (a learner who has written those parts); the default cuts every block."""
    owners = _enclosing_functions(source)
    notebook = _notebook(source)
    keep = set(keep)
    parts = block_parts(source) if keep else {}
    out = [HEADER.format(name=name)]
    inside = False
    kept = False
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"solutions/{name}:{lineno}: {BEGIN} inside another block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            function = owners.get(lineno)
            if function is None:
                raise ValueError(f"solutions/{name}:{lineno}: {BEGIN} outside a function")
            kept = parts.get(function) in keep
            if kept:
                continue
            out.append(
                f"{indent}raise NotImplementedError(\n"
                f'{indent}    "exercise {function} is not written yet: "\n'
                f'{indent}    "see its docstring and {notebook}"\n'
                f"{indent})\n"
            )
        elif stripped == END:
            if not inside:
                raise ValueError(f"solutions/{name}:{lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside or kept:
            out.append(line)
    if inside:
        raise ValueError(f"solutions/{name}: {BEGIN} is never closed")
    return ruff_format("".join(out), LABS / name)


def ruff_format(source: str, path: Path) -> str:
    """``source`` as ``ruff format`` (the repository's settings) writes it at ``path``.

    A stub's ``raise`` line can be longer than the solution block it replaces, so the stub is
    formatted like any other module: the drift check and ``ruff format --check`` then agree.
    """
    from ruff.__main__ import find_ruff_bin

    proc = subprocess.run(
        [find_ruff_bin(), "format", "--stdin-filename", str(path), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise ValueError(f"ruff could not format the stub {path.name}:\n{proc.stderr}")
    return proc.stdout


def expected_stubs(
    names: list[str] | None = None, keep: Iterable[str] = (), out: Path = LABS
) -> dict[Path, str]:
    """<out>/<name>.py -> generated text, for every exercise in solutions/ (or only ``names``),
    with the blocks of the ``keep`` parts kept."""
    paths = [SOLUTIONS / f"{n}.py" for n in names] if names else sorted(SOLUTIONS.glob("*.py"))
    for path in paths:
        if not path.exists():
            raise SystemExit(f"no exercise solutions/{path.name}")
    return {
        out / path.name: make_stub(path.read_text(), path.name, keep)
        for path in paths
        if path.name != "__init__.py"
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labs.stubs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("names", nargs="*", help="exercise modules to generate (default: all)")
    parser.add_argument("--check", action="store_true", help="report drift instead of writing")
    parser.add_argument(
        "--keep",
        default="",
        metavar="PART[,PART...]",
        help="keep the solution of these parts' functions (e.g. core); needs --out",
    )
    parser.add_argument(
        "--out", type=Path, default=LABS, help="the folder to write to (default: labs/)"
    )
    args = parser.parse_args(argv)
    keep = [p for p in args.keep.split(",") if p]
    if keep and args.out.resolve() == LABS.resolve():
        parser.error("--keep writes partly solved modules: give --out a folder other than labs/")
    drift = 0
    for path, text in expected_stubs(args.names, keep, args.out).items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if args.check:
            drift += 1
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=1
            )
            print("\n".join(list(diff)[:40]))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if args.check and drift:
        print(
            f"{drift} learner module(s) differ from solutions/; run `python -m labs.stubs`",
            file=sys.stderr,
        )
        return 1
    return 0
