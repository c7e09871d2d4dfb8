"""The GPU (NCCL) validation path: every lab, the notebooks, and throughput at ~1B parameters.

    python scripts/gpu_check.py                 # on a GPU machine: < 8 minutes on one H200
    python scripts/gpu_check.py --cpu-smoke     # the same code, gloo on CPU, tiny sizes (CI)
    python scripts/gpu_check.py --backend gloo --tiny --labs collectives zero --notebooks none

Four phases, printed as they run and summed up in ``--out``/gpu_check.md and gpu_check.json:

1. plan: GPUs (names and memory from ``nvidia-smi``; this process never initialises CUDA, so
   ranks can still be forked), the dense bf16 peak (``GPU_TABLE``, from NVIDIA's data sheets,
   whose bf16 figures are "with sparsity", twice the dense one), and where each lab runs: on
   NCCL, one process per GPU, at min(GPUs, the lab's own ranks). With one GPU every lab runs at
   world size 1, which exercises device placement, NCCL's setup and GPU numerics but no
   point-to-point message, no uneven all-to-all and no subgroup: the report says so. A
   configuration that needs more ranks than there are GPUs (the lab refuses the smaller world)
   is reported as not exercised. Without a GPU (or with ``--backend gloo``) the labs run on gloo
   with CPU tensors.
2. labs: ``labs.bench.run_lab`` (the bench's code, torch's implementation side by side), each
   checked against its single-process reference; bytes sent and held against the theory are
   reported. A lab passes only when it ran and matched: "invalid", "skipped" (the time budget
   ran out) and "failed" rows fail the check.
3. throughput: the course model at Llama-3.2-1B's shape with the byte vocabulary (0.97 B
   parameters), bf16 autocast (fp32 master weights, gradients and AdamW state), on every GPU: no
   parallelism (the baseline), our DDP (``BucketedDDP``), ZeRO-3 and TP, and torch's DDP, FSDP2
   (with a bf16 ``MixedPrecisionPolicy``: bf16 compute, fp32 gradient reduction and master
   weights, as our runs under autocast) and DTensor TP. The micro-batch is the largest that the
   memory calculator (``labs.theory.memory.memory_per_rank``) puts under half the GPU. Reports
   tokens/s, MFU (``labs.theory.flops``: 6·P_matmul + 12·L·nh·hd·seq FLOPs per token), peak
   memory against the calculator, and our losses against torch's (same weights and tokens).
4. notebooks: each through nbval (``pytest --nbval-lax``), a few at a time. Their launch cells pick
   NCCL wherever there is a GPU per rank; no cell is GPU-only.

``--budget`` (seconds) bounds the whole run: work that would start with too little time left is
skipped and reported as skipped, which fails the check. Exit status 0 when every lab that this
machine can run matched its reference and every throughput run and notebook passed, 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
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
@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A GPU the check knows: its dense bf16 Tensor Core peak and its memory."""

    name: str
    words: tuple[str, ...]  # all must be words of nvidia-smi's name (case-insensitive)
    bf16_tflops: float  # dense: half the data sheet's "with sparsity" figure
    memory_gib: float  # the data sheet's GB, which are binary (H200: 141 GB = 143,771 MiB)


# First match wins, so a variant comes before its family. Sources, NVIDIA's data sheets:
# - A100: "NVIDIA A100 Tensor Core GPU" data sheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
#   BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity), SXM4 and PCIe alike; 40 GB HBM2 or
#   80 GB HBM2e.
# - H100: "NVIDIA H100 Tensor Core GPU" data sheet: BFLOAT16 Tensor Core 1,979 TFLOPS* (SXM),
#   1,513* (PCIe), 1,671* (NVL), "* with sparsity"; 80 GB (SXM, PCIe), 94 GB (NVL).
# - H200: "NVIDIA H200 Tensor Core GPU" data sheet: BFLOAT16 Tensor Core 1,979 TFLOPS* (SXM),
#   1,671* (NVL), "* with sparsity"; 141 GB HBM3e.
# nvidia-smi's names: "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3"
# (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL". A GH200 is
# none of these (its name is one word, "GH200") and gets no peak: pass --peak-tflops.
GPU_TABLE = (
    GpuSpec("H200 NVL", ("H200", "NVL"), 1671 / 2, 141.0),
    GpuSpec("H200 SXM", ("H200",), 1979 / 2, 141.0),
    GpuSpec("H100 NVL", ("H100", "NVL"), 1671 / 2, 94.0),
    GpuSpec("H100 PCIe", ("H100", "PCIE"), 1513 / 2, 80.0),
    GpuSpec("H100 SXM", ("H100",), 1979 / 2, 80.0),
    GpuSpec("A100 80GB", ("A100", "80GB"), 312.0, 80.0),
    GpuSpec("A100 40GB", ("A100", "40GB"), 312.0, 40.0),
)


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi (CUDA stays uninitialised here), else generic names, else []."""
    import torch

    from labs.runtime.device import gpu_names as nvidia_smi_names

    count = torch.cuda.device_count()  # NVML where it can: no CUDA initialisation here
    names = nvidia_smi_names() if count else []
    return names[:count] if len(names) >= count else [f"GPU {i}" for i in range(count)]


def gpu_memory_gib() -> float | None:
    """The smallest GPU's memory as nvidia-smi reports it, in GiB (None without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        mib = [float(line) for line in out.stdout.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) / 1024 if mib else None


def known_gpu(name: str) -> GpuSpec | None:
    """The row of ``GPU_TABLE`` for an nvidia-smi name, matched word by word (None if unknown)."""
    words = set(re.split(r"[^0-9A-Z]+", name.upper()))
    return next((g for g in GPU_TABLE if set(g.words) <= words), None)


def gpu_spec(
    names: list[str], override_tflops: float | None
) -> tuple[float | None, float | None, str]:
    """(dense bf16 peak FLOP/s, memory GiB, where the peak comes from) for the first GPU's name."""
    known = known_gpu(names[0]) if names else None
    memory = known.memory_gib if known else None
    if override_tflops:
        return override_tflops * 1e12, memory, "--peak-tflops"
    if known:
        return (
            known.bf16_tflops * 1e12,
            memory,
            f"{known.name}: NVIDIA's data sheet, dense bf16 (half the figure with sparsity)",
        )
    return None, memory, "unknown for this device: pass --peak-tflops for MFU"


def lab_ranks(lab: str) -> int:
    """The ranks a lab runs at by default (its declaration's ``ranks``, ``LAB.ranks``)."""
    from labs.experiments.spec import command_labs

    return command_labs()[lab].ranks


# What a world of one cannot show: said wherever the labs ran on one GPU.
NOT_AT_WORLD_ONE = "point-to-point messages, uneven all-to-all, subgroups"


def lab_plan(ranks: int, gpus: int, backend: str) -> tuple[int, str, str]:
    """(nproc, backend, why): where a lab of ``ranks`` ranks runs on this machine."""
    if backend == "gloo" or gpus == 0:
        return ranks, "gloo", "gloo, CPU tensors" + (" (forced)" if gpus else "")
    if gpus == 1:
        return (
            1,
            "nccl",
            f"NCCL at world size 1 (one GPU): not exercised: {NOT_AT_WORLD_ONE}",
        )
    nproc = min(gpus, ranks)
    return nproc, "nccl", f"NCCL, one process per GPU ({nproc} of {gpus})"


# --- phase 2: the labs ----------------------------------------------------------------------------
def check_labs(labs, plans, *, steps, timeout, vs_torch, deadline, log) -> list[dict]:
    """Every configuration of every lab, at its plan's (nproc, backend); one row each, with
    ``passed`` only when it ran and matched its reference. A configuration the lab refuses at a
    world smaller than its own ranks (fewer GPUs) is "not exercised"."""
    from labs.bench import run_lab
    from labs.bench.report import fmt

    rows = []
    for lab in labs:
        nproc, backend, why = plans[lab]
        if time.monotonic() > deadline:
            rows.append(
                {
                    "lab": lab,
                    "nproc": nproc,
                    "backend": backend,
                    "status": "skipped",
                    "where": why,
                    "passed": False,
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
            if row["status"] == "invalid" and nproc < lab_ranks(lab):
                row.update(status="not exercised", note=f"needs more ranks: {row['note']}")
            row.update(
                where=why,
                passed=row["status"] == "ok" and row.get("matches_reference") is True,
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


def _wrap(mode: str, model, cfg, *, bf16: bool = True):
    """(module to call, what a step does after backward, context for forward and backward) for
    ``mode``."""
    import torch

    from labs.experiments.zero import RunSpec, wrap_for_zero
    from labs.runtime.device import ddp_device_ids, rank_device

    mp_policy = None
    if bf16 and mode == "torch-fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    from labs.runtime.impl import exercise
    from labs.train import make_optimizer

    nothing = contextlib.nullcontext
    if mode in ("zero3", "torch-fsdp2"):  # as the ZeRO lab runs them
        spec = RunSpec(stage=3, torch_impl="fsdp2" if mode == "torch-fsdp2" else None)
        # FSDP2's own bf16 mixed precision, like ours under autocast: bf16 compute, fp32 master
        # weights and fp32 gradient reduction. Ours: fully_shard per unit, the root, then AdamW.
        module, optimizer = wrap_for_zero(model, spec, cfg, mp_policy=mp_policy)
        return module, lambda: (optimizer.step(), optimizer.zero_grad()), nothing
    ctx = nothing
    if mode == "ddp":
        model = exercise("ddp").BucketedDDP(model, bucket_mb=25.0)
    elif mode == "tp":
        model = exercise("tensor_parallel").apply_tensor_parallel(model)
    elif mode == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=ddp_device_ids(rank_device()), bucket_cap_mb=25
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
    wrapped, finish_step, ctx = _wrap(run.mode, model, TrainConfig(lr=1e-4), bf16=run.bf16)
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
    from labs.bench.report import fmt
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
def check_verdict(report: dict) -> tuple[bool, str]:
    """(passed, one line saying so): every lab this machine can run matched its reference, and
    every throughput run and notebook ran and passed. "skipped", "invalid" and "failed" are
    failures; a configuration "not exercised" (more ranks than GPUs) is listed, never passed."""
    labs = report["labs"]
    trows = report["throughput"]["rows"]
    nb_rows = report["notebooks"]
    not_run = [
        f"{r['lab']} {r.get('config', '')}".strip() for r in labs if r["status"] == "not exercised"
    ]
    ok = (
        all(r.get("passed") or r["status"] == "not exercised" for r in labs)
        and all(r["status"] == "ok" for r in trows)
        and all(r["status"] == "passed" for r in nb_rows)
    )
    passed = sum(bool(r.get("passed")) for r in labs)
    failed = [
        f"{r['lab']} {r.get('config', '')} ({r['status']})".replace("  ", " ")
        for r in labs
        if not r.get("passed") and r["status"] != "not exercised"
    ]
    failed += [f"throughput {r['mode']} ({r['status']})" for r in trows if r["status"] != "ok"]
    failed += [f"{r['notebook']} ({r['status']})" for r in nb_rows if r["status"] != "passed"]
    text = f"{'PASSED' if ok else 'FAILED'}: {passed} lab configuration(s) matched"
    if failed:
        text += f"; not passed: {', '.join(failed)}"
    if not_run:
        text += f"; not exercised on this machine: {', '.join(not_run)}"
    return ok, text


def markdown(report: dict) -> str:
    from labs.bench.report import fmt, name

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
        f"Verdict: {check_verdict(report)[1]}.",
        "",
        "## Where the labs ran",
        "",
    ]
    lines += [
        f"- {lab}: {nproc} rank(s) on {backend}: {why}"
        for lab, nproc, backend, why in report["plan"]
    ]
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
            else f"✗ {r['status']}: {r['note'][:80]}"
            if r["status"] != "not exercised"
            else f"not exercised: {r['note'][:80]}"
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
    from labs.experiments.spec import command_labs

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
        "--labs", nargs="+", choices=sorted(command_labs()), default=None, help="default: every lab"
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks per lab (default: each lab's own; with GPUs, at most one per GPU)",
    )
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

    from labs.bench.report import hardware
    from labs.experiments.spec import command_labs
    from labs.runtime.impl import set_implementation

    set_implementation("solutions")  # the course's own answers: ranks inherit the switch
    names = gpu_names()
    on_gpus = bool(names) and args.backend != "gloo"
    peak, gpu_gib, source = gpu_spec(names if on_gpus else [], args.peak_tflops)
    labs = args.labs or list(command_labs())
    plans = {lab: lab_plan(args.ranks or lab_ranks(lab), len(names), args.backend) for lab in labs}
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
    for lab, (nproc, backend, why) in plans.items():
        log(f"{lab} runs at {nproc} rank(s) on {backend}: {why}")
    phase_s = {}

    log("\n[labs] every lab against its single-process reference")
    t0 = time.monotonic()
    labs_rows = check_labs(
        labs,
        plans,
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
    # the memory nvidia-smi reports, else the data sheet's, else a cautious 40 GiB
    gpu_gib = None if args.tiny or not on_gpus else gpu_memory_gib() or gpu_gib or 40.0
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
        "plan": [[lab, *plan] for lab, plan in plans.items()],
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
    ok, verdict = check_verdict(report)
    log(f"wrote {out / 'gpu_check.md'} and gpu_check.json: {verdict} in {report['wall_s']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
