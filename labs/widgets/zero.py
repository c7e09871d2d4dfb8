"""ZeRO-stage visualizer (notebook 03): what each rank holds at each moment of a training step.

    # stage, ranks, prefetch, offload; a slider steps through the step
    zero_visualizer(stage=3, dp=4)
    # the same drawing for moment 5, as a matplotlib figure
    draw_moment(3, 4, 5)

The moments and the bytes come from ``labs.theory.zero.step_moments`` (pure functions,
tested headless); this module only draws. The title names the lab's entry point for the stage
(``ENTRY_POINTS``). Each unit of the model is a column; each rank a
row. In a cell, three bars (P parameters, G gradients, O optimizer state) are cut into N
segments: all filled = the full tensor, one filled (the rank's own, r-th) = its shard,
hatched = being gathered ahead of use (prefetch), dotted = held on the host (offload),
empty = not held. The panel on the right gives each rank's device bytes at that moment
beside what the calculator says a rank holds between steps.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from labs.theory.zero import course_units, held_bytes, step_moments

COLOURS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
# How each stage is asked for in the lab (labs/zero.py), the same in a plain training loop
ENTRY_POINTS = {
    0: "DDP: every rank holds everything",
    1: "optimizer = ShardedOptimizer(model.parameters(), AdamW)",
    2: "optimizer = ShardedOptimizer(model.parameters(), AdamW, shard_grads=True)",
    3: "fully_shard(each unit); fully_shard(model); optimizer = AdamW(model.parameters())",
}
ROWS = (("params", "P"), ("grads", "G"), ("optimizer", "O"))


def _cell(ax, x, y, state, rank, n, colour):
    """One bar of N segments at (x, y), 1 wide and 0.22 high."""
    w = 0.9 / n
    for i in range(n):
        filled = state in ("full", "prefetch") or (state in ("shard", "host") and i == rank)
        hatch = {"prefetch": "///", "host": "..."}.get(state) if filled else None
        ax.add_patch(
            Rectangle(
                (x + i * w, y),
                w,
                0.22,
                facecolor=colour if filled and not hatch else "white",
                edgecolor=colour if filled else "0.75",
                hatch=hatch,
                linewidth=0.8,
            )
        )


def draw_moment(
    stage: int,
    dp: int,
    moment: int,
    *,
    units: list[tuple[str, int]] | None = None,
    prefetch: bool = True,
    offload: bool = False,
):
    """Every rank's holdings at ``moment`` of one step; returns (figure, frames)."""
    units = units or course_units()
    names = [n for n, _ in units]
    numels = [k for _, k in units]
    frames = step_moments(stage, numels, dp=dp, prefetch=prefetch, offload=offload, names=names)
    if not 0 <= moment < len(frames):
        raise ValueError(f"moment={moment} is outside 0..{len(frames) - 1} for stage {stage}")
    frame = frames[moment]
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(11, 0.9 + 0.75 * dp), width_ratios=[3, 1.3])
    for r in range(dp):
        for k in range(len(units)):
            for j, (kind, _) in enumerate(ROWS):
                _cell(grid, k, -r - 0.3 * (j + 1), frame[kind][k], r, dp, COLOURS[kind])
    grid.set_xlim(-0.05, len(units))
    grid.set_ylim(-dp - 0.05, 0.05)
    grid.set_xticks([k + 0.45 for k in range(len(units))], names, fontsize=9)
    grid.xaxis.tick_top()
    grid.set_yticks([-r - 0.5 for r in range(dp)], [f"rank {r}" for r in range(dp)])
    for side in ("right", "bottom", "left"):
        grid.spines[side].set_visible(False)
    grid.set_title(
        f"ZeRO-{stage} ({ENTRY_POINTS[stage]})\n"
        f"moment {moment + 1}/{len(frames)}: {frame['label']}; collective: {frame['collective']}",
        fontsize=10,
        pad=22,
    )
    _draw_bytes(bars, frame, held_bytes(numels, stage=stage, dp=dp, offload=offload), dp)
    fig.tight_layout()
    return fig, frames


def _draw_bytes(ax, frame, held, dp):
    left = [0.0] * dp
    for kind, label in ROWS:
        v = frame["bytes"][kind] / 1e3
        ax.barh(range(dp), [v] * dp, left=left, color=COLOURS[kind], label=label)
        left = [x + v for x in left]
    ax.axvline(
        held["total"] / 1e3, color="black", linestyle="--", label="calculator (between steps)"
    )
    if frame["bytes"]["host"]:
        ax.text(
            0.98,
            0.02,
            f"host: {frame['bytes']['host'] / 1e3:.0f} kB per rank",
            transform=ax.transAxes,
            ha="right",
            fontsize=8,
        )
    ax.set_yticks(range(dp), [f"rank {r}" for r in range(dp)])
    ax.invert_yaxis()
    ax.set_xlabel("device kB held now")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)


def zero_visualizer(stage: int = 3, dp: int = 4, *, units: list[tuple[str, int]] | None = None):
    """The widget: choose a stage, ranks, prefetch and offload; step through the moments."""
    import ipywidgets as w
    from IPython.display import display

    stage_box = w.Dropdown(options=[0, 1, 2, 3], value=stage, description="ZeRO stage")
    dp_box = w.IntSlider(value=dp, min=2, max=8, description="ranks")
    prefetch_box = w.Checkbox(value=True, description="prefetch")
    offload_box = w.Checkbox(value=False, description="offload")
    moment_box = w.IntSlider(value=0, min=0, max=1, description="moment")
    out = w.Output()

    def frames_now():
        numels = [k for _, k in (units or course_units())]
        return step_moments(
            stage_box.value,
            numels,
            dp=dp_box.value,
            prefetch=prefetch_box.value,
            offload=offload_box.value and stage_box.value > 0,
        )

    def redraw(*_):
        moment_box.max = len(frames_now()) - 1
        with out:
            out.clear_output(wait=True)
            fig, _ = draw_moment(
                stage_box.value,
                dp_box.value,
                moment_box.value,
                units=units,
                prefetch=prefetch_box.value,
                offload=offload_box.value and stage_box.value > 0,
            )
            display(fig)
            plt.close(fig)

    for box in (stage_box, dp_box, prefetch_box, offload_box, moment_box):
        box.observe(redraw, "value")
    redraw()
    ui = w.VBox([w.HBox([stage_box, dp_box, prefetch_box, offload_box]), moment_box, out])
    display(ui)
    return ui
