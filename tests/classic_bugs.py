"""Instructor-only: the classic mistakes of every lab, each a small edit of the solution, and the
check that must catch it with the hint that must name its cause (``tests/test_classic_bugs.py``
plants each one and runs the lab). It shows solution lines, so the student release leaves it out
(``labs.release.INSTRUCTOR_TESTS``).

    Bug(id, module, old, new, check, hint, options)

``module`` is the module the edit applies to (a solution, or for notebook 01, which has no
exercise module, the lab's own measurement code); ``old`` must occur exactly once in it; ``check``
is the name of a check that must FAIL and ``hint`` a substring of that check's hint. ``options``
are passed to the lab's ``run`` on top of ``RUNS[lab]`` (small runs: 2 ranks, 2 steps).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple


class Bug(NamedTuple):
    id: str
    module: str
    old: str
    new: str
    check: str
    hint: str
    options: dict = {}


# Each lab's run for the catalog: small and quick (about a second each on 2 cores).
RUNS = {
    "collectives": dict(nproc=2, steps=1, numel=1200),  # N = 2, 3, 4 divide it
}

CATALOG: dict[str, list[Bug]] = {
    "collectives": [
        Bug(
            "reduce-scatter overwrites instead of adding",
            "solutions.collectives",
            "chunks[recv_idx] += incoming",
            "chunks[recv_idx].copy_(incoming)",
            "coded integers: every rank, once, in place",
            "must add each received chunk",
        ),
        Bug(
            "reduce-scatter sends the chunk it is about to receive",
            "solutions.collectives",
            "send_idx = (me - s) % n",
            "send_idx = (me - s - 1) % n",
            "chunk sent in each round",
            "check the (r - s) mod N index",
        ),
        Bug(
            "reduce-scatter walks the ring the wrong way (right on 2 ranks only)",
            "solutions.collectives",
            "send_idx = (me - s) % n\n        recv_idx = (me - s - 1) % n",
            "send_idx = (me + s) % n\n        recv_idx = (me + s - 1) % n",
            "chunk sent in each round",
            "check the (r - s) mod N index",
            dict(nproc=3),
        ),
        Bug(
            "all-gather sends the unreduced chunk",
            "solutions.collectives",
            "send_idx = (me + 1 - s) % n",
            "send_idx = (me - s) % n",
            "chunk sent in each round",
            "check the (r + 1 - s) mod N index",
        ),
        Bug(
            "all-gather stores the received chunk one index off",
            "solutions.collectives",
            "recv_idx = (me - s) % n\n        incoming = torch.empty_like(chunks[recv_idx])\n"
            "        exchange(chunks[send_idx].contiguous(), incoming, ring.next, ring.prev, group)\n"
            "        chunks[recv_idx].copy_(incoming)",
            "recv_idx = (me - s - 1) % n\n        incoming = torch.empty_like(chunks[recv_idx])\n"
            "        exchange(chunks[send_idx].contiguous(), incoming, ring.next, ring.prev, group)\n"
            "        chunks[recv_idx].copy_(incoming)",
            "coded integers: every rank, once, in place",
            "stored at another index",
        ),
        Bug(
            "all-gather adds instead of copying",
            "solutions.collectives",
            "chunks[recv_idx].copy_(incoming)",
            "chunks[recv_idx] += incoming",
            "coded integers: every rank, once, in place",
            "added twice",
        ),
        Bug(
            "reduce-scatter one round short",
            "solutions.collectives",
            "    for s in range(n - 1):\n        send_idx = (me - s) % n",
            "    for s in range(n - 2):\n        send_idx = (me - s) % n",
            "bytes per send",
            "count the rounds of each loop",
        ),
    ],
}


def all_bugs() -> list[tuple[str, Bug]]:
    """(lab, bug) for every bug of the catalog."""
    return [(lab, bug) for lab, bugs in CATALOG.items() for bug in bugs]


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"no module {module!r}")
    return Path(spec.origin)


def edited_source(bug: Bug) -> str:
    """The module's source with the bug planted; ValueError unless ``old`` occurs exactly once."""
    source = _origin(bug.module).read_text()
    if source.count(bug.old) != 1:
        raise ValueError(
            f"{bug.id}: the text to replace occurs {source.count(bug.old)} times in {bug.module}"
        )
    return source.replace(bug.old, bug.new)


def _ours(name: str, bug: Bug) -> bool:
    return name == bug.module or name.startswith("solutions.")


def _set_child(name: str, module: types.ModuleType | None) -> None:
    """Make ``module`` (None: nothing) the attribute ``name``'s package holds for it."""
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is None:
        return
    if module is None:
        if hasattr(parent, child):
            delattr(parent, child)
    else:
        setattr(parent, child, module)


@contextmanager
def planted(bug: Bug) -> Iterator[types.ModuleType]:
    """``bug.module`` replaced in ``sys.modules`` by its edited source for the duration (ranks
    forked meanwhile inherit it). The other ``solutions`` modules are imported afresh inside, so
    those that import from the planted one (``from .tensor_parallel_comm import ...``) see it;
    everything is restored afterwards."""
    source = edited_source(bug)
    parent_name = bug.module.rpartition(".")[0]
    importlib.import_module(parent_name)
    saved = {name: mod for name, mod in sys.modules.items() if _ours(name, bug)}
    for name in saved:
        del sys.modules[name]
    module = types.ModuleType(bug.module)
    module.__file__ = str(_origin(bug.module))
    module.__package__ = parent_name
    sys.modules[bug.module] = module
    _set_child(bug.module, module)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        yield module
    finally:
        for name in [n for n in sys.modules if _ours(n, bug)]:
            del sys.modules[name]
            _set_child(name, None)
        sys.modules.update(saved)
        for name, mod in saved.items():
            _set_child(name, mod)
