"""Experiment 00: the hand-written ring all-reduce against ``dist.all_reduce`` and the ring formula.

    summary = run(nproc=4)                # notebook 00
    python -m labs.run collectives --nproc 4 --json
    sweep = bandwidth_sweep(nproc=4)      # time vs message size, for the bandwidth plot

Checks, on every rank:
* integers (int64): the ring's result equals ``dist.all_reduce``'s exactly;
* floats: equal within rounding (a ring adds in another order than gloo);
* bytes: the ledger's count of bytes this rank sent equals 2 (N-1)/N K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labs.experiments.common import RunSummary, new_summary
from labs.measure.ledger import CommLedger
from labs.measure.timing import time_steps
from labs.runtime.device import rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.theory.comm import all_reduce_bytes

DEFAULT_NUMEL = 1 << 16  # 65,536 elements: 256 KiB of fp32 per rank


def whoami() -> dict:
    """Each rank reports who and where it is (notebook 00's first launch)."""
    import os

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "device": str(rank_device()),
        "threads": torch.get_num_threads(),
    }


def ring_worker(numel: int, steps: int, vs_torch: bool, seed: int) -> dict:
    ring = exercise("collectives")
    rank = dist.get_rank()
    device = rank_device()
    g = torch.Generator().manual_seed(seed + rank)
    ints = torch.randint(-1000, 1000, (numel,), generator=g).to(device)
    floats = torch.randn(numel, generator=g).to(device)

    ours_int = ints.clone()
    torch_int = ints.clone()
    ring.ring_all_reduce(ours_int)
    dist.all_reduce(torch_int)

    ours_float = floats.clone()
    torch_float = floats.clone()
    with CommLedger() as ledger:
        ring.ring_all_reduce(ours_float)
    dist.all_reduce(torch_float)

    def ring_step():
        ring.ring_all_reduce(floats.clone())
        report_progress()

    def torch_step():
        dist.all_reduce(floats.clone())

    step_time = time_steps(ring_step, steps, device=device)
    torch_time = time_steps(torch_step, steps, device=device) if vs_torch else None
    return {
        "rank": rank,
        "exact_int": torch.equal(ours_int, torch_int),
        "max_abs_diff": (ours_float - torch_float).abs().max().item(),
        "max_rel_diff": ((ours_float - torch_float).abs().max() / torch_float.abs().max()).item(),
        "sent_bytes": ledger.sent_bytes(),
        "sends": ledger.calls("isend") + ledger.calls("send"),
        "tensor_bytes": floats.numel() * floats.element_size(),
        "step_time_s": step_time,
        "torch_step_time_s": torch_time,
    }


def run(
    *,
    nproc: int = 4,
    steps: int = 5,
    numel: int = DEFAULT_NUMEL,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 120.0,
    seed: int = 0,
) -> RunSummary:
    """Run the ring all-reduce on ``nproc`` ranks and check it; returns the lab summary."""
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    per_rank = launch(
        ring_worker,
        nproc,
        numel,
        steps,
        vs_torch,
        seed,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc="ring all-reduce",
    )
    k = per_rank[0]["tensor_bytes"]
    summary = new_summary("collectives", nproc=nproc, backend=per_rank.backend, steps=steps)
    summary.update(
        comm_bytes_per_rank=[r["sent_bytes"] for r in per_rank],
        theory_comm_bytes_per_rank=all_reduce_bytes(k, nproc),
        state_bytes_per_rank=[k] * nproc,
        theory_state_bytes_per_rank=k,
        step_time_s=max(r["step_time_s"] for r in per_rank),
        torch_step_time_s=(max(r["torch_step_time_s"] for r in per_rank) if vs_torch else None),
        tensor_bytes=k,
        sends_per_rank=per_rank[0]["sends"],
        exact_int=all(r["exact_int"] for r in per_rank),
        max_abs_diff=max(r["max_abs_diff"] for r in per_rank),
        max_rel_diff=max(r["max_rel_diff"] for r in per_rank),
    )
    summary["bytes_match_theory"] = all(
        abs(b - summary["theory_comm_bytes_per_rank"]) <= nproc * 8
        for b in summary["comm_bytes_per_rank"]
    )
    return summary


def bandwidth_worker(sizes: list[int], repeats: int, ours: bool) -> list[dict]:
    ring = exercise("collectives")
    device = rank_device()
    rows = []
    for numel in sizes:
        x = torch.ones(numel, device=device)
        # one warm-up call, then ``repeats`` timed ones (the step-time rule drops the warm-up)
        row = {
            "bytes": numel * 4,
            "torch_s": time_steps(lambda x=x: dist.all_reduce(x), repeats + 1, device=device),
        }
        if ours:
            row["ours_s"] = time_steps(
                lambda x=x: ring.ring_all_reduce(x.clone()), repeats + 1, device=device
            )
        rows.append(row)
        report_progress()
    return rows


def bandwidth_sweep(
    *,
    nproc: int = 4,
    sizes: list[int] | None = None,
    repeats: int = 5,
    ours: bool = True,
    backend: str = "auto",
    timeout: float = 300.0,
) -> dict:
    """Time all-reduce against message size (4 KiB .. 4 MiB of fp32 by default).
    Returns rows with bytes, seconds and bus bandwidth (bytes sent per rank / time)."""
    sizes = sizes or [1 << p for p in range(10, 21, 2)]
    per_rank = launch(
        bandwidth_worker,
        nproc,
        sizes,
        repeats,
        ours,
        backend=backend,
        timeout=timeout,
        progress=len(sizes),
        desc="message sizes",
    )
    rows = []
    for i, size_row in enumerate(per_rank[0]):
        row = dict(size_row)
        for key in ("torch_s", "ours_s"):
            if key in size_row:
                # a collective ends when its slowest rank does
                row[key] = max(r[i][key] for r in per_rank)
                row[key.replace("_s", "_busbw")] = all_reduce_bytes(row["bytes"], nproc) / row[key]
        rows.append(row)
    return {"nproc": nproc, "backend": per_rank.backend, "rows": rows}


def plot_bandwidth(sweep: dict, ax=None):
    """Bus bandwidth against message size, torch's all-reduce and ours, log-log."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    x = [r["bytes"] for r in sweep["rows"]]
    ax.loglog(x, [r["torch_busbw"] / 1e9 for r in sweep["rows"]], "o-", label="dist.all_reduce")
    if "ours_busbw" in sweep["rows"][0]:
        ax.loglog(x, [r["ours_busbw"] / 1e9 for r in sweep["rows"]], "s--", label="our ring")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce on {sweep['nproc']} ranks ({sweep['backend']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax


def add_arguments(parser) -> None:
    parser.add_argument(
        "--numel", type=int, default=DEFAULT_NUMEL, help="elements in each rank's tensor"
    )
    parser.add_argument("--seed", type=int, default=0)
