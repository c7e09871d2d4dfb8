"""Notebook 11's pictures: the data, the cost of each part, a pipeline's stages with the
encoder, measured runs.

    # images and their captions
    show_samples(8)
    # who has the parameters
    parts_table(preset("llama3-8b"), ENCODERS["siglip-so400m"], text_tokens=1024)
    # per-stage time + 1F1B chart
    draw_balance(spec, enc, split=(0, 4), text_tokens=24, mbs=4, microbatches=4)
    # the same with sliders, and a "rebalance" button
    balance_explorer()
    # measured charts per split
    draw_measured(labs.experiments.multimodal_timeline.imbalance(...))

Numbers come from ``labs.theory.multimodal`` and ``labs.experiments.multimodal``; this module
only draws. Charts: rows are pipeline stages (ranks), time runs right, forwards plain, backwards
hatched, colours are micro-batches, grey is idle; per-stage bars show the encoder's part in
orange.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from labs.theory import multimodal as theory
from labs.theory.activations import stage_activation_bytes
from labs.theory.flops import flops_per_token
from labs.theory.memory import param_count
from labs.theory.planner import multimodal as multimodal_plan
from labs.widgets.pipeline import draw_gantt

ENCODER_COLOUR = "tab:orange"
DECODER_COLOUR = "tab:blue"


def show_samples(n: int = 8, *, seed: int = 0):
    """The first ``n`` samples of the data set, each image over its caption."""
    from labs.data.shapes import ByteTokenizer, ShapesDataset

    ds = ShapesDataset(seed=seed)
    tok = ByteTokenizer()
    fig, axes = plt.subplots(1, n, figsize=(1.4 * n, 1.9))
    for i, ax in enumerate(axes):
        image, caption = ds[i]
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        # "a small red circle" -> "small\nred circle"
        words = tok.decode(caption).strip().removeprefix("a ")
        ax.set_title(words.replace(" ", "\n", 1), fontsize=8)
        ax.axis("off")
    return fig


def parts_table(spec, enc, *, text_tokens: int, mbs: int = 1) -> list[dict]:
    """Per sample, encoder (+ projector) against decoder: parameters, tokens, training FLOPs,
    activations (bf16)."""
    seq = enc.tokens + text_tokens
    ef = theory.encoder_flops(enc, mbs=mbs, text_hidden=spec.hidden)
    enc_params = theory.encoder_param_counts(enc, text_hidden=spec.hidden)["total"]
    enc_acts = theory.encoder_activation_bytes(enc, mbs=mbs, text_hidden=spec.hidden, dtype_bytes=2)
    dec_acts = stage_activation_bytes(spec, seq=seq, mbs=mbs, dtype_bytes=2, layers=spec.n_layers)
    rows = [
        {
            "part": "encoder + projector",
            "params": enc_params,
            "tokens": enc.tokens,
            "train_flops": ef["forward"] + ef["backward"],
            "activation_bytes": enc_acts["total"],
        },
        {
            "part": "decoder",
            "params": param_count(spec),
            "tokens": seq,
            "train_flops": flops_per_token(spec, seq=seq) * seq * mbs,
            "activation_bytes": dec_acts["total"],
        },
    ]
    for key in ("params", "train_flops", "activation_bytes"):
        total = sum(r[key] for r in rows)
        for r in rows:
            r[key + "_share"] = r[key] / total
    return rows


def print_parts(rows: list[dict]) -> None:
    """``parts_table``'s rows, one line each with the shares."""
    print(f"{'part':20} {'params':>14} {'tokens':>7} {'train FLOPs':>12} {'activations MiB':>16}")
    for r in rows:
        print(
            f"{r['part']:20} {r['params']:>14,} {r['tokens']:>7} {r['train_flops']:>12.3g} "
            f"{r['activation_bytes'] / 2**20:>16,.2f}"
            f"   ({r['params_share']:.1%} of the parameters,"
            f" {r['train_flops_share']:.1%} of the FLOPs,"
            f" {r['activation_bytes_share']:.1%} of the activations)"
        )


def _gantt(ax, events: list[dict], stages: int, title: str) -> None:
    """1F1B events (dicts) as notebook 05 draws them, stage 0 named as the encoder's."""
    draw_gantt(
        ax,
        events,
        stages,
        1,
        title,
        t0=min(e["start"] for e in events),
        labels=False,
        row_names=["stage 0 (encoder)"] + [f"stage {s}" for s in range(1, stages)],
    )


def _stage_bars(ax, totals, encoder_part: float, title: str, unit: str) -> None:
    stages = range(len(totals))
    ax.bar(stages, totals, color=DECODER_COLOUR, label="decoder")
    ax.bar([0], [encoder_part], color=ENCODER_COLOUR, label="encoder + projector")
    ax.axhline(sum(totals) / len(totals), color="black", linestyle=":", linewidth=1, label="mean")
    ax.set_xticks(list(stages), [f"s{s}" for s in stages])
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def draw_balance(spec, enc, *, split, text_tokens: int, mbs: int, microbatches: int, tp: int = 1):
    """Per-stage forward + backward FLOPs of one micro-batch (the encoder's part in orange) and the
    1F1B chart they give. Returns (figure, ``pipeline_balance``'s result)."""
    r = theory.pipeline_balance(
        spec, enc, split=split, text_tokens=text_tokens, mbs=mbs, microbatches=microbatches, tp=tp
    )
    ef = theory.encoder_flops(enc, mbs=mbs, text_hidden=spec.hidden)
    fig, (bars, chart) = plt.subplots(
        1, 2, figsize=(11, 0.9 + 0.5 * len(split)), gridspec_kw={"width_ratios": [1, 4]}
    )
    _stage_bars(
        bars,
        [t / 1e6 for t in r["stage_time"]],
        (ef["forward"] + ef["backward"]) / 1e6,
        f"split {tuple(split)}",
        "MFLOP per micro-batch",
    )
    _gantt(
        chart,
        r["events"],
        len(split),
        f"1F1B, M={microbatches}: bubble {r['bubble_fraction']:.1%} (equal stages: "
        f"{r['balanced_bubble_fraction']:.1%}); slowest stage {r['imbalance']:.2f}x the mean",
    )
    chart.set_xlabel("FLOPs (time at a constant FLOP rate)")
    fig.tight_layout()
    return fig, r


def balance_explorer(
    *, spec=None, enc=None, text_tokens: int = 24, mbs: int = 4, microbatches: int = 4
):
    """Sliders: encoder layers, width and patches, pipeline stages, micro-batches, decoder layers on
    each stage; the "rebalance" button applies ``balanced_split``. Defaults: the lab's ``timing``
    model."""
    import dataclasses

    import ipywidgets as w
    from IPython.display import display

    if spec is None or enc is None:
        from labs.experiments.multimodal import SIZES, specs

        spec, enc = specs(SIZES["timing"])
    layers = w.IntSlider(value=enc.n_layers, min=1, max=24, description="enc layers")
    width = w.IntSlider(value=enc.hidden, min=32, max=512, step=32, description="enc width")
    patches = w.IntSlider(value=enc.tokens, min=4, max=256, step=4, description="patches")
    stages = w.IntSlider(value=2, min=2, max=min(spec.n_layers + 1, 8), description="stages")
    micro = w.IntSlider(value=microbatches, min=1, max=32, description="micro-batches")
    split = w.Text(value=str(theory.default_split(spec.n_layers, 2))[1:-1], description="split")
    button = w.Button(description="rebalance")
    out = w.Output()

    def current():
        e = dataclasses.replace(
            enc,
            n_layers=layers.value,
            hidden=width.value,
            tokens=patches.value,
            n_heads=4 if width.value % 4 == 0 else 1,
        )
        return e, tuple(int(x) for x in split.value.replace(" ", "").split(",") if x)

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            try:
                e, s = current()
                fig, _ = draw_balance(
                    spec, e, split=s, text_tokens=text_tokens, mbs=mbs, microbatches=micro.value
                )
            except ValueError as err:
                print(f"invalid: {err}")
                return
            display(fig)
            plt.close(fig)

    def on_stages(_):
        split.value = str(theory.default_split(spec.n_layers, stages.value))[1:-1]

    def rebalance(_):
        e, _ = current()
        best = theory.balanced_split(spec, e, stages=stages.value, text_tokens=text_tokens, mbs=mbs)
        split.value = str(best)[1:-1]  # "0, 2, 2" without the parentheses

    stages.observe(on_stages, "value")
    for control in (layers, width, patches, micro, split):
        control.observe(redraw, "value")
    button.on_click(rebalance)
    redraw()
    box = w.VBox([w.HBox([layers, width, patches]), w.HBox([stages, micro, split, button]), out])
    display(box)
    return box


def draw_measured(result: dict):
    """For each split of ``labs.experiments.multimodal_timeline.imbalance``: each stage's measured
    time per micro-batch (stage 0, the encoder's, in orange) and the chart of the median step."""
    rows = result["rows"]
    fig, axes = plt.subplots(
        len(rows),
        2,
        figsize=(11, (0.9 + 0.5 * result["nproc"]) * len(rows)),
        squeeze=False,
        gridspec_kw={"width_ratios": [1, 4]},
    )
    for (bars, chart), row in zip(axes, rows):
        ms = [t * 1e3 for t in row["stage_time"]]
        bars.bar(range(len(ms)), ms, color=[ENCODER_COLOUR] + [DECODER_COLOUR] * (len(ms) - 1))
        bars.axhline(sum(ms) / len(ms), color="black", linestyle=":", linewidth=1)
        bars.set_xticks(range(len(ms)), [f"s{s}" for s in range(len(ms))])
        bars.set_ylabel("ms per micro-batch (F+B)")
        bars.set_title(f"split {row['split']}", fontsize=9)
        _gantt(
            chart,
            row["events"],
            result["nproc"],
            f"measured: bubble {row['measured_bubble']:.1%},"
            f" stage 0 idle {row['stage_idle'][0]:.0%};"
            f" on paper with these times {row['simulated_bubble']:.1%};"
            f" from FLOPs {row['flops_bubble']:.1%}",
        )
        chart.set_xlabel("seconds")
    fig.tight_layout()
    return fig


def measured_table(result: dict) -> None:
    """``imbalance``'s result as a table: per split, per-stage time, imbalance, bubble measured /
    on paper / FLOPs."""
    print(
        f"{'split':>10} {'stage ms (F+B per micro-batch)':>31} {'slowest/mean':>13}"
        f" {'step ms':>8} {'bubble: measured':>17} {'on paper':>9} {'FLOPs':>6}"
        f" {'stage 0 idle':>13}"
    )
    for r in result["rows"]:
        stage_ms = " ".join(f"{t * 1e3:6.1f}" for t in r["stage_time"])
        print(
            f"{str(r['split']):>10} {stage_ms:>31} {r['imbalance']:>13.2f}"
            f" {r['timed_step_s'] * 1e3:>8.1f} {r['measured_bubble']:>17.1%}"
            f" {r['simulated_bubble']:>9.1%} {r['flops_bubble']:>6.1%}"
            f" {r['stage_idle'][0]:>13.0%}"
        )
    print(f"(equal stages would give (P-1)/(M+P-1) = {result['uniform_bubble']:.1%})")


def print_tp_or_replicate(encoders: dict, *, text_hidden: int, tps=(2, 8), mbs: int = 1) -> None:
    """``theory.encoder_tp_or_replicate`` for each named encoder and TP degree, one line each."""
    print(
        f"{'encoder':16} {'tp':>3} {'split it: bytes/GPU':>20} {'all-reduces':>12} {'time':>9}   "
        f"{'replicate it: extra GFLOP':>26} {'time':>9}   cheaper"
    )
    for name, enc in encoders.items():
        for tp in tps:
            r = theory.encoder_tp_or_replicate(enc, tp=tp, mbs=mbs, text_hidden=text_hidden)
            best = "replicate" if r["replicate_extra_seconds"] < r["tp_seconds"] else "split"
            print(
                f"{name:16} {tp:>3} {r['tp_bytes'] / 1e6:>17.2f} MB {r['collectives']:>12} "
                f"{r['tp_seconds'] * 1e3:>6.3f} ms   {r['replicate_extra_flops'] / 1e9:>26.2f} "
                f"{r['replicate_extra_seconds'] * 1e3:>6.3f} ms   {best}"
            )


def print_memory(mem: dict) -> None:
    """``theory.memory_per_rank_with_encoder`` per stage: GiB with the encoder, without, and the
    difference."""
    gib = 2**30
    print(
        f"{'stage':>5} {'layers':>6} {'with encoder':>13} {'decoder alone':>14}"
        f" {'encoder adds':>13}  (GiB)"
    )
    for row, alone in zip(mem["stages"], mem["decoder_only_bytes"]):
        print(
            f"{row['stage']:>5} {row['layers']:>6} {row['total_bytes'] / gib:>13.2f}"
            f" {alone / gib:>14.2f} {row['encoder_bytes'] / gib:>13.2f}"
        )
    print(
        f"busiest stage {mem['stage']}: {mem['total_bytes'] / gib:.2f} GiB; "
        f"spread between stages {mem['imbalance_bytes'] / gib:.2f} GiB"
    )


def print_plan(plan: dict, *, model: str = "custom", encoder: str = "custom") -> None:
    """``plan_with_encoder``'s result (``labs.theory.planner.multimodal``) as its command line
    prints it."""
    summary = multimodal_plan.plan_summary(plan, model=model, encoder=encoder)
    print(multimodal_plan.format_result(summary))
