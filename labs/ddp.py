# Your exercise module, generated from solutions/ddp.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 02 (notebooks/02_data_parallel.ipynb): data parallelism (DDP) from scratch.

    model = BucketedDDP(build_model(cfg, device=rank_device()), bucket_mb=0.1)
    # every rank now holds rank 0's weights, on its own device (the GPU under NCCL)
    optimizer = make_optimizer(model.parameters(), train_cfg)
    for micro_batches in rank_data(train_cfg, grad_accum=2):
        loss = train_step(model, optimizer, micro_batches)

**What is sharded: the data, nothing else.** Each of the N ranks of ``group`` holds the
whole model, its whole gradient and the whole optimizer state (memory per rank is the
single-process figure), and runs forward and backward on B/N of the global batch of B
sequences. The loss is a mean over the batch, so the mean of the N ranks' gradients is
the gradient of the global batch: after the all-reduce every rank takes the same
optimizer step a single process would take on the whole batch.

**Communication contract** (data-parallel group of N ranks; G = bytes of the gradients
that exist, Ψ·4 in fp32; P = bytes of parameters and buffers):

    when        what                                                 bytes sent per rank
    wrap time   broadcast every parameter and buffer from the        (N-1)/N · P, once
                group's first rank
    forward     nothing
    backward    all-reduce (sum) of every gradient, then ÷N          2 (N-1)/N · G per step
    no_sync()   nothing: gradients accumulate locally; the next
                synchronised backward reduces the sum

How the backward's all-reduces are issued:

    NaiveDDP        one blocking all-reduce per tensor, after backward: nothing overlaps
    OverlappedDDP   one async all-reduce per tensor, launched by its gradient hook
    BucketedDDP     one async all-reduce per bucket of >= bucket_mb MiB, in backward order

``labs.theory.comm.all_reduce_bytes(G, N)``; calls and bucket boundaries:
``labs.theory.overlap.all_reduce_calls`` and ``bucket_layout`` (BucketedDDP reduces its
whole buckets, so its G counts every trainable parameter, used or not).

Every rank must issue the same collectives in the same order. The ranks run the same
model, so autograd finishes the gradients in the same order everywhere, and a
parameter without a gradient (frozen, or unused by the forward) is so on every rank.

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, §3.2 (naive, overlap, bucketing; no_sync in §3.2.4); the
Ultra-Scale Playbook, "Data Parallelism".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.data import rank_batches
from labs.runtime.device import rank_device
from labs.theory.dims import check_divides, check_positive
from labs.theory.overlap import MiB
from labs.train import TrainConfig

NOTEBOOK = "02_data_parallel.ipynb"


def broadcast_parameters(module: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer of ``module`` with the group's first rank's, in place.

    One ``dist.broadcast`` per tensor, from the *global* rank of the group's rank 0
    (``dist.get_global_rank``; with ``group=None`` that is rank 0). Frozen parameters and
    buffers too: every rank must compute the same function. A tied weight is one tensor
    and is broadcast once (``module.parameters()`` lists it once).
    """
    raise NotImplementedError(
        "exercise broadcast_parameters is not written yet: "
        "see its docstring and notebooks/02_data_parallel.ipynb"
    )


class _DataParallel(nn.Module):
    """What the three wrappers share: the wrapped module, the group, ``forward`` and ``no_sync``."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.require_backward_grad_sync = True  # False inside no_sync(): hooks must not communicate
        # Unique trainable parameters in registration order (a tied weight once).
        self.params = [p for p in module.parameters() if p.requires_grad]
        broadcast_parameters(module, group=group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients locally (nanoGPT flips
        the same flag, ``require_backward_grad_sync``, on torch's DDP)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


class NaiveDDP(_DataParallel):
    """Data parallelism at its simplest: after backward, all-reduce the gradients one by one.
    The whole communication time is added to every step (nothing overlaps with compute)."""

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None):
        super().__init__(module, group)

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward: sum each trainable parameter's
        ``.grad`` over the group with a blocking ``dist.all_reduce`` and divide by N, so every
        rank holds the mean gradient. Skip parameters whose ``.grad`` is None (frozen or unused:
        so on every rank). One call per gradient tensor."""
        raise NotImplementedError(
            "exercise NaiveDDP.finish_gradient_synchronization is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )


class OverlappedDDP(_DataParallel):
    """All-reduce each gradient as soon as autograd has finished it, while backward goes on
    computing the earlier layers' gradients: communication hides behind compute."""

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None):
        super().__init__(module, group)
        # (gradient, its all-reduce in flight)
        self.pending: list[tuple[torch.Tensor, dist.Work]] = []
        # Register ``self.on_gradient_ready`` as a post-accumulate-grad hook on every trainable
        # parameter (``p.register_post_accumulate_grad_hook``); keep the handles in self.handles.
        raise NotImplementedError(
            "exercise OverlappedDDP.__init__ is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )

    def on_gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once per backward when ``param.grad`` holds its (accumulated)
        gradient. Unless inside ``no_sync()``, launch ``dist.all_reduce(param.grad, async_op=True)``
        on the group and remember the gradient and the returned work handle. Do not wait here."""
        raise NotImplementedError(
            "exercise OverlappedDDP.on_gradient_ready is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward: wait for every all-reduce in
        flight, divide each gradient by N, and forget them (the next step starts empty)."""
        raise NotImplementedError(
            "exercise OverlappedDDP.finish_gradient_synchronization is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )


class BucketedDDP(_DataParallel):
    """Fewer, larger all-reduces: gradients are copied into flat buckets of about
    ``bucket_mb`` MiB, and a bucket is all-reduced (async) once all its gradients are in.

    Buckets hold the trainable parameters in *reverse* registration order, the order
    backward produces their gradients (torch's DDP starts from the same guess). Walk them,
    add each parameter to the open bucket and close the bucket once it holds at least
    ``bucket_mb * MiB`` bytes (``labs.theory.overlap.bucket_layout``'s rule). Each bucket
    is one flat buffer of the parameters' dtype; a parameter owns the slice at its offset. Costs G
    extra bytes per rank for the buffers (torch avoids it with ``gradient_as_bucket_view``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
    ):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 (MiB per bucket), got {bucket_mb!r}")
        super().__init__(module, group)
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("BucketedDDP needs every trainable parameter on one dtype and device")
        self.bucket_bytes = bucket_mb * MiB
        # flat gradient buffers, [numel of the bucket]
        self.buckets: list[torch.Tensor] = []
        # the parameters of each bucket, in backward order
        self.bucket_params: list[list[nn.Parameter]] = []
        # parameter -> (bucket index, offset in it)
        self.slots: dict[nn.Parameter, tuple[int, int]] = {}
        # Fill the three attributes above as the class docstring says, and register
        # ``self.on_gradient_ready`` as a post-accumulate-grad hook on every trainable parameter.
        raise NotImplementedError(
            "exercise BucketedDDP.__init__ is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )
        # each bucket's all-reduce in flight
        self.works: list[dist.Work | None] = [None] * len(self.buckets)
        # the gradients copied in this step
        self.arrived: list[set[nn.Parameter]] = [set() for _ in self.buckets]
        self._views = {
            p: self.buckets[i][offset : offset + p.numel()].view_as(p)  # each parameter's slot
            for p, (i, offset) in self.slots.items()
        }

    def _slice(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s slot in its bucket (a view, shaped like ``param``)."""
        return self._views[param]

    def on_gradient_ready(self, param: nn.Parameter) -> None:
        """Gradient hook. Unless inside ``no_sync()``: copy ``param.grad`` into its slot, note
        that it arrived, and when the bucket's last gradient is in, launch its all-reduce with
        ``async_op=True`` and keep the work handle in ``self.works[bucket]``. Do not wait."""
        raise NotImplementedError(
            "exercise BucketedDDP.on_gradient_ready is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward. A bucket not yet launched holds
        a parameter that got no gradient: zero that slot and launch it now (calls = buckets on
        every rank). Wait for every bucket, divide by N, copy each slice back into the ``.grad``
        of the parameters that got one (the others keep ``grad=None``, as in a single process),
        then reset ``works`` and ``arrived`` for the next step."""
        raise NotImplementedError(
            "exercise BucketedDDP.finish_gradient_synchronization is not written yet: "
            "see its docstring and notebooks/02_data_parallel.ipynb"
        )


def rank_data(
    cfg: TrainConfig, *, group: dist.ProcessGroup | None = None, grad_accum: int = 1
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's data: for each of ``cfg.steps`` steps, ``grad_accum`` micro-batches (x, y),
    each ``[B/(N·K), T]`` (B = ``cfg.batch_size``, the global batch; K = ``grad_accum``), on
    this rank's device (``rank_device()``: its GPU under NCCL, where the model is).

    Take this rank's batches of B/N sequences from ``labs.data.rank_batches`` (a
    ``DistributedSampler``: rank r of N gets a disjoint slice of one permutation seeded
    with ``cfg.data_seed``; ``seq_len=cfg.seq_len``), r and N being this rank's place in
    ``group``, move them to ``rank_device()`` and split each batch along dim 0 into K
    micro-batches. The N ranks' batches of a step, in rank order, are then exactly the
    single-process global batch (``labs.train.data_for``).
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    check_positive(grad_accum=grad_accum)
    check_divides(cfg.batch_size, "batch_size", n * grad_accum, "dp*grad_accum")
    raise NotImplementedError(
        "exercise rank_data is not written yet: "
        "see its docstring and notebooks/02_data_parallel.ipynb"
    )


def train_step(
    model: _DataParallel,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """One optimizer step over this rank's ``micro_batches`` (gradient accumulation over K of them).

    Zero the gradients (``set_to_none=True``); for each micro-batch run ``model(x, y)``
    and backward on ``loss / K`` (so the K gradients add up to the batch mean's), the first
    K-1 inside ``model.no_sync()`` so that only the last backward communicates; then
    ``model.finish_gradient_synchronization()`` and ``optimizer.step()``. Returns this rank's
    loss: the mean of its K micro-batch losses (unscaled), a Python float.
    """
    raise NotImplementedError(
        "exercise train_step is not written yet: "
        "see its docstring and notebooks/02_data_parallel.ipynb"
    )
