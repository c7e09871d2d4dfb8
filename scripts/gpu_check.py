"""The GPU (NCCL) validation path: every lab, the notebooks, and throughput at ~1B parameters.

    python scripts/gpu_check.py                 # on a GPU machine: < 8 minutes on one H200
    python scripts/gpu_check.py --cpu-smoke     # the same code, gloo on CPU, tiny sizes (CI)
    python scripts/gpu_check.py --backend gloo --tiny --labs collectives zero --notebooks none

Four phases, printed as they run and summed up in ``--out``/gpu_check.md and gpu_check.json:

1. plan: GPUs (names from ``nvidia-smi``; this process never initialises CUDA, so ranks can still be
   forked), the dense bf16 peak (``labs.theory.presets.GPUS``: 989 TFLOP/s for H100/H200 SXM,
   NVIDIA's data sheets, whose 1,979 TFLOP/s is "with sparsity", twice the dense figure), and where
   the labs run. With a GPU per rank, on NCCL, one process per GPU. With fewer GPUs than a lab's
   ranks, NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). gloo can move CUDA tensors,
   but only by staging each collective through host memory, and the course puts a gloo rank's
   tensors on the CPU (``labs.runtime.device.rank_device``). So each lab then runs twice: at its
   ranks on gloo with CPU tensors (correctness at full width) and on NCCL at world size = GPUs (the
   CUDA path: device placement, NCCL collectives, GPU numerics) where the lab accepts that width.
   The output says which ran where.
2. labs: ``labs.bench.run_lab`` (the bench's code, torch's implementation side by side), each
   checked against its single-process reference; bytes sent and held against the theory are
   reported.
3. throughput: the course model at Llama-3.2-1B's shape with the byte vocabulary (0.97 B
   parameters), bf16 autocast (fp32 master weights, gradients and AdamW state), on every GPU: no
   parallelism (the baseline), our DDP (``BucketedDDP``), ZeRO-3 and TP, and torch's DDP, FSDP2 and
   DTensor TP. The micro-batch is the largest that the memory calculator
   (``labs.theory.memory.memory_per_rank``) puts under half the GPU. Reports tokens/s, MFU
   (``labs.theory.flops``: 6·P_matmul + 12·L·nh·hd·seq FLOPs per token), peak memory against the
   calculator, and our losses against torch's (same weights and tokens).
4. notebooks: each through nbval (``pytest --nbval-lax``), a few at a time. Their launch cells pick
   NCCL wherever there is a GPU per rank; no cell is GPU-only.

``--budget`` (seconds) bounds the whole run: work that would start with too little time left is
skipped and reported as skipped. Exit status 0 when every lab matches its reference and every
throughput run and notebook passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODE_NAMES = {
    "none": "no parallelism (baseline)",
    "ddp": "our BucketedDDP",
    "zero3": "our ZeRO-3",
    "tp": "our TP",
    "torch-ddp": "torch DDP",
    "torch-fsdp2": "torch FSDP2 fully_shard",
    "torch-tp": "torch DTensor TP",
}
OURS = ("ddp", "zero3", "tp")
THEIRS = {"ddp": "torch-ddp", "zero3": "torch-fsdp2", "tp": "torch-tp"}


# --- phase 1: the machine and the plan ------------------------------------------------------------
def gpu_names() -> list[str]:
    """GPU names from nvidia-smi (CUDA stays uninitialised here), else generic names, else []."""
    import torch

    from labs.runtime.device import gpu_names as nvidia_smi_names

    count = torch.cuda.device_count()  # NVML where it can: no CUDA initialisation here
    names = nvidia_smi_names() if count else []
    return names[:count] if len(names) >= count else [f"GPU {i}" for i in range(count)]


def gpu_spec(
    names: list[str], override_tflops: float | None
) -> tuple[float | None, float | None, str]:
    """(dense bf16 peak FLOP/s, memory GiB, where the peak comes from) for the first GPU's name."""
    from labs.theory.presets import GPUS

    known = next(
        (
            (key, mem, tflops)
            for key, (mem, tflops) in GPUS.items()
            if names and key.split()[0] in names[0]
        ),
        None,
    )
    memory = known[1] if known else None
    if override_tflops:
        return override_tflops * 1e12, memory, "--peak-tflops"
    if known:
        return (
            known[2] * 1e12,
            memory,
            f"labs.theory.presets.GPUS[{known[0]!r}], dense bf16 from the data sheet",
        )
    return None, memory, "unknown for this device: pass --peak-tflops for MFU"


def lab_plan(ranks: int, gpus: int, backend: str) -> list[tuple[int, str, str]]:
    """[(nproc, backend, why)]: the runs that together cover every lab on this machine."""
    if backend == "gloo" or gpus == 0:
        return [(ranks, "gloo", "gloo, CPU tensors" + (" (forced)" if gpus else ""))]
    if gpus >= ranks:
        return [(ranks, "nccl", f"NCCL, one process per GPU ({ranks} of {gpus})")]
    return [
        (
            ranks,
            "gloo",
            f"gloo, CPU tensors: {gpus} GPU(s) < {ranks} ranks"
            " and NCCL refuses two ranks on one GPU",
        ),
        (gpus, "nccl", f"NCCL at world size {gpus}, one process per GPU: the CUDA code path"),
    ]


# --- phase 2: the labs ----------------------------------------------------------------------------
def check_labs(labs, plan, *, steps, timeout, vs_torch, deadline, log) -> list[dict]:
    from labs.bench import run_lab
    from labs.bench_report import fmt

    rows = []
    for lab in labs:
        for nproc, backend, why in plan:
            if time.monotonic() > deadline:
                rows.append(
                    {
                        "lab": lab,
                        "nproc": nproc,
                        "backend": backend,
                        "status": "skipped",
                        "where": why,
                        "note": "time budget spent",
                    }
                )
                continue
            for row in run_lab(
                lab,
                nproc=nproc,
                steps=steps,
                backend=backend,
                vs_torch=vs_torch,
                timeout=min(timeout, max(30.0, deadline - time.monotonic())),
            ):
                row.update(
                    where=why,
                    passed=row["status"] == "ok" and row.get("matches_reference") is not False,
                )
                verdict = (
                    ("ok" if row["passed"] else "FAIL") if row["status"] == "ok" else row["status"]
                )
                log(
                    f"  {lab:<11} {row.get('config', ''):<30} x{nproc} {backend:<5}"
                    f" reference {verdict:<8}"
                    f" max diff {fmt(row.get('max_diff'), '.1e') or '-'}"
                    f"  bytes/theory {fmt(row.get('comm_ratio'), '.3f')}"
                    f"  state/theory {fmt(row.get('state_ratio'), '.3f')}"
                    + (f"  ({row['note'][:120]})" if row["status"] != "ok" else "")
                )
                rows.append(row)
    return rows


# --- phase 3: throughput --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Throughput:
    """One throughput run of ``mode`` (a key of ``MODE_NAMES``) on every rank."""

    mode: str
    model: dict  # ModelConfig fields
    micro_batch: (
        int  # sequences per data-parallel rank per step (TP: per step, every rank the same)
    )
    warmup: int = 2
    steps: int = 5
    bf16: bool = True
    seed: int = 0


def model_config(tiny: bool) -> dict:
    """The course model at Llama-3.2-1B's shape (byte vocabulary, seq 2048), or the course's tiny
    default."""
    from labs.models.transformer import ModelConfig
    from labs.theory.presets import preset

    if tiny:
        return dataclasses.asdict(ModelConfig())
    p = preset("llama3.2-1b")
    return dataclasses.asdict(
        ModelConfig(
            seq_len=2048,
            n_layer=p.n_layers,
            n_embd=p.hidden,
            n_head=p.n_heads,
            n_kv_head=p.kv_heads,
            ffn_hidden=p.ffn,
        )
    )


def spec_of(cfg: dict):
    from labs.experiments.common import course_spec
    from labs.models.transformer import ModelConfig

    return course_spec(ModelConfig(**cfg))


def predicted_bytes(cfg: dict, *, world: int, micro_batch: int) -> dict[str, int]:
    """The memory calculator's bytes per rank for each mode (bf16-mixed, AdamW)."""
    from labs.theory.memory import memory_per_rank

    layouts = {
        "none": {},
        "ddp": dict(dp=world),
        "zero3": dict(dp=world, zero=3 if world > 1 else 0),
        "tp": dict(tp=world),
    }
    out = {
        m: memory_per_rank(
            spec_of(cfg), seq=cfg["seq_len"], mbs=micro_batch, precision="bf16-mixed", **kw
        )["total_bytes"]
        for m, kw in layouts.items()
    }
    return {**out, **{THEIRS[m]: out[m] for m in OURS}}


def pick_micro_batch(cfg: dict, *, world: int, gpu_gib: float | None) -> int:
    """The largest micro-batch (1..64) the calculator puts under half of ``gpu_gib`` in every mode
    (2 without one). Half: autocast keeps the residual stream and the norms in fp32, which the bf16
    calculator does not count."""
    best = 2 if not gpu_gib else 1
    for mbs in (1, 2, 4, 8, 16, 32, 64) if gpu_gib else ():
        if max(predicted_bytes(cfg, world=world, micro_batch=mbs).values()) / 2**30 > gpu_gib / 2:
            break
        best = mbs
    return best


def _wrap(mode: str, model, cfg):
    """(module to call, what a step does after backward, context for forward and backward) for
    ``mode``."""
    from labs.experiments.zero import RunSpec, wrap_for_zero
    from labs.runtime.device import rank_device
    from labs.runtime.impl import exercise
    from labs.train import make_optimizer

    nothing = contextlib.nullcontext
    if mode in ("zero3", "torch-fsdp2"):  # as the ZeRO lab runs them
        wrapper, opt = wrap_for_zero(model, RunSpec(stage=3, torch_fsdp=mode == "torch-fsdp2"), cfg)
        step = wrapper or opt
        return model, lambda: (step.step(), step.zero_grad()), nothing
    ctx = nothing
    if mode == "ddp":
        model = exercise("ddp").BucketedDDP(model, bucket_mb=25.0)
    elif mode == "tp":
        model = exercise("tensor_parallel").apply_tensor_parallel(model)
    elif mode == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = rank_device()
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=25
        )
    elif mode == "torch-tp":
        from torch.distributed.tensor.parallel import loss_parallel

        from labs.experiments.tp import torch_tensor_parallel

        model = torch_tensor_parallel(model, sp=False)
        ctx = loss_parallel
    opt = make_optimizer(model.parameters(), cfg)
    sync = getattr(
        model, "finish_gradient_synchronization", lambda: None
    )  # our DDP's end of backward
    return model, lambda: (sync(), opt.step(), opt.zero_grad(set_to_none=True)), ctx


def throughput_worker(run: Throughput) -> dict:
    """One rank: build the model on its device, wrap it, time ``run.steps`` steps after
    ``run.warmup``."""
    import torch
    import torch.distributed as dist

    from labs.measure.timing import StepTimer
    from labs.models.transformer import ModelConfig, Transformer, count_params
    from labs.runtime.device import rank_device
    from labs.runtime.launcher import report_progress
    from labs.train import TrainConfig

    device = rank_device()
    rank = dist.get_rank()
    cfg = ModelConfig(**run.model)
    torch.manual_seed(run.seed)  # the same (default) initialisation on every rank and in every mode
    with torch.device(device):
        model = Transformer(cfg)
    n_params = count_params(model)
    wrapped, finish_step, ctx = _wrap(run.mode, model, TrainConfig(lr=1e-4))
    g = torch.Generator().manual_seed(
        run.seed + (0 if run.mode in ("tp", "torch-tp") else rank)
    )  # TP: one batch
    tokens = torch.randint(
        0, cfg.vocab_size, (run.warmup + run.steps, run.micro_batch, cfg.seq_len + 1), generator=g
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    timer = StepTimer(device)
    for batch in tokens.to(device):
        # [B, T] each
        x = batch[:, :-1].contiguous()
        y = batch[:, 1:].contiguous()
        with timer.step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.bf16), ctx():
                _, loss = wrapped(x, y)
                loss.backward()
            finish_step()
        losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item())
        report_progress()
    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # throughput after ``run.warmup`` steps (CUDA's autotuning and allocator settle in more
        # than the one warm-up step of a lab's step time)
        "step_time_s": statistics.median(timer.times[run.warmup :]),
        "losses": losses,
        "n_params": n_params,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
    }


def measure_throughput(
    modes, *, cfg, world, backend, micro_batch, predict_memory, peak, steps, timeout, deadline, log
) -> list[dict]:
    """One row per mode: tokens/s, MFU, peak memory (and the calculator's, with
    ``predict_memory``)."""
    from labs.bench_report import fmt
    from labs.experiments.zero import warm_imports
    from labs.runtime.launcher import launch
    from labs.theory.flops import flops_per_token, mfu

    warm_imports(fsdp=True)  # imported once here rather than in every forked rank
    per_token = flops_per_token(spec_of(cfg), seq=cfg["seq_len"])
    rows = []
    for mode in modes:
        row = {
            "mode": mode,
            "name": MODE_NAMES[mode],
            "world": world,
            "backend": backend,
            "micro_batch": micro_batch,
        }
        left = deadline - time.monotonic()
        if left < 20:
            rows.append({**row, "status": "skipped", "note": "time budget spent"})
            continue
        per_rank = None
        mbs = micro_batch
        while per_rank is None:
            run = Throughput(mode=mode, model=cfg, micro_batch=mbs, steps=steps)
            try:
                per_rank = launch(
                    throughput_worker,
                    world,
                    run,
                    backend=backend,
                    timeout=min(timeout, max(20.0, deadline - time.monotonic())),
                    progress=run.warmup + steps,
                    desc=f"{MODE_NAMES[mode]}, micro-batch {mbs}",
                )
            except Exception as e:  # a failed run is a row, not the end of the check
                message = f"{type(e).__name__}: {getattr(e, 'message', e)}"
                if "out of memory" in message and mbs > 1 and deadline - time.monotonic() > 20:
                    log(
                        f"  {MODE_NAMES[mode]:<26} out of memory at micro-batch {mbs}:"
                        f" trying {mbs // 2}"
                    )
                    # the calculator's pick was too big for this mode: halve it and say so
                    mbs //= 2
                    continue
                break
        if per_rank is None:
            rows.append({**row, "micro_batch": mbs, "status": "failed", "note": message[:300]})
            log(f"  {MODE_NAMES[mode]:<26} FAILED {message[:300]}")
            continue
        t = max(r["step_time_s"] for r in per_rank)  # a step ends when its slowest rank does
        tokens = (1 if mode in ("tp", "torch-tp") else world) * mbs * cfg["seq_len"]
        peak_bytes = [r["peak_memory_bytes"] or 0 for r in per_rank]
        row.update(
            status="ok",
            micro_batch=mbs,
            device=per_rank[0]["device_name"],
            step_time_s=t,
            tokens_per_step=tokens,
            tokens_per_s=tokens / t,
            flops_per_token=per_token,
            n_params=per_rank[0]["n_params"],
            mfu=mfu(per_token * tokens, step_time_s=t, peak_flops=peak, n_gpus=world)
            if peak
            else None,
            losses=per_rank[0]["losses"],
            peak_memory_gib=max(peak_bytes) / 2**30 or None,
            predicted_memory_gib=predicted_bytes(cfg, world=world, micro_batch=mbs)[mode] / 2**30
            if predict_memory
            else None,
        )
        peak_text = ""
        if row["peak_memory_gib"]:
            calculator = fmt(row["predicted_memory_gib"], ".1f")
            peak_text = f"  peak {row['peak_memory_gib']:.1f} GiB (calculator {calculator})"
        log(
            f"  {MODE_NAMES[mode]:<26} {row['tokens_per_s']:>12,.0f} tokens/s"
            f"  step {t * 1e3:8.1f} ms  MFU {fmt(row['mfu'], '.1%') or 'n/a'}"
            f"  loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}{peak_text}"
        )
        rows.append(row)
    done = {r["mode"]: r for r in rows if r["status"] == "ok"}
    # same weights, same tokens: ours and torch's losses must agree
    for mode, theirs in THEIRS.items():
        if mode in done and theirs in done:
            done[mode]["max_rel_loss_diff_vs_torch"] = max(
                abs(a - b) / abs(b) for a, b in zip(done[mode]["losses"], done[theirs]["losses"])
            )
    return rows


# --- phase 4: notebooks ---------------------------------------------------------------------------
def run_notebooks(paths, *, jobs, deadline, log) -> list[dict]:
    """Validate each notebook with nbval in its own pytest process, ``jobs`` at a time."""
    env = dict(os.environ, LABS_IMPL="solutions", PYTHONHASHSEED="0")
    pending = list(paths)
    running = []
    rows = []
    while pending or running:
        while pending and len(running) < jobs and time.monotonic() < deadline - 30:
            path = pending.pop(0)
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                str(path),
                "-q",
                "-p",
                "no:cacheprovider",
                "--nbval-lax",
            ]
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            running.append((path, proc, time.monotonic()))
        if pending and not running:  # too little time left to start them
            rows += [
                {"notebook": Path(p).name, "status": "skipped", "note": "time budget spent"}
                for p in pending
            ]
            pending = []
        for path, proc, t0 in list(running):
            late = time.monotonic() > deadline
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0].strip()
            running.remove((path, proc, t0))
            status = "passed" if proc.returncode == 0 else "timed out" if late else "failed"
            rows.append(
                {
                    "notebook": Path(path).name,
                    "status": status,
                    "wall_s": time.monotonic() - t0,
                    "note": out.splitlines()[-1] if out else "",
                }
            )
            log(
                f"  {Path(path).name:<36} {status:<9} {rows[-1]['wall_s']:6.1f} s"
                f"  {rows[-1]['note'][:100]}"
            )
        time.sleep(0.2)
    return rows


# --- the report -----------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    from labs.bench_report import fmt, name

    env = report["environment"]
    t = report["throughput"]
    gpus = (
        f"{env['gpus']} x {', '.join(sorted(set(env['gpu_names'])))}" if env["gpus"] else "no GPU"
    )
    peak = f"{env['peak_flops'] / 1e12:.4g} TFLOP/s" if env["peak_flops"] else "n/a"
    lines = [
        f"# GPU check ({report['date']})",
        "",
        f"Machine: {gpus}; {env['cpu']}, {env['cores']} CPU cores; torch {env['torch']}."
        f" Peak bf16 per device: {peak} ({env['peak_source']})."
        f" Command: `{report['command']}`.",
        "",
        "## Where the labs ran",
        "",
    ]
    lines += [f"- {nproc} rank(s) on {backend}: {why}" for nproc, backend, why in report["plan"]]
    lines += [
        "",
        "## Labs against the single-process reference",
        "",
        "| lab | ranks | backend | reference | max diff | bytes / theory | state / theory "
        "| ours (ms) | torch (ms) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["labs"]:
        verdict = (
            ("✓" if r["passed"] else "✗")
            if r["status"] == "ok"
            else f"{r['status']}: {r['note'][:80]}"
        )
        lines.append(
            f"| {name(r)} | {r['nproc']} | {r['backend']} | {verdict}"
            f" | {fmt(r.get('max_diff'), '.1e')} | {fmt(r.get('comm_ratio'), '.3f')}"
            f" | {fmt(r.get('state_ratio'), '.3f')} | {fmt(r.get('ours_ms'), '.1f')}"
            f" | {fmt(r.get('torch_ms'), '.1f')} |"
        )
    alone = " A world of one: the collectives move nothing, so this shows each wrapper's overhead."
    alone = alone if t["world"] == 1 else ""
    lines += [
        "",
        f"## Throughput: {t['n_params'] / 1e6:,.1f} M parameters, seq {t['seq_len']}, micro-batch "
        f"{t['micro_batch']}, bf16 autocast, world size {t['world']} ({t['backend']})",
        "",
        f"Median of {t['steps']} steps after 2 warm-up steps.{alone}",
        "",
        "| run | micro-batch | tokens/s | step (ms) | MFU | peak memory (GiB) | calculator (GiB) "
        "| loss first → last | losses vs torch's |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in t["rows"]:
        if r["status"] != "ok":
            why = f"{r['status']}: {r.get('note', '')[:80]}"
            lines.append(f"| {r['name']} | {r['micro_batch']} | {why} | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f}"
            f" | {r['step_time_s'] * 1e3:.1f} | {fmt(r['mfu'], '.1%')} "
            f"| {fmt(r['peak_memory_gib'], '.1f')} | {fmt(r['predicted_memory_gib'], '.1f')} "
            f"| {r['losses'][0]:.3f} → {r['losses'][-1]:.3f} "
            f"| {fmt(r.get('max_rel_loss_diff_vs_torch'), '.1e')} |"
        )
    if report["notebooks"]:
        lines += [
            "",
            "## Notebooks (nbval)",
            "",
            "| notebook | status | wall (s) |",
            "|---|---|---:|",
        ]
        lines += [
            f"| {r['notebook']} | {r['status']} | {fmt(r.get('wall_s'), '.1f')} |"
            for r in report["notebooks"]
        ]
    lines += [
        "",
        f"Wall time {report['wall_s']:.0f} s: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in report["phase_s"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    from labs.run import LABS

    p = argparse.ArgumentParser(
        prog="python scripts/gpu_check.py", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="= --backend gloo --tiny --labs collectives --notebooks none --steps 2 (what CI runs)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: NCCL on GPUs when there are any; gloo: CPU tensors (this path's test on CPU)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the course's tiny default model for the throughput phase",
    )
    p.add_argument(
        "--labs", nargs="+", choices=sorted(LABS), default=None, help="default: every lab"
    )
    p.add_argument("--ranks", type=int, default=4, help="ranks per lab")
    p.add_argument("--steps", type=int, default=3, help="training steps per lab (>= 2)")
    p.add_argument(
        "--world", type=int, default=None, help="throughput world size (default: GPUs, 2 on CPU)"
    )
    p.add_argument(
        "--throughput-steps", type=int, default=5, help="timed steps, after 2 warm-up steps"
    )
    p.add_argument(
        "--micro-batch", type=int, default=None, help="default: the memory calculator's pick"
    )
    p.add_argument("--modes", nargs="+", choices=tuple(MODE_NAMES), default=list(MODE_NAMES))
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak per device, for MFU"
    )
    p.add_argument(
        "--notebooks", nargs="+", default=None, help="paths, or 'none' (default: every notebook)"
    )
    p.add_argument(
        "--notebook-jobs",
        type=int,
        default=None,
        help="notebooks at once (default: CPU cores // 4)",
    )
    p.add_argument(
        "--no-torch",
        dest="vs_torch",
        action="store_false",
        help="labs: skip torch's side-by-side run",
    )
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    p.add_argument(
        "--out", default="out/gpu_check", help="folder for gpu_check.md and gpu_check.json"
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.backend = "gloo"
        args.tiny = True
        args.steps = 2
        args.labs = args.labs or ["collectives"]
        args.notebooks = args.notebooks or ["none"]
    for name in (
        "ranks",
        "world",
        "throughput_steps",
        "micro_batch",
        "budget",
        "timeout",
        "notebook_jobs",
    ):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # torch.cuda.is_available() (which launch's backend choice calls) initialises the CUDA driver
    # through cudaGetDeviceCount unless told to ask NVML, and a forked rank then cannot initialise
    # CUDA ("poisoned fork", see is_available's docstring). Ranks are forked from this process: ask
    # NVML.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    start = time.monotonic()
    end = start + args.budget

    def log(text: str) -> None:
        print(text, flush=True)

    from labs.bench_report import hardware
    from labs.run import LABS
    from labs.runtime.impl import set_implementation

    set_implementation("solutions")  # the course's own answers: ranks inherit the switch
    names = gpu_names()
    on_gpus = bool(names) and args.backend != "gloo"
    peak, gpu_gib, source = gpu_spec(names if on_gpus else [], args.peak_tflops)
    plan = lab_plan(args.ranks, len(names), args.backend)
    env = {
        **hardware(),
        "gpus": len(names),
        "gpu_names": names,
        "peak_flops": peak,
        "peak_source": source,
    }
    log(
        f"GPU check: {len(names)} GPU(s) {sorted(set(names))}, {env['cores']} CPU cores,"
        f" torch {env['torch']}"
    )
    log(f"peak bf16 per device: {f'{peak / 1e12:.4g} TFLOP/s' if peak else 'n/a'} ({source})")
    for nproc, backend, why in plan:
        log(f"labs run at {nproc} rank(s) on {backend}: {why}")
    phase_s = {}

    log("\n[labs] every lab against its single-process reference")
    t0 = time.monotonic()
    labs_rows = check_labs(
        args.labs or list(LABS),
        plan,
        steps=args.steps,
        timeout=args.timeout,
        vs_torch=args.vs_torch,
        deadline=end - 0.35 * args.budget,
        log=log,
    )
    phase_s["labs"] = time.monotonic() - t0

    t0 = time.monotonic()
    world = args.world or (len(names) if on_gpus else 2)
    backend = "nccl" if on_gpus else "gloo"
    if not on_gpus and not args.tiny:
        log("\n(no GPU in use: the throughput phase runs the tiny model; the ~1B one needs a GPU)")
    cfg = model_config(args.tiny or not on_gpus)
    gpu_gib = None if args.tiny or not on_gpus else gpu_gib or 40.0
    mbs = args.micro_batch or pick_micro_batch(cfg, world=world, gpu_gib=gpu_gib)
    log(
        f"\n[throughput] course model H={cfg['n_embd']}, {cfg['n_layer']} layers,"
        f" seq {cfg['seq_len']}, micro-batch {mbs}, world size {world} on {backend}"
        + (" (one GPU: a world of one)" if world == 1 else "")
    )
    trows = measure_throughput(
        args.modes,
        cfg=cfg,
        world=world,
        backend=backend,
        micro_batch=mbs,
        predict_memory=bool(gpu_gib),
        peak=peak,
        steps=args.throughput_steps,
        timeout=args.timeout,
        deadline=end - 0.15 * args.budget,
        log=log,
    )
    phase_s["throughput"] = time.monotonic() - t0

    t0 = time.monotonic()
    nb_rows = []
    if args.notebooks != ["none"]:
        paths = [
            Path(p) for p in args.notebooks or sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
        ]
        log(f"\n[notebooks] {len(paths)} through nbval")
        nb_rows = run_notebooks(
            paths, jobs=args.notebook_jobs or max(1, env["cores"] // 4), deadline=end, log=log
        )
    phase_s["notebooks"] = time.monotonic() - t0

    import torch

    from labs.models.transformer import ModelConfig, Transformer, count_params

    with torch.device("meta"):
        n_params = count_params(Transformer(ModelConfig(**cfg)))
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python scripts/gpu_check.py", *argv]),
        "environment": env,
        "plan": plan,
        "labs": labs_rows,
        "notebooks": nb_rows,
        "phase_s": phase_s,
        "wall_s": time.monotonic() - start,
        "throughput": {
            "rows": trows,
            "world": world,
            "backend": backend,
            "micro_batch": mbs,
            "steps": args.throughput_steps,
            "seq_len": cfg["seq_len"],
            "model": cfg,
            "n_params": n_params,
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    log("\n" + markdown(report))
    skipped = sum(r["status"] in ("skipped", "invalid") for r in labs_rows + trows + nb_rows)
    ok = (
        all(r.get("passed") or r["status"] in ("skipped", "invalid") for r in labs_rows)
        and all(r["status"] in ("ok", "skipped") for r in trows)
        and all(r["status"] in ("passed", "skipped") for r in nb_rows)
    )
    log(
        f"wrote {out / 'gpu_check.md'} and gpu_check.json: {'PASSED' if ok else 'FAILED'}"
        f"{f' ({skipped} skipped or not applicable)' if skipped else ''}"
        f" in {report['wall_s']:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
