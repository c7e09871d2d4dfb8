"""Which implementation of the exercises runs: the learner's (``labs``) or the reference
(``solutions``), for all of them or one exercise at a time.

Two switches, both environment variables, so every launched rank (torchrun's included) inherits
them:

    LABS_IMPL=labs                 # default: your code in labs/<exercise>.py
    LABS_IMPL=solutions            # the reference for every exercise (CI, instructors)
    LABS_REFERENCE=pipeline_parallel,zero
                                   # the reference for these exercises alone, your code for the
                                   # rest: stuck on one lab, you can still run the ones after it

``python -m labs.run`` and ``python -m labs.check`` take ``--impl`` and ``--reference`` and set
them for you. In a student release ``solutions/`` holds only the references the instructor
revealed (``python -m labs.release OUT --reveal EX``); asking for another one says so.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from types import ModuleType

IMPL_ENV = "LABS_IMPL"
REFERENCE_ENV = "LABS_REFERENCE"
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


def parse_exercises(names: str | Iterable[str], *, what: str = REFERENCE_ENV) -> tuple[str, ...]:
    """``"zero,pipeline_parallel"`` (or a list) as exercise names, checked: an unknown name is a
    ``ValueError`` naming ``what`` and the valid names."""
    if isinstance(names, str):
        names = names.split(",")
    out = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in out if n not in EXERCISES]
    if unknown:
        raise ValueError(
            f"{what}: unknown exercise {', '.join(map(repr, unknown))}; choose from"
            f" {', '.join(EXERCISES)}"
        )
    return out


def reference_exercises() -> tuple[str, ...]:
    """The exercises ``LABS_REFERENCE`` runs from the reference, whatever ``LABS_IMPL`` says."""
    return parse_exercises(os.environ.get(REFERENCE_ENV, ""))


def set_reference(names: str | Iterable[str]) -> tuple[str, ...]:
    """Run the reference for ``names`` (and the selected implementation for the rest) in this
    process and every rank it launches from now on; returns the names."""
    chosen = parse_exercises(names, what="reference")
    if chosen:
        os.environ[REFERENCE_ENV] = ",".join(chosen)
    else:
        os.environ.pop(REFERENCE_ENV, None)
    return chosen


def source_of(name: str) -> str:
    """The package exercise ``name`` is imported from: "solutions" when the reference stands in
    for it (``LABS_REFERENCE``, or ``LABS_IMPL=solutions``), else "labs"."""
    return "solutions" if name in reference_exercises() else implementation()


class ReferenceUnavailable(ImportError):
    """The reference for an exercise was asked for and this copy of the course does not have it
    (a student release ships only the references its instructor revealed)."""


def exercise(name: str) -> ModuleType:
    """The exercise module ``name`` from the selected implementation, e.g. ``exercise("ddp")``:
    the reference where ``LABS_REFERENCE`` names it, else as ``LABS_IMPL`` says."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; choose from {EXERCISES}")
    package = source_of(name)
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if package != "solutions" or e.name not in ("solutions", f"solutions.{name}"):
            raise
        raise ReferenceUnavailable(
            f"the reference for exercise {name!r} is not in this copy of the course: a student"
            f" release holds only the solutions its instructor revealed. Write labs/{name}.py"
            f" (python -m labs.check {name} tells you what is missing), or ask your instructor"
            f" to reveal it (python -m labs.release OUT --reveal {name})."
        ) from None
