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

``EXERCISES`` (every exercise, in the order the notebooks teach them) and ``builds_on(name)``
(the earlier exercises one needs) come from the labs' declarations (``labs.experiments.spec``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from types import ModuleType

IMPL_ENV = "LABS_IMPL"
REFERENCE_ENV = "LABS_REFERENCE"
IMPLEMENTATIONS = ("labs", "solutions")


def _exercises() -> tuple[str, ...]:
    """Every exercise, from the labs' declarations (read on first use: no import cycle)."""
    from labs.experiments.spec import exercises

    return exercises()


def __getattr__(name: str):
    if name == "EXERCISES":
        return _exercises()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def builds_on(name: str) -> tuple[str, ...]:
    """The earlier exercises exercise ``name`` needs (its lab's runs call them, or its notebook
    teaches them first), e.g. ``builds_on("mesh")``: zero, tensor_parallel, pipeline_parallel,
    context_parallel."""
    from labs.experiments.spec import builds_on as declared

    return declared(name)


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
    unknown = [n for n in out if n not in _exercises()]
    if unknown:
        raise ValueError(
            f"{what}: unknown exercise {', '.join(map(repr, unknown))}; choose from"
            f" {', '.join(_exercises())}"
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
    the reference where ``LABS_REFERENCE`` names it, else as ``LABS_IMPL`` says. An exercise is a
    plain module directly in the package (the learner's folder holds nothing else); anything else
    is refused, naming the exercises."""
    package = source_of(name)
    module = f"{package}.{name}"
    if name.isidentifier() and not name.startswith("_"):
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if package == "solutions" and e.name in ("solutions", module) and name in _exercises():
                raise ReferenceUnavailable(
                    f"the reference for exercise {name!r} is not in this copy of the course: a"
                    " student release holds only the solutions its instructor revealed. Write"
                    f" labs/{name}.py (python -m labs.check {name} tells you what is missing), or"
                    f" ask your instructor to reveal it (python -m labs.release OUT --reveal"
                    f" {name})."
                ) from None
            if e.name != module:  # the exercise exists and imports something missing
                raise
        else:
            if not hasattr(found, "__path__"):  # a package is the course's own code
                return found
    raise ValueError(f"unknown exercise {name!r}; choose from {_exercises()}")
