"""Notebook 04, §11: tensor parallelism's backward collectives overlapped with the weight-gradient
matmuls (``apply_async_communication``), and what it changes in a profiled step.

    runs = overlap_runs("traces/tp-overlap", nproc=2, sp=False, op_time=0.005)
    print(overlap_table(runs))     # per variant and rank: step, compute, comm, exposed comm (ms),
                                   # then the exposed communication of the step and of backward
    plot_overlap(runs)             # compute / communication lanes of one step, before and after
    same_results(runs["sync"]["summary"], runs["async"]["summary"])  # losses, collectives, bytes
    python -m labs.run tp --nproc 2 --async-linear --op-time 0.005 --profile traces/tp-async

Each variant is the TP lab (``labs.experiments.tp.run``) with every rank profiling steps 1-3
(``labs.experiments.profiling``); ``labs.measure.trace`` reduces each rank's trace to a compute
and a communication lane and measures the exposed communication, the time a rank communicates
while it computes nothing. The overlap happens in the backward pass, so it is also measured
there alone (``backward_figures``: from the first to the last autograd node of each step): the
forward's collectives, which nothing overlaps, and their waits for a late peer, stay out of it.

Padding (``op_time``, ``PaddedMatmuls``). An overlap needs two things to run at once: the matmul
on one core and gloo's communication thread on another. With N ranks on fewer than 2N free cores
they take turns, and the trace shows the collective starting only when the matmul ends. A GPU
computes on the device and leaves the host free, and so does a sleep: padding each matrix product
to ``op_time`` seconds, as notebook 05 pads pipeline operations, makes compute that long and
leaves the cores to gloo. The durations are set; the collectives and their waits are real.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from labs.measure.trace import intersect, lanes_of, length, load_trace
from labs.runtime.device import rank_device, synchronize

# The aten operators padded: the matrix products of the linears (forward and backward).
MATMULS = ("mm", "addmm", "bmm", "baddbmm")
# Which runs notebook 04 compares: name -> apply_async_communication or not.
VARIANTS = {"sync": False, "async": True}
# The range torch.profiler records around each autograd node's backward.
BACKWARD_NODE = "autograd::engine::evaluate_function"


class PaddedMatmuls(TorchDispatchMode):
    """While active, each matrix product (``MATMULS``) lasts at least ``op_time`` seconds: the
    rest is slept out after it (on a GPU, after waiting for it), as if compute were that long."""

    def __init__(self, op_time: float):
        super().__init__()
        if op_time < 0:
            raise ValueError(f"op_time={op_time} must be >= 0 (seconds; 0: no padding)")
        self.op_time = op_time
        self.device = rank_device()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in MATMULS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        synchronize(self.device)
        pad = self.op_time - (time.perf_counter() - start)
        if pad > 0:
            time.sleep(pad)
        return out


def padded(op_time: float) -> AbstractContextManager:
    """``PaddedMatmuls(op_time)``, or nothing to do when ``op_time`` is 0."""
    return PaddedMatmuls(op_time) if op_time else nullcontext()


def overlap_runs(
    folder: str | os.PathLike,
    *,
    nproc: int = 2,
    sp: bool = False,
    op_time: float = 0.0,
    steps: int = 4,
    **options,
) -> dict[str, dict]:
    """The TP lab twice on ``nproc`` ranks (with SP when ``sp``), each rank profiling steps 1-3:
    ``"sync"`` (f, then the matmuls) and ``"async"`` (``apply_async_communication``), matrix
    products padded to ``op_time``; ``options`` go to ``labs.experiments.tp.run``. Returns
    ``{variant: profile_lab's result}`` (``summary``, ``steps``, ``medians``, ``lanes``), traces
    in ``folder/sync`` and ``folder/async``. Notebook 04."""
    from labs.experiments.profiling import profile_lab

    runs = {}
    for name, async_linear in VARIANTS.items():
        run = profile_lab(
            "tp",
            Path(folder) / name,
            nproc=nproc,
            steps=steps,
            sp=sp,
            op_time=op_time,
            async_linear=async_linear,
            **options,
        )
        runs[name] = {**run, "backward": backward_figures(run["traces"])}
    return runs


def backward_figures(traces: list[str]) -> list[dict]:
    """Per rank (``traces``: its trace files, in rank order) and profiled step, the backward pass
    alone: ``backward_s`` (from the step's first autograd node to its last, on any thread),
    ``comm_s`` and ``exposed_comm_s`` inside that window, and the window itself as ``start_s`` and
    ``end_s`` from the step's start."""
    rows = []
    for rank, path in enumerate(traces):
        trace = load_trace(path)
        lanes = lanes_of(trace, rank=rank)  # seconds of the trace's own clock
        nodes = [
            (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in trace["traceEvents"]
            if e.get("ph") == "X" and "dur" in e and e["name"].startswith(BACKWARD_NODE)
        ]
        for step, start, end in lanes.steps:
            inside = [(s, e) for s, e in nodes if start <= s and e <= end]
            if not inside:
                continue
            window = [(min(s for s, _ in inside), max(e for _, e in inside))]
            rows.append(
                {
                    "rank": rank,
                    "step": step,
                    "backward_s": window[0][1] - window[0][0],
                    "comm_s": length(intersect(list(lanes.comm), window)),
                    "exposed_comm_s": length(intersect(lanes.exposed, window)),
                    "start_s": window[0][0] - start,
                    "end_s": window[0][1] - start,
                }
            )
    return rows


def exposed_ms(rows: list[dict]) -> float:
    """Exposed communication in ms: each rank's least ``exposed_comm_s`` over its profiled steps,
    the median over ranks (rows of ``step_figures`` or ``backward_figures``). The least, because
    noise only adds to it (a late peer, a thread waiting for a core): the best step is the nearest
    to what the schedule itself leaves exposed, as ``timeit`` reports the best of its repeats."""
    ranks = sorted({r["rank"] for r in rows})
    per_rank = [min(r["exposed_comm_s"] for r in rows if r["rank"] == k) for k in ranks]
    return statistics.median(per_rank) * 1e3


def exposed_summary(runs: Mapping[str, Mapping]) -> dict:
    """Per variant of ``overlap_runs``, the exposed communication (``exposed_ms``) of the whole
    step and of the backward pass alone, in ms."""
    return {
        name: {"step": exposed_ms(run["steps"]), "backward": exposed_ms(run["backward"])}
        for name, run in runs.items()
    }


def overlap_table(runs: Mapping[str, Mapping]) -> str:
    """``labs.experiments.profiling.exposed_table`` of ``overlap_runs`` (medians over the profiled
    steps), then the exposed communication of the step and of its backward pass, sync against
    async (``exposed_summary``: the best step of each rank, the median over ranks)."""
    from labs.experiments.profiling import exposed_table

    figures = exposed_summary(runs)
    lines = [
        exposed_table(runs),
        "",
        "exposed communication (each rank's best profiled step, median over ranks):",
        f"{'':<16}{'sync ms':>9}{'async ms':>10}",
    ]
    for part in ("step", "backward"):
        before = figures["sync"][part]
        after = figures["async"][part]
        change = 1 - after / before if before else 0.0
        share = f"{abs(change):>6.0%} {'less' if change >= 0 else 'more'}"
        lines.append(f"{'per ' + part:<16}{before:>9.2f}{after:>10.2f} {share}")
    return "\n".join(lines)


def plot_overlap(runs: Mapping[str, Mapping], *, step: int | None = None, whole_step: bool = False):
    """The compute and communication lanes of one profiled step (default: the first) of each
    variant, one panel each on one time scale (``labs.experiments.profiling.plot_runs``), exposed
    communication in red; zoomed on the backward passes unless ``whole_step``."""
    from labs.experiments.profiling import plot_runs

    fig = plot_runs(runs, step=step)
    if whole_step:
        return fig
    if step is None:
        step = min(s for lanes in runs["sync"]["lanes"] for s, _, _ in lanes.steps)
    edges = []
    for run in runs.values():
        # where each rank's step starts in the plot: ms after the earliest rank's start
        starts = {
            lanes.rank: next(start for s, start, _ in lanes.steps if s == step)
            for lanes in run["lanes"]
        }
        t0 = min(starts.values())
        for row in run["backward"]:
            if row["step"] == step:
                offset = starts[row["rank"]] - t0
                edges += [offset + row["start_s"], offset + row["end_s"]]
    margin = 0.02 * (max(edges) - min(edges))
    fig.axes[0].set_xlim((min(edges) - margin) * 1e3, (max(edges) + margin) * 1e3)
    for ax in fig.axes:
        ax.set_title(f"{ax.get_title()}: the backward of step {step}")
    return fig


def same_results(sync: Mapping, overlapped: Mapping) -> dict:
    """What the overlap must not change, between two TP lab summaries on the same settings, f then
    the matmuls (``sync``) and ``apply_async_communication`` (``overlapped``): both verdicts, the
    losses (bit for bit), the collectives per phase and op (calls, payload, bytes sent), and the
    bytes sent, held and saved per rank. Notebook 04."""
    keys = (
        "comm",
        "comm_bytes_per_rank",
        "param_bytes_per_rank",
        "state_bytes_per_rank",
        "saved_activation_bytes",
    )
    return {
        "both pass their verdicts": sync.passed and overlapped.passed,
        "losses identical": sync["losses"] == overlapped["losses"],
        **{f"{k} identical": sync[k] == overlapped[k] for k in keys},
    }
