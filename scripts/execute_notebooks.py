"""Execute notebooks in place, the way CI validates them, so their committed outputs are current.

    .venv/bin/python scripts/execute_notebooks.py                      # every notebook
    .venv/bin/python scripts/execute_notebooks.py notebooks/00_*.ipynb  # some

Runs with the reference solutions (LABS_IMPL=solutions), from the notebooks/ folder,
with widget state stored so a reader sees the widgets' last drawing without running.
Cells tagged ``raises-exception`` may fail; any other failure stops with the cell shown.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    os.environ.update(
        LABS_IMPL="solutions",
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        PYTHONHASHSEED="0",
    )
    t0 = time.perf_counter()
    try:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
            store_widget_state=True,
        ).execute()
    finally:
        # on failure too: the outputs up to the failing cell show what went wrong
        nbformat.write(nb, path)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
