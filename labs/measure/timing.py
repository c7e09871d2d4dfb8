"""Step time: one way to time a step, one rule to turn a run's steps into ``step_time_s``.

    timer = StepTimer(device)
    for batch in batches:
        with timer.step():                 # synchronises the device before and after
            train_step(batch)
    timer.step_time()                      # median over the steps after the first (warm-up)

    time_steps(lambda: dist.all_reduce(x), 5)   # the same for a function called 5 times

The rule, for every lab: the first step is a warm-up (it builds the optimizer's state, fills
allocator caches, connects gloo's pairs, imports lazily) and is left out; ``step_time_s`` is
the median of the others, on each rank. A run of one step has nothing else to report, so its
one step counts. A lab reports the slowest rank's figure: a step ends when its last rank does.

On a GPU the clock is read after ``synchronize`` (``labs.runtime.device``), so a step's time is
its kernels' time and not the time to queue them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from labs.runtime.device import synchronize


def step_time(times: Sequence[float]) -> float:
    """The course's step-time rule: the median of ``times`` after the first (warm-up) step; a run
    of one step reports that step."""
    if not times:
        raise ValueError("times is empty: time at least one step")
    return statistics.median(times[1:] or times)


class StepTimer:
    """Times each step of a run on ``device`` (default: this rank's), keeping every step's
    seconds in ``times``."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.times: list[float] = []

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time the block: the device is synchronised before the clock starts and before it
        stops."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.times.append(time.perf_counter() - start)

    def step_time(self) -> float:
        """``step_time(self.times)``: the median after the warm-up step."""
        return step_time(self.times)


def time_steps(
    fn: Callable[[], object], steps: int, *, device: torch.device | None = None
) -> float:
    """Call ``fn()`` ``steps`` times, each timed as a step; the step time by the course's rule."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    timer = StepTimer(device)
    for _ in range(steps):
        with timer.step():
            fn()
    return timer.step_time()
