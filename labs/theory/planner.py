"""The parallelism planner (notebook 08): which DP x TP x PP x CP layout to train a model with.
Pure Python.

    plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    # -> dp 4, tp 8, pp 4, cp 4
    scaling(preset("llama3-70b"), [128, 512, 2048], seq=32768, gpus_per_node=8, gpu_mem_gib=80)
    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80 --json

(The CLI and the readable summaries are in ``labs.theory.plan_report``, reachable from here.)

The rule (the Ultra-Scale Playbook's rule of thumb, made mechanical):

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
     (most data parallelism, least model-parallel traffic); a tie goes to more TP, then more PP.
  DP takes the remaining factor, dp = G/(tp·pp·cp). With PP it shards the optimizer state only
  (ZeRO-1, Megatron's distributed optimizer: DeepSpeed's pipeline engine refuses ZeRO-2/3, which
  would re-gather weights or reduce gradients every micro-batch); without PP it is FSDP (ZeRO-3).
  ZeRO shards over the dp·cp ranks that hold the same weights, as Megatron and torchtitan do.

The figures come from the course's calculators: memory per GPU from ``labs.theory.memory``
(tested against real tensors), the bubble and pipeline step time from ``labs.theory.pipeline``,
FLOPs and MFU from ``labs.theory.flops``, bytes from ``labs.theory.comm``'s ring formulas.
Bytes one GPU sends per step, with K_a = mbs·(seq/cp)·h·e a micro-batch's activation, Ψ_r
the rank's parameters, m micro-batches and ℓ layers on the stage (``comm_per_step``):

    tp  (4 + 2 if recompute=full)·ℓ·m all-reduces of K_a over tp (with SP: all-gathers +
        reduce-scatters of the same volume; Megatron-LM §3, Korthikanti et al. 2022 §4.2.2)
    cp  (3 + 1 if full)·ℓ·m ring passes of KV = 2·mbs·seq·(nkv/tp)·hd·e, each (cp-1)/cp·KV
    pp  m·K_a/tp per direction a stage feeds (a middle stage feeds both)
    dp  over dp·cp ranks: ZeRO-0 all-reduce of Ψ_r gradients; ZeRO-1 reduce-scatter + all-gather;
        FSDP two all-gathers of the weights and a reduce-scatter per micro-batch

Step time (rough): compute = hardware FLOPs / (G·peak·efficiency), stretched by the bubble;
TP and PP traffic sits on the critical path, DP and CP traffic overlaps compute and only its
excess shows. A group whose ranks lie in one node moves data at the intra-node bandwidth,
otherwise at the inter-node one (ranks fill the (dp, pp, cp, tp) grid of ``labs.theory.dims``,
tp innermost). Scaling efficiency = compute / step time: the share of an ideal, perfectly
parallel step that survives the bubble and the exposed communication.

Assumptions (defaults, every one an argument): bf16 mixed precision with AdamW (16 bytes of
state per parameter), micro-batch 1, no activation recomputation, 1F1B, sequence parallelism
with TP, 10% of GPU memory kept free (allocator, communication buffers, FSDP's gathered layer
and other transients the calculator leaves out), a global batch of about 4M tokens, matmuls at
60% of peak, H100 figures (989 TFLOP/s, NVLink 450 GB/s and InfiniBand 50 GB/s per GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from labs.theory.comm import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from labs.theory.dims import ParallelDims, check_positive, divisors
from labs.theory.flops import flops_per_token, mfu
from labs.theory.memory import GIB, PRECISIONS, ModelSpec, memory_per_rank, param_count
from labs.theory.pipeline import bubble_fraction, step_time

ASSUMPTIONS = dict(
    mbs=1,
    precision="bf16-mixed",
    optimizer="adamw",
    recompute="none",
    schedule="1f1b",
    headroom=0.10,
    efficiency=0.60,
)
TOKENS_PER_BATCH = 1 << 22  # default global batch: about 4M tokens


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
    """Bytes one GPU sends per step along each axis of ``layout`` (dp, tp, pp, cp, zero): see the
    docstring."""
    dp, tp, pp, cp, zero = (layout[k] for k in ("dp", "tp", "pp", "cp", "zero"))
    e = PRECISIONS[precision]["param"]
    m = microbatches
    full = recompute == "full"
    act = mbs * (seq // cp) * spec.hidden * e  # K_a: [mbs, T/cp, H]
    # K and V of the whole sequence: [mbs, T, nkv/tp, hd]
    kv = 2 * mbs * seq * (spec.kv_heads // tp) * spec.hd * e
    n = dp * cp
    grads = params * PRECISIONS[precision]["grad"]
    weights = params * e
    if zero == 0:
        data = all_reduce_bytes(grads, n)
    elif zero in (1, 2):
        data = reduce_scatter_bytes(grads, n) + all_gather_bytes(weights, n)
    else:
        data = m * (2 * all_gather_bytes(weights, n) + reduce_scatter_bytes(grads, n))
    return {
        "dp": data,
        "tp": (4 + 2 * full) * layers * m * all_reduce_bytes(act, tp),
        "pp": 0.0 if pp == 1 else (1 if pp == 2 else 2) * m * act / tp,
        "cp": (3 + full) * layers * m * all_gather_bytes(kv, cp),
    }


def _spans(layout: dict) -> dict[str, int]:
    """How many consecutive ranks each axis's group covers in the (dp, pp, cp, tp) grid."""
    tp = layout["tp"]
    cp = layout["cp"]
    pp = layout["pp"]
    dp = layout["dp"]
    return {"tp": tp, "cp": tp * cp, "pp": tp * cp * pp, "dp": tp * cp * pp * dp}


def evaluate(
    spec: ModelSpec,
    layout: dict,
    *,
    seq: int,
    global_batch: int,
    cluster: Cluster,
    mbs: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    recompute: str = "none",
    schedule: str = "1f1b",
    headroom: float = 0.10,
    efficiency: float = 0.60,
) -> dict:
    """Every figure of one layout (dp, tp, pp, cp, zero): memory per GPU, whether it fits the budget
    (GPU memory less ``headroom``), whether a model replica fits without DP sharding
    (``replica_fits``), bytes and seconds of communication per axis, bubble, step time, MFU.
    An impossible layout raises ValueError naming the parameter."""
    dp, tp, pp, cp, zero = (layout[k] for k in ("dp", "tp", "pp", "cp", "zero"))
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
    m = global_batch // (dp * mbs)
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
        schedule=schedule,
    )
    mem = memory_per_rank(spec, zero=zero, dp=dp * cp if zero else 1, **run)
    replica = mem if zero == 0 else memory_per_rank(spec, **run)
    budget = cluster.gpu_mem_gib * GIB * (1 - headroom)
    comm = comm_per_step(
        spec,
        layout,
        seq=seq,
        mbs=mbs,
        microbatches=m,
        params=mem["params"],
        layers=mem["layers"],
        precision=precision,
        recompute=recompute,
    )
    seconds = {
        axis: comm[axis]
        / ((cluster.intra_gbps if span <= cluster.node else cluster.inter_gbps) * 1e9)
        for axis, span in _spans(layout).items()
    }
    tokens = global_batch * seq
    model_flops = flops_per_token(spec, seq=seq) * tokens
    compute = (
        flops_per_token(spec, seq=seq, recompute=recompute)
        * tokens
        / (cluster.gpus * cluster.peak_tflops * 1e12 * efficiency)
    )
    sched = schedule if pp > 1 else "1f1b"
    piped = step_time(sched, pp, m, t_f=compute / (3 * m), t_b=2 * compute / (3 * m))
    exposed = seconds["tp"] + seconds["pp"] + max(0.0, seconds["dp"] + seconds["cp"] - compute)
    total = piped + exposed
    return {
        "layout": dict(layout),
        "microbatches": m,
        "memory": mem,
        "budget_bytes": budget,
        "fits": mem["total_bytes"] <= budget,
        "replica_bytes": replica["total_bytes"],
        "replica_fits": replica["total_bytes"] <= budget,
        "comm_bytes": comm,
        "comm_seconds": seconds,
        "intra_node": {axis: span <= cluster.node for axis, span in _spans(layout).items()},
        "bubble": bubble_fraction(sched, pp, m),
        "compute_s": compute,
        "bubble_s": piped - compute,
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


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _try(spec: ModelSpec, layout: dict, **kw: object) -> tuple[dict | None, str | None]:
    """(``evaluate``'s figures, None), or (None, the error) for an impossible layout."""
    try:
        return evaluate(spec, layout, **kw), None
    except ValueError as e:
        return None, str(e)


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
    """The layout the rule proposes (see the module docstring): ``evaluate``'s figures for it, plus
    ``dp``, ``tp``, ``pp``, ``cp``, ``zero``, ``global_batch``, ``rule`` (what each step decided, in
    words), ``rejected`` (layouts passed over, each with its figures or error and the reason),
    ``warnings`` and ``assumptions``. Raises ValueError when no layout fits, saying what to
    change."""
    unknown = sorted(set(assumptions) - set(ASSUMPTIONS))
    if unknown:
        raise ValueError(f"unknown assumption(s) {unknown}; choose from {tuple(ASSUMPTIONS)}")
    a = {**ASSUMPTIONS, **assumptions}
    check_positive(seq=seq, mbs=a["mbs"])
    if not 0 <= a["headroom"] < 1 or not 0 < a["efficiency"] <= 1:
        raise ValueError(
            "headroom must be in [0, 1) and efficiency in (0, 1],"
            f" got headroom={a['headroom']!r}, efficiency={a['efficiency']!r}"
        )
    cluster = Cluster(gpus, gpus_per_node, gpu_mem_gib, peak_tflops, intra_gbps, inter_gbps)
    batch = global_batch if global_batch is not None else max(1, TOKENS_PER_BATCH // seq)
    check_positive(global_batch=batch)
    kw = dict(seq=seq, global_batch=batch, cluster=cluster, **a)
    budget = gpu_mem_gib * GIB * (1 - a["headroom"])
    rule = []  # what each step of the rule decided, in words
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
        layout = _layout(gpus // tp, tp, 1, 1)
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
    if chosen is None and best is None:
        needs = [r["replica_bytes"] for _, r, _ in tried if r is not None]
        need = f"; the smallest replica needs {_gib(min(needs))} per GPU" if needs else ""
        raise ValueError(
            f"no layout of gpus={gpus} fits the model at seq={seq} in {_gib(budget)} per"
            f" GPU{need}; use recompute='full', more GPUs, GPUs with more memory or a shorter"
            " sequence"
        )
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
    else:
        chosen = best
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
    return _finish(spec, chosen, rule, rejected, a, batch, cluster)


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
    for axis, seconds in result["comm_seconds"].items():
        if seconds > 0.2 * step:
            link = "inside a node" if result["intra_node"][axis] else "between nodes"
            warnings.append(
                f"{axis} traffic takes {seconds:.3g} s of a {step:.3g} s step ({link}); a larger"
                " micro-batch (fewer, larger messages per byte of compute) or fewer ranks on it"
                " would help"
            )
    if result["bubble"] > 0.2:
        warnings.append(
            f"the pipeline bubble is {result['bubble']:.0%} of the step; more micro-batches per"
            " step (a larger global batch) or an interleaved schedule shrink it"
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
    "microbatches",
    "compute_s",
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
    **kw: object,
) -> list[dict]:
    """The plan at each of ``gpu_counts`` for the same model and global batch: where the time goes
    as the machine grows. Each row: ``gpus``, the degrees, ``step_time_s``,
    ``tokens_per_s_per_gpu``, ``scaling_efficiency`` (compute / step) and ``vs_first`` (throughput
    per GPU relative to the first count's), the seconds of ``bubble_s`` and exposed communication,
    or ``error`` when nothing fits."""
    rows = []
    for gpus in gpu_counts:
        try:
            p = plan(
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
        row["exposed_by_axis"] = _exposed_by_axis(p)
        row["tokens_per_s_per_gpu"] = p["tokens_per_s"] / gpus
        rows.append(row)
    base = next((r["tokens_per_s_per_gpu"] for r in rows if "error" not in r), None)
    for r in rows:
        if "error" not in r:
            r["vs_first"] = r["tokens_per_s_per_gpu"] / base
    return rows


def _exposed_by_axis(p: dict) -> dict[str, float]:
    """The exposed seconds split by axis: TP and PP entirely, DP and CP in proportion to their
    excess."""
    sec = p["comm_seconds"]
    hidden = sec["dp"] + sec["cp"]
    excess = max(0.0, hidden - p["compute_s"])
    share = excess / hidden if hidden else 0.0
    return {"tp": sec["tp"], "pp": sec["pp"], "dp": sec["dp"] * share, "cp": sec["cp"] * share}
