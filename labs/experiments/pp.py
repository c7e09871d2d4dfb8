"""Experiment 05: pipeline schedules on P ranks against the reference, the bubble formula and
torch's pipelining.

    summary = run(nproc=4, schedule="1f1b", microbatches=8)     # notebook 05
    python -m labs.run pp --schedule 1f1b --nproc 4 --microbatches 8 --vs-torch --json

Checks, for ``naive`` (one forward, inference) and the training schedules ``gpipe``,
``1f1b``, ``interleaved``, ``zb-h1`` (zero bubble: backwards split into B and W) and
``dualpipev`` (DeepSeek's DualPipe cut in half, run by torch's ``ScheduleDualPipeV``, which the
course does not ask you to write: ``labs.experiments.pp_torch``):

* reference: every step's loss, and every gradient after step 1 (by name, on the rank that
  holds it), equal the single-process run on the same global batch (fp32, 1e-5 relative);
  naive: the logits equal the full model's (bit for bit on gloo; on GPUs within the fp32
  tolerance, ``labs.train.rule("same_ops", ...)``);
* theory: bytes each rank sends (ledger) = ``p2p_bytes_per_rank``; the order of F, B (and W)
  on each rank = ``schedule_ops``; the peak number of micro-batches whose activations a stage
  holds (saved-tensor accounting, ``labs.experiments.pp_timeline``) = ``in_flight_microbatches``;
  the measured bubble next to (P-1)/(V·M+P-1) (zb-h1 and dualpipev: (P-1)/(3M+P-1));
* torch: ``torch.distributed.pipelining`` (ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B
  / ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble, ``pp_torch.VS_TORCH``) on the same
  split: same losses, step time side by side.

Measuring the bubble on a laptop. With 4 ranks on 2 cores an operation of our tiny model
takes about a millisecond, as long as the send/recv around it, and ranks share cores, so a
raw timeline mostly shows the machine (``raw_bubble_fraction``). The measurement step
therefore pads each operation with a sleep to ``op_time`` (forward) and
``backward_ratio·op_time`` (backward; a split one half of it each for B and W, so F = B = W by
default), as if every stage's compute were that long: the durations are set, the gaps between
them are real waits for real messages. That makes the schedule's shape visible and its idle
share comparable with the formula (``bubble_fraction``). What is left between the two is
delay: ``delay_bubble_fraction`` is the schedule run on paper with the measured operation times
and the measured mean delay of an operation (message latency, a busy CPU;
``labs.theory.pipeline.fit_timeline``). ``op_time=0`` turns padding off. ``measure_steps=k``
runs k padded steps and keeps the least idle: another process's stall (this machine is shared)
only ever adds idle time, so the least idle step is the closest to the schedule's own, as
``timeit`` keeps the fastest run. The padded, measured timeline is ``labs.experiments.pp_timeline``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labs.experiments.common import RunSummary, course_spec, fill_losses, new_summary
from labs.experiments.pp_timeline import (
    MeasuredTimeline,
    clock_record,
    idle_fraction_of,
    on_one_clock,
)
from labs.experiments.spec import Bench, Lab, ints, option
from labs.measure import CommLedger, Timeline, state_bytes
from labs.measure.timing import StepTimer
from labs.models.transformer import ModelConfig, build_model
from labs.runtime.device import one_thread
from labs.runtime.impl import exercise
from labs.runtime.launcher import RankResults, launch, report_progress
from labs.runtime.pipe import pipe_group, record_ops
from labs.theory import pipeline as theory
from labs.theory.dims import ParallelDims, check_divides, check_positive
from labs.theory.memory import param_counts
from labs.train import (
    TrainConfig,
    compare_losses,
    data_for,
    make_optimizer,
    max_rel_diff,
    rule,
    train_reference,
    within,
)

CHOICES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


def _stages(pp, pipe, model, plan, virtual, schedule):
    """This rank's chunks: virtual stages rank, rank+P, ... (one unless interleaved); in
    DualPipeV's V, rank and 2P-1-rank."""
    return [
        pp.build_stage(
            model, plan=plan, stage=theory.virtual_stage(schedule, pipe.size, pipe.rank, c)
        )
        for c in range(virtual)
    ]


def loss_rank(schedule: str, nproc: int, virtual: int) -> int:
    """The rank that holds the last stage (and the loss): the last rank, or rank 0 in a V."""
    return theory.stage_rank(schedule, nproc, nproc * virtual - 1)


def split_microbatches(
    x: torch.Tensor, y: torch.Tensor, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut the global batch (x, y), [B, T] each, into ``n`` micro-batches of [B/n, T]."""
    check_divides(x.shape[0], "batch_size", n, "microbatches")
    return list(zip(x.chunk(n), y.chunk(n)))


def _run_step(pp, schedule, chunks, x, y, microbatches, pipe, timeline, torch_pipeline=None):
    """One step of ``schedule`` on this rank, its operations spans on ``timeline`` (recorded by the
    pipe, ``record_ops``: the schedules carry no instrumentation): the loss on the rank of the last
    stage (naive: the logits). DualPipeV: torch's (``torch_pipeline``, its stages timed alike)."""
    x = x.to(pipe.device)
    y = y.to(pipe.device)
    if schedule == "dualpipev":
        return torch_pipeline.step(x, y, timeline)
    if schedule == "naive":
        with record_ops(pp, timeline, chunks=chunks, targets=[y]):
            return pp.naive_forward(chunks[0], x, pipe=pipe)
    mbs = split_microbatches(x, y, microbatches)
    with record_ops(pp, timeline, chunks=chunks, targets=[t for _, t in mbs]):
        if schedule == "interleaved":
            return pp.train_step_interleaved(chunks, mbs, pipe=pipe)
        step = {
            "1f1b": pp.train_step_1f1b,
            "zb-h1": pp.train_step_zb_h1,
        }.get(schedule, pp.train_step_afab)
        return step(chunks[0], mbs, pipe=pipe)


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
    measure_steps: int = 1,
) -> dict:
    """Train ``cfg.steps`` steps (naive: ``cfg.steps`` forwards) with our schedule on this rank,
    then ``measure_steps`` padded, measured steps; optionally the same with torch's pipelining.
    Returns what this rank saw."""
    pp = exercise("pipeline_parallel")
    pipe = pipe_group()
    model = build_model(model_cfg, seed=cfg.seed, device=pipe.device)
    chunks = _stages(pp, pipe, model, plan, virtual, schedule)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = make_optimizer(params, cfg) if schedule != "naive" else None
    torch_pipeline = None
    if schedule == "dualpipev":  # torch's schedule runs our stages
        from labs.experiments.pp_torch import TorchPipeline

        torch_pipeline = TorchPipeline(
            schedule, chunks, pipe, microbatches, cls="ScheduleDualPipeV"
        )
        # torch's first step also agrees on shapes between the stages (small messages the
        # ledger would count): a step whose gradients are thrown away does that first
        x, y = data_for(cfg)[0]
        torch_pipeline.step(x.to(pipe.device), y.to(pipe.device))
        optimizer.zero_grad(set_to_none=True)
    data = data_for(cfg)
    out = {"rank": pipe.rank, "losses": [], "grads": {}, "logits": None}
    timer = StepTimer(pipe.device)
    for step, (x, y) in enumerate(data):
        first = step == 0
        timeline = MeasuredTimeline(exclude=params) if first else Timeline()
        ledger = CommLedger() if first else nullcontext()
        with timer.step():
            with ledger:
                result = _run_step(
                    pp, schedule, chunks, x, y, microbatches, pipe, timeline, torch_pipeline
                )
            if schedule == "naive":
                if result is not None:
                    out["logits"] = result if first else out["logits"]
                    logits = result.float().flatten(0, 1)  # [B·T, V]
                    result = F.cross_entropy(logits, y.to(result.device).flatten()).item()
            else:
                if first:  # None where a parameter got no gradient
                    out["grads"] = {
                        n: None if p.grad is None else p.grad.clone()
                        for c in chunks
                        for n, p in c.named_parameters()
                    }
                optimizer.step()
                if step == len(data) - 1:
                    out["state_bytes"] = state_bytes(params, optimizer)["total"]
                optimizer.zero_grad(set_to_none=True)
        out["losses"].append(result)
        if first:
            calls = ledger.calls_by_op()
            out.update(
                sent_bytes=ledger.sent_bytes(),
                sent_per_call=calls.get("isend", []) + calls.get("send", []),
                held=timeline.peak_held,
                held_bytes=timeline.peak_bytes,
                order=[(e.name, e.meta["microbatch"], e.meta["chunk"]) for e in timeline.events],
            )
        report_progress()
    out["step_time_s"] = timer.step_time()
    out["params"] = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    out["raw_events"] = clock_record(timeline)  # the last step's
    if schedule == "naive":
        out["state_bytes"] = state_bytes(params)["total"]
    # the measurement steps: padded operations, no update (their gradients are thrown away)
    # an interleaved chunk holds 1/V of the rank's layers, so its operations take 1/V of the time
    out["measured_steps"] = []
    for _ in range(measure_steps):
        measured = MeasuredTimeline(
            op_time=op_time / virtual,
            backward_ratio=backward_ratio,
            w_share=0.5 if schedule in theory.SPLIT_BACKWARD else 0.0,
            exclude=params,
        )
        _run_step(pp, schedule, chunks, *data[0], microbatches, pipe, measured, torch_pipeline)
        out["measured_steps"].append(clock_record(measured))
    out["events"] = out["measured_steps"][0]
    if vs_torch and schedule != "naive":
        out.update(_torch_run(pp, pipe, schedule, model_cfg, cfg, microbatches, virtual, plan))
    return out


def _torch_run(pp, pipe, schedule, model_cfg, cfg, microbatches, virtual, plan) -> dict:
    """The same split trained by torch.distributed.pipelining (``pp_torch.VS_TORCH``: the
    schedule of the same family); losses and step times on this rank."""
    from labs.experiments.pp_torch import TorchPipeline

    if schedule == "1f1b" and microbatches < pipe.size:
        why = f"Schedule1F1B needs microbatches >= stages ({microbatches} < {pipe.size})"
        return {"torch_skipped": why}
    model = build_model(model_cfg, seed=cfg.seed, device=pipe.device)
    chunks = _stages(pp, pipe, model, plan, virtual, schedule)
    pipeline = TorchPipeline(schedule, chunks, pipe, microbatches)
    optimizer = make_optimizer([p for c in chunks for p in c.parameters()], cfg)
    losses = []
    timer = StepTimer(pipe.device)
    for x, y in data_for(cfg):
        with timer.step():
            loss = pipeline.step(x.to(pipe.device), y.to(pipe.device))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    return {"torch_losses": losses, "torch_step_time_s": timer.step_time()}


def layer_costs(model_cfg: ModelConfig) -> tuple[list[int], int, int]:
    """Parameters of each block, of the first stage's extra (embedding) and of the last stage's
    extra (final norm and head), from the theory's count."""
    c = param_counts(course_spec(model_cfg))
    return [c["per_layer"]] * model_cfg.n_layer, c["embedding"], c["final_norm"] + c["head"]


def stage_params(
    model_cfg: ModelConfig, plan: tuple, stages: int, schedule: str = "1f1b"
) -> list[int]:
    """Parameters each rank holds under ``plan`` (its virtual stages rank, rank+P, ...; in
    DualPipeV's V rank and 2P-1-rank), from the theory."""
    costs, first, last = layer_costs(model_cfg)
    per_stage = theory.plan_costs(costs, plan, first, last)
    held = [0] * stages
    for s, n in enumerate(per_stage):
        held[theory.stage_rank(schedule, stages, s)] += n
    return held


def make_plan(schedule: str, model_cfg: ModelConfig, stages: int, virtual: int, plan=None) -> tuple:
    """``plan`` checked, or: balanced by parameter count; naive fills device after device up to
    the balanced split's largest stage (the smallest budget per device that fits the model)."""
    n = stages * virtual
    if plan is not None:
        plan = tuple(plan)
        fewest = 0 if schedule == "naive" else 1
        if len(plan) != n or sum(plan) != model_cfg.n_layer or min(plan) < fewest:
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
    *,
    nproc,
    schedule,
    microbatches,
    virtual,
    layers,
    batch_size,
    op_time,
    backward_ratio,
    measure_steps=1,
) -> None:
    """Every ValueError a bad option can cause, raised before any rank starts."""
    if schedule not in CHOICES + ("afab",):
        raise ValueError(f"schedule={schedule!r} is not one of {CHOICES}")
    theory.check_schedule(schedule, nproc, microbatches, virtual)
    check_positive(layers=layers)
    ParallelDims(pp=nproc).check_model(n_layer=layers, virtual_stages=virtual)
    check_divides(batch_size, "batch_size", microbatches, "microbatches")
    if op_time < 0 or backward_ratio < 0:
        raise ValueError(f"op_time={op_time} and backward_ratio={backward_ratio} must be >= 0")
    if measure_steps < 1:
        raise ValueError(f"measure_steps={measure_steps} must be >= 1 (padded steps measured)")


@dataclass(frozen=True)
class Options:
    """The pipeline lab's options (``run``'s keywords, ``python -m labs.run pp``'s flags)."""

    schedule: str = option("1f1b", choices=CHOICES)
    microbatches: int | None = option(None, "M (default 8; naive: 1)")
    virtual: int | None = option(
        None, "V chunks per rank (interleaved; default 2; dualpipev: always 2)"
    )
    layers: int = option(8, "layers of the course model")
    batch_size: int = option(16, "global batch (sequences per step)")
    plan: tuple[int, ...] | None = option(
        None,
        "layers per (virtual) stage, e.g. 3,2,2,1 (default: balanced by parameters)",
        parse=ints,
    )
    op_time: float = option(
        0.02, "seconds each forward is padded to in the measured step (0: no padding)"
    )
    backward_ratio: float = option(
        2.0, "backward time / forward time when padding (a split backward: B and W half each)"
    )
    seed: int = option(0)
    measure_steps: int = option(
        1, "padded steps to measure; the least idle is kept (a stall only adds idle time)"
    )

    def shape(self) -> tuple[int, int]:
        """(M, V): the micro-batches and the chunks per rank, their defaults filled in."""
        microbatches = self.microbatches
        if microbatches is None:
            microbatches = 1 if self.schedule == "naive" else 8
        virtual = self.virtual
        if virtual is None:
            virtual = theory.chunks_per_rank(
                self.schedule, 2 if self.schedule == "interleaved" else 1
            )
        return microbatches, virtual

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        microbatches, virtual = self.shape()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        validate(
            nproc=nproc,
            schedule=self.schedule,
            microbatches=microbatches,
            virtual=virtual,
            layers=self.layers,
            batch_size=self.batch_size,
            op_time=self.op_time,
            backward_ratio=self.backward_ratio,
            measure_steps=self.measure_steps,
        )
        make_plan(self.schedule, ModelConfig(n_layer=self.layers), nproc, virtual, self.plan)


LAB = Lab(
    name="pp",
    notebook="05_pipeline_parallel",
    exercises=("pipeline_parallel",),
    reference=("reference_run",),
    options=Options,
    ranks=4,
    small_run={
        "nproc": 2,
        "steps": 2,
        "microbatches": 4,
        "layers": 2,
        "batch_size": 8,
        "op_time": 0.0,
    },
    bench=(
        Bench(
            options={"schedule": "1f1b", "op_time": 0.0},
            torch="torch.distributed.pipelining",
            bubble=False,
            note="Unpadded: the same job as torch's. Its idle time is message latency around ~1 ms "
            "operations, not the schedule's bubble (see the padded row below).",
        ),
        Bench(
            options={"schedule": "1f1b", "op_time": 0.02},
            vs_torch=False,
            note="Each forward padded to 20 ms and each backward to 40 ms with sleeps (the lab's "
            "op_time), as if every stage's compute were that long, so the bubble is measurable on "
            "CPU: compare its bubble with the theory, not its time with torch's (unpadded, in the "
            "row above).",
        ),
    ),
    profiled=True,
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    **options,
) -> RunSummary:
    """Run ``schedule`` on ``nproc`` pipeline stages (default ``LAB.ranks``; the ``options``:
    ``Options``) and check it; returns the lab summary. Defaults: ``microbatches`` 8 (naive: 1),
    ``virtual`` 2 for interleaved and dualpipev (else 1). ``measure_steps``: padded steps
    measured, the least idle kept."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    microbatches, virtual = o.shape()
    model_cfg = ModelConfig(n_layer=o.layers)
    cfg = TrainConfig(steps=steps, batch_size=o.batch_size, seed=o.seed)
    plan = make_plan(o.schedule, model_cfg, nproc, virtual, o.plan)
    if vs_torch or o.schedule == "dualpipev":
        # slow to import: once here, not in every forked rank
        import labs.experiments.pp_torch  # noqa: F401
    ref = reference_run(model_cfg, cfg) if o.schedule != "naive" else None
    per_rank = launch(
        pipeline_worker,
        nproc,
        o.schedule,
        model_cfg,
        cfg,
        microbatches,
        virtual,
        plan,
        o.op_time,
        o.backward_ratio,
        vs_torch,
        o.measure_steps,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc=o.schedule,
    )
    return summarize(
        per_rank,
        ref,
        schedule=o.schedule,
        model_cfg=model_cfg,
        cfg=cfg,
        microbatches=microbatches,
        virtual=virtual,
        plan=plan,
        op_time=o.op_time,
        backward_ratio=o.backward_ratio,
        vs_torch=vs_torch,
    )


def reference_run(model_cfg: ModelConfig, cfg: TrainConfig):
    """The single-process reference on the same global batches, with step 1's gradients."""
    return train_reference(model_cfg, cfg, return_grads=True)


def summarize(
    per_rank: RankResults,
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
) -> RunSummary:
    """The lab summary from the ranks' results and the reference ``ref`` (None for naive, whose
    reference is the unsplit model's forward): reference, theory and torch side by side."""
    P = len(per_rank)
    last = per_rank[loss_rank(schedule, P, virtual)]  # where the loss is
    # every rank's measured operations on one clock, for each padded step; the least idle kept
    measured = [
        on_one_clock([{"events": record} for record in step], "events")
        for step in zip(*(r["measured_steps"] for r in per_rank))
    ]
    timeline = min(measured, key=idle_fraction_of)
    summary = new_summary(
        "pp",
        nproc=P,
        backend=per_rank.backend,
        steps=cfg.steps,
        schedule=schedule,
        microbatches=microbatches,
        virtual=virtual,
        plan=list(plan),
        op_time_s=op_time,
    )
    if schedule == "naive":
        # inference: compare with the unsplit model's forward on the same batches
        model = build_model(model_cfg, seed=cfg.seed)
        batches = data_for(cfg)
        reference = []
        with torch.no_grad(), one_thread():
            for x, y in batches:
                _, loss = model(x, y)
                reference.append(loss.item())
            first_x, _ = batches[0]
            summary["max_rel_logit_diff"] = max_rel_diff(last["logits"], model(first_x))
    else:
        reference = ref.losses
        grads = {n: g for r in per_rank for n, g in r["grads"].items() if g is not None}
        summary["max_rel_grad_diff"] = max(
            max_rel_diff(grads[n], g) for n, g in ref.grads.items() if n in grads
        )
    fill_losses(summary, last["losses"], reference)
    order = theory.schedule_ops(schedule, P, microbatches, virtual)
    per_stage = stage_params(model_cfg, plan, P, schedule)
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
        # fp32 parameters; training adds their gradients and AdamW's two moments
        theory_state_bytes_per_rank=[n * (4 if schedule == "naive" else 16) for n in per_stage],
        step_time_s=max(r["step_time_s"] for r in per_rank),
        bubble_fraction=idle_fraction_of(timeline),
        measured_bubble_fractions=[idle_fraction_of(t) for t in measured],
        raw_bubble_fraction=idle_fraction_of(on_one_clock(per_rank, "raw_events")),
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
    summary.add_checks(
        pp_checks(
            per_rank,
            ref,
            summary,
            schedule=schedule,
            order=order,
            microbatches=microbatches,
            batch=cfg.batch_size,
            message_bytes=cfg.batch_size // microbatches * cfg.seq_len * model_cfg.n_embd * 4,
        )
    )
    if vs_torch and "torch_step_time_s" in last:
        summary["torch_step_time_s"] = max(r["torch_step_time_s"] for r in per_rank)
        summary["torch_losses"] = last["torch_losses"]
        torch_loss_diff = compare_losses(last["torch_losses"], reference)
        summary["torch_max_abs_loss_diff"] = torch_loss_diff["max_abs_loss_diff"]
    elif vs_torch:
        summary["torch_skipped"] = last.get(
            "torch_skipped", "torch.distributed.pipelining has no naive placement"
        )
    return summary


# --- the verdict ----------------------------------------------------------------------------------
SCHEDULE_RULES = {
    "naive": "one forward of the whole batch, stage after stage",
    "gpipe": "all M forwards, then all M backwards in the same order (micro-batch 0 first)",
    "afab": "all M forwards, then all M backwards in the same order (micro-batch 0 first)",
    "1f1b": "stage s runs a warm-up of min(P - s - 1, M) forwards, then one forward and one "
    "backward (the oldest micro-batch's) in turn, then the cool-down's backwards",
    "interleaved": "the k-th forward and backward are on (micro-batch, chunk) = "
    "interleaved_op(k, P, V, forward), after interleaved_warmup(P, M, rank, V) forwards",
    "zb-h1": "1F1B's order of forwards and backwards (B), each B's W right after it except that "
    "stage s holds its s latest W's back and runs them after its last B",
    "dualpipev": "torch's ScheduleDualPipeV order (labs.theory.pipeline._dualpipe_v's phases)",
}


def _op_name(op, virtual: int) -> str:
    name, mb, chunk = op
    return f"{name}{mb}" + (f" (chunk {chunk})" if virtual > 1 else "")


def order_check(per_rank: list[dict], order: list[list[tuple]], schedule: str, virtual: int):
    """Each stage's operations in the order the schedule names them; the first stage that departs
    from it is named with the two operations (``SCHEDULE_RULES`` says what the order must be)."""
    from labs.experiments.checks import Check

    for r in per_rank:
        got = [tuple(op) for op in r["order"]]
        want = order[r["rank"]]
        if got == want:
            continue
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        ran = _op_name(got[i], virtual) if i < len(got) else "nothing more"
        expected = _op_name(want[i], virtual) if i < len(want) else "nothing more"
        if i < len(want) and want[i] in got[i + 1 :]:
            what = f"stage {r['rank']} ran {ran} before {expected}"
        else:
            what = f"stage {r['rank']} ran {ran} where the schedule runs {expected}"
        return Check(
            "schedule order",
            False,
            " ".join(_op_name(op, virtual) for op in got[: i + 1]),
            " ".join(_op_name(op, virtual) for op in want[: i + 1]),
            where=f"stage {r['rank']}, operation {i + 1}",
            hint=what + f": {SCHEDULE_RULES[schedule]}",
            against="theory",
        )
    return Check(
        "schedule order",
        True,
        "as labs.theory.pipeline.schedule_ops",
        schedule,
        where=f"{len(per_rank)} stages",
        against="theory",
    )


def pp_checks(
    per_rank,
    ref,
    summary: RunSummary,
    *,
    schedule: str,
    order: list[list[tuple]],
    microbatches: int,
    batch: int,
    message_bytes: int,
) -> list:
    """Losses, every stage's gradients after step 1 and parameters after the last step (by name,
    each on the stage holding it), the schedule's order on every stage, the bytes of every message,
    the micro-batches a stage holds at its peak and its state bytes."""
    from labs.experiments.checks import (
        Check,
        calls_check,
        compare_values,
        losses_check,
        training_checks,
    )

    backend = summary["backend"]
    P = len(per_rank)
    virtual = summary["virtual"]
    zb_hint = ""
    if schedule in theory.SPLIT_BACKWARD:
        zb_hint = (
            "every micro-batch's B and W must each run once: B only the input's gradient "
            "(torch.autograd.grad with respect to the input), W only the weights' (added to "
            "their .grad)"
        )
    if schedule == "naive":
        # the very ops of the full model: bit for bit on gloo, the fp32 tolerance on GPUs
        checks = [
            Check(
                "logits equal the unsplit model's",
                within("same_ops", summary["max_rel_logit_diff"], backend=backend),
                summary["max_rel_logit_diff"],
                0.0,
                rule("same_ops", None, backend).rel,
                where="last stage",
                hint="the stages must run the full model's layers in order, each exactly once: "
                "check which layers each stage holds (build_stage) and what it sends on",
                against="reference",
            ),
            losses_check(
                summary["losses"],
                summary["reference_losses"],
                tolerance=rule("same_ops", None, backend).rel,
            ),
        ]
    else:
        checks = training_checks(
            losses=per_rank[loss_rank(schedule, P, virtual)]["losses"],
            reference_losses=ref.losses,
            grads=[r["grads"] for r in per_rank],
            reference_grads=[{n: ref.grads[n] for n in r["grads"]} for r in per_rank],
            params=[r["params"] for r in per_rank],
            reference_params=[{n: ref.params[n] for n in r["params"]} for r in per_rank],
            backend=backend,
            known_scales={
                **(
                    {2.0: "the weights' gradients were computed twice, " + zb_hint}
                    if zb_hint
                    else {}
                ),
                float(microbatches): "the loss of a step is the mean over all M micro-batches: the "
                "last stage must scale each micro-batch's loss by 1/M (n_microbatches)",
                1 / microbatches: "the loss was divided by M twice, or only one of the M "
                "micro-batches' backwards reached the gradients",
            },
            grad_hint=zb_hint,
            first_step_hint="the loss differs at step 1: the stages' model is not the reference's"
            " (a layer skipped or run twice, the final norm or the head left out) or the loss is "
            "not the mean over the micro-batches",
        )
        held = [n for r in per_rank for n in r["params"]]
        odd = sorted(set(ref.params) ^ set(held)) + sorted({n for n in held if held.count(n) > 1})
        checks.append(
            Check(
                "every parameter on one stage",
                not odd,
                len(held),
                len(ref.params),
                where=f"{P} stages" + (f": {', '.join(odd[:3])}" if odd else ""),
                hint="the stages together must hold every layer of the model exactly once: "
                "check the layers each stage gets (build_stage)",
            )
        )
    checks.append(order_check(per_rank, order, schedule, virtual))
    expected = [
        [message_bytes]
        * (
            theory.p2p_bytes_per_rank(
                schedule, P, r, batch=batch, seq_len=1, hidden=1, itemsize=1, virtual=virtual
            )
            // batch
            * microbatches
        )
        for r in range(P)
    ]
    checks.append(
        calls_check(
            "p2p bytes per send",
            [r["sent_per_call"] for r in per_rank],
            expected,
            world_size=P,
            count_hint="a stage sends one activation [B/M, T, H] per micro-batch to the next stage "
            "and one gradient back to the previous (per chunk it holds, when interleaved)",
            hint="a message carried another size than one micro-batch's activation [B/M, T, H]",
        )
    )
    if schedule != "naive":
        checks.append(
            compare_values(
                "micro-batches held at the peak",
                summary["microbatches_held"],
                summary["theory_microbatches_held"],
                hint="AFAB holds all M micro-batches' activations; 1F1B at most P - s on stage s: "
                "a backward frees its micro-batch's activations, so running it later holds more; "
                "ZB-H1 min(P, M) on every stage: B keeps the graph (retain_graph=True), its W "
                "frees it",
            )
        )
    checks.append(
        compare_values(
            "state bytes per rank",
            summary["state_bytes_per_rank"],
            summary["theory_state_bytes_per_rank"],
            hint="a stage holds only its own layers' parameters (and, training, their gradients "
            "and AdamW's moments)",
        )
    )
    return checks
