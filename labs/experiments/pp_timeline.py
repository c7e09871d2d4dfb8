"""Experiment 05's clock: the pipeline's operations on a timeline, padded to a set duration, and
the activations each stage holds.

``MeasuredTimeline`` is the ``labs.measure.Timeline`` a schedule records its "F" and "B" (and "W",
"BW") spans on in the lab's measurement step (``labs.experiments.pp``). Two things on top of a
timeline:

* padding: each "F" span lasts at least ``op_time`` and each backward ``backward_ratio·op_time``
  (the rest is slept out), as if every stage's compute were that long: the durations are set, the
  gaps between them are real waits for real messages. A split backward shares it: "W" takes
  ``w_share`` of it, "B" the rest; "BW" (a full backward beside split ones) all of it;
* activations held: during each "F" span, saved-tensor hooks tag every tensor autograd saves
  with the span's (micro-batch, chunk); when autograd frees it (after that backward) the tag
  is released. The peak number of tags alive at once is the measured micro-batches held.

``clock_record`` packs a rank's spans for the trip to the parent, ``on_one_clock`` puts every
rank's on one clock there, and ``idle_fraction_of`` measures the bubble.
"""

from __future__ import annotations

import socket
import sys
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from labs.measure import Event, Timeline, idle_fraction
from labs.runtime.device import synchronize
from labs.theory.pipeline import OPERATIONS


class MeasuredTimeline(Timeline):
    """A Timeline whose "F" spans last at least ``op_time`` and backwards
    ``backward_ratio·op_time`` ("B" and "W" split it, ``w_share`` to W), sleeping out the rest,
    and that counts the activations each "F" span leaves alive."""

    def __init__(
        self,
        *,
        op_time: float = 0.0,
        backward_ratio: float = 2.0,
        w_share: float = 0.0,
        exclude=(),
    ):
        super().__init__()
        backward = backward_ratio * op_time
        self.min_time = {
            "F": op_time,
            "B": (1 - w_share) * backward,
            "W": w_share * backward,
            "BW": backward,
        }
        self._params = {p.untyped_storage().data_ptr() for p in exclude}
        # (micro-batch, chunk) -> saved tensors alive
        self.live: dict[tuple, int] = defaultdict(int)
        self.peak_held = 0
        self.bytes = 0
        self.peak_bytes = 0
        self._tag = None

    @contextmanager
    def span(self, name: str, **meta):
        start = time.perf_counter()
        self._tag = (meta.get("microbatch"), meta.get("chunk"))
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            if name == "F"
            else nullcontext()
        )
        with super().span(name, **meta), hooks:
            yield
            if self.sync:
                synchronize(self.device)  # the op's own time, before padding it out
            pad = self.min_time.get(name, 0.0) - (time.perf_counter() - start)
            if pad > 0:
                time.sleep(pad)

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self._params:
            return t  # weights are state, not activations
        # detached: a saved output packed with its grad_fn would point back at the node that
        # saves it, a cycle that only the garbage collector frees; a node a split backward's
        # autograd.grad never runs (ZB-H1's W skips the input-only ops) would then outlive it
        held = _Held(t.detach())
        tag = self._tag
        nbytes = t.numel() * t.element_size()
        self.live[tag] += 1
        self.bytes += nbytes
        self.peak_held = max(self.peak_held, sum(1 for n in self.live.values() if n))
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        # runs when autograd frees the saved tensor
        weakref.finalize(held, self._release, tag, nbytes)
        return held

    def _release(self, tag, nbytes):
        self.live[tag] -= 1
        self.bytes -= nbytes


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Held) else packed


def clock_record(timeline: Timeline) -> dict:
    """The spans, and what it takes to put every rank's on one clock: ``time.perf_counter`` is
    CLOCK_MONOTONIC on Linux, one clock for all processes of a machine, so the ranks' origins
    (``timeline.origin``) line their spans up exactly; the barrier before each origin only
    lines them up to within its exit skew, milliseconds on a busy machine."""
    return {
        "host": socket.gethostname(),
        "origin": timeline.origin,
        "spans": [
            {
                "rank": e.rank,
                "name": e.name,
                "microbatch": e.meta.get("microbatch"),
                "chunk": e.meta.get("chunk"),
                "start": e.start,
                "end": e.end,
            }
            for e in timeline.events
        ],
    }


def on_one_clock(per_rank: list[dict], key: str) -> list[dict]:
    """All ranks' spans of ``key`` (each rank's ``clock_record``), on rank 0's clock when all ranks
    share a machine."""
    shared = len({r[key]["host"] for r in per_rank}) == 1 and sys.platform.startswith("linux")
    out = []
    for r in per_rank:
        shift = r[key]["origin"] - per_rank[0][key]["origin"] if shared else 0.0
        out += [dict(e, start=e["start"] + shift, end=e["end"] + shift) for e in r[key]["spans"]]
    return out


def idle_fraction_of(spans: list[dict]) -> float:
    """The measured bubble: idle share of ranks x makespan in the ranks' "F"/"B"/"W"/"BW"
    spans."""
    return idle_fraction(
        [Event(e["rank"], e["name"], e["start"], e["end"]) for e in spans], names=OPERATIONS
    )
