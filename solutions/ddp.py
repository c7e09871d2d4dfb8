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

**Mixed precision** (``MixedPrecisionOptimizer``; Micikevicius et al., "Mixed Precision
Training", ICLR 2018): cast the model to bf16 (or fp16) *before* wrapping it, so every rank
starts from the first rank's bf16 weights; forward and backward run in bf16 and the gradients
are bf16 (2 bytes per parameter, the calculator's figure). ``reduce_dtype=torch.float32`` sums
them over the ranks in fp32: each gradient (or bucket) is cast up, all-reduced (G = Ψ·4 bytes on
the wire instead of Ψ·2), divided by N and rounded back into the bf16 ``.grad`` once, where a
bf16 all-reduce rounds every partial sum. The optimizer keeps fp32 master weights and steps them
with the gradients cast to fp32, then rounds the masters back into the bf16 weights. fp16 also
scales the loss (``labs.train.LossScaler``): the master gradients are divided by the scale in
fp32, and a step whose gradients overflowed is skipped (the ranks hold the same averaged
gradients, so they all skip it). Per rank: 2Ψ (bf16 weights) + 2Ψ (bf16 gradients) + 4Ψ
(masters) + 8Ψ (AdamW's fp32 moments) = 16Ψ bytes, as ``labs.theory.memory`` counts bf16-mixed.

    model = build_model(cfg).to(torch.bfloat16)
    ddp = BucketedDDP(model, bucket_mb=0.1, reduce_dtype=torch.float32)
    optimizer = MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW, lr=3e-3)
    loss = train_step(ddp, optimizer, micro_batches)   # fp16: loss_scaler=LossScaler() too

References: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, §3.2 (naive, overlap, bucketing; no_sync in §3.2.4); the
Ultra-Scale Playbook, "Data Parallelism".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.data import rank_batches
from labs.runtime.device import rank_device
from labs.theory.dims import check_divides, check_positive
from labs.theory.overlap import MiB
from labs.train import LossScaler, TrainConfig, overflowed

NOTEBOOK = "02_data_parallel.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 60, "buckets": 25, "mixed-precision": 25}


def broadcast_parameters(module: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer of ``module`` with the group's first rank's, in place.

    One ``dist.broadcast`` per tensor, from the *global* rank of the group's rank 0
    (``dist.get_global_rank``; with ``group=None`` that is rank 0). Frozen parameters and
    buffers too: every rank must compute the same function. A tied weight is one tensor
    and is broadcast once (``module.parameters()`` lists it once).

    Part: core.
    """
    ### BEGIN SOLUTION
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=src, group=group)
    ### END SOLUTION


class _DataParallel(nn.Module):
    """What the three wrappers share: the wrapped module, the group, ``forward`` and ``no_sync``."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        reduce_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        # the dtype gradients are summed over the ranks in (None: their own)
        self.reduce_dtype = reduce_dtype
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
    The whole communication time is added to every step (nothing overlaps with compute).
    ``reduce_dtype``: sum the gradients in that dtype (mixed precision: fp32 for bf16 ones)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        super().__init__(module, group, reduce_dtype)

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward: sum each trainable parameter's
        ``.grad`` over the group with a blocking ``dist.all_reduce`` and divide by N, so every
        rank holds the mean gradient. Skip parameters whose ``.grad`` is None (frozen or unused:
        so on every rank). One call per gradient tensor. With ``self.reduce_dtype`` set (and not
        the gradient's own), all-reduce a copy cast to it and copy the mean back into ``.grad``.

        Part: core; the ``reduce_dtype`` lines come with mixed-precision (an extension).
        """
        ### BEGIN SOLUTION
        for p in self.params:
            if p.grad is not None:
                grad = p.grad.to(self.reduce_dtype or p.grad.dtype)  # a copy only to cast
                dist.all_reduce(grad, group=self.group)
                grad.div_(self.world_size)
                p.grad.copy_(grad)  # rounds back to the gradient's dtype (nothing if the same)
        ### END SOLUTION


class OverlappedDDP(_DataParallel):
    """All-reduce each gradient as soon as autograd has finished it, while backward goes on
    computing the earlier layers' gradients: communication hides behind compute."""

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        """Wrap ``module`` and hook every trainable parameter's gradient.

        Part: core.
        """
        super().__init__(module, group, reduce_dtype)
        # (gradient, the tensor being reduced: itself or its copy in reduce_dtype, the all-reduce)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, dist.Work]] = []
        # Register ``self.on_gradient_ready`` as a post-accumulate-grad hook on every trainable
        # parameter (``p.register_post_accumulate_grad_hook``); keep the handles in self.handles.
        ### BEGIN SOLUTION
        self.handles = [
            p.register_post_accumulate_grad_hook(self.on_gradient_ready) for p in self.params
        ]
        ### END SOLUTION

    def on_gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once per backward when ``param.grad`` holds its (accumulated)
        gradient. Unless inside ``no_sync()``, launch ``dist.all_reduce(..., async_op=True)`` on
        the group, on ``param.grad`` itself or (``self.reduce_dtype`` set) on a copy cast to it,
        and remember the gradient, the tensor being reduced and the returned work handle (in
        ``self.pending``). Do not wait here.

        Part: core; the ``reduce_dtype`` lines come with mixed-precision (an extension).
        """
        ### BEGIN SOLUTION
        if self.require_backward_grad_sync:
            reduced = param.grad.to(self.reduce_dtype or param.grad.dtype)
            work = dist.all_reduce(reduced, group=self.group, async_op=True)
            self.pending.append((param.grad, reduced, work))
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward: wait for every all-reduce in
        flight, divide each reduced tensor by N (copying it back into its gradient when it was a
        cast copy), and forget them (the next step starts empty).

        Part: core.
        """
        ### BEGIN SOLUTION
        for grad, reduced, work in self.pending:
            work.wait()
            reduced.div_(self.world_size)
            grad.copy_(reduced)
        self.pending.clear()
        ### END SOLUTION


class BucketedDDP(_DataParallel):
    """Fewer, larger all-reduces: gradients are copied into flat buckets of about
    ``bucket_mb`` MiB, and a bucket is all-reduced (async) once all its gradients are in.

    Buckets hold the trainable parameters in *reverse* registration order, the order
    backward produces their gradients (torch's DDP starts from the same guess). Walk them,
    add each parameter to the open bucket and close the bucket once it holds at least
    ``bucket_mb * MiB`` bytes (``labs.theory.overlap.bucket_layout``'s rule). Each bucket
    is one flat buffer of ``self.bucket_dtype`` (``reduce_dtype``, else the parameters' dtype),
    whose bytes the rule counts (4 per element for fp32 buckets of bf16 gradients); a parameter
    owns the slice at its offset. Costs G extra bytes per rank for the buffers (torch avoids it
    with ``gradient_as_bucket_view``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        """Wrap ``module``, lay its gradients out in buckets, hook them.

        Part: buckets (an extension).
        """
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 (MiB per bucket), got {bucket_mb!r}")
        super().__init__(module, group, reduce_dtype)
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("BucketedDDP needs every trainable parameter on one dtype and device")
        self.bucket_bytes = bucket_mb * MiB
        # what the buckets hold and the all-reduces carry
        self.bucket_dtype = reduce_dtype or self.params[0].dtype
        itemsize = self.bucket_dtype.itemsize
        # flat gradient buffers, [numel of the bucket]
        self.buckets: list[torch.Tensor] = []
        # the parameters of each bucket, in backward order
        self.bucket_params: list[list[nn.Parameter]] = []
        # parameter -> (bucket index, offset in it)
        self.slots: dict[nn.Parameter, tuple[int, int]] = {}
        # Fill the three attributes above as the class docstring says, and register
        # ``self.on_gradient_ready`` as a post-accumulate-grad hook on every trainable parameter.
        ### BEGIN SOLUTION
        bucket = []
        size = 0
        for p in reversed(self.params):
            bucket.append(p)
            size += p.numel() * itemsize
            if size >= self.bucket_bytes:
                self.bucket_params.append(bucket)
                bucket = []
                size = 0
        if bucket:
            self.bucket_params.append(bucket)
        for i, params in enumerate(self.bucket_params):
            offset = 0
            for p in params:
                self.slots[p] = (i, offset)
                offset += p.numel()
            self.buckets.append(
                torch.zeros(offset, dtype=self.bucket_dtype, device=params[0].device)
            )
        self.handles = [
            p.register_post_accumulate_grad_hook(self.on_gradient_ready) for p in self.params
        ]
        ### END SOLUTION
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
        ``async_op=True`` and keep the work handle in ``self.works[bucket]``. Do not wait.

        Part: buckets (an extension).
        """
        ### BEGIN SOLUTION
        if not self.require_backward_grad_sync:
            return
        i, _ = self.slots[param]
        self._slice(param).copy_(param.grad)
        self.arrived[i].add(param)
        if len(self.arrived[i]) == len(self.bucket_params[i]):
            self.works[i] = dist.all_reduce(self.buckets[i], group=self.group, async_op=True)
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call once per optimizer step, after its last backward. A bucket not yet launched holds
        a parameter that got no gradient: zero that slot and launch it now (calls = buckets on
        every rank). Wait for every bucket, divide by N, copy each slice back into the ``.grad``
        of the parameters that got one (the others keep ``grad=None``, as in a single process),
        then reset ``works`` and ``arrived`` for the next step.

        Part: buckets (an extension).
        """
        ### BEGIN SOLUTION
        for i, params in enumerate(self.bucket_params):
            if self.works[i] is None:
                for p in params:
                    if p not in self.arrived[i]:
                        self._slice(p).zero_()
                self.works[i] = dist.all_reduce(self.buckets[i], group=self.group, async_op=True)
        for i, work in enumerate(self.works):
            work.wait()
            self.buckets[i].div_(self.world_size)
            for p in self.arrived[i]:
                p.grad.copy_(self._slice(p))
        self.works = [None] * len(self.buckets)
        self.arrived = [set() for _ in self.buckets]
        ### END SOLUTION


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(**defaults)`` on fp32 master copies of low-precision parameters.

    ``params``: the model's trainable parameters in bf16 or fp16 (cast the model first). The
    optimizer keeps ``self.masters``, one fp32 copy of each ([same shape]), and ``self.inner``,
    ``optimizer_cls`` on them, so its state is fp32 too. ``step()`` casts each ``.grad`` to fp32
    into its master's ``.grad`` (divided by the loss scale, with ``loss_scaler``), steps the
    masters, and rounds them back into the parameters; the fp32 gradients are dropped after the
    step (the rank holds bf16 gradients between steps: 2 + 2 + 4 + k bytes per parameter).
    ``loss_scaler`` (fp16): a ``labs.train.LossScaler``; the training step multiplies the loss
    by it, this optimizer divides it out, skips a step whose gradients overflowed and updates
    the scale. ``param_groups`` are the user's (a scheduler's lr reaches the inner optimizer).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        loss_scaler: LossScaler | None = None,
        **defaults: Any,
    ) -> None:
        """fp32 masters of ``params`` and ``optimizer_cls`` on them.

        Part: mixed-precision (an extension).
        """
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, not one tensor")
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))
        if not self.params:
            raise ValueError("MixedPrecisionOptimizer got no trainable parameters")
        high = sorted({str(p.dtype) for p in self.params if p.dtype.itemsize > 2})
        if high:
            raise ValueError(
                f"MixedPrecisionOptimizer keeps fp32 masters of bf16/fp16 parameters, got {high}:"
                " cast the model first (model.to(torch.bfloat16)), before wrapping it in DDP"
            )
        self.loss_scaler = loss_scaler
        self.masters: list[torch.Tensor] = []
        self.inner: torch.optim.Optimizer | None = None
        # Make ``self.masters`` (an fp32 copy of each parameter, detached, on its device) and
        # ``self.inner = optimizer_cls(self.masters, **defaults)``.
        ### BEGIN SOLUTION
        self.masters = [p.detach().float() for p in self.params]
        self.inner = optimizer_cls(self.masters, **defaults)
        ### END SOLUTION
        super().__init__(self.params, self.inner.defaults)
        self.state = self.inner.state  # what this optimizer holds: the masters' state

    def _sync_hyperparameters(self) -> None:
        """The user's hyperparameters (a scheduler may have changed lr) into the inner optimizer."""
        for g, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One step on the masters, after the gradients are synchronised.

        For each parameter: its master's ``.grad`` is the parameter's ``.grad`` cast to fp32 and
        divided by the loss scale (``self.loss_scaler.value``; no scaler: 1) in fp32, or None
        where the parameter has none. With a loss scaler, a step whose master gradients hold an
        inf or a nan (``labs.train.overflowed``) is skipped; either way
        ``self.loss_scaler.update(overflow)``. Otherwise ``self.inner.step()``, then copy each
        master into its parameter (``p.copy_``, which rounds to bf16). Finally set every
        master's ``.grad`` to None (fp32 gradients exist only during the step).

        Part: mixed-precision (an extension).
        """
        if closure is not None:
            raise ValueError("MixedPrecisionOptimizer.step takes no closure")
        self._sync_hyperparameters()
        ### BEGIN SOLUTION
        scale = self.loss_scaler.value if self.loss_scaler is not None else 1.0
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.float().div_(scale)
        grads = [m.grad for m in self.masters if m.grad is not None]
        overflow = self.loss_scaler is not None and overflowed(grads)
        if not overflow:
            self.inner.step()
            for p, master in zip(self.params, self.masters):
                p.copy_(master)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        for master in self.masters:
            master.grad = None
        ### END SOLUTION


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

    Part: core.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    check_positive(grad_accum=grad_accum)
    check_divides(cfg.batch_size, "batch_size", n * grad_accum, "dp*grad_accum")
    ### BEGIN SOLUTION
    batches = rank_batches(
        steps=cfg.steps,
        batch_size=cfg.batch_size // n,
        seq_len=cfg.seq_len,
        rank=rank,
        world_size=n,
        seed=cfg.data_seed,
    )
    device = rank_device()
    # per step: K x ([B/(N K), T], [B/(N K), T])
    return [
        list(zip(x.to(device).chunk(grad_accum), y.to(device).chunk(grad_accum)))
        for x, y in batches
    ]
    ### END SOLUTION


def train_step(
    model: _DataParallel,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_scaler: LossScaler | None = None,
) -> float:
    """One optimizer step over this rank's ``micro_batches`` (gradient accumulation over K of them).

    Zero the gradients (``set_to_none=True``); for each micro-batch run ``model(x, y)``
    and backward on ``loss / K`` (so the K gradients add up to the batch mean's; with a
    ``loss_scaler``, on ``loss_scaler.scale(loss / K)``), the first K-1 inside
    ``model.no_sync()`` so that only the last backward communicates; then
    ``model.finish_gradient_synchronization()`` and ``optimizer.step()``. Returns this rank's
    loss: the mean of its K micro-batch losses (unscaled), a Python float.

    Part: core; the ``loss_scaler`` lines come with mixed-precision (an
    extension).
    """
    ### BEGIN SOLUTION
    optimizer.zero_grad(set_to_none=True)
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            _, loss = model(x, y)
            scaled = loss / k
            if loss_scaler is not None:
                scaled = loss_scaler.scale(scaled)
            scaled.backward()
        total += loss.item()
    model.finish_gradient_synchronization()
    optimizer.step()
    return total / k
    ### END SOLUTION
