"""Bubble calculator (notebook 05): a pipeline schedule's Gantt chart, bubble and activations
held.

    # choose schedule, P, M, V, t_f, t_b; a switch overlays a real run
    bubble_calculator()
    # the same drawing as a plain matplotlib figure
    draw_schedule("1f1b", 4, 8)
    # with the chart measured by labs.experiments.pp.run
    draw_schedule("1f1b", 4, 8, measured=summary)
    # runs side by side
    compare(gpipe, onef)
    # measured charts one above the other, on one time axis (1F1B against ZB-H1)
    measured_gantts(onef, zb)
    # the bubble of each run: measured, with its measured delays, on paper, by the formula
    bubble_table(onef, inter, zb, dualv)
    # device_map-style plans
    placements()

The numbers and the chart come from ``labs.theory.pipeline`` (``figures``, ``simulate``);
a measured run comes from ``labs.experiments.pp.run``. This module only draws: rows are
ranks, time runs to the right, forwards are plain and backwards hatched (zero-bubble's
weight-gradient W's dotted, DualPipeV's full backwards crossed), colours are micro-batches, grey
is the bubble. A chunk's operations (interleaved, DualPipeV) are labelled ``F<mb>.<chunk>``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from labs.theory import pipeline as theory

MB_COLOURS = plt.get_cmap("tab20")
MAX_MEASURED_RANKS = 4  # a measured overlay starts this many processes at most (a laptop's worth)
# what the pipeline lab runs
MEASURABLE = ("naive", "gpipe", "afab", "1f1b", "interleaved", "zb-h1", "dualpipev")
HATCHES = {"B": "//", "W": "..", "BW": "xx"}  # forwards plain
FORMULAS = {  # the bubble's formula each chart's title quotes
    "zb-h1": "(P-1)(t_f+t_b-2t_w) / step",
    "dualpipev": "(P-1)(t_f/2) / step",
}


def draw_gantt(
    ax,
    events: list[dict],
    stages: int,
    virtual: int,
    title: str,
    scale: float = 1.0,
    t0: float = 0.0,
    labels: bool = True,
    row_names: list[str] | None = None,
) -> None:
    """Draw ``events`` (dicts with rank, name, microbatch, chunk, start, end) on ``ax``, one row
    per rank over a grey idle background, from time ``t0``; later chunks of an interleaved rank
    are paler."""
    end = max(e["end"] for e in events)
    smallest_label = (end - t0) / 45 if labels else float("inf")  # narrower bars stay unlabelled
    for r in range(stages):  # the whole row in grey first: whatever stays grey is idle
        ax.barh(r, (end - t0) * scale, left=0, height=0.8, color="0.88", edgecolor="none")
    for e in events:
        left = (e["start"] - t0) * scale
        width = (e["end"] - e["start"]) * scale
        ax.barh(
            e["rank"],
            width,
            left=left,
            height=0.8,
            color=MB_COLOURS(e["microbatch"] % 20),
            edgecolor="black",
            linewidth=0.4,
            hatch=HATCHES.get(e["name"]),
            alpha=1.0 - 0.5 * e["chunk"] / virtual,
        )
        if e["end"] - e["start"] >= smallest_label:
            label = f"{e['name']}{e['microbatch']}"
            if virtual > 1:
                label += f".{e['chunk']}"
            ax.text(left + width / 2, e["rank"], label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(stages), row_names or [f"rank {r}" for r in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_title(title, fontsize=9, loc="left")


def draw_schedule(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int | None = None,
    t_f: float = 1.0,
    t_b: float = 2.0,
    measured: dict | None = None,
):
    """The schedule's chart on paper (and, with ``measured``, the chart of a real run below it,
    its times rescaled so that a forward lasts ``t_f``), plus the activations each stage holds.
    ``virtual``: default 1 (dualpipev: 2). Returns (figure, ``theory.figures(...)``); raises
    ValueError for an invalid schedule."""
    virtual = theory.chunks_per_rank(schedule, 1) if virtual is None else virtual
    result = theory.figures(schedule, stages, microbatches, virtual, t_f, t_b)
    t_b_sim = 0.0 if schedule == "naive" else t_b
    sim = theory.simulate(schedule, stages, microbatches, virtual, t_f, t_b_sim)
    rows = 2 if measured else 1
    fig, axes = plt.subplots(
        rows,
        2,
        figsize=(11, 0.9 + (0.45 * stages + 0.6) * rows),
        squeeze=False,
        gridspec_kw={"width_ratios": [5, 1]},
    )
    v = f", V={virtual}" if schedule == "interleaved" else ""
    formula = FORMULAS.get(schedule, "(P-1)/(V·M+P-1)")
    title = (
        f"{schedule}, P={stages}, M={microbatches}{v} (paper):"
        f" bubble {result['bubble_fraction']:.1%} of the step = {formula}"
    )
    draw_gantt(axes[0][0], sim["events"], stages, virtual, title)
    held = result["activation_microbatches_per_stage"]
    ax = axes[0][1]
    ax.set_title("activations held\n(micro-batches of a stage)", fontsize=8)
    if schedule == "naive":  # inference keeps nothing for a backward
        ax.axis("off")
        ax.text(
            0.5, 0.5, "inference:\nnothing kept\nfor backward", ha="center", va="center", fontsize=8
        )
    else:
        ax.barh(range(stages), held, color="tab:purple")
        ax.set_ylim(stages - 0.5, -0.5)
        ax.set_yticks([])
        for r, h in enumerate(held):
            ax.text(h, r, f" {h:g}", va="center", fontsize=7)
        ax.set_xlim(0, max(held) * 1.35)
    if measured:
        _draw_measured(axes[1], measured, stages, virtual, t_f)
        # one time axis for both charts
        paper_left, paper_right = axes[0][0].get_xlim()
        _, measured_right = axes[1][0].get_xlim()
        axes[1][0].set_xlim(paper_left, max(paper_right, measured_right))
        axes[0][0].set_xlim(axes[1][0].get_xlim())
        axes[-1][0].set_xlabel("time (units of t_f; measured: rescaled)")
    else:
        axes[-1][0].set_xlabel("time (units of t_f)")
    mbs = sorted({e["microbatch"] for e in sim["events"]})[:10]
    axes[0][0].legend(
        handles=[Patch(color=MB_COLOURS(i % 20), label=f"mb {i}") for i in mbs]
        + [
            Patch(facecolor="white", edgecolor="black", hatch="//", label="backward"),
            *(
                [Patch(facecolor="white", edgecolor="black", hatch="..", label="weight grad W")]
                if schedule in theory.SPLIT_BACKWARD
                else []
            ),
            *(
                [Patch(facecolor="white", edgecolor="black", hatch="xx", label="full backward")]
                if schedule == "dualpipev"
                else []
            ),
            Patch(color="0.88", label="idle"),
        ],
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    fig.tight_layout()
    return fig, result


def _draw_measured(axes, summary: dict, stages: int, virtual: int, t_f: float) -> None:
    events = summary["timeline"]
    t0 = min(e["start"] for e in events)
    scale = t_f / summary["measured_t_forward_s"] if summary.get("measured_t_forward_s") else 1.0
    torch_run = " by torch's ScheduleDualPipeV" if summary["schedule"] == "dualpipev" else ""
    title = (
        f"measured{torch_run} on {summary['nproc']} ranks ({summary['backend']}, forwards padded"
        f" to {summary['op_time_s'] * 1e3:g} ms): bubble {summary['bubble_fraction']:.1%}\n"
        f"with the measured {summary['measured_delay_s'] * 1e3:.1f} ms mean delay per operation"
        f" the schedule predicts {summary['delay_bubble_fraction']:.1%}"
    )
    draw_gantt(axes[0], events, stages, virtual, title, scale=scale, t0=t0)
    held = summary.get("microbatches_held")
    ax = axes[1]
    if not held:
        ax.axis("off")
    else:
        ax.barh(range(stages), [h / virtual for h in held], color="tab:green")
        for r, h in enumerate(held):
            ax.text(h / virtual, r, f" {h / virtual:g}", va="center", fontsize=7)
        ax.set_xlim(0, max(held) / virtual * 1.35)
        ax.set_title("measured (saved tensors)", fontsize=8)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks([])


def measure(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int,
    t_f: float,
    t_b: float,
    op_time: float = 0.02,
) -> dict:
    """A real run of the schedule (one step, operations padded to ``op_time``, backward t_b/t_f
    as long)."""
    from labs.experiments.pp import run

    if stages > MAX_MEASURED_RANKS:
        raise ValueError(
            f"stages={stages}: a measured run here starts at most {MAX_MEASURED_RANKS} processes"
        )
    batch = microbatches * -(-16 // microbatches)  # >= 16 sequences, a multiple of M
    return run(
        nproc=stages,
        steps=1,
        schedule=schedule,
        microbatches=microbatches,
        virtual=virtual,
        layers=max(8, stages * virtual),
        batch_size=batch,
        op_time=op_time,
        backward_ratio=0.0 if schedule == "naive" else t_b / t_f,
    )


def bubble_calculator(
    schedule: str = "1f1b",
    stages: int = 4,
    microbatches: int = 8,
    virtual: int = 1,
    measured: dict | None = None,
):
    """The interactive widget. ``measured``: a summary of ``labs.experiments.pp.run`` to overlay;
    with the switch on and other settings, the widget measures a run itself (P <= 4)."""
    import ipywidgets as w
    from IPython.display import display

    if measured:
        schedule = measured["schedule"]
        stages = measured["nproc"]
        microbatches = measured["microbatches"]
        virtual = measured["virtual"]
    sched = w.Dropdown(
        options=[s for s in theory.SCHEDULES if s != "afab"], value=schedule, description="schedule"
    )
    p = w.IntSlider(value=stages, min=1, max=8, description="stages P")
    m = w.IntSlider(value=microbatches, min=1, max=32, description="micro-batches M")
    v = w.IntSlider(value=virtual, min=1, max=4, description="virtual V")
    tf = w.FloatSlider(value=1.0, min=0.25, max=4.0, step=0.25, description="t_f")
    tb = w.FloatSlider(value=2.0, min=0.0, max=8.0, step=0.25, description="t_b")
    overlay = w.Checkbox(value=bool(measured), description="overlay a measured run")
    out = w.Output()
    # measured runs by (schedule, P, M, V, t_b/t_f); a lab run pads backward to 2 t_f
    cache = {}
    if measured:
        key = (
            measured["schedule"],
            measured["nproc"],
            measured["microbatches"],
            measured["virtual"],
            2.0,
        )
        cache[key] = measured

    def redraw(*_):
        v.disabled = sched.value != "interleaved"
        chunks = theory.chunks_per_rank(sched.value, v.value if sched.value == "interleaved" else 1)
        key = (sched.value, p.value, m.value, chunks)
        with out:
            out.clear_output(wait=True)
            try:
                theory.check_schedule(*key)
                run = None
                note = ""
                if overlay.value and p.value > MAX_MEASURED_RANKS:
                    note = (
                        f"(no measured run: this machine runs at most {MAX_MEASURED_RANKS} ranks)"
                    )
                elif overlay.value and sched.value not in MEASURABLE:
                    note = f"(no measured run: the pipeline lab has no {sched.value} schedule)"
                elif overlay.value:
                    run_key = key + (0.0 if sched.value == "naive" else tb.value / tf.value,)
                    if run_key not in cache:
                        print("measuring a real run ...")
                        cache[run_key] = measure(*key, tf.value, tb.value)
                    run = cache[run_key]
                fig, r = draw_schedule(*key, t_f=tf.value, t_b=tb.value, measured=run)
            except ValueError as e:
                print(f"invalid: {e}")
                return
            out.clear_output(wait=True)
            display(fig)
            plt.close(fig)
            print(theory.format_result(r))
            if note:
                print(note)

    for control in (sched, p, m, v, tf, tb, overlay):
        control.observe(redraw, "value")
    redraw()
    box = w.VBox([w.HBox([sched, p, m, v]), w.HBox([tf, tb, overlay]), out])
    display(box)
    return box


def plot_bubble_vs_microbatches(
    stages: int = 4,
    virtual: int = 2,
    max_microbatches: int = 32,
    measured: list[dict] = (),
    ax=None,
):
    """The bubble fraction against M for GPipe/1F1B, interleaved, ZB-H1 and DualPipeV (lines, from
    the formulas; the last two with F = B = W), the rule of thumb M = 4P (dashed), and measured
    runs (points; hollow: the schedule's prediction with the measured delay per operation)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ms = range(1, max_microbatches + 1)
    ax.plot(
        ms,
        [theory.bubble_fraction("1f1b", stages, m) for m in ms],
        label="GPipe / 1F1B: (P-1)/(M+P-1)",
    )
    inter = [m for m in ms if m % stages == 0]
    ax.plot(
        inter,
        [theory.bubble_fraction("interleaved", stages, m, virtual) for m in inter],
        "o-",
        ms=3,
        label=f"interleaved, V={virtual}: (P-1)/(VM+P-1)",
    )
    for schedule, label, fewest in (
        ("zb-h1", "ZB-H1: (P-1)/(3M+P-1)", stages),
        ("dualpipev", "DualPipeV: (P-1)/(3M+P-1), M >= 2P", 2 * stages),
    ):
        zb = [m for m in ms if m >= fewest]
        chunks = theory.chunks_per_rank(schedule)
        ax.plot(
            zb,
            [theory.bubble_fraction(schedule, stages, m, chunks) for m in zb],
            ls=":",
            label=label,
        )
    ax.axvline(4 * stages, color="0.5", ls="--", lw=1)
    ax.text(4 * stages, 0.9, " M = 4P", color="0.4", fontsize=8)
    colours = {"interleaved": "tab:orange", "zb-h1": "tab:green", "dualpipev": "tab:red"}
    for s in measured:
        colour = colours.get(s["schedule"], "tab:blue")
        ax.plot(s["microbatches"], s["bubble_fraction"], "s", color=colour, ms=7)
        ax.plot(s["microbatches"], s["delay_bubble_fraction"], "s", mfc="none", color=colour, ms=9)
        ax.annotate(
            s["schedule"],
            (s["microbatches"], s["bubble_fraction"]),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=7,
        )
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble fraction of the step")
    title = f"P = {stages} stages"
    if measured:
        title += ": squares measured, hollow = with the measured delays"
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_activations(*summaries: dict, ax=None):
    """Peak activation bytes each rank held (saved-tensor accounting), one group of bars per run,
    labelled with the micro-batches held."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(summaries)
    for i, s in enumerate(summaries):
        ranks = range(s["nproc"])
        mib = [b / 2**20 for b in s["activation_bytes_held"]]
        v = f", V={s['virtual']}" if s["virtual"] > 1 else ""
        label = f"{s['schedule']} (M={s['microbatches']}{v})"
        bars = ax.bar([r + i * width for r in ranks], mib, width, label=label)
        for bar, held in zip(bars, s["microbatches_held"]):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                str(held),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(
        [r + 0.4 - width / 2 for r in range(summaries[0]["nproc"])],
        [f"rank {r}" for r in range(summaries[0]["nproc"])],
    )
    ax.set_ylabel("peak activations (MiB)")
    ax.set_title(
        "activations held at the peak (numbers: micro-batches; chunk micro-batches if chunked)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return ax


def placements(*, layers: int = 8, stages: int = 4, fractions=(1.0, 0.5, 0.3)) -> list[dict]:
    """Where ``device_map``-style filling puts the course model's layers when each device may hold
    ``fraction`` of the model's parameters, next to the balanced split. Prints a table."""
    from labs.experiments.pp import layer_costs
    from labs.models.transformer import ModelConfig

    costs, first, last = layer_costs(ModelConfig(n_layer=layers))
    total = sum(costs) + first + last
    rows = [
        {
            "placement": f"fill, {f:.0%} of the model per device",
            "plan": theory.fill_plan(
                costs, stages, capacity=int(f * total), first_extra=first, last_extra=last
            ),
        }
        for f in fractions
    ]
    rows.append(
        {
            "placement": "balanced by parameters",
            "plan": theory.balanced_plan(costs, stages, first_extra=first, last_extra=last),
        }
    )
    for row in rows:
        row["params_per_device"] = theory.plan_costs(costs, row["plan"], first, last)
        print(
            f"{row['placement']:<34} layers per device {row['plan']}"
            f"  parameters {row['params_per_device']}"
        )
    return rows


def compare(*summaries: dict) -> list[dict]:
    """A table with one row per run of ``labs.experiments.pp.run``: correctness, the bubble
    (measured, predicted with the measured delays, formula), micro-batches held, step times."""
    import torch

    from labs.train import rule

    rows = []
    for s in summaries:
        v = f" V={s['virtual']}" if s["schedule"] == "interleaved" else ""
        torch_time = "-"
        if s["torch_step_time_s"] is not None:
            torch_time = f"{s['torch_step_time_s']:.3f}"
        torch_same = "-"
        if "torch_losses" in s:
            bound = rule("value", torch.float32, s["backend"]).rel * s["reference_loss"]
            torch_same = s["torch_max_abs_loss_diff"] <= bound
        rows.append(
            {
                "run": f"{s['schedule']} P={s['nproc']} M={s['microbatches']}{v}",
                "matches reference": s["matches_reference"],
                "bubble measured": f"{s['bubble_fraction']:.3f}",
                "bubble with delays": f"{s['delay_bubble_fraction']:.3f}",
                "bubble formula": f"{s['theory_bubble_fraction']:.3f}",
                "micro-batches held": s.get("microbatches_held", "-"),
                "step time (s)": f"{s['step_time_s']:.3f}",
                "torch step time (s)": torch_time,
                "torch same losses": torch_same,
            }
        )
    _print_table(rows)
    return rows


def _print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))


def _run_name(s: dict) -> str:
    v = f" V={s['virtual']}" if s["schedule"] == "interleaved" else ""
    return f"{s['schedule']}{v}"


def bubble_table(*summaries: dict) -> list[dict]:
    """The bubble of each run of ``labs.experiments.pp.run`` (notebook 05): the formula's, the
    schedule's run on paper (equal to it), the measured one and its gap to the formula, and the
    schedule run on paper with the run's own measured delay per operation (what explains the
    gap). Prints a table; returns its rows."""
    rows = []
    for s in summaries:
        rows.append(
            {
                "schedule": _run_name(s),
                "P": s["nproc"],
                "M": s["microbatches"],
                "forward padded to (ms)": f"{s['op_time_s'] * 1e3:g}",
                "formula": f"{s['theory_bubble_fraction']:.3f}",
                "on paper": f"{s['simulated_bubble_fraction']:.3f}",
                "measured": f"{s['bubble_fraction']:.3f}",
                "measured - formula": f"{s['bubble_fraction'] - s['theory_bubble_fraction']:+.3f}",
                "delay per op (ms)": f"{s['measured_delay_s'] * 1e3:.1f}",
                "with the delays": f"{s['delay_bubble_fraction']:.3f}",
            }
        )
    _print_table(rows)
    return rows


def measured_gantts(*summaries: dict):
    """The measured charts of runs of ``labs.experiments.pp.run`` one above the other on one time
    axis, in ms from each run's first operation (notebook 05: 1F1B against ZB-H1, padded alike),
    each titled with its bubble measured and by the formula. Returns the figure."""
    heights = [0.45 * s["nproc"] + 0.9 for s in summaries]
    fig, axes = plt.subplots(
        len(summaries), 1, figsize=(11, sum(heights)), squeeze=False, sharex=True
    )
    for ax, s in zip(axes[:, 0], summaries):
        events = s["timeline"]
        title = (
            f"{_run_name(s)}, P={s['nproc']}, M={s['microbatches']}, measured: bubble"
            f" {s['bubble_fraction']:.1%} (formula {s['theory_bubble_fraction']:.1%}; with the"
            f" measured {s['measured_delay_s'] * 1e3:.1f} ms delay per operation"
            f" {s['delay_bubble_fraction']:.1%})"
        )
        t0 = min(e["start"] for e in events)
        draw_gantt(ax, events, s["nproc"], s["virtual"], title, scale=1e3, t0=t0)
    axes[0][0].legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", label="forward F"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="backward B"),
            Patch(facecolor="white", edgecolor="black", hatch="..", label="weight grad W"),
            Patch(facecolor="white", edgecolor="black", hatch="xx", label="full backward"),
            Patch(color="0.88", label="idle"),
        ],
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    padding = ", ".join(f"{s['op_time_s'] * 1e3:g}" for s in summaries)
    axes[-1][0].set_xlabel(
        f"time since the step's first operation (ms; forwards padded to {padding} ms)"
    )
    fig.tight_layout()
    return fig
