"""Profile a lab's own training steps: a ``torch.profiler`` trace per rank, by the step timer.

    with profiling("traces"):          # what `python -m labs.run ddp --profile traces` does
        ddp.run(nproc=2, steps=4)
    # -> traces/rank0.json, traces/rank1.json: Chrome/Perfetto JSON (ui.perfetto.dev,
    #    chrome://tracing), read by labs.measure.trace

No lab has profiling code of its own. Every lab times its steps with ``StepTimer``
(``labs.measure.timing``), and each ``StepTimer`` asks :func:`step_profiler` for a profiler when
its second step begins. One is handed out when profiling was asked for (``profiling`` sets the
``LABS_PROFILE_DIR`` variable, which launched ranks inherit, like ``LABS_IMPL``), inside a rank
(the process group is up), and only to the first timer of this rank to ask: a lab that times
several loops (three DDP variants, ours then torch's) has its first loop profiled.

What is recorded: steps 1 to ``PROFILED_STEPS`` (step 0 is the warm-up the step-time rule leaves
out too), each inside a ``ProfilerStep#<n>`` range, the name torch's own ``profiler.step()`` uses,
so tools that split a trace into steps (``labs.measure.trace``, TensorBoard, HTA) find them. The
trace is written when the last of those steps ends, or when the loop asks for its step time
(``StepTimer.step_time``), whichever comes first. CPU activity always; the GPU's too on a GPU.
Profiling slows every operator down a little: a profiled run's step times are not for comparing.

One addition to what torch records: ``Work.wait()`` (waiting for an async collective) is not an
operator, so a rank blocked in it would look idle, or, when the wait runs in an autograd hook
(ZeRO-3 gathering the next unit in backward), busy inside the operator that ran the hook. While
the profiler runs, ``wait`` is wrapped in a ``c10d::Work.wait`` range, which ``labs.measure.trace``
counts as communication like any other collective call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

# The folder traces go to; set by ``profiling``, inherited by launched ranks.
PROFILE_ENV = "LABS_PROFILE_DIR"
# Steps 1..PROFILED_STEPS are profiled (step 0 is the warm-up).
PROFILED_STEPS = 3
# The name of a profiled step's range in the trace, as torch's ``profiler.step()`` writes it.
STEP_PREFIX = "ProfilerStep#"
# The range around each ``Work.wait()`` while profiling (a collective call: prefix "c10d::").
WAIT_EVENT = "c10d::Work.wait"

# Trace files this process has taken on (a rank profiles one loop).
_claimed: set[Path] = set()


def trace_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank``'s trace goes: ``folder/rank<rank>.json``."""
    return Path(folder) / f"rank{rank}.json"


@contextmanager
def profiling(folder: str | os.PathLike, *, rank: int | None = None) -> Iterator[Path]:
    """Profile the steps of every lab run inside the block into ``folder`` (created if needed).

    Old traces there are removed first, so what the folder holds afterwards is this run's:
    every ``rank*.json`` when this process launches the ranks, only ``rank<rank>.json`` when it
    is one rank of a torchrun job (``rank``), whose peers clear their own.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"profile folder {str(folder)!r} is a file: give a folder for the traces")
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder.glob("rank*.json") if rank is None else [trace_path(folder, rank)]
    for path in stale:
        path.unlink(missing_ok=True)
    before = os.environ.get(PROFILE_ENV)
    os.environ[PROFILE_ENV] = str(folder.resolve())
    try:
        yield folder
    finally:
        if before is None:
            del os.environ[PROFILE_ENV]
        else:
            os.environ[PROFILE_ENV] = before


class StepProfiler:
    """``torch.profiler`` around steps ``first`` .. ``first + count - 1`` of one step loop on this
    rank; the trace goes to ``path`` (Chrome trace JSON)."""

    def __init__(self, path: Path, *, first: int = 1, count: int = PROFILED_STEPS, cuda=False):
        self.path = path
        self.first = first
        self.last = first + count - 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profile = profile(activities=activities)
        self._running = False

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Wrap step ``step`` (0 = the warm-up): start before the first profiled step, mark each
        profiled step as a ``ProfilerStep#<step>`` range, write the trace after the last."""
        if step == self.first:
            self._profile.start()
            self._running = True
            self._wait = dist.Work.wait
            dist.Work.wait = _recorded(self._wait)
        if not self._running or step > self.last:
            yield
            return
        with record_function(f"{STEP_PREFIX}{step}"):
            yield
        if step == self.last:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace now (a loop that ended before ``last``); idempotent."""
        if not self._running:
            return
        self._running = False
        dist.Work.wait = self._wait
        self._profile.stop()
        self._profile.export_chrome_trace(str(self.path))


def _recorded(wait):
    """``wait`` inside a ``WAIT_EVENT`` range."""

    def recorded_wait(work, *args, **kwargs):
        with record_function(WAIT_EVENT):
            return wait(work, *args, **kwargs)

    return recorded_wait


def step_profiler(device: torch.device) -> StepProfiler | None:
    """A profiler for the step loop that asks, or None: None unless profiling was asked for
    (``profiling``), this process is a rank (the process group is up), and no loop of this rank
    has taken the rank's trace yet."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder or not dist.is_initialized():
        return None
    path = trace_path(folder, dist.get_rank())
    if path in _claimed or path.exists():
        return None  # an earlier loop, or an earlier launch of this run, has this rank's trace
    _claimed.add(path)
    return StepProfiler(path, cuda=device.type == "cuda")


def around_step(profiler: StepProfiler | None, step: int):
    """``profiler.around(step)``, or nothing to do when there is no profiler."""
    return nullcontext() if profiler is None else profiler.around(step)
