"""Step time: one way to time a step, one rule to turn a run's steps into ``step_time_s``.

    timer = StepTimer(device)
    for batch in batches:
        with timer.step():                 # CUDA events on a GPU, the clock on the CPU
            train_step(batch)
    timer.step_time()                      # median over the steps after the first (warm-up)

    time_steps(lambda: dist.all_reduce(x), 5)   # the same for a function called 5 times

The rule, for every lab: the first step is a warm-up (it builds the optimizer's state, fills
allocator caches, connects gloo's pairs, imports lazily) and is left out; ``step_time_s`` is
the median of the others, on each rank. A run of one step has nothing else to report, so its
one step counts. A lab reports the slowest rank's figure: a step ends when its last rank does.

On a GPU a step is timed by CUDA events recorded on the device's current stream before and after
it (and waited for), so a step's time is the GPU's, from its first kernel to its last, and not the
time the host took to queue them; on the CPU, by the host's clock (``time.perf_counter``).

Profiling (``python -m labs.run LAB --profile DIR``, ``labs.measure.profile``): the first timer of
a rank that reaches its second step wraps steps 1-3 in ``torch.profiler`` and writes the rank's
trace; the profiler starts and stops outside the timed block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from labs.measure.profile import StepProfiler, around_step, step_profiler
from labs.runtime.device import rank_device, synchronize


def step_time(times: Sequence[float]) -> float:
    """The course's step-time rule: the median of ``times`` after the first (warm-up) step; a run
    of one step reports that step."""
    if not times:
        raise ValueError("times is empty: time at least one step")
    return statistics.median(times[1:] or times)


class StepTimer:
    """Times each step of a run on ``device`` (default: this rank's, ``rank_device()``), keeping
    every step's seconds in ``times``."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.times: list[float] = []
        self.profiler: StepProfiler | None = None  # set at step 1 when profiling is on

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time the block. On a GPU: between two CUDA events on the current stream, the second
        waited for before the time is read. On the CPU: by the clock. Profiled when profiling is
        on (``labs.measure.profile``)."""
        device = self.device or rank_device()
        if len(self.times) == 1:
            self.profiler = step_profiler(device)
        with around_step(self.profiler, len(self.times)):
            with self._timed(device):
                yield

    @contextmanager
    def _timed(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            end.synchronize()
            self.times.append(start.elapsed_time(end) / 1e3)  # milliseconds -> seconds
            return
        synchronize(device)
        start_s = time.perf_counter()
        yield
        synchronize(device)
        self.times.append(time.perf_counter() - start_s)

    def step_time(self) -> float:
        """``step_time(self.times)``: the median after the warm-up step. (The loop is over: a
        profiled loop shorter than the profiled steps writes its trace now.)"""
        if self.profiler is not None:
            self.profiler.finish()
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
