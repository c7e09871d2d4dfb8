"""Mixed precision, measured (notebooks 02 and 03): the same training in fp32, in bf16 reducing the
gradients in fp32, and in bf16 reducing them in bf16, side by side.

    curves = loss_curves("ddp", nproc=4, steps=30)             # notebook 02: bucketed DDP
    curves = loss_curves("zero", nproc=4, steps=30, stage=3)   # notebook 03: ZeRO-3
    print(format_stages(zero_stages(nproc=4)))                 # bf16-mixed bytes, stages 0-3
    print(format_curves(curves))                               # bytes, loss differences, time
    plot_curves(curves)                                        # the losses, and bf16 minus fp32
    python -m labs.run ddp --precision bf16-mixed --reduce-dtype bf16 --json   # one of them

Each run is a whole lab run (``labs.experiments.ddp.run`` or ``labs.experiments.zero.run``) with
its own verdict: the bf16 ones against the single-process reference under the same policy, with
the tolerance table's mixed rows (``labs.train``). What the curves show: bf16 costs little loss on
this model (a few 1e-4 of it after 30 steps); reducing in bf16 halves the gradient bytes on the
wire and, from 3 ranks on, rounds every partial sum (on 2 ranks a bf16 all-reduce adds once and
rounds once: the same numbers as an fp32 reduction rounded to bf16).
"""

from __future__ import annotations

from labs.experiments.common import RunSummary
from labs.experiments.spec import Lab, command_labs

# label -> (precision, reduce_dtype)
POLICIES = {
    "fp32": ("fp32", None),
    "bf16, reduce in fp32": ("bf16-mixed", "fp32"),
    "bf16, reduce in bf16": ("bf16-mixed", "bf16"),
}


def mixed_precision_labs() -> dict[str, Lab]:
    """The labs that train in mixed precision (ddp, zero): those whose options extend
    ``labs.train.PrecisionOptions``."""
    from labs.train import PrecisionOptions

    return {
        name: lab
        for name, lab in command_labs().items()
        if issubclass(lab.options, PrecisionOptions)
    }


def loss_curves(lab: str = "ddp", *, nproc: int = 4, steps: int = 30, **options) -> dict:
    """One run of ``lab`` ("ddp" or "zero") per policy of ``POLICIES``, the same model, data and
    steps: {label: summary}. ``options`` go to every run (e.g. ``stage=3``, ``variant=...``)."""
    labs = mixed_precision_labs()
    if lab not in labs:
        raise ValueError(f"lab={lab!r} is not one of {tuple(labs)}")
    run = labs[lab].run
    return {
        label: run(nproc=nproc, steps=steps, precision=precision, reduce_dtype=reduce, **options)
        for label, (precision, reduce) in POLICIES.items()
    }


def zero_stages(*, nproc: int = 4, steps: int = 5, precision: str = "bf16-mixed") -> list:
    """ZeRO stages 0-3 in ``precision`` (reducing in fp32): one summary per stage."""
    zero = mixed_precision_labs()["zero"]
    return [zero.run(nproc=nproc, steps=steps, stage=k, precision=precision) for k in range(4)]


def format_stages(sweep: list[RunSummary]) -> str:
    """Bytes held per rank, role by role, beside the memory calculator's figures for the run's
    precision (``labs.theory.memory.state_bytes``; bf16-mixed: 2 + 2 + 12 bytes per parameter,
    sharded by the stage), and the verdict. ZeRO-3 holds the calculator's total in FSDP2's
    layout (fp32 shard, fp32 gradient shard, moments: 4 + 4 + 8)."""
    from labs.theory.memory import state_bytes

    roles = (
        ("params", "param_bytes"),
        ("grads", "grad_bytes"),
        ("optimizer", "optimizer_bytes"),
        ("total", "total_bytes"),
    )
    lines = [
        "bytes per rank, measured / the calculator's",
        f"{'stage':<8}" + "".join(f"{role:>22}" for role, _ in roles) + "  verdict",
    ]
    for s in sweep:
        precision = "fp32" if s["precision"] == "fp32" else "bf16-mixed"  # fp16: the same bytes
        calc = state_bytes(
            s["n_params"], precision=precision, optimizer="adamw", zero=s["stage"], dp=s["nproc"]
        )
        held = s["state_breakdown"]
        cells = "".join(f"{f'{held[k]:,} / {calc[key]:,.0f}':>22}" for k, key in roles)
        lines.append(f"ZeRO-{s['stage']:<3}{cells}  {'PASS' if s.passed else 'FAIL'}")
    return "\n".join(lines)


def _sent(s: RunSummary) -> float:
    sent = s["comm_bytes_per_rank"]
    return sent[0] if isinstance(sent, list) else sent


def _held(s: RunSummary) -> float:
    held = s["state_bytes_per_rank"]
    return held[0] if isinstance(held, list) else held


def format_curves(curves: dict[str, RunSummary]) -> str:
    """One line per policy: bytes held per rank beside the calculator's figure, bytes sent per
    rank per step, the largest loss difference to its own reference and to the fp32 run, the
    step time, and the verdict."""
    fp32 = curves["fp32"]["losses"]
    lines = [
        f"{'policy':<22}{'held B/rank':>12}{'calculator':>11}{'sent B/step':>12}"
        f"{'vs its ref':>11}{'vs fp32':>9}{'step ms':>9}  verdict"
    ]
    for label, s in curves.items():
        vs_fp32 = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], fp32))
        theory = s["theory_state_bytes_per_rank"]
        theory = theory[0] if isinstance(theory, list) else theory
        lines.append(
            f"{label:<22}{_held(s):>12,.0f}{theory:>11,.0f}{_sent(s):>12,.0f}"
            f"{s['max_rel_loss_diff']:>11.1e}{vs_fp32:>9.1e}{s['step_time_s'] * 1e3:>9.1f}"
            f"  {'PASS' if s.passed else 'FAIL'}"
        )
    return "\n".join(lines)


def plot_curves(curves: dict[str, RunSummary], axes=None):
    """Left: each policy's losses (mean over ranks). Right: each bf16 run's loss minus the fp32
    run's, step by step (what bf16 costs), and reducing in bf16 minus reducing in fp32 (what the
    reduction's dtype alone changes)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    left, right = axes
    fp32 = curves["fp32"]["losses"]
    steps = range(1, len(fp32) + 1)
    for (label, s), style in zip(curves.items(), ("-", "--", ":")):
        left.plot(steps, s["losses"], style, lw=2, label=label)
        if label != "fp32":
            right.plot(steps, [a - b for a, b in zip(s["losses"], fp32)], style, lw=2, label=label)
    first = next(iter(curves.values()))
    where = f"{first['lab']}" + (f", ZeRO-{first['stage']}" if "stage" in first else "")
    left.set_title(f"losses ({where}, {first['nproc']} ranks)")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.legend()
    low, high = (curves[k]["losses"] for k in ("bf16, reduce in bf16", "bf16, reduce in fp32"))
    right.plot(
        steps,
        [a - b for a, b in zip(low, high)],
        "-",
        color="0.3",
        lw=1,
        label="bf16 − fp32 reduce",
    )
    right.axhline(0.0, color="0.6", lw=1)
    right.set_title("loss minus the fp32 run's")
    right.set_xlabel("step")
    right.legend()
    left.figure.tight_layout()
    return left.figure
