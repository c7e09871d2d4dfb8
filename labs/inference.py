# Your exercise module, generated from solutions/inference.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 09 (notebooks/09_inference.ipynb): greedy generation with a KV cache, on one rank,
tensor-parallel, and with the layers placed rank after rank.

Generation is a *prefill* (the T0 prompt tokens in one forward) and then one *decode* step per new
token, which feeds only that token and reads every earlier position's keys and values from the **KV
cache**: per layer K and V [B, nkv, T, hd], preallocated for T = T0 + new tokens and written in
place (vLLM pages it in blocks instead). Prompts of different lengths are **left-padded** to one
length T0, with ``valid`` [B, T] marking real tokens: every sequence's new token then lands in the
same column, no real token ever attends to a pad, and positions count real tokens only (``positions
= cumsum(valid) - 1``), so a batched prompt decodes exactly as it would alone.

Two ways to put the model on N ranks (symbols of ``labs.theory.inference``; e bytes per element, L
layers):

TP (vLLM / TensorRT-LLM ``tensor_parallel_size=N``; Megatron-LM, Shoeybi et al. 2019, §3): every
rank holds nh/N query heads and nkv/N key/value heads of *every* layer (``apply_tensor_parallel`` of
notebook 04), so its cache is 2·L·B·T·(nkv/N)·hd·e bytes. Per forward of t tokens, on the TP group,
``2L + 2`` collectives (f is the identity in forward, so only the g's remain):

    collective              what                                             calls
    all-reduce [B, t, H]    the vocab-parallel embedding's g                 1
    all-reduce [B, t, H]    g after o_proj and after down_proj, per layer    2L
    all-gather [B, 2] fp64  each rank's (max logit, its id) for greedy       1
                            (not the [B, V/N] logits)

bytes sent per rank: (2L+1)·2(N-1)/N·B·t·H·e + (N-1)·B·2·8. Every rank computes every token: the N
ranks work on one token at once, so per-token latency drops with N as long as the all-reduces are
fast (NVLink).

Placement (``device_map="auto"`` in accelerate, llama.cpp's / Ollama's layer split): stage s holds
whole layers ``plan[s]`` (``build_stage`` of notebook 05), the first also ``tok_emb``, the last
``norm`` and ``lm_head``; its cache is 2·plan[s]·B·T·nkv·hd·e. Per forward, point to point only:
stage s sends its output [B, t, H] to s+1 (P-1 hops of B·t·H·e bytes) and the last stage sends the
chosen ids [B] (int64) back to the first, which embeds them next. One stage computes at a time:
per-token latency is the whole model's plus P hops; it holds a model too big for one device, and the
other stages idle unless several batches are in flight (vLLM's pipeline parallelism).

References: Pope et al., "Efficiently Scaling Transformer Inference" (MLSys 2023), §2-3 (KV cache,
memory-bound decode, partitioning for latency); Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention" (SOSP 2023); accelerate's "Big Model Inference" guide
(``device_map="auto"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.models.transformer import ModelConfig, rotary_cos_sin
from labs.runtime.pipe import Pipe, p2p
from labs.runtime.tensor_comm import all_gather_along
from labs.theory.dims import check_positive

NOTEBOOK = "09_inference.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 45, "placement": 20}

PAD_ID = 0  # left padding; never attended to, so its value does not matter


# --- plumbing: batching prompts, positions, masks ---
def left_pad(
    prompts: Sequence[Sequence[int]], *, new_tokens: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (lists of token ids) left-padded to the longest: ids [B, T0] and ``valid`` [B, T0 +
    new_tokens] (False on the pads; the generated positions are all real)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    check_positive(new_tokens=new_tokens)
    t0 = max(len(p) for p in prompts)
    padded = [[PAD_ID] * (t0 - len(p)) + list(p) for p in prompts]
    idx = torch.tensor(padded, device=device)  # [B, T0]
    valid = torch.ones(len(prompts), t0 + new_tokens, dtype=torch.bool, device=device)  # [B, T]
    for b, p in enumerate(prompts):
        valid[b, : t0 - len(p)] = False
    return idx, valid


def rope_for(
    valid: torch.Tensor, start: int, t: int, cfg: ModelConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, t, hd] for slots start..start+t: position = real tokens before the
    slot."""
    positions = (valid[:, : start + t].cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, t]
    # [B·t, hd] each
    cos, sin = rotary_cos_sin(positions.flatten(), cfg.head_dim, cfg.rope_theta, dtype=dtype)
    cos = cos.view(*positions.shape, -1)[:, None]  # [B, 1, t, hd]
    sin = sin.view(*positions.shape, -1)[:, None]  # [B, 1, t, hd]
    return cos, sin


def attention_mask(valid: torch.Tensor, start: int, t: int) -> torch.Tensor:
    """[B, 1, t, start+t] bool, True where query slot i may read key slot j: j <= i and j real. A
    pad query reads the pads before it instead (its output is never used, but a row with no key at
    all would give NaN)."""
    slots = torch.arange(start + t, device=valid.device)
    causal = slots[None, :] <= slots[start:, None]  # [t, start+t]
    keys = valid[:, None, : start + t]  # [B, 1, start+t]
    queries = valid[:, start : start + t, None]  # [B, t, 1]
    return (causal & (keys | ~queries))[:, None]  # [B, 1, t, start+t]


def blocks_of(part: nn.Module) -> list[nn.Module]:
    """The blocks of a whole model (``layers`` list) or of a pipeline stage (``layers`` dict)."""
    if isinstance(part.layers, nn.ModuleDict):
        return list(part.layers.values())
    return list(part.layers)


# --- the KV cache ---
class KVCache:
    """K and V of ``n_layer`` layers, each [B, nkv, T, hd], allocated once (zeros) for T =
    ``max_len`` positions. Under TP ``n_kv_head`` is this rank's nkv/tp heads; on a pipeline stage
    ``n_layer`` is the stage's layers."""

    def __init__(
        self,
        *,
        n_layer: int,
        batch: int,
        max_len: int,
        n_kv_head: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch, n_kv_head, max_len, head_dim)  # [B, nkv(/tp), T, hd]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]

    @classmethod
    def for_blocks(
        cls,
        blocks: Sequence[nn.Module],
        *,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A cache sized for ``blocks`` as they are (their attention's head count: all heads, or a
        TP rank's)."""
        attn = blocks[0].attn if blocks else None
        return cls(
            n_layer=len(blocks),
            batch=batch,
            max_len=max_len,
            n_kv_head=attn.n_kv_head if attn else 0,
            head_dim=attn.head_dim if attn else 0,
            dtype=dtype,
            device=device,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [B, nkv, t, hd] of layer ``layer`` at slots start..start+t (in place,
        no new memory); return that layer's K and V for slots 0..start+t, [B, nkv, start+t, hd]
        each: views, no copies.

        Part: core.
        """
        raise NotImplementedError(
            "exercise KVCache.write is not written yet: "
            "see its docstring and notebooks/09_inference.ipynb"
        )


# --- one forward of t new tokens over the cache ---
def cached_attention(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    cache: KVCache,
    layer: int,
    start: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The course ``Attention`` ``attn`` (or its TP version: the same names, column-parallel q/k/v,
    row-parallel o_proj with its all-reduce) on t new tokens x [B, t, H] at slots start..start+t:
    ``attn.project`` (q, k, v, rotated with ``cos``/``sin`` [B, 1, t, hd]; nh/tp, nkv/tp heads under
    TP), write k, v into ``cache``, SDPA of q over the cached keys with ``mask`` [B, 1, t, start+t]
    (``enable_gqa``), then o_proj. Returns [B, t, H].

    Part: core.
    """
    raise NotImplementedError(
        "exercise cached_attention is not written yet: "
        "see its docstring and notebooks/09_inference.ipynb"
    )


def greedy(logits: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The greedy token of each sequence from its last logits [B, V], or with ``group`` the
    vocab-parallel [B, V/tp] (rank r holds ids [r V/tp, (r+1) V/tp)). Ties go to the lowest id, as
    ``torch.argmax``. TP: one all-gather of every rank's best (logit, id) pair, [B, 2] in float64
    (exact for both), not of the logits.

    Part: core.
    """
    raise NotImplementedError(
        "exercise greedy is not written yet: see its docstring and notebooks/09_inference.ipynb"
    )


def forward_tokens(
    part: nn.Module,
    x: torch.Tensor,
    *,
    cache: KVCache,
    start: int,
    valid: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """t new tokens through ``part``: the whole course model, its TP version (``group``: the TP
    group, for ``greedy``), or one pipeline stage (``tok_emb``/``norm``/``lm_head`` None when it
    lacks them). ``x``: ids [B, t] if ``part`` embeds, else the previous stage's hidden states [B,
    t, H]; slots start..start+t; ``valid`` [B, T] (see ``left_pad``). Per block: x + attention
    (``cached_attention``, i-th block -> cache layer i), then x + mlp. Returns the greedy tokens [B]
    from the last slot's logits if ``part`` has the head, else [B, t, H].

    Part: core.
    """
    t = x.shape[1]
    cos, sin = rope_for(valid, start, t, part.cfg, dtype=next(part.parameters()).dtype)
    mask = attention_mask(valid, start, t)  # [B, 1, t, start+t]
    raise NotImplementedError(
        "exercise forward_tokens is not written yet: "
        "see its docstring and notebooks/09_inference.ipynb"
    )


# --- the generation loops ---
@dataclass(frozen=True)
class Generated:
    """What a generation returns: the new tokens [B, new_tokens] (None on a middle pipeline stage)
    and the rank's KV cache, filled (``cache.nbytes``: what it holds)."""

    tokens: torch.Tensor | None
    cache: KVCache


def _new_cache(part: nn.Module, batch: int, max_len: int) -> KVCache:
    p = next(part.parameters())
    return KVCache.for_blocks(
        blocks_of(part), batch=batch, max_len=max_len, dtype=p.dtype, device=p.device
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int,
    group: dist.ProcessGroup | None = None,
    on_token: Callable[[int], None] | None = None,
) -> Generated:
    """Greedy generation of ``new_tokens`` tokens after each prompt with a KV cache: one prefill
    forward of the left-padded prompts [B, T0] (slots 0..T0) gives token 0; decode step i =
    1..new_tokens-1 feeds token i-1 [B, 1] at slot T0+i-1 and gives token i. ``model``: the course
    model, or its TP version with ``group`` (every rank returns the same tokens). Calls
    ``on_token(i)`` after token i. Cache: T = T0 + new_tokens slots. Returns ``Generated(tokens [B,
    new_tokens], cache)``.

    Part: core.
    """
    idx, valid = left_pad(prompts, new_tokens=new_tokens, device=next(model.parameters()).device)
    cache = _new_cache(model, len(prompts), valid.shape[1])
    raise NotImplementedError(
        "exercise generate is not written yet: see its docstring and notebooks/09_inference.ipynb"
    )


@torch.no_grad()
def generate_placed(
    stage: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int,
    pipe: Pipe,
    on_token: Callable[[int], None] | None = None,
) -> Generated:
    """``generate`` with the layers placed stage after stage (``stage``: this rank's ``build_stage``
    of notebook 05, ``pipe``: its ``labs.runtime.pipe.pipe_group()``). Every forward: the first
    stage embeds the ids, the others receive [B, t, H] from the previous stage (``p2p`` of
    ``labs.runtime.pipe``); each runs its blocks on its own cache and sends its output on; the last
    picks the tokens and sends them [B] (int64) to the first (``pipe.next`` of the last stage is the
    first). Returns ``Generated``: tokens [B, new_tokens] on the first and the last stage, None on
    the others.

    Part: placement (an extension).
    """
    idx, valid = left_pad(prompts, new_tokens=new_tokens, device=next(stage.parameters()).device)
    cache = _new_cache(stage, len(prompts), valid.shape[1])
    dtype = next(stage.parameters()).dtype
    B, t = idx.shape
    raise NotImplementedError(
        "exercise generate_placed is not written yet: "
        "see its docstring and notebooks/09_inference.ipynb"
    )
