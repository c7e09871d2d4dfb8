"""The device a rank computes on, and a report of what this machine offers."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """``cuda:<local rank>`` when the process group runs NCCL, else ``cpu``."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


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
    from labs.runtime.launcher import choose_backend

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
