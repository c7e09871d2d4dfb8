"""The Ultra-Scale Playbook's rule of thumb, made mechanical (``rule_plan``): the explanation
beside the search's pick. Pure Python.

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
  DP takes the remaining factor, dp = G/(tp·pp·cp). With PP the rule pairs it with ZeRO-1 (the
  optimizer state sharded), as DeepSpeed's pipeline engine and Megatron's distributed optimizer
  do; without PP it is FSDP (ZeRO-3). That pairing is the rule's, not a law: torchtitan and
  Llama 3 run FSDP under PP, and the search tries every ZeRO stage with PP. ZeRO shards over the
  dp·cp ranks that hold the same weights, as Megatron and torchtitan do.
"""

from __future__ import annotations

from labs.theory.dims import divisors
from labs.theory.memory import GIB
from labs.theory.model import ModelSpec
from labs.theory.planner.cost import (
    Cluster,
    check_assumptions,
    check_inputs,
    cluster_and_batch,
    finish,
    gib,
    layout_name,
    try_layout,
)


def paired_layout(dp: int, tp: int, pp: int, cp: int) -> dict:
    """A layout with the ZeRO stage the rule pairs with it: FSDP (3) without PP, ZeRO-1 with PP, 0
    alone."""
    zero = 0 if dp * cp == 1 else (3 if pp == 1 else 1)
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero}


def rule_steps(spec: ModelSpec, cluster: Cluster, kw: dict) -> dict:
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
                "name": layout_name(layout),
                "result": result,
                "error": error,
                "reason": reason,
            }
        )

    # 1-2. FSDP over every GPU, then FSDP + TP inside a node, smallest tp first.
    chosen = None
    for tp in divisors(cluster.node):
        layout = paired_layout(cluster.gpus // tp, tp, 1, 1)
        result, error = try_layout(spec, layout, **kw)
        label = "FSDP" + (f" + TP={tp}" if tp > 1 else "")
        if result is not None and result["fits"]:
            chosen = result
            needs = gib(result["memory"]["total_bytes"])
            rule.append(f"{label}: fits, {needs} per GPU of a {gib(budget)} budget")
            break
        if error:
            why = error
        else:
            why = f"needs {gib(result['memory']['total_bytes'])} per GPU > {gib(budget)} budget"
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
        f" ({_size(t)} GPUs, {gib(best['replica_bytes'])} per GPU without DP sharding);"
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
        layout = paired_layout(G // size, tp, pp, cp)
        result, error = try_layout(spec, layout, **kw)
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
        why = f"a replica needs {gib(result['replica_bytes'])} per GPU > {gib(budget)}"
        if result["fits"]:
            why += (
                f"; it fits only by sharding over DP x CP = {layout['dp'] * layout['cp']} ranks "
                f"({gib(result['memory']['total_bytes'])}, ZeRO-{layout['zero']})"
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
    a = check_assumptions(assumptions)
    cluster, batch = cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    r = rule_steps(spec, cluster, rule_keywords(seq, batch, cluster, a))
    if r["chosen"] is None:
        raise ValueError(nothing_fits(gpus, seq, cluster, a, r["smallest_replica_bytes"]))
    return finish(spec, r["chosen"], r["rule"], r["rejected"], a, batch, cluster)


def rule_keywords(seq: int, batch: int, cluster: Cluster, a: dict) -> dict:
    return dict(
        seq=seq,
        global_batch=batch,
        cluster=cluster,
        **{**a, "mbs": a["mbs"] or 1, "schedule": a["schedule"] or "1f1b"},
    )


def nothing_fits(gpus: int, seq: int, cluster: Cluster, a: dict, replica: float) -> str:
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
    need = f"; the smallest replica needs {gib(replica)} per GPU" if replica else ""
    return (
        f"no layout of gpus={gpus} fits the model at seq={seq} in {gib(budget)} per"
        f" GPU{need}; use recompute='full', more GPUs, GPUs with more memory or a shorter"
        " sequence"
    )
