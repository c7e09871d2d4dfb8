"""Execute one notebook headless for grading, inside the sandbox, and send what happened to the
grader.

    python -I run_notebook.py NOTEBOOK.ipynb CELL_TIMEOUT_S OUTPUT_LIMIT_BYTES

NOTEBOOK is the one ``labs.grade.notebooks.prepare`` wrote: the student's cells, with the
release's tags on the release's cells and no tags on the student's own. It runs from its folder
with the environment it is given (``PYTHONPATH`` and ``LABS_IMPL=labs`` for the kernel; ``-I``
keeps this process itself on the installed packages only). Cells tagged ``raises-exception`` may
fail, as in CI.

This process holds the results channel (``LABS_GRADE_FD``) and makes itself non-dumpable before
the kernel starts: the kernel, which runs the student's code, does not inherit the channel and
cannot ptrace this process or open its file descriptors. It can only kill it, and then the report
ends early. Lines sent, as the run goes: ``{"cell": i}`` when cell i starts; ``{"ran": i, "ok":
bool}`` when code cell i has run (``ok`` false: it raised); at the end ``{"end": "ok" | "error" |
"cell-timeout" | "kernel-died", "ename", "evalue", "cut": bytes of output dropped}`` and then
``{"notebook": ...}``, the executed notebook. Outputs past OUTPUT_LIMIT_BYTES in all are dropped,
with a note in the cell where it happened (and the widget state, if it does not fit in what is
left). A cell over time is interrupted, so the ranks it
launched are stopped by ``labs.launch``, and reported as "cell-timeout".
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path
from queue import Empty

# jsonschema (nbformat's validator) imports rfc3987_syntax when installed, for its "iri" format,
# which compiles a grammar at import: 2 CPU-s of every notebook item, for a format nbformat never
# checks (it passes no format checker). Missing, jsonschema leaves that format out.
sys.modules.setdefault("rfc3987_syntax", None)

import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import (  # noqa: E402
    CellExecutionError,
    CellTimeoutError,
    DeadKernelError,
)

PR_SET_DUMPABLE = 4
EVALUE_LIMIT = 3000
NUDGE_S = 5.0  # waiting this long for a reply, the client sends the kernel a kernel_info request
# The kernel, asked to shut down, ends with os._exit(0): the interpreter's teardown with torch
# loaded is a second of CPU a notebook and decides nothing (``labs.runtime.exit``). The line runs
# once the kernel has started, before the first cell, leaving no name and no execution count;
# atexit runs its handler after those registered later (the warm worker pool's shutdown), before
# IPython's own.
KERNEL_EXITS_WITHOUT_TEARDOWN = (
    "--IPKernelApp.exec_lines=__import__('atexit').register(__import__('os')._exit, 0)"
)


RESULTS = {"fd": None}  # the results channel, taken out of the environment by main


def send(record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    fd = RESULTS["fd"]
    while data:
        data = data[os.write(fd, data) :]


class CappedClient(NotebookClient):
    """nbclient's client, keeping at most ``budget`` bytes of outputs in all, and nudging a kernel
    that seems to have missed a request.

    The nudge: after a cell with widgets, the kernel now and then leaves the next execute request
    unread until the cell timeout interrupts it (then runs it normally): 119 s lost, in 3 of about
    40 notebook runs here (nbclient issue 312 describes the same stall). A kernel_info request sent
    while the client waits gives the kernel's socket a new event, and the kernel reads both."""

    def __init__(self, nb, budget: int, **kw) -> None:
        super().__init__(nb, **kw)
        self.budget = budget
        self.cut = 0
        self.cut_cells: set[int] = set()

    async def async_start_new_kernel_client(self):
        client = await super().async_start_new_kernel_client()
        channel = client.shell_channel
        get_msg = channel.get_msg

        async def get_msg_nudging(timeout=None):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = NUDGE_S if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    return await get_msg(timeout=min(NUDGE_S, left))
                except Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    client.kernel_info()

        channel.get_msg = get_msg_nudging
        return client

    def output(self, outs, msg, display_id, cell_index):
        size = len(json.dumps(msg.get("content", {})))
        if size <= self.budget:
            self.budget -= size
            return super().output(outs, msg, display_id, cell_index)
        self._drop(outs, size, cell_index)
        return None

    def _update_display_id(self, display_id, msg):
        """An output updated in place (``display(..., display_id=True).update(...)``) replaces
        the data of every output with that id: what it adds counts against the budget too."""
        places = [
            (cell, index)
            for cell, indices in self._display_id_map.get(display_id, {}).items()
            for index in indices
        ]
        content = msg.get("content", {})
        new = _size(content)
        old = sum(_size(self.nb["cells"][cell]["outputs"][index]) for cell, index in places)
        grows = new * len(places) - old
        if grows > self.budget:
            cell = places[0][0] if places else 0
            self._drop(self.nb["cells"][cell]["outputs"], grows, cell)
            return None
        self.budget -= grows
        return super()._update_display_id(display_id, msg)

    def _drop(self, outs, size: int, cell_index: int) -> None:
        self.budget = 0
        self.cut += size
        if cell_index not in self.cut_cells:
            self.cut_cells.add(cell_index)
            note = "[the grader dropped this cell's further output: over the notebook's limit]\n"
            outs.append(nbformat.v4.new_output("stream", name="stderr", text=note))


def _size(output) -> int:
    """The bytes an output's data and metadata take in the notebook."""
    return len(json.dumps(output.get("data", {}))) + len(json.dumps(output.get("metadata", {})))


def main(src: str, cell_timeout: float, output_limit: int) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    RESULTS["fd"] = int(os.environ.pop("LABS_GRADE_FD"))  # the kernel gets neither it nor its name
    os.set_inheritable(RESULTS["fd"], False)
    nb = nbformat.read(src, as_version=4)
    started = {"at": 0.0}
    end = {"end": "starting", "ename": "", "evalue": "", "cut": 0}

    def on_cell_start(cell, cell_index):
        started["at"] = time.monotonic()
        send({"cell": cell_index})

    def on_cell_executed(cell, cell_index, execute_reply):
        status = (execute_reply or {}).get("content", {}).get("status")
        send({"ran": cell_index, "ok": status == "ok"})

    # interrupt_on_timeout: a cell over time gets KeyboardInterrupt, so labs.launch stops its ranks
    client = CappedClient(
        nb,
        output_limit,
        timeout=cell_timeout,
        interrupt_on_timeout=True,
        kernel_name="python3",
        extra_arguments=[KERNEL_EXITS_WITHOUT_TEARDOWN],
        startup_timeout=120,
        resources={"metadata": {"path": str(Path(src).parent)}},
        on_cell_start=on_cell_start,
        on_cell_executed=on_cell_executed,
    )
    try:
        client.execute()
        end["end"] = "ok"
    except CellTimeoutError as exc:
        end.update(end="cell-timeout", ename="CellTimeoutError", evalue=str(exc).splitlines()[0])
    except CellExecutionError as exc:
        over_time = (
            exc.ename == "KeyboardInterrupt" and time.monotonic() - started["at"] >= cell_timeout
        )
        end.update(
            end="cell-timeout" if over_time else "error",
            ename=exc.ename,
            evalue=f"interrupted after {cell_timeout:g} s" if over_time else exc.evalue,
        )
    except DeadKernelError as exc:
        end.update(end="kernel-died", ename="DeadKernelError", evalue=str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure is the notebook's result, for the grader
        end.update(end="error", ename=type(exc).__name__, evalue=str(exc))
    widgets = len(json.dumps(nb.metadata.get("widgets", {})))
    if widgets > client.budget:  # widget state counts towards the outputs' limit too
        nb.metadata.pop("widgets", None)
        client.cut += widgets
    end["evalue"] = str(end["evalue"])[:EVALUE_LIMIT]
    end["cut"] = client.cut
    send(end)
    send({"notebook": json.loads(nbformat.writes(nb))})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
