"""Notebooks on the spawn path, as macOS runs them: notebook 00 and a training notebook, 07 (a
mixture-of-experts model trained with expert parallelism: the lightest of the training notebooks),
executed end to end under ``LABS_START_METHOD=spawn``.

Both run in one kernel, one after the other, as in a learner's session: the first launch starts
the warm workers (``labs.runtime.pool``), every later launch reuses them. The cells that nbval
checks (``# NBVAL_CHECK_OUTPUT``) must print what the committed notebook shows, every notebook's
final assertions must pass, and each launch's start time is printed (``pytest -s``).
"""

import json
import statistics

import nbformat
import pytest

from tests.helpers import ROOT, NudgingNotebookClient

NOTEBOOKS = ("00_setup_and_collectives.ipynb", "07_mixture_of_experts.ipynb")
CHECK = "# NBVAL_CHECK_OUTPUT"
HISTORY = (
    "import json\n"
    "from labs.runtime.pool import worker_pool\n"
    "starts = [vars(start) for start in worker_pool().history]\n"
    "print(json.dumps({'starts': starts, 'replaced': worker_pool().replaced}))"
)


def shown_text(outputs) -> str:
    """What a cell prints: its streams and the text of its results (pictures left out)."""
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts).strip()


@pytest.mark.slow
def test_notebooks_run_end_to_end_on_the_spawn_path(monkeypatch):
    monkeypatch.setenv("LABS_START_METHOD", "spawn")  # the kernel, and so its launches, inherit it
    committed = [
        cell
        for name in NOTEBOOKS
        for cell in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
    ]
    cells = [nbformat.from_dict(cell) for cell in committed]
    session = nbformat.v4.new_notebook(cells=cells + [nbformat.v4.new_code_cell(HISTORY)])
    NudgingNotebookClient(
        session,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    ).execute()

    for before, after in zip(committed, session.cells):
        if before.cell_type == "code" and before.source.startswith(CHECK):
            assert shown_text(after.outputs) == shown_text(before.outputs), before.source
    pool = json.loads(session.cells[-1].outputs[0].text)
    starts = pool["starts"]
    print("spawned launches (ranks, warm workers, seconds to start):")
    print([(s["ranks"], s["warm"], round(s["seconds"], 3)) for s in starts])
    print("workers replaced:", pool["replaced"])
    assert len(starts) > 10 and starts[0]["warm"] == 0  # every launch went through the pool
    # cold: the first launch, the first of 8 ranks, and one right after a failed launch (its
    # killed workers' replacements were still importing torch)
    warm = [s["seconds"] for s in starts if s["warm"] == s["ranks"]]
    assert len(warm) >= len(starts) - 3, starts
    assert statistics.median(warm) < 0.5, warm
