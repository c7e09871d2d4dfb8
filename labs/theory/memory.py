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
    (``optimizer_bytes=k`` sets k directly: 2 for an 8-bit Adam, 4 for bf16 moments, ...)

With ``offload`` (ZeRO-Offload, Ren et al. 2021) the optimizer state, fp32 master copy
included, lives in host memory: ``optimizer_bytes`` on the GPU is 0 and ``offloaded_bytes``
says what the host holds for this rank. FP8 training (``fp8``) changes activations only
(``labs.theory.activations``): the weights the GPU keeps stay in bf16 with an fp32 master copy,
the FP8 copies of a layer's weights live only while it runs.

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
parallelism split activations only; ZeRO shards over the dp ranks only. A mixture-of-experts
model (``ModelSpec.n_experts`` > 1) holds E/ep experts per rank (expert parallelism over the
data-parallel ranks), replicated over dp/ep ranks, which is what ZeRO shards them over.
Activations come from ``labs.theory.activations``, times the micro-batches a stage holds at
its peak (``labs.theory.pipeline.in_flight_microbatches``: all M for AFAB, min(pp - s, M) for
1F1B, min(pp, M) for ZB-H1; interleaved 1F1B walks the rank's order of chunk operations).
The rank reported is the stage with the largest total.
"""

from __future__ import annotations

import math
from functools import lru_cache

from labs.theory.activations import RECOMPUTE, stage_activation_bytes
from labs.theory.dims import ParallelDims, check_divides, check_positive

# the model and its parameters live in labs.theory.model; these names stay importable from here
from labs.theory.model import ModelSpec as ModelSpec
from labs.theory.model import layers_on_stage as layers_on_stage
from labs.theory.model import layers_params as layers_params
from labs.theory.model import param_count as param_count
from labs.theory.model import param_counts as param_counts
from labs.theory.model import param_counts_per_rank as param_counts_per_rank
from labs.theory.model import stage_params as stage_params
from labs.theory.pipeline import check_schedule, in_flight_microbatches, interleaved_peak

PRECISIONS = {
    # bytes per parameter: weights the model computes with, their gradients, the fp32 master copy
    "fp32": {"param": 4, "grad": 4, "master": 0},
    "bf16-mixed": {"param": 2, "grad": 2, "master": 4},
}
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
ZERO_STAGES = (0, 1, 2, 3)


def check_training(
    *,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    recompute: str = "none",
    schedule: str = "1f1b",
    optimizer_bytes: float | None = None,
) -> None:
    """Raise a ValueError naming the parameter for an unknown precision, optimizer,
    recomputation or pipeline schedule: the checks the memory calculator and the planner share,
    with the same messages."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {tuple(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {tuple(OPTIMIZERS)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {PP_SCHEDULES}")
    if optimizer_bytes is not None:
        number = isinstance(optimizer_bytes, (int, float)) and not isinstance(optimizer_bytes, bool)
        if not number or optimizer_bytes < 0:
            raise ValueError(
                "optimizer_bytes (optimizer state per parameter, fp32 master copy not included)"
                f" must be a number >= 0, got {optimizer_bytes!r}"
            )


def _check_state_args(n_params: int, precision: str, optimizer: str, zero: int, dp: int) -> None:
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params must be an integer >= 0, got {n_params!r}")
    check_training(precision=precision, optimizer=optimizer)
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
    optimizer_bytes: float | None = None,
) -> dict[str, float]:
    """Bytes of training state one rank holds between steps, for ``n_params`` parameters.

    Returns ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (moments plus the fp32
    master copy, which mixed-precision optimizers own) and ``total_bytes``. ``exact_shards``
    counts a sharded buffer as ceil(Ψ/N) elements, what flat-buffer ZeRO really holds;
    otherwise Ψ/N, the textbook figure. ``optimizer_bytes`` replaces the optimizer's k (state
    bytes per parameter, the master copy not included).
    """
    _check_state_args(n_params, precision, optimizer, zero, dp)
    check_training(optimizer_bytes=optimizer_bytes)
    p = PRECISIONS[precision]
    grad_per_param = p["grad"] + (4 if fp32_grad_accum else 0)
    k = OPTIMIZERS[optimizer] if optimizer_bytes is None else optimizer_bytes
    opt_per_param = p["master"] + k
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

PP_SCHEDULES = ("1f1b", "afab", "gpipe", "interleaved", "zb-h1")
GIB = 2**30


def _check_layout(
    spec: ModelSpec,
    *,
    seq: int,
    mbs: int,
    precision: str,
    optimizer: str,
    dp: int,
    tp: int,
    sp: bool,
    pp: int,
    cp: int,
    ep: int,
    recompute: str,
    microbatches: int | None,
    schedule: str,
    virtual: int,
    fp32_grad_accum: bool,
    fp8: bool,
    optimizer_bytes: float | None,
) -> None:
    check_positive(seq=seq, mbs=mbs, ep=ep, virtual=virtual)
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)  # every degree an integer >= 1
    dims.check_model(
        n_head=spec.n_heads,
        n_kv_head=spec.kv_heads,
        ffn_hidden=spec.ffn,
        n_layer=spec.n_layers,
        virtual_stages=virtual,
    )
    if sp and tp == 1:
        raise ValueError(
            "sp=True splits activations over tensor-parallel ranks but tp=1;"
            " use tp >= 2 or sp=False"
        )
    # tokens split evenly
    check_divides(seq, "seq", cp * tp if sp else cp, "cp*tp" if sp else "cp")
    check_training(
        precision=precision,
        optimizer=optimizer,
        recompute=recompute,
        schedule=schedule,
        optimizer_bytes=optimizer_bytes,
    )
    if microbatches is not None:
        check_positive(microbatches=microbatches)
    if pp > 1:
        check_schedule(schedule, pp, microbatches or pp, virtual)
    elif virtual > 1:
        raise ValueError(
            f"virtual={virtual} splits pipeline stages into chunks but pp=1; use pp >= 2"
        )
    if fp32_grad_accum and precision != "bf16-mixed":
        raise ValueError(
            f"fp32_grad_accum=True only applies to precision='bf16-mixed', not {precision!r}"
        )
    if fp8 and precision != "bf16-mixed":
        raise ValueError(
            f"fp8=True runs the linear layers in FP8 inside bf16-mixed training, not {precision!r};"
            " use precision='bf16-mixed'"
        )
    if ep > 1:
        if not spec.moe:
            raise ValueError(f"ep={ep} spreads experts over ranks but the model has none; use ep=1")
        check_divides(spec.n_experts, "n_experts", ep, "ep")
        check_divides(dp, "dp", ep, "ep")  # experts are spread over the data-parallel ranks


@lru_cache(maxsize=4096)  # the planner asks again for each micro-batch size and schedule
def _state(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    ep: int,
    stage: int,
    zero: int,
    dp: int,
    offload: bool,
    **state: object,
) -> dict:
    """``state_bytes`` of one stage's parameters: the dense ones sharded by ZeRO over the dp
    ranks, a mixture of experts' expert weights over the dp/ep ranks that hold the same experts;
    with ``offload`` the optimizer's bytes move to ``offloaded_bytes``."""
    n = stage_params(spec, tp=tp, pp=pp, stage=stage, ep=ep)
    layers = layers_on_stage(spec.n_layers, pp, stage)
    experts = layers * param_counts_per_rank(spec, tp=tp, ep=ep)["experts"] // spec.n_layers
    dense = state_bytes(n - experts, zero=zero, dp=dp, **state)
    out = {**dense, "params": n}
    if experts:
        expert_dp = dp // ep
        shared = state_bytes(experts, zero=zero if expert_dp > 1 else 0, dp=expert_dp, **state)
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes"):
            out[key] += shared[key]
    out["offloaded_bytes"] = out["optimizer_bytes"] if offload else 0.0
    if offload:
        out["total_bytes"] -= out["optimizer_bytes"]
        out["optimizer_bytes"] = 0.0
    return out


def _activation_parts(
    spec: ModelSpec, *, layers: int, first: bool, last: bool, virtual: int, **size: object
) -> tuple[dict, list[float]]:
    """One micro-batch's activation parts on a stage with ``layers`` layers (``first``: it has the
    embedding, ``last`` the loss), and what each of its ``virtual`` chunks holds per chunk
    micro-batch: chunk c holds layers/V of the stage; only the first stage's first chunk keeps the
    embedding's, the last stage's last chunk the loss's."""
    per_mb = stage_activation_bytes(spec, layers=layers, first=first, last=last, **size)
    if virtual == 1:
        return per_mb, [per_mb["total"]]
    chunk = stage_activation_bytes(spec, layers=layers / virtual, first=False, last=False, **size)
    chunk_bytes = [chunk["total"]] * virtual
    chunk_bytes[0] += per_mb["embedding"]
    chunk_bytes[-1] += per_mb["final_norm"] + per_mb["loss"]
    return per_mb, chunk_bytes


def _stage_activations(
    per_mb: dict, chunk_bytes: list[float], *, stage: int, pp: int, m: int, schedule: str
) -> tuple[float, int]:
    """(bytes, micro-batches held) of stage ``stage`` at its peak: the micro-batches its
    schedule holds at once (``in_flight_microbatches``; interleaved: its order of chunk
    operations, ``interleaved_peak``)."""
    if pp == 1:
        return per_mb["total"], 1
    if schedule != "interleaved":
        held = in_flight_microbatches(schedule, pp, m, stage)
        return held * per_mb["total"], held
    return interleaved_peak(pp, m, stage, len(chunk_bytes), chunk_bytes)


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
    virtual: int = 1,
    ep: int = 1,
    fp8: bool = False,
    optimizer_bytes: float | None = None,
    offload: bool = False,
) -> dict:
    """Bytes one rank holds at the peak of a training step: parameters, gradients, optimizer
    state and saved activations, for the busiest pipeline stage.

    ``microbatches`` (M, default pp) is the number of micro-batches per step: AFAB holds all M
    at once, 1F1B at most pp - stage, ZB-H1 min(pp, M), interleaved 1F1B (``virtual`` chunks
    per rank) what its order of chunk operations holds. ``ep``: expert-parallel ranks (a
    mixture-of-experts spec); ``fp8``: FP8 linear layers; ``optimizer_bytes``: the optimizer's
    state per parameter instead of ``optimizer``'s; ``offload``: optimizer state on the host.
    Returns ``params`` (this rank's parameters before ZeRO), ``param_bytes``, ``grad_bytes``,
    ``optimizer_bytes``, ``activation_bytes``, ``total_bytes`` (on the GPU),
    ``offloaded_bytes`` (in host memory), ``stage``, ``layers``, ``in_flight`` (micro-batches,
    or for interleaved chunk micro-batches, held), ``activations_per_microbatch`` (the parts:
    per_layer, layers, embedding, rotary, final_norm, loss, total) and ``stage_total_bytes``
    (every stage's total).
    """
    _check_layout(
        spec,
        seq=seq,
        mbs=mbs,
        precision=precision,
        optimizer=optimizer,
        dp=dp,
        tp=tp,
        sp=sp,
        pp=pp,
        cp=cp,
        ep=ep,
        recompute=recompute,
        microbatches=microbatches,
        schedule=schedule,
        virtual=virtual,
        fp32_grad_accum=fp32_grad_accum,
        fp8=fp8,
        optimizer_bytes=optimizer_bytes,
    )
    m = microbatches or pp
    size = dict(
        seq=seq,
        mbs=mbs,
        dtype_bytes=PRECISIONS[precision]["param"],
        tp=tp,
        sp=sp,
        cp=cp,
        recompute=recompute,
        fp8=fp8,
    )
    peaks = _stage_peaks(spec, pp, m, schedule, virtual, tuple(size.items()))
    # stages with the same layers, embedding and head hold the same state
    states = {}
    totals = []
    for stage, (kind, _, activations, _) in enumerate(peaks):
        if kind not in states:
            states[kind] = _state(
                spec,
                tp=tp,
                pp=pp,
                ep=ep,
                stage=stage,
                zero=zero,
                dp=dp,
                offload=offload,
                precision=precision,
                optimizer=optimizer,
                fp32_grad_accum=fp32_grad_accum,
                exact_shards=exact_shards,
                optimizer_bytes=optimizer_bytes,
            )
        totals.append(states[kind]["total_bytes"] + activations)
    worst = max(range(pp), key=totals.__getitem__)  # the first of the busiest stages
    kind, per_mb, activations, in_flight = peaks[worst]
    state = states[kind]
    return {
        "params": state["params"],
        "param_bytes": state["param_bytes"],
        "grad_bytes": state["grad_bytes"],
        "optimizer_bytes": state["optimizer_bytes"],
        "activation_bytes": activations,
        "total_bytes": totals[worst],
        "offloaded_bytes": state["offloaded_bytes"],
        "stage": worst,
        "layers": kind[0],
        "in_flight": in_flight,
        "activations_per_microbatch": dict(per_mb),
        "stage_total_bytes": totals,
    }


@lru_cache(maxsize=1024)
def _stage_peaks(
    spec: ModelSpec, pp: int, m: int, schedule: str, virtual: int, size: tuple
) -> tuple[tuple[tuple, dict, float, int], ...]:
    """Per stage: its kind (layers, has the embedding, has the loss), one micro-batch's activation
    parts, and the bytes and micro-batches it holds at its peak. ZeRO, dp and the optimizer do not
    change them: kept for the planner, which asks again for every one of its layouts."""
    parts = {}
    peaks = []
    for stage in range(pp):
        layers = layers_on_stage(spec.n_layers, pp, stage)
        kind = (layers, stage == 0, stage == pp - 1)
        if kind not in parts:
            parts[kind] = _activation_parts(
                spec, layers=layers, first=kind[1], last=kind[2], virtual=virtual, **dict(size)
            )
        per_mb, chunk_bytes = parts[kind]
        activations, in_flight = _stage_activations(
            per_mb, chunk_bytes, stage=stage, pp=pp, m=m, schedule=schedule
        )
        peaks.append((kind, per_mb, activations, in_flight))
    return tuple(peaks)


def fits(total_bytes: float, gpu_mem_gib: float) -> bool:
    """Whether ``total_bytes`` fit in a GPU with ``gpu_mem_gib`` GiB (2^30 bytes, as nvidia-smi's
    MiB / 1024). Transient buffers (logits casts, communication buffers, a block recomputed in
    backward, allocator fragmentation) are not in the total: leave a few GiB of headroom."""
    if not gpu_mem_gib > 0:
        raise ValueError(f"gpu_mem must be > 0 GiB, got {gpu_mem_gib!r}")
    return total_bytes <= gpu_mem_gib * GIB
