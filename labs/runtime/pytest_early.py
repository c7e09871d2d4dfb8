"""A pytest plugin loaded before all others (``-p labs.runtime.pytest_early`` in pyproject.toml's
``addopts``: pytest imports ``-p`` plugins before the installed ones, nbval among them).

nbval imports nbformat, whose validator imports jsonschema, which imports ``rfc3987_syntax`` when
it is installed (jupyter-events asks for it) to check the "iri" string format: that import
compiles a grammar, about 2 CPU-seconds of every pytest process (every ``python -m labs.check``,
every test run in the suite) for a format nbformat never checks (it validates without a format
checker). Marked missing here, jsonschema leaves that one format out; nothing else changes.
``labs.release`` (and so ``labs.grade``) imports this module before nbformat for the same 2 s of
every command; the grader's notebook runner (``labs/grade/run_notebook.py``), which may import
nothing of the course, does the same for its kernel client."""

import sys

sys.modules.setdefault("rfc3987_syntax", None)
