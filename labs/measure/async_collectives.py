"""Async collectives on one rank: launched, waited on, and overlapped with a matmul or not.

    with AsyncCollectives() as log:
        loss.backward()
    log.summary()   # [{"op": "all_reduce", "waited": True, "matmuls_in_flight": 3}, ...]

An overlapped collective is launched with ``async_op=True``, computes something while it is in
flight, and is waited on (``work.wait()``) before its result is used. Two of the three are
invisible to a correctness check: a collective never waited on usually finishes in time anyway
on a small run, and one waited on straight away gives the right numbers, just later. This log
sees both. While active it records:

* each call of a collective below that returns a work (``async_op=True``), with the number of
  matrix products (``aten.mm``, ``addmm``, ``bmm``, ``baddbmm``) this process had run so far;
* each ``Work.wait()``, with that number again.

A collective's ``matmuls_in_flight`` is the number of matrix products run between its launch and
its wait (None when it was never waited on). The matrix products are counted by a
``TorchDispatchMode``, which autograd carries into the backward pass, on any device; the
collectives by wrapping ``torch.distributed``'s functions as ``labs.measure.ledger`` does (both
can be active together).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

# The collectives whose async launch is recorded (torch 2.13 names both spellings).
ASYNC_OPS = (
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather_single",
    "all_gather_into_tensor",
)
# The aten operators counted as matrix products.
MATMULS = ("mm", "addmm", "bmm", "baddbmm")


@dataclasses.dataclass
class AsyncCollective:
    """One collective launched with ``async_op=True``."""

    op: str  # e.g. "all_reduce"
    work: Any  # its ``dist.Work``
    launched_at: int  # matrix products run before the launch
    waited_at: int | None = None  # ... before the first wait; None: never waited on

    @property
    def matmuls_in_flight(self) -> int | None:
        return None if self.waited_at is None else self.waited_at - self.launched_at


class AsyncCollectives(TorchDispatchMode):
    """Records the async collectives this rank launches while active (one log at a time)."""

    def __init__(self):
        super().__init__()
        self.collectives: list[AsyncCollective] = []
        self.matmuls = 0
        self._originals: dict[tuple[Any, str], Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.matmuls += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> AsyncCollectives:
        for op in ASYNC_OPS:
            launched = self._launch(op, getattr(dist, op))
            for module in (dist, c10d):
                self._originals[(module, op)] = getattr(module, op)
                setattr(module, op, launched)
        self._originals[(dist.Work, "wait")] = dist.Work.wait
        dist.Work.wait = self._wait(dist.Work.wait)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()

    def _launch(self, op: str, original):
        log = self

        def launch(*args, **kwargs):
            work = original(*args, **kwargs)
            # async_op=True; once (the deprecated *_tensor names call the *_single ones)
            if work is not None and not any(c.work is work for c in log.collectives):
                log.collectives.append(AsyncCollective(op, work, log.matmuls))
            return work

        launch.__wrapped__ = original
        return launch

    def _wait(self, original):
        log = self

        def wait(work, *args, **kwargs):
            for c in log.collectives:
                if c.work is work and c.waited_at is None:
                    c.waited_at = log.matmuls
            return original(work, *args, **kwargs)

        return wait

    def summary(self) -> list[dict]:
        """Per async collective, in launch order: ``op``, ``waited`` and ``matmuls_in_flight``."""
        return [
            {
                "op": c.op,
                "waited": c.waited_at is not None,
                "matmuls_in_flight": c.matmuls_in_flight,
            }
            for c in self.collectives
        ]
