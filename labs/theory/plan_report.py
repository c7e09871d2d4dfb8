"""The planner's front end, shared by the CLI and the widget (``labs.widgets.planner``): the plan
as plain JSON (``summary``), as text (``format_result``, ``format_scaling``) and
``python -m labs.theory plan``. Pure Python. The rule and its arithmetic are in
``labs.theory.planner``.

    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80
    python -m labs.theory plan --preset llama3-8b --seq 131072 --gpus 64 --export accelerate

Bad input (a cluster that is not whole nodes, a model no layout fits, an export that cannot express
the plan, ...) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse

from labs.theory import exports
from labs.theory.memory import GIB
from labs.theory.memory_report import add_model_arguments, spec_from_args
from labs.theory.planner import ASSUMPTIONS, plan
from labs.theory.presets import GPUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's options."""
    add_model_arguments(parser)
    run = parser.add_argument_group("training run")
    run.add_argument("--seq", type=int, required=True, help="sequence length")
    run.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default: ~4M tokens)"
    )
    for key, value in ASSUMPTIONS.items():
        run.add_argument(
            "--" + key.replace("_", "-"), type=type(value), default=value, help=f"default {value}"
        )
    gpu = parser.add_argument_group("cluster")
    gpu.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    gpu.add_argument("--gpus-per-node", type=int, default=8)
    gpu.add_argument(
        "--gpu", default="H100 80GB", help=" | ".join(GPUS) + " (memory and peak FLOP/s)"
    )
    gpu.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (overrides --gpu's)")
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
    """The ``plan`` command's result: the plan's ``summary``, or with ``--export`` also the launch
    command or config."""
    if args.gpu not in GPUS:
        raise ValueError(
            f"gpu={args.gpu!r} is not one of {tuple(GPUS)}; or give --gpu-mem and --peak-tflops"
        )
    name, spec = spec_from_args(args)
    gpu = GPUS[args.gpu]
    p = plan(
        spec,
        seq=args.seq,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_gib=args.gpu_mem if args.gpu_mem is not None else gpu.memory_gib,
        peak_tflops=args.peak_tflops if args.peak_tflops is not None else gpu.peak_tflops,
        intra_gbps=args.intra_bw,
        inter_gbps=args.inter_bw,
        global_batch=args.global_batch,
        **{k: getattr(args, k) for k in ASSUMPTIONS},
    )
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
        "sp",
        "world_size",
        "global_batch",
        "microbatches",
        "total_params",
        "fits",
        "bubble",
        "compute_s",
        "bubble_s",
        "exposed_comm_s",
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
    return {
        "model": model,
        **{k: p[k] for k in keep},
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
        "replica_gib": p["replica_bytes"] / GIB,
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
    """``cli``'s result as text: the plan, memory, communication and time, the rule's steps and
    the rejected layouts (or the export alone)."""
    if "export" in r:
        return r["export"]
    c = r["cluster"]
    m = r["memory_gib"]
    comm = ", ".join(
        f"{a} {r['comm_bytes'][a] / 1e9:.3g} GB ({r['comm_seconds'][a]:.3g} s, "
        f"{'intra' if r['intra_node'][a] else 'inter'})"
        for a in ("tp", "cp", "pp", "dp")
    )
    lines = [
        f"plan        DP={r['dp']} TP={r['tp']} PP={r['pp']} CP={r['cp']}  (ZeRO-{r['zero']}"
        f"{', SP' if r['sp'] else ''}) on {c['gpus']} GPUs in nodes of {c['gpus_per_node']}",
        f"model       {r['model']}: {r['total_params']:,} parameters;"
        f" global batch {r['global_batch']} sequences"
        f" = {r['microbatches']} micro-batch(es) of {r['assumptions']['mbs']} per DP rank",
        f"memory      {m['total']:.1f} GiB per GPU of {c['gpu_mem_gib']:.1f}"
        f" (params {m['param']:.1f}, grads {m['grad']:.1f}, optimizer {m['optimizer']:.1f},"
        f" activations {m['activation']:.1f}); a replica without DP sharding"
        f" {r['replica_gib']:.1f}",
        f"comm/step   {comm}",
        f"time        step {r['step_time_s']:.3g} s (compute {r['compute_s']:.3g} s),"
        f" bubble {r['bubble']:.1%}, scaling efficiency {r['scaling_efficiency']:.0%},"
        f" MFU {r['mfu']:.0%}",
        "",
        "rule",
    ]
    lines += [f"  {step}" for step in r["rule"]]
    lines += ["", "rejected"] + [f"  {x['name']:<30} {x['reason']}" for x in r["rejected"]]
    lines += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


def format_scaling(rows: list[dict]) -> str:
    """``labs.theory.planner.scaling``'s rows as a table: layout, step time, where the time goes
    (compute, bubble, exposed communication by axis), scaling efficiency, per-GPU throughput,
    MFU."""
    lines = [
        f"{'GPUs':>6}  {'layout':<20}{'step s':>8}{'compute':>9}{'bubble':>8}{'exposed':>9}"
        f"  {'lost to':<22}{'eff.':>6}{'tok/s/GPU':>11}{'vs first':>9}{'MFU':>6}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['gpus']:>6}  no layout fits")
            continue
        layout = f"DP{r['dp']} TP{r['tp']} PP{r['pp']} CP{r['cp']}"
        worst = max(r["exposed_by_axis"], key=r["exposed_by_axis"].get)
        lost = "bubble" if r["bubble_s"] >= r["exposed_comm_s"] else f"{worst} communication"
        if r["bubble_s"] + r["exposed_comm_s"] == 0:
            lost = "-"
        lines.append(
            f"{r['gpus']:>6}  {layout:<20}{r['step_time_s']:>8.3g}{r['compute_s']:>9.3g}"
            f"{r['bubble_s']:>8.3g}{r['exposed_comm_s']:>9.3g}  {lost:<22}"
            f"{r['scaling_efficiency']:>6.0%}{r['tokens_per_s_per_gpu']:>11,.0f}"
            f"{r['vs_first']:>9.0%}{r['mfu']:>6.0%}"
        )
    return "\n".join(lines)
