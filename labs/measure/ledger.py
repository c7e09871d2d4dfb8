"""Communication ledger: every collective a rank issues, with its kind and its bytes.

    with CommLedger() as ledger:
        train_step()
    ledger.sent_bytes()                  # bytes this rank put on the wire, ring model
    ledger.calls("all_reduce")           # how many all-reduces
    ledger.summary()                     # {op: {"calls", "payload_bytes", "sent_bytes"}}
    ledger.calls_by_op()                 # {op: [bytes sent by call 1, call 2, ...]}

While the ``with`` block runs, the ``torch.distributed`` functions below are wrapped,
so lab code keeps calling plain ``dist.all_reduce(...)``. Each call records:

* ``payload_bytes``: the size of the tensor handed to the collective (``numel * itemsize``),
  the ``K`` of the formulas;
* ``sent_bytes``: what this rank sends under the textbook algorithm for that collective,
  from the group size ``N`` (the same expressions as ``labs.theory.comm``):

  =====================  ===========================================  ===============
  op                     sent per rank                                K is
  =====================  ===========================================  ===============
  all_reduce             2 (N-1)/N K (ring: reduce-scatter, gather)   the tensor
  reduce_scatter_single  (N-1)/N K                                    the full input
  all_gather_single      (N-1)/N K                                    the full output
  broadcast, reduce      (N-1)/N K (pipelined chain, averaged)        the tensor
  all_to_all_single      bytes of the rows leaving for other ranks    exact
  send / isend           K                                            exact
  =====================  ===========================================  ===============

For point-to-point and all-to-all the figure is exact; for the others it is the
algorithm's cost, what the course's theory predicts. Our hand-written collectives are
built from send/recv, so for them the ledger's figure is a true count of bytes sent.

Not seen: collectives issued inside torch's own C++ (DDP's reducer, FSDP2, DTensor's
functional collectives). ``torch.distributed.tensor.debug.CommDebugMode`` counts those
calls (not their bytes); the tests use it to cross-check this ledger's counts.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# The wrapped functions. Wrapping them both in ``torch.distributed`` and in
# ``distributed_c10d`` keeps ``P2POp(dist.isend, ...)`` valid (it compares with c10d's names).
# (torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single; both are
# recorded.)
RECORDED_OPS = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "send",
    "isend",
    "recv",
    "irecv",
    "batch_isend_irecv",
)


_RECEIVES = ("recv", "irecv")


@dataclass(frozen=True)
class CommRecord:
    """One collective on one rank."""

    op: str  # e.g. "all_reduce"
    group_size: int  # N
    payload_bytes: int  # K: the tensor handed to the call
    sent_bytes: float  # bytes this rank sends (algorithm model, see module docstring)
    recv_bytes: float  # bytes this rank receives (point-to-point and all-to-all: exact)
    phase: str  # the label of the enclosing ``ledger.phase(...)`` block


class GroupBytes(NamedTuple):
    """Bytes this rank sent on one process group."""

    group: dist.ProcessGroup | None  # None: the default group
    sent_bytes: float


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def ring_fraction(n: int) -> float:
    """(N-1)/N: the share of a tensor each rank sends in a ring all-gather or reduce-scatter."""
    return (n - 1) / n


class CommLedger:
    """Records the collectives this rank issues while active. One ledger at a time per process."""

    _active: CommLedger | None = None

    def __init__(self, *, keep_sent: bool = False):
        """``keep_sent``: also keep a CPU copy of what every send carries, in ``sent_tensors``
        (in call order), so a check can tell *which* data travelled, not only how many bytes."""
        self.records: list[CommRecord] = []
        self.keep_sent = keep_sent
        self.sent_tensors: list[torch.Tensor] = []
        # the ProcessGroup of each record (None: the default group), in-process only
        self.groups: list[dist.ProcessGroup | None] = []
        self._phase = ""
        self._originals: dict[tuple[object, str], object] = {}
        self._depth = threading.local()  # nested calls (batch_isend_irecv -> isend) count once

    # --- context management -------------------------------------------------
    def __enter__(self) -> CommLedger:
        if CommLedger._active is not None:
            raise RuntimeError(
                "a CommLedger is already recording in this process; nest phases instead"
            )
        CommLedger._active = self
        for op in RECORDED_OPS:
            wrapper = self._wrap(op, getattr(c10d, op))  # one wrapper object, set in both modules
            for module in (dist, c10d):
                self._originals[(module, op)] = getattr(module, op)
                setattr(module, op, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for (module, op), original in self._originals.items():
            setattr(module, op, original)
        self._originals.clear()
        CommLedger._active = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the collectives issued inside the block, e.g. ``ledger.phase("backward")``."""
        previous = self._phase
        self._phase = name
        try:
            yield
        finally:
            self._phase = previous

    # --- queries ----------------------------------------------------------------
    def calls(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self._select(op, phase))

    def sent_bytes(self, op: str | None = None, phase: str | None = None) -> float:
        return sum(r.sent_bytes for r in self._select(op, phase))

    def payload_bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.payload_bytes for r in self._select(op, phase))

    def sent_bytes_by_group(self) -> list[GroupBytes]:
        """(process group, bytes this rank sent on it) for every group used, in order of first
        use; None is the default group."""
        groups: dict[int, dist.ProcessGroup | None] = {}
        sent: dict[int, float] = {}
        for group, r in zip(self.groups, self.records):
            groups.setdefault(id(group), group)
            sent[id(group)] = sent.get(id(group), 0.0) + r.sent_bytes
        return [GroupBytes(groups[key], sent[key]) for key in groups]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per op: number of calls, payload bytes and bytes sent by this rank."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0}
        )
        for r in self.records:
            out[r.op]["calls"] += 1
            out[r.op]["payload_bytes"] += r.payload_bytes
            out[r.op]["sent_bytes"] += r.sent_bytes
        return dict(out)

    def calls_by_op(self, phase: str | None = None) -> dict[str, list[float]]:
        """Per op, the bytes this rank sent in each call, in call order (receives: the bytes
        received): what the labs check call by call."""
        out: dict[str, list[float]] = {}
        for r in self._select(None, phase):
            out.setdefault(r.op, []).append(r.recv_bytes if r.op in _RECEIVES else r.sent_bytes)
        return out

    def clear(self) -> None:
        self.records.clear()
        self.groups.clear()
        self.sent_tensors.clear()

    def _select(self, op: str | None, phase: str | None) -> list[CommRecord]:
        return [
            r
            for r in self.records
            if (op is None or r.op == op) and (phase is None or r.phase == phase)
        ]

    # --- recording ----------------------------------------------------------------
    def _wrap(self, op: str, original: Callable) -> Callable:
        ledger = self

        def recorded(*args, **kwargs):
            depth = getattr(ledger._depth, "value", 0)
            if depth == 0:
                ledger._record(op, args, kwargs)
            ledger._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                ledger._depth.value = depth

        recorded.__wrapped__ = original
        recorded.__name__ = op
        return recorded

    def _add(
        self,
        op: str,
        n: int,
        payload: int,
        sent: float,
        received: float = 0.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        record = CommRecord(
            op=op,
            group_size=n,
            payload_bytes=int(payload),
            sent_bytes=float(sent),
            recv_bytes=float(received),
            phase=self._phase,
        )
        self.records.append(record)
        self.groups.append(group)

    def _record(self, op: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if op == "batch_isend_irecv":
            for p2p in _bind(op, args, kwargs)["p2p_op_list"]:
                name = getattr(p2p.op, "__name__", str(p2p.op))
                self._record_p2p(name, p2p.tensor, p2p.group)
            return
        a = _bind(op, args, kwargs)
        group = a.get("group")
        if op in ("send", "isend", "recv", "irecv"):
            self._record_p2p(op, a["tensor"], group)
            return
        n = _group_size(group)
        if op == "all_reduce":
            k = _nbytes(a["tensor"])
            self._add(op, n, k, 2 * ring_fraction(n) * k, 2 * ring_fraction(n) * k, group)
            return
        if op in ("broadcast", "reduce"):
            k = _nbytes(a["tensor"])
        elif op in ("all_gather_single", "all_gather_into_tensor"):  # K is the gathered output
            k = _nbytes(a["output_tensor"])
        elif op in ("reduce_scatter_single", "reduce_scatter_tensor"):  # K is the full input
            k = _nbytes(a["input"])
        elif op == "all_gather":
            k = n * _nbytes(a["tensor"])
        elif op == "reduce_scatter":
            k = sum(_nbytes(t) for t in a["input_list"])
        else:  # all_to_all_single
            self._record_all_to_all(a, n)
            return
        self._add(op, n, k, ring_fraction(n) * k, ring_fraction(n) * k, group)

    def _record_p2p(self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """A send counts its tensor as sent, a receive as received (group size 2: a pair)."""
        k = _nbytes(tensor)
        if self.keep_sent and op in ("send", "isend"):
            self.sent_tensors.append(tensor.detach().to("cpu", copy=True))
        sent = k if op in ("send", "isend") else 0
        received = k if op in ("recv", "irecv") else 0
        self._add(op, 2, k, sent, received, group)

    def _record_all_to_all(self, a: dict[str, Any], n: int) -> None:
        """Exact bytes: the rows of ``input`` bound for other ranks, and those arriving from
        them."""
        output = a["output"]
        inp = a["input"]
        me = dist.get_rank(a.get("group"))
        row_in = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
        row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else _nbytes(output)
        in_splits = list(a.get("input_split_sizes") or [inp.shape[0] // n] * n)
        out_splits = list(a.get("output_split_sizes") or [output.shape[0] // n] * n)
        sent = sum(s for i, s in enumerate(in_splits) if i != me) * row_in
        received = sum(s for i, s in enumerate(out_splits) if i != me) * row_out
        self._add("all_to_all_single", n, _nbytes(inp), sent, received, a.get("group"))


@functools.cache
def _signature(op: str) -> inspect.Signature:
    return inspect.signature(getattr(c10d, op))


def _bind(op: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, whether passed by position or keyword."""
    return _signature(op).bind_partial(*args, **kwargs).arguments
