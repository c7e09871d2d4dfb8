"""Instructor-only: the ZeRO lab's classic mistakes, each a small edit of ``solutions/zero.py``, the
check that must catch it and a substring of the hint that must name its cause
(``tests/test_classic_bugs_zero.py`` plants each and runs the lab). The same shape as the other
labs' catalog (``tests/classic_bugs.py``), to be merged into it:

    Bug(id, module, old, new, check, hint, options)

``old`` must occur exactly once in ``module``; ``options`` are passed to ``labs.experiments.zero.
run`` on top of ``RUNS["zero"]`` (2 ranks, 2 steps: a few seconds each).
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


RUNS = {"zero": dict(nproc=2, steps=2)}
MODULE = "solutions.zero"

CATALOG: dict[str, list[Bug]] = {
    "zero": [
        Bug(
            "ZeRO-1 reduce-scatter without the division by N",
            MODULE,
            "                u.full_grad[u.lo : u.hi].div_(self.world)\n",
            "",
            "gradients after step 1",
            "did you divide the sum by the world size?",
            dict(stage=1),
        ),
        Bug(
            "ZeRO-3 reduce-scatter without the division by N",
            MODULE,
            "        u.grad_shard.div_(self.world)\n",
            "",
            "gradients after step 1",
            "did you divide the sum by the world size?",
            dict(stage=3),
        ),
        Bug(
            "all-gather of the wrong shard (offset 0 instead of this rank's)",
            MODULE,
            "dist.all_gather_single(u.full, u.full[u.lo : u.hi], group=self.group)",
            "dist.all_gather_single(u.full, u.full[: u.shard], group=self.group)",
            "parameters after step 1",
            "each rank must send its own slice",
            dict(stage=2),
        ),
        Bug(
            "the optimizer steps the whole parameters instead of the shard",
            MODULE,
            '"params": [t]}\n            for g, t in zip(groups, targets)',
            '"params": g["params"]}\n            for g, t in zip(groups, targets)',
            "state held per rank",
            "does it step the whole parameters rather than this rank's shard",
            dict(stage=1),
        ),
        Bug(
            "ZeRO-3 forgets to gather a unit again before its backward",
            MODULE,
            "        self.gather(k)\n        if self.prefetch and k > 0:",
            "        if self.prefetch and k > 0:",
            "run completes",
            "is not gathered after pre_backward",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-3 never frees a unit after its forward",
            MODULE,
            "        self.release(k)\n        ### END SOLUTION\n\n    def pre_backward",
            "        pass\n        ### END SOLUTION\n\n    def pre_backward",
            "peak parameter bytes",
            "is each unit released after its forward",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-3 uses a prefetched unit before its all-gather finished",
            MODULE,
            "        if not async_op and k in self.inflight:\n"
            "            self.inflight.pop(k).wait()\n",
            "",
            "run completes",
            "its all-gather is still in flight",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-2 keeps the whole gradients after the reduce-scatter",
            MODULE,
            "        u.shard_grad.add_(part.div_(self.world))\n        for p in u.params:\n"
            "            p.grad = None\n",
            "        u.shard_grad.add_(part.div_(self.world))\n",
            "state held per rank",
            "are the whole gradients freed",
            dict(stage=2),
        ),
        Bug(
            "flat buffers not padded to a multiple of N",
            MODULE,
            "        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)",
            "        flat = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)",
            "run completes",
            "check flatten's padding",
            dict(stage=1, model="awkward"),
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


@contextmanager
def planted(bug: Bug) -> Iterator[types.ModuleType]:
    """``bug.module`` replaced in ``sys.modules`` (and on its package) by its edited source for the
    duration: ranks forked meanwhile inherit it. Restored afterwards."""
    source = edited_source(bug)
    package_name, _, child = bug.module.rpartition(".")
    package = importlib.import_module(package_name)
    saved = sys.modules.get(bug.module)
    module = types.ModuleType(bug.module)
    module.__file__ = str(_origin(bug.module))
    module.__package__ = package_name
    sys.modules[bug.module] = module
    setattr(package, child, module)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        yield module
    finally:
        if saved is None:
            sys.modules.pop(bug.module, None)
            delattr(package, child)
        else:
            sys.modules[bug.module] = saved
            setattr(package, child, saved)
