"""The parallelism planner (notebook 08): which DP x TP x PP x CP layout to train a model with.
Pure Python.

    plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    # -> the fastest layout that fits, the top five, and what the playbook's rule picks
    rule_plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    # -> dp 4, tp 8, pp 4, cp 4: the rule alone
    evaluate_layout(preset("llama3-405b"), "tp=8,pp=16,cp=1,dp=128,zero=1", seq=8192,
                    gpus=16384, gpus_per_node=8, gpu_mem_gib=79.6, global_batch=2048)
    scaling(preset("llama3-70b"), [128, 512, 2048], seq=32768, gpus_per_node=8, gpu_mem_gib=80)
    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80 --json

(The CLI and the readable summaries are in ``labs.theory.plan_report``, reachable from here.)

**The search.** ``plan`` enumerates every layout of the G GPUs: tp (a divisor of the node
size), pp (at most one stage per layer), cp, dp = G/(tp·pp·cp) (dividing the global batch);
the ZeRO stage (0-3 without PP; 0 or 1 with PP, as DeepSpeed's pipeline engine and Megatron's
distributed optimizer allow); the micro-batch size mbs (1, 2, 4, 8 dividing the batch per DP
rank; the micro-batch count is then m = batch / (dp·mbs)); and, with PP, the schedule: 1F1B,
interleaved 1F1B with V = 2 or 4 chunks per rank (when pp divides m) and zero-bubble ZB-H1
(when m >= pp). GPipe/AFAB has 1F1B's bubble and holds more, so it is tried only when asked
for. Each layout's memory comes from the calculator; those that fit the budget (GPU memory
less ``headroom``) are timed with the cost model below, and the fastest wins (ties: less
communication, then less memory). The five fastest are reported.

**The rule** (the Ultra-Scale Playbook's rule of thumb, made mechanical, ``rule_plan``) stays
as the explanation of the choice: "the rule picks X; the fastest estimate is Y, because ...".

  1. FSDP first. Data parallelism over every GPU with ZeRO-3 shards the whole training state
     G ways; if that fits (and the global batch has a sequence for every rank), it is the plan.
  2. TP inside a node when a layer does not fit. FSDP does not split a layer's work: every GPU
     runs every layer on its whole micro-batch and keeps all of its activations. Tensor (+
     sequence) parallelism splits each layer over tp GPUs of one node; the smallest tp (a
     divisor of the node size) with which FSDP + TP fits is the plan.
  3. PP across nodes when the model does not fit, and
  4. CP when the sequence does not fit. Past a node of TP, a model replica (tp·pp·cp GPUs) must
     hold the model's whole training state and its micro-batches' activations without counting
     on data-parallel sharding (DP is whatever is left, possibly 1): PP splits the layers (the
     state), CP the sequence (the activations). Of the replicas that fit, the smallest wins
     (most data parallelism, least model-parallel traffic); a tie goes to the faster estimate.
  DP takes the remaining factor, dp = G/(tp·pp·cp). With PP it shards the optimizer state only
  (ZeRO-1); without PP it is FSDP (ZeRO-3). ZeRO shards over the dp·cp ranks that hold the
  same weights, as Megatron and torchtitan do.

The figures come from the course's calculators: memory per GPU from ``labs.theory.memory``
(tested against real tensors), the bubble and pipeline step time from ``labs.theory.pipeline``,
FLOPs and MFU from ``labs.theory.flops``, bytes from ``labs.theory.comm``'s ring formulas.
Bytes one GPU sends per step, with K_a = mbs·(seq/cp)·h·e a micro-batch's activation, Ψ_r
the rank's parameters, m micro-batches and ℓ layers on the stage (``comm_per_step``):

    tp  (4 + 2 if recompute=full)·ℓ·m all-reduces of K_a over tp (with SP: all-gathers +
        reduce-scatters of the same volume; Megatron-LM §3, Korthikanti et al. 2022 §4.2.2)
    cp  (3 + 1 if full)·ℓ·m ring passes of KV = 2·mbs·seq·(nkv/tp)·hd·e, each (cp-1)/cp·KV
    pp  V·m·K_a/tp per direction a stage feeds (a middle stage feeds both; V chunks per rank)
    dp  over dp·cp ranks: ZeRO-0 all-reduce of Ψ_r gradients; ZeRO-1 reduce-scatter +
        all-gather; ZeRO-2 a reduce-scatter per micro-batch (the gradients are sharded, so
        they cannot accumulate) + an all-gather; ZeRO-3 two all-gathers of the weights and a
        reduce-scatter per micro-batch

**The cost model** (rough, and the same for every layout): compute C = hardware FLOPs /
(G·peak·efficiency), perfectly parallel. A pipeline runs at the pace of its slowest stage, the
one with the most layers (or the last, which also runs the head): its compute C_s =
C·(its work / the mean stage's), the difference being the ``imbalance``; so t_f = C_s/(3m) and
t_b = 2C_s/(3m) per micro-batch, and the schedule stretches C_s by its bubble
(``labs.theory.pipeline.step_time``, ZB-H1 with W = B). TP and PP traffic sits on the critical
path. CP's ring overlaps the attention blocks it feeds (12·L·nh·hd·seq of the FLOPs per token):
only its excess over that compute shows. DP traffic overlaps only the compute that runs beside
it: a gradient all-reduce or reduce-scatter overlaps the last micro-batch's backward,
ZeRO-1/2's all-gather of the updated weights the next step's first forward, ZeRO-3's gathers
each micro-batch's forward and backward; what does not fit under that compute is exposed. A
group whose ranks lie in one node moves data at the intra-node bandwidth, otherwise at the
inter-node one (ranks fill the (dp, pp, cp, tp) grid of ``labs.theory.dims``, tp innermost).
Step = C + imbalance + bubble + exposed communication; scaling efficiency = C / step: the share
of an ideal, perfectly parallel step that survives. Not modelled: kernels that run slower on
small matrices (a micro-batch of few tokens per rank) or while communication shares the GPU,
message latency, and anything a framework fuses. So the search likes fine splits (deep
pipelines with many micro-batches, CP at short sequences) more than a real cluster would.

Assumptions (defaults, every one an argument): bf16 mixed precision with AdamW (16 bytes of
state per parameter), no activation recomputation, sequence parallelism with TP, 10% of GPU
memory kept free (allocator, communication buffers, FSDP's gathered layer and other transients
the calculator leaves out), a global batch of about 4M tokens, matmuls at 60% of peak, H100
figures (989 TFLOP/s, NVLink 450 GB/s and InfiniBand 50 GB/s per GPU). Bandwidths and
communication volumes are in decimal GB (10^9 bytes), as links are quoted; memory in GiB.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from labs.theory.comm import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from labs.theory.dims import ParallelDims, check_divides, check_positive, divisors
from labs.theory.flops import flops_per_token, mfu
from labs.theory.memory import (
    GIB,
    PP_SCHEDULES,
    PRECISIONS,
    ModelSpec,
    check_training,
    layers_on_stage,
    memory_per_rank,
    param_count,
)
from labs.theory.pipeline import bubble_fraction, step_time

ASSUMPTIONS = dict(
    mbs=None,  # None: try 1, 2, 4, 8
    precision="bf16-mixed",
    optimizer="adamw",
    recompute="none",
    schedule=None,  # None: 1f1b, interleaved (V = 2, 4) and zb-h1 where they apply
    headroom=0.10,
    efficiency=0.60,
)
TOKENS_PER_BATCH = 1 << 22  # default global batch: about 4M tokens
MBS_CHOICES = (1, 2, 4, 8)
VIRTUAL_CHOICES = (2, 4)
TOP = 5  # layouts the plan reports


@dataclasses.dataclass(frozen=True)
class Cluster:
    """G GPUs in nodes of K, each with ``gpu_mem_gib`` GiB and ``peak_tflops``; bandwidths are
    GB/s (10^9 bytes/s) per GPU in one direction, inside a node and between nodes."""

    gpus: int
    gpus_per_node: int
    gpu_mem_gib: float
    peak_tflops: float = 989.0
    intra_gbps: float = 450.0
    inter_gbps: float = 50.0

    def __post_init__(self):
        check_positive(gpus=self.gpus, gpus_per_node=self.gpus_per_node)
        for name in ("gpu_mem_gib", "peak_tflops", "intra_gbps", "inter_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus={self.gpus} is not a whole number of nodes of gpus_per_node="
                f"{self.gpus_per_node}; use a multiple of {self.gpus_per_node}"
            )

    @property
    def node(self) -> int:
        """GPUs joined by the fast link: one node, or all of them when there is less than a node."""
        return min(self.gpus, self.gpus_per_node)


def comm_per_step(
    spec: ModelSpec,
    layout: dict,
    *,
    seq: int,
    mbs: int,
    microbatches: int,
    params: int,
    layers: int,
    precision: str = "bf16-mixed",
    recompute: str = "none",
) -> dict[str, float]:
    """Bytes one GPU sends per step along each axis of ``layout`` (dp, tp, pp, cp, zero, and
    optionally virtual): see the docstring."""
    dp, tp, pp, cp, zero = (layout[k] for k in ("dp", "tp", "pp", "cp", "zero"))
    v = layout.get("virtual", 1)
    e = PRECISIONS[precision]["param"]
    m = microbatches
    full = recompute == "full"
    act = mbs * (seq // cp) * spec.hidden * e  # K_a: [mbs, T/cp, H]
    # K and V of the whole sequence: [mbs, T, nkv/tp, hd]
    kv = 2 * mbs * seq * (spec.kv_heads // tp) * spec.hd * e
    n = dp * cp
    return {
        "dp": sum(_dp_collectives(zero, params, n, m, precision).values()),
        "tp": (4 + 2 * full) * layers * m * all_reduce_bytes(act, tp),
        "pp": 0.0 if pp == 1 else (1 if pp == 2 else 2) * v * m * act / tp,
        "cp": (3 + full) * layers * m * all_gather_bytes(kv, cp),
    }


def _dp_collectives(zero: int, params: int, n: int, m: int, precision: str) -> dict[str, float]:
    """Bytes of each data-parallel collective of a step, by when it runs: ``grad_sync`` (with
    the last micro-batch's backward), ``weight_gather`` (before the next step's first forward),
    ``per_microbatch_forward`` and ``per_microbatch_backward`` (each of the m micro-batches),
    summed over the step."""
    grads = params * PRECISIONS[precision]["grad"]
    weights = params * PRECISIONS[precision]["param"]
    out = dict.fromkeys(
        ("grad_sync", "weight_gather", "per_microbatch_forward", "per_microbatch_backward"), 0.0
    )
    if zero == 0:
        out["grad_sync"] = all_reduce_bytes(grads, n)
    elif zero == 1:
        out["grad_sync"] = reduce_scatter_bytes(grads, n)
        out["weight_gather"] = all_gather_bytes(weights, n)
    elif zero == 2:
        out["per_microbatch_backward"] = m * reduce_scatter_bytes(grads, n)
        out["weight_gather"] = all_gather_bytes(weights, n)
    else:
        out["per_microbatch_forward"] = m * all_gather_bytes(weights, n)
        out["per_microbatch_backward"] = m * (
            all_gather_bytes(weights, n) + reduce_scatter_bytes(grads, n)
        )
    return out


def _spans(layout: dict) -> dict[str, int]:
    """How many consecutive ranks each axis's group covers in the (dp, pp, cp, tp) grid."""
    tp = layout["tp"]
    cp = layout["cp"]
    pp = layout["pp"]
    dp = layout["dp"]
    return {"tp": tp, "cp": tp * cp, "pp": tp * cp * pp, "dp": tp * cp * pp * dp}


def _exposed_dp(
    zero: int, params: int, n: int, m: int, precision: str, bandwidth: float, t_f: float, t_b: float
) -> float:
    """Seconds of data-parallel traffic the compute beside it does not hide (see the
    docstring): each collective against the micro-batch compute it overlaps."""
    c = {k: v / bandwidth for k, v in _dp_collectives(zero, params, n, m, precision).items()}
    exposed = max(0.0, c["grad_sync"] - t_b) + max(0.0, c["weight_gather"] - t_f)
    exposed += m * max(0.0, c["per_microbatch_forward"] / m - t_f)
    exposed += m * max(0.0, c["per_microbatch_backward"] / m - t_b)
    return exposed


def _stage_imbalance(spec: ModelSpec, pp: int, flops_per_token_: float) -> float:
    """The slowest pipeline stage's work over the mean stage's: stages hold n_layers // pp layers
    (the first n_layers % pp one more) and the last also runs the head (6·V·h FLOPs per token)."""
    if pp == 1:
        return 1.0
    head = 6 * spec.vocab_size * spec.hidden
    per_layer = (flops_per_token_ - head) / spec.n_layers
    work = [layers_on_stage(spec.n_layers, pp, s) * per_layer for s in range(pp)]
    work[-1] += head
    return max(work) * pp / flops_per_token_


def _layout_options(layout: dict, kw: dict) -> tuple[int, str, int]:
    """(mbs, schedule, virtual) of a layout: its own keys, else the keyword defaults."""
    mbs = layout.get("mbs", kw.get("mbs") or 1)
    schedule = layout.get("schedule", kw.get("schedule") or "1f1b")
    default_v = VIRTUAL_CHOICES[0] if schedule == "interleaved" else 1
    virtual = layout.get("virtual", layout.get("v", default_v))
    return mbs, schedule, virtual


def evaluate(
    spec: ModelSpec,
    layout: dict,
    *,
    seq: int,
    global_batch: int,
    cluster: Cluster,
    mbs: int | None = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    recompute: str = "none",
    schedule: str | None = "1f1b",
    headroom: float = 0.10,
    efficiency: float = 0.60,
    replica: bool = True,
) -> dict:
    """Every figure of one layout (dp, tp, pp, cp, zero; optionally mbs, schedule and virtual,
    which override the keywords): memory per GPU, whether it fits the budget (GPU memory less
    ``headroom``), whether a model replica fits without DP sharding (``replica_fits``; skipped
    with ``replica=False``), bytes and seconds of communication per axis, exposed seconds per
    axis, bubble, step time, MFU. An impossible layout raises ValueError naming the parameter."""
    dp, tp, pp, cp, zero = (layout[k] for k in ("dp", "tp", "pp", "cp", "zero"))
    mbs, schedule, virtual = _layout_options(layout, {"mbs": mbs, "schedule": schedule})
    ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, world_size=cluster.gpus)
    if tp > cluster.node or cluster.node % tp:
        raise ValueError(
            f"tp={tp} does not fit in a node of gpus_per_node={cluster.gpus_per_node}:"
            " a TP group must sit inside one node;"
            f" use tp in {{{','.join(map(str, divisors(cluster.node)))}}}"
        )
    if global_batch % (dp * mbs):
        raise ValueError(
            f"global_batch={global_batch} sequences do not split over dp={dp} ranks of"
            f" mbs={mbs}; use a global batch that is a multiple of dp*mbs={dp * mbs}"
        )
    if zero > 0 and dp * cp == 1:
        raise ValueError(f"zero={zero} shards over dp*cp ranks but dp*cp=1; use zero=0")
    m = global_batch // (dp * mbs)
    sched = schedule if pp > 1 else "1f1b"
    v = virtual if sched == "interleaved" else 1
    run = dict(
        seq=seq,
        mbs=mbs,
        precision=precision,
        optimizer=optimizer,
        tp=tp,
        sp=tp > 1,
        pp=pp,
        cp=cp,
        recompute=recompute,
        microbatches=m,
        schedule=sched,
        virtual=v,
    )
    mem = memory_per_rank(spec, zero=zero, dp=dp * cp if zero else 1, **run)
    whole = None
    if replica:
        whole = mem if zero == 0 else memory_per_rank(spec, **run)
    budget = cluster.gpu_mem_gib * GIB * (1 - headroom)
    comm = comm_per_step(
        spec,
        {**layout, "virtual": v},
        seq=seq,
        mbs=mbs,
        microbatches=m,
        params=mem["params"],
        layers=mem["layers"],
        precision=precision,
        recompute=recompute,
    )
    bandwidth = {
        axis: (cluster.intra_gbps if span <= cluster.node else cluster.inter_gbps) * 1e9
        for axis, span in _spans(layout).items()
    }
    seconds = {axis: comm[axis] / bandwidth[axis] for axis in comm}
    tokens = global_batch * seq
    model_flops = flops_per_token(spec, seq=seq) * tokens
    hardware = flops_per_token(spec, seq=seq, recompute=recompute)
    compute = hardware * tokens / (cluster.gpus * cluster.peak_tflops * 1e12 * efficiency)
    # the slowest stage sets the pace: the most layers, and the head on the last stage
    stage_compute = compute * _stage_imbalance(spec, pp, hardware)
    t_f = stage_compute / (3 * m)
    t_b = 2 * stage_compute / (3 * m)
    piped = step_time(sched, pp, m, t_f=t_f, t_b=t_b, virtual=v)
    attention = 12 * spec.n_layers * spec.n_heads * spec.hd * seq / hardware * stage_compute
    exposed_by_axis = {
        "tp": seconds["tp"],
        "pp": seconds["pp"],
        "cp": max(0.0, seconds["cp"] - attention),  # the ring hides behind attention only
        "dp": _exposed_dp(zero, mem["params"], dp * cp, m, precision, bandwidth["dp"], t_f, t_b),
    }
    exposed = sum(exposed_by_axis.values())
    total = piped + exposed
    return {
        "layout": dict(layout),
        "mbs": mbs,
        "schedule": sched,
        "virtual": v,
        "microbatches": m,
        "memory": mem,
        "budget_bytes": budget,
        "fits": mem["total_bytes"] <= budget,
        "replica_bytes": whole["total_bytes"] if whole else None,
        "replica_fits": whole["total_bytes"] <= budget if whole else None,
        "comm_bytes": comm,
        "comm_seconds": seconds,
        "exposed_by_axis": exposed_by_axis,
        "intra_node": {axis: span <= cluster.node for axis, span in _spans(layout).items()},
        "bubble": bubble_fraction(sched, pp, m, v) if pp > 1 else 0.0,
        "compute_s": compute,
        "imbalance_s": stage_compute - compute,
        "bubble_s": piped - stage_compute,
        "exposed_comm_s": exposed,
        "step_time_s": total,
        "tokens_per_s": tokens / total,
        "scaling_efficiency": compute / total,
        "mfu": mfu(
            model_flops,
            step_time_s=total,
            peak_flops=cluster.peak_tflops * 1e12,
            n_gpus=cluster.gpus,
        ),
    }


# ---------------------------------------------------------------------------------------------
# Input, checked up front with the memory calculator's messages.


def _assumptions(assumptions: dict) -> dict:
    """The assumptions with defaults filled in, each checked: unknown names, a precision,
    optimizer, recomputation or schedule the calculator does not know, an mbs < 1, headroom and
    efficiency out of range."""
    unknown = sorted(set(assumptions) - set(ASSUMPTIONS))
    if unknown:
        raise ValueError(f"unknown assumption(s) {unknown}; choose from {tuple(ASSUMPTIONS)}")
    a = {**ASSUMPTIONS, **assumptions}
    check_training(
        precision=a["precision"],
        optimizer=a["optimizer"],
        recompute=a["recompute"],
        schedule=a["schedule"] or "1f1b",
    )
    if a["mbs"] is not None:
        check_positive(mbs=a["mbs"])
    if not 0 <= a["headroom"] < 1 or not 0 < a["efficiency"] <= 1:
        raise ValueError(
            "headroom must be in [0, 1) and efficiency in (0, 1],"
            f" got headroom={a['headroom']!r}, efficiency={a['efficiency']!r}"
        )
    return a


def _check_inputs(spec: ModelSpec, *, seq: int, batch: int, cluster: Cluster, a: dict) -> None:
    """What no layout can fix, said before any layout is tried."""
    check_positive(seq=seq, global_batch=batch)
    if spec.moe:
        raise ValueError(
            f"n_experts={spec.n_experts}: the planner has no expert-parallel axis; size a mixture"
            " of experts with the memory calculator (python -m labs.theory memory --experts ..."
            " --ep ...)"
        )
    if a["mbs"] is not None:
        check_divides(batch, "global_batch", a["mbs"], "mbs")
    if a["schedule"] == "interleaved" and spec.n_layers < 4:
        raise ValueError(
            f"schedule='interleaved' needs pp >= 2 stages of virtual >= 2 chunks, at least 4"
            f" layers, but n_layer={spec.n_layers}; use schedule='1f1b'"
        )


def _cluster_and_batch(
    seq: int,
    gpus: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    global_batch: int | None,
    peak_tflops: float,
    intra_gbps: float,
    inter_gbps: float,
) -> tuple[Cluster, int]:
    check_positive(seq=seq)
    cluster = Cluster(gpus, gpus_per_node, gpu_mem_gib, peak_tflops, intra_gbps, inter_gbps)
    batch = global_batch if global_batch is not None else max(1, TOKENS_PER_BATCH // seq)
    check_positive(global_batch=batch)
    return cluster, batch


# ---------------------------------------------------------------------------------------------
# The rule of thumb.


def _layout(dp: int, tp: int, pp: int, cp: int) -> dict:
    """A layout with the ZeRO stage the rule pairs with it: FSDP (3) without PP, ZeRO-1 with PP, 0
    alone."""
    zero = 0 if dp * cp == 1 else (3 if pp == 1 else 1)
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero}


def _name(layout: dict) -> str:
    parts = [
        f"{axis.upper()}={layout[axis]}"
        for axis in ("dp", "tp", "pp", "cp")
        if layout[axis] > 1 or axis == "dp"
    ]
    return " ".join(parts) + f" (ZeRO-{layout['zero']})"


def describe(result: dict) -> str:
    """A layout in one line: degrees, ZeRO stage, schedule and micro-batching."""
    layout = result["layout"]
    text = _name(layout)
    if layout["pp"] > 1:
        v = f" V={result['virtual']}" if result["schedule"] == "interleaved" else ""
        text += f" {result['schedule']}{v}"
    return text + f", mbs {result['mbs']} x {result['microbatches']}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _try(spec: ModelSpec, layout: dict, **kw: object) -> tuple[dict | None, str | None]:
    """(``evaluate``'s figures, None), or (None, the error) for an impossible layout."""
    try:
        return evaluate(spec, layout, **kw), None
    except ValueError as e:
        return None, str(e)


def _rule(spec: ModelSpec, cluster: Cluster, kw: dict) -> dict:
    """The rule's steps: ``chosen`` (its layout's figures, or None when nothing it tries fits),
    ``rule`` (what each step decided, in words), ``rejected`` (layouts passed over, with the
    reason) and ``smallest_replica_bytes`` (for the error when nothing fits)."""
    budget = cluster.gpu_mem_gib * GIB * (1 - kw["headroom"])
    rule = []
    rejected = []

    def reject(layout: dict, result: dict | None, error: str | None, reason: str) -> None:
        rejected.append(
            {
                "layout": layout,
                "name": _name(layout),
                "result": result,
                "error": error,
                "reason": reason,
            }
        )

    # 1-2. FSDP over every GPU, then FSDP + TP inside a node, smallest tp first.
    chosen = None
    for tp in divisors(cluster.node):
        layout = _layout(cluster.gpus // tp, tp, 1, 1)
        result, error = _try(spec, layout, **kw)
        label = "FSDP" + (f" + TP={tp}" if tp > 1 else "")
        if result is not None and result["fits"]:
            chosen = result
            needs = _gib(result["memory"]["total_bytes"])
            rule.append(f"{label}: fits, {needs} per GPU of a {_gib(budget)} budget")
            break
        if error:
            why = error
        else:
            why = f"needs {_gib(result['memory']['total_bytes'])} per GPU > {_gib(budget)} budget"
        reject(layout, result, error, why)
        rule.append(f"{label}: {why}")

    # 3-4. The smallest replica (tp x pp x cp GPUs) that holds the model, PP for its state, CP for
    # its sequence; the fastest of equal size. Computed even when FSDP fits, to show what it would
    # cost.
    best, tried = _smallest_replica(spec, cluster, kw)
    needs = [r["replica_bytes"] for _, r, _ in tried if r is not None]
    out = {"rule": rule, "rejected": rejected, "smallest_replica_bytes": min(needs or [0.0])}
    if chosen is not None:
        if best is not None:
            reject(
                best["layout"],
                best,
                None,
                "FSDP already fits; the rule adds PP and CP only when it does not "
                f"(estimated step {best['step_time_s']:.3g} s vs "
                f"{chosen['step_time_s']:.3g} s)",
            )
        return {**out, "chosen": chosen}
    if best is None:
        rule.append("PP/CP: no replica of tp x pp x cp GPUs holds the model")
        return {**out, "chosen": None}
    t = best["layout"]
    rule.append(
        "PP/CP: the smallest replica that holds the model is"
        f" TP={t['tp']} x PP={t['pp']} x CP={t['cp']}"
        f" ({_size(t)} GPUs, {_gib(best['replica_bytes'])} per GPU without DP sharding);"
        f" DP={t['dp']} replicas of it"
    )
    for layout, result, error in tried:  # the alternatives one axis away from the plan
        if sum(layout[k] != t[k] for k in ("tp", "pp", "cp")) == 1:
            reject(layout, result, error, error or _why_not(result, best, budget))
    return {**out, "chosen": best}


def _smallest_replica(
    spec: ModelSpec, cluster: Cluster, kw: dict
) -> tuple[dict | None, list[tuple[dict, dict | None, str | None]]]:
    """Search replicas by size (tp·pp·cp with pp·cp > 1): the fastest of the smallest that fit, and
    every other layout tried (up to 4x that size) as (layout, result or None, error or None)."""
    G = cluster.gpus
    node = cluster.node
    triples = sorted(
        (tp * pp * cp, tp, pp, cp)
        for tp in divisors(node)
        for pp in divisors(G // tp)
        if pp <= spec.n_layers
        for cp in divisors(G // (tp * pp))
        if pp * cp > 1
    )
    fitting = []  # results of the smallest size that fits
    tried = []
    for size, tp, pp, cp in triples:
        if fitting and size > 4 * _size(fitting[0]["layout"]):
            break
        layout = _layout(G // size, tp, pp, cp)
        result, error = _try(spec, layout, **kw)
        if (
            result is not None
            and result["replica_fits"]
            and result["fits"]
            and (not fitting or size == _size(fitting[0]["layout"]))
        ):
            fitting.append(result)
        else:
            tried.append((layout, result, error))
    if not fitting:
        return None, tried
    best = min(fitting, key=lambda r: r["step_time_s"])
    return best, tried + [(r["layout"], r, None) for r in fitting if r is not best]


def _size(layout: dict) -> int:
    return layout["tp"] * layout["pp"] * layout["cp"]


def _why_not(result: dict, best: dict, budget: float) -> str:
    """Why the rule passed over a layout that ran the numbers."""
    layout = result["layout"]
    if not result["replica_fits"]:
        why = f"a replica needs {_gib(result['replica_bytes'])} per GPU > {_gib(budget)}"
        if result["fits"]:
            why += (
                f"; it fits only by sharding over DP x CP = {layout['dp'] * layout['cp']} ranks "
                f"({_gib(result['memory']['total_bytes'])}, ZeRO-{layout['zero']})"
            )
        return why
    if _size(layout) > _size(best["layout"]):
        return (
            f"fits, but a replica of {_size(layout)} GPUs leaves DP={layout['dp']} "
            f"(the plan's replica has {_size(best['layout'])})"
        )
    return (
        f"fits with a replica of the same size, but its step is slower "
        f"({result['step_time_s']:.3g} s vs {best['step_time_s']:.3g} s)"
    )


def rule_plan(
    spec: ModelSpec,
    *,
    seq: int,
    gpus: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    global_batch: int | None = None,
    peak_tflops: float = 989.0,
    intra_gbps: float = 450.0,
    inter_gbps: float = 50.0,
    **assumptions: object,
) -> dict:
    """The layout the playbook's rule proposes (see the module docstring), with micro-batch 1 and
    1F1B unless ``mbs`` / ``schedule`` are given: ``evaluate``'s figures for it, plus the keys
    of ``plan``'s result (``rule``, ``rejected``, ...). Raises ValueError when the rule finds no
    layout that fits."""
    a = _assumptions(assumptions)
    cluster, batch = _cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    _check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    r = _rule(spec, cluster, _rule_kw(seq, batch, cluster, a))
    if r["chosen"] is None:
        raise ValueError(_nothing_fits(gpus, seq, cluster, a, r["smallest_replica_bytes"]))
    return _finish(spec, r["chosen"], r["rule"], r["rejected"], a, batch, cluster)


def _rule_kw(seq: int, batch: int, cluster: Cluster, a: dict) -> dict:
    return dict(
        seq=seq,
        global_batch=batch,
        cluster=cluster,
        **{**a, "mbs": a["mbs"] or 1, "schedule": a["schedule"] or "1f1b"},
    )


def _nothing_fits(gpus: int, seq: int, cluster: Cluster, a: dict, replica: float) -> str:
    budget = cluster.gpu_mem_gib * GIB * (1 - a["headroom"])
    tps = [tp for tp in divisors(cluster.node) if tp > 1]
    if tps and not any(seq % tp == 0 for tp in tps):
        # the sequence itself ruled out tensor parallelism: say so first
        return (
            f"no layout of gpus={gpus} fits the model at seq={seq} with tp=1, and seq={seq} is"
            f" not divisible by tp in {{{','.join(map(str, tps))}}}: sequence parallelism, which"
            " the planner pairs with tensor parallelism, splits every sequence over the TP"
            f" ranks; use a seq divisible by {tps[0]} (e.g. {seq - seq % cluster.node or seq})"
        )
    need = f"; the smallest replica needs {_gib(replica)} per GPU" if replica else ""
    return (
        f"no layout of gpus={gpus} fits the model at seq={seq} in {_gib(budget)} per"
        f" GPU{need}; use recompute='full', more GPUs, GPUs with more memory or a shorter"
        " sequence"
    )


# ---------------------------------------------------------------------------------------------
# The search: every layout that fits, the fastest first.


def _schedules(pp: int, m: int, n_layers: int, pinned: str | None) -> list[tuple[str, int]]:
    """(schedule, virtual) pairs to try for ``pp`` stages and ``m`` micro-batches."""
    if pp == 1:
        return [("1f1b", 1)]
    names = [pinned] if pinned else ["1f1b", "interleaved", "zb-h1"]
    out = []
    for name in names:
        if name == "interleaved":
            if m % pp == 0:
                out += [(name, v) for v in VIRTUAL_CHOICES if pp * v <= n_layers]
        elif name == "zb-h1":
            if m >= pp:
                out.append((name, 1))
        else:
            out.append((name, 1))
    return out


def candidates(spec: ModelSpec, *, seq: int, batch: int, cluster: Cluster, a: dict) -> list[dict]:
    """Every layout the search tries (see the module docstring), as layout dicts with dp, tp,
    pp, cp, zero, mbs, schedule and virtual."""
    G = cluster.gpus
    out = []
    for tp in divisors(cluster.node):
        for pp in divisors(G // tp):
            if pp > spec.n_layers:
                continue
            for cp in divisors(G // (tp * pp)):
                dp = G // (tp * pp * cp)
                if seq % (cp * tp) or batch % dp:
                    continue
                per_rank = batch // dp
                mbs_options = [a["mbs"]] if a["mbs"] else MBS_CHOICES
                for mbs in (b for b in mbs_options if per_rank % b == 0):
                    m = per_rank // mbs
                    zeros = (0,) if dp * cp == 1 else ((0, 1, 2, 3) if pp == 1 else (0, 1))
                    for schedule, v in _schedules(pp, m, spec.n_layers, a["schedule"]):
                        for zero in zeros:
                            out.append(
                                {
                                    "dp": dp,
                                    "tp": tp,
                                    "pp": pp,
                                    "cp": cp,
                                    "zero": zero,
                                    "mbs": mbs,
                                    "schedule": schedule,
                                    "virtual": v,
                                }
                            )
    return out


def _speed_key(result: dict) -> tuple[float, float, float]:
    """Fastest first; then the least communication, then the least memory."""
    step = round(result["step_time_s"], 9)
    return step, sum(result["comm_bytes"].values()), result["memory"]["total_bytes"]


def plan(
    spec: ModelSpec,
    *,
    seq: int,
    gpus: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    global_batch: int | None = None,
    peak_tflops: float = 989.0,
    intra_gbps: float = 450.0,
    inter_gbps: float = 50.0,
    **assumptions: object,
) -> dict:
    """The fastest layout that fits (see the module docstring): ``evaluate``'s figures for it,
    plus ``dp``, ``tp``, ``pp``, ``cp``, ``zero``, ``mbs``, ``schedule``, ``virtual``,
    ``global_batch``, ``top`` (the five fastest layouts that fit, each a short dict),
    ``candidates`` (layouts tried) and ``fitting`` (layouts that fit); the rule's view:
    ``rule`` (what each step of the playbook's rule decided), ``rule_layout`` (what it picks,
    with its step time; None when it finds nothing), ``explanation`` ("the rule picks X; the
    fastest estimate is Y, because ..."), ``rejected`` (the layouts the rule passed over, with
    the reason); ``warnings`` and ``assumptions``. Raises ValueError when no layout fits, saying
    what to change, or up front for input no layout could use."""
    a = _assumptions(assumptions)
    cluster, batch = _cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    _check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    kw = dict(seq=seq, global_batch=batch, cluster=cluster, **a)
    tried = candidates(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    fitting = []
    for layout in tried:
        result, _ = _try(spec, layout, **{**kw, "replica": False})
        if result is not None and result["fits"]:
            fitting.append(result)
    fitting.sort(key=_speed_key)
    rule = _rule(spec, cluster, _rule_kw(seq, batch, cluster, a))
    if not fitting:
        raise ValueError(_nothing_fits(gpus, seq, cluster, a, rule["smallest_replica_bytes"]))
    best = evaluate(spec, fitting[0]["layout"], **kw)  # with its replica's figures
    out = _finish(spec, best, rule["rule"], rule["rejected"], a, batch, cluster)
    chosen = rule["chosen"]
    out["rule_layout"] = None if chosen is None else _short(chosen)
    out["explanation"] = explain(chosen, best)
    out["top"] = [_short(r) for r in fitting[:TOP]]
    out["candidates"] = len(tried)
    out["fitting"] = len(fitting)
    return out


def _short(result: dict) -> dict:
    """A layout's row in the top-five table."""
    return {
        "name": describe(result),
        **{k: result["layout"][k] for k in ("dp", "tp", "pp", "cp", "zero")},
        "mbs": result["mbs"],
        "schedule": result["schedule"],
        "virtual": result["virtual"],
        "microbatches": result["microbatches"],
        "memory_gib": result["memory"]["total_bytes"] / GIB,
        "bubble": result["bubble"],
        "bubble_s": result["bubble_s"],
        "exposed_comm_s": result["exposed_comm_s"],
        "step_time_s": result["step_time_s"],
        "mfu": result["mfu"],
    }


def _losses(result: dict) -> dict[str, float]:
    """Where a layout's step goes beyond useful work: bubble and exposed traffic per axis."""
    out = {"the pipeline bubble": result["bubble_s"]}
    for axis, seconds in result["exposed_by_axis"].items():
        out[f"exposed {axis.upper()} traffic"] = seconds
    return out


def explain(rule_result: dict | None, fastest: dict) -> str:
    """ "The rule picks X; the fastest estimate is Y, because ...": the two parts of the step that
    differ most between the rule's layout and the fastest one."""
    y = describe(fastest)
    if rule_result is None:
        return f"the rule finds no layout that fits; the fastest estimate is {y}"
    x = describe(rule_result)
    tx = rule_result["step_time_s"]
    ty = fastest["step_time_s"]
    if x == y:
        return f"the rule picks {x}, which is also the fastest estimate ({tx:.3g} s per step)"
    if tx <= ty * (1 + 1e-9):  # a tie: the search prefers less traffic, then less memory
        cx = sum(rule_result["comm_bytes"].values()) / 1e9
        cy = sum(fastest["comm_bytes"].values()) / 1e9
        if cy < cx:
            why = f"sends less: {cy:.3g} GB per GPU per step against {cx:.3g} GB"
        else:
            mx = rule_result["memory"]["total_bytes"] / GIB
            my = fastest["memory"]["total_bytes"] / GIB
            why = f"holds less: {my:.1f} GiB per GPU against {mx:.1f} GiB"
        return (
            f"the rule picks {x} ({tx:.3g} s per step); the search's pick, {y}, is as fast and"
            f" {why}"
        )
    lx = _losses(rule_result)
    ly = _losses(fastest)
    gaps = sorted(((lx[k] - ly[k], k) for k in lx), reverse=True)
    reasons = [
        f"{k} costs {lx[k]:.3g} s there and {ly[k]:.3g} s here"
        for gap, k in gaps[:2]
        if gap > 0.01 * tx
    ]
    if not reasons:
        reasons = [f"its parts add up to {ty:.3g} s against {tx:.3g} s"]
    return (
        f"the rule picks {x} ({tx:.3g} s per step); the fastest estimate is {y}"
        f" ({ty:.3g} s, {tx / ty:.2f}x faster), because " + "; ".join(reasons)
    )


# ---------------------------------------------------------------------------------------------
# A layout you give it.

LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "zero", "mbs", "v", "virtual", "schedule")


def parse_layout(text: str | dict) -> dict:
    """``"tp=8,pp=16,cp=1,dp=128[,zero=1,v=2,schedule=interleaved,mbs=1]"`` as a layout dict;
    dp, tp, pp and cp are required, zero defaults to the rule's pairing (3 without PP, 1 with
    it, 0 alone), ``v`` is ``virtual`` (and implies the interleaved schedule)."""
    if isinstance(text, dict):
        fields = {k: str(v) for k, v in text.items()}
    else:
        fields = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(
                    f"layout part {part!r} is not key=value; write e.g. tp=8,pp=16,cp=1,dp=128"
                )
            fields[key.strip()] = value.strip()
    unknown = sorted(set(fields) - set(LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"unknown layout key(s) {unknown}; choose from {LAYOUT_KEYS}")
    missing = [k for k in ("dp", "tp", "pp", "cp") if k not in fields]
    if missing:
        raise ValueError(f"the layout lacks {missing}; give dp, tp, pp and cp")
    layout = {}
    for key, value in fields.items():
        if key == "schedule":
            if value not in PP_SCHEDULES:
                raise ValueError(f"schedule={value!r} is not one of {PP_SCHEDULES}")
            layout[key] = value
            continue
        try:
            layout["virtual" if key == "v" else key] = int(value)
        except ValueError:
            raise ValueError(f"layout {key}={value!r} is not an integer") from None
    if layout.get("virtual", 1) > 1:
        layout.setdefault("schedule", "interleaved")
    if "zero" not in layout:
        layout["zero"] = _layout(layout["dp"], layout["tp"], layout["pp"], layout["cp"])["zero"]
    return layout


def evaluate_layout(
    spec: ModelSpec,
    layout: str | dict,
    *,
    seq: int,
    gpus: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    global_batch: int | None = None,
    peak_tflops: float = 989.0,
    intra_gbps: float = 450.0,
    inter_gbps: float = 50.0,
    **assumptions: object,
) -> dict:
    """One layout you give (``parse_layout``'s text or dict), evaluated like the plan's: memory,
    step time, bubble, communication per axis, and ``verdict``: why it fits or not. The keys
    of ``plan``'s result (its ``rule`` and ``rejected`` empty), plus ``given`` = True."""
    a = _assumptions(assumptions)
    cluster, batch = _cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    _check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    layout = parse_layout(layout)
    kw = dict(seq=seq, global_batch=batch, cluster=cluster, **{**a, "mbs": a["mbs"] or 1})
    result = evaluate(spec, layout, **kw)
    out = _finish(spec, result, [], [], a, batch, cluster)
    total = result["memory"]["total_bytes"]
    budget = result["budget_bytes"]
    word = "fits" if result["fits"] else "does not fit"
    why = f"{word}: {_gib(total)} per GPU against a {_gib(budget)} budget"
    why += f" ({cluster.gpu_mem_gib:.1f} GiB less {a['headroom']:.0%} headroom)"
    if not result["fits"]:
        mem = result["memory"]
        biggest = max(
            ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"),
            key=lambda k: mem[k],
        )
        why += (
            f"; the largest part is {biggest.removesuffix('_bytes')} ({_gib(mem[biggest])},"
            f" stage {mem['stage']}, {mem['in_flight']} micro-batch(es) in flight)"
        )
    out.update(given=True, verdict=why, explanation=why, top=[_short(result)], rule_layout=None)
    return out


def _finish(
    spec: ModelSpec,
    result: dict,
    rule: list[str],
    rejected: list[dict],
    assumptions: dict,
    batch: int,
    cluster: Cluster,
) -> dict:
    out = {
        **result["layout"],
        **result,
        "sp": result["layout"]["tp"] > 1,
        "world_size": cluster.gpus,
        "global_batch": batch,
        "total_params": param_count(spec),
        "rule": rule,
        "rejected": rejected,
        "assumptions": assumptions,
        "cluster": dataclasses.asdict(cluster),
    }
    warnings = []
    step = result["step_time_s"]
    for axis, seconds in result["exposed_by_axis"].items():
        if seconds > 0.2 * step:
            link = "inside a node" if result["intra_node"][axis] else "between nodes"
            warnings.append(
                f"exposed {axis} traffic takes {seconds:.3g} s of a {step:.3g} s step ({link});"
                " a larger micro-batch (fewer, larger messages per byte of compute) or fewer"
                " ranks on it would help"
            )
    if result["bubble"] > 0.2:
        warnings.append(
            f"the pipeline bubble is {result['bubble']:.0%} of the step; more micro-batches per"
            " step (a larger global batch) or an interleaved or zero-bubble schedule shrink it"
        )
    out["warnings"] = warnings
    return out


# what ``scaling`` keeps of each plan
SCALING_KEYS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "zero",
    "mbs",
    "schedule",
    "virtual",
    "microbatches",
    "compute_s",
    "imbalance_s",
    "bubble_s",
    "exposed_comm_s",
    "step_time_s",
    "scaling_efficiency",
    "mfu",
)


def scaling(
    spec: ModelSpec,
    gpu_counts: Iterable[int],
    *,
    seq: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    global_batch: int | None = None,
    rule: bool = False,
    **kw: object,
) -> list[dict]:
    """The plan (with ``rule``, the playbook's rule's layout) at each of ``gpu_counts`` for the
    same model and global batch: where the time goes as the machine grows. Each row: ``gpus``,
    the degrees, ``step_time_s``, ``tokens_per_s_per_gpu``, ``scaling_efficiency`` (compute /
    step) and ``vs_first`` (throughput per GPU relative to the first count's), the seconds of
    ``imbalance_s``, ``bubble_s`` and exposed communication, or ``error`` when nothing fits."""
    rows = []
    planner = rule_plan if rule else plan
    for gpus in gpu_counts:
        try:
            p = planner(
                spec,
                seq=seq,
                gpus=gpus,
                gpus_per_node=gpus_per_node,
                gpu_mem_gib=gpu_mem_gib,
                global_batch=global_batch,
                **kw,
            )
        except ValueError as e:
            rows.append({"gpus": gpus, "error": str(e)})
            continue
        row = {"gpus": gpus, **{k: p[k] for k in SCALING_KEYS}}
        row["exposed_by_axis"] = dict(p["exposed_by_axis"])
        row["tokens_per_s_per_gpu"] = p["tokens_per_s"] / gpus
        rows.append(row)
    base = next((r["tokens_per_s_per_gpu"] for r in rows if "error" not in r), None)
    for r in rows:
        if "error" not in r:
            r["vs_first"] = r["tokens_per_s_per_gpu"] / base
    return rows
