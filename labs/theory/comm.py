"""Communication volume of the collectives, per rank: the formulas the ledger is checked against.

Symbols: ``K`` bytes of the tensor the collective is about (the full tensor for all-reduce,
the full gathered output for all-gather, the full input for reduce-scatter), ``N`` ranks
in the group. Bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; the
Ultra-Scale Playbook, appendix A0) send:

    all-reduce      2 (N-1)/N K    = a reduce-scatter followed by an all-gather
    reduce-scatter    (N-1)/N K
    all-gather        (N-1)/N K
    all-to-all        (N-1)/N K    (even split: keep 1/N, send the rest)
    broadcast         (N-1)/N K    per rank on average (pipelined chain)

Time is another matter for a broadcast: the root must send all K bytes, so at a rank's
bandwidth B it takes K/B, not (N-1)/N·K/B. ``collective_seconds`` uses nccl-tests' bus factors
(doc/PERFORMANCE.md and src/*.cu: t = K·f/B with f = 2(N-1)/N for all-reduce, (N-1)/N for
reduce-scatter, all-gather and all-to-all, 1 for broadcast and reduce), and ``bus_bandwidth``
is nccl-tests' busbw = K/t · f.

Pure Python: no torch needed.
"""

from __future__ import annotations


def _check(k: float, n: int) -> None:
    if k < 0:
        raise ValueError(f"tensor bytes K must be >= 0, got {k}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group size N must be an integer >= 1, got {n!r}")


def all_reduce_bytes(k: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a K-byte tensor over N ranks."""
    _check(k, n)
    return 2 * (n - 1) / n * k


def reduce_scatter_bytes(k: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of a K-byte input."""
    _check(k, n)
    return (n - 1) / n * k


def all_gather_bytes(k: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather producing a K-byte output."""
    _check(k, n)
    return (n - 1) / n * k


def all_to_all_bytes(k: float, n: int) -> float:
    """Bytes each rank sends in an evenly split all-to-all of a K-byte input."""
    _check(k, n)
    return (n - 1) / n * k


def broadcast_bytes(k: float, n: int) -> float:
    """Average bytes per rank in a pipelined-chain broadcast of K bytes."""
    _check(k, n)
    return (n - 1) / n * k


BYTES_PER_RANK = {
    "all_reduce": all_reduce_bytes,
    "reduce_scatter": reduce_scatter_bytes,
    "all_gather": all_gather_bytes,
    "all_to_all": all_to_all_bytes,
    "broadcast": broadcast_bytes,
}


# nccl-tests' bus factor f per collective: its time is f·K/B on links of B bytes/s per rank
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,  # all K bytes leave the root
}


def collective_seconds(op: str, k: float, n: int, bandwidth: float) -> float:
    """Seconds collective ``op`` of K bytes over N ranks takes at ``bandwidth`` bytes/s per rank
    (the bus factor's f·K/B): for a broadcast K/B, which its bytes per rank on average would
    underestimate by (N-1)/N."""
    _check(k, n)
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return BUS_FACTOR[op](n) * k / bandwidth


def ring_steps(op: str, n: int) -> int:
    """Rounds of neighbour exchange in the ring algorithm: N-1 per phase."""
    return 2 * (n - 1) if op == "all_reduce" else (n - 1)


def bus_bandwidth(op: str, k: float, n: int, seconds: float) -> float:
    """Bus bandwidth (bytes/s), as nccl-tests defines it: the algorithm bandwidth K / t times the
    bus factor (``BUS_FACTOR``). For an ideal ring it does not depend on N."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    _check(k, n)
    return k / seconds * BUS_FACTOR[op](n)


def collective(op: str, k: float, n: int, *, bandwidth_gbs: float | None = None) -> dict:
    """One collective's figures (``python -m labs.theory comm``): ``bytes_per_rank`` and
    ``ring_steps``, and with a per-rank ``bandwidth_gbs`` (GB/s) the ``seconds`` it takes
    (``collective_seconds``)."""
    if op not in BYTES_PER_RANK:
        raise ValueError(f"op={op!r} is not one of {tuple(sorted(BYTES_PER_RANK))}")
    sent = BYTES_PER_RANK[op](k, n)
    result = {
        "op": op,
        "tensor_bytes": k,
        "ranks": n,
        "bytes_per_rank": sent,
        "ring_steps": ring_steps(op, n),
    }
    if bandwidth_gbs is not None:
        if bandwidth_gbs <= 0:
            raise ValueError(f"--bandwidth-gbs must be > 0, got {bandwidth_gbs}")
        result["seconds"] = collective_seconds(op, k, n, bandwidth_gbs * 1e9)
    return result


def format_collective(r: dict) -> str:
    """``collective``'s result as one sentence."""
    text = (
        f"{r['op']} of {r['tensor_bytes']:.4g} B over {r['ranks']} ranks: "
        f"{r['bytes_per_rank']:.4g} B sent per rank in {r['ring_steps']} ring steps"
    )
    if "seconds" in r:
        text += f", {r['seconds'] * 1e3:.3g} ms at the given bandwidth"
    return text
