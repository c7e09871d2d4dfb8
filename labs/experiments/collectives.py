"""Experiment 00: the hand-written ring all-reduce against ``dist.all_reduce`` and the ring formula.

    summary = run(nproc=4)                # notebook 00
    python -m labs.run collectives --nproc 4 --json
    sweep = bandwidth_sweep(nproc=4)      # time vs message size, for the bandwidth plot

Checks, on every rank (``ring_checks``; the verdict is ``summary.verdict()``):
* integers (int64): the ring's result equals ``dist.all_reduce``'s exactly;
* coded integers: rank r's element i is ``i·2^N + 2^r``, so any partial sum tells which ranks
  it holds (its low N bits) and which position it came from: the result must hold every rank
  at every position (an overwrite, a chunk stored at the wrong index or added twice shows
  here, with the element and the ranks it holds), and every message the ring sent must be
  the chunk the algorithm names ((r - s) mod N in round s of the reduce-scatter, holding ranks
  r-s..r; (r + 1 - s) mod N, fully reduced, in the all-gather), which catches a wrong chunk even
  where the result happens to come out right;
* floats: equal within rounding (a ring adds in another order than gloo);
* bytes: the ledger's bytes of every send, call by call, equal the chunk's (K/N), and their sum
  2 (N-1)/N K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.experiments.checks import Check, calls_check, compare_values
from labs.experiments.common import RunSummary, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.measure.ledger import CommLedger
from labs.measure.timing import time_steps
from labs.runtime.device import rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.theory.comm import all_reduce_bytes

DEFAULT_NUMEL = 1 << 16  # 65,536 elements: 256 KiB of fp32 per rank
# the coded tensor: 16·N elements, N equal chunks (a rank that sends a chunk of another size than
# its neighbour expects aborts inside gloo, before any check could name the chunk)
CODED_PER_RANK = 16


@dataclass(frozen=True)
class Options:
    """The ring lab's options (``run``'s keywords, ``python -m labs.run collectives``'s flags)."""

    numel: int = option(DEFAULT_NUMEL, "elements in each rank's tensor")
    seed: int = option(0)

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        if self.numel < 1:
            raise ValueError(f"numel must be >= 1, got {self.numel}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")


LAB = Lab(
    name="collectives",
    notebook="00_setup_and_collectives",
    exercises=("collectives",),
    reference=("coded_tensor", "decode", "expected_sends"),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 1, "numel": 1200},  # N = 2, 3, 4 divide it
    bench=(Bench(torch="dist.all_reduce"),),
)


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


# --- coded integers: every partial sum says which ranks and which position it holds -----------
def coded_tensor(numel: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s int64 tensor: element i is i·2^n + 2^rank. A sum over a set S of ranks is
    |S|·i·2^n + mask(S): its low n bits name the ranks it holds, the rest its position."""
    return (torch.arange(numel, dtype=torch.int64) << n) + (1 << rank)


def decode(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ranks mask, position, consistent) of each element of a sum of coded tensors: the position
    is the high bits divided by the number of ranks; ``consistent`` is False where the high bits
    are not that many copies of one position (something was added twice or out of place)."""
    mask = values & ((1 << n) - 1)
    count = torch.tensor([bin(int(m)).count("1") for m in mask.tolist()], dtype=torch.int64)
    high = values >> n
    position = high // count.clamp(min=1)
    return mask, position, (position * count == high) & (count > 0)


def ranks_of(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def chunk_bounds(numel: int, n: int) -> list[int]:
    """Start index of each of ``torch.tensor_split``'s n chunks, and numel at the end."""
    sizes = [len(c) for c in torch.tensor_split(torch.empty(numel), n)]
    return [sum(sizes[:i]) for i in range(n + 1)]


def expected_sends(rank: int, n: int) -> list[dict]:
    """What rank ``rank`` sends, round by round: reduce-scatter round s the chunk (r - s) mod N
    holding ranks r-s..r, all-gather round s the chunk (r + 1 - s) mod N holding every rank."""
    reduce_scatter = [
        {
            "phase": "reduce-scatter",
            "round": s + 1,
            "chunk": (rank - s) % n,
            "ranks": sorted((rank - j) % n for j in range(s + 1)),
        }
        for s in range(n - 1)
    ]
    all_gather = [
        {
            "phase": "all-gather",
            "round": s + 1,
            "chunk": (rank + 1 - s) % n,
            "ranks": list(range(n)),
        }
        for s in range(n - 1)
    ]
    return reduce_scatter + all_gather


def describe_sends(sent: list[torch.Tensor], numel: int, n: int) -> list[dict]:
    """Which chunk each sent message was and which ranks it held (-1 / [] when it is no chunk)."""
    bounds = chunk_bounds(numel, n)
    out = []
    for t in sent:
        mask, position, consistent = decode(t.flatten(), n)
        chunk = -1
        ranks = []
        if len(t) and bool(consistent.all()) and bool((mask == mask[0]).all()):
            first = int(position[0])
            chunk = next((c for c in range(n) if bounds[c] == first), -1)
            if chunk >= 0 and not torch.equal(position, torch.arange(first, first + len(t))):
                chunk = -1
            ranks = ranks_of(int(mask[0]))
        out.append({"chunk": chunk, "ranks": ranks, "numel": t.numel()})
    return out


def ring_worker(numel: int, steps: int, vs_torch: bool, seed: int) -> dict:
    ring = exercise("collectives")
    rank = dist.get_rank()
    n = dist.get_world_size()
    device = rank_device()
    coded_numel = CODED_PER_RANK * n
    coded = coded_tensor(coded_numel, rank, n).to(device)
    with CommLedger(keep_sent=True) as coded_ledger:
        ring.ring_all_reduce(coded)
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
        "sent_per_call": ledger.calls_by_op().get("isend", [])
        + ledger.calls_by_op().get("send", []),
        "coded_numel": coded_numel,
        "coded_result": coded.cpu(),
        "coded_sends": describe_sends(coded_ledger.sent_tensors, coded_numel, n),
        "tensor_bytes": floats.numel() * floats.element_size(),
        "step_time_s": step_time,
        "torch_step_time_s": torch_time,
    }


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 120.0,
    **options,
) -> RunSummary:
    """Run the ring all-reduce on ``nproc`` ranks (default ``LAB.ranks``; ``options``: ``Options``)
    and check it; returns the lab summary."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    per_rank = launch(
        ring_worker,
        nproc,
        o.numel,
        steps,
        vs_torch,
        o.seed,
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
        max_abs_diff=max(r["max_abs_diff"] for r in per_rank),
        max_rel_diff=max(r["max_rel_diff"] for r in per_rank),
    )
    summary.add_checks(ring_checks(per_rank, numel=o.numel, backend=per_rank.backend))
    return summary


# --- the verdict ----------------------------------------------------------------------------------
def ring_checks(per_rank: list[dict], *, numel: int, backend: str) -> list[Check]:
    """The checks of a ring run (module docstring), each with the classic cause when it fails."""
    from labs.train import rule

    n = len(per_rank)
    int_bad = [r["rank"] for r in per_rank if not r["exact_int"]]
    checks = [
        Check(
            "integer sum equals dist.all_reduce",
            not int_bad,
            f"differs on rank {int_bad[0]}" if int_bad else "equal",
            "equal",
            where=f"{n} ranks, int64",
            hint="" if not int_bad else "see the coded integers' check for which elements",
            against="reference",
        ),
        coded_result_check(per_rank),
        chunk_order_check(per_rank),
        Check(
            "float sum within rounding",
            max(r["max_rel_diff"] for r in per_rank) <= rule("value", backend=backend).rel,
            max(r["max_rel_diff"] for r in per_rank),
            0.0,
            rule("value", backend=backend).rel,
            where="worst rank, fp32",
            hint="the float sums differ by more than rounding: see the integer checks",
            against="reference",
        ),
    ]
    sizes = [b - a for a, b in zip(chunk_bounds(numel, n), chunk_bounds(numel, n)[1:])]
    itemsize = per_rank[0]["tensor_bytes"] // numel
    expected = [
        [sizes[send["chunk"]] * itemsize for send in expected_sends(r["rank"], n)] for r in per_rank
    ]
    checks.append(
        calls_check(
            "bytes per send",
            [r["sent_per_call"] for r in per_rank],
            expected,
            world_size=n,
            count_hint=f"a ring all-reduce sends 2(N-1) = {2 * (n - 1)} chunks per rank: N-1 rounds"
            " of reduce-scatter, then N-1 of all-gather; count the rounds of each loop",
            hint="a send carried another size than its chunk: send one chunk of "
            "torch.tensor_split(flat, N) per round",
        )
    )
    checks.append(
        compare_values(
            "bytes sent per rank",
            [r["sent_bytes"] for r in per_rank],
            [float(sum(e)) for e in expected],
            tolerance=1e-9,
            where="2(N-1)/N K (its chunks' bytes when N does not divide K)",
            world_size=n,
            what="bytes sent",
        )
    )
    return checks


def coded_result_check(per_rank: list[dict]) -> Check:
    """Every element of the coded result holds every rank, once, at its own position."""
    n = len(per_rank)
    everyone = (1 << n) - 1
    for r in per_rank:
        result = r["coded_result"]
        mask, position, consistent = decode(result, n)
        good = (mask == everyone) & (position == torch.arange(len(result))) & consistent
        if bool(good.all()):
            continue
        # the most telling element first: one out of place, then one counted twice, then one
        # missing ranks
        misplaced = ~good & consistent & (position != torch.arange(len(result)))
        for kind in (misplaced, ~good & ~consistent, ~good):
            if bool(kind.any()):
                i = int(kind.nonzero()[0, 0])
                break
        held = ranks_of(int(mask[i]))
        where = f"rank {r['rank']}, element {i} of {len(result)}"
        if not bool(consistent[i]):
            hint = (
                "an element came out as a sum that counts some rank more than once: a chunk was "
                "added twice (the all-gather must copy the reduced chunk it receives, not add it)"
            )
        elif int(position[i]) != i:
            hint = (
                f"element {i} holds the sum of position {int(position[i])}: a received chunk was"
                " stored at another index than the one that was sent (check the receive index,"
                " (r - s - 1) mod N in the reduce-scatter, (r - s) mod N in the all-gather)"
            )
        else:
            hint = (
                f"element {i} holds only ranks {held} of {list(range(n))}: the reduce-scatter "
                "must add each received chunk to its own (+=, not an overwrite), and the "
                "all-gather must pass on the reduced chunks"
            )
        return Check(
            "coded integers: every rank, once, in place",
            False,
            f"ranks {held} at position {int(position[i])}",
            f"ranks {list(range(n))} at position {i}",
            where=where,
            hint=hint,
            against="reference",
        )
    return Check(
        "coded integers: every rank, once, in place",
        True,
        "every element",
        "every rank at its position",
        where=f"{n} ranks",
        against="reference",
    )


def chunk_order_check(per_rank: list[dict]) -> Check:
    """Every message the ring sent was the chunk the algorithm names, holding the ranks it names."""
    n = len(per_rank)
    for r in per_rank:
        expected = expected_sends(r["rank"], n)
        sent = r["coded_sends"]
        for got, want in zip(sent, expected):
            if (got["chunk"], got["ranks"]) == (want["chunk"], want["ranks"]):
                continue
            where = f"rank {r['rank']}, {want['phase']} round {want['round']}"
            rule_ = "(r - s) mod N" if want["phase"] == "reduce-scatter" else "(r + 1 - s) mod N"
            if got["chunk"] != want["chunk"]:
                hint = (
                    f"rank {r['rank']} sent chunk {got['chunk']} in {want['phase']} round "
                    f"{want['round']}, expected chunk {want['chunk']}: check the {rule_} index"
                    " (round s counts from 0)"
                )
            else:
                hint = (
                    f"rank {r['rank']} sent chunk {got['chunk']} holding ranks {got['ranks']}, "
                    f"expected ranks {want['ranks']}: "
                    + (
                        "the chunk a rank sends on must already hold what it received"
                        if want["phase"] == "reduce-scatter"
                        else "the all-gather sends fully reduced chunks, starting from the one"
                        " the reduce-scatter left complete, (r + 1) mod N"
                    )
                )
            return Check(
                "chunk sent in each round",
                False,
                f"chunk {got['chunk']}, ranks {got['ranks']}",
                f"chunk {want['chunk']}, ranks {want['ranks']}",
                where=where,
                hint=hint,
                against="theory",
            )
        if len(sent) != len(expected):
            return Check(
                "chunk sent in each round",
                False,
                f"{len(sent)} sends",
                f"{len(expected)} sends",
                where=f"rank {r['rank']}",
                hint=f"a ring all-reduce sends 2(N-1) = {len(expected)} chunks per rank",
                against="theory",
            )
    return Check(
        "chunk sent in each round",
        True,
        "as the algorithm names",
        "(r - s) mod N, then (r + 1 - s) mod N",
        where=f"{n} ranks, {2 * (n - 1)} sends each",
        against="theory",
    )


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
