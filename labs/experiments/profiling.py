"""Profile your own step (notebook 12): run a lab with a profiler trace per rank, then read them.

    run = profile_lab("ddp", "traces/ddp", nproc=2, steps=4)   # the lab's summary, its traces
    print(format_figures(run["steps"]))                       # per rank and step, in ms
    plot_lanes(run["lanes"])                                  # compute / communication lanes
    python -m labs.run ddp --nproc 2 --steps 4 --profile traces/ddp   # the same, from the shell

Recording is ``labs.measure.profile`` (the step timer profiles steps 1-3 of each rank's first
loop), reading is ``labs.measure.trace``. Labs whose ranks run training steps can be profiled
(``profiled_labs``); the others (collectives, memory, infer) time something else and say so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from labs.experiments.spec import command_labs
from labs.measure.profile import PROFILED_STEPS, profiling, trace_path
from labs.measure.trace import format_figures, load_run, median_figures, plot_lanes, step_figures
from labs.runtime.launcher import under_torchrun


def profiled_labs() -> tuple[str, ...]:
    """The labs whose ranks train with a StepTimer-timed loop, the ones ``--profile`` applies to
    (``profiled=True`` in their ``LAB``)."""
    return tuple(name for name, lab in command_labs().items() if lab.profiled)


def check_profiled(lab: str, steps: int) -> None:
    """A clear error for a lab or a run that ``--profile`` cannot profile."""
    profiled = profiled_labs()
    if lab not in profiled:
        raise ValueError(
            f"--profile applies to labs whose ranks run training steps, {', '.join(profiled)};"
            f" {lab!r} times something else: profile it with torch.profiler directly"
        )
    if steps < 2:
        raise ValueError(
            f"--profile needs steps >= 2, got steps={steps}: step 0 is the warm-up, steps 1 to"
            f" {PROFILED_STEPS} are profiled"
        )


def run_profiled(lab: str, run: Callable, folder: str | os.PathLike, **options):
    """``run(**options)`` (the lab's ``run``) with each rank profiling its steps into ``folder``.
    Under torchrun this process is one rank and clears only its own old trace."""
    check_profiled(lab, options.get("steps", 2))
    rank = int(os.environ["RANK"]) if under_torchrun() else None
    with profiling(folder, rank=rank):
        return run(**options)


def profile_report(folder: str | os.PathLike, nproc: int | None = None) -> dict:
    """What the traces in ``folder`` say: ``folder``, ``traces`` (their paths), ``steps`` (per
    rank and step, ``labs.measure.trace.step_figures``), ``medians`` (per rank, over the steps)
    and ``lanes`` (``Lanes`` per rank, for ``plot_lanes``). Reads the ranks' traces that are
    here (under a multi-node torchrun, this node's)."""
    folder = Path(folder)
    ranks = sorted(int(p.stem[4:]) for p in folder.glob("rank*.json") if p.stem[4:].isdigit())
    ranks = [r for r in ranks if nproc is None or r < nproc]
    if not ranks:
        raise FileNotFoundError(
            f"no traces in {folder}: did the lab's ranks run at least 2 timed steps?"
        )
    lanes = load_run(folder, ranks)
    rows = step_figures(lanes)
    return {
        "folder": str(folder),
        "traces": [str(trace_path(folder, r)) for r in ranks],
        "steps": rows,
        "medians": median_figures(rows),
        "lanes": lanes,
    }


def profile_lab(lab: str, folder: str | os.PathLike, **options) -> dict:
    """Run ``lab`` (one of ``profiled_labs()``: "ddp", "zero", ...) with ``options`` (its ``run``'s
    keywords), each rank profiling steps 1-3 into ``folder``; the lab's ``summary`` and
    ``profile_report``'s figures. Notebook 12."""
    check_profiled(lab, options.get("steps", 5))
    summary = run_profiled(lab, command_labs()[lab].run, folder, **options)
    return {"summary": summary, **profile_report(folder, nproc=summary["nproc"])}


def json_report(report: Mapping) -> dict:
    """``profile_report`` without its ``Lanes`` (what ``labs.run --json`` writes as ``profile``)."""
    return {k: v for k, v in report.items() if k != "lanes"}


def format_report(report: Mapping) -> str:
    """``profile_report`` as text: where the traces are, then each profiled step per rank."""
    return "\n".join(
        [
            f"profile: {len(report['traces'])} traces in {report['folder']}"
            " (open them in ui.perfetto.dev or chrome://tracing)",
            "each profiled step: compute, communication, and the communication no compute hides",
            format_figures(report["steps"]),
        ]
    )


def exposed_table(runs: Mapping[str, Mapping]) -> str:
    """Median step, compute, communication and exposed communication per rank, for named
    ``profile_lab`` results side by side (e.g. {"DDP": ..., "ZeRO-3": ...}), in ms."""
    lines = [
        f"{'run':<14}{'rank':>5}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}"
        f"{'exposed ms':>12}{'exposed/step':>14}"
    ]
    for name, run in runs.items():
        for r in run["medians"]:
            share = r["exposed_comm_s"] / r["step_s"] if r["step_s"] else 0.0
            lines.append(
                f"{name:<14}{r['rank']:>5}{r['step_s'] * 1e3:>10.2f}{r['compute_s'] * 1e3:>12.2f}"
                f"{r['comm_s'] * 1e3:>10.2f}{r['exposed_comm_s'] * 1e3:>12.2f}{share:>14.0%}"
            )
    return "\n".join(lines)


def plot_runs(runs: Mapping[str, Mapping], *, step: int | None = None):
    """``plot_lanes`` for named ``profile_lab`` results, one panel each, on one time scale."""
    import matplotlib.pyplot as plt

    heights = [0.6 + 0.9 * len(run["lanes"]) for run in runs.values()]
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, sum(heights)), sharex=True, height_ratios=heights, squeeze=False
    )
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        plot_lanes(run["lanes"], step=step, ax=ax, title=name)
    fig.tight_layout()
    return fig
