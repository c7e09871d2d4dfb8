"""Read a run's profiler traces: compute and communication lanes, and the exposed communication.

    runs = load_run("traces")      # traces/rank0.json, rank1.json, ... (labs.measure.profile)
    rows = step_figures(runs)      # per rank and step: step, compute, comm, exposed seconds
    print(format_figures(rows))
    plot_lanes(runs)               # two lanes per rank; the exposed parts in red

A trace (``torch.profiler``'s Chrome JSON) is a list of events, each with a thread, a start ``ts``
and a duration ``dur`` in microseconds. We reduce each rank's trace to two *lanes*, each a set of
disjoint time intervals:

* **compute**: on a GPU, the kernels that are not NCCL's; on the CPU, the operators (``cpu_op``)
  the rank's compute thread runs (the thread that holds the ``ProfilerStep#`` ranges), minus the
  time that thread spends inside a collective call;
* **communication**: on a GPU, NCCL's kernels; on the CPU, gloo's work (``gloo:all_reduce``, ...:
  gloo runs a collective on its own threads), and the compute thread's own collective calls
  (``c10d::*``, ``_c10d_functional::*``: a barrier, a send, the launch of an all-reduce, and
  ``c10d::Work.wait``, the waits ``labs.measure.profile`` marks).

Then, inside each step's window: compute time = |compute|, communication time = |comm| and

    exposed communication = |comm| - |comm ∩ compute|

the time the rank spends communicating while it computes nothing: what the step would lose if the
communication were free. Communication that runs beside compute (DDP's bucketed all-reduce during
backward, a ZeRO-3 prefetch) is hidden; a blocking collective after backward is exposed, however
fast. On the CPU a gloo collective's time includes waiting for the slowest peer. (Holistic Trace
Analysis computes the same overlap from GPU traces; CPU and gloo traces need the rules above.)

Times are seconds since the run's first profiled step began on any rank: every trace carries
``baseTimeNanoseconds``, the wall clock its ``ts`` counts from, so ranks on one machine line up.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from labs.measure.profile import STEP_PREFIX, trace_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Interval = tuple[float, float]  # (start, end), seconds
# A collective call on the compute thread: c10d ops, functional collectives and their waits.
CALL_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
# A collective's own work: gloo's threads on the CPU, NCCL's range (its kernels on a GPU).
WORK_PREFIXES = ("gloo:", "nccl:")


# --- intervals ---------------------------------------------------------------------------------


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals``, as sorted, disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where both ``a`` and ``b`` (each sorted and disjoint, as ``merge`` gives) are."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where ``a`` is and ``b`` is not (both sorted and disjoint)."""
    out = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total length of disjoint ``intervals``."""
    return sum(end - start for start, end in intervals)


# --- one rank's trace --------------------------------------------------------------------------


@dataclass(frozen=True)
class Lanes:
    """One rank's trace, reduced: its profiled steps and its compute and communication lanes
    (sorted, disjoint intervals, seconds on the run's clock)."""

    rank: int
    steps: tuple[tuple[int, float, float], ...]  # (step number, start, end)
    compute: tuple[Interval, ...]
    comm: tuple[Interval, ...]
    device: str  # "cpu" (operators and gloo threads) or "cuda" (kernels)

    @property
    def exposed(self) -> list[Interval]:
        """The communication no compute hides."""
        return subtract(list(self.comm), list(self.compute))


def load_trace(path: str | os.PathLike) -> dict:
    """A Chrome trace as a dict; a clear error when the file is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path}: run the lab with --profile first")
    with path.open() as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace: it has no traceEvents")
    return trace


def _is_call(name: str) -> bool:
    return name.startswith(CALL_PREFIXES)


def _is_work(name: str) -> bool:
    return name.startswith(WORK_PREFIXES)


def _compute_thread(events: list[dict]):
    """The thread that runs the steps: the one holding the ProfilerStep ranges, else the thread
    with the most operator time."""
    for e in events:
        if e["name"].startswith(STEP_PREFIX):
            return e["tid"]
    busy: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            busy[e["tid"]] = busy.get(e["tid"], 0.0) + e["dur"]
    if not busy:
        raise ValueError("the trace has no operators: was anything run under the profiler?")
    return max(busy, key=busy.get)


def lanes_of(trace: dict, *, rank: int | None = None, origin_us: float = 0.0) -> Lanes:
    """Reduce ``trace`` to its lanes. Times are seconds from ``origin_us``, microseconds on the
    wall clock (``baseTimeNanoseconds / 1000 + ts``; 0: the trace's own ``ts``)."""
    offset = trace.get("baseTimeNanoseconds", 0) // 1000 - origin_us if origin_us else 0

    def span(e: dict) -> Interval:
        start = (e["ts"] + offset) / 1e6
        return (start, start + e["dur"] / 1e6)

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    thread = _compute_thread(events)
    on_thread = [e for e in events if e["tid"] == thread]
    steps = tuple(
        (int(e["name"][len(STEP_PREFIX) :]), *span(e))
        for e in on_thread
        if e["name"].startswith(STEP_PREFIX)
    )
    if kernels:  # on a GPU: the device's lanes
        comm = merge(span(e) for e in kernels if "nccl" in e["name"].lower())
        compute = merge(span(e) for e in kernels if "nccl" not in e["name"].lower())
        device = "cuda"
    else:  # on the CPU: the compute thread's operators, gloo's threads
        calls = merge(span(e) for e in on_thread if _is_call(e["name"]))  # ops and marked waits
        work = [span(e) for e in events if _is_work(e["name"])]
        comm = merge([*calls, *work])
        ops = merge(
            span(e) for e in on_thread if e.get("cat") == "cpu_op" and not _is_call(e["name"])
        )
        compute = subtract(ops, calls)
        device = "cpu"
    if rank is None:
        rank = trace.get("distributedInfo", {}).get("rank", 0)
    return Lanes(rank, tuple(sorted(steps)), tuple(compute), tuple(comm), device)


def load_run(folder: str | os.PathLike, ranks: Iterable[int] | None = None) -> list[Lanes]:
    """The lanes of ``folder/rank<r>.json`` for each rank in ``ranks`` (default: every trace
    there), on one clock: seconds since the first profiled step began on any of them."""
    folder = Path(folder)
    if ranks is None:
        ranks = sorted(int(p.stem[4:]) for p in folder.glob("rank*.json") if p.stem[4:].isdigit())
    ranks = list(ranks)
    if not ranks:
        raise FileNotFoundError(f"no rank*.json traces in {folder}: run the lab with --profile")
    traces = {r: load_trace(trace_path(folder, r)) for r in ranks}
    origin = min(_first_step_us(t) for t in traces.values())
    return [lanes_of(traces[r], rank=r, origin_us=origin) for r in ranks]


def _first_step_us(trace: dict) -> float:
    starts = [
        e["ts"]
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("name", "").startswith(STEP_PREFIX)
    ]
    first = min(starts) if starts else min(e["ts"] for e in trace["traceEvents"] if "ts" in e)
    return trace.get("baseTimeNanoseconds", 0) // 1000 + first


# --- figures ----------------------------------------------------------------------------------


def step_figures(runs: Sequence[Lanes]) -> list[dict]:
    """Per rank and profiled step: ``step_s`` (the step's length), ``compute_s``, ``comm_s`` and
    ``exposed_comm_s`` (communication not under compute), all inside the step's window."""
    rows = []
    for lanes in runs:
        exposed = lanes.exposed
        for step, start, end in lanes.steps:
            window = [(start, end)]
            rows.append(
                {
                    "rank": lanes.rank,
                    "step": step,
                    "step_s": end - start,
                    "compute_s": length(intersect(list(lanes.compute), window)),
                    "comm_s": length(intersect(list(lanes.comm), window)),
                    "exposed_comm_s": length(intersect(exposed, window)),
                }
            )
    return rows


def median_figures(rows: Sequence[dict]) -> list[dict]:
    """Per rank, the median over its profiled steps of each figure of ``step_figures``."""
    out = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["rank"] == rank]
        keys = ("step_s", "compute_s", "comm_s", "exposed_comm_s")
        out.append({"rank": rank, **{k: statistics.median(r[k] for r in mine) for k in keys}})
    return out


def format_figures(rows: Sequence[dict]) -> str:
    """A table of ``step_figures`` (or ``median_figures``) rows, in milliseconds."""
    head = (
        f"{'rank':>4}{'step':>6}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'exposed ms':>12}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['rank']:>4}{r.get('step', 'med'):>6}{r['step_s'] * 1e3:>10.2f}"
            f"{r['compute_s'] * 1e3:>12.2f}{r['comm_s'] * 1e3:>10.2f}"
            f"{r['exposed_comm_s'] * 1e3:>12.2f}"
        )
    return "\n".join(lines)


# --- the picture ------------------------------------------------------------------------------


def plot_lanes(
    runs: Sequence[Lanes], *, step: int | None = None, ax: Axes | None = None, title: str = ""
) -> Axes:
    """Two lanes per rank, compute (blue) and communication (orange), with the exposed
    communication in red; one step (``step``; default the first profiled), in milliseconds from
    its start on the earliest rank."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("runs is empty: load_run(folder) gives one Lanes per rank")
    if step is None:
        step = min(s for lanes in runs for s, _, _ in lanes.steps)
    windows = {lanes.rank: [(s, e) for n, s, e in lanes.steps if n == step] for lanes in runs}
    if not all(windows.values()):
        raise ValueError(f"step={step} was not profiled on every rank")
    t0 = min(w[0][0] for w in windows.values())
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.9 * len(runs)))
    rows = []
    for i, lanes in enumerate(runs):
        window = windows[lanes.rank]
        lanes_here = (
            (lanes.compute, "tab:blue", f"rank {lanes.rank} compute"),
            (lanes.comm, "tab:orange", f"rank {lanes.rank} comm"),
        )
        for j, (intervals, colour, label) in enumerate(lanes_here):
            y = 2 * i + j
            bars = [((s - t0) * 1e3, (e - s) * 1e3) for s, e in intersect(list(intervals), window)]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colour)
            rows.append(label)
        exposed = [((s - t0) * 1e3, (e - s) * 1e3) for s, e in intersect(lanes.exposed, window)]
        ax.broken_barh(exposed, (2 * i + 1 - 0.4, 0.8), color="tab:red")
        ax.axvspan((window[0][0] - t0) * 1e3, (window[0][1] - t0) * 1e3, color="0.95", zorder=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since step {step} began")
    ax.set_title(title or f"step {step}: compute and communication per rank")
    ax.legend(
        handles=[
            Patch(color="tab:blue", label="compute"),
            Patch(color="tab:orange", label="communication, hidden"),
            Patch(color="tab:red", label="communication, exposed"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    return ax
