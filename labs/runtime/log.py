"""One logging helper for every rank: prefixes the rank, prints on rank 0 unless asked."""

from __future__ import annotations

import sys
from typing import TextIO

import torch.distributed as dist


def log(*parts: object, all_ranks: bool = False, file: TextIO | None = None) -> None:
    """``print`` with a ``[rank r]`` prefix; only rank 0 prints unless ``all_ranks``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0 and not all_ranks:
        return
    prefix = f"[rank {rank}]" if dist.is_initialized() else "[main]"
    print(prefix, *parts, file=file or sys.stdout, flush=True)
