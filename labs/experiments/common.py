"""What every experiment shares: the summary every lab reports, timing, and a readable printout.

An *experiment* (``labs.experiments.<lab>``) runs one lab on N ranks and checks it
three ways: against the single-process reference, against the theory's figures and,
where one exists, against PyTorch's own implementation. Each module exposes

    run(*, nproc, steps, backend="auto", vs_torch=False, timeout=..., <lab options>) -> dict
    add_arguments(parser)          # its own command-line options for ``python -m labs.run``

and ``run`` returns a summary with at least ``SUMMARY_KEYS``.
"""

from __future__ import annotations

import json
import statistics
import time

from labs.runtime.device import synchronize
from labs.theory.memory import ModelSpec

SUMMARY_KEYS = (
    "lab",
    "nproc",
    "backend",
    "impl",
    "steps",
    "loss",
    "reference_loss",
    "max_abs_loss_diff",
    "comm_bytes_per_rank",
    "theory_comm_bytes_per_rank",
    "state_bytes_per_rank",
    "theory_state_bytes_per_rank",
    "step_time_s",
    "torch_step_time_s",
)


def course_spec(cfg) -> ModelSpec:
    """The theory's description of the course model ``cfg`` (a
    ``labs.models.transformer.ModelConfig``)."""
    return ModelSpec(
        vocab_size=cfg.vocab_size,
        hidden=cfg.n_embd,
        n_layers=cfg.n_layer,
        n_heads=cfg.n_head,
        n_kv_heads=cfg.n_kv_head,
        ffn_hidden=cfg.ffn_hidden,
        tied_embeddings=cfg.tie_embeddings,
    )


def new_summary(lab: str, *, nproc: int, backend: str, steps: int, **extra) -> dict:
    """A summary with every required key (None until the experiment fills it in)."""
    from labs.runtime.impl import implementation

    summary = dict.fromkeys(SUMMARY_KEYS)
    summary.update(lab=lab, nproc=nproc, backend=backend, impl=implementation(), steps=steps)
    summary.update(extra)
    return summary


def fill_losses(summary: dict, losses: list[float], reference: list[float], dtype=None) -> dict:
    """Record a run's losses beside the reference's: ``loss`` and ``reference_loss`` (last step),
    ``losses``, ``reference_losses``, ``max_abs_loss_diff``, ``max_rel_loss_diff`` and
    ``matches_reference`` (every step within the tolerance for ``dtype``, fp32 by default)."""
    import torch

    from labs.train import TOLERANCES, compare_losses

    diff = compare_losses(losses, reference)
    summary.update(
        loss=losses[-1],
        reference_loss=reference[-1],
        losses=list(losses),
        reference_losses=list(reference),
        **diff,
        matches_reference=diff["max_rel_loss_diff"] <= TOLERANCES[dtype or torch.float32],
    )
    return summary


def median_step_time(times: list[float]) -> float:
    """The median of a run's step times, leaving out the first (warm-up) step when there are
    others."""
    return statistics.median(times[1:] or times)


def median_time(fn, repeats: int, warmup: int = 1, device=None) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 8:
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + ", ...]"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def format_summary(summary: dict) -> str:
    """Two aligned columns, the required keys first."""
    keys = [k for k in SUMMARY_KEYS if k in summary] + sorted(
        k for k in summary if k not in SUMMARY_KEYS
    )
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {_fmt(summary[k])}" for k in keys)


def to_json(summary: dict) -> str:
    return json.dumps(summary, default=float)


COMM_HEADER = f"{'calls':>6}{'payload B':>11}{'sent B/rank':>13}   theory: calls, payload, sent"


def comm_row(measured: dict, theory: dict) -> str:
    """One op's measured ``calls``/``payload_bytes``/``sent_bytes`` beside the theory's, aligned
    under COMM_HEADER."""
    m = [measured.get(k, 0) for k in ("calls", "payload_bytes", "sent_bytes")]
    t = [theory.get(k, 0) for k in ("calls", "payload_bytes", "sent_bytes")]
    return f"{m[0]:>6.10g}{m[1]:>11.10g}{m[2]:>13.10g}   {t[0]:.10g}, {t[1]:.10g}, {t[2]:.10g}"
