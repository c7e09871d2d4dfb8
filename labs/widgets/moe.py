"""Routing and load visualizer (notebook 07): who gets the tokens, what capacity drops, what the
aux loss does.

    # a synthetic router to play with: sliders for E, k, ranks, skew, cf
    routing_visualizer()
    # heat map: pairs per expert (columns) per rank (rows)
    draw_load(counts, capacity=20)
    # share of pairs dropped as the capacity factor grows
    draw_capacity_sweep(sweep, current=1.25)
    # imbalance and drops per step, with and without the aux loss
    draw_balance(curves)
    # the same heat map for real runs
    draw_run_load(summary)
    draw_balance_loads(curves)
    # an EP run's losses over the reference's
    draw_losses(summary)

The numbers come from ``labs.theory.moe`` (synthetic routing, capacity, drops) or from a real
run (``labs.experiments.moe.run`` and ``balance_run``); this module only draws.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from labs.theory import moe as theory

CAPACITY_FACTORS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]


def draw_load(counts: list[list[int]], capacity: int | None = None, ax=None, title: str = ""):
    """Heat map of ``counts[rank][expert]`` (pairs routed before dropping); a cell over ``capacity``
    shows how many pairs that rank's group drops there. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.55 * len(counts[0]), 0.9 + 0.45 * len(counts)))
    image = ax.imshow(counts, cmap="viridis", aspect="auto")
    bright = 0.6 * max(map(max, counts))  # above it a cell is light: black text
    for r, row in enumerate(counts):
        for e, n in enumerate(row):
            over = capacity is not None and n > capacity
            if over:
                colour = "red"
            else:
                colour = "black" if n > bright else "white"
            ax.text(
                e,
                r,
                f"{n}\n-{n - capacity}" if over else str(n),
                ha="center",
                va="center",
                fontsize=7,
                color=colour,
            )
    ax.set_xticks(range(len(counts[0])), [f"e{e}" for e in range(len(counts[0]))])
    ax.set_yticks(range(len(counts)), [f"rank {r}" for r in range(len(counts))])
    ax.set_xlabel("expert")
    if capacity is not None:
        cap = f", capacity {capacity} per rank (red: dropped)"
    else:
        cap = ", no capacity limit"
    ax.set_title((title + "\n" if title else "") + f"pairs per expert{cap}", fontsize=9)
    ax.figure.colorbar(image, ax=ax, fraction=0.04)
    return ax


def draw_capacity_sweep(sweep: list[dict], current: float | None = None, ax=None):
    """Share of (token, choice) pairs dropped against the capacity factor
    (``theory.capacity_sweep``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot([r["capacity_factor"] for r in sweep], [100 * r["dropped_share"] for r in sweep], "o-")
    if current is not None:
        ax.axvline(current, color="grey", ls="--", lw=1, label=f"cf = {current:g}")
        ax.legend(fontsize=8)
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("pairs dropped (%)")
    ax.set_title("capacity vs dropped tokens", fontsize=9)
    ax.grid(alpha=0.3)
    return ax


def draw_balance(curves: dict, axes=None):
    """Per step, for each aux-loss coefficient: imbalance (max/mean load, worst layer and rank) and
    the share of pairs dropped (``labs.experiments.moe.balance_run``). Returns the figure."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9, 3))
    for coef, rows in curves.items():
        label = f"aux coef {coef:g}" if coef else "no aux loss"
        axes[0].plot(range(1, len(rows["imbalance"]) + 1), rows["imbalance"], label=label)
        axes[1].plot(
            range(1, len(rows["dropped_share"]) + 1),
            [100 * d for d in rows["dropped_share"]],
            label=label,
        )
    axes[0].set_ylabel("imbalance (max / mean)")
    axes[1].set_ylabel("pairs dropped (%)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].figure.suptitle("load balance during training", fontsize=10)
    axes[0].figure.tight_layout()
    return axes[0].figure


def draw_losses(summary: dict, ax=None):
    """The EP run's loss per step over the single-process reference's
    (``labs.experiments.moe.run``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    steps = range(1, len(summary["losses"]) + 1)
    ax.plot(steps, summary["reference_losses"], "o-", label="single process (reference)")
    ax.plot(
        steps,
        summary["losses"],
        "x--",
        label=f"EP={summary['ep']} x DP on {summary['nproc']} ranks",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy + aux)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def draw_run_load(summary: dict, layer: int = 0, ax=None):
    """The heat map for a real EP run (``labs.experiments.moe.run``): pairs per expert per rank at
    step 1."""
    counts = [per_layer[layer] for per_layer in summary["chosen_per_expert"]]
    return draw_load(
        counts,
        summary["capacity"],
        ax=ax,
        title=f"layer {layer}, step 1 on {summary['nproc']} ranks "
        f"(ep={summary['ep']}, top-{summary['top_k']})",
    )


def draw_balance_loads(curves: dict, step: int = -1, layer: int = 0):
    """Side by side, one heat map per aux-loss coefficient: the load of ``layer`` at ``step`` of
    ``balance_run`` (rows: the routing groups, as ranks). Returns the figure."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 2.6), squeeze=False)
    for ax, (coef, rows) in zip(axes[0], curves.items()):
        label = f"aux coef {coef:g}" if coef else "no aux loss"
        shown = len(rows["counts"]) if step == -1 else step + 1  # 1-based
        draw_load(
            rows["counts"][step][layer],
            rows["capacity"],
            ax=ax,
            title=f"{label}, layer {layer}, step {shown}",
        )
    fig.tight_layout()
    return fig


def draw_synthetic(
    *,
    tokens: int = 256,
    n_experts: int = 8,
    top_k: int = 2,
    ranks: int = 4,
    skew: float = 1.0,
    capacity_factor: float = 1.25,
    seed: int = 0,
):
    """The visualizer's drawing for one setting: the load heat map and the capacity sweep. Returns
    (figure, facts) with the capacity, pairs dropped and the imbalance."""
    counts = theory.synthetic_routing(
        tokens=tokens, n_experts=n_experts, top_k=top_k, ranks=ranks, skew=skew, seed=seed
    )
    capacity = theory.expert_capacity(tokens, top_k, n_experts, capacity_factor)
    sweep = theory.capacity_sweep(
        counts, tokens, top_k, sorted(set(CAPACITY_FACTORS + [capacity_factor]))
    )
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 0.9 + max(3.0, 0.45 * ranks)), gridspec_kw={"width_ratios": [1.6, 1]}
    )
    draw_load(counts, capacity, ax=left, title=f"synthetic router, skew {skew:g}")
    draw_capacity_sweep(sweep, current=capacity_factor, ax=right)
    fig.tight_layout()
    facts = {
        "capacity": capacity,
        "dropped": sum(theory.dropped_pairs(row, capacity) for row in counts),
        "pairs": ranks * tokens * top_k,
        "imbalance": max(theory.imbalance(row) for row in counts),
    }
    return fig, facts


def routing_visualizer(**initial):
    """The interactive widget over :func:`draw_synthetic`."""
    import ipywidgets as w
    from IPython.display import display

    settings = {
        "tokens": 256,
        "n_experts": 8,
        "top_k": 2,
        "ranks": 4,
        "skew": 1.0,
        "capacity_factor": 1.25,
    }
    settings.update(initial)
    boxes = {
        "tokens": w.IntSlider(min=16, max=1024, step=16, description="tokens/rank"),
        "n_experts": w.IntSlider(min=2, max=16, description="experts"),
        "top_k": w.IntSlider(min=1, max=4, description="top-k"),
        "ranks": w.IntSlider(min=1, max=8, description="EP ranks"),
        "skew": w.FloatSlider(min=0.0, max=4.0, step=0.25, description="router skew"),
        "capacity_factor": w.FloatSlider(min=0.25, max=3.0, step=0.25, description="capacity f."),
    }
    for name, box in boxes.items():
        box.value = settings[name]
    out = w.Output()
    text = w.HTML()

    def redraw(*_):
        if boxes["top_k"].value > boxes["n_experts"].value:
            # keep the sliders consistent, not an error
            boxes["top_k"].value = boxes["n_experts"].value
            return
        with out:
            out.clear_output(wait=True)
            fig, facts = draw_synthetic(**{k: b.value for k, b in boxes.items()})
            display(fig)
            plt.close(fig)
        text.value = (
            f"capacity {facts['capacity']} pairs per expert per rank; {facts['dropped']} of "
            f"{facts['pairs']} pairs dropped ({100 * facts['dropped'] / facts['pairs']:.1f}%); "
            f"worst imbalance {facts['imbalance']:.2f}"
        )

    for box in boxes.values():
        box.observe(redraw, "value")
    redraw()
    controls = list(boxes.values())
    box = w.VBox([w.HBox(controls[:3]), w.HBox(controls[3:]), text, out])
    display(box)
    return box
