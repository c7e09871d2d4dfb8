"""A per-rank event timeline: named spans with start and end times, drawn as a Gantt chart.

    timeline = Timeline()                     # on each rank, after the process group is up
    with timeline.span("F", microbatch=3):
        stage(x)
    events = timeline.events                  # return them from the rank; the parent plots
    plot_gantt(all_events)                    # rank x time, one bar per span

    with trace_all_reduces(timeline):         # every dist.all_reduce, launch to completion
        loss.backward()

Times are seconds since ``Timeline`` was created. Ranks create it right after a
barrier, so their clocks (``time.perf_counter``, one monotonic clock per machine) line
up to within the barrier's skew. On GPU the span waits for queued kernels before
reading the clock, so a span measures work, not launch time. A collective that runs
beside the compute (``collective``, ``trace_all_reduces``) is timed where it runs: on a
GPU between CUDA events on the device (its start on the launching stream, its end after
NCCL's work), on the CPU from its launch to the moment gloo completes its future.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labs.runtime.device import rank_device, synchronize

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class Event:
    rank: int
    name: str  # e.g. "F", "B", "all_reduce", "optimizer"
    start: float  # seconds since the timeline's origin
    end: float
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. {"microbatch": 3, "chunk": 0}

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Records spans on this rank. ``sync=True`` waits for the GPU at each span's edges."""

    def __init__(self, rank: int | None = None, sync: bool = True, barrier: bool = True):
        if barrier and dist.is_initialized():
            dist.barrier()
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        self.sync = sync
        self.device = rank_device()
        self._on_gpu = self.device.type == "cuda"
        # (name, start, end, meta) of collectives timed by CUDA events, until ``flush``
        self._pending: list[tuple[str, Any, Any, dict]] = []
        if self._on_gpu:
            synchronize(self.device)  # the GPU's clock starts with the host's
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record(torch.cuda.current_stream(self.device))
            self._side_stream = torch.cuda.Stream(self.device)
        self.origin = time.perf_counter()
        self.events: list[Event] = []

    def now(self) -> float:
        """Seconds since the timeline was created."""
        return time.perf_counter() - self.origin

    @contextmanager
    def span(self, name: str, **meta: Any) -> Iterator[None]:
        """Record the block as one span ``name``; ``meta`` is kept with it (e.g. microbatch=3)."""
        if self.sync:
            synchronize(self.device)
        start = self.now()
        try:
            yield
        finally:
            if self.sync:
                synchronize(self.device)
            self.events.append(Event(self.rank, name, start, self.now(), meta))

    def collective(self, name: str, launch: Callable[[], Any], **meta: Any) -> Any:
        """Call ``launch()`` (a collective, synchronous or ``async_op=True``) and record it as an
        event ``name`` from its launch to its completion, without waiting for it here; returns
        what ``launch`` returned.

        On a GPU: between two CUDA events, one on the launching stream just before the launch
        (NCCL's stream starts no earlier), one on a side stream made to wait for the collective's
        work; read at ``flush``. The host's view (a future completing) would measure when the
        host learned of it, not when NCCL ran it. On the CPU: from the launch to the moment gloo
        completes the work's future, in its communication thread (not when someone waits)."""
        if self._on_gpu:
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            work = launch()
            end = torch.cuda.Event(enable_timing=True)
            self._side_stream.wait_stream(stream)  # a synchronous collective: queued on stream
            with torch.cuda.stream(self._side_stream):
                if work is not None:
                    work.wait()  # the side stream (not the host) waits for NCCL's work
                end.record(self._side_stream)
            self._pending.append((name, start, end, meta))
            return work
        start_s = self.now()
        work = launch()

        def done(_=None):
            self.events.append(Event(self.rank, name, start_s, self.now(), meta))

        if work is None:
            done()
        else:
            work.get_future().add_done_callback(done)
        return work

    def flush(self) -> None:
        """Wait for the GPU and turn the collectives timed by CUDA events into events (a no-op on
        the CPU, where they are recorded as they complete)."""
        if not self._pending:
            return
        synchronize(self.device)
        for name, start, end, meta in self._pending:
            self.events.append(
                Event(
                    self.rank,
                    name,
                    self._origin_event.elapsed_time(start) / 1e3,  # ms since the origin -> s
                    self._origin_event.elapsed_time(end) / 1e3,
                    meta,
                )
            )
        self._pending.clear()


@contextmanager
def trace_all_reduces(timeline: Timeline) -> Iterator[None]:
    """Every ``dist.all_reduce`` issued inside the block becomes an "all_reduce" event on
    ``timeline``, from its launch to its completion (``Timeline.collective``), with ``meta``
    ``bucket`` (its index in the block) and ``bytes``. The events are complete when the block
    ends (GPU ones are flushed then)."""
    original = c10d.all_reduce
    counter = itertools.count()

    def traced(tensor, *args, **kwargs):
        meta = {"bucket": next(counter), "bytes": tensor.numel() * tensor.element_size()}
        return timeline.collective("all_reduce", lambda: original(tensor, *args, **kwargs), **meta)

    try:
        dist.all_reduce = c10d.all_reduce = traced
        yield
    finally:
        dist.all_reduce = c10d.all_reduce = original
        timeline.flush()


def busy_time(events: list[Event], rank: int) -> float:
    """Seconds ``rank`` spent inside spans."""
    return sum(e.duration for e in events if e.rank == rank)


def idle_fraction(events: list[Event], names: tuple[str, ...] | None = None) -> float:
    """Share of (ranks x makespan) not covered by spans: the measured bubble.

    The makespan runs from the earliest start to the latest end over all ranks;
    ``names`` restricts which spans count as work (e.g. ``("F", "B")``).
    """
    work = [e for e in events if names is None or e.name in names]
    if not work:
        return 0.0
    ranks = sorted({e.rank for e in work})
    t0 = min(e.start for e in work)
    t1 = max(e.end for e in work)
    busy = sum(e.duration for e in work)
    return 1.0 - busy / (len(ranks) * (t1 - t0))


def plot_gantt(
    events: list[Event],
    ax: Axes | None = None,
    color_by: str | None = "microbatch",
    title: str | None = None,
    labels: bool = True,
) -> Axes:
    """Draw ranks (rows) against time; spans coloured by ``meta[color_by]`` (or by name)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        n_ranks = len({e.rank for e in events})
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * max(1, n_ranks)))
    cmap = plt.get_cmap("tab20")
    keys = sorted({str(e.meta.get(color_by, e.name)) for e in events})
    colour = {k: cmap(i % 20) for i, k in enumerate(keys)}
    for e in events:
        key = str(e.meta.get(color_by, e.name))
        hatch = "//" if e.name.upper().startswith("B") else None
        ax.barh(
            e.rank,
            e.duration,
            left=e.start,
            height=0.8,
            color=colour[key],
            edgecolor="black",
            linewidth=0.4,
            hatch=hatch,
        )
        if labels and e.duration > 0:
            ax.text(
                e.start + e.duration / 2,
                e.rank,
                f"{e.name}{e.meta.get(color_by, '')}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ranks = sorted({e.rank for e in events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    if title:
        ax.set_title(title)
    if len(keys) <= 12:
        ax.legend(
            handles=[Patch(color=colour[k], label=f"{color_by or 'span'} {k}") for k in keys],
            fontsize=7,
            loc="upper right",
            bbox_to_anchor=(1.0, -0.15),
            ncol=min(6, len(keys)),
        )
    return ax
