"""Memory calculator (notebook 01): what one GPU holds in a training run, and whether it fits.

    # the widget: presets or free dimensions (head_dim, MoE experts and top-k among them), every
    # option (FP8, optimizer bytes, CPU offload, EP, interleaved and zero-bubble pipelines), a
    # stacked bar per rank, the GPU's memory, a verdict, a sweep
    memory_calculator()
    draw_breakdown(result, 80.0)                         # the stacked bar alone, as a figure
    draw_sweep(sweep(spec, "seq", [...]), "seq", 80.0)   # memory against one parameter

Every number comes from ``labs.theory.memory`` (``memory_per_rank``, and ``evaluate`` / ``sweep``
in ``labs.theory.memory_report``); this module only draws. Controls carry the CSS classes
``labs-memory-<name>`` (preset, seq, zero, dp, tp, gpu, ...), the verdict ``labs-memory-verdict``
and the chart ``labs-memory-chart``, so a browser test can drive the widget.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from labs.theory.activations import RECOMPUTE
from labs.theory.memory import GIB, OPTIMIZERS, PP_SCHEDULES, PRECISIONS
from labs.theory.memory_report import DIMS, evaluate, spec_dims, sweep
from labs.theory.presets import GPUS, PRESETS

PARTS = (
    ("param_bytes", "parameters", "tab:blue"),
    ("grad_bytes", "gradients", "tab:orange"),
    ("optimizer_bytes", "optimizer state", "tab:green"),
    ("activation_bytes", "activations", "tab:red"),
)
SWEEPS = {
    "seq": [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
    "mbs": [1, 2, 4, 8, 16],
    "dp": [1, 2, 4, 8, 16, 32, 64],
    "zero": [0, 1, 2, 3],
    "tp": [1, 2, 4, 8, 16],
    "pp": [1, 2, 4, 8, 16],
    "cp": [1, 2, 4, 8, 16, 32],
    "recompute": list(RECOMPUTE),
}


def _gpu_line(ax, gpu_mem_gib: float, label: str) -> None:
    ax.axhline(gpu_mem_gib, color="black", linestyle="--", linewidth=1.2)
    ax.text(
        ax.get_xlim()[1],
        gpu_mem_gib,
        f" {label}: {gpu_mem_gib:.1f} GiB",
        va="bottom",
        ha="right",
        fontsize=8,
    )


def draw_breakdown(result: dict, gpu_mem_gib: float, *, gpu_label: str = "GPU", title: str = ""):
    """One stacked bar: parameters, gradients, optimizer state and activations of one rank (GiB),
    with a dashed line at the GPU's memory. Returns the figure."""
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    bottom = 0.0
    for key, label, colour in PARTS:
        gib = result[key] / GIB
        ax.bar([0], [gib], bottom=bottom, color=colour, width=0.5, label=f"{label} {gib:,.1f}")
        bottom += gib
    ax.set_xlim(-0.6, 0.6)
    ax.set_ylim(0, max(bottom, gpu_mem_gib) * 1.15)
    _gpu_line(ax, gpu_mem_gib, gpu_label)
    ax.set_xticks([0], [f"rank (stage {result['stage']})"])
    ax.set_ylabel("GiB per rank")
    ax.set_title(title or f"total {bottom:,.1f} GiB", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def draw_sweep(
    rows: list[dict], param: str, gpu_mem_gib: float, *, gpu_label: str = "GPU", ax=None
):
    """Stacked bars of the per-rank breakdown for each value of ``param``; values the layout
    rejects are marked 'invalid'. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, colour in PARTS:
        heights = [r[key] / GIB if "error" not in r else 0.0 for r in rows]
        ax.bar(x, heights, bottom=bottom, color=colour, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, r in enumerate(rows):
        if "error" in r:
            ax.text(i, 0, "invalid", rotation=90, ha="center", va="bottom", fontsize=8, color="0.4")
    ax.set_ylim(0, max(max(bottom), gpu_mem_gib) * 1.15)
    ax.set_xticks(list(x), [str(r["value"]) for r in rows], fontsize=8)
    _gpu_line(ax, gpu_mem_gib, gpu_label)
    ax.set_xlabel(param)
    ax.set_ylabel("GiB per rank")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return ax


def memory_calculator(preset: str = "llama3-8b", **run):
    """The interactive calculator. ``run`` sets initial values (seq, mbs, zero, dp, tp, ...).
    Displays itself and returns the box."""
    import ipywidgets as w
    from IPython.display import display

    def control(name, widget):
        widget.add_class(f"labs-memory-{name.replace('_', '-')}")
        return widget

    style = {"description_width": "initial"}
    layout = w.Layout(width="170px")
    c = {
        "preset": w.Dropdown(options=[*PRESETS, "custom"], value=preset, description="model"),
        "arch": w.Dropdown(options=["llama", "gpt"], value="llama", description="arch"),
        "tied": w.Checkbox(value=False, description="tied head"),
        **{d: w.IntText(description=d.replace("_", " "), style=style, layout=layout) for d in DIMS},
        "seq": w.IntText(value=run.get("seq", 4096), description="seq", layout=layout),
        "mbs": w.IntText(value=run.get("mbs", 1), description="mbs", layout=layout),
        "precision": w.Dropdown(
            options=list(PRECISIONS),
            value=run.get("precision", "bf16-mixed"),
            description="precision",
        ),
        "optimizer": w.Dropdown(
            options=list(OPTIMIZERS), value=run.get("optimizer", "adamw"), description="optimizer"
        ),
        "fp32_grad_accum": w.Checkbox(
            value=run.get("fp32_grad_accum", False), description="fp32 grad accumulation"
        ),
        "fp8": w.Checkbox(value=run.get("fp8", False), description="FP8 linear layers"),
        "optimizer_bytes": w.Text(
            value="" if run.get("optimizer_bytes") is None else str(run["optimizer_bytes"]),
            placeholder="the optimizer's",
            description="optimizer bytes/param",
            style=style,
            layout=w.Layout(width="260px"),
        ),
        "offload": w.Checkbox(value=run.get("offload", False), description="optimizer on CPU"),
        "zero": w.Dropdown(
            options=[0, 1, 2, 3], value=run.get("zero", 0), description="ZeRO", layout=layout
        ),
        **{
            d: w.IntText(value=run.get(d, 1), description=d, layout=layout)
            for d in ("dp", "tp", "pp", "cp", "ep")
        },
        "sp": w.Checkbox(value=run.get("sp", False), description="sequence parallel"),
        "recompute": w.Dropdown(
            options=list(RECOMPUTE), value=run.get("recompute", "none"), description="recompute"
        ),
        "microbatches": w.IntText(
            value=run.get("microbatches") or 0,
            description="micro-batches (0: pp)",
            style=style,
            layout=w.Layout(width="200px"),
        ),
        "schedule": w.Dropdown(
            options=list(PP_SCHEDULES), value=run.get("schedule", "1f1b"), description="schedule"
        ),
        "virtual": w.IntText(
            value=run.get("virtual", 1), description="chunks V", style=style, layout=layout
        ),
        "gpu": w.Dropdown(options=[*GPUS, "custom"], value="H100 80GB", description="GPU"),
        "gpu_mem": w.FloatText(
            value=GPUS["H100 80GB"].memory_gib, description="GiB", layout=layout
        ),
        "sweep": w.Dropdown(options=list(SWEEPS), value="seq", description="sweep"),
    }
    for name, widget in c.items():
        control(name, widget)
    verdict_box = w.HTML().add_class("labs-memory-verdict")
    chart = w.Output().add_class("labs-memory-chart")
    sweep_chart = w.Output().add_class("labs-memory-sweep-chart")
    busy = {"filling": False}

    def quietly(fn):  # set controls without redrawing after each one
        busy["filling"] = True
        try:
            fn()
        finally:
            busy["filling"] = False

    def fill_from_preset(*_):
        if c["preset"].value != "custom":
            dims = spec_dims(PRESETS[c["preset"].value])
            quietly(lambda: [setattr(c[k], "value", v) for k, v in dims.items()])

    def choose_gpu(*_):
        if c["gpu"].value != "custom":
            quietly(lambda: setattr(c["gpu_mem"], "value", GPUS[c["gpu"].value].memory_gib))
            redraw()

    def settings() -> dict:
        preset_name = None if c["preset"].value == "custom" else c["preset"].value
        dims = {d: c[d].value for d in DIMS}
        text = c["optimizer_bytes"].value.strip()
        try:
            optimizer_bytes = float(text) if text else None
        except ValueError:
            optimizer_bytes = text  # memory_per_rank names it in the verdict
        run_now = {
            k: c[k].value
            for k in (
                "seq",
                "mbs",
                "precision",
                "optimizer",
                "fp32_grad_accum",
                "fp8",
                "offload",
                "zero",
                "dp",
                "tp",
                "pp",
                "cp",
                "ep",
                "sp",
                "recompute",
                "schedule",
                "virtual",
            )
        }
        return dict(
            preset=preset_name,
            dims={**dims, "arch": c["arch"].value, "tied": c["tied"].value},
            microbatches=c["microbatches"].value or None,
            optimizer_bytes=optimizer_bytes,
            **run_now,
        )

    def redraw(change=None):
        if busy["filling"]:
            return
        owner = change["owner"] if change is not None else None
        if owner in [c[d] for d in (*DIMS, "arch", "tied")]:
            # editing a dimension leaves the preset
            quietly(lambda: setattr(c["preset"], "value", "custom"))
        if owner is c["gpu_mem"]:
            quietly(lambda: setattr(c["gpu"], "value", "custom"))
        gpu_mem = c["gpu_mem"].value
        gpu_label = c["gpu"].value
        if gpu_mem > 0:
            state = evaluate(gpu_mem_gib=gpu_mem, **settings())
        else:
            state = {"result": None, "verdict": "cannot compute: GPU memory must be > 0 GiB"}
        ok = state["result"] is not None and state["verdict"].startswith("fits")
        colour = "green" if ok else ("darkred" if state["result"] is not None else "gray")
        verdict_box.value = f"<b style='color:{colour}; font-size:1.1em'>{state['verdict']}</b>"
        with chart:
            chart.clear_output(wait=True)
            if state["result"] is not None:
                fig = draw_breakdown(
                    state["result"], gpu_mem, gpu_label=gpu_label, title=state["name"] or ""
                )
                display(fig)
                plt.close(fig)
        with sweep_chart:
            sweep_chart.clear_output(wait=True)
            if state["result"] is not None:
                kwargs = settings()
                param = c["sweep"].value
                base = {k: v for k, v in kwargs.items() if k not in ("preset", "dims")}
                rows = sweep(state["spec"], param, SWEEPS[param], **base)
                fig, ax = plt.subplots(figsize=(7, 3.4))
                draw_sweep(rows, param, gpu_mem, gpu_label=gpu_label, ax=ax)
                ax.set_title(f"{state['name']}: memory per rank against {param}", fontsize=10)
                display(fig)
                plt.close(fig)

    c["preset"].observe(fill_from_preset, "value")
    c["gpu"].observe(choose_gpu, "value")
    fill_from_preset()
    for name, widget in c.items():
        if name != "gpu":
            widget.observe(redraw, "value")
    redraw()

    def row(*names: str) -> w.HBox:
        return w.HBox([c[n] for n in names])

    box = w.VBox(
        [
            row("preset", "arch", "tied"),
            row(*list(DIMS)[:6]),
            row(*list(DIMS)[6:]),
            row("seq", "mbs", "precision", "fp8", "fp32_grad_accum"),
            row("optimizer", "optimizer_bytes", "offload"),
            row("zero", "dp", "tp", "sp", "ep"),
            row("pp", "microbatches", "schedule", "virtual", "cp", "recompute"),
            row("gpu", "gpu_mem"),
            verdict_box,
            chart,
            c["sweep"],
            sweep_chart,
        ]
    )
    display(box)
    return box
