"""A rank's place in a pipeline, point-to-point exchanges with its neighbours, and the record of
what its stages compute.

The stages of a pipeline (notebook 05; the layer placement of notebook 09; the pipeline axis of the
mesh in notebook 08) sit on a ring of the pipeline's group: stage s receives from s-1 and sends to
s+1, and the last stage's *next* is the first (interleaving wraps around; generation sends the new
tokens back to the first stage that way).

    pipe = pipe_group(group, dtype=torch.bfloat16)            # who my neighbours are; what
                                                              # travels is bf16
    received = p2p(pipe, send_next=out, recv_next=shape)      # one batch of sends and receives
    grad = received.from_next                                 # [b, T, H], bf16
    sending = p2p(pipe, send_prev=grad_in, wait_sends=False)  # the send travels on ...
    sending.wait()                                            # ... until waited for

``p2p`` is the one way the schedules talk. An activation or gradient travels in the stages' compute
dtype (``Pipe.dtype``) on this rank's device: the receiver allocates it from the shape it expects,
and a floating-point send in another dtype is refused, since a receiver of the wrong dtype would
read garbage or wait for bytes that never come. Activations (towards the next stage) and gradients
(towards the previous one) travel under two tags, so a pair of ranks that exchanges both (two
stages of an interleaved pipeline, P = 2) never matches one with the other; within a direction,
messages arrive in the order they were sent.

``record_ops`` is for the lab, not the lesson: it puts the stage operations a schedule runs
(forward, backward, the weights' backward) on a timeline, so that the schedules' signatures carry
no instrumentation.

Everything is point to point on the pipeline's group; the schedules built on it are the exercises.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.runtime.device import rank_device
from labs.runtime.ring import ring_neighbours

if TYPE_CHECKING:
    from labs.measure.timeline import Timeline

# The tag of a message by its direction: activations go forward, gradients back.
FORWARD_TAG = 0
BACKWARD_TAG = 1


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
    """What one :func:`p2p` batch received (None where nothing was asked), and the sends it left
    in flight (``wait_sends=False``), which :meth:`wait` waits for."""

    from_prev: torch.Tensor | None  # from the previous stage: an activation [b, T, H]
    from_next: torch.Tensor | None  # from the next stage: a gradient [b, T, H]
    sending: tuple[dist.Work, ...] = ()  # sends still in flight

    def wait(self) -> None:
        """Return once every send of the batch has left."""
        for work in self.sending:
            work.wait()


def p2p(
    pipe: Pipe,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: tuple[int, ...] | None = None,
    recv_next: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    wait_sends: bool = True,
) -> Received:
    """One batch of point-to-point operations with the neighbours (``dist.batch_isend_irecv``);
    returns once its receives have arrived.

    ``send_next`` / ``send_prev``: tensors for the next / previous stage (their values: a message
    never carries autograd's graph); ``recv_prev`` / ``recv_next``: shapes (e.g. [b, T, H]) to
    receive from them, in ``dtype`` (default ``pipe.dtype``, the stages'). A floating-point send in
    another dtype is a ValueError (integer messages, e.g. generated token ids, go as they are).

    ``wait_sends=True``: sends and receives are posted together and all waited for. A send and a
    receive posted in one batch cannot deadlock when both neighbours send at once (1F1B's steady
    state). ``wait_sends=False``: the sends are posted and left in flight (the result's ``wait()``
    waits for them) while the caller computes on; only the receives are waited for.
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
    sends = [
        dist.P2POp(dist.isend, tensor.detach(), peer, pipe.group, tag)
        for tensor, peer, tag in (
            (send_next, pipe.next, FORWARD_TAG),
            (send_prev, pipe.prev, BACKWARD_TAG),
        )
        if tensor is not None
    ]
    receives = [
        dist.P2POp(dist.irecv, tensor, peer, pipe.group, tag)
        for tensor, peer, tag in (
            (from_prev, pipe.prev, FORWARD_TAG),
            (from_next, pipe.next, BACKWARD_TAG),
        )
        if tensor is not None
    ]
    sending = ()
    if not wait_sends and sends:
        sending = tuple(dist.batch_isend_irecv(sends))
        sends = []
    if sends or receives:
        for work in dist.batch_isend_irecv(sends + receives):
            work.wait()
    return Received(from_prev, from_next, sending)


# --- the lab's record of a schedule: the pipe times the stages' operations, not the lesson -------
SPANS = {  # the pipeline exercise's stage operation -> its span on a timeline
    "forward_step": "F",
    "backward_step": "B",
    "backward_input_step": "B",  # ZB-H1's B: the input's gradient only
    "backward_weight_step": "W",  # ZB-H1's W: the weights' gradients
}


@contextmanager
def record_ops(
    lesson: ModuleType,
    timeline: Timeline,
    *,
    chunks: Sequence[nn.Module],
    targets: Sequence[torch.Tensor],
) -> Iterator[None]:
    """While the block runs, every stage operation of ``lesson`` (the pipeline exercise module)
    is a span on ``timeline``: ``forward_step`` "F", ``backward_step`` and ``backward_input_step``
    "B", ``backward_weight_step`` "W", and a forward of one of ``chunks`` called outside them (the
    naive placement's ``stage(x)``) "F". Each span carries ``microbatch`` and ``chunk``:

    * chunk c is ``chunks[c]`` (this rank's stages, in the order the schedule is given them);
    * a forward's micro-batch is i when its targets are ``targets[i]`` (the same tensor, or a
      view of the same memory); failing that, the chunk's k-th forward is micro-batch k;
    * a backward's is the micro-batch of the forward that made the output it starts from.

    The lab's harness opens it around one step (``labs.experiments.pp``); the schedules keep the
    lesson's signatures and call ``forward_step`` and its siblings as always: for the block's
    duration those names in ``lesson`` are timed wrappers (as ``trace_all_reduces`` wraps
    ``dist.all_reduce``), and the chunks carry forward hooks. Everything is restored on exit."""
    made: dict[int, tuple[int | None, int]] = {}  # id(output) -> (micro-batch, chunk)
    forwards = [0] * len(chunks)  # forwards of each chunk so far
    running: list[str] = []  # the operation inside which a stage's forward is no span of its own

    def chunk_of(stage: nn.Module) -> int:
        return next((c for c, s in enumerate(chunks) if s is stage), 0)

    def microbatch_of(y: torch.Tensor | None, chunk: int) -> int:
        k = forwards[chunk]
        forwards[chunk] += 1
        for i, t in enumerate(targets):
            if t is y or (y is not None and t.data_ptr() == y.data_ptr() and t.shape == y.shape):
                return i
        return k

    def timed(name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            if name == "forward_step":
                chunk = chunk_of(given["stage"])
                microbatch = microbatch_of(given["targets"], chunk)
            else:
                microbatch, chunk = made.get(id(given["output"]), (None, 0))
            with timeline.span(SPANS[name], microbatch=microbatch, chunk=chunk):
                running.append(name)
                try:
                    result = original(*args, **kwargs)
                finally:
                    running.pop()
            if name == "forward_step":
                made[id(result)] = (microbatch, chunk)
            elif name != "backward_input_step":  # B keeps the record for its W
                made.pop(id(given["output"]), None)
            return result

        return wrapper

    hook_spans: list[tuple[nn.Module, ExitStack]] = []

    def before(module: nn.Module, args) -> None:
        if running:
            return
        chunk = chunk_of(module)
        span = ExitStack()
        span.enter_context(timeline.span("F", microbatch=microbatch_of(None, chunk), chunk=chunk))
        hook_spans.append((module, span))

    def after(module: nn.Module, args, output) -> None:
        if hook_spans and hook_spans[-1][0] is module:
            hook_spans.pop()[1].close()

    originals = {name: getattr(lesson, name) for name in SPANS if hasattr(lesson, name)}
    handles = []
    try:
        for name, original in originals.items():
            setattr(lesson, name, timed(name, original))
        for chunk in chunks:
            handles.append(chunk.register_forward_pre_hook(before))
            handles.append(chunk.register_forward_hook(after, always_call=True))
        yield
    finally:
        for name, original in originals.items():
            setattr(lesson, name, original)
        for handle in handles:
            handle.remove()
