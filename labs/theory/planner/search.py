"""The planner's search (``plan``): every layout that fits, the fastest first; a layout you give
(``evaluate_layout``); the plan across cluster sizes (``scaling``). Pure Python.

**The search.** ``plan`` enumerates every layout of the G GPUs: tp (a divisor of the node
size), pp (at most one stage per layer), cp, dp = G/(tp·pp·cp) (dividing the global batch);
the ZeRO stage (0-3, with or without PP: torchtitan and Llama 3 shard with FSDP under PP, where
DeepSpeed's pipeline engine stops at ZeRO-1); the micro-batch size mbs (1, 2, 4, 8 dividing the
batch per DP rank; the micro-batch count is then m = batch / (dp·mbs)); and, with PP, the
schedule: 1F1B, interleaved 1F1B with V = 2 or 4 chunks per rank (when pp divides m) and
zero-bubble ZB-H1 (when m >= pp). GPipe/AFAB has 1F1B's bubble and holds more, so it is tried
only when asked for. Each layout's memory comes from the calculator; those that fit the budget
(GPU memory less ``headroom``) are timed with the cost model (``labs.theory.planner.cost``), and
the fastest wins (ties: less communication, then less memory). The five fastest are reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from labs.theory.dims import divisors
from labs.theory.memory import GIB, PP_SCHEDULES, ZERO_STAGES
from labs.theory.model import ModelSpec
from labs.theory.planner.cost import (
    MBS_CHOICES,
    VIRTUAL_CHOICES,
    Cluster,
    check_assumptions,
    check_inputs,
    cluster_and_batch,
    describe,
    evaluate,
    finish,
    gib,
    try_layout,
)
from labs.theory.planner.rule import (
    nothing_fits,
    paired_layout,
    rule_keywords,
    rule_plan,
    rule_steps,
)

TOP = 5  # layouts the plan reports


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
                    zeros = (0,) if dp * cp == 1 else ZERO_STAGES
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
    only: Callable[[dict], bool] | None = None,
    **assumptions: object,
) -> dict:
    """The fastest layout that fits (see the module docstring), of those ``only`` keeps when
    given (a layout dict -> bool, e.g. what an export can express): ``evaluate``'s figures for it,
    plus ``dp``, ``tp``, ``pp``, ``cp``, ``zero``, ``mbs``, ``schedule``, ``virtual``,
    ``global_batch``, ``top`` (the five fastest layouts that fit, each a short dict),
    ``candidates`` (layouts tried) and ``fitting`` (layouts that fit); the rule's view:
    ``rule`` (what each step of the playbook's rule decided), ``rule_layout`` (what it picks,
    with its step time; None when it finds nothing), ``explanation`` ("the rule picks X; the
    fastest estimate is Y, because ..."), ``rejected`` (the layouts the rule passed over, with
    the reason); ``warnings`` and ``assumptions``. Raises ValueError when no layout fits, saying
    what to change, or up front for input no layout could use."""
    a = check_assumptions(assumptions)
    cluster, batch = cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    kw = dict(seq=seq, global_batch=batch, cluster=cluster, **a)
    tried = candidates(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    if only is not None:
        tried = [layout for layout in tried if only(layout)]
    fitting = []
    for layout in tried:
        result, _ = try_layout(spec, layout, **{**kw, "replica": False})
        if result is not None and result["fits"]:
            fitting.append(result)
    fitting.sort(key=_speed_key)
    rule = rule_steps(spec, cluster, rule_keywords(seq, batch, cluster, a))
    if not fitting:
        raise ValueError(nothing_fits(gpus, seq, cluster, a, rule["smallest_replica_bytes"]))
    best = evaluate(spec, fitting[0]["layout"], **kw)  # with its replica's figures
    out = finish(spec, best, rule["rule"], rule["rejected"], a, batch, cluster)
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
        layout["zero"] = paired_layout(layout["dp"], layout["tp"], layout["pp"], layout["cp"])[
            "zero"
        ]
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
    a = check_assumptions(assumptions)
    cluster, batch = cluster_and_batch(
        seq, gpus, gpus_per_node, gpu_mem_gib, global_batch, peak_tflops, intra_gbps, inter_gbps
    )
    check_inputs(spec, seq=seq, batch=batch, cluster=cluster, a=a)
    layout = parse_layout(layout)
    kw = dict(seq=seq, global_batch=batch, cluster=cluster, **{**a, "mbs": a["mbs"] or 1})
    result = evaluate(spec, layout, **kw)
    out = finish(spec, result, [], [], a, batch, cluster)
    total = result["memory"]["total_bytes"]
    budget = result["budget_bytes"]
    word = "fits" if result["fits"] else "does not fit"
    why = f"{word}: {gib(total)} per GPU against a {gib(budget)} budget"
    why += f" ({cluster.gpu_mem_gib:.1f} GiB less {a['headroom']:.0%} headroom)"
    if not result["fits"]:
        mem = result["memory"]
        biggest = max(
            ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"),
            key=lambda k: mem[k],
        )
        why += (
            f"; the largest part is {biggest.removesuffix('_bytes')} ({gib(mem[biggest])},"
            f" stage {mem['stage']}, {mem['in_flight']} micro-batch(es) in flight)"
        )
    out.update(given=True, verdict=why, explanation=why, top=[_short(result)], rule_layout=None)
    return out


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
