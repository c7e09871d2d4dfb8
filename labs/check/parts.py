"""A lab's parts: the core a learner writes to go on, and the extensions after it.

Each exercise module declares its parts once, in order, with the minutes each takes at its
notebook's pace (the module is copied into the learner's stub unchanged)::

    PARTS = {"core": 60, "buckets": 20, "mixed-precision": 25}

``core`` comes first: it is what a learner must write to go on to the next notebooks, and the
notebook's stated time is its time. Every other part is an extension, written after the core, in
this order: a part's tests need that part and the parts before it, nothing after it.

**Functions.** The docstring of every function a learner writes (a function holding a solution
block) has a line that names its part, the first word after ``Part:``::

    Part: core.
    Part: buckets (extension).
    Part: core (the ``reduce_dtype`` lines: mixed-precision, an extension).

A function belongs to the first part that needs it; a later part may come back to add lines to
it, as the rest of that line says.

**Tests.** A test of an exercise belongs to the part it checks: ``@pytest.mark.part("buckets")``
on the test, on one ``pytest.param``, or in a module's ``pytestmark``; a test without the mark
belongs to ``core``. ``python -m labs.check EX --part NAME`` runs the tests of one part, and the
tests of a part pass once that part and the parts before it are written: nothing in the core's
tests calls an extension (``tests/test_parts.py`` proves it on a copy of ``labs/`` where only
the core is written).
"""

from __future__ import annotations

import ast
import re

CORE = "core"
PART_LINE = re.compile(r"^\s*Part: ([a-z0-9][a-z0-9-]*)\b(.*)$", re.M)


def module_parts(source: str) -> dict[str, int]:
    """``PARTS`` of an exercise module's source: part name -> minutes, in order. A module without
    one has a single part, ``{"core": 0}`` (0: no time stated)."""
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "PARTS"
        ):
            parts = ast.literal_eval(node.value)
            if not parts or next(iter(parts)) != CORE:
                raise ValueError(f'PARTS must start with "{CORE}", got {list(parts)}')
            return dict(parts)
    return {CORE: 0}


def docstring_part(docstring: str | None) -> str | None:
    """The part a docstring names on its ``Part:`` line, or None."""
    match = PART_LINE.search(docstring or "")
    return match.group(1) if match else None


def function_docstrings(source: str) -> dict[str, tuple[int, int, str | None]]:
    """Qualified name of every function and method -> (first line, last line, docstring)."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found[name] = (child.lineno, child.end_lineno, ast.get_docstring(child))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def function_parts(source: str, block_owners: set[str]) -> dict[str, str | None]:
    """For each function in ``block_owners`` (those holding a solution block), the part its
    docstring names (None where it names none)."""
    docs = function_docstrings(source)
    return {name: docstring_part(docs[name][2]) for name in sorted(block_owners)}
