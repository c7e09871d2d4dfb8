"""What each collective does, on paper: every rank's data before and after. Drives the
collective visualizer of notebook 00 (``labs.widgets.collectives``). Pure Python.

Rank r starts with N chunks; chunk i of rank r holds the number (r+1)*10 + i, so a
sum shows which ranks contributed. A cell is ``(value, sources)``: ``sources`` is the
set of ranks whose data reached it (one rank: a copy; several: a reduction).
"""

from __future__ import annotations

from typing import NamedTuple

from labs.theory.comm import BYTES_PER_RANK

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

DESCRIPTIONS = {
    "all_reduce": "every rank ends with the sum of all ranks' tensors",
    "broadcast": "the root's tensor is copied to every rank",
    "all_gather": "every rank contributes its one chunk and ends with all N chunks",
    "reduce_scatter": "chunk i is summed over all ranks and rank i keeps it",
    "all_to_all": "rank r sends its chunk j to rank j: a transpose of the chunk matrix",
    "send_recv": "point to point: each rank sends its tensor to the next rank in a ring",
}


class Cell(NamedTuple):
    """One chunk of one rank's tensor."""

    value: int
    sources: frozenset[int]  # the ranks whose data reached it


def initial(n: int, chunks: int | None = None) -> list[list[Cell]]:
    """Every rank's chunks before a collective: rank r's chunk i holds (r+1)*10 + i."""
    chunks = n if chunks is None else chunks
    return [[Cell((r + 1) * 10 + i, frozenset({r})) for i in range(chunks)] for r in range(n)]


def _sum(cells: list[Cell]) -> Cell:
    return Cell(
        value=sum(c.value for c in cells),
        sources=frozenset().union(*(c.sources for c in cells)),
    )


def simulate(op: str, n: int, root: int = 0) -> dict:
    """Before and after for collective ``op`` on ``n`` ranks; also bytes sent per rank,
    in units of one chunk (a rank's whole tensor is N chunks, except for all-gather's
    input, which is one)."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
        raise ValueError(f"world size must be an integer between 1 and 16, got {n!r}")
    if not 0 <= root < n:
        raise ValueError(f"root={root} must be a rank in 0..{n - 1}")
    before = initial(n, chunks=1 if op == "all_gather" else n)
    if op == "all_reduce":
        after = [[_sum([before[r][i] for r in range(n)]) for i in range(n)] for _ in range(n)]
    elif op == "broadcast":
        after = [list(before[root]) for _ in range(n)]
    elif op == "all_gather":
        after = [[before[r][0] for r in range(n)] for _ in range(n)]
    elif op == "reduce_scatter":
        after = [[_sum([before[r][i] for r in range(n)])] for i in range(n)]
    elif op == "all_to_all":
        after = [[before[src][dst] for src in range(n)] for dst in range(n)]
    else:  # send_recv
        after = [list(before[(r - 1) % n]) for r in range(n)]
    full = n  # chunks in the whole tensor K
    if op == "send_recv":
        sent = full if n > 1 else 0
    else:
        sent = BYTES_PER_RANK[op](full, n)
    return {
        "op": op,
        "world_size": n,
        "before": before,
        "after": after,
        "description": DESCRIPTIONS[op],
        "chunks_sent_per_rank": sent,
        "tensor_chunks": full,
    }
