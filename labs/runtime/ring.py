"""Ranks on a ring: who my neighbours are, and one exchange with them.

Notebook 00's ring all-reduce, notebook 06's ring attention and notebook 05's pipeline all place the
ranks of a group on a ring, position r talking to r+1 and r-1 (mod N). The helpers here are the
plumbing they share; the algorithms built on them are the exercises.

A send and a receive are posted together (``dist.batch_isend_irecv``): if every rank first sent
with a blocking ``send``, every rank would wait for a receiver and the ring would deadlock.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class RingPeers(NamedTuple):
    """This rank's place on the ring of a group."""

    rank: int  # my position in the group
    size: int  # N, the ranks on the ring
    next: int  # global rank of position rank+1 (mod N)
    prev: int  # global rank of position rank-1 (mod N)


def ring_neighbours(group: dist.ProcessGroup | None = None) -> RingPeers:
    """My position on the ring of ``group`` (default WORLD), its size and my two neighbours'
    *global* ranks (what ``send``/``recv`` take, also on a sub-group)."""
    me = dist.get_rank(group)
    n = dist.get_world_size(group)
    if group is None:
        return RingPeers(me, n, next=(me + 1) % n, prev=(me - 1) % n)
    return RingPeers(
        me,
        n,
        next=dist.get_global_rank(group, (me + 1) % n),
        prev=dist.get_global_rank(group, (me - 1) % n),
    )


def post_exchange(
    send_buf: torch.Tensor,
    recv_buf: torch.Tensor,
    to_rank: int,
    from_rank: int,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> list[dist.Work]:
    """Start sending ``send_buf`` to ``to_rank`` and receiving ``recv_buf`` from ``from_rank``,
    both posted at once (neither side waits for the other to go first). Returns the works to wait
    on."""
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send_buf, to_rank, group, tag),
            dist.P2POp(dist.irecv, recv_buf, from_rank, group, tag),
        ]
    )


def exchange(
    send_buf: torch.Tensor,
    recv_buf: torch.Tensor,
    to_rank: int,
    from_rank: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``send_buf`` to ``to_rank`` while receiving ``recv_buf`` from ``from_rank``; wait for
    both."""
    for work in post_exchange(send_buf, recv_buf, to_rank, from_rank, group):
        work.wait()
