"""Sharding visualizer (notebook 04): one transformer block cut over tp ranks, and the lab's
plots.

    sharding_visualizer()                      # choose tp, SP: weights, activations, collectives
    draw_block_sharding(spec, tp=4, sp=True)   # the same drawing as a plain matplotlib figure
    plot_losses(summary)
    plot_saved_activations(no_sp, sp)
    plot_layer_comm(spec)

Left: every weight of the block as a rectangle ([out, in], as ``nn.Linear.weight``), cut into the
parts each rank holds, coloured by rank (grey: replicated on every rank). Right: the block's
forward, op by op, with each rank's activation shape (a bar coloured by rank when the ranks hold
different parts, grey when they hold the same tensor, hatched for partial sums) and every
collective with its forward and backward op and byte counts. The numbers come from
``labs.theory.tensor_parallel``; this module only draws.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from labs.theory import tensor_parallel as theory

RANK_COLOURS = plt.get_cmap("tab10")
OP_NAMES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _draw_weights(ax, spec, tp):
    shards = [w for w in theory.weight_shards(spec, tp=tp) if w["in_block"]]
    scale = max(max(w["shape"]) for w in shards)
    x = 0.0
    for w in shards:
        if len(w["shape"]) == 2:
            rows, cols = w["shape"]
        else:  # a norm's vector, drawn as a thin column
            rows = w["shape"][0]
            cols = max(1, scale // 16)
        h = 3.0 * rows / scale
        wd = 3.0 * cols / scale
        for r in range(tp if w["dim"] is not None else 1):
            colour = RANK_COLOURS(r % 10) if w["dim"] is not None else "0.75"
            if w["dim"] == 0:  # rows of the weight (output features), rank 0 on top
                patch = Rectangle((x, 3 - h * (r + 1) / tp), wd, h / tp)
            elif w["dim"] == 1:  # columns: input features
                patch = Rectangle((x + wd * r / tp, 3 - h), wd / tp, h)
            else:
                patch = Rectangle((x, 3 - h), wd, h)
            patch.set(facecolor=colour, edgecolor="black", linewidth=0.6, alpha=0.85)
            ax.add_patch(patch)
        name = w["name"].split(".")[-1]
        label = f"{name}\n{list(w['shape'])}\n{w['split']}\nrank: {list(w['rank_shape'])}"
        ax.text(x + wd / 2, 3 - h - 0.08, label, ha="center", va="top", fontsize=7)
        x += wd + 0.45
    ax.set_xlim(-0.2, x)
    ax.set_ylim(-0.6, 3.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"weights of one block on {tp} rank(s) (colour = rank, grey = replicated)", fontsize=10
    )


def _activation_bar(ax, y, step, tp):
    layout = step["layout"]
    if layout in ("replicated", "partial sums"):
        hatch = "///" if layout == "partial sums" else None
        ax.add_patch(
            Rectangle(
                (0, y - 0.3), 1, 0.6, facecolor="0.8", edgecolor="black", hatch=hatch, linewidth=0.6
            )
        )
        return
    for r in range(tp):  # split: rank r holds the r-th part
        ax.add_patch(
            Rectangle(
                (r / tp, y - 0.3),
                1 / tp,
                0.6,
                facecolor=RANK_COLOURS(r % 10),
                edgecolor="black",
                linewidth=0.6,
                alpha=0.85,
            )
        )


def _draw_flow(ax, flow, tp):
    n = len(flow)
    for i, step in enumerate(flow):
        y = n - i
        if step["kind"] == "collective":
            payload = _bytes(step["payload_bytes"])
            fwd = "fwd: identity"
            if step["forward"]:
                sent = _bytes(step["forward_sent_bytes"])
                fwd = f"fwd {OP_NAMES[step['forward']]} {payload}, sends {sent}/rank"
            bwd = "bwd: identity"
            if step["backward"]:
                sent = _bytes(step["backward_sent_bytes"])
                bwd = f"bwd {OP_NAMES[step['backward']]} {payload}, sends {sent}/rank"
            ax.add_patch(
                Rectangle(
                    (0, y - 0.3), 1, 0.6, facecolor="#fde0dd", edgecolor="#c51b8a", linewidth=1.2
                )
            )
            ax.text(
                0.5,
                y,
                step["op"],
                ha="center",
                va="center",
                fontsize=8,
                color="#7a0177",
                weight="bold",
            )
            ax.text(1.08, y, f"{fwd}  |  {bwd}", va="center", fontsize=8, color="#7a0177")
        else:
            _activation_bar(ax, y, step, tp)
            ax.text(-0.05, y, step["op"], ha="right", va="center", fontsize=8)
            ax.text(
                1.08,
                y,
                f"{list(step['shape'])} per rank, {step['layout']}",
                va="center",
                fontsize=8,
            )
    ax.set_xlim(-1.1, 3.6)
    ax.set_ylim(0.3, n + 0.7)
    ax.axis("off")


def draw_block_sharding(
    spec=theory.COURSE_MODEL,
    *,
    tp: int = 2,
    sp: bool = False,
    batch: int = 8,
    seq: int = 32,
    dtype_bytes: int = 4,
):
    """The visualizer's drawing for one block of ``spec``; returns (figure, flow, comm summary of
    the block)."""
    flow = theory.block_flow(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    summary = theory.comm_summary(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    comm = summary["block"]
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(11, 2.6 + 0.33 * len(flow)),
        gridspec_kw={"height_ratios": [2.2, 0.33 * len(flow)]},
    )
    _draw_weights(top, spec, tp)
    _draw_flow(bottom, flow, tp)
    sent = sum(e["sent_bytes"] for phase in comm.values() for e in phase.values())
    calls = ", ".join(
        f"{phase}: " + " + ".join(f"{e['calls']} {OP_NAMES[op]}" for op, e in comm[phase].items())
        for phase in ("forward", "backward")
        if phase in comm
    )
    bottom.set_title(
        f"forward through one block, B={batch}, T={seq}, {'with' if sp else 'without'} SP\n"
        f"per block {calls}; {_bytes(sent)} sent per rank per step",
        fontsize=9,
    )
    fig.tight_layout()
    return fig, flow, comm


def sharding_visualizer(
    spec=theory.COURSE_MODEL, *, tp: int = 2, sp: bool = False, batch: int = 8, seq: int = 32
):
    """The interactive widget: TP degree (the degrees that divide every split dimension) and SP on
    or off."""
    import ipywidgets as w
    from IPython.display import display

    degrees = [
        d
        for d in (1, 2, 4, 8, 16)
        if not any(
            n % d
            for n in (spec.n_heads, spec.kv_heads, spec.hidden, spec.ffn, spec.vocab_size, seq)
        )
    ]
    tp_box = w.Dropdown(
        options=degrees, value=tp if tp in degrees else degrees[-1], description="tp"
    )
    sp_box = w.Checkbox(value=sp, description="sequence parallel")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, _, _ = draw_block_sharding(
                spec, tp=tp_box.value, sp=sp_box.value, batch=batch, seq=seq
            )
            display(fig)
            plt.close(fig)

    tp_box.observe(redraw, "value")
    sp_box.observe(redraw, "value")
    redraw()
    box = w.VBox([w.HBox([tp_box, sp_box]), out])
    display(box)
    return box


def plot_losses(*summaries, ax=None):
    """Each run's losses (and torch's, when measured) over the reference's."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    ref = summaries[0]["reference_losses"]
    ax.plot(range(1, len(ref) + 1), ref, "k-", lw=3, alpha=0.3, label="single process (reference)")
    for i, s in enumerate(summaries):
        label = f"{s['model']}, tp={s['tp']}{' + SP' if s['sp'] else ''}"
        ax.plot(
            range(1, len(s["losses"]) + 1),
            s["losses"],
            "o--",
            ms=4,
            color=RANK_COLOURS(i),
            label=label,
        )
        if s.get("torch_losses"):
            ax.plot(
                range(1, len(s["torch_losses"]) + 1),
                s["torch_losses"],
                "x:",
                color=RANK_COLOURS(i),
                label=label + " (torch DTensor)",
            )
    ax.set_xticks(range(1, len(ref) + 1))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_saved_activations(*summaries, ax=None):
    """Saved activation bytes per rank, measured (bars) and the theory's figure (markers), per
    run."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"tp={s['tp']}{' + SP' if s['sp'] else ''}" for s in summaries]
    measured = [s["saved_activation_bytes"][0] / 1024 for s in summaries]
    ax.bar(
        labels,
        measured,
        color=[RANK_COLOURS(i) for i in range(len(summaries))],
        alpha=0.7,
        label="measured",
    )
    ax.plot(
        labels,
        [s["theory_saved_activation_bytes"] / 1024 for s in summaries],
        "k_",
        ms=30,
        mew=2,
        label="theory",
    )
    ax.set_ylabel("saved for backward, KiB per rank")
    ax.legend(fontsize=8)
    return ax


def plot_layer_comm(
    spec, *, seq: int = 4096, mbs: int = 1, tps=(2, 4, 8, 16, 32), links=None, ax=None, **kw
):
    """TP's communication time over compute time for one layer, against tp, on each link of
    ``links`` (name -> GB/s; default ``theory.LINKS``): above 1, the GPUs wait on the network more
    than they compute."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4))
    for name, gbs in (links or theory.LINKS).items():
        rows = [
            theory.layer_comm_vs_compute(spec, tp=t, seq=seq, mbs=mbs, link_gbs=gbs, **kw)
            for t in tps
        ]
        ax.plot(tps, [r["comm_over_compute"] for r in rows], "o-", label=f"{name}, {gbs:g} GB/s")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.axvline(8, color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(tps), [str(t) for t in tps])
    ax.text(8, 1.05, " 8 GPUs: one node", fontsize=8)
    ax.set_title(f"TP collectives vs matmuls, one layer, seq={seq}, micro-batch {mbs}", fontsize=9)
    ax.set_xlabel("tp")
    ax.set_ylabel("comm time / compute time per layer")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax
