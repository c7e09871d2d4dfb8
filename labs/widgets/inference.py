"""Latency and throughput of serving on N GPUs (notebook 09): tensor parallelism against layer
placement, from the theory (``labs.theory.inference``) and from measured runs
(``labs.experiments.infer``). This module only draws.

    # preset, GPU, batch, context -> ms/token and tokens/s against N
    latency_explorer()
    # the same as a plain figure
    plot_decode_theory(PRESETS["llama3-70b"], batch=8, context=4096)
    # gloo runs: measured per-token latency and tokens/s
    plot_measured([run_2, run_4])
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from labs.theory import inference as theory
from labs.theory.presets import PRESETS

COLOURS = {"single": "0.5", "tp": "tab:blue", "placement": "tab:orange"}


def theory_rows(
    spec, *, batch: int, context: int, gpu: str = "H100 80GB", degrees=(1, 2, 4, 8)
) -> list[dict]:
    """``decode_time`` for both modes at each degree the model allows (pure; the widget's
    numbers)."""
    rows = []
    for mode in theory.MODES:
        for n in degrees:
            try:
                row = theory.decode_time(
                    spec, mode=mode, degree=n, batch=batch, context=context, gpu=gpu
                )
            except ValueError:
                continue  # e.g. more stages than layers, or heads not divisible by tp
            rows.append(row)
    return rows


def plot_decode_theory(
    spec,
    *,
    batch: int = 8,
    context: int = 4096,
    gpu: str = "H100 80GB",
    degrees=(1, 2, 4, 8),
    title: str = "",
):
    """Two panels against N: per-token latency (ms) and tokens/s, TP and placement (dashed:
    placement with N batches in flight). Hollow markers: the weights and cache do not fit that many
    GPUs."""
    rows = theory_rows(spec, batch=batch, context=context, gpu=gpu, degrees=degrees)
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode in theory.MODES:
        mine = [r for r in rows if r["mode"] == mode]
        n = [r["degree"] for r in mine]
        ax_l.plot(n, [r["latency_s"] * 1e3 for r in mine], "-", color=COLOURS[mode], label=mode)
        ax_t.plot(
            n,
            [r["tokens_per_s"] for r in mine],
            "-",
            color=COLOURS[mode],
            label=f"{mode}, one batch",
        )
        if mode == "placement":
            ax_t.plot(
                n,
                [r["pipelined_tokens_per_s"] for r in mine],
                "--",
                color=COLOURS[mode],
                label="placement, N batches in flight",
            )
        for ax, key in ((ax_l, "latency_s"), (ax_t, "tokens_per_s")):
            scale = 1e3 if key == "latency_s" else 1.0
            for r in mine:
                ax.plot(
                    r["degree"],
                    r[key] * scale,
                    "o",
                    color=COLOURS[mode],
                    markerfacecolor=COLOURS[mode] if r["fits"] else "white",
                )
    for ax, label in ((ax_l, "ms per token"), (ax_t, "tokens/s (all sequences)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(degrees), [str(d) for d in degrees])
        ax.set_xlabel("GPUs N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(
        title or f"decode on {gpu}: B={batch}, context {context} (hollow: does not fit)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def measured_rows(runs: list[dict]) -> list[dict]:
    """One row per (mode, N) of ``labs.experiments.infer.run`` summaries (mode "both" or one mode),
    the single-rank baseline first: measured latency, its 90th percentile, the latency model and
    tokens/s."""
    rows = []
    seen = set()  # (mode, ranks) already in rows
    for s in runs:
        if ("single", 1) not in seen:
            seen.add(("single", 1))
            rows.append(
                {
                    "mode": "single",
                    "nproc": 1,
                    "latency_s": s["single_latency_per_token_s"],
                    "p90_latency_s": None,
                    "model_latency_s": s["single_latency_per_token_s"],
                    "tokens_per_s": s["single_tokens_per_s"],
                }
            )
        for mode in theory.MODES:
            if s["mode"] == "both":
                m = s.get(mode)
            else:
                m = s if s["mode"] == mode else None
            if m is None or (mode, s["nproc"]) in seen:
                continue
            seen.add((mode, s["nproc"]))
            rows.append(
                {
                    "mode": mode,
                    "nproc": s["nproc"],
                    "latency_s": m["latency_per_token_s"],
                    "p90_latency_s": m["p90_latency_per_token_s"],
                    "model_latency_s": m["model_latency_per_token_s"],
                    "tokens_per_s": m["tokens_per_s"],
                }
            )
    return rows


def measured_table(runs: list[dict]) -> str:
    """``measured_rows`` as aligned text (milliseconds)."""
    lines = [
        f"{'mode':<10}{'ranks':>6}{'ms/token':>10}{'p90 ms':>8}{'model ms':>10}{'tokens/s':>10}"
    ]
    for r in measured_rows(runs):
        if r["p90_latency_s"] is not None:
            p90 = f"{r['p90_latency_s'] * 1e3:8.2f}"
        else:
            p90 = f"{'':>8}"
        lines.append(
            f"{r['mode']:<10}{r['nproc']:>6}{r['latency_s'] * 1e3:10.2f}{p90}"
            f"{r['model_latency_s'] * 1e3:10.2f}{r['tokens_per_s']:10.0f}"
        )
    return "\n".join(lines)


def plot_measured(runs: list[dict]):
    """Bars: measured per-token latency and tokens/s per (mode, ranks); black ticks: the latency
    model fed with the single rank's latency and the measured message time."""
    rows = measured_rows(runs)
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(10, 3.4))
    x = list(range(len(rows)))
    labels = [f"{r['mode']}\n{r['nproc']} rank{'s' if r['nproc'] > 1 else ''}" for r in rows]
    colours = [COLOURS[r["mode"]] for r in rows]
    ax_l.bar(x, [r["latency_s"] * 1e3 for r in rows], color=colours)
    ax_l.plot(
        x,
        [r["model_latency_s"] * 1e3 for r in rows],
        "_",
        color="black",
        markersize=28,
        mew=2,
        label="latency model",
    )
    ax_l.set_ylabel("ms per token (median)")
    ax_l.legend(fontsize=8)
    ax_t.bar(x, [r["tokens_per_s"] for r in rows], color=colours)
    ax_t.set_ylabel("tokens/s (all sequences)")
    for ax in (ax_l, ax_t):
        ax.set_xticks(x, labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("measured on this machine (gloo, one thread per rank)", fontsize=10)
    fig.tight_layout()
    return fig


def latency_explorer(
    preset: str = "llama3-70b", batch: int = 8, context: int = 4096, gpu: str = "H100 80GB"
):
    """The interactive widget: choose the model, GPU, batch and context; see
    ``plot_decode_theory``."""
    import ipywidgets as w
    from IPython.display import display

    preset_box = w.Dropdown(
        options=[p for p in PRESETS if PRESETS[p].arch == "llama"],
        value=preset,
        description="model",
    )
    gpu_box = w.Dropdown(options=list(theory.HBM_TBS), value=gpu, description="GPU")
    batch_box = w.IntSlider(value=batch, min=1, max=256, description="batch B")
    context_box = w.IntSlider(value=context, min=128, max=131072, step=128, description="context T")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig = plot_decode_theory(
                PRESETS[preset_box.value],
                batch=batch_box.value,
                context=context_box.value,
                gpu=gpu_box.value,
                title=f"{preset_box.value} on {gpu_box.value}: "
                f"B={batch_box.value}, context {context_box.value} (hollow: does not fit)",
            )
            display(fig)
            plt.close(fig)

    for box in (preset_box, gpu_box, batch_box, context_box):
        box.observe(redraw, "value")
    redraw()
    ui = w.VBox([w.HBox([preset_box, gpu_box]), w.HBox([batch_box, context_box]), out])
    display(ui)
    return ui
