# Your exercise module, generated from solutions/context_parallel.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 06 (notebooks/06_context_parallel.ipynb): ring attention, forward and backward, with
zig-zag balance.

What is sharded: the sequence. The T tokens are cut into 2·CP chunks of c = T/(2·CP); rank r
holds chunks r and 2·CP−1−r (zig-zag) or 2r and 2r+1 (contiguous), with their positions, so
every activation is local, ``# [B, T/cp, H]``. Weights are replicated on the CP group.

Communication on the CP ``group`` (a ring: ``labs.runtime.ring``), per attention layer:
* forward: CP steps; at step s rank r holds the K/V of rank r−s, computes its queries against
  it (skipping fully masked chunk pairs) and merges the partial result by the log-sum-exp rule.
  The next block's ``batch_isend_irecv`` (to r+1, from r−1) is posted *before* computing, so
  it travels while the rank computes: CP−1 sends of the local K/V,
      (CP−1)/CP · KV bytes,  KV = 2·B·T·nkv·hd·itemsize (``labs.theory.context_parallel``).
  K/V travel unrepeated (nkv heads), expanded to nh on arrival: nkv/nh of repeated heads' bytes.
* backward: K/V go round again, and each block's gradient accumulator dK/dV follows one hop
  behind, visiting the CP−1 other ranks and ending at its owner: 2 (CP−1)/CP · KV bytes.
* replicated weights: each rank backpropagates its own tokens' loss weighted by its token
  share (T/CP of T), then one all-reduce (sum) of all gradients over the CP group,
  2 (CP−1)/CP · Ψ · itemsize bytes per step (``all_reduce_gradients``).
Saved for backward per layer: local q, k, v, out, log-sum-exp, ∝ T/CP; no T×T matrix (recomputed).

References: Liu et al., "Ring Attention with Blockwise Transformers" (2023) §3; Milakov &
Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al., "FlashAttention" (2022)
§3.1, App. B.2 (backward from the log-sum-exp); Dubey et al., "The Llama 3 Herd of Models" (2024)
§3.3.2 (zig-zag).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.function import FunctionCtx

from labs.models.transformer import Attention
from labs.runtime.ring import post_exchange, ring_neighbours
from labs.theory.dims import check_divides

NOTEBOOK = "06_context_parallel.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 55, "backward": 35}

# K/V and their gradients can be in flight at once: distinct message tags
KV_TAG = 1
DKV_TAG = 2


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def chunk_ids(rank: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The two global chunk indices (of 2·cp chunks) ``rank`` holds, in the order it stores them:
    zig-zag (r, 2·cp−1−r): one early and one late chunk, so causal work is equal on every rank;
    contiguous (2r, 2r+1): the plain split, T/cp consecutive tokens.

    Part: core.
    """
    raise NotImplementedError(
        "exercise chunk_ids is not written yet: "
        "see its docstring and notebooks/06_context_parallel.ipynb"
    )


def block_kind(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """What a causal mask leaves of query chunk × key chunk: "full" (key chunk before the query
    chunk, or no mask), "diagonal" (the same chunk: lower triangle) or "masked" (after: skip it).

    Part: core.
    """
    raise NotImplementedError(
        "exercise block_kind is not written yet: "
        "see its docstring and notebooks/06_context_parallel.ipynb"
    )


def split_sequence(
    x: torch.Tensor, *, cp: int, rank: int, zigzag: bool = True, dim: int = 1
) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (length T): chunks ``chunk_ids(rank, cp, zigzag)``
    of the 2·cp chunks, concatenated in that order. ``[B, T, ...] -> [B, T/cp, ...]`` for dim=1.
    Raises ValueError when T is not divisible by 2·cp.

    Part: core.
    """
    check_divides(x.shape[dim], "seq_len", 2 * cp, "2*cp (two chunks per context-parallel rank)")
    raise NotImplementedError(
        "exercise split_sequence is not written yet: "
        "see its docstring and notebooks/06_context_parallel.ipynb"
    )


def unsplit_sequence(
    parts: list[torch.Tensor], *, zigzag: bool = True, dim: int = 1
) -> torch.Tensor:
    """The inverse of ``split_sequence``: ``parts[r]`` is rank r's share; returns the full
    sequence.

    Part: core.
    """
    raise NotImplementedError(
        "exercise unsplit_sequence is not written yet: "
        "see its docstring and notebooks/06_context_parallel.ipynb"
    )


def _scores(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v repeated to the nh query heads, and the scores q kᵀ·scale (masked above the diagonal if
    causal)."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)  # [B, nh, Tk, hd]
    v = v.repeat_interleave(g, dim=1)  # [B, nh, Tk, hd]
    s = q @ k.transpose(-2, -1) * scale  # [B, nh, Tq, Tk]
    if causal:
        above_diagonal = torch.ones_like(s, dtype=torch.bool).triu(1)
        s = s.masked_fill(above_diagonal, float("-inf"))
    return k, v, s


def attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of a query block against one key/value block, and each query's log-sum-exp.

    q: [B, nh, Tq, hd]; k, v: [B, nkv, Tk, hd] (nh/nkv query heads share a kv head, as SDPA's
    ``enable_gqa``). ``causal``: lower-triangular mask (a block on the diagonal, Tq = Tk).
    Returns out [B, nh, Tq, hd] = softmax(q kᵀ·scale) v over *this block only*, and lse [B, nh, Tq]
    = log Σ_keys exp(q kᵀ·scale): what the merge rule needs to combine blocks exactly.
    """
    k, v, s = _scores(q, k, v, causal, scale)  # [B, nh, Tk, hd] x2, [B, nh, Tq, Tk]
    lse = s.logsumexp(dim=-1)  # [B, nh, Tq]
    out = torch.exp(s - lse[..., None]) @ v  # [B, nh, Tq, hd]
    return out, lse


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's share of the *global* attention (FlashAttention's backward).

    dout, out: [B, nh, Tq, hd] for the full softmax over all keys; lse: [B, nh, Tq] its global
    log-sum-exp. p = exp(q kᵀ·scale − lse) is this block's slice of the global softmax, so
    dv = pᵀ dout, ds = p ⊙ (dout vᵀ − rowsum(dout ⊙ out)), dq = ds k·scale, dk = dsᵀ q·scale.
    Returns dq [B, nh, Tq, hd], dk and dv [B, nkv, Tk, hd] (summed over the heads sharing them).
    """
    b, nkv, tk, hd = k.shape
    g = q.shape[1] // nkv
    # recomputed: [B, nh, Tk, hd] x2, [B, nh, Tq, Tk]
    k, v, s = _scores(q, k, v, causal, scale)
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-2, -1) @ dout  # [B, nh, Tk, hd]
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))  # [B, nh, Tq, Tk]
    dq = ds @ k * scale  # [B, nh, Tq, hd]
    dk = ds.transpose(-2, -1) @ q * scale  # [B, nh, Tk, hd]
    dk = dk.view(b, nkv, g, tk, hd).sum(2)  # [B, nkv, Tk, hd]
    dv = dv.view(b, nkv, g, tk, hd).sum(2)  # [B, nkv, Tk, hd]
    return dq, dk, dv


def merge_partials(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets (the online-softmax rule).

    out, block_out: [B, nh, Tq, hd], softmax-normalised over their own keys; lse, block_lse:
    [B, nh, Tq] their log-sum-exps. Returns (merged out, merged lse) with
    lse' = log(e^lse + e^block_lse) and out' = e^(lse−lse')·out + e^(block_lse−lse')·block_out.
    Never form e^lse itself: it overflows. Do not modify the inputs.

    Part: core.
    """
    raise NotImplementedError(
        "exercise merge_partials is not written yet: "
        "see its docstring and notebooks/06_context_parallel.ipynb"
    )


def _pairs(
    q_ids: tuple[int, int], k_ids: tuple[int, int], causal: bool
) -> list[tuple[int, int, bool]]:
    """(local q chunk, local k chunk, causal mask?) for the chunk pairs that are not fully
    masked."""
    pairs = []
    for a, q_chunk in enumerate(q_ids):
        for b, k_chunk in enumerate(k_ids):
            kind = block_kind(q_chunk, k_chunk, causal)
            if kind != "masked":
                pairs.append((a, b, kind == "diagonal"))
    return pairs


def _chunk(t: torch.Tensor, i: int, dim: int = -2) -> torch.Tensor:
    """Local chunk i (of 2) along the token dim: [.., T/cp, hd] -> [.., T/(2cp), hd]."""
    return t.narrow(dim, i * (t.shape[dim] // 2), t.shape[dim] // 2)


class RingAttention(torch.autograd.Function):
    """fwd: K/V travel the ring (send to r+1, recv from r−1), partial outputs merged by log-sum-exp;
    bwd: K/V travel again and their gradients follow them home; dq stays local."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup | None,
        causal: bool,
        zigzag: bool,
    ) -> torch.Tensor:
        """q: [B, nh, T/cp, hd], k, v: [B, nkv, T/cp, hd], this rank's tokens (``split_sequence``).

        Ring peers: ``ring_neighbours(group)`` of ``labs.runtime.ring`` (global ranks: a sub-group
        works). CP steps: at step s hold the K/V of rank (me − s) mod CP (as one stacked tensor
        [2, B, nkv, T/cp, hd]); unless it is the last step, first post the exchange that brings the
        next step's block (``post_exchange``, also of ``labs.runtime.ring``, tag KV_TAG), then for
        each chunk pair of ``_pairs`` run ``attention_block`` and merge into that query chunk's
        (out, lse), then wait. Save q, k, v, out, lse for backward. Returns out [B, nh, T/cp, hd],
        laid out in memory as SDPA's ([B, T/cp, nh, hd]:
        ``.transpose(1, 2).contiguous().transpose(1, 2)``).

        Part: core.
        """
        raise NotImplementedError(
            "exercise RingAttention.forward is not written yet: "
            "see its docstring and notebooks/06_context_parallel.ipynb"
        )

    @staticmethod
    def backward(
        ctx: FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        """dout: [B, nh, T/cp, hd]. Returns dq, dk, dv for this rank's tokens (and None for the
        rest).

        Step s holds K/V of rank (me − s) mod CP as in forward (post the next exchange first)
        and computes, per chunk pair, ``attention_block_backward`` with the saved *global* out
        and lse: dq adds up locally; dk, dv go into this step's contribution to that block's
        gradient. Step 0's contribution is our own block's: keep it. From step 1 on, add the
        accumulator received from r−1 (posted the step before; none at step 1) and post it on to
        r+1 (tag DKV_TAG): after step CP−1 it reaches its owner. Finally wait for the accumulator
        of our own block and add it to what we kept.

        Part: backward (an extension).
        """
        raise NotImplementedError(
            "exercise RingAttention.backward is not written yet: "
            "see its docstring and notebooks/06_context_parallel.ipynb"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    zigzag: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by ``group``.
    q: [B, nh, T/cp, hd], k, v: [B, nkv, T/cp, hd] -> [B, nh, T/cp, hd]."""
    return RingAttention.apply(q, k, v, group, causal, zigzag)


class ContextParallelAttention(Attention):
    """The course model's attention (``labs.models.transformer.Attention``) on this rank's tokens:
    the same q/k/v/o projections (so parameter names and values are unchanged, and ``project``
    works), ring attention over ``group`` instead of SDPA."""

    def __init__(self, attn: Attention, group: dist.ProcessGroup | None, *, zigzag: bool = True):
        nn.Module.__init__(self)  # no fresh projections: ``attn``'s own are taken below
        self.n_head = attn.n_head
        self.n_kv_head = attn.n_kv_head
        self.head_dim = attn.head_dim
        self.q_proj = attn.q_proj
        self.k_proj = attn.k_proj
        self.v_proj = attn.v_proj
        self.o_proj = attn.o_proj
        self.group = group
        self.zigzag = zigzag

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T/cp, H], this rank's tokens; cos, sin: [T/cp, hd] for *their* positions.
        ``self.project`` (q, k, v, rotated), ``ring_attention`` (causal, unrepeated K/V),
        ``o_proj``: [B, T/cp, H].

        Part: backward (an extension).
        """
        raise NotImplementedError(
            "exercise ContextParallelAttention.forward is not written yet: "
            "see its docstring and notebooks/06_context_parallel.ipynb"
        )


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup | None, *, zigzag: bool = True
) -> nn.Module:
    """Swap every block's attention for ``ContextParallelAttention`` on ``group``, in place.
    The model then takes this rank's tokens and positions: ``model(*shard_inputs(...))``."""
    for block in model.layers:
        block.attn = ContextParallelAttention(block.attn, group, zigzag=zigzag)
    return model


def shard_inputs(
    idx: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    zigzag: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (tokens [B, T/cp], targets [B, T/cp], positions [T/cp]) of a global batch."""
    me = dist.get_rank(group)
    cp = dist.get_world_size(group)
    positions = torch.arange(idx.shape[1], device=idx.device)
    return tuple(
        split_sequence(t, cp=cp, rank=me, zigzag=zigzag, dim=-1) for t in (idx, targets, positions)
    )


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every gradient over ``group``: one all-reduce of a flat buffer, 2 (CP−1)/CP · Ψ ·
    itemsize bytes per rank. Each rank's gradient already carries its token share of the loss."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))
