"""Which implementation of the exercises runs: the learner's (``labs``) or the reference
(``solutions``).

One switch, the environment variable ``LABS_IMPL``:

    LABS_IMPL=labs        # default: your code in labs/<exercise>.py
    LABS_IMPL=solutions   # the reference code in solutions/<exercise>.py (CI, instructors)

Launched ranks inherit the environment, so every rank runs the same implementation.
``python -m labs.run --impl ...`` and the test suite set it for you.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

IMPL_ENV = "LABS_IMPL"
IMPLEMENTATIONS = ("labs", "solutions")
EXERCISES = (
    "collectives",
    "activations",  # notebook 01: bytes of training state and saved activations, measured
    "ddp",
    "zero",
    "tensor_parallel",
    "tensor_parallel_comm",  # notebook 04's communication operators (part 1 of its lab)
    "pipeline_parallel",
    "context_parallel",
    "expert_parallel",
    "mesh",
    "inference",
    "multimodal",
    "diagnosis",  # notebook 10: which rank to suspect, from the launcher's report
)


def implementation() -> str:
    """The package the exercises are imported from, as the switch says."""
    impl = os.environ.get(IMPL_ENV, "labs")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not one of {IMPLEMENTATIONS}")
    return impl


def set_implementation(impl: str) -> None:
    """Select the implementation for this process and every rank it launches from now on."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    os.environ[IMPL_ENV] = impl


def exercise(name: str) -> ModuleType:
    """The exercise module ``name`` from the selected implementation, e.g. ``exercise("ddp")``."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; choose from {EXERCISES}")
    return importlib.import_module(f"{implementation()}.{name}")
