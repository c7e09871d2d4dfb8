"""Collective visualizer (notebook 00): each rank's tensor before and after a collective.

    collective_visualizer()                # dropdown for the collective, slider for the world size
    draw_collective("reduce_scatter", 4)   # the same drawing, as a plain matplotlib figure

The semantics come from ``labs.theory.collectives.simulate``; this module only draws.
A cell coloured like one rank holds that rank's data; a grey cell holds a sum, with
the contributing ranks written under the value.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from labs.theory.collectives import OPS, simulate

RANK_COLOURS = plt.get_cmap("tab10")


def _draw_state(ax, state, title, n):
    ax.set_title(title, fontsize=10)
    width = max(len(row) for row in state)
    for r, row in enumerate(state):
        for i, (value, sources) in enumerate(row):
            colour = RANK_COLOURS(next(iter(sources)) % 10) if len(sources) == 1 else "0.8"
            ax.add_patch(
                Rectangle((i, -r - 1), 0.95, 0.9, facecolor=colour, edgecolor="black", alpha=0.85)
            )
            label = (
                str(value)
                if len(sources) == 1
                else f"{value}\nΣ{''.join(str(s) for s in sorted(sources))}"
            )
            ax.text(i + 0.47, -r - 0.55, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.1, width)
    ax.set_ylim(-n - 0.1, 0.1)
    ax.set_yticks([-r - 0.55 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def draw_collective(op: str, world_size: int, root: int = 0):
    """A figure with every rank's chunks before and after ``op``; returns (figure, simulation)."""
    sim = simulate(op, world_size, root=root)
    fig, (before, after) = plt.subplots(1, 2, figsize=(9, 0.6 + 0.55 * world_size))
    _draw_state(before, sim["before"], "before", world_size)
    _draw_state(after, sim["after"], "after", world_size)
    fig.suptitle(
        f"{op}: {sim['description']}\nbytes sent per rank ="
        f" {sim['chunks_sent_per_rank']:.3g} chunks of a {sim['tensor_chunks']}-chunk tensor",
        fontsize=10,
    )
    fig.tight_layout()
    return fig, sim


def collective_visualizer(op: str = "all_reduce", world_size: int = 4):
    """The interactive widget: choose a collective and a world size, see before and after."""
    import ipywidgets as w
    from IPython.display import display

    op_box = w.Dropdown(options=OPS, value=op, description="collective")
    n_box = w.IntSlider(value=world_size, min=2, max=8, description="world size")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, _ = draw_collective(op_box.value, n_box.value)
            display(fig)
            plt.close(fig)

    op_box.observe(redraw, "value")
    n_box.observe(redraw, "value")
    redraw()
    box = w.VBox([w.HBox([op_box, n_box]), out])
    display(box)
    return box
