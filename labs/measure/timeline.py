"""A per-rank event timeline: named spans with start and end times, drawn as a Gantt chart.

    timeline = Timeline()                     # on each rank, after the process group is up
    with timeline.span("F", microbatch=3):
        stage(x)
    events = timeline.events                  # return them from the rank; the parent plots
    plot_gantt(all_events)                    # rank x time, one bar per span

Times are seconds since ``Timeline`` was created. Ranks create it right after a
barrier, so their clocks (``time.perf_counter``, one monotonic clock per machine) line
up to within the barrier's skew. On GPU the span waits for queued kernels before
reading the clock, so a span measures work, not launch time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

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
