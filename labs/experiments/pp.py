"""Experiment 05: pipeline schedules on P ranks against the reference, the bubble formula and
torch's pipelining.

    summary = run(nproc=4, schedule="1f1b", microbatches=8)     # notebook 05, or:
    python -m labs.run pp --schedule 1f1b --nproc 4 --microbatches 8 --vs-torch --json

Checks, for ``naive`` (one forward, inference) and the training schedules ``gpipe``,
``1f1b`` and ``interleaved``:

* reference: every step's loss, and every gradient after step 1 (by name, on the rank that
  holds it), equal the single-process run on the same global batch (fp32, 1e-5 relative);
  naive: the logits equal the full model's;
* theory: bytes each rank sends (ledger) = ``p2p_bytes_per_rank``; the order of F and B on
  each rank = ``schedule_ops``; the peak number of micro-batches whose activations a stage
  holds (saved-tensor accounting, below) = ``in_flight_microbatches``; the measured bubble
  next to (P-1)/(V·M+P-1);
* torch: ``torch.distributed.pipelining`` (PipelineStage with ScheduleGPipe / Schedule1F1B /
  ScheduleInterleaved1F1B) on the same split: same losses, step time side by side.

Measuring the bubble on a laptop. With 4 ranks on 2 cores an operation of our tiny model
takes about a millisecond, as long as the send/recv around it, and ranks share cores, so a
raw timeline mostly shows the machine (``raw_bubble_fraction``). The measurement step
therefore pads each operation with a sleep to ``op_time`` (forward) and
``backward_ratio·op_time`` (backward), as if every stage's compute were that long: the
durations are set, the gaps between them are real waits for real messages. That makes
the schedule's shape visible and its idle share comparable with the formula
(``bubble_fraction``). What is left between the two is delay: ``delay_bubble_fraction`` is
the schedule run on paper with the measured operation times and the measured mean delay of
an operation (message latency, a busy CPU; ``labs.theory.pipeline.fit_timeline``).
``op_time=0`` turns padding off.

Activations held: during each "F" span, saved-tensor hooks tag every tensor autograd saves
with the span's (micro-batch, chunk); when autograd frees it (after that backward) the tag
is released. The peak number of tags alive at once is the measured micro-batches held.
"""

from __future__ import annotations

import socket
import sys
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs.experiments.common import course_spec, fill_losses, median_step_time, new_summary
from labs.measure import CommLedger, Timeline, idle_fraction, state_bytes
from labs.models.transformer import ModelConfig, build_model
from labs.runtime.device import one_thread, synchronize
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.runtime.pipe import pipe_group
from labs.theory import pipeline as theory
from labs.theory.dims import ParallelDims, check_divides
from labs.theory.memory import param_counts
from labs.train import (
    TOLERANCES,
    TrainConfig,
    compare_losses,
    data_for,
    make_optimizer,
    max_rel_diff,
    train_reference,
)

CHOICES = ("naive", "gpipe", "1f1b", "interleaved")
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
}


class MeasuredTimeline(Timeline):
    """A Timeline whose "F"/"B" spans last at least ``op_time`` / ``backward_ratio·op_time``
    (sleeping out the rest), and that counts the activations each "F" span leaves alive."""

    def __init__(self, *, op_time: float = 0.0, backward_ratio: float = 2.0, exclude=()):
        super().__init__()
        self.min_time = {"F": op_time, "B": backward_ratio * op_time}
        self._params = {p.untyped_storage().data_ptr() for p in exclude}
        self.live: dict[tuple, int] = defaultdict(
            int
        )  # (micro-batch, chunk) -> saved tensors alive
        self.peak_held = 0
        self.bytes = 0
        self.peak_bytes = 0
        self._tag = None

    @contextmanager
    def span(self, name: str, **meta):
        start = time.perf_counter()
        self._tag = (meta.get("microbatch"), meta.get("chunk"))
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            if name == "F"
            else nullcontext()
        )
        with super().span(name, **meta), hooks:
            yield
            pad = self.min_time.get(name, 0.0) - (time.perf_counter() - start)
            if pad > 0:
                time.sleep(pad)

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self._params:
            return t  # weights are state, not activations
        held = _Held(t)
        tag = self._tag
        nbytes = t.numel() * t.element_size()
        self.live[tag] += 1
        self.bytes += nbytes
        self.peak_held = max(self.peak_held, sum(1 for n in self.live.values() if n))
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(
            held, self._release, tag, nbytes
        )  # runs when autograd frees the saved tensor
        return held

    def _release(self, tag, nbytes):
        self.live[tag] -= 1
        self.bytes -= nbytes


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Held) else packed


def _events(timeline) -> dict:
    """The spans, and what it takes to put every rank's on one clock: ``time.perf_counter`` is
    CLOCK_MONOTONIC on Linux, one clock for all processes of a machine, so the ranks' origins
    (``timeline.origin``) line their spans up exactly; the barrier before each origin only
    lines them up to within its exit skew, milliseconds on a busy machine."""
    return {
        "host": socket.gethostname(),
        "origin": timeline.origin,
        "spans": [
            {
                "rank": e.rank,
                "name": e.name,
                "microbatch": e.meta.get("microbatch"),
                "chunk": e.meta.get("chunk"),
                "start": e.start,
                "end": e.end,
            }
            for e in timeline.events
        ],
    }


def _one_clock(per_rank, key) -> list[dict]:
    """All ranks' spans of ``key``, on rank 0's clock when all ranks share a machine."""
    shared = len({r[key]["host"] for r in per_rank}) == 1 and sys.platform.startswith("linux")
    out = []
    for r in per_rank:
        shift = r[key]["origin"] - per_rank[0][key]["origin"] if shared else 0.0
        out += [dict(e, start=e["start"] + shift, end=e["end"] + shift) for e in r[key]["spans"]]
    return out


def _stages(pp, pipe, model, plan, virtual):
    """This rank's chunks: virtual stages rank, rank+P, ... (one unless interleaved)."""
    return [
        pp.build_stage(model, plan=plan, stage=c * pipe.size + pipe.rank) for c in range(virtual)
    ]


def split_microbatches(
    x: torch.Tensor, y: torch.Tensor, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut the global batch (x, y), [B, T] each, into ``n`` micro-batches of [B/n, T]."""
    check_divides(x.shape[0], "batch_size", n, "microbatches")
    return list(zip(x.chunk(n), y.chunk(n)))


def _run_step(pp, schedule, chunks, x, y, microbatches, pipe, timeline):
    """One step of ``schedule`` on this rank: the loss on the last rank (naive: the logits)."""
    x, y = x.to(pipe.device), y.to(pipe.device)
    if schedule == "naive":
        return pp.naive_forward(chunks[0], x, pipe=pipe, timeline=timeline)
    mbs = split_microbatches(x, y, microbatches)
    if schedule == "interleaved":
        return pp.train_step_interleaved(chunks, mbs, pipe=pipe, timeline=timeline)
    step = pp.train_step_1f1b if schedule == "1f1b" else pp.train_step_afab
    return step(chunks[0], mbs, pipe=pipe, timeline=timeline)


def pipeline_worker(
    schedule: str,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    microbatches: int,
    virtual: int,
    plan: tuple,
    op_time: float = 0.0,
    backward_ratio: float = 2.0,
    vs_torch: bool = False,
) -> dict:
    """Train ``cfg.steps`` steps (naive: ``cfg.steps`` forwards) with our schedule on this rank,
    then one measured step; optionally the same with torch's pipelining. Returns what this rank
    saw."""
    pp = exercise("pipeline_parallel")
    pipe = pipe_group()
    model = build_model(model_cfg, seed=cfg.seed, device=pipe.device)
    chunks = _stages(pp, pipe, model, plan, virtual)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = make_optimizer(params, cfg) if schedule != "naive" else None
    data = data_for(cfg)
    out = {
        "rank": pipe.rank,
        "backend": dist.get_backend(),
        "losses": [],
        "times": [],
        "grads": {},
        "logits": None,
    }
    for step, (x, y) in enumerate(data):
        first = step == 0
        timeline = MeasuredTimeline(exclude=params) if first else Timeline()
        ledger = CommLedger() if first else nullcontext()
        t0 = time.perf_counter()
        with ledger:
            result = _run_step(pp, schedule, chunks, x, y, microbatches, pipe, timeline)
        if schedule == "naive":
            if result is not None:
                out["logits"] = result if first else out["logits"]
                result = F.cross_entropy(
                    result.float().flatten(0, 1), y.to(result.device).flatten()
                ).item()
        else:
            if first:
                out["grads"] = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}
            optimizer.step()
            if step == len(data) - 1:
                out["state_bytes"] = state_bytes(params, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
        synchronize(pipe.device)
        out["times"].append(time.perf_counter() - t0)
        out["losses"].append(result)
        if first:
            out.update(
                sent_bytes=ledger.sent_bytes(),
                held=timeline.peak_held,
                held_bytes=timeline.peak_bytes,
                order=[(e.name, e.meta["microbatch"], e.meta["chunk"]) for e in timeline.events],
            )
        report_progress()
    out["raw_events"] = _events(timeline)  # the last step's
    if schedule == "naive":
        out["state_bytes"] = state_bytes(params)["total"]
    # the measurement step: padded operations, no update (its gradients are thrown away)
    # an interleaved chunk holds 1/V of the rank's layers, so its operations take 1/V of the time
    measured = MeasuredTimeline(
        op_time=op_time / virtual, backward_ratio=backward_ratio, exclude=params
    )
    _run_step(pp, schedule, chunks, *data[0], microbatches, pipe, measured)
    out["events"] = _events(measured)
    if vs_torch and schedule != "naive":
        out.update(_torch_run(pp, pipe, schedule, model_cfg, cfg, microbatches, virtual, plan))
    return out


def _torch_run(pp, pipe, schedule, model_cfg, cfg, microbatches, virtual, plan) -> dict:
    """The same split trained by torch.distributed.pipelining; losses and step times on this
    rank."""
    import torch.distributed.pipelining as tpp

    if schedule == "1f1b" and microbatches < pipe.size:
        return {
            "torch_skipped": f"Schedule1F1B needs microbatches >= stages ({microbatches} < {pipe.size})"
        }
    model = build_model(model_cfg, seed=cfg.seed, device=pipe.device)
    chunks = _stages(pp, pipe, model, plan, virtual)
    n = pipe.size * virtual
    stages = [
        tpp.PipelineStage(c, c_idx * pipe.size + pipe.rank, n, pipe.device, group=pipe.group)
        for c_idx, c in enumerate(chunks)
    ]

    def loss_fn(
        logits, targets
    ):  # the mean over the micro-batch; torch divides gradients by M (scale_grads)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    cls = getattr(tpp, TORCH_SCHEDULES[schedule])
    sched = cls(
        stages if schedule == "interleaved" else stages[0],
        n_microbatches=microbatches,
        loss_fn=loss_fn,
    )
    optimizer = make_optimizer([p for c in chunks for p in c.parameters()], cfg)
    has_first = chunks[0].first
    has_last = chunks[-1].last
    losses, times = [], []
    for x, y in data_for(cfg):
        x, y, mb_losses = x.to(pipe.device), y.to(pipe.device), []
        t0 = time.perf_counter()
        sched.step(
            *((x,) if has_first else ()), **({"target": y, "losses": mb_losses} if has_last else {})
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(pipe.device)
        times.append(time.perf_counter() - t0)
        losses.append(torch.stack(mb_losses).mean().item() if has_last else None)
    return {"torch_losses": losses, "torch_times": times}


def layer_costs(model_cfg: ModelConfig) -> tuple[list[int], int, int]:
    """Parameters of each block, of the first stage's extra (embedding) and of the last stage's
    extra (final norm and head), from the theory's count."""
    c = param_counts(course_spec(model_cfg))
    return [c["per_layer"]] * model_cfg.n_layer, c["embedding"], c["final_norm"] + c["head"]


def stage_params(model_cfg: ModelConfig, plan: tuple, stages: int) -> list[int]:
    """Parameters each rank holds under ``plan`` (its virtual stages rank, rank+P, ...), from the
    theory."""
    costs, first, last = layer_costs(model_cfg)
    per_stage = theory.plan_costs(costs, plan, first, last)
    return [sum(per_stage[r::stages]) for r in range(stages)]


def make_plan(schedule: str, model_cfg: ModelConfig, stages: int, virtual: int, plan=None) -> tuple:
    """``plan`` checked, or: balanced by parameter count; naive fills device after device up to
    the balanced split's largest stage (the smallest budget per device that fits the model)."""
    n = stages * virtual
    if plan is not None:
        plan = tuple(plan)
        if (
            len(plan) != n
            or sum(plan) != model_cfg.n_layer
            or min(plan) < (0 if schedule == "naive" else 1)
        ):
            raise ValueError(
                f"plan={plan} must give {n} stages (nproc x virtual) layers adding up to "
                f"layers={model_cfg.n_layer}, at least 1 each"
            )
        return plan
    costs, first, last = layer_costs(model_cfg)
    balanced = theory.balanced_plan(costs, n, first_extra=first, last_extra=last)
    if schedule != "naive":
        return balanced
    capacity = max(theory.plan_costs(costs, balanced, first, last))
    return theory.fill_plan(costs, n, capacity=capacity, first_extra=first, last_extra=last)


def validate(
    *, nproc, schedule, microbatches, virtual, layers, batch_size, op_time, backward_ratio
) -> None:
    """Every ValueError a bad option can cause, raised before any rank starts."""
    if schedule not in CHOICES + ("afab",):
        raise ValueError(f"schedule={schedule!r} is not one of {CHOICES}")
    theory.check_schedule(schedule, nproc, microbatches, virtual)
    ParallelDims(pp=nproc).check_model(n_layer=layers, virtual_stages=virtual)
    check_divides(batch_size, "batch_size", microbatches, "microbatches")
    if op_time < 0 or backward_ratio < 0:
        raise ValueError(f"op_time={op_time} and backward_ratio={backward_ratio} must be >= 0")


def run(
    *,
    nproc: int = 4,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual: int | None = None,
    layers: int = 8,
    batch_size: int = 16,
    plan=None,
    op_time: float = 0.02,
    backward_ratio: float = 2.0,
    seed: int = 0,
) -> dict:
    """Run ``schedule`` on ``nproc`` pipeline stages and check it; returns the lab summary.
    Defaults: ``microbatches`` 8 (naive: 1), ``virtual`` 2 for interleaved (else 1)."""
    microbatches = (1 if schedule == "naive" else 8) if microbatches is None else microbatches
    virtual = (2 if schedule == "interleaved" else 1) if virtual is None else virtual
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    validate(
        nproc=nproc,
        schedule=schedule,
        microbatches=microbatches,
        virtual=virtual,
        layers=layers,
        batch_size=batch_size,
        op_time=op_time,
        backward_ratio=backward_ratio,
    )
    model_cfg = ModelConfig(n_layer=layers)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, seed=seed)
    plan = make_plan(schedule, model_cfg, nproc, virtual, plan)
    if vs_torch:
        import torch.distributed.pipelining  # noqa: F401  (slow to import: once here, not in every forked rank)
    ref = reference_run(model_cfg, cfg) if schedule != "naive" else None
    per_rank = launch(
        pipeline_worker,
        nproc,
        schedule,
        model_cfg,
        cfg,
        microbatches,
        virtual,
        plan,
        op_time,
        backward_ratio,
        vs_torch,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc=schedule,
    )
    return summarize(
        per_rank,
        ref,
        schedule=schedule,
        model_cfg=model_cfg,
        cfg=cfg,
        microbatches=microbatches,
        virtual=virtual,
        plan=plan,
        op_time=op_time,
        backward_ratio=backward_ratio,
        vs_torch=vs_torch,
    )


def reference_run(model_cfg: ModelConfig, cfg: TrainConfig):
    """The single-process reference on the same global batches, with step 1's gradients."""
    return train_reference(model_cfg, cfg, return_grads=True)


def summarize(
    per_rank,
    ref,
    *,
    schedule,
    model_cfg,
    cfg,
    microbatches,
    virtual,
    plan,
    op_time,
    backward_ratio,
    vs_torch,
) -> dict:
    """The lab summary from the ranks' results and the reference ``ref`` (None for naive, whose
    reference is the unsplit model's forward): reference, theory and torch side by side."""
    P = len(per_rank)
    last = per_rank[-1]
    timeline = _one_clock(per_rank, "events")  # every rank's measured operations on one clock
    summary = new_summary(
        "pp",
        nproc=P,
        backend=last["backend"],
        steps=cfg.steps,
        schedule=schedule,
        microbatches=microbatches,
        virtual=virtual,
        plan=list(plan),
        op_time_s=op_time,
    )
    if (
        schedule == "naive"
    ):  # inference: compare with the unsplit model's forward on the same batches
        model = build_model(model_cfg, seed=cfg.seed)
        with torch.no_grad(), one_thread():
            reference = [model(x, y)[1].item() for x, y in data_for(cfg)]
            summary["max_logits_rel_diff"] = max_rel_diff(
                last["logits"], model(data_for(cfg)[0][0])
            )
    else:
        reference = ref.losses
        grads = {n: g for r in per_rank for n, g in r["grads"].items()}
        missing = sorted(set(ref.grads) - set(grads))
        summary["max_grad_rel_diff"] = max(
            max_rel_diff(grads[n], g) for n, g in ref.grads.items() if n in grads
        )
        summary["grads_match_reference"] = (
            not missing and summary["max_grad_rel_diff"] <= TOLERANCES[torch.float32]
        )
    fill_losses(summary, last["losses"], reference)
    order = theory.schedule_ops(schedule, P, microbatches, virtual)
    per_stage = stage_params(model_cfg, plan, P)
    summary.update(
        comm_bytes_per_rank=[r["sent_bytes"] for r in per_rank],
        theory_comm_bytes_per_rank=[
            theory.p2p_bytes_per_rank(
                schedule,
                P,
                r,
                batch=cfg.batch_size,
                seq_len=cfg.seq_len,
                hidden=model_cfg.n_embd,
                virtual=virtual,
            )
            for r in range(P)
        ],
        state_bytes_per_rank=[r["state_bytes"] for r in per_rank],
        theory_state_bytes_per_rank=[
            n * (4 if schedule == "naive" else 16) for n in per_stage
        ],  # fp32 + grad + AdamW
        step_time_s=max(median_step_time(r["times"]) for r in per_rank),
        order_matches_schedule=all(
            list(map(tuple, r["order"])) == order[r["rank"]] for r in per_rank
        ),
        bubble_fraction=idle_fraction_of(timeline),
        raw_bubble_fraction=idle_fraction_of(_one_clock(per_rank, "raw_events")),
        theory_bubble_fraction=theory.bubble_fraction(schedule, P, microbatches, virtual),
        simulated_bubble_fraction=theory.simulate(
            schedule, P, microbatches, virtual, 1.0, 0.0 if schedule == "naive" else backward_ratio
        )["bubble_fraction"],
        timeline=timeline,
    )
    # the formula assumes operations start the moment they can; the chart shows how late they did
    fit = theory.fit_timeline(summary["timeline"], schedule, P, microbatches, virtual)
    summary.update(
        measured_t_forward_s=fit["t_forward"],
        measured_t_backward_s=fit["t_backward"],
        measured_delay_s=fit["t_delay"],
        delay_bubble_fraction=fit["bubble_fraction"],
    )
    if schedule != "naive":
        summary.update(
            microbatches_held=[r["held"] for r in per_rank],
            theory_microbatches_held=[
                theory.in_flight_microbatches(schedule, P, microbatches, r, virtual)
                for r in range(P)
            ],
            activation_bytes_held=[r["held_bytes"] for r in per_rank],
        )
    summary["comm_matches_theory"] = (
        summary["comm_bytes_per_rank"] == summary["theory_comm_bytes_per_rank"]
    )
    if vs_torch and "torch_times" in last:
        summary["torch_step_time_s"] = max(median_step_time(r["torch_times"]) for r in per_rank)
        summary["torch_losses"] = last["torch_losses"]
        summary["torch_max_abs_loss_diff"] = compare_losses(last["torch_losses"], reference)[
            "max_abs_loss_diff"
        ]
    elif vs_torch:
        summary["torch_skipped"] = last.get(
            "torch_skipped", "torch.distributed.pipelining has no naive placement"
        )
    return summary


def idle_fraction_of(spans: list[dict]) -> float:
    """The measured bubble: idle share of ranks x makespan in the ranks' "F"/"B" spans."""
    from labs.measure import Event

    return idle_fraction(
        [Event(e["rank"], e["name"], e["start"], e["end"]) for e in spans], names=("F", "B")
    )


def add_arguments(parser) -> None:
    parser.add_argument("--schedule", choices=CHOICES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=None, help="M (default 8; naive: 1)")
    parser.add_argument(
        "--virtual", type=int, default=None, help="V chunks per rank (interleaved; default 2)"
    )
    parser.add_argument("--layers", type=int, default=8, help="layers of the course model")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="global batch (sequences per step)"
    )
    parser.add_argument(
        "--plan",
        type=lambda s: tuple(int(v) for v in s.split(",")),
        default=None,
        help="layers per (virtual) stage, e.g. 3,2,2,1 (default: balanced by parameters)",
    )
    parser.add_argument(
        "--op-time",
        type=float,
        default=0.02,
        help="seconds each forward is padded to in the measured step (0: no padding)",
    )
    parser.add_argument(
        "--backward-ratio",
        type=float,
        default=2.0,
        help="backward time / forward time when padding",
    )
    parser.add_argument("--seed", type=int, default=0)
