"""The parallelism planner and the device mesh, drawn (notebook 08).

    draw_mesh(ParallelDims(dp=2, tp=2, pp=2), gpus_per_node=4)   # which ranks share which group
    draw_plan(summary(plan(...)))                       # memory, communication and time of a plan
    draw_scaling(scaling(spec, [128, 256, 512], ...))   # compute, bubble, exposed comm by GPUs
    planner_widget("llama3-70b", seq=32768, gpus=512)   # the interactive planner

Every number comes from ``labs.theory.planner`` (``plan``, ``evaluate_layout``, ``summary``,
``format_result``) and the rank grid from ``labs.theory.dims``; this module only draws. The
widget shows the fastest layout, why (against the playbook's rule) and the five fastest; a
layout typed into its ``layout`` box is evaluated instead. Controls carry the CSS classes
``labs-planner-<name>`` (preset, seq, gpus, gpus-per-node, gpu, mbs, schedule, layout, ...),
the plan text ``labs-planner-result`` and the chart ``labs-planner-chart``, so a browser test can
drive the widget.
"""

from __future__ import annotations

import html

import matplotlib.pyplot as plt

from labs.theory.dims import AXES, ParallelDims
from labs.theory.exports import export
from labs.theory.memory import PP_SCHEDULES
from labs.theory.planner import ASSUMPTIONS, evaluate_layout, plan
from labs.theory.planner.report import format_result, summary
from labs.theory.presets import GPUS, PRESETS, preset

AXIS_COLOURS = {"dp": "tab:blue", "tp": "tab:red", "pp": "tab:green", "cp": "tab:purple"}
PARTS = (
    ("param", "parameters", "tab:blue"),
    ("grad", "gradients", "tab:orange"),
    ("optimizer", "optimizer state", "tab:green"),
    ("activation", "activations", "tab:red"),
)


def mesh_table(dims: ParallelDims) -> list[dict]:
    """One row per rank: its (dp, pp, cp, tp) coordinates and the index of its group along each
    axis."""
    rows = []
    for rank in range(dims.world_size):
        groups = {
            axis: next(i for i, g in enumerate(dims.groups(axis)) if rank in g) for axis in AXES
        }
        rows.append({"rank": rank, **dims.coords(rank), "groups": groups})
    return rows


def draw_mesh(dims: ParallelDims, *, gpus_per_node: int | None = None):
    """One row of ranks per axis with a degree > 1; ranks of one group share a colour and a label
    (``tp0``, ``tp1``...), nodes are grey boxes. Returns the figure."""
    axes = [a for a in ("tp", "cp", "pp", "dp") if dims.degrees[a] > 1] or ["dp"]
    node = gpus_per_node or dims.world_size
    table = mesh_table(dims)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * dims.world_size + 1.5), 0.75 * len(axes) + 1.2))
    cmap = plt.get_cmap("tab20")
    for row, axis in enumerate(axes):
        y = len(axes) - 1 - row
        for r in table:
            g = r["groups"][axis]
            ax.add_patch(
                plt.Rectangle(
                    (r["rank"] + 0.08, y + 0.12), 0.84, 0.76, color=cmap(g % 20), alpha=0.85
                )
            )
            ax.text(r["rank"] + 0.5, y + 0.5, f"{axis}{g}", ha="center", va="center", fontsize=8)
        ax.text(
            -0.2,
            y + 0.5,
            f"{axis.upper()} groups (size {dims.degrees[axis]})",
            ha="right",
            va="center",
            fontsize=9,
            color=AXIS_COLOURS[axis],
        )
    for start in range(0, dims.world_size, node):
        ax.add_patch(
            plt.Rectangle(
                (start + 0.02, -0.05),
                min(node, dims.world_size - start) - 0.04,
                len(axes) + 0.1,
                fill=False,
                edgecolor="0.5",
                linestyle="--",
            )
        )
        ax.text(
            start + min(node, dims.world_size - start) / 2,
            len(axes) + 0.15,
            f"node {start // node}",
            ha="center",
            va="bottom",
            fontsize=8,
            color="0.4",
        )
    ax.set_xticks(
        [r + 0.5 for r in range(dims.world_size)],
        [f"rank {r}" for r in range(dims.world_size)],
        fontsize=8,
    )
    ax.set_yticks([])
    ax.set_xlim(-0.1, dims.world_size + 0.1)
    ax.set_ylim(-0.2, len(axes) + 0.6)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    degrees = " x ".join(f"{a.upper()}={dims.degrees[a]}" for a in AXES)
    ax.set_title(f"{degrees}: ranks fill the (dp, pp, cp, tp) grid, tp innermost", fontsize=10)
    fig.tight_layout()
    return fig


def draw_plan(s: dict):
    """Three panels for a plan's ``summary``: memory per GPU by part against the budget and the
    GPU, bytes sent per GPU per step along each axis (inside a node or between nodes), and the
    step's time (compute, bubble, exposed communication). Returns the figure."""
    fig, (mem, comm, time) = plt.subplots(
        1, 3, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1.3, 1.1, 1.3]}
    )
    bottom = 0.0
    for key, label, colour in PARTS:
        mem.bar(
            [0],
            [s["memory_gib"][key]],
            bottom=bottom,
            color=colour,
            width=0.5,
            label=f"{label} {s['memory_gib'][key]:.1f}",
        )
        bottom += s["memory_gib"][key]
    mem.axhline(
        s["cluster"]["gpu_mem_gib"],
        color="black",
        linestyle="--",
        linewidth=1.2,
        label="GPU memory",
    )
    mem.axhline(
        s["budget_gib"], color="0.5", linestyle=":", linewidth=1.2, label="budget (less headroom)"
    )
    mem.set_xticks([0], [f"DP{s['dp']} TP{s['tp']} PP{s['pp']} CP{s['cp']}"], fontsize=8)
    mem.set_ylabel("GiB per GPU")
    mem.set_xlim(-0.5, 1.6)
    mem.set_ylim(0, max(bottom, s["cluster"]["gpu_mem_gib"]) * 1.1)
    mem.legend(fontsize=7, loc="center right")
    axes = ("tp", "cp", "pp", "dp")
    gb = [s["comm_bytes"][a] / 1e9 for a in axes]
    colours = [AXIS_COLOURS[a] if s["intra_node"][a] else "0.55" for a in axes]
    bars = comm.bar(axes, gb, color=colours)
    for bar, a in zip(bars, axes):
        comm.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height(),
            f"{s['comm_seconds'][a]:.2g} s\n{'intra' if s['intra_node'][a] else 'inter'}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    comm.set_ylabel("GB sent per GPU per step")
    comm.set_yscale("log")
    # a log scale: a decade below the smallest bar that is not empty, room for labels above
    smallest = min([g for g in gb if g > 0] + [1.0])
    comm.set_ylim(max(smallest / 10, 1e-6), max(gb + [1e-6]) * 20)
    comm.set_title("communication (grey: between nodes)", fontsize=9)
    pieces = (
        ("compute", s["compute_s"], "tab:blue"),
        ("imbalance", s["imbalance_s"], "tab:olive"),
        ("bubble", s["bubble_s"], "tab:orange"),
        ("exposed comm", s["exposed_comm_s"], "tab:red"),
    )
    left = 0.0
    for label, seconds, colour in pieces:
        time.barh([0], [seconds], left=left, color=colour, label=f"{label} {seconds:.3g} s")
        left += seconds
    time.set_yticks([])
    time.set_xlabel("seconds per step")
    time.set_title(
        f"scaling efficiency {s['scaling_efficiency']:.0%}, MFU {s['mfu']:.0%}", fontsize=9
    )
    time.set_ylim(-0.5, 1.6)
    time.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(
        f"{s['model']} on {s['world_size']} GPUs: global batch {s['global_batch']}, "
        f"{s['microbatches']} micro-batch(es) per DP rank",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def draw_scaling(rows: list[dict], *, title: str = ""):
    """For ``labs.theory.planner.scaling``'s rows: seconds per step split into compute, bubble and
    exposed communication (bars, one per GPU count, each scaled to its own step = 100%), and the
    scaling efficiency above them. Returns the figure."""
    rows = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = range(len(rows))
    parts = (
        ("compute", "compute_s", "tab:blue"),
        ("stage imbalance", "imbalance_s", "tab:olive"),
        ("bubble", "bubble_s", "tab:orange"),
        ("exposed communication", "exposed_comm_s", "tab:red"),
    )
    bottom = [0.0] * len(rows)
    for label, key, colour in parts:
        share = [100 * r[key] / r["step_time_s"] for r in rows]
        ax.bar(x, share, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, share)]
    for i, r in enumerate(rows):
        ax.text(i, 101, f"{r['scaling_efficiency']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(
        list(x),
        [f"{r['gpus']}\nDP{r['dp']} TP{r['tp']}\nPP{r['pp']} CP{r['cp']}" for r in rows],
        fontsize=7,
    )
    ax.set_ylabel("% of the step")
    ax.set_ylim(0, 115)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(title or "where the step goes (scaling efficiency on top)", fontsize=10)
    fig.tight_layout()
    return fig


def planner_widget(
    model: str = "llama3-70b",
    *,
    seq: int = 32768,
    gpus: int = 512,
    gpus_per_node: int = 8,
    gpu: str = "H100 80GB",
    global_batch: int = 0,
    recompute: str = "none",
):
    """The interactive planner: model, sequence, batch, cluster and the main assumptions; shows
    the plan (text), its chart, the rejected layouts and an export. Displays itself and returns
    the box."""
    import ipywidgets as w
    from IPython.display import display

    narrow = w.Layout(width="190px")
    style = {"description_width": "initial"}
    c = {
        "preset": w.Dropdown(options=list(PRESETS), value=model, description="model"),
        "seq": w.IntText(value=seq, description="seq", layout=narrow),
        "global_batch": w.IntText(
            value=global_batch,
            description="global batch (0: ~4M tokens)",
            style=style,
            layout=w.Layout(width="260px"),
        ),
        "gpus": w.IntText(value=gpus, description="GPUs", layout=narrow),
        "gpus_per_node": w.IntText(value=gpus_per_node, description="per node", layout=narrow),
        "gpu": w.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        "intra": w.FloatText(
            value=GPUS[gpu].intra_gbps, description="intra GB/s", layout=narrow, style=style
        ),
        "inter": w.FloatText(
            value=GPUS[gpu].inter_gbps, description="inter GB/s", layout=narrow, style=style
        ),
        "recompute": w.Dropdown(
            options=["none", "selective", "full"], value=recompute, description="recompute"
        ),
        "mbs": w.IntText(value=0, description="mbs (0: search)", style=style, layout=narrow),
        "schedule": w.Dropdown(
            options=["search", *PP_SCHEDULES], value="search", description="schedule"
        ),
        "layout": w.Text(
            value="",
            placeholder="tp=8,pp=4,cp=4,dp=4[,zero=1,v=2]",
            description="layout (empty: plan)",
            style=style,
            layout=w.Layout(width="420px"),
        ),
        "headroom": w.FloatSlider(
            value=ASSUMPTIONS["headroom"], min=0.0, max=0.5, step=0.05, description="headroom"
        ),
        "export": w.Dropdown(
            options=["torchrun", "accelerate", "deepspeed"], value="torchrun", description="export"
        ),
    }
    for name, widget in c.items():
        widget.add_class(f"labs-planner-{name.replace('_', '-')}")
    result = w.HTML().add_class("labs-planner-result")
    chart = w.Output().add_class("labs-planner-chart")
    exported = w.HTML().add_class("labs-planner-export-text")

    def redraw(*_):
        try:
            gpu = GPUS[c["gpu"].value]
            kw = dict(
                seq=c["seq"].value,
                gpus=c["gpus"].value,
                gpus_per_node=c["gpus_per_node"].value,
                gpu_mem_gib=gpu.memory_gib,
                peak_tflops=gpu.peak_tflops,
                intra_gbps=c["intra"].value,
                inter_gbps=c["inter"].value,
                global_batch=c["global_batch"].value or None,
                recompute=c["recompute"].value,
                headroom=c["headroom"].value,
                mbs=c["mbs"].value or None,
                schedule=None if c["schedule"].value == "search" else c["schedule"].value,
            )
            spec = preset(c["preset"].value)
            given = c["layout"].value.strip()
            p = evaluate_layout(spec, given, **kw) if given else plan(spec, **kw)
        except ValueError as e:
            result.value = f"<b style='color:darkred'>cannot plan: {e}</b>"
            exported.value = ""
            chart.clear_output()
            return
        s = summary(p, model=c["preset"].value)
        report = html.escape(format_result(s), quote=False)
        result.value = f"<pre style='font-size:11px; line-height:1.25'>{report}</pre>"
        try:
            text = export(c["export"].value, p)
        except ValueError as e:
            text = f"cannot export: {e}"
        exported.value = f"<pre style='font-size:11px'>{html.escape(text, quote=False)}</pre>"
        with chart:
            chart.clear_output(wait=True)
            fig = draw_plan(s)
            display(fig)
            plt.close(fig)

    def links(change):
        """A GPU brings its cluster's links (``labs.theory.presets.GPUS``); edit them after."""
        card = GPUS[change["new"]]
        for name, value in (("intra", card.intra_gbps), ("inter", card.inter_gbps)):
            c[name].unobserve(redraw, "value")  # the GPU's own change redraws once, after
            c[name].value = value
            c[name].observe(redraw, "value")

    c["gpu"].observe(links, "value")
    for widget in c.values():
        widget.observe(redraw, "value")
    redraw()

    def row(*names: str) -> w.HBox:
        return w.HBox([c[n] for n in names])

    box = w.VBox(
        [
            row("preset", "seq", "global_batch"),
            row("gpus", "gpus_per_node", "gpu"),
            row("intra", "inter", "recompute", "headroom"),
            row("mbs", "schedule", "layout"),
            chart,
            result,
            c["export"],
            exported,
        ]
    )
    display(box)
    return box
