"""Launcher, backend and device choice, the implementation switch, logging; and, for the grader,
what a rank must not reach in the process that launched it (``protect_from_ranks``,
``keep_from_ranks``: ``labs.runtime.isolation``).

Names are imported on first use, so that a command that needs only the implementation switch
(``labs.check``'s and ``labs.release``'s own process, ``labs.stubs``) starts without torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ddp_device_ids": "labs.runtime.device",
    "environment_report": "labs.runtime.device",
    "local_rank": "labs.runtime.device",
    "one_thread": "labs.runtime.device",
    "rank_device": "labs.runtime.device",
    "synchronize": "labs.runtime.device",
    "LaunchTimeout": "labs.runtime.errors",
    "RankDied": "labs.runtime.errors",
    "RankError": "labs.runtime.errors",
    "exercise": "labs.runtime.impl",
    "implementation": "labs.runtime.impl",
    "set_implementation": "labs.runtime.impl",
    "keep_from_ranks": "labs.runtime.isolation",
    "protect_from_ranks": "labs.runtime.isolation",
    "choose_backend": "labs.runtime.launcher",
    "launch": "labs.runtime.launcher",
    "report_progress": "labs.runtime.launcher",
    "under_torchrun": "labs.runtime.launcher",
    "log": "labs.runtime.log",  # the function: on first use it replaces the submodule's name
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'labs.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
