"""The model a calculator is about: ``ModelSpec`` (the dimensions that fix a decoder-only
transformer's parameter count) and its parameters, in all and per rank. Pure Python.

    param_count(PRESETS["llama3-8b"])                     # 8,030,261,248
    param_counts_per_rank(PRESETS["llama3-70b"], tp=8)    # by part, on one TP rank
    stage_params(PRESETS["llama3-70b"], tp=8, pp=4, stage=3)

Every other theory module (activations, memory, FLOPs, the planner) takes a ``ModelSpec``; this
module imports none of them, so none of them imports another for the type. Tests build each
preset with ``transformers`` on the meta device and compare ``sum(p.numel())``
(tests/test_theory_memory.py).

Tensor parallelism (Megatron, Shoeybi et al. 2019) splits q/k/v/o and the MLP matrices 1/tp (by
heads and by F) and the vocab-parallel embedding and head ceil(V/tp) rows each; norms (and GPT's
row-parallel biases and position table) are replicated. Pipeline parallelism gives stage s its
layers (the first L mod pp stages one extra), the first stage the embedding, the last the final
norm and the head (a tied head is a second copy there when pp > 1). A mixture-of-experts model
(``n_experts`` > 1) holds E/ep experts per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from labs.theory.dims import check_positive


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions that fix a decoder-only transformer's parameter count.

    ``arch="llama"``: RMSNorm (weight only), no biases, rotary positions, SwiGLU MLP
    (gate, up, down), grouped-query attention (``n_kv_heads``), untied head by default.
    ``arch="gpt"``: LayerNorm (weight and bias), biases everywhere, learned positions
    (``max_positions``), GELU MLP (up, down), multi-head attention, tied head.
    """

    arch: str = "llama"
    vocab_size: int = 256
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: = n_heads
    ffn_hidden: int | None = None  # None: 4 * hidden
    tied_embeddings: bool = False
    max_positions: int = 1024  # gpt only: rows of the learned position table
    head_dim: int | None = None  # None: hidden // n_heads
    n_experts: int = 1  # > 1: every MLP is this many SwiGLU experts behind a router (llama only)
    top_k: int = 1  # experts each token runs through (with n_experts > 1)

    def __post_init__(self):
        if self.arch not in ("llama", "gpt"):
            raise ValueError(f"arch={self.arch!r} is not one of ('llama', 'gpt')")
        required = ("vocab_size", "hidden", "n_layers", "n_heads", "max_positions")
        check_positive(**{n: getattr(self, n) for n in required})
        check_positive(n_experts=self.n_experts, top_k=self.top_k)
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} is larger than n_experts={self.n_experts}: a token cannot"
                f" pick more experts than exist; use top_k <= {self.n_experts}"
            )
        if self.n_experts > 1 and self.arch != "llama":
            raise ValueError(
                f"n_experts={self.n_experts} with arch={self.arch!r}: experts are SwiGLU MLPs;"
                " use arch='llama'"
            )
        optional = ("n_kv_heads", "ffn_hidden", "head_dim")  # None: the default above
        check_positive(**{n: getattr(self, n) for n in optional if getattr(self, n) is not None})
        if self.head_dim is None and self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"heads={self.n_heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        """nkv: key/value heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        """F: the MLP's hidden width."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def hd(self) -> int:
        """hd: the head dimension."""
        return self.head_dim or self.hidden // self.n_heads

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.n_experts > 1


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Exact parameter count by part: ``embedding``, ``per_layer`` (and its ``attention``,
    ``mlp``, ``norms``), ``final_norm``, ``head`` (0 when tied), ``experts`` (the expert
    weights of all layers, which expert parallelism splits; 0 for a dense model) and ``total``.

    Llama: per layer  h·nh·hd + 2·h·nkv·hd + nh·hd·h   (q, k, v, o)
                    + 3·h·F                             (gate, up, down)
                    + 2·h                               (two RMSNorm weights)
           total    V·h (embedding) + L·per_layer + h (final norm) + V·h (head, untied)
           MoE      the MLP is E experts of 3·h·F and a router h·E (``labs.theory.moe``)
    GPT:   the playbook's N = h·V + L(12h² + 13h) + 2h when F = 4h, plus the learned
           positions (max_positions·h), which the playbook leaves out.
    """
    return param_counts_per_rank(spec)


def param_count(spec: ModelSpec) -> int:
    """The exact number of parameters (``param_counts``' total)."""
    return param_counts(spec)["total"]


def param_counts_per_rank(spec: ModelSpec, *, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """``param_counts`` for one tensor-parallel rank (``tp`` must divide heads, kv-heads and F) of
    one expert-parallel group of ``ep`` ranks (each holds n_experts / ep experts)."""
    return dict(_counts_per_rank(spec, tp, ep))


@lru_cache(maxsize=1024)
def _counts_per_rank(spec: ModelSpec, tp: int, ep: int) -> tuple[tuple[str, int], ...]:
    h = spec.hidden
    V = math.ceil(spec.vocab_size / tp)
    F = spec.ffn
    L = spec.n_layers
    experts = 0  # per layer
    if spec.arch == "llama":
        attention = (2 * h * spec.n_heads * spec.hd + 2 * h * spec.kv_heads * spec.hd) // tp
        expert = 3 * h * F // tp
        if spec.moe:
            experts = spec.n_experts // ep * expert
            mlp = experts + h * spec.n_experts  # the router is replicated
        else:
            mlp = expert
        norms = 2 * h
        embedding = V * h
        final_norm = h
    else:
        # column-parallel qkv and up (weights and biases split), row-parallel o and down (biases
        # replicated)
        attention = (4 * h * h + 3 * h) // tp + h
        mlp = (2 * h * F + F) // tp + h
        norms = 4 * h
        embedding = V * h + spec.max_positions * h
        final_norm = 2 * h
    per_layer = attention + mlp + norms
    head = 0 if spec.tied_embeddings else V * h
    total = embedding + L * per_layer + final_norm + head
    return (
        ("embedding", embedding),
        ("attention", attention),
        ("mlp", mlp),
        ("norms", norms),
        ("per_layer", per_layer),
        ("final_norm", final_norm),
        ("head", head),
        ("experts", L * experts),
        ("total", total),
    )


def layers_on_stage(n_layers: int, pp: int, stage: int) -> int:
    """Layers of pipeline stage ``stage``: n_layers // pp, one more on the first n_layers % pp
    stages."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def stage_params(spec: ModelSpec, *, tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds (before ZeRO), the layers split
    evenly."""
    return layers_params(
        spec,
        layers=layers_on_stage(spec.n_layers, pp, stage),
        first=stage == 0,
        last=stage == pp - 1,
        pp=pp,
        tp=tp,
        ep=ep,
    )


def layers_params(
    spec: ModelSpec, *, layers: int, first: bool, last: bool, pp: int, tp: int = 1, ep: int = 1
) -> int:
    """Parameters one TP rank of a pipeline stage holds with ``layers`` blocks: the ``first`` stage
    also the embedding, the ``last`` the final norm and the head (and, tied across pp > 1 stages,
    its own copy of the table)."""
    c = param_counts_per_rank(spec, tp=tp, ep=ep)
    n = layers * c["per_layer"] + (c["embedding"] if first else 0)
    if last:
        tied_copy = (
            math.ceil(spec.vocab_size / tp) * spec.hidden if spec.tied_embeddings and pp > 1 else 0
        )
        n += c["final_norm"] + c["head"] + tied_copy
    return n
