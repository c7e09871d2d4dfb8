"""Which implementation of the exercises runs: the learner's (``labs``) or the reference
(``solutions``).

One switch, the environment variable ``LABS_IMPL``:

    LABS_IMPL=labs        # default: your code in labs/<exercise>.py
    LABS_IMPL=solutions   # the reference code in solutions/<exercise>.py (CI, instructors)

Launched ranks inherit the environment, so every rank runs the same implementation.
``python -m labs.run --impl ...`` and the test suite set it for you.

``EXERCISES`` (every exercise, in the order the notebooks teach them) and ``builds_on(name)``
(the earlier exercises one needs) come from the labs' declarations
(``labs.experiments.spec``); reading them imports every lab module once.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

IMPL_ENV = "LABS_IMPL"
IMPLEMENTATIONS = ("labs", "solutions")


def __getattr__(name: str):
    if name == "EXERCISES":  # built from the labs' declarations on first use (no import cycle)
        from labs.experiments.spec import exercises

        return exercises()
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


def exercise(name: str) -> ModuleType:
    """The exercise module ``name`` from the selected implementation, e.g. ``exercise("ddp")``.
    An exercise is a plain module directly in the package (the learner's folder holds nothing
    else); anything else is refused, naming the exercises."""
    module = f"{implementation()}.{name}"
    if name.isidentifier() and not name.startswith("_"):
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # the exercise exists and imports something missing
                raise
        else:
            if not hasattr(found, "__path__"):  # a package is the course's own code
                return found
    raise ValueError(f"unknown exercise {name!r}; choose from {__getattr__('EXERCISES')}")
