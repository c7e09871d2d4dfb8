"""Experiment 11, the clock: per-stage times and the bubble of the pipeline with the encoder on
stage 0.

    result = imbalance(splits=[(0, 4), (2, 2)], nproc=2)     # notebook 11, section 7
    measured_split(result["rows"][0], SIZES["timing"])       # rebalance with the measured costs

Each rank records its "F" and "B" spans (``labs.measure.Timeline``) on the ``timing`` model, big
enough that a stage's compute (milliseconds) outweighs a message; nothing is padded, the durations
are real compute. The splits are trained in one launch with their steps interleaved, so that every
split meets the same machine load (on a shared 2-core machine the load drifts from second to
second). Per split: the median forward and backward time of each stage, the measured idle share
(``idle_fraction``, the median over the timed steps) and each stage's own idle share, the 1F1B
schedule run on paper with the measured times and mean delay
(``labs.theory.pipeline.fit_timeline``'s ``t_delay``), and the prediction from FLOPs
(``labs.theory.multimodal.pipeline_balance``). Every split's losses are checked against the
reference too.
"""

from __future__ import annotations

import statistics

import torch

from labs.experiments.checks import losses_check, matches
from labs.experiments.multimodal_setup import SIZES, check_args, reference_run, specs
from labs.experiments.multimodal_workers import pp_worker
from labs.measure import idle_fraction
from labs.measure.timeline import busy_time
from labs.models.vision import MultimodalConfig
from labs.runtime.launcher import launch
from labs.theory import multimodal as theory
from labs.theory.pipeline import fit_timeline
from labs.train import TrainConfig, compare_losses, rule


def measure_timelines(
    runs: list[dict], *, split, microbatches: int, cfg: MultimodalConfig, batch_size: int
) -> dict:
    """From one split's timed steps (``runs``: its result on each rank): each stage's median forward
    and backward time; the measured bubble (idle share of stages x step, ``idle_fraction``; the
    median over the steps) and each stage's own idle share (``stage_idle``); the median step's span
    and chart; the schedule on paper with the measured times and mean delay (``simulated_bubble``);
    the prediction from FLOPs (``flops_bubble``, ``flops_stage_share``)."""
    timed = len(runs[0]["timelines"])
    steps = [[e for r in runs for e in r["timelines"][i]] for i in range(timed)]
    spans = [max(e.end for e in ev) - min(e.start for e in ev) for ev in steps]
    median = sorted(range(len(steps)), key=lambda i: spans[i])[len(steps) // 2]

    def median_duration(stage: int, name: str) -> float:
        """A stage's median "F" or "B" span over the timed steps."""
        return statistics.median(
            e.duration for ev in steps for e in ev if e.rank == stage and e.name == name
        )

    t_f = [median_duration(s, "F") for s in range(len(runs))]
    t_b = [median_duration(s, "B") for s in range(len(runs))]
    dicts = [
        {"rank": e.rank, "name": e.name, "start": e.start, "end": e.end, "chunk": 0, **e.meta}
        for e in steps[median]
    ]
    t_delay = fit_timeline(dicts, "1f1b", len(runs), microbatches)["t_delay"]
    on_paper = theory.simulate_stages(t_f, t_b, microbatches, t_delay=t_delay)
    spec, enc = specs(cfg)
    flops = theory.pipeline_balance(
        spec,
        enc,
        split=split,
        text_tokens=cfg.caption_len,
        mbs=batch_size // microbatches,
        microbatches=microbatches,
    )
    total = sum(t_f) + sum(t_b)
    P = len(runs)
    idle = [[1 - busy_time(ev, r) / span for r in range(P)] for ev, span in zip(steps, spans)]
    bubbles = [idle_fraction(ev, names=("F", "B")) for ev in steps]
    return {
        "t_forward": t_f,
        "t_backward": t_b,
        "stage_time": [f + b for f, b in zip(t_f, t_b)],
        "measured_stage_share": [(f + b) / total for f, b in zip(t_f, t_b)],
        "measured_bubble": statistics.median(bubbles),
        "measured_bubbles": bubbles,
        "stage_idle": [statistics.median(i[r] for i in idle) for r in range(P)],
        "timed_step_s": spans[median],
        "events": dicts,
        "t_delay": t_delay,
        "simulated_bubble": on_paper["bubble_fraction"],
        "simulated_step_s": on_paper["makespan"],
        "flops_bubble": flops["bubble_fraction"],
        "flops_imbalance": flops["imbalance"],
        "flops_stage_share": [t / sum(flops["stage_time"]) for t in flops["stage_time"]],
        "imbalance": max(f + b for f, b in zip(t_f, t_b)) / (total / P),
    }


def measured_split(row: dict, cfg: MultimodalConfig, *, stages: int | None = None) -> tuple:
    """Rebalance from a measured run of the encoder alone on stage 0 (``row`` of ``imbalance``,
    split (0, n)): the encoder costs stage 0's time; stage 1's time is n layers plus the head,
    shared between them in their FLOP ratio. Returns ``split_for_costs``' split for ``stages``
    (default: the run's)."""
    split = row["split"]
    if len(split) != 2 or split[0] != 0:
        raise ValueError(f"measured_split needs a run with split=(0, n), got split={split}")
    spec, _ = specs(cfg)
    flops = theory.decoder_flops(spec, seq=cfg.seq_len, mbs=1)
    n = spec.n_layers
    layer = row["stage_time"][1] * flops["per_layer"] / (n * flops["per_layer"] + flops["head"])
    return theory.split_for_costs(
        encoder=row["stage_time"][0],
        layer=layer,
        head=row["stage_time"][1] - n * layer,
        n_layers=n,
        stages=stages or len(split),
    )


def imbalance(
    *,
    splits=((0, 4), (2, 2)),
    nproc: int = 2,
    steps: int = 5,
    microbatches: int = 4,
    batch_size: int = 16,
    size: str = "timing",
    seed: int = 0,
    backend: str = "auto",
    timeout: float = 300.0,
) -> dict:
    """Train the pipeline once per split in one launch, the splits' steps interleaved, and time
    every step after the first (warm-up). Returns ``rows`` (per split: its losses vs the reference
    and ``measure_timelines``'s figures) and ``uniform_bubble`` = (P-1)/(M+P-1), what equal stages
    would give."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {tuple(SIZES)}")
    cfg = SIZES[size]
    train = TrainConfig(steps=steps, batch_size=batch_size, seed=seed)
    if steps < 2:
        raise ValueError(f"steps={steps}: the first step is a warm-up, use steps >= 2")
    splits = [
        check_args(
            cfg, nproc=nproc, mode="pp", split=sp, microbatches=microbatches, zero=0, train=train
        )
        for sp in splits
    ]
    ref = reference_run(cfg, train)
    per_rank = launch(
        pp_worker,
        nproc,
        cfg,
        train,
        splits,
        microbatches,
        steps - 1,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc=f"splits {', '.join(map(str, splits))}",
    )
    rows = []
    for k, split in enumerate(splits):
        runs = [r[k] for r in per_rank]
        row = {
            "split": split,
            "losses": runs[-1]["losses"],
            **compare_losses(runs[-1]["losses"], ref.losses),
        }
        bounds = rule("value", torch.float32, per_rank.backend).per_step(len(ref.losses))
        row["checks"] = [losses_check(runs[-1]["losses"], ref.losses, tolerance=bounds)]
        row["matches_reference"] = matches(row["checks"], "reference")
        rows.append(
            {
                **row,
                **measure_timelines(
                    runs, split=split, microbatches=microbatches, cfg=cfg, batch_size=batch_size
                ),
            }
        )
    return {
        "nproc": nproc,
        "microbatches": microbatches,
        "size": size,
        "batch_size": batch_size,
        "rows": rows,
        "uniform_bubble": (nproc - 1) / (microbatches + nproc - 1),
        "reference_losses": ref.losses,
    }
