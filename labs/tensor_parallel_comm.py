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

Bytes sent per rank per call, K = bytes of the whole [B, T, H] activation: all-reduce 2(N-1)/N·K,
all-gather and reduce-scatter (N-1)/N·K, identity and split nothing (``labs.theory.comm``). The
layout plumbing (moving dim ``dim`` to dim 0 and back) is in ``labs.runtime.tensor_comm``; no
operator modifies its input.

References: Shoeybi et al. 2019, "Megatron-LM", §3 (f and g); Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4.2.2 (the SP pair).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from labs.runtime.tensor_comm import (
    all_gather_along,
    all_reduce_copy,
    reduce_scatter_along,
    split_along,
)

NOTEBOOK = "04_tensor_parallel.ipynb"
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
        raise NotImplementedError(
            "exercise ReduceScatterToSequenceParallelRegion.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


def enter_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """A replicated activation enters a TP region: f, or with SP the all-gather
    [B, T/tp, H] -> [B, T, H]."""
    raise NotImplementedError(
        "exercise enter_parallel_region is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )


def exit_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """Partial sums [B, T, H] leave a TP region: g -> [B, T, H], or with SP the reduce-scatter
    -> [B, T/tp, H]."""
    raise NotImplementedError(
        "exercise exit_parallel_region is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )
