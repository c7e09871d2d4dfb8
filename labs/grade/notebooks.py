"""A student's notebook for grading: made ready to run from the release's cells, and judged
after.

"Executed" means every code cell of the released notebook ran, as released, in order, to the end,
with the release's tags. Cells are matched by cell id (nbformat 4.5; JupyterLab keeps ids when
cells are edited, moved or copied):

* a code cell whose id is a released code cell's gets that cell's metadata, tags included (so
  ``raises-exception`` lets only a cell the course allows fail); the student's own cells get none
  (a ``raises-exception`` or ``skip-execution`` tag a student adds is ignored);
* a released code cell missing from the student's notebook, emptied, changed (its code is not the
  release's: compared as Python syntax trees, so layout and comments may differ) or moved before
  an earlier one means the notebook did not run as released: "executed" is no, and the feedback
  says which cell (the course's cells call the student's exercise modules: replacing one with
  ``pass`` would skip the work it checks);
* the student's own cells run where they are; one that raises stops the run like any other.

The notebook is never trusted to be JSON, a notebook, or small, and the grader never parses it
itself: ``prepare_limited`` and ``save_limited`` run this file as a child process (the standard
library only, ``python -I -S``) with an address-space, CPU-time and wall-clock limit, and a
notebook of more than ``MAX_CELLS`` cells is refused. What cannot be read says so ("cannot be
parsed: ..."), not that a kernel failed.

    python -I -S notebooks.py prepare MINE.ipynb RELEASED.ipynb OUT.ipynb   # -> Prepared, JSON
    python -I -S notebooks.py save RESULTS OUT.ipynb                        # -> the runner's report
"""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, field

CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")  # nbformat 4.5's rule for a cell id
MAX_CELLS = 2000  # of a student's notebook (the course's have fewer than 100)
CHILD_MEMORY = 2 << 30  # address space of the child that parses a notebook
CHILD_CPU_S = 60
CHILD_WALL_S = 120


@dataclass
class Prepared:
    """The notebook to run (written where the caller said), and what judging it needs."""

    runnable: bool  # False: nothing can run (see problems)
    required: dict[int, tuple[int, bool]] = field(default_factory=dict)
    # ^ index in the notebook to run -> (index of the cell in the release, may raise)
    problems: list[str] = field(default_factory=list)  # why it cannot count as executed
    changed: int = 0  # released code cells not in the student's notebook as released
    own_code: int = 0  # the student's own code cells (not released ones) with code in them
    firsts: list[str] = field(default_factory=list)  # each cell's first line of code, for messages


def first_line(source: str) -> str:
    line = next((x for x in source.splitlines() if x.strip() and not x.startswith("#")), "")
    return f" (`{line[:80]}`)" if line else ""


def same_code(mine: str, released: str) -> bool:
    """The same program: equal syntax trees (layout and comments aside), or, where one is not
    Python, equal text but for trailing spaces and blank lines."""
    try:
        return ast.dump(ast.parse(mine)) == ast.dump(ast.parse(released))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        lines = [[x.rstrip() for x in s.splitlines() if x.strip()] for s in (mine, released)]
        return lines[0] == lines[1]


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    if isinstance(source, list) and all(isinstance(x, str) for x in source):
        return "".join(source)
    if not isinstance(source, str):
        raise ValueError("a cell's source is not text")
    return source


def _cells(nb) -> list[dict]:
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("it is not a notebook (no list of cells)")
    if len(nb["cells"]) > MAX_CELLS:
        raise ValueError(f"it has {len(nb['cells'])} cells, more than the {MAX_CELLS} graded")
    if not all(isinstance(c, dict) and isinstance(c.get("cell_type"), str) for c in nb["cells"]):
        raise ValueError("a cell is not a cell")
    return nb["cells"]


def _new_cell(kind: str, source: str, cell_id: str, metadata: dict) -> dict:
    cell = {"cell_type": kind, "id": cell_id, "metadata": metadata, "source": source}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def prepare(mine: bytes, released: dict) -> tuple[Prepared, dict | None]:
    """The student's notebook (its bytes) made ready to run against the ``released`` one (its
    JSON): what judging needs, and the notebook to run (None when nothing can run)."""
    try:
        theirs = _cells(json.loads(mine.decode("utf-8")))
        cells = [(c["cell_type"], _source(c), c.get("id")) for c in theirs]
    except Exception as exc:  # noqa: BLE001 - any way a file fails to be a notebook
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return Prepared(False, problems=[f"the notebook cannot be parsed: {why}"]), None
    release_code = {
        c.get("id"): (i, c) for i, c in enumerate(released["cells"]) if c["cell_type"] == "code"
    }
    nb = {key: value for key, value in released.items() if key != "cells"}
    nb["cells"] = []
    prepared = Prepared(True)
    used: set[str] = set()
    for kind, source, cell_id in cells:
        if kind not in ("code", "markdown", "raw"):
            continue
        fresh = not isinstance(cell_id, str) or not CELL_ID.match(cell_id) or cell_id in used
        cell_id = uuid.uuid4().hex[:12] if fresh else cell_id
        used.add(cell_id)
        metadata = {}
        if kind == "code" and cell_id in release_code and not fresh:
            index, ref = release_code[cell_id]
            metadata = json.loads(json.dumps(ref.get("metadata", {})))
            raises = "raises-exception" in metadata.get("tags", [])
            prepared.required[len(nb["cells"])] = (index, raises)
        elif kind == "code" and source.strip():
            prepared.own_code += 1
        nb["cells"].append(_new_cell(kind, source, cell_id, metadata))
        prepared.firsts.append(first_line(source) if kind == "code" else "")
    found = {index: at for at, (index, _) in prepared.required.items()}
    last = -1
    for index, ref in release_code.values():
        mine_at = found.get(index)
        released_source = _source(ref)
        where = f"cell {index + 1}{first_line(released_source)} of the course's notebook"
        if mine_at is None:
            prepared.changed += 1
            if released_source.strip():
                prepared.problems.append(f"{where} is not in yours (cells are matched by id)")
            continue
        source = nb["cells"][mine_at]["source"]
        if released_source.strip() and not source.strip():
            prepared.changed += 1
            prepared.problems.append(f"{where} is empty in yours")
        elif not same_code(source, released_source):
            prepared.changed += 1
            prepared.problems.append(
                f"{where} was changed in yours: the course's cells must run as released (your "
                "own code goes in cells of your own)"
            )
        elif mine_at < last:
            prepared.problems.append(f"{where} comes before an earlier cell in yours")
        last = max(last, mine_at)
    return prepared, nb


def read_report(raw: bytes) -> tuple[dict, dict | None]:
    """The runner's lines gathered: "cell" (the last started), "ran" ({index: ok}), "end" (the final
    record, or None), "malformed" (the first bad line, or None); and the executed notebook."""
    report = {"cell": None, "ran": {}, "end": None, "malformed": None}
    notebook = None
    lines = raw.split(b"\n")
    lines.pop()  # after the last newline: empty, or cut short by a kill
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if "cell" in record:
                report["cell"] = int(record["cell"])
            elif "ran" in record:
                report["ran"][int(record["ran"])] = bool(record["ok"])
            elif "end" in record:
                report["end"] = {k: str(record.get(k, "")) for k in ("end", "ename", "evalue")}
                report["end"]["cut"] = int(record.get("cut", 0))
            elif "notebook" in record:
                notebook = record["notebook"]
                _cells(notebook)
            else:
                raise ValueError("unknown record")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            report["malformed"] = report["malformed"] or f"line {number}"
    return report, notebook


def judge(prepared: Prepared, report: dict) -> tuple[bool, str]:
    """(executed, what happened) from the runner's report; the caller adds time limits."""
    end = report["end"]
    running = where(prepared, report["cell"])
    if report["malformed"]:
        return False, f"the notebook runner's report is malformed ({report['malformed']})"
    if end is None:
        return False, f"stopped: the notebook runner ended without a report, in {running}"
    if end["end"] != "ok":
        return False, f"{end['end']} in {running}: {end['ename']}: {end['evalue'].strip()}"[:3000]
    if prepared.problems:
        return False, prepared.problems[0]
    for at, (_, raises) in sorted(prepared.required.items()):
        ok = report["ran"].get(at)
        if ok is None and prepared.firsts[at]:
            return False, f"{where(prepared, at)} did not run"
        if ok is False and not raises:
            why = "raised, and the course's notebook does not allow it"
            return False, f"{where(prepared, at)} {why}"
    return True, "ok"


def where(prepared: Prepared, index: int | None) -> str:
    """ "cell 7 (`first line of its code`)", as a reader finds it in JupyterLab."""
    if index is None or not 0 <= index < len(prepared.firsts):
        return "no cell (the kernel did not start)"
    return f"cell {index + 1}{prepared.firsts[index]}"


# ---- the limited child: the grader calls these
# -------------------------------------------------------------------------------


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_S, CHILD_CPU_S))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child(*args: str) -> dict:
    """Run this file with ``args`` in a limited child; its one line of JSON, or {"error": why}."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), *args],
            capture_output=True,
            timeout=CHILD_WALL_S,
            preexec_fn=_limit_child,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"it took the grader more than {CHILD_WALL_S} s to read"}
    try:
        return json.loads(proc.stdout.decode())
    except ValueError:
        return {"error": f"the grader could not read it within its limits (exit {proc.returncode})"}


def prepare_limited(mine: str, released: str, out: str) -> Prepared:
    """``prepare`` in a limited child: the student's notebook file ``mine`` against the release's
    ``released``; the notebook to run is written to ``out``."""
    found = _child("prepare", mine, released, out)
    if "error" in found:
        return Prepared(False, problems=[f"the notebook cannot be parsed: {found['error']}"])
    found["required"] = {int(k): tuple(v) for k, v in found["required"].items()}
    return Prepared(**found)


def save_limited(results: str, out: str) -> dict:
    """``read_report`` in a limited child, on the runner's channel saved in ``results``; the
    executed notebook is written to ``out`` (when there is one). Adds "saved": bool."""
    report = _child("save", results, out)
    if "error" in report:
        return {"cell": None, "ran": {}, "end": None, "malformed": report["error"], "saved": False}
    report["ran"] = {int(k): v for k, v in report["ran"].items()}
    return report


def _main(argv: list[str]) -> None:
    if argv[0] == "prepare":
        _, mine, released, out = argv
        with open(mine, "rb") as f:
            data = f.read()
        with open(released, encoding="utf-8") as f:
            course = json.load(f)
        prepared, nb = prepare(data, course)
        if nb is not None:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(nb, f)
        print(json.dumps(asdict(prepared)))
    elif argv[0] == "save":
        _, results, out = argv
        with open(results, "rb") as f:
            report, notebook = read_report(f.read())
        if notebook is not None:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(notebook, f, indent=1)
        print(json.dumps({**report, "saved": notebook is not None}))


if __name__ == "__main__":
    _main(sys.argv[1:])
