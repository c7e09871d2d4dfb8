"""Collectives along any tensor dimension: the layout plumbing under the labs' autograd operators.

    all_gather_along(x, dim=1, group=g)      # [B, T/N, H] on each rank -> [B, T, H], rank order
    reduce_scatter_along(x, dim=1, group=g)  # [B, T, H] partial sums -> [B, T/N, H] of the sum
    out, work = reduce_scatter_along_async(x, dim=1, group=g)  # the same, launched; work.wait()
    split_along(x, dim=-1, group=g)          # this rank's chunk, no communication
    all_reduce_copy(x, group=g)              # the sum over ranks, in a new tensor
    shard_weight(linear, dim=0, group=g)     # this rank's block of a weight, partition_dim=0

``dist.all_gather_single`` and ``dist.reduce_scatter_single`` work on dim 0 of contiguous
tensors; these helpers move the chunks of another dimension there and back. None of
them modifies its input (autograd may still need it). Every rank of ``group`` must call
them with the same shapes; N must divide ``x.shape[dim]`` for the gather/scatter pair.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_copy(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group``, as a new tensor (``x`` is left alone)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def split_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous 1/N chunk of ``x`` along ``dim`` (no communication)."""
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


def all_gather_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (one ``all_gather_single``)."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank i's x at rows [i*d0, (i+1)*d0)
    dist.all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(n), dim=dim)


def _chunks_to_dim0(
    x: torch.Tensor, dim: int, n: int, caller: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(an empty tensor shaped like one chunk of ``x`` along ``dim``, the ``n`` chunks stacked
    along dim 0): the output and input of a ``reduce_scatter_single`` that scatters ``dim``."""
    chunks = x.chunk(n, dim)
    if len(chunks) != n or any(c.shape != chunks[0].shape for c in chunks):
        raise ValueError(
            f"{caller}: size {x.shape[dim]} of dim {dim} does not split into {n} equal chunks"
        )
    return x.new_empty(chunks[0].shape), torch.cat(chunks, dim=0)


def reduce_scatter_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Chunk ``rank`` along ``dim`` of the sum over ranks of ``x`` (one
    ``reduce_scatter_single``)."""
    n = dist.get_world_size(group)
    out, stacked = _chunks_to_dim0(x, dim, n, "reduce_scatter_along")
    # chunk i lands on rank i
    dist.reduce_scatter_single(out, stacked, group=group)
    return out


def reduce_scatter_along_async(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, dist.Work]:
    """``reduce_scatter_along`` launched with ``async_op=True``: (the output, the work). The
    output holds the sum only after ``work.wait()``; meanwhile the caller computes something
    else (``LinearWithAsyncCommunication``'s weight gradients)."""
    n = dist.get_world_size(group)
    out, stacked = _chunks_to_dim0(x, dim, n, "reduce_scatter_along_async")
    work = dist.reduce_scatter_single(out, stacked, group=group, async_op=True)
    return out, work


def shard_weight(
    layer: torch.nn.Module, dim: int, group: dist.ProcessGroup | None = None
) -> torch.nn.Parameter:
    """This rank's contiguous 1/N block along ``dim`` of ``layer.weight``, as a new Parameter tagged
    ``partition_dim = dim`` (the ranks' blocks concatenated along it in rank order give the weight
    back). The layer must have no bias: the course's layers shard weights only."""
    if getattr(layer, "bias", None) is not None:
        raise ValueError(
            f"{type(layer).__name__} has a bias; the tensor-parallel layers take none"
            " (Llama has none)"
        )
    part = torch.nn.Parameter(split_along(layer.weight.detach(), dim, group).clone())
    part.partition_dim = dim
    return part
