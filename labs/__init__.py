"""LLM Parallelism Labs: the package every notebook imports.

    from labs import launch, exercise

Runtime and measurement (``labs.runtime``, ``labs.models``, ``labs.data``, ``labs.measure``,
``labs.theory``, ``labs.widgets``, ``labs.experiments``) are complete code. The exercise
modules (``labs.ddp``, ``labs.zero``, ...) are yours to fill in; ``exercise(name)`` returns
the one the ``LABS_IMPL`` switch selects (see ``labs.runtime.impl``). A notebook that runs earlier
exercises shows their state with ``prerequisites(lab)``, and ``use_reference(exercise)`` runs the
reference of one of them (``labs.runtime.prerequisites``).

Attributes are imported lazily so that ``python -m labs.theory`` runs without torch.
"""

_LAZY = {
    "launch": "labs.runtime",
    "RankError": "labs.runtime",
    "LaunchTimeout": "labs.runtime",
    "exercise": "labs.runtime",
    "log": "labs.runtime",
    "prerequisites": "labs.runtime.prerequisites",
    "exercise_status": "labs.runtime.prerequisites",
    "use_reference": "labs.runtime.prerequisites",
    "use_own": "labs.runtime.prerequisites",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'labs' has no attribute {name!r}")
