"""A student's notebook for grading: made ready to run from the release's cells, and judged
after.

"Executed" means every code cell of the released notebook ran, in order, to the end, with the
release's tags. Cells are matched by cell id (nbformat 4.5; JupyterLab keeps ids when cells are
edited, moved or copied):

* a code cell whose id is a released code cell's gets that cell's metadata, tags included (so
  ``raises-exception`` lets only a cell the course allows fail); the student's own cells get none
  (a ``raises-exception`` or ``skip-execution`` tag a student adds is ignored);
* a released code cell missing from the student's notebook, emptied, or moved before an earlier
  one means the notebook did not run as released: "executed" is no, and the feedback says which
  cell;
* the student's own cells run where they are; one that raises stops the run like any other.

The notebook is parsed here, by the grader, never trusted to be JSON, a notebook, or small: what
cannot be read says so ("cannot be parsed: ..."), not that a kernel failed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import nbformat

CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")  # nbformat 4.5's rule for a cell id


@dataclass
class Prepared:
    """The notebook to run, and what judging it needs."""

    notebook: nbformat.NotebookNode | None  # None: nothing can run (see problems)
    required: dict[int, tuple[int, bool]] = field(default_factory=dict)
    # ^ index in ``notebook`` -> (index of the cell in the release, may raise)
    problems: list[str] = field(default_factory=list)  # why it cannot count as executed
    changed: int = 0  # released code cells not in the student's notebook verbatim


def first_line(source: str) -> str:
    line = next((x for x in source.splitlines() if x.strip() and not x.startswith("#")), "")
    return f" (`{line[:80]}`)" if line else ""


def prepare(mine: bytes, released: nbformat.NotebookNode) -> Prepared:
    """The student's notebook (its bytes) made ready to run against the ``released`` one."""
    try:
        theirs = nbformat.reads(mine.decode("utf-8"), as_version=4)
        cells = [(c["cell_type"], str(c.get("source", "")), c.get("id")) for c in theirs.cells]
    except Exception as exc:  # noqa: BLE001 - any way a file fails to be a notebook
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return Prepared(None, problems=[f"the notebook cannot be parsed: {why}"])
    release_code = {
        c.get("id"): (i, c) for i, c in enumerate(released.cells) if c.cell_type == "code"
    }
    nb = nbformat.v4.new_notebook(metadata=json.loads(json.dumps(released.metadata)))
    prepared = Prepared(nb)
    used: set[str] = set()
    for kind, source, cell_id in cells:
        if kind not in ("code", "markdown", "raw"):
            continue
        fresh = not isinstance(cell_id, str) or not CELL_ID.match(cell_id) or cell_id in used
        cell_id = uuid.uuid4().hex[:12] if fresh else cell_id
        used.add(cell_id)
        make = getattr(nbformat.v4, f"new_{kind}_cell")
        cell = make(source=source)
        cell["id"] = cell_id
        if kind == "code" and cell_id in release_code and not fresh:
            index, ref = release_code[cell_id]
            cell["metadata"] = json.loads(json.dumps(ref.metadata))
            raises = "raises-exception" in ref.metadata.get("tags", [])
            prepared.required[len(nb.cells)] = (index, raises)
        nb.cells.append(cell)
    found = {index: at for at, (index, _) in prepared.required.items()}
    last = -1
    for index, ref in release_code.values():
        mine_at = found.get(index)
        where = f"cell {index + 1}{first_line(ref.source)} of the course's notebook"
        if mine_at is None:
            prepared.changed += 1
            if ref.source.strip():
                prepared.problems.append(f"{where} is not in yours (cells are matched by id)")
            continue
        source = nb.cells[mine_at].source
        prepared.changed += source.strip() != ref.source.strip()
        if ref.source.strip() and not source.strip():
            prepared.problems.append(f"{where} is empty in yours")
        elif mine_at < last:
            prepared.problems.append(f"{where} comes before an earlier cell in yours")
        last = max(last, mine_at)
    return prepared


def read_report(raw: bytes) -> dict:
    """The runner's lines gathered: "cell" (the last started), "ran" ({index: ok}), "end" (the final
    record, or None), "notebook" (or None), "malformed" (the first bad line, or None)."""
    report = {"cell": None, "ran": {}, "end": None, "notebook": None, "malformed": None}
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
                report["notebook"] = nbformat.from_dict(record["notebook"])
            else:
                raise ValueError("unknown record")
        except (ValueError, TypeError, KeyError, AttributeError):
            report["malformed"] = report["malformed"] or f"line {number}"
    return report


def judge(prepared: Prepared, report: dict) -> tuple[bool, str]:
    """(executed, what happened) from the runner's report; the caller adds time limits."""
    nb = prepared.notebook
    end = report["end"]
    running = where(nb, report["cell"])
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
        if ok is None and nb.cells[at].source.strip():
            return False, f"{where(nb, at)} did not run"
        if ok is False and not raises:
            return False, f"{where(nb, at)} raised, and the course's notebook does not allow it"
    return True, "ok"


def where(nb: nbformat.NotebookNode | None, index: int | None) -> str:
    """ "cell 7 (`first line of its code`)", as a reader finds it in JupyterLab."""
    if index is None or nb is None or not 0 <= index < len(nb.cells):
        return "no cell (the kernel did not start)"
    return f"cell {index + 1}{first_line(nb.cells[index].source)}"
