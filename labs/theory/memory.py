"""Memory per rank: parameters, gradients and optimizer state (the training *state*).

Pure Python, no torch: every figure here is a formula, and tests check each one
against real tensors (``labs.measure.memory``).

Symbols: Ψ parameters, N data-parallel ranks (``dp``), k optimizer bytes per parameter.

    precision      params  grads  fp32 master  (bytes per parameter)
    fp32              4      4        0
    bf16-mixed        2      2        4        (+4 with fp32 gradient accumulation)

    optimizer      k (fp32 state per parameter)
    adam / adamw   8  (first and second moment)
    sgd-momentum   4
    sgd            0

ZeRO (Rajbhandari et al. 2020, §5) shards the state over the N data-parallel ranks:

    stage 0: params + grads + (master + k)                 (plain DDP)
    stage 1: params + grads + (master + k) / N             (optimizer state sharded)
    stage 2: params + (grads + master + k) / N             (+ gradients sharded)
    stage 3: (params + grads + master + k) / N             (+ parameters sharded)

With flat-buffer sharding a rank holds ceil(Ψ/N) elements of each sharded buffer
(the last shard is padded), so ``state_bytes(..., exact_shards=True)`` rounds up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRECISIONS = {
    # bytes per parameter: weights the model computes with, their gradients, the fp32 master copy
    "fp32": {"param": 4, "grad": 4, "master": 0},
    "bf16-mixed": {"param": 2, "grad": 2, "master": 4},
}
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
ZERO_STAGES = (0, 1, 2, 3)


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
    n_kv_heads: int | None = None     # None: = n_heads
    ffn_hidden: int | None = None     # None: 4 * hidden
    tied_embeddings: bool = False
    max_positions: int = 1024         # gpt only: rows of the learned position table
    head_dim: int | None = None       # None: hidden // n_heads

    def __post_init__(self):
        if self.arch not in ("llama", "gpt"):
            raise ValueError(f"arch={self.arch!r} is not one of ('llama', 'gpt')")
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("n_kv_heads", "ffn_hidden", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.head_dim is None and self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"heads={self.n_heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.n_heads


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Exact parameter count by part: ``embedding``, ``per_layer`` (and its ``attention``,
    ``mlp``, ``norms``), ``final_norm``, ``head`` (0 when tied) and ``total``.

    Llama: per layer  h·nh·hd + 2·h·nkv·hd + nh·hd·h   (q, k, v, o)
                    + 3·h·F                             (gate, up, down)
                    + 2·h                               (two RMSNorm weights)
           total    V·h (embedding) + L·per_layer + h (final norm) + V·h (head, untied)
    GPT:   the playbook's N = h·V + L(12h² + 13h) + 2h when F = 4h, plus the learned
           positions (max_positions·h), which the playbook leaves out.
    """
    h, V, L = spec.hidden, spec.vocab_size, spec.n_layers
    if spec.arch == "llama":
        q_o = 2 * h * spec.n_heads * spec.hd
        k_v = 2 * h * spec.kv_heads * spec.hd
        attention, mlp, norms = q_o + k_v, 3 * h * spec.ffn, 2 * h
        embedding, final_norm = V * h, h
    else:  # gpt: qkv and output projections with biases, up/down with biases, 2 LayerNorms (w + b)
        attention = (h * 3 * h + 3 * h) + (h * h + h)
        mlp = (h * spec.ffn + spec.ffn) + (spec.ffn * h + h)
        norms = 2 * 2 * h
        embedding, final_norm = V * h + spec.max_positions * h, 2 * h
    per_layer = attention + mlp + norms
    head = 0 if spec.tied_embeddings else V * h
    total = embedding + L * per_layer + final_norm + head
    return {"embedding": embedding, "attention": attention, "mlp": mlp, "norms": norms, "per_layer": per_layer,
            "final_norm": final_norm, "head": head, "total": total}


def param_count(spec: ModelSpec) -> int:
    return param_counts(spec)["total"]


def _check_state_args(n_params, precision, optimizer, zero, dp):
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params must be an integer >= 0, got {n_params!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {tuple(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {tuple(OPTIMIZERS)}")
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not one of {ZERO_STAGES}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    if zero > 0 and dp == 1:
        raise ValueError(f"zero={zero} shards over data-parallel ranks but dp=1; use dp >= 2 or zero=0")


def state_bytes(n_params: int, *, precision: str = "fp32", optimizer: str = "adamw", zero: int = 0, dp: int = 1,
                fp32_grad_accum: bool = False, exact_shards: bool = False) -> dict[str, float]:
    """Bytes of training state one rank holds between steps, for ``n_params`` parameters.

    Returns ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (moments plus the fp32
    master copy, which mixed-precision optimizers own) and ``total_bytes``. ``exact_shards``
    counts a sharded buffer as ceil(Ψ/N) elements, what flat-buffer ZeRO really holds;
    otherwise Ψ/N, the textbook figure.
    """
    _check_state_args(n_params, precision, optimizer, zero, dp)
    p = PRECISIONS[precision]
    grad_per_param = p["grad"] + (4 if fp32_grad_accum else 0)
    opt_per_param = p["master"] + OPTIMIZERS[optimizer]
    shard = math.ceil(n_params / dp) if exact_shards else n_params / dp
    params = n_params * p["param"] if zero < 3 else shard * p["param"]
    grads = n_params * grad_per_param if zero < 2 else shard * grad_per_param
    optim = n_params * opt_per_param if zero < 1 else shard * opt_per_param
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optim, "total_bytes": params + grads + optim}
