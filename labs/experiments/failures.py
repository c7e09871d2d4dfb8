"""Notebook 10: the failures learners hit, reproduced on purpose, safely, and diagnosed.

    reproduce("skipped_collective")   # raises the launcher's LaunchTimeout naming the stuck ranks
    diagnose("skipped_collective")    # the same run, caught: what was raised, how fast, what was
                                      # left behind
    diagnose_all()                    # every scenario, for the notebook's summary table

Each scenario is a small rank function with one deliberate bug and a bounded run: the
launcher's timeout (or torch's own check) ends it, and every rank is killed before the
call returns, so a failing cell never hangs the notebook or leaves processes behind.

    scenario             the bug                                  what the learner sees
    skipped_collective   one rank skips an all-reduce the others  LaunchTimeout
                         wait on
    wrong_shape          ranks all-reduce tensors of different    gloo aborts the rank
                         sizes
    wrong_shape_detail   the same with                            a readable mismatch
                         TORCH_DISTRIBUTED_DEBUG=DETAIL
    port_in_use          a rendezvous on a port something else    "address already in use"
                         holds
    crashed_rank         one rank is killed by a signal           RankDied (SIGKILL)
    out_of_memory        state bigger than the memory cap, as     allocation error
                         the calculator predicted
    straggler            monitored_barrier names the late rank    RankError naming it

Every scenario runs on the backend ``launch`` picks (NCCL on a GPU box, one GPU per rank) with
its tensors on ``rank_device()``, except the few in ``GLOO_ONLY``, which need gloo for what they
show and force it: the one place that says which, and why.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from labs.experiments.spec import Lab
from labs.runtime.device import rank_device
from labs.runtime.errors import LaunchTimeout, RankDied, RankError
from labs.runtime.launcher import launch
from labs.runtime.proc import child_pids
from labs.theory.memory import state_bytes

# Notebook 10's lab: provoked failures, diagnosed in the notebook (no ``labs.run`` command). Its
# exercise reads the launcher's reports (``labs/diagnosis.py``).
LAB = Lab(name="failures", notebook="10_when_it_breaks", exercises=("diagnosis",))

# --- the buggy rank functions ---------------------------------------------------


def skipped_collective_rank(steps: int = 3):
    """Rank 1 forgets one all-reduce (say, behind an `if` on a rank-local condition)."""
    for step in range(steps):
        if dist.get_rank() == 1 and step == steps - 1:
            continue  # the bug
        dist.all_reduce(torch.ones(4, device=rank_device()))
    return dist.get_rank()


def wrong_shape_rank():
    """Rank 0 all-reduces 4 numbers, the others 5 (say, a ragged last batch)."""
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 5, device=rank_device()))


def port_in_use_rank(port: int):
    """Host a rendezvous store on a fixed port, which another program already holds."""
    if dist.get_rank() == 0:
        dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=2))
    return port


def crashed_rank():
    """Rank 1 dies mid-step (segfault, OOM killer, a node going down: here SIGKILL)."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1, device=rank_device()))


def _address_space_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _cap_memory(device: torch.device, budget_bytes: int) -> None:
    """Let this rank allocate at most ``budget_bytes`` more on ``device``: on a GPU through torch's
    caching allocator (``set_per_process_memory_fraction``), on the CPU with an address-space
    limit (a stand-in for a GPU's memory)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_reserved(device)
        torch.cuda.set_per_process_memory_fraction((used + budget_bytes) / total, device)
        return
    resource.setrlimit(
        resource.RLIMIT_AS, (_address_space_bytes() + budget_bytes, resource.RLIM_INFINITY)
    )


def out_of_memory_rank(n_params: int, budget_bytes: int):
    """Cap this rank's memory at ``budget_bytes`` more than it uses now, then allocate fp32
    parameters, gradients and Adam's two moments on its device: 16 bytes each."""
    device = rank_device()
    _cap_memory(device, budget_bytes)
    params = torch.zeros(n_params, device=device)
    grads = torch.zeros(n_params, device=device)
    moments = torch.zeros(2 * n_params, device=device)
    return params.numel() + grads.numel() + moments.numel()


def straggler_rank(delay_s: float, barrier_timeout_s: float):
    """Rank 1 is late (slow data loading, a noisy neighbour); a monitored barrier names it."""
    if dist.get_rank() == 1:
        time.sleep(delay_s)
    dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))


def _occupied_port() -> tuple[socket.socket, int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


# --- running them -------------------------------------------------------------------


def oom_prediction(n_params: int, budget_bytes: int) -> dict:
    """What the memory calculator says before anything runs: fp32 + AdamW state vs the budget."""
    need = state_bytes(n_params, precision="fp32", optimizer="adamw")["total_bytes"]
    return {
        "n_params": n_params,
        "needed_bytes": need,
        "budget_bytes": budget_bytes,
        "fits": need <= budget_bytes,
    }


OOM_PARAMS = 16 << 20
OOM_BUDGET = 128 << 20
SCENARIOS = (
    "skipped_collective",
    "wrong_shape",
    "wrong_shape_detail",
    "port_in_use",
    "crashed_rank",
    "out_of_memory",
    "straggler",
)
# The scenarios that run on gloo on every machine, and why (notebook 10 tells the learner).
GLOO_ONLY = {
    "wrong_shape": "gloo compares the ranks' sizes and aborts; NCCL does not check them, and a"
    " mismatched all-reduce may hang or read past the end of a buffer",
    "straggler": "dist.monitored_barrier exists only on gloo",
}


def reproduce(name: str, timeout: float = 5.0):
    """Run scenario ``name``; it raises the error a learner would see."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {SCENARIOS}")
    backend = "gloo" if name in GLOO_ONLY else "auto"
    if name == "skipped_collective":
        return launch(skipped_collective_rank, 3, timeout=timeout, backend=backend)
    if name == "wrong_shape":
        return launch(wrong_shape_rank, 2, timeout=timeout, backend=backend)
    if name == "wrong_shape_detail":
        return launch(
            wrong_shape_rank,
            2,
            timeout=timeout,
            backend=backend,
            env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
        )
    if name == "port_in_use":
        holder, port = _occupied_port()
        try:
            return launch(port_in_use_rank, 2, port, timeout=timeout, backend=backend)
        finally:
            holder.close()
    if name == "crashed_rank":
        return launch(crashed_rank, 2, timeout=timeout, backend=backend)
    if name == "out_of_memory":
        # 16 Mi parameters: 256 MiB of fp32 + AdamW state, in a 128 MiB budget. (Each tensor is
        # over glibc's 32 MiB mmap threshold, so it is fresh address space the cap can refuse.)
        return launch(
            out_of_memory_rank, 2, OOM_PARAMS, OOM_BUDGET, timeout=timeout, backend=backend
        )
    return launch(straggler_rank, 3, 3.0, 1.0, timeout=timeout, backend=backend)


def diagnose(name: str, timeout: float = 5.0) -> dict:
    """Run a scenario and report what happened: the error's type and first line, the
    seconds it took, and how many processes it left behind (always 0)."""
    before = child_pids()
    t0 = time.perf_counter()
    try:
        reproduce(name, timeout=timeout)
        error = None
        text = "no error"
    except (RankError, RankDied, LaunchTimeout) as e:
        error = type(e).__name__
        text = str(e)
    seconds = time.perf_counter() - t0
    first = text.splitlines()[0]
    detail = next(
        (
            line.strip()
            for line in text.splitlines()
            if "what():" in line or "Detected mismatch" in line
        ),
        "",
    )
    return {
        "scenario": name,
        "error": error,
        "message": first[:160],
        "detail": detail[:160],
        "seconds": round(seconds, 2),
        "processes_left": len(child_pids() - before),
    }


def diagnose_all(timeout: float = 5.0) -> list[dict]:
    return [diagnose(name, timeout=timeout) for name in SCENARIOS]


def diagnosis_table(rows: list[dict]) -> str:
    """The diagnoses as an aligned text table: scenario, error, seconds, processes left, message."""
    lines = [f"{'scenario':<20} {'error':<14} {'seconds':>7} {'left':>4}  message"]
    for r in rows:
        lines.append(
            f"{r['scenario']:<20} {str(r['error']):<14} {r['seconds']:>7.2f}"
            f" {r['processes_left']:>4}  {r['message'][:90]}"
        )
    return "\n".join(lines)


# --- slow synchronisation, seen on a timeline and in a profile --------------------------


def unbalanced_step_rank(steps: int, work: int, slow_rank: int, slowdown: float):
    """Each step: a matmul workload (``slowdown`` times bigger on ``slow_rank``), then an
    all-reduce. Records compute and all-reduce spans, and a torch.profiler summary."""
    from torch.profiler import ProfilerActivity, profile

    from labs.measure.timeline import Timeline

    rank = dist.get_rank()
    device = rank_device()
    a = torch.randn(work, work).to(device)
    grad = torch.randn(1 << 16).to(device)
    repeats = max(1, round(4 * (slowdown if rank == slow_rank else 1.0)))
    a @ a
    dist.all_reduce(grad)  # warm-up: the first collective also sets up connections
    # on a GPU the kernels' own time (CUDA activity), not the time to launch them
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as prof:
        timeline = Timeline()  # after the profiler started: its start-up is not part of step 0
        for step in range(steps):
            with timeline.span("compute", step=step):
                for _ in range(repeats):
                    a @ a
            with timeline.span("all_reduce", step=step):
                dist.all_reduce(grad)
    totals = {"compute": 0.0, "communication": 0.0}
    for event in prof.key_averages():
        if event.key == "aten::mm":
            us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
            totals["compute"] += us / 1e6
        elif "allreduce" in event.key.lower() or "all_reduce" in event.key.lower():
            us = event.device_time_total if on_gpu else event.cpu_time_total
            totals["communication"] += us / 1e6
    return {"events": timeline.events, "profile_s": totals}


def straggler_timeline(
    nproc: int = 3,
    steps: int = 4,
    work: int = 320,
    slow_rank: int = 1,
    slowdown: float = 4.0,
    timeout: float = 60.0,
) -> dict:
    """Run the unbalanced steps; returns every rank's spans and the profiler's split of time."""
    per_rank = launch(
        unbalanced_step_rank, nproc, steps, work, slow_rank, slowdown, timeout=timeout
    )
    events = [e for r in per_rank for e in r["events"]]
    waits = {
        r: sum(e.duration for e in events if e.rank == r and e.name == "all_reduce")
        for r in range(nproc)
    }
    return {
        "events": events,
        "wait_s": waits,
        "profile_s": [r["profile_s"] for r in per_rank],
        "slow_rank": slow_rank,
    }


def plot_straggler(result: dict):
    """Gantt chart of compute vs all-reduce per rank, and the profiler's compute/communication
    split."""
    import matplotlib.pyplot as plt

    from labs.measure.timeline import plot_gantt

    fig, (gantt, bars) = plt.subplots(1, 2, figsize=(12, 3), gridspec_kw={"width_ratios": [3, 1]})
    plot_gantt(
        result["events"],
        ax=gantt,
        color_by=None,
        labels=False,
        title=f"rank {result['slow_rank']} is slow: the others wait inside all_reduce",
    )
    ranks = range(len(result["profile_s"]))
    compute = [p["compute"] for p in result["profile_s"]]
    comm = [p["communication"] for p in result["profile_s"]]
    bars.bar(ranks, compute, label="compute (aten::mm)")
    bars.bar(ranks, comm, bottom=compute, label="all_reduce (incl. waiting)")
    bars.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    bars.set_ylabel("seconds (torch.profiler)")
    bars.legend(fontsize=7)
    fig.tight_layout()
    return fig
