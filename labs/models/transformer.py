"""The course model: a small decoder-only transformer in the Llama style, read top to bottom.

    RMSNorm -> Attention (rotary positions, grouped-query heads) -> residual
    RMSNorm -> MLP (SwiGLU: down(silu(gate(x)) * up(x)))      -> residual

Every parallelism in the course is applied to this one model, so it is written to be
cut: attention has separate q/k/v/o projections (TP splits them by heads), the MLP has
separate gate/up/down (TP splits them by the hidden dimension), the blocks live in one
``layers`` list (PP cuts it into stages), and positions come from ``positions`` rather
than from ``arange(T)`` so a context-parallel rank can hold tokens from the middle of
the sequence. Module names follow ``transformers``' Llama, so weights copy across
(``labs.models.hf.to_hf_llama``) and the two give the same logits.

Shape legend: B batch, T sequence, H hidden (n_embd), nh heads, nkv key/value heads,
hd head dim (H / nh), F MLP hidden (ffn_hidden), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokenizer: one token per byte
    seq_len: int = 64  # longest sequence; sizes the rotary table
    n_layer: int = 2
    n_embd: int = 64  # H
    n_head: int = 8  # nh; head dim = n_embd // n_head
    n_kv_head: int = 4  # nkv < nh is grouped-query attention; = nh is plain multi-head
    ffn_hidden: int = 128  # F; Llama uses about 8/3 H rounded up
    tie_embeddings: bool = False  # share the token embedding with the output head (GPT-2 does)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in (
            "vocab_size",
            "seq_len",
            "n_layer",
            "n_embd",
            "n_head",
            "n_kv_head",
            "ffn_hidden",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even"
                " for rotary positions"
            )

    @property
    def head_dim(self) -> int:
        """hd = H / nh."""
        return self.n_embd // self.n_head


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and the loss compute in: fp32 for bf16 and fp16 activations (as Llama
    does), the model's own dtype from fp32 up (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least fp32 (``compute_dtype``) and cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(compute_dtype(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given token positions: ``[T, hd]`` each."""
    even = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)  # [hd/2]
    inv_freq = 1.0 / (theta ** (even / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim: the 90° turn of each channel pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels by a position-dependent angle. x: [B, n, T, hd]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, nh, T, hd], k, v [B, nkv, T, hd], q and k rotated by
        ``cos``/``sin``. The head counts come from the weights' shapes, so a tensor-parallel copy
        (nh/tp, nkv/tp heads) projects alike."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        # Each group of nh/nkv query heads shares one key/value head. [B, nh, T, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # [B, T, H]
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [B, T, F]
        return self.down_proj(hidden)  # [B, T, H]


class Block(nn.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def run_blocks(
    blocks: Iterable[nn.Module],
    x: torch.Tensor,
    cfg: ModelConfig,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoder ``blocks`` (an iterable) on x [B, T, H] at rotary ``positions`` (default 0..T-1) ->
    [B, T, H]."""
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)
    # tables in the activations' dtype (as transformers' Llama does), or bf16 q/k would turn fp32
    cos, sin = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype=x.dtype)
    for block in blocks:
        x = block(x, cos, sin)  # [B, T, H]
    return x


class Transformer(nn.Module):
    """Token embedding -> n_layer blocks -> final norm -> output head (logits over V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx: [B, T] token ids -> logits [B, T, V]; with targets, also the mean cross-entropy."""
        if positions is None:
            # from the ids: under sequence parallelism the embedding returns T/tp tokens
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = run_blocks(self.layers, self.tok_emb(idx), self.cfg, positions)  # [B, T, H]
        logits = self.lm_head(self.norm(x))  # [B, T, V]
        if targets is None:
            return logits
        # in at least fp32: a bf16 softmax over V would round every probability
        wide = logits.to(compute_dtype(logits.dtype))
        loss = F.cross_entropy(wide.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic initialisation from ``seed``, whatever the global RNG state: N(0, std)
    for linear and embedding weights (output projections scaled by 1/sqrt(2 n_layer), as
    GPT-2 does), ones for norms. Modules are visited in a fixed order (named_parameters)."""
    g = torch.Generator().manual_seed(seed)
    n_layer = getattr(getattr(model, "cfg", None), "n_layer", 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            scale = std
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                scale = std / math.sqrt(2 * n_layer)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def build_model(
    cfg: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """The course model with weights from ``seed``: same seed, same weights, on every rank."""
    model = init_weights(Transformer(cfg), seed)
    return model.to(device=device, dtype=dtype)


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied weight counts once)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())
