"""The device a rank computes on, the numerics it computes with, and what this machine offers.

device = rank_device()        # cuda:<LOCAL_RANK> under NCCL, else cpu
local_rank()                  # this process's GPU on its node (LOCAL_RANK)
DistributedDataParallel(model, device_ids=ddp_device_ids(device))
exact_fp32()                  # TF32 off: fp32 matmuls and convolutions in full fp32
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from labs.runtime import audit

BACKENDS = ("auto", "gloo", "nccl")
# Count GPUs through NVML, not the CUDA runtime: a CUDA call in this process would make every
# forked rank's CUDA fail ("initialization error"). torch reads this at each device_count() call.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def choose_backend(nprocs: int, backend: str = "auto") -> str:
    """'nccl' when asked for or when this machine has a GPU per rank of a launch of ``nprocs``
    ranks on it, else 'gloo'. Validates the choice. (A torchrun job spans nodes: its ranks do not
    ask this, see ``labs.runtime.launcher``.)"""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nprocs:
        # with no GPU at all, fewer ranks cannot help: only gloo runs
        fix = f"use nprocs<={gpus} or backend='gloo'" if gpus else "use backend='gloo' or 'auto'"
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: nprocs={nprocs} but {gpus} GPU(s) visible;"
            f" {fix}"
        )
    if backend == "auto":
        return "nccl" if gpus >= nprocs and dist.is_nccl_available() else "gloo"
    return backend


def local_rank() -> int:
    """This process's index among the ranks of its node, which is its GPU's index: LOCAL_RANK,
    set by ``launch`` and by torchrun (0 when neither started this process). The one place the
    course reads it: a rank's global rank is not its GPU once a job spans several nodes."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device() -> torch.device:
    """``cuda:<local rank>`` when the process group runs NCCL, else ``cpu``. Under the device
    audit (``labs.runtime.audit``), its stand-in for the GPU, ``cpu:<local rank>``."""
    stand_in = audit.stand_in()
    if stand_in is not None:
        return stand_in
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def ddp_device_ids(device: torch.device | None = None) -> list[int] | None:
    """``device_ids`` for torch's ``DistributedDataParallel``: ``[index]`` of this rank's GPU
    (``device``, default ``rank_device()``), None on the CPU. The audit checks it on its
    stand-in."""
    device = device or rank_device()
    if device.type == "cuda" or device == audit.stand_in():
        return [device.index]
    return None


def exact_fp32() -> None:
    """Turn TF32 off for fp32 matmuls (cuBLAS) and convolutions (cuDNN), in this process.

    On Ampere and newer GPUs TF32 rounds a matmul's inputs to 10 mantissa bits (~5e-4
    relative), and cuDNN uses it for convolutions by default: a parallel run and its reference
    would then differ by far more than the course's 1e-5. Every rank calls this at start, and so
    does the single-process reference. A no-op on a machine without CUDA."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def deterministic_algorithms() -> None:
    """On a GPU rank, make every kernel that torch can make deterministic so: a rerun, or another
    rank computing the same thing, gets the same bits (the table's rules with ``deterministic``
    in ``labs.train``). cuDNN picks deterministic convolutions, the embedding and index backwards
    stop adding with atomics, and cuBLAS keeps a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``,
    read when this process first uses cuBLAS, so call this before the first matmul). An op torch
    has no deterministic version of only warns. A no-op off the GPU: the CPU's kernels are."""
    if rank_device().type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def synchronize(device: torch.device | None = None) -> None:
    """Wait for queued GPU work before reading a clock; nothing to wait for on CPU."""
    device = device or rank_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one intra-op thread, as every launched rank does. The course's tiny
    single-process references gain nothing from more threads, and while ranks run on a busy
    2-core machine, torch's spinning OpenMP workers make a reference step 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi ([] without it): asking torch would initialise CUDA here, and ranks
    could no longer be forked."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def environment_report() -> dict[str, object]:
    """What the course will run on here: versions, cores, GPUs and the backend ``launch`` picks."""
    from labs.runtime.impl import implementation

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "gpus": gpus,
        "gpu_names": (gpu_names() or ["(nvidia-smi not found)"]) if gpus else [],
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "backend_for_4_ranks": choose_backend(4),
        "implementation": implementation(),
    }
