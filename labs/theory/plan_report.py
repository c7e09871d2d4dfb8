"""The planner's front end, shared by the CLI and the widget (``labs.widgets.planner``): the plan
as plain JSON (``summary``), as text (``format_result``, ``format_scaling``) and
``python -m labs.theory plan``. Pure Python. The rule and its arithmetic are in
``labs.theory.planner``.

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

import argparse

from labs.theory import exports
from labs.theory.memory import GIB, OPTIMIZERS, PP_SCHEDULES, PRECISIONS
from labs.theory.memory_report import add_model_arguments, gpu_memory_gib, spec_from_args
from labs.theory.planner import ASSUMPTIONS, evaluate_layout, plan
from labs.theory.presets import GPUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's options."""
    add_model_arguments(parser)
    run = parser.add_argument_group("training run")
    run.add_argument("--seq", type=int, required=True, help="sequence length")
    run.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default: ~4M tokens)"
    )
    run.add_argument(
        "--mbs",
        type=int,
        default=None,
        help="micro-batch size (default: the planner tries 1, 2, 4, 8)",
    )
    run.add_argument("--precision", default=ASSUMPTIONS["precision"], help=" or ".join(PRECISIONS))
    run.add_argument("--optimizer", default=ASSUMPTIONS["optimizer"], help=", ".join(OPTIMIZERS))
    run.add_argument(
        "--recompute", default=ASSUMPTIONS["recompute"], help="none, selective or full"
    )
    run.add_argument(
        "--schedule",
        default=None,
        help=f"pipeline schedule: {', '.join(PP_SCHEDULES)} (default: the planner tries 1f1b,"
        " interleaved and zb-h1)",
    )
    for key in ("headroom", "efficiency"):
        run.add_argument(
            "--" + key,
            type=float,
            default=ASSUMPTIONS[key],
            help=f"default {ASSUMPTIONS[key]}",
        )
    run.add_argument(
        "--layout",
        default=None,
        help="evaluate this layout instead of planning: tp=8,pp=16,cp=1,dp=128"
        "[,zero=1,v=2,schedule=interleaved,mbs=1]",
    )
    gpu = parser.add_argument_group("cluster")
    gpu.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    gpu.add_argument("--gpus-per-node", type=int, default=8)
    gpu.add_argument(
        "--gpu", default="H100 80GB", help=" | ".join(GPUS) + " (memory and peak FLOP/s)"
    )
    gpu.add_argument(
        "--gpu-mem",
        type=str,
        default=None,
        help="GiB per GPU (overrides --gpu's; 79.6GiB or 80GB also work: memory is in GiB)",
    )
    gpu.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 TFLOP/s per GPU (overrides --gpu's)",
    )
    gpu.add_argument(
        "--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)"
    )
    gpu.add_argument(
        "--inter-bw", type=float, default=50.0, help="GB/s per GPU between nodes (InfiniBand)"
    )
    gpu.add_argument(
        "--export",
        choices=("torchrun", "accelerate", "deepspeed"),
        default=None,
        help="print a launch command or config for the plan instead of the plan",
    )
    gpu.add_argument(
        "--offload", action="store_true", help="DeepSpeed export: optimizer state on the CPU"
    )


def cli(args: argparse.Namespace) -> dict:
    """The ``plan`` command's result: the plan's ``summary`` (or, with ``--layout``, the given
    layout's), and with ``--export`` also the launch command or config."""
    if args.gpu not in GPUS:
        raise ValueError(
            f"gpu={args.gpu!r} is not one of {tuple(GPUS)}; or give --gpu-mem and --peak-tflops"
        )
    name, spec = spec_from_args(args)
    gpu = GPUS[args.gpu]
    kw = dict(
        seq=args.seq,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_gib=gpu_memory_gib(args.gpu_mem) if args.gpu_mem is not None else gpu.memory_gib,
        peak_tflops=args.peak_tflops if args.peak_tflops is not None else gpu.peak_tflops,
        intra_gbps=args.intra_bw,
        inter_gbps=args.inter_bw,
        global_batch=args.global_batch,
        **{k: getattr(args, k) for k in ASSUMPTIONS},
    )
    if args.layout is not None:
        p = evaluate_layout(spec, args.layout, **kw)
    else:
        p = plan(spec, **kw)
    out = summary(p, model=name)
    if args.export:
        out["export"] = exports.export(args.export, p, offload=args.offload)
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
    """``cli``'s result as text: the plan (or the given layout), memory, communication and time,
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
