"""Experiment 01's views: a memory run's bytes, measured beside the calculator's, as tables and a
figure.

    summary = labs.experiments.memory.run(nproc=2, steps=3)    # notebook 01
    print(format_comparison(summary))     # measured vs predicted, per precision and recomputation
    print(format_regions(summary))        # activation bytes by region
    print(format_recompute(summary))      # what recomputation saves and what it costs
    plot_comparison(summary)
"""

from __future__ import annotations

from labs.experiments.common import RunSummary, course_spec
from labs.experiments.memory import BYTE_KEYS
from labs.models.transformer import ModelConfig
from labs.theory.flops import flops_per_token


def comparison_rows(summary: RunSummary) -> list[dict]:
    """One flat row per configuration: measured and predicted bytes side by side."""
    out = []
    for r in summary["rows"]:
        row = {"precision": r["precision"], "recompute": r["recompute"]}
        for k in BYTE_KEYS:
            row[f"{k}_measured"] = r["measured"][k]
            row[f"{k}_predicted"] = r["predicted"][k]
        row["playbook_activation_bytes"] = r["playbook_activation_bytes"]
        row["step_time_ms"] = 1e3 * r["step_time_s"]
        out.append(row)
    return out


def matches_calculator(summary: RunSummary, row: dict) -> bool:
    """Whether a configuration's state and saved-activation bytes equal the calculator's on every
    rank: its two checks, by name."""
    prefix = f"{row['precision']}/{row['recompute']}: "
    names = ("state bytes (params, grads, optimizer)", "activation bytes")
    return all(summary.check(prefix + name).ok for name in names)


def format_comparison(summary: RunSummary) -> str:
    """The measured-vs-predicted table (bytes per rank) notebook 01 prints."""
    head = (
        f"{'precision':<11}{'recompute':<10}"
        + "".join(f"{k.split('_')[0]:>24}" for k in BYTE_KEYS)
        + "  match"
    )
    lines = [head, f"{'':<21}" + f"{'measured / predicted':>24}" * len(BYTE_KEYS)]
    for r in summary["rows"]:
        cells = "".join(
            f"{r['measured'][k]:>12,.0f} /{r['predicted'][k]:>10,.0f}" for k in BYTE_KEYS
        )
        match = "yes" if matches_calculator(summary, r) else "NO"
        lines.append(f"{r['precision']:<11}{r['recompute']:<10}{cells}  {match}")
    return "\n".join(lines)


def format_regions(summary: RunSummary, precision: str = "bf16-mixed") -> str:
    """Activation bytes by region, measured (formula), for each recomputation, and the playbook's
    34·s·b·h + 5·a·s²·b per layer beside the measured layers."""
    rows = [r for r in summary["rows"] if r["precision"] == precision]
    n_layers = sum(k.startswith("layer") for k in rows[0]["regions"])
    lines = [
        f"{precision}: bytes autograd saved, measured (formula)",
        f"{'region':<12}" + "".join(f"{r['recompute']:>24}" for r in rows),
    ]
    for region in ["embedding", *(f"layer{i}" for i in range(n_layers)), "final_norm", "loss"]:
        cells = []
        for r in rows:
            p = r["parts"]
            want = {
                "embedding": p["embedding"],
                "final_norm": p["final_norm"],
                "loss": p["loss"],
                "layer0": p["per_layer"] + p["rotary"],
            }.get(region, p["per_layer"])
            cells.append(f"{r['regions'].get(region, 0):>12,} ({want:>9,.0f})")
        lines.append(f"{region:<12}" + "".join(cells))
    none = next(r for r in rows if r["recompute"] == "none")
    playbook = none["playbook_activation_bytes"]
    if playbook is not None:
        layers = sum(v for k, v in none["regions"].items() if k.startswith("layer"))
        lines.append(
            f"layers measured {layers:,} B; playbook 34sbh + 5as²b: {playbook:,.0f} B "
            f"({playbook / layers - 1:+.0%})"
        )
    return "\n".join(lines)


def format_recompute(summary: RunSummary) -> str:
    """What recomputation buys (activation bytes saved vs none, measured and predicted) and what it
    costs (extra FLOPs per step, ``labs.theory.flops``; the FLOP counter test checks them)."""
    spec = course_spec(ModelConfig(**summary["model"]))
    seq = summary["seq_len"]
    lines = [
        f"{'precision':<11}{'recompute':<10}{'activations':>12}{'saved: measured':>17}"
        f"{'predicted':>11}{'extra FLOPs':>13}"
    ]
    for r in summary["rows"]:
        none = next(
            q
            for q in summary["rows"]
            if q["precision"] == r["precision"] and q["recompute"] == "none"
        )
        saved = [
            none[k]["activation_bytes"] - r[k]["activation_bytes"]
            for k in ("measured", "predicted")
        ]
        extra = (
            flops_per_token(spec, seq=seq, recompute=r["recompute"])
            / flops_per_token(spec, seq=seq)
            - 1
        )
        lines.append(
            f"{r['precision']:<11}{r['recompute']:<10}{r['measured']['activation_bytes']:>12,}"
            f"{saved[0]:>17,}{saved[1]:>11,.0f}{extra:>13.0%}"
        )
    return "\n".join(lines)


def plot_comparison(summary: RunSummary, ax=None):
    """Grouped bars: measured activation bytes per configuration, predicted marked on top."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    rows = summary["rows"]
    labels = [f"{r['precision']}\n{r['recompute']}" for r in rows]
    x = range(len(rows))
    ax.bar(
        x,
        [r["measured"]["activation_bytes"] / 1024 for r in rows],
        color="tab:red",
        alpha=0.7,
        label="measured (saved-tensor hooks)",
    )
    ax.scatter(
        x,
        [r["predicted"]["activation_bytes"] / 1024 for r in rows],
        marker="_",
        s=900,
        color="black",
        zorder=3,
        label="calculator",
    )
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("activations (KiB per rank)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return ax
