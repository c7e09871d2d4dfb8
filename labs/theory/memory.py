"""Memory per rank: parameters, gradients and optimizer state (the training *state*), and
``memory_per_rank``, which adds activations under every parallelism (notebook 01's calculator).

Pure Python, no torch: every figure here is a formula, and tests check each one
against real tensors (``labs.measure.memory``).

    memory_per_rank(PRESETS["llama3-8b"], seq=4096, mbs=1, zero=3, dp=8)   # {"total_bytes": ...}
    python -m labs.theory memory --preset llama3-8b --seq 4096 --mbs 1 --zero 3 --dp 8 \
        --gpu-mem 80 --json

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

Model parallelism decides which Ψ a rank holds before ZeRO shards it: tensor parallelism
(Megatron, Shoeybi et al. 2019) splits q/k/v/o and the MLP matrices 1/tp (by heads and by F)
and the vocab-parallel embedding and head ceil(V/tp) rows each; norms (and GPT's row-parallel
biases and position table) are replicated. Pipeline parallelism gives stage s its layers (the
first L mod pp stages one extra), the first stage the embedding, the last the final norm and
the head (a tied head is a second copy there when pp > 1). Context parallelism and sequence
parallelism split activations only; ZeRO shards over the dp ranks only. Activations come
from ``labs.theory.activations``, times the micro-batches a stage holds at its peak
(``labs.theory.pipeline.in_flight_microbatches``: all M for AFAB, min(pp - s, M) for 1F1B).
The rank reported is the stage with the largest total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labs.theory.activations import RECOMPUTE, stage_activation_bytes
from labs.theory.dims import ParallelDims, check_divides, check_positive
from labs.theory.pipeline import in_flight_microbatches

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
    n_kv_heads: int | None = None  # None: = n_heads
    ffn_hidden: int | None = None  # None: 4 * hidden
    tied_embeddings: bool = False
    max_positions: int = 1024  # gpt only: rows of the learned position table
    head_dim: int | None = None  # None: hidden // n_heads

    def __post_init__(self):
        if self.arch not in ("llama", "gpt"):
            raise ValueError(f"arch={self.arch!r} is not one of ('llama', 'gpt')")
        required = ("vocab_size", "hidden", "n_layers", "n_heads", "max_positions")
        check_positive(**{n: getattr(self, n) for n in required})
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
    h = spec.hidden
    V = spec.vocab_size
    L = spec.n_layers
    if spec.arch == "llama":
        q_o = 2 * h * spec.n_heads * spec.hd
        k_v = 2 * h * spec.kv_heads * spec.hd
        attention = q_o + k_v
        mlp = 3 * h * spec.ffn
        norms = 2 * h
        embedding = V * h
        final_norm = h
    else:
        # gpt: qkv and output projections with biases, up/down with biases, 2 LayerNorms (w + b)
        attention = (h * 3 * h + 3 * h) + (h * h + h)
        mlp = (h * spec.ffn + spec.ffn) + (spec.ffn * h + h)
        norms = 2 * 2 * h
        embedding = V * h + spec.max_positions * h
        final_norm = 2 * h
    per_layer = attention + mlp + norms
    head = 0 if spec.tied_embeddings else V * h
    total = embedding + L * per_layer + final_norm + head
    return {
        "embedding": embedding,
        "attention": attention,
        "mlp": mlp,
        "norms": norms,
        "per_layer": per_layer,
        "final_norm": final_norm,
        "head": head,
        "total": total,
    }


def param_count(spec: ModelSpec) -> int:
    """The exact number of parameters (``param_counts``' total)."""
    return param_counts(spec)["total"]


def _check_state_args(n_params: int, precision: str, optimizer: str, zero: int, dp: int) -> None:
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params must be an integer >= 0, got {n_params!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {tuple(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {tuple(OPTIMIZERS)}")
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not one of {ZERO_STAGES}")
    check_positive(dp=dp)
    if zero > 0 and dp == 1:
        raise ValueError(
            f"zero={zero} shards over data-parallel ranks but dp=1; use dp >= 2 or zero=0"
        )


def state_bytes(
    n_params: int,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    zero: int = 0,
    dp: int = 1,
    fp32_grad_accum: bool = False,
    exact_shards: bool = False,
) -> dict[str, float]:
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
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": optim,
        "total_bytes": params + grads + optim,
    }


# ----------------------------------------------------------------------------------------------
# Per rank under tensor, pipeline, context and data parallelism: the calculator of notebook 01.

PP_SCHEDULES = ("1f1b", "afab", "gpipe")
GIB = 2**30


def param_counts_per_rank(spec: ModelSpec, *, tp: int = 1) -> dict[str, int]:
    """``param_counts`` for one tensor-parallel rank (``tp`` must divide heads, kv-heads and F)."""
    h = spec.hidden
    V = math.ceil(spec.vocab_size / tp)
    F = spec.ffn
    if spec.arch == "llama":
        attention = (2 * h * spec.n_heads * spec.hd + 2 * h * spec.kv_heads * spec.hd) // tp
        mlp = 3 * h * F // tp
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
    total = embedding + spec.n_layers * per_layer + final_norm + head
    return {
        "embedding": embedding,
        "attention": attention,
        "mlp": mlp,
        "norms": norms,
        "per_layer": per_layer,
        "final_norm": final_norm,
        "head": head,
        "total": total,
    }


def layers_on_stage(n_layers: int, pp: int, stage: int) -> int:
    """Layers of pipeline stage ``stage``: n_layers // pp, one more on the first n_layers % pp
    stages."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def stage_params(spec: ModelSpec, *, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds (before ZeRO), the layers split
    evenly."""
    return layers_params(
        spec,
        layers=layers_on_stage(spec.n_layers, pp, stage),
        first=stage == 0,
        last=stage == pp - 1,
        pp=pp,
        tp=tp,
    )


def layers_params(
    spec: ModelSpec, *, layers: int, first: bool, last: bool, pp: int, tp: int = 1
) -> int:
    """Parameters one TP rank of a pipeline stage holds with ``layers`` blocks: the ``first`` stage
    also the embedding, the ``last`` the final norm and the head (and, tied across pp > 1 stages,
    its own copy of the table)."""
    c = param_counts_per_rank(spec, tp=tp)
    n = layers * c["per_layer"] + (c["embedding"] if first else 0)
    if last:
        tied_copy = (
            math.ceil(spec.vocab_size / tp) * spec.hidden if spec.tied_embeddings and pp > 1 else 0
        )
        n += c["final_norm"] + c["head"] + tied_copy
    return n


def _check_layout(
    spec: ModelSpec,
    *,
    seq: int,
    mbs: int,
    precision: str,
    dp: int,
    tp: int,
    sp: bool,
    pp: int,
    cp: int,
    recompute: str,
    microbatches: int | None,
    schedule: str,
    fp32_grad_accum: bool,
) -> None:
    check_positive(seq=seq, mbs=mbs)
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)  # every degree an integer >= 1
    dims.check_model(
        n_head=spec.n_heads, n_kv_head=spec.kv_heads, ffn_hidden=spec.ffn, n_layer=spec.n_layers
    )
    if sp and tp == 1:
        raise ValueError(
            "sp=True splits activations over tensor-parallel ranks but tp=1;"
            " use tp >= 2 or sp=False"
        )
    # tokens split evenly
    check_divides(seq, "seq", cp * tp if sp else cp, "cp*tp" if sp else "cp")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {PP_SCHEDULES}")
    if microbatches is not None:
        check_positive(microbatches=microbatches)
    if fp32_grad_accum and precision != "bf16-mixed":
        raise ValueError(
            f"fp32_grad_accum=True only applies to precision='bf16-mixed', not {precision!r}"
        )


def memory_per_rank(
    spec: ModelSpec,
    *,
    seq: int,
    mbs: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    zero: int = 0,
    dp: int = 1,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    cp: int = 1,
    recompute: str = "none",
    microbatches: int | None = None,
    schedule: str = "1f1b",
    fp32_grad_accum: bool = False,
    exact_shards: bool = False,
) -> dict:
    """Bytes one rank holds at the peak of a training step: parameters, gradients, optimizer
    state and saved activations, for the busiest pipeline stage.

    ``microbatches`` (M, default pp) is the number of micro-batches per step: AFAB holds all M
    at once, 1F1B at most pp - stage. Returns ``params`` (this rank's parameters before ZeRO),
    ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``activation_bytes``, ``total_bytes``,
    ``stage``, ``layers``, ``in_flight`` (micro-batches held), ``activations_per_microbatch``
    (the parts: per_layer, layers, embedding, rotary, final_norm, loss, total) and
    ``stage_total_bytes`` (every stage's total).
    """
    _check_layout(
        spec,
        seq=seq,
        mbs=mbs,
        precision=precision,
        dp=dp,
        tp=tp,
        sp=sp,
        pp=pp,
        cp=cp,
        recompute=recompute,
        microbatches=microbatches,
        schedule=schedule,
        fp32_grad_accum=fp32_grad_accum,
    )
    m = microbatches or pp
    stages = []
    for stage in range(pp):
        n = stage_params(spec, tp=tp, pp=pp, stage=stage)
        state = state_bytes(
            n,
            precision=precision,
            optimizer=optimizer,
            zero=zero,
            dp=dp,
            fp32_grad_accum=fp32_grad_accum,
            exact_shards=exact_shards,
        )
        layers = layers_on_stage(spec.n_layers, pp, stage)
        per_mb = stage_activation_bytes(
            spec,
            seq=seq,
            mbs=mbs,
            dtype_bytes=PRECISIONS[precision]["param"],
            layers=layers,
            first=stage == 0,
            last=stage == pp - 1,
            tp=tp,
            sp=sp,
            cp=cp,
            recompute=recompute,
        )
        in_flight = in_flight_microbatches(schedule, pp, m, stage) if pp > 1 else 1
        activations = in_flight * per_mb["total"]
        stages.append(
            {
                "params": n,
                "param_bytes": state["param_bytes"],
                "grad_bytes": state["grad_bytes"],
                "optimizer_bytes": state["optimizer_bytes"],
                "activation_bytes": activations,
                "total_bytes": state["total_bytes"] + activations,
                "stage": stage,
                "layers": layers,
                "in_flight": in_flight,
                "activations_per_microbatch": per_mb,
            }
        )
    worst = max(stages, key=lambda s: s["total_bytes"])
    return {**worst, "stage_total_bytes": [s["total_bytes"] for s in stages]}


def fits(total_bytes: float, gpu_mem_gib: float) -> bool:
    """Whether ``total_bytes`` fit in a GPU with ``gpu_mem_gib`` GiB (2^30 bytes, as nvidia-smi's
    MiB / 1024). Transient buffers (logits casts, communication buffers, a block recomputed in
    backward, allocator fragmentation) are not in the total: leave a few GiB of headroom."""
    if not gpu_mem_gib > 0:
        raise ValueError(f"gpu_mem must be > 0 GiB, got {gpu_mem_gib!r}")
    return total_bytes <= gpu_mem_gib * GIB
