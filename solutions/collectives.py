"""Exercise 00 (notebooks/00_setup_and_collectives.ipynb): a ring all-reduce from send and recv.

The N ranks sit on a ring; each talks only to its neighbours. The tensor is cut into
N chunks (``torch.tensor_split``, so any size works: chunks may differ by one element).

    reduce-scatter phase, N-1 rounds: in round s rank r sends chunk (r - s) mod N to
        rank r+1 and adds the chunk (r - s - 1) mod N it receives from rank r-1.
        Afterwards rank r holds the full sum of chunk (r + 1) mod N.
    all-gather phase, N-1 rounds: in round s rank r sends chunk (r + 1 - s) mod N
        (fully reduced) to rank r+1 and stores chunk (r - s) mod N from rank r-1.

Communication contract, per rank, for a tensor of K bytes: 2 (N-1) rounds, each
sending one chunk of K/N bytes, so 2 (N-1)/N K bytes in all
(``labs.theory.comm.all_reduce_bytes``). Every round sends and receives at once
(``exchange`` of ``labs.runtime.ring``, on ``dist.batch_isend_irecv``): with blocking
``send`` first on every rank, all ranks would wait for a receiver and the ring would deadlock.
The neighbours come from ``ring_neighbours(group)``: global ranks, so a sub-group works.

Reference: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters
of workstations" (2009); the Ultra-Scale Playbook, appendix A0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labs.runtime.ring import exchange, ring_neighbours

NOTEBOOK = "00_setup_and_collectives.ipynb"
# The lab has one part, its core, and the minutes it takes at the notebook's pace
# (labs.check.parts); each function's docstring names its part.
PARTS = {"core": 45}


def ring_reduce_scatter(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Reduce-scatter phase on a ring, in place on ``chunks`` (this rank's N chunks).

    Afterwards chunk (me + 1) mod N holds the sum over all ranks. Returns that index.
    Sends N-1 chunks.

    Part: core.
    """
    ### BEGIN SOLUTION
    ring = ring_neighbours(group)
    me = ring.rank
    n = ring.size
    for s in range(n - 1):
        send_idx = (me - s) % n
        recv_idx = (me - s - 1) % n
        incoming = torch.empty_like(chunks[recv_idx])
        exchange(chunks[send_idx].contiguous(), incoming, ring.next, ring.prev, group)
        chunks[recv_idx] += incoming
    return (me + 1) % n
    ### END SOLUTION


def ring_all_gather(chunks: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """All-gather phase on a ring, in place on ``chunks``: rank r starts owning the reduced
    chunk (r + 1) mod N and ends holding every rank's reduced chunk. Sends N-1 chunks.

    Part: core.
    """
    ### BEGIN SOLUTION
    ring = ring_neighbours(group)
    me = ring.rank
    n = ring.size
    for s in range(n - 1):
        send_idx = (me + 1 - s) % n
        recv_idx = (me - s) % n
        incoming = torch.empty_like(chunks[recv_idx])
        exchange(chunks[send_idx].contiguous(), incoming, ring.next, ring.prev, group)
        chunks[recv_idx].copy_(incoming)
    ### END SOLUTION


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks of ``group``, in place, like ``dist.all_reduce``; returns it.

    tensor: any shape, any size (N need not divide it). Chunks are views of a flat copy
    (``tensor.view(-1)`` when contiguous), so the phases write straight into the result.
    Bytes sent per rank: 2 (N-1)/N * tensor bytes (exactly, when N divides numel).

    Part: core.
    """
    ### BEGIN SOLUTION
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, n))  # N views into flat
    ring_reduce_scatter(chunks, group)
    ring_all_gather(chunks, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
    ### END SOLUTION
