"""The planner's cost model: one layout's memory, communication and step time, and the inputs
checked up front. Pure Python.

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
        reduce-scatter per micro-batch (with PP: of the stage's weights, for every micro-batch
        the stage runs)

**The cost model** (rough, and the same for every layout): compute C = hardware FLOPs /
(G·peak·efficiency), perfectly parallel. A pipeline runs at the pace of its slowest stage, the
one with the most layers (or the last, which also runs the head): its compute C_s =
C·(its work / the mean stage's), the difference being the ``imbalance``; so t_f = C_s/(3m) and
t_b = 2C_s/(3m) per micro-batch, and the schedule stretches C_s by its bubble
(``labs.theory.pipeline.step_time``, ZB-H1 with W = B). A group whose ranks lie in one node
moves data at the intra-node bandwidth, otherwise at the inter-node one (ranks fill the (dp,
pp, cp, tp) grid of ``labs.theory.dims``, tp innermost), each at ``comm_efficiency`` of the link
(a collective's bus bandwidth stays under the line rate). TP and PP traffic sits on the critical
path. The rest overlaps the compute that runs beside it, and no more: CP's ring the attention
blocks it feeds (12·L·nh·hd·seq of the FLOPs per token), a gradient all-reduce or
reduce-scatter the last micro-batch's backward, ZeRO-1/2's all-gather of the updated weights
the next step's first forward, ZeRO-3's gathers and reduce-scatters each micro-batch's forward
and backward. Overlap is not free: a collective of c seconds beside t seconds of compute adds
max(0, c - t) + ``overlap_penalty``·min(c, t) (``overlapped``): what does not fit under the
compute, and the slowdown of the compute while the two share the GPU (NCCL's kernels take
streaming multiprocessors and memory bandwidth). However large ZeRO-3's traffic grows, it is
never assumed hidden: its per-GPU bytes do not shrink as DP grows, so past some size it sets the
step. Step = C + imbalance + bubble + exposed communication; scaling efficiency = C / step: the
share of an ideal, perfectly parallel step that survives. Not modelled: kernels that run slower
on small matrices (a micro-batch of few tokens per rank), message latency, and anything a
framework fuses. So the search likes fine splits (deep pipelines with many micro-batches, CP at
short sequences) more than a real cluster would.

``comm_efficiency`` (0.8) and ``overlap_penalty`` (0.25) are the model's two fitted constants,
set on the one published comparison of the same model with and without model parallelism
(Narayanan et al. 2021, Table 2: GPT-3 175B on 384 / 768 / 1,536 A100s, ZeRO-3 144 / 88 / 44
TFLOP/s per GPU against PTD-P's 153 / 149 / 141): with them the planner orders the two as the
paper does at every size, within 6 % of its throughput ratios (tests/test_published_runs.py and
``labs.theory.planner.published`` hold every published run beside ours).

Assumptions (defaults, every one an argument): bf16 mixed precision with AdamW (16 bytes of
state per parameter; ``fp32_grad_accum`` adds fp32 gradients, 4 bytes more, reduced in fp32), no
activation recomputation, sequence parallelism with TP, 10% of GPU memory kept free (allocator,
communication buffers, FSDP's gathered layer and other transients the calculator leaves out), a
global batch of about 4M tokens, matmuls at 60% of peak, H100 figures (989 TFLOP/s, NVLink 450
GB/s and InfiniBand 50 GB/s per GPU; ``labs.theory.presets.GPUS`` has each GPU's). Bandwidths and
communication volumes are in decimal GB (10^9 bytes), as links are quoted; memory in GiB.
"""

from __future__ import annotations

import dataclasses

from labs.theory.comm import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from labs.theory.dims import ParallelDims, check_divides, check_positive, divisors
from labs.theory.flops import flops_per_token, mfu
from labs.theory.memory import GIB, PRECISIONS, check_training, memory_per_rank
from labs.theory.model import ModelSpec, layers_on_stage, param_count
from labs.theory.pipeline import bubble_fraction, step_time

ASSUMPTIONS = dict(
    mbs=None,  # None: try 1, 2, 4, 8
    precision="bf16-mixed",
    optimizer="adamw",
    recompute="none",
    schedule=None,  # None: 1f1b, interleaved (V = 2, 4) and zb-h1 where they apply
    headroom=0.10,
    efficiency=0.60,
    fp32_grad_accum=False,
    comm_efficiency=0.80,
    overlap_penalty=0.25,
)

TOKENS_PER_BATCH = 1 << 22  # default global batch: about 4M tokens

MBS_CHOICES = (1, 2, 4, 8)

VIRTUAL_CHOICES = (2, 4)


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
    fp32_grad_accum: bool = False,
) -> dict[str, float]:
    """Bytes one GPU sends per step along each axis of ``layout`` (dp, tp, pp, cp, zero, and
    optionally virtual): see the docstring. With ``fp32_grad_accum`` the gradients are reduced
    in fp32."""
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
        "dp": sum(_dp_collectives(zero, params, n, m, precision, fp32_grad_accum).values()),
        "tp": (4 + 2 * full) * layers * m * all_reduce_bytes(act, tp),
        "pp": 0.0 if pp == 1 else (1 if pp == 2 else 2) * v * m * act / tp,
        "cp": (3 + full) * layers * m * all_gather_bytes(kv, cp),
    }


def _dp_collectives(
    zero: int, params: int, n: int, m: int, precision: str, fp32_grads: bool = False
) -> dict[str, float]:
    """Bytes of each data-parallel collective of a step, by when it runs: ``grad_sync`` (with
    the last micro-batch's backward), ``weight_gather`` (before the next step's first forward),
    ``per_microbatch_forward`` and ``per_microbatch_backward`` (each of the m micro-batches),
    summed over the step. ``fp32_grads``: gradients reduced in fp32 (4 bytes each)."""
    grads = params * (4 if fp32_grads else PRECISIONS[precision]["grad"])
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


def overlapped(comm_s: float, compute_s: float, penalty: float) -> float:
    """Seconds a collective of ``comm_s`` adds to ``compute_s`` of compute it runs beside: what
    does not fit under the compute, plus ``penalty`` of the time the two share the GPU (NCCL's
    kernels take streaming multiprocessors and memory bandwidth from the matmuls)."""
    return max(0.0, comm_s - compute_s) + penalty * min(comm_s, compute_s)


def _exposed_dp(
    zero: int,
    params: int,
    n: int,
    m: int,
    precision: str,
    bandwidth: float,
    t_f: float,
    t_b: float,
    penalty: float,
    fp32_grads: bool,
) -> float:
    """Seconds of data-parallel traffic the compute beside it does not hide (see the
    docstring): each collective against the micro-batch compute it overlaps."""
    collectives = _dp_collectives(zero, params, n, m, precision, fp32_grads)
    c = {k: v / bandwidth for k, v in collectives.items()}
    exposed = overlapped(c["grad_sync"], t_b, penalty)
    exposed += overlapped(c["weight_gather"], t_f, penalty)
    exposed += m * overlapped(c["per_microbatch_forward"] / m, t_f, penalty)
    exposed += m * overlapped(c["per_microbatch_backward"] / m, t_b, penalty)
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
    fp32_grad_accum: bool = False,
    comm_efficiency: float = 0.80,
    overlap_penalty: float = 0.25,
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
        fp32_grad_accum=fp32_grad_accum,
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
        fp32_grad_accum=fp32_grad_accum,
    )
    bandwidth = {
        axis: (cluster.intra_gbps if span <= cluster.node else cluster.inter_gbps)
        * 1e9
        * comm_efficiency
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
        "cp": overlapped(seconds["cp"], attention, overlap_penalty),  # beside attention only
        "dp": _exposed_dp(
            zero,
            mem["params"],
            dp * cp,
            m,
            precision,
            bandwidth["dp"],
            t_f,
            t_b,
            overlap_penalty,
            fp32_grad_accum,
        ),
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


def check_assumptions(assumptions: dict) -> dict:
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
    if not 0 < a["comm_efficiency"] <= 1 or not 0 <= a["overlap_penalty"] <= 1:
        raise ValueError(
            "comm_efficiency must be in (0, 1] and overlap_penalty in [0, 1],"
            f" got comm_efficiency={a['comm_efficiency']!r},"
            f" overlap_penalty={a['overlap_penalty']!r}"
        )
    return a


def check_inputs(spec: ModelSpec, *, seq: int, batch: int, cluster: Cluster, a: dict) -> None:
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


def cluster_and_batch(
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
# A layout's name, and its figures with the warnings the plan prints.


def layout_name(layout: dict) -> str:
    parts = [
        f"{axis.upper()}={layout[axis]}"
        for axis in ("dp", "tp", "pp", "cp")
        if layout[axis] > 1 or axis == "dp"
    ]
    return " ".join(parts) + f" (ZeRO-{layout['zero']})"


def describe(result: dict) -> str:
    """A layout in one line: degrees, ZeRO stage, schedule and micro-batching."""
    layout = result["layout"]
    text = layout_name(layout)
    if layout["pp"] > 1:
        v = f" V={result['virtual']}" if result["schedule"] == "interleaved" else ""
        text += f" {result['schedule']}{v}"
    return text + f", mbs {result['mbs']} x {result['microbatches']}"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def try_layout(spec: ModelSpec, layout: dict, **kw: object) -> tuple[dict | None, str | None]:
    """(``evaluate``'s figures, None), or (None, the error) for an impossible layout."""
    try:
        return evaluate(spec, layout, **kw), None
    except ValueError as e:
        return None, str(e)


def finish(
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
