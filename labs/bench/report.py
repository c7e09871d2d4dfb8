"""What the course benchmark writes: ``bench.csv``, ``bench.md`` (the table, the machine, the notes)
and ``bench.png`` (four panels, one line per run), from the rows of ``labs.bench.run_bench``."""

from __future__ import annotations

import csv
import os
import platform
from pathlib import Path

SLOWER = 1.2  # ours / torch above this gets an explanation (issue 13, item 2)
# A bench row's fields, in the order bench.csv writes them.
COLUMNS = (
    "lab",
    "config",
    "nproc",
    "backend",
    "impl",
    "steps",
    "status",
    "ours_ms",
    "torch_ms",
    "torch_impl",
    "same_job",
    "ours_over_torch",
    "comm_bytes",
    "theory_comm_bytes",
    "comm_ratio",
    "state_bytes",
    "theory_state_bytes",
    "state_ratio",
    "max_diff",
    "diff_key",
    "matches_reference",
    "bubble",
    "theory_bubble",
    "bubble_ratio",
    "wall_s",
    "note",
)


def hardware() -> dict:
    """The machine, without initialising CUDA (a later fork of NCCL ranks needs it untouched)."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count()  # NVML where it can: is_available() would initialise CUDA
    return {
        "cpu": model,
        "cores": cores,
        "gpus": gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def name(row: dict) -> str:
    return f"{row['lab']} ({row['config']})" if row.get("config") else row["lab"]


def fmt(value, spec: str) -> str:
    """``format(value, spec)``, or "" for None."""
    return "" if value is None else format(value, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    """The table (one row per lab and rank count), the machine it ran on, and the notes."""
    hw = meta["hardware"]
    lines = [
        f"# Course benchmark ({meta['date']})",
        "",
        f"Machine: {hw['cpu']}, {hw['cores']} cores, {hw['gpus']} GPU(s); torch {hw['torch']}, "
        f"Python {hw['python']}. Implementation: `{meta['impl']}`. Command: `{meta['command']}`.",
        "",
        "Step time: each lab's median over its steps after the first (warm-up) one, max over"
        f" ranks, the fastest of {meta.get('repeats', 1)} run(s); ranks beyond {hw['cores']}"
        " share the cores, so times include waiting for one. Ratios are measured / theory"
        " (1.000: the formula's figure to the byte, on the rank farthest from it). Max diff: the"
        " largest relative difference from the single-process reference (collectives: from"
        " `dist.all_reduce`; infer: generated tokens, equal or not), ✓ within the lab's"
        " tolerance.",
        "",
        "| lab | ranks | ours (ms) | torch (ms) | torch's implementation | ours / torch "
        "| bytes sent / theory | state bytes / theory | max diff vs reference | bubble (theory) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {name(r)} | {r['nproc']} | {r['status']} | | | | | | | |")
            notes.append(f"- **{name(r)}** ({r['nproc']} ranks, {r['status']}): {r['note']}")
            continue
        mark = {True: " ✓", False: " ✗", None: ""}[r["matches_reference"]]
        bubble = f"{r['bubble']:.3f} ({r['theory_bubble']:.3f})" if r["bubble"] is not None else ""
        lines.append(
            f"| {name(r)} | {r['nproc']} | {fmt(r['ours_ms'], '.1f')}"
            f" | {fmt(r['torch_ms'], '.1f')} | {r['torch_impl'] or '—'}"
            f" | {fmt(r['ours_over_torch'], '.2f')} | {fmt(r['comm_ratio'], '.3f')}"
            f" | {fmt(r['state_ratio'], '.3f')} | {fmt(r['max_diff'], '.1e')}{mark} | {bubble} |"
        )
        if r["note"]:
            notes.append(f"- **{name(r)}** ({r['nproc']} ranks): {r['note']}")
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path) -> None:
    """One line per run, four panels: step time ours / torch's, bytes and state against theory,
    largest difference from the reference, pipeline bubble against theory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ok = [r for r in rows if r["status"] == "ok"][::-1]  # first row on top
    y = list(range(len(ok)))
    fig, (speed, theory, diff, bubble) = plt.subplots(
        1, 4, figsize=(15, 0.42 * len(ok) + 1.8), sharey=True
    )
    colours = ["tab:blue" if r.get("same_job") else "tab:gray" for r in ok]
    speed.barh(y, [r["ours_over_torch"] or 0 for r in ok], color=colours)
    speed.axvline(1, color="black", lw=0.8)
    speed.axvline(SLOWER, color="tab:red", ls="--", lw=0.8)
    speed.set(
        title="step time, ours / torch's", xscale="log", yticks=y, yticklabels=[name(r) for r in ok]
    )
    speed.legend(
        handles=[
            Patch(color="tab:blue", label="the same job"),
            Patch(color="tab:gray", label="torch's time is another job"),
            Line2D([], [], color="tab:red", ls="--", label=f"{SLOWER:g}x: explained in bench.md"),
        ],
        fontsize=7,
        loc="lower right",
    )
    theory.scatter([r["comm_ratio"] for r in ok], y, marker="o", label="bytes sent", zorder=3)
    theory.scatter(
        [r["state_ratio"] for r in ok],
        y,
        marker="x",
        color="tab:orange",
        label="state bytes",
        zorder=3,
    )
    theory.axvline(1, color="black", lw=0.8)
    theory.set(title="measured / theory", xlim=(0.9, 1.1))
    theory.legend(fontsize=7, loc="lower right")
    diff.barh(
        y,
        [r["max_diff"] or 0 for r in ok],
        color=["tab:red" if r["matches_reference"] is False else "tab:green" for r in ok],
    )
    diff.axvline(1e-5, color="tab:red", ls="--", lw=0.8, label="fp32 tolerance 1e-5")
    for i, r in zip(y, ok):  # a reference check without a number (e.g. generated tokens equal)
        if r["max_diff"] is None and r["matches_reference"] is not None:
            diff.text(
                2e-9, i, "equal" if r["matches_reference"] else "differ", va="center", fontsize=8
            )
    diff.set(title="max rel. difference from the reference", xscale="log", xlim=(1e-9, 1e-4))
    diff.legend(fontsize=7, loc="lower right")
    piped = [(i, r) for i, r in zip(y, ok) if r["bubble"] is not None]
    bubble.barh(
        [i for i, _ in piped], [r["bubble"] for _, r in piped], color="tab:purple", label="measured"
    )
    bubble.scatter(
        [r["theory_bubble"] for _, r in piped],
        [i for i, _ in piped],
        marker="|",
        s=300,
        color="black",
        label="theory",
        zorder=3,
    )
    bubble.set(title="pipeline bubble fraction", xlim=(0, 1))
    bubble.legend(fontsize=7, loc="lower right")
    for ax in (speed, theory, diff, bubble):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], out, meta: dict) -> dict[str, Path]:
    """``bench.csv``, ``bench.md`` and ``bench.png`` in the folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"bench.{k}" for k in ("csv", "md", "png")}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in COLUMNS} for r in rows)
    paths["md"].write_text(markdown(rows, meta))
    plot(rows, paths["png"])
    return paths
