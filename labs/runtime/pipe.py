"""A rank's place in a pipeline, and point-to-point exchanges with its neighbours.

The stages of a pipeline (notebook 05; the layer placement of notebook 09; the pipeline axis of the
mesh in notebook 08) sit on a ring of the pipeline's group: stage s receives from s-1 and sends to
s+1, and the last stage's *next* is the first (interleaving wraps around; generation sends the new
tokens back to the first stage that way).

    pipe = pipe_group(group, dtype=torch.bfloat16)            # who my neighbours are; what
                                                              # travels is bf16
    received = p2p(pipe, send_next=out, recv_next=shape)      # one batch of sends and receives
    grad = received.from_next                                 # [b, T, H], bf16

An activation or gradient travels in the stages' compute dtype (``Pipe.dtype``) on this rank's
device: the receiver allocates it from the shape it expects, and a floating-point send in another
dtype is refused, since a receiver of the wrong dtype would read garbage or wait for bytes that
never come.

Everything is point to point on the pipeline's group; the schedules built on it are the exercises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from labs.runtime.device import rank_device
from labs.runtime.ring import ring_neighbours


@dataclass(frozen=True)
class Pipe:
    """Where this rank sits in the pipeline; neighbours are cyclic (interleaving wraps around)."""

    group: dist.ProcessGroup | None  # the pipeline's process group (None: WORLD)
    rank: int  # position in the group = stage index (of chunk 0)
    size: int  # P
    prev: int  # global rank of position rank-1 (mod P)
    next: int  # global rank of position rank+1 (mod P)
    device: torch.device  # where received tensors live (the GPU under NCCL)
    dtype: torch.dtype = torch.float32  # what activations and gradients travel in: the stages'


def pipe_group(
    group: dist.ProcessGroup | None = None, *, dtype: torch.dtype = torch.float32
) -> Pipe:
    """This rank's :class:`Pipe` in ``group`` (default WORLD): its neighbours on the group's
    ring, its device, and ``dtype``, the dtype of the stages' activations (the model's)."""
    ring = ring_neighbours(group)
    return Pipe(
        group=group,
        rank=ring.rank,
        size=ring.size,
        prev=ring.prev,
        next=ring.next,
        device=rank_device(),
        dtype=dtype,
    )


class Received(NamedTuple):
    """What one :func:`p2p` batch received: None where nothing was asked."""

    from_prev: torch.Tensor | None  # from the previous stage: an activation [b, T, H]
    from_next: torch.Tensor | None  # from the next stage: a gradient [b, T, H]


def p2p(
    pipe: Pipe,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: tuple[int, ...] | None = None,
    recv_next: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> Received:
    """One batch of point-to-point operations with the neighbours (``dist.batch_isend_irecv``),
    waited for.

    ``send_next`` / ``send_prev``: tensors for the next / previous stage; ``recv_prev`` /
    ``recv_next``: shapes (e.g. [b, T, H]) to receive from them, in ``dtype`` (default
    ``pipe.dtype``, the stages'). A floating-point send in another dtype is a ValueError (integer
    messages, e.g. generated token ids, go as they are). A send and a
    receive posted in one batch cannot deadlock when both neighbours send at once (1F1B's steady
    state).
    """
    dtype = dtype or pipe.dtype
    for name, tensor in (("send_next", send_next), ("send_prev", send_prev)):
        if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            raise ValueError(
                f"{name} is {tensor.dtype} but this pipe's messages are {dtype}: build the pipe"
                f" with pipe_group(..., dtype={tensor.dtype}) (the stages' dtype)"
            )
    from_prev = None
    from_next = None
    if recv_prev is not None:
        from_prev = torch.empty(recv_prev, dtype=dtype, device=pipe.device)
    if recv_next is not None:
        from_next = torch.empty(recv_next, dtype=dtype, device=pipe.device)
    ops = [
        dist.P2POp(op, tensor, peer, pipe.group)
        for op, tensor, peer in (
            (dist.isend, send_next, pipe.next),
            (dist.isend, send_prev, pipe.prev),
            (dist.irecv, from_prev, pipe.prev),
            (dist.irecv, from_next, pipe.next),
        )
        if tensor is not None
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return Received(from_prev, from_next)
