"""Launcher, backend and device choice, the implementation switch, logging; and, for the grader,
what a rank must not reach in the process that launched it (``protect_from_ranks``,
``keep_from_ranks``: ``labs.runtime.isolation``)."""

from labs.runtime.device import (
    ddp_device_ids,
    environment_report,
    local_rank,
    one_thread,
    rank_device,
    synchronize,
)
from labs.runtime.errors import LaunchTimeout, RankDied, RankError
from labs.runtime.impl import exercise, implementation, set_implementation
from labs.runtime.isolation import keep_from_ranks, protect_from_ranks
from labs.runtime.launcher import choose_backend, launch, report_progress, under_torchrun
from labs.runtime.log import log

__all__ = [
    "LaunchTimeout",
    "RankDied",
    "RankError",
    "choose_backend",
    "ddp_device_ids",
    "environment_report",
    "exercise",
    "implementation",
    "keep_from_ranks",
    "launch",
    "local_rank",
    "log",
    "one_thread",
    "protect_from_ranks",
    "rank_device",
    "report_progress",
    "set_implementation",
    "synchronize",
    "under_torchrun",
]
