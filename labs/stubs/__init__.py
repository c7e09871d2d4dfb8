"""Generate the learner's exercise modules in ``labs/`` from the reference in ``solutions/``.

    python -m labs.stubs            # rewrite labs/<exercise>.py from solutions/<exercise>.py
    python -m labs.stubs ddp zero   # only these exercises
    python -m labs.stubs --check    # exit 1 if labs/ differs from what generation gives

``solutions/`` is the single source. In a solution module, code between the markers

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

is the learner's to write. Generation replaces each marked block with a
``raise NotImplementedError`` that names the function and its notebook; everything
else (signatures, docstrings that state the task, helpers) is copied unchanged.
The markers are nbgrader's, so an nbgrader user reads them at a glance.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from pathlib import Path

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


def make_stub(source: str, name: str) -> str:
    """The learner version of one solution module's source."""
    owners = _enclosing_functions(source)
    notebook = _notebook(source)
    out = [HEADER.format(name=name)]
    inside = False
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
        elif not inside:
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


def expected_stubs(names: list[str] | None = None) -> dict[Path, str]:
    """labs/<name>.py -> generated text, for every exercise in solutions/ (or only ``names``)."""
    paths = [SOLUTIONS / f"{n}.py" for n in names] if names else sorted(SOLUTIONS.glob("*.py"))
    for path in paths:
        if not path.exists():
            raise SystemExit(f"no exercise solutions/{path.name}")
    return {
        LABS / path.name: make_stub(path.read_text(), path.name)
        for path in paths
        if path.name != "__init__.py"
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labs.stubs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("names", nargs="*", help="exercise modules to generate (default: all)")
    parser.add_argument("--check", action="store_true", help="report drift instead of writing")
    args = parser.parse_args(argv)
    drift = 0
    for path, text in expected_stubs(args.names).items():
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
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and drift:
        print(
            f"{drift} learner module(s) differ from solutions/; run `python -m labs.stubs`",
            file=sys.stderr,
        )
        return 1
    return 0
