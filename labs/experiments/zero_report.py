"""Experiment 03's views: a ZeRO run's checks in a few lines, and stages 0-3 measured against
theory in a figure.

    summary = labs.experiments.zero.run(nproc=4, stage=3)          # notebook 03
    print(report(summary))
    plot_stages([labs.experiments.zero.run(nproc=4, stage=s) for s in (0, 1, 2, 3)])
    print(format_sees(labs.experiments.zero.what_a_rank_sees()))
"""

from __future__ import annotations

from labs.experiments.common import RunSummary


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1e3:,.1f} kB"


def report(s: RunSummary) -> str:
    """A run's figures in a few lines (reference, memory, communication, peak, offload, torch),
    then its verdict table. A run a rank did not finish: the verdict alone."""
    if "losses" not in s:
        return s.verdict()
    name = f"ZeRO-{s['stage']}" if s["stage"] else "data parallel (stage 0)"
    held = s["state_breakdown"]
    theory_held = s["theory_state_bytes_per_rank"]
    theory_held = theory_held[0] if isinstance(theory_held, list) else theory_held
    offload = ", offload" if s["offload"] else ""
    precision = s.get("precision", "fp32")
    numbers = s["dtype"] if precision == "fp32" else f"{precision}, reduce in {s['reduce_dtype']}"
    unit = "4Ψ" if precision == "fp32" else "2Ψ"  # psi_equivalent counts the weights' bytes
    lines = [
        f"{name} on {s['nproc']} ranks ({s['backend']}, {s['model']} model, {numbers}"
        f"{offload}), {s['steps']} AdamW steps",
        f"  losses      max relative difference to the reference {s['max_rel_loss_diff']:.1e}",
        f"  parameters  max relative difference {s['max_rel_param_diff']:.1e} ({s['worst_param']})",
        f"  held/rank   {_kb(s['state_bytes_per_rank'][0])} measured,"
        f" {_kb(theory_held)} theory (params {_kb(held['params'])},"
        f" grads {_kb(held['grads'])}, optimizer {_kb(held['optimizer'])})",
        f"  sent/rank   {_kb(s['comm_bytes_per_rank'][0])} per step measured,"
        f" {_kb(s['theory_comm_bytes_per_rank'])} theory"
        f" = {s['psi_equivalent']:.3g} x (N-1)/N x {unit}",
    ]
    if s["stage"] == 3:
        lines.append(
            f"  peak params {_kb(s['peak_param_bytes_per_rank'][0])} in forward measured,"
            f" {_kb(s['theory_peak_param_bytes'])} theory (shards + unit k + prefetched k+1)"
        )
    if s["offload"]:
        lines.append(
            f"  host link   {_kb(s['host_bytes_per_step'])} per step measured, "
            f"{_kb(s['theory_host_bytes_per_step'])} theory; on host {_kb(held['host'])}"
        )
    if s.get("torch_step_time_s"):
        lines.append(
            f"  step time   ours {s['step_time_s'] * 1e3:.0f} ms, torch's {s['torch_impl']} "
            f"{s['torch_step_time_s'] * 1e3:.0f} ms;"
            f" torch holds {_kb(s['torch_state_bytes_per_rank'][0])} per rank,"
            f" losses within {s['torch_max_rel_loss_diff']:.1e} of the reference"
        )
    else:
        lines.append(f"  step time   {s['step_time_s'] * 1e3:.0f} ms (median)")
    return "\n".join(lines) + "\n" + s.verdict()


def plot_stages(sweep: list[RunSummary], axes=None):
    """Measured (bars) against theory (black ticks), stages 0-3: state bytes held per rank by
    parameters, gradients and optimizer state, and bytes sent per rank per step."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    mem, comm = axes
    x = [s["stage"] for s in sweep]
    bottom = [0] * len(sweep)
    for kind, colour in (
        ("params", "tab:blue"),
        ("grads", "tab:orange"),
        ("optimizer", "tab:green"),
    ):
        vals = [s["state_breakdown"][kind] / 1e3 for s in sweep]
        mem.bar(x, vals, bottom=bottom, color=colour, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    theory_held = [s["theory_state_bytes_per_rank"] for s in sweep]
    mem.scatter(
        x,
        [(t[0] if isinstance(t, list) else t) / 1e3 for t in theory_held],
        marker="_",
        s=900,
        color="black",
        label="theory",
        zorder=3,
    )
    mem.set(
        title=f"state held per rank ({sweep[0]['nproc']} ranks)", xlabel="ZeRO stage", ylabel="kB"
    )
    comm.bar(
        x,
        [s["comm_bytes_per_rank"][0] / 1e3 for s in sweep],
        color="tab:purple",
        label="measured (ledger)",
    )
    comm.scatter(
        x,
        [s["theory_comm_bytes_per_rank"] / 1e3 for s in sweep],
        marker="_",
        s=900,
        color="black",
        label="theory",
        zorder=3,
    )
    comm.set(title="bytes sent per rank per step", xlabel="ZeRO stage", ylabel="kB")
    for ax in axes:
        ax.set_xticks(x)
        ax.legend(fontsize=8, markerscale=0.3)
    return axes


def format_sees(sees: dict) -> str:
    """``what_a_rank_sees``'s answers, one line per question, one column per stage."""
    questions = list(next(iter(sees.values())))
    width = max(len(q) for q in questions)
    lines = []
    for q in questions:
        lines.append(f"{q:<{width}}")
        for stage, seen in sees.items():
            lines.append(f"  ZeRO-{stage}: {seen[q]}")
    return "\n".join(lines)
