# Your exercise module, generated from solutions/tensor_parallel_comm.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 04, part 1 (notebooks/04_tensor_parallel.ipynb): Megatron's communication operators.

Tensor parallelism runs collectives inside every layer, so autograd has to know about them: each
one is a ``torch.autograd.Function`` whose backward is the adjoint of its forward. Every operator
runs on the tensor-parallel ``group`` of N = tp ranks, on activations [B, T, H] (T is ``SEQ_DIM``):

        operator                               forward            backward
    f   CopyToModelParallelRegion              identity           all-reduce
    g   ReduceFromModelParallelRegion          all-reduce         identity
        GatherFromModelParallelRegion          all-gather(last)   split(last)
        ScatterToModelParallelRegion           split(last)        all-gather(last)
    SP  GatherFromSequenceParallelRegion       all-gather(T)      reduce-scatter(T)
    SP  ReduceScatterToSequenceParallelRegion  reduce-scatter(T)  all-gather(T)

f is where a replicated activation enters a TP region (attention, the MLP): every rank used the
same input for its own columns, so the input's gradient is the sum of the ranks' terms. g is where
the partial sums of a row-parallel layer leave it; each partial sum receives the whole output
gradient. With sequence parallelism the activations outside the regions are split along T, and the
SP pair replaces f and g (``enter_parallel_region``, ``exit_parallel_region`` choose).

``LinearWithAsyncCommunication`` is f (or SP's all-gather) fused with the column-parallel matmuls
that read its output, so that its backward can overlap communication with compute: it launches
the all-reduce (SP: reduce-scatter along T) of the input's gradient with ``async_op=True``,
computes the weight gradients while the collective is in flight, then waits. The same collectives
and bytes as f followed by the matmuls; less of their time exposed (Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``, picotron's ``LinearWithAsyncAllReduce``).

Bytes sent per rank per call, K = bytes of the whole [B, T, H] activation: all-reduce 2(N-1)/N·K,
all-gather and reduce-scatter (N-1)/N·K, identity and split nothing (``labs.theory.comm``). The
layout plumbing (moving dim ``dim`` to dim 0 and back) is in ``labs.runtime.tensor_comm``; no
operator modifies its input.

References: Shoeybi et al. 2019, "Megatron-LM", §3 (f and g); Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4.2.2 (the SP pair); the async linear is
the design of Megatron-LM's ``megatron/core/tensor_parallel/layers.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from labs.runtime.tensor_comm import (
    all_gather_along,
    all_reduce_copy,
    reduce_scatter_along,
    reduce_scatter_along_async,
    split_along,
)

NOTEBOOK = "04_tensor_parallel.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 60, "sequence-parallel": 15, "async": 20}

SEQ_DIM = 1  # activations are [B, T, H]: T is dim 1


# Exercise: each forward is given; write the backward, its adjoint.
class CopyToModelParallelRegion(torch.autograd.Function):
    """fwd: identity; bwd: all-reduce. Megatron's f: a replicated activation enters a TP region."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: all-reduce the gradient (a copy).

        Part: core.
        """
        raise NotImplementedError(
            "exercise CopyToModelParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class ReduceFromModelParallelRegion(torch.autograd.Function):
    """fwd: all-reduce; bwd: identity. Megatron's g: partial sums leave a TP region."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: the gradient, unchanged.

        Part: core.
        """
        raise NotImplementedError(
            "exercise ReduceFromModelParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class GatherFromModelParallelRegion(torch.autograd.Function):
    """fwd: all-gather along the last dim; bwd: keep this rank's slice of the last dim."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: this rank's slice of the last dim.

        Part: core.
        """
        raise NotImplementedError(
            "exercise GatherFromModelParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class ScatterToModelParallelRegion(torch.autograd.Function):
    """fwd: keep this rank's slice of the last dim; bwd: all-gather along the last dim."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: all-gather along the last dim.

        Part: core.
        """
        raise NotImplementedError(
            "exercise ScatterToModelParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """fwd: all-gather along T, [B, T/tp, H] -> [B, T, H]; bwd: reduce-scatter along T. SP's f."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: reduce-scatter along T.

        Part: sequence-parallel (an extension).
        """
        raise NotImplementedError(
            "exercise GatherFromSequenceParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """fwd: reduce-scatter along T, partial sums [B, T, H] -> [B, T/tp, H]; bwd: all-gather along
    T. SP's g."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The adjoint of forward: all-gather along T.

        Part: sequence-parallel (an extension).
        """
        raise NotImplementedError(
            "exercise ReduceScatterToSequenceParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


def enter_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """A replicated activation enters a TP region: f, or with SP the all-gather
    [B, T/tp, H] -> [B, T, H].

    Part: core; the SP branch comes with sequence-parallel (an extension).
    """
    raise NotImplementedError(
        "exercise enter_parallel_region is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )


def exit_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """Partial sums [B, T, H] leave a TP region: g -> [B, T, H], or with SP the reduce-scatter
    -> [B, T/tp, H].

    Part: core; the SP branch comes with sequence-parallel (an extension).
    """
    raise NotImplementedError(
        "exercise exit_parallel_region is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )


# Exercise (notebook 04, §11): the forward is given; write the backward, overlapped.
class LinearWithAsyncCommunication(torch.autograd.Function):
    """fwd: enter the TP region (identity; SP: all-gather along T, [B, T/tp, in] -> [B, T, in]),
    then Y_i = X W_iᵀ for each column-parallel weight W_i [out_i/tp, in] reading that input;
    bwd: grad_X = Σ_i grad_Y_i W_i, all-reduced (SP: reduce-scattered along T) with
    ``async_op=True``; while that collective is in flight, the weight-gradient matmuls
    grad_W_i = grad_Y_iᵀ X; then wait, and return grad_X.

    Called as ``q, k, v = LinearWithAsyncCommunication.apply(x, group, sequence_parallel, Wq, Wk,
    Wv)``: the linears that share an input share its gradient's one collective (Megatron fuses q/k/v
    and gate/up into one weight for this). The collectives are those of f (SP: the all-gather /
    reduce-scatter pair) followed by the matmuls, call for call and byte for byte; what changes is
    when the backward waits. Saves X (gathered, with SP) once, as the separate linears do."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        if sequence_parallel:
            x = all_gather_along(x, SEQ_DIM, group)  # [B, T/tp, in] -> [B, T, in]
        ctx.group = group
        ctx.sequence_parallel = sequence_parallel
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w) for w in weights)  # each [B, T, out_i/tp]

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """grad_X first, its collective launched async; the weights' gradients while it
        travels; then wait (the class docstring).

        Part: async (an extension).
        """
        x, *weights = ctx.saved_tensors  # x [B, T, in]; weights [out_i/tp, in]
        raise NotImplementedError(
            "exercise LinearWithAsyncCommunication.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )
