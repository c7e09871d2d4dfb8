"""The plan as the command line and the widget (``labs.widgets.planner``) show it: as plain JSON
(``summary``), as text (``format_result``, ``format_top``, ``format_scaling``), and ``report``,
what ``python -m labs.theory plan`` prints (the command line itself is ``labs.theory.cli``).
Pure Python.

    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80
    python -m labs.theory plan --preset llama3-8b --seq 131072 --gpus 64 --export accelerate
    python -m labs.theory plan --preset llama3-405b --seq 8192 --gpus 16384 --global-batch 2048 \\
        --layout tp=8,pp=16,cp=1,dp=128,zero=1,v=2

The text output leads with the fastest layout, the sentence that explains it against the
playbook's rule, and the five fastest layouts that fit; ``--layout`` evaluates a layout you give
instead (memory, step time, bubble, communication per axis, and why it fits or not).

Bad input (a cluster that is not whole nodes, an unknown recomputation, optimizer, precision or
schedule, an --mbs that does not divide the batch, a model no layout fits, an export that cannot
express the plan, ...) is one line on stderr and exit status 2, with the memory calculator's
messages where the two share a check.
"""

from __future__ import annotations

import functools

from labs.theory import exports
from labs.theory.memory import GIB
from labs.theory.memory_report import gpu_memory_gib
from labs.theory.model import ModelSpec
from labs.theory.planner.search import evaluate_layout, plan
from labs.theory.presets import GPUS


def report(
    spec: ModelSpec,
    *,
    seq: int,
    gpus: int,
    model: str = "custom",
    layout: str | dict | None = None,
    export: str | None = None,
    offload: bool = False,
    gpu: str = "H100 80GB",
    gpu_mem: str | float | None = None,
    peak_tflops: float | None = None,
    intra_bw: float | None = None,
    inter_bw: float | None = None,
    gpus_per_node: int = 8,
    global_batch: int | None = None,
    **assumptions: object,
) -> dict:
    """What ``python -m labs.theory plan`` prints: the plan's ``summary`` (with ``layout``, the
    given layout's), and with ``export`` ("torchrun", "accelerate" or "deepspeed") also the
    launch command or config, of the fastest layout that tool can express. ``gpu`` names a GPU
    of ``labs.theory.presets.GPUS``, whose memory, peak and links ``gpu_mem`` (GiB, or a number
    with a unit), ``peak_tflops``, ``intra_bw`` and ``inter_bw`` (GB/s per GPU inside a node and
    between nodes) override."""
    if gpu not in GPUS:
        raise ValueError(
            f"gpu={gpu!r} is not one of {tuple(GPUS)}; or give --gpu-mem and --peak-tflops"
        )
    card = GPUS[gpu]
    kw = dict(
        seq=seq,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        gpu_mem_gib=gpu_memory_gib(gpu_mem) if gpu_mem is not None else card.memory_gib,
        peak_tflops=peak_tflops if peak_tflops is not None else card.peak_tflops,
        intra_gbps=intra_bw if intra_bw is not None else card.intra_gbps,
        inter_gbps=inter_bw if inter_bw is not None else card.inter_gbps,
        global_batch=global_batch,
        **assumptions,
    )
    if layout is not None:
        p = evaluate_layout(spec, layout, **kw)
    elif export:  # the fastest layout the tool can express
        try:
            p = plan(spec, only=functools.partial(exports.can_express, export), **kw)
        except ValueError as e:
            raise ValueError(
                f"of the layouts {export} can express: {e}; or use --export torchrun (any layout)"
            ) from None
    else:
        p = plan(spec, **kw)
    out = summary(p, model=model)
    if export:
        out["export"] = exports.export(export, p, offload=offload)
    return out


def summary(p: dict, *, model: str = "custom") -> dict:
    """The plan as plain JSON: degrees, memory per GPU by part (GiB), communication per axis,
    bubble, step time, MFU, the rule's steps, the rejected layouts (name, reason, GiB, step
    time)."""
    mem = p["memory"]
    keep = (
        "dp",
        "tp",
        "pp",
        "cp",
        "zero",
        "mbs",
        "schedule",
        "virtual",
        "sp",
        "world_size",
        "global_batch",
        "microbatches",
        "total_params",
        "fits",
        "bubble",
        "compute_s",
        "imbalance_s",
        "bubble_s",
        "exposed_comm_s",
        "exposed_by_axis",
        "step_time_s",
        "tokens_per_s",
        "scaling_efficiency",
        "mfu",
        "comm_bytes",
        "comm_seconds",
        "intra_node",
        "rule",
        "warnings",
        "assumptions",
        "cluster",
    )
    extra = ("top", "rule_layout", "explanation", "candidates", "fitting", "given", "verdict")
    return {
        "model": model,
        **{k: p[k] for k in keep},
        **{k: p[k] for k in extra if k in p},
        "memory_gib": {
            k.removesuffix("_bytes"): mem[k] / GIB
            for k in (
                "param_bytes",
                "grad_bytes",
                "optimizer_bytes",
                "activation_bytes",
                "total_bytes",
            )
        },
        "replica_gib": p["replica_bytes"] / GIB if p["replica_bytes"] is not None else None,
        "budget_gib": p["budget_bytes"] / GIB,
        "rejected": [
            {
                "name": r["name"],
                **r["layout"],
                "reason": r["reason"],
                "memory_gib": r["result"]["memory"]["total_bytes"] / GIB if r["result"] else None,
                "step_time_s": r["result"]["step_time_s"] if r["result"] else None,
            }
            for r in p["rejected"]
        ],
    }


def format_result(r: dict) -> str:
    """``report``'s result as text: the plan (or the given layout), memory, communication and time,
    why it was chosen, the five fastest layouts that fit, the rule's steps and the layouts the
    rule rejected (or the export alone)."""
    if "export" in r:
        return r["export"]
    c = r["cluster"]
    m = r["memory_gib"]
    comm = ", ".join(
        f"{a} {r['comm_bytes'][a] / 1e9:.3g} GB ({r['comm_seconds'][a]:.3g} s, "
        f"{'intra' if r['intra_node'][a] else 'inter'})"
        for a in ("tp", "cp", "pp", "dp")
    )
    exposed = ", ".join(f"{a} {r['exposed_by_axis'][a]:.3g} s" for a in ("tp", "cp", "pp", "dp"))
    how = [f"ZeRO-{r['zero']}"] + (["SP"] if r["sp"] else [])
    if r["pp"] > 1:
        how.append(r["schedule"] + (f" V={r['virtual']}" if r["schedule"] == "interleaved" else ""))
    how.append(f"mbs {r['mbs']} x {r['microbatches']} micro-batches")
    replica = f"; a replica without DP sharding {r['replica_gib']:.1f}" if r["replica_gib"] else ""
    lines = [
        f"{'layout' if r.get('given') else 'plan':<12}DP={r['dp']} TP={r['tp']} PP={r['pp']}"
        f" CP={r['cp']}  ({', '.join(how)}) on {c['gpus']} GPUs in nodes of {c['gpus_per_node']}",
        f"model       {r['model']}: {r['total_params']:,} parameters;"
        f" global batch {r['global_batch']} sequences",
        f"memory      {m['total']:.1f} GiB per GPU of {c['gpu_mem_gib']:.1f} GiB"
        f" (params {m['param']:.1f}, grads {m['grad']:.1f}, optimizer {m['optimizer']:.1f},"
        f" activations {m['activation']:.1f}){replica}",
        f"comm/step   {comm}  (GB = 10^9 bytes)",
        f"exposed     {exposed}",
        f"time        step {r['step_time_s']:.3g} s = compute {r['compute_s']:.3g}"
        f" + imbalance {r['imbalance_s']:.3g} + bubble {r['bubble_s']:.3g}"
        f" + exposed comm {r['exposed_comm_s']:.3g}; bubble {r['bubble']:.1%},"
        f" scaling efficiency {r['scaling_efficiency']:.0%}, MFU {r['mfu']:.0%}",
    ]
    if r.get("given"):
        lines += ["", f"verdict     {r['verdict']}"]
    else:
        lines += ["", f"why         {r['explanation']}"]
        lines += ["", format_top(r["top"], tried=r["candidates"], fitting=r["fitting"])]
        lines += ["", "the playbook's rule"] + [f"  {step}" for step in r["rule"]]
        if r["rejected"]:
            lines += ["", "rejected by the rule"]
            lines += [f"  {x['name']:<30} {x['reason']}" for x in r["rejected"]]
    lines += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


def format_top(rows: list[dict], *, tried: int | None = None, fitting: int | None = None) -> str:
    """The plan's ``top`` rows as a table: layout, memory, bubble, step time, MFU."""
    head = "fastest layouts that fit"
    if tried is not None:
        head += f" ({fitting} of {tried} tried)"
    lines = [
        head,
        f"  {'#':<3}{'layout':<54}{'GiB':>6}{'bubble':>8}{'step s':>9}{'MFU':>6}",
    ]
    for i, t in enumerate(rows, 1):
        lines.append(
            f"  {i:<3}{t['name']:<54}{t['memory_gib']:>6.1f}{t['bubble']:>8.1%}"
            f"{t['step_time_s']:>9.3g}{t['mfu']:>6.0%}"
        )
    return "\n".join(lines)


def format_scaling(rows: list[dict]) -> str:
    """``labs.theory.planner.scaling``'s rows as a table: layout, step time, where the time goes
    (compute, stage imbalance, bubble, exposed communication), what loses the most, scaling
    efficiency, per-GPU throughput, MFU."""
    lines = [
        f"{'GPUs':>6}  {'layout':<32}{'step s':>8}{'compute':>9}{'imbal.':>8}{'bubble':>8}"
        f"{'exposed':>9}  {'lost to':<18}{'eff.':>6}{'tok/s/GPU':>11}{'vs first':>9}{'MFU':>6}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['gpus']:>6}  no layout fits")
            continue
        layout = f"DP{r['dp']} TP{r['tp']} PP{r['pp']} CP{r['cp']} Z{r['zero']}"
        if r["pp"] > 1:
            layout += " " + r["schedule"] + (f"/{r['virtual']}" if r["virtual"] > 1 else "")
        losses = {"bubble": r["bubble_s"], "imbalance": r["imbalance_s"]}
        losses.update({f"{a} comm": v for a, v in r["exposed_by_axis"].items()})
        lost = max(losses, key=losses.get) if max(losses.values()) > 0 else "-"
        lines.append(
            f"{r['gpus']:>6}  {layout:<32}{r['step_time_s']:>8.3g}{r['compute_s']:>9.3g}"
            f"{r['imbalance_s']:>8.3g}{r['bubble_s']:>8.3g}{r['exposed_comm_s']:>9.3g}"
            f"  {lost:<18}{r['scaling_efficiency']:>6.0%}{r['tokens_per_s_per_gpu']:>11,.0f}"
            f"{r['vs_first']:>9.0%}{r['mfu']:>6.0%}"
        )
    return "\n".join(lines)
