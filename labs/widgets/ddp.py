"""Comm/compute overlap timeline (notebook 02): backward compute and all-reduces on two lanes.

    overlap_widget(measured=trace)                        # sliders; the measured run drawn below
    draw_overlap(simulate_ddp(variant="naive"), trace)    # the same drawing as a plain figure

The simulated timeline comes from ``labs.theory.overlap.simulate_ddp``, the measured one
from ``labs.experiments.ddp.measure_overlap`` (a real run, every rank traced); both are
lists of span dicts (lane "compute" or "comm", start, end, bucket). This module only draws.
Red marks exposed communication: the time between the end of backward and the end of
the last all-reduce, which the optimizer step waits for.
"""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from labs.theory.overlap import VARIANTS, simulate_ddp

BUCKET_COLOURS = plt.get_cmap("tab20")
KIND_COLOURS = {"forward": "0.85", "wait": "tab:red", "optimizer": "0.55"}


def _colour(span):
    if span.get("kind") in KIND_COLOURS:
        return KIND_COLOURS[span["kind"]]
    return "0.7" if span["bucket"] is None else BUCKET_COLOURS(span["bucket"] % 20)


def draw_lanes(ax, spans: list[dict], *, title: str, scale: float = 1e3, unit: str = "ms"):
    """Two lanes (compute above, comm below) per rank; spans without a rank are rank 0's."""
    ranks = sorted({s.get("rank", 0) for s in spans})
    labels = []
    for i, rank in enumerate(ranks):
        mine = [s for s in spans if s.get("rank", 0) == rank]
        for lane_index, lane in enumerate(("compute", "comm")):
            y = 2 * i + lane_index
            labels.append((y, f"rank {rank} {lane}" if len(ranks) > 1 else lane))
            lane_spans = [s for s in mine if s["lane"] == lane]
            # a real run's all-reduces can overlap (queued behind each other): then they are
            # drawn half height, staggered
            stagger = lane == "comm" and any(
                a["start"] < b["end"] and b["start"] < a["end"]
                for a in lane_spans
                for b in lane_spans
                if a is not b
            )
            for s in lane_spans:
                if stagger:  # even buckets above the lane's centre, odd ones below
                    height = 0.4
                    offset = 0.2 * (1 - 2 * (s["bucket"] % 2))
                else:
                    height = 0.8
                    offset = 0.0
                ax.barh(
                    y + offset,
                    (s["end"] - s["start"]) * scale,
                    left=s["start"] * scale,
                    height=height,
                    color=_colour(s),
                    edgecolor="black",
                    linewidth=0.3,
                    alpha=0.9,
                )
        backward = [
            s for s in mine if s["lane"] == "compute" and s.get("kind", "backward") == "backward"
        ]
        compute_end = max((s["end"] for s in backward), default=0.0)
        comm_end = max((s["end"] for s in mine if s["lane"] == "comm"), default=0.0)
        if comm_end > compute_end:
            ax.add_patch(
                Rectangle(
                    (compute_end * scale, 2 * i - 0.45),
                    (comm_end - compute_end) * scale,
                    1.9,
                    color="tab:red",
                    alpha=0.12,
                    zorder=0,
                )
            )
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=8)
    ax.set_ylim(2 * len(ranks) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9)
    return ax


def simulated_title(sim: dict) -> str:
    return (
        f"model: {sim['variant']}, {sim['params_m']:.3g}M params on {sim['ranks']} ranks, "
        f"{sim['calls']} all-reduces; "
        f"backward {sim['backward_s'] * 1e3:.1f} ms, comm {sim['comm_s'] * 1e3:.1f} ms, "
        f"exposed {sim['exposed_s'] * 1e3:.1f} ms ({sim['hidden_fraction']:.0%} of comm hidden)"
    )


def measured_title(trace: dict) -> str:
    exposed = ", ".join(f"{r['exposed_s'] * 1e3:.1f}" for r in trace["per_rank"])
    backward = ", ".join(f"{r['backward_s'] * 1e3:.1f}" for r in trace["per_rank"])
    return (
        f"measured: {trace['variant']} on {trace['nproc']} ranks (gloo),"
        f" {trace['per_rank'][0]['all_reduces']} all-reduces; backward {backward} ms,"
        f" exposed {exposed} ms per rank"
    )


def draw_overlap(sim: dict, measured: dict | None = None):
    """The simulated timeline, and below it the measured one when given; returns the figure."""
    rows = 1 + (measured is not None)
    heights = [1.0] + ([max(1.0, len(measured["per_rank"]))] if measured else [])
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(10, 1.6 + 1.3 * sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    draw_lanes(axes[0][0], sim["spans"], title=simulated_title(sim))
    if measured is not None:
        draw_lanes(axes[1][0], measured["spans"], title=measured_title(measured))
    fig.legend(
        handles=[
            Patch(color=BUCKET_COLOURS(0), label="bucket 0 (backward segment, its all-reduce)"),
            Patch(color=BUCKET_COLOURS(1), label="bucket 1 ..."),
            Patch(color="tab:red", alpha=0.5, label="exposed communication / wait"),
            Patch(color="0.85", label="forward"),
            Patch(color="0.55", label="optimizer"),
        ],
        loc="lower center",
        ncol=5,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def overlap_widget(measured: dict | None = None, **defaults):
    """Sliders for the scenario of ``simulate_ddp`` (keyword defaults override its own); the
    measured trace, when given, stays drawn below for comparison."""
    import ipywidgets as w
    from IPython.display import display

    s = {name: p.default for name, p in inspect.signature(simulate_ddp).parameters.items()}
    s.update(defaults)
    log = dict(base=10, readout_format=".3g")
    controls = {
        "variant": w.Dropdown(options=VARIANTS, value=s["variant"], description="variant"),
        "params_m": w.FloatLogSlider(
            value=s["params_m"], min=-1, max=5, description="params (M)", **log
        ),
        "layers": w.IntSlider(value=s["layers"], min=1, max=128, description="layers"),
        "bucket_mb": w.FloatLogSlider(
            value=s["bucket_mb"], min=-2, max=3, description="bucket MiB", **log
        ),
        "bytes_per_grad": w.Dropdown(
            options=[("bf16", 2), ("fp32", 4)], value=s["bytes_per_grad"], description="gradients"
        ),
        "bandwidth_gbs": w.FloatLogSlider(
            value=s["bandwidth_gbs"], min=-2, max=3, description="GB/s", **log
        ),
        "latency_us": w.FloatLogSlider(
            value=s["latency_us"], min=0, max=4, description="latency µs", **log
        ),
        "tflops": w.FloatLogSlider(
            value=s["tflops"], min=-3, max=3.3, description="TFLOP/s", **log
        ),
        "ranks": w.IntSlider(value=s["ranks"], min=2, max=1024, description="ranks"),
        "tokens_per_rank": w.IntSlider(
            value=s["tokens_per_rank"], min=64, max=131072, step=64, description="tokens/rank"
        ),
    }
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig = draw_overlap(
                simulate_ddp(**{**s, **{k: c.value for k, c in controls.items()}}), measured
            )
            display(fig)
            plt.close(fig)

    for c in controls.values():
        c.observe(redraw, "value")
    redraw()
    items = list(controls.values())
    box = w.VBox([w.HBox(items[:5]), w.HBox(items[5:]), out])
    display(box)
    return box
