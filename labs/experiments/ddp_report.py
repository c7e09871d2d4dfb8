"""Experiment 02's views: a DDP run's checks as a table, its losses and its traffic as plots.

    summary = labs.experiments.ddp.run(nproc=4, variant="all")     # notebook 02
    print(report(summary)); plot_losses(summary); plot_comm(summary)

Every function takes one or more summaries of ``labs.experiments.ddp.run`` (e.g. one run per
variant) and reads each variant's row in ``summary["variants"]``.
"""

from __future__ import annotations

from labs.experiments.common import RunSummary


def _rows(summaries: tuple[RunSummary, ...]) -> dict:
    """Variant name -> its row, over one or more summaries (e.g. one run per variant)."""
    return {name: row for summary in summaries for name, row in summary["variants"].items()}


def report(*summaries: RunSummary) -> str:
    """One line per variant: differences from the reference, calls and bytes against theory, step
    time."""
    lines = [
        f"{'variant':<11}{'loss diff':>10}{'grad diff':>10}{'param diff':>11}"
        f"{'calls':>7}{'theory':>7}{'kB/rank/step':>13}{'theory':>9}{'step ms':>9}"
    ]
    for name, r in _rows(summaries).items():
        sent_kb = r["comm_bytes_per_rank_per_step"][0][0] / 1e3  # rank 0, step 1
        lines.append(
            f"{name:<11}{r['max_rel_loss_diff']:>10.1e}{r['max_rel_grad_diff']:>10.1e}"
            f"{r['max_rel_param_diff']:>11.1e}{r['all_reduce_calls_per_step'][0]:>7}"
            f"{r['theory_all_reduce_calls']:>7}{sent_kb:>13.1f}"
            f"{r['theory_comm_bytes_per_rank'] / 1e3:>9.1f}{r['step_time_s'] * 1e3:>9.1f}"
        )
    return "\n".join(lines)


def plot_losses(*summaries: RunSummary, ax=None):
    """Each variant's losses (mean over ranks) over the single-process reference's."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    rows = _rows(summaries)
    reference = next(iter(rows.values()))["reference_losses"]
    steps = range(1, len(reference) + 1)
    ax.plot(
        steps, reference, "-", color="0.6", lw=6, alpha=0.6, label="single process, whole batch"
    )
    for (name, row), marker in zip(rows.items(), "os^"):
        ax.plot(
            steps,
            row["losses"],
            marker + "--",
            label=f"{name} (max rel diff {row['max_rel_loss_diff']:.1e})",
        )
    ax.set_xticks(list(steps))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"DDP on {summaries[0]['nproc']} ranks vs one process, same global batch")
    ax.legend(fontsize=8)
    return ax


def plot_comm(*summaries: RunSummary, ax=None):
    """Bytes each rank all-reduced per step (every rank, every step) against 2(N-1)/N G."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    rows = _rows(summaries)
    for i, row in enumerate(rows.values()):
        measured = [b for rank in row["comm_bytes_per_rank_per_step"] for b in rank]
        ax.scatter(
            [i + 0.15] * len(measured),
            [b / 1e3 for b in measured],
            color="C0",
            zorder=3,
            label="measured (ledger), every rank and step" if i == 0 else None,
        )
        ax.bar(
            i - 0.15,
            row["theory_comm_bytes_per_rank"] / 1e3,
            width=0.3,
            color="C1",
            alpha=0.7,
            label="theory 2(N-1)/N G" if i == 0 else None,
        )
        ax.text(
            i,
            row["theory_comm_bytes_per_rank"] / 2e3,
            f"{row['all_reduce_calls_per_step'][0]} calls\n"
            f"(theory {row['theory_all_reduce_calls']})",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("kB sent per rank per step")
    ax.set_title(f"all-reduce traffic, N = {summaries[0]['nproc']}")
    ax.legend(fontsize=8, loc="lower right")
    return ax
