"""Experiment 02, the timeline: when each all-reduce of a real DDP step runs, on every rank.

    trace = measure_overlap(nproc=2, variant="bucketed")   # notebook 02, beside the simulation
    trace["spans"]        # span dicts like labs.theory.overlap.simulate_backward's, with a rank
    trace["per_rank"]     # backward time, wait after it, exposed communication, all-reduces
    traces = overlap_gain(nproc=2, op_time=0.005)          # naive and overlapped, compute padded
    print(overlap_table(traces))

A traced step runs forward, backward, ``finish_gradient_synchronization`` and the optimizer
under ``labs.measure.Timeline`` spans; ``trace_all_reduces`` (``labs.measure.timeline``)
records every ``dist.all_reduce`` from launch to completion: on a GPU between CUDA events
around NCCL's work; on the CPU until gloo's communication thread completes the work's
future (the real end, not when someone waits). A bucket's all-reduce is launched the
moment its last gradient is ready, so the launches cut the backward span into per-bucket
compute segments.

Padding (``op_time``), as notebooks 04 and 05 pad compute: each matrix product of forward and
backward lasts at least ``op_time`` seconds, the rest slept out (``labs.experiments.tp_overlap.
PaddedMatmuls``). An overlap needs the backward and gloo's communication thread to run at once;
on a laptop whose cores the ranks share they take turns, and overlapping gains nothing. A sleep,
like a GPU kernel, leaves the cores to gloo: with padding, what overlapping hides shows.
"""

from __future__ import annotations

import statistics

from labs.experiments.ddp import DEFAULT_BUCKET_MB, Job, backward_order_bytes, build, wrap
from labs.experiments.tp_overlap import padded
from labs.measure import Timeline
from labs.measure.timeline import Event, trace_all_reduces
from labs.models.transformer import ModelConfig
from labs.runtime.device import rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.theory.comm import all_reduce_bytes
from labs.theory.dims import check_divides, check_positive
from labs.theory.overlap import VARIANTS, MiB, all_reduce_calls, bucket_layout
from labs.train import TrainConfig, make_optimizer


def overlap_worker(variant: str, job: Job, op_time: float = 0.0) -> list[list[Event]]:
    """Every step traced: forward, backward, wait for the all-reduces, optimizer; one list of
    events per step. ``op_time``: each matrix product of forward and backward padded to that many
    seconds."""
    ddp = exercise("ddp")
    model = wrap(variant, build(job, rank_device()), bucket_mb=job.bucket_mb)
    optimizer = make_optimizer(model.parameters(), job.train)
    steps = []
    for [(x, y)] in ddp.rank_data(job.train):
        timeline = Timeline()  # a barrier, then t = 0 on every rank
        optimizer.zero_grad(set_to_none=True)
        with trace_all_reduces(timeline):
            with timeline.span("forward"), padded(op_time):
                _, loss = model(x, y)
            with timeline.span("backward"), padded(op_time):
                loss.backward()
            with timeline.span("wait"):
                model.finish_gradient_synchronization()
        with timeline.span("optimizer"):
            optimizer.step()
        report_progress()
        steps.append(timeline.events)
    return steps


def step_figures(events: list[Event], nproc: int) -> dict:
    """One rank's step, from its events: backward, the wait after it, the two together (what
    overlapping shortens), the communication still running when backward ended (exposed), and
    the all-reduces."""
    span = {e.name: e for e in events if e.name != "all_reduce"}
    reduces = [e for e in events if e.name == "all_reduce"]
    return {
        "backward_s": span["backward"].duration,
        "wait_s": span["wait"].duration,
        "backward_and_wait_s": span["wait"].end - span["backward"].start,
        "exposed_s": max(0.0, max(e.end for e in reduces) - span["backward"].end),
        "all_reduces": len(reduces),
        "comm_s": sum(e.duration for e in reduces),
        "sent_bytes": sum(all_reduce_bytes(e.meta["bytes"], nproc) for e in reduces),
    }


def last_rank_figures(ranks_events: list[list[Event]], nproc: int) -> dict:
    """One step: ``step_figures`` of the rank whose backward ended last (the ranks' clocks start
    together, after a barrier), and which rank that was."""
    ends = [next(e.end for e in events if e.name == "backward") for events in ranks_events]
    last = max(range(len(ends)), key=ends.__getitem__)
    return {"rank": last, **step_figures(ranks_events[last], nproc)}


def overlap_spans(events: list[Event]) -> list[dict]:
    """Measured events as the span dicts of ``labs.theory.overlap.simulate_backward``, per rank:
    the backward is cut where each all-reduce was launched (that bucket's gradients were ready)."""
    spans = []
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        backward = next(e for e in mine if e.name == "backward")
        reduces = sorted(
            (e for e in mine if e.name == "all_reduce"), key=lambda e: e.meta["bucket"]
        )
        cut = backward.start
        for e in reduces:
            if backward.start <= e.start <= backward.end:
                spans.append(
                    {
                        "rank": rank,
                        "lane": "compute",
                        "kind": "backward",
                        "start": cut,
                        "end": e.start,
                        "bucket": e.meta["bucket"],
                    }
                )
                cut = e.start
        if cut < backward.end:
            spans.append(
                {
                    "rank": rank,
                    "lane": "compute",
                    "kind": "backward",
                    "start": cut,
                    "end": backward.end,
                    "bucket": None,
                }
            )
        spans += [
            {
                "rank": rank,
                "lane": "comm",
                "kind": "all_reduce",
                "start": e.start,
                "end": e.end,
                "bucket": e.meta["bucket"],
                "bytes": e.meta["bytes"],
            }
            for e in reduces
        ]
        spans += [
            {
                "rank": rank,
                "lane": "compute",
                "kind": e.name,
                "start": e.start,
                "end": e.end,
                "bucket": None,
            }
            for e in mine
            if e.name in ("forward", "wait", "optimizer")
        ]
    return spans


def measure_overlap(
    *,
    nproc: int = 2,
    steps: int = 3,
    variant: str = "bucketed",
    bucket_mb: float = DEFAULT_BUCKET_MB,
    n_layer: int = 2,
    n_embd: int = 64,
    batch_size: int = 8,
    op_time: float = 0.0,
    backend: str = "auto",
    timeout: float = 120.0,
) -> dict:
    """Trace ``steps`` steps on every rank. Returns the last step's spans; per rank its backward
    time, the wait for communication after it, the exposed communication and the all-reduces
    (``step_figures``); ``steps``: each later step seen from the rank that finished backward last
    (``last_rank_figures``), and their medians (``median_exposed_s``,
    ``median_backward_and_wait_s``: steadier on a busy machine); and ``simulation``:
    ``labs.theory.overlap.simulate_ddp``'s inputs fitted to this run.
    ``op_time``: pad each matrix product to that many seconds (0: no padding; see above)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    if not op_time >= 0:
        raise ValueError(f"op_time={op_time!r} must be >= 0 (seconds per matrix product)")
    check_positive(nproc=nproc, steps=steps)
    check_divides(batch_size, "batch_size", nproc, "nproc")
    job = Job(
        variants=(variant,),
        model_cfg=ModelConfig(n_layer=n_layer, n_embd=n_embd),
        bucket_mb=bucket_mb,
        train=TrainConfig(steps=steps, batch_size=batch_size),
    )
    traced = launch(
        overlap_worker,
        nproc,
        variant,
        job,
        op_time,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc="traced steps",
    )
    events = [e for rank_steps in traced for e in rank_steps[-1]]  # the last step's
    per_rank = [step_figures(rank_steps[-1], nproc) for rank_steps in traced]
    # Each step after the first, seen from the rank that finished backward last: what it waits
    # for then is communication alone. (An earlier rank also waits for that rank: skew, which a
    # busy machine makes large and random, and which overlapping cannot remove.)
    later = [
        last_rank_figures([rank_steps[s] for rank_steps in traced], nproc) for s in range(1, steps)
    ] or [last_rank_figures([r[-1] for r in traced], nproc)]
    model = build(job)
    grads = backward_order_bytes(model)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = batch_size // nproc * job.train.seq_len
    # The simulator's inputs fitted to this run: FLOP/s from backward's length (4 FLOPs per
    # parameter per token), bandwidth from the bytes sent over the time the all-reduces took.
    simulation = dict(
        variant=variant,
        params_m=n_params / 1e6,
        layers=n_layer,
        bucket_mb=bucket_mb,
        ranks=nproc,
        bytes_per_grad=next(model.parameters()).element_size(),
        tokens_per_rank=tokens,
        latency_us=1.0,
        tflops=4 * n_params * tokens / statistics.mean(r["backward_s"] for r in per_rank) / 1e12,
        bandwidth_gbs=sum(r["sent_bytes"] for r in per_rank)
        / sum(r["comm_s"] for r in per_rank)
        / 1e9,
    )
    return {
        "variant": variant,
        "nproc": nproc,
        "bucket_mb": bucket_mb,
        "op_time": op_time,
        "steps": later,
        "median_exposed_s": statistics.median(f["exposed_s"] for f in later),
        "median_backward_and_wait_s": statistics.median(f["backward_and_wait_s"] for f in later),
        "spans": overlap_spans(events),
        "per_rank": per_rank,
        "n_params": n_params,
        "simulation": simulation,
        "theory_calls": all_reduce_calls(variant, grads, bucket_mb * MiB),
        "buckets": bucket_layout(grads, bucket_mb * MiB),
    }


def overlap_gain(
    *,
    nproc: int = 2,
    op_time: float = 0.005,
    steps: int = 6,
    variants: tuple[str, ...] = ("naive", "overlapped"),
    **options,
) -> dict[str, dict]:
    """``measure_overlap`` of each variant, compute padded to ``op_time`` seconds per matrix
    product: ``{variant: trace}``. With padding the overlapped variants hide their all-reduces
    behind backward and end the step sooner than naive, which waits for all of them after it
    (notebook 02, section 6; ``overlap_table`` prints the figures)."""
    return {
        v: measure_overlap(nproc=nproc, variant=v, op_time=op_time, steps=steps, **options)
        for v in variants
    }


def overlap_table(traces: dict[str, dict]) -> str:
    """Per variant, in ms, the medians over the steps after the first, on the rank that finished
    backward last: backward and the wait for its communication after it, and the communication
    still running when backward ended (exposed)."""
    op_time = next(iter(traces.values()))["op_time"]
    lines = [
        f"{'variant':<11} {'all-reduces':>11} {'backward + wait':>16} {'exposed':>8}"
        f"   (ms per step, the last rank out of backward; matmuls padded to {op_time * 1e3:g} ms)"
    ]
    for variant, trace in traces.items():
        lines.append(
            f"{variant:<11} {trace['per_rank'][0]['all_reduces']:>11}"
            f" {trace['median_backward_and_wait_s'] * 1e3:>16.1f}"
            f" {trace['median_exposed_s'] * 1e3:>8.1f}"
        )
    return "\n".join(lines)
