"""Execute one notebook headless for grading, recording which cell runs, and save the executed copy.

    python run_notebook.py SRC.ipynb DST.ipynb RESULT.json CELL_TIMEOUT_S

Runs from SRC's folder with the environment it is given (``labs.grade`` sets ``LABS_IMPL=labs``
and ``PYTHONPATH`` to the graded copy). Cells tagged ``raises-exception`` may fail, as in CI.
RESULT.json is rewritten at the start of every cell, so a run killed for taking too long still
says where it was: ``{"status": "ok" | "running" | "error" | "cell-timeout" | "kernel-died",
"cell": index, "code_cells": n, "ename", "evalue"}`` (a cell over time is interrupted, so the
ranks it launched are stopped by ``labs.launch``, and reported as "cell-timeout").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError


def main(src: str, dst: str, result_path: str, cell_timeout: float) -> int:
    nb = nbformat.read(src, as_version=4)
    result = {
        "status": "starting",
        "cell": None,
        "code_cells": sum(c.cell_type == "code" for c in nb.cells),
        "ename": "",
        "evalue": "",
    }

    def save():
        Path(result_path).write_text(json.dumps(result))

    def on_cell_start(cell, cell_index):
        result.update(status="running", cell=cell_index, started=time.monotonic())
        save()

    save()
    # interrupt_on_timeout: a cell over time gets KeyboardInterrupt, so labs.launch stops its ranks
    client = NotebookClient(
        nb,
        timeout=cell_timeout,
        interrupt_on_timeout=True,
        kernel_name="python3",
        startup_timeout=120,
        resources={"metadata": {"path": str(Path(src).parent)}},
        on_cell_start=on_cell_start,
    )
    try:
        client.execute()
        result["status"] = "ok"
    except CellTimeoutError as exc:
        result.update(
            status="cell-timeout", ename="CellTimeoutError", evalue=str(exc).splitlines()[0]
        )
    except CellExecutionError as exc:
        over_time = (
            exc.ename == "KeyboardInterrupt"
            and time.monotonic() - result.get("started", 0) >= cell_timeout
        )
        result.update(
            status="cell-timeout" if over_time else "error",
            ename=exc.ename,
            evalue=f"interrupted after {cell_timeout:g} s" if over_time else exc.evalue,
        )
    except DeadKernelError as exc:
        result.update(status="kernel-died", ename="DeadKernelError", evalue=str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure is the notebook's result, reported to the grader
        result.update(status="error", ename=type(exc).__name__, evalue=str(exc))
    finally:
        nbformat.write(nb, dst)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
