"""Serving on paper: KV-cache bytes, communication per generated token and a rough
decode-latency model, for tensor parallelism and for layer placement (notebook 09). Pure Python.

    # what one rank's cache holds
    kv_cache_bytes_per_rank(spec, batch=4, seq=35, tp=2, dtype_bytes=4)
    # per rank: collectives of one forward
    forward_comm(spec, mode="tp", degree=4, batch=4)
    # seconds per token, tokens/s
    decode_time(PRESETS["llama3-70b"], mode="tp", degree=8, batch=1, context=4096)
    # tokens of cache beside the weights
    cache_capacity(PRESETS["llama3-70b"], gpu="H100 80GB", tp=8)
    python -m labs.theory infer --preset llama3-70b --degree 8 --batch 8 --seq 4096 --json

Symbols: B sequences decoded together, T positions cached per sequence (prompt + new tokens),
t tokens fed in one forward (prefill: the prompt length T0; decode: 1), L layers, H hidden,
nh / nkv query / key-value heads, hd head dim, e bytes per element, N ranks (the tp or pp
degree).

KV cache per rank:  2 · L_rank · B · T · nkv_rank · hd · e   (K and V of every cached position)

    TP          L_rank = L, nkv_rank = nkv/N (N > nkv: vLLM replicates, one kv head per rank)
    placement   L_rank = the stage's layers (``labs.theory.memory.layers_on_stage``),
                nkv_rank = nkv

Per forward of t tokens, per rank (the contract of ``solutions/inference.py``):

    TP          2L+1 all-reduces of B·t·H·e (embedding's g; o_proj's and down_proj's g per
                layer) and one all-gather of N·B·2·8 bytes (every rank's best logit and its id,
                float64): 2L+2 collectives
    placement   stage s < N-1 sends its output B·t·H·e to s+1; the last sends the ids, B·8, to
                the first: N messages per token, one at a time (P-1 activation hops and the way
                back)

Decode latency (rough, roofline): a decode step reads every weight and the whole cache once for
t = 1 token per sequence, so on a GPU it is bound by memory bandwidth: per rank
max(bytes read / HBM bandwidth, FLOPs / peak), plus per message a latency α and bytes / link
bandwidth. TP: the N ranks read 1/N each, at the same time, then 2L+2 collectives. Placement:
the stages read their parts one after another (the whole model), then N hops.
"""

from __future__ import annotations

from labs.theory.comm import all_gather_bytes, all_reduce_bytes
from labs.theory.dims import check_divides, check_positive
from labs.theory.memory import GIB
from labs.theory.model import ModelSpec, layers_on_stage, stage_params
from labs.theory.presets import GPUS, PRESETS, preset

MODES = ("tp", "placement")
# HBM bandwidth, TB/s (data sheets; SXM parts): what a memory-bound decode step streams its
# weights at
HBM_TBS = {
    "A100 40GB": 1.555,
    "A100 80GB": 2.039,
    "H100 80GB": 3.35,
    "H200 141GB": 4.8,
    "RTX 4090 24GB": 1.008,
}
# H100 NVLink 4, one direction; a small NCCL message's latency
NVLINK_GBS = 450.0
NVLINK_LATENCY_US = 5.0


def check(spec: ModelSpec, *, mode: str, degree: int) -> None:
    """ValueError unless ``mode`` applies to ``spec`` on ``degree`` ranks: TP splits query heads
    (and kv heads, or replicates them when degree > nkv), placement needs a layer per stage."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    check_positive(degree=degree)
    if mode == "tp":
        check_divides(spec.n_heads, "n_heads", degree, "tp")
        if degree > spec.kv_heads:
            check_divides(degree, "tp", spec.kv_heads, "n_kv_heads")
        else:
            check_divides(spec.kv_heads, "n_kv_heads", degree, "tp")
    elif degree > spec.n_layers:
        raise ValueError(
            f"pp={degree} stages but the model has {spec.n_layers} layers;"
            f" use pp <= {spec.n_layers}"
        )


def kv_heads_per_rank(spec: ModelSpec, *, tp: int = 1) -> int:
    """nkv/tp, or 1 when tp > nkv (each kv head replicated on tp/nkv ranks, as vLLM does)."""
    check(spec, mode="tp", degree=tp)
    return max(1, spec.kv_heads // tp)


def kv_cache_bytes_per_token(
    spec: ModelSpec, *, tp: int = 1, pp: int = 1, stage: int = 0, dtype_bytes: int = 2
) -> int:
    """Bytes one cached position of one sequence takes on one rank:
    2 · L_rank · nkv_rank · hd · e."""
    check(spec, mode="placement", degree=pp)
    check_positive(dtype_bytes=dtype_bytes)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is outside 0..{pp - 1}")
    return (
        2
        * layers_on_stage(spec.n_layers, pp, stage)
        * kv_heads_per_rank(spec, tp=tp)
        * spec.hd
        * dtype_bytes
    )


def kv_cache_bytes_per_rank(
    spec: ModelSpec,
    *,
    batch: int,
    seq: int,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    dtype_bytes: int = 2,
) -> int:
    """The KV cache of one rank: 2 · L_rank · B · T · nkv_rank · hd · e bytes (B sequences, T
    positions each)."""
    check_positive(batch=batch, seq=seq)
    return (
        batch
        * seq
        * kv_cache_bytes_per_token(spec, tp=tp, pp=pp, stage=stage, dtype_bytes=dtype_bytes)
    )


def _op(calls: int, payload: float, sent: float) -> dict:
    return {"calls": calls, "payload_bytes": calls * payload, "sent_bytes": calls * sent}


def forward_comm(
    spec: ModelSpec, *, mode: str, degree: int, batch: int, tokens: int = 1, dtype_bytes: int = 2
) -> list[dict]:
    """Per rank, {op: {"calls", "payload_bytes", "sent_bytes"}} of one forward of ``tokens`` new
    tokens per sequence (ops: all_reduce, all_gather, send, recv; a recv's payload is what arrives,
    it sends nothing)."""
    check(spec, mode=mode, degree=degree)
    check_positive(batch=batch, tokens=tokens, dtype_bytes=dtype_bytes)
    if degree == 1:
        return [{}]
    act = batch * tokens * spec.hidden * dtype_bytes
    ids = batch * 8
    if mode == "tp":
        pairs = degree * batch * 2 * 8
        row = {
            "all_reduce": _op(2 * spec.n_layers + 1, act, all_reduce_bytes(act, degree)),
            "all_gather": _op(1, pairs, all_gather_bytes(pairs, degree)),
        }
        return [row] * degree
    out = []
    for s in range(degree):
        sent = ids if s == degree - 1 else act  # the last stage sends the ids back to the first
        received = ids if s == 0 else act
        out.append({"send": _op(1, sent, sent), "recv": _op(1, received, 0)})
    return out


def messages_per_forward(spec: ModelSpec, *, mode: str, degree: int) -> int:
    """Collectives (TP: 2L+2) or point-to-point hops (placement: N) one forward waits for, one
    after another."""
    check(spec, mode=mode, degree=degree)
    if degree == 1:
        return 0
    return 2 * spec.n_layers + 2 if mode == "tp" else degree


def weight_bytes_per_rank(
    spec: ModelSpec, *, mode: str, degree: int, dtype_bytes: int = 2
) -> list[int]:
    """The weights each rank holds (Llama: untied head unless the spec ties it). TP: matrices / N,
    norms replicated, kv projections of nkv_rank heads; placement: the stage's layers, the first
    the embedding, the last the final norm and the head (``labs.theory.memory.stage_params``)."""
    check(spec, mode=mode, degree=degree)
    if mode == "tp":
        h = spec.hidden
        hd = spec.hd
        F = spec.ffn
        V = spec.vocab_size
        L = spec.n_layers
        head = 0 if spec.tied_embeddings else V * h
        kv = kv_heads_per_rank(spec, tp=degree)
        layer = 2 * h * spec.n_heads * hd // degree + 2 * h * kv * hd + 3 * h * F // degree + 2 * h
        return [(V * h // degree + L * layer + h + head // degree) * dtype_bytes] * degree
    return [stage_params(spec, pp=degree, stage=s) * dtype_bytes for s in range(degree)]


def per_token_latency(
    *, compute_s: list[float], mode: str, messages: int, message_s: float
) -> float:
    """The latency model both for GPUs and for the gloo measurements: ``compute_s`` per rank (TP:
    the ranks work at once, the slowest counts; placement: one after another, they add up) plus
    ``messages`` waits of ``message_s`` each."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    return (max(compute_s) if mode == "tp" else sum(compute_s)) + messages * message_s


def decode_time(
    spec: ModelSpec,
    *,
    mode: str,
    degree: int,
    batch: int,
    context: int,
    gpu: str = "H100 80GB",
    link_gbs: float = NVLINK_GBS,
    link_latency_us: float = NVLINK_LATENCY_US,
    dtype_bytes: int = 2,
) -> dict:
    """One decode step (one new token for each of ``batch`` sequences with ``context`` cached
    positions) on ``degree`` GPUs: per rank the bytes read (its weights and its cache) and FLOPs
    (2 per weight per sequence, attention 4·nh_rank·hd·context per layer), memory- or
    compute-bound; per message α + bytes / link (the activation B·H·e). Returns latency_s,
    tokens_per_s (one batch in flight) and pipelined_tokens_per_s (placement with ``degree``
    batches in flight, as vLLM's pipeline parallelism: the slowest stage sets it)."""
    if gpu not in HBM_TBS:
        raise ValueError(f"gpu={gpu!r} is not one of {tuple(HBM_TBS)}")
    check_positive(batch=batch, context=context)
    if link_gbs <= 0 or link_latency_us < 0:
        raise ValueError(
            f"link_gbs must be > 0 and link_latency_us >= 0, got {link_gbs}, {link_latency_us}"
        )
    weights = weight_bytes_per_rank(spec, mode=mode, degree=degree, dtype_bytes=dtype_bytes)
    stages = degree if mode == "placement" else 1
    heads = spec.n_heads // (degree if mode == "tp" else 1)
    peak_flops = GPUS[gpu].peak_tflops * 1e12
    hbm = HBM_TBS[gpu] * 1e12
    compute = []  # seconds per rank: memory- or compute-bound
    read = []  # bytes per rank
    for r in range(degree):
        s = r if mode == "placement" else 0
        kv = kv_cache_bytes_per_rank(
            spec,
            batch=batch,
            seq=context,
            tp=1 if stages > 1 else degree,
            pp=stages,
            stage=s,
            dtype_bytes=dtype_bytes,
        )
        layers = layers_on_stage(spec.n_layers, stages, s)
        weight_flops = 2 * weights[r] / dtype_bytes * batch
        attention_flops = 4 * layers * heads * spec.hd * context * batch
        flops = weight_flops + attention_flops
        read.append(weights[r] + kv)
        compute.append(max((weights[r] + kv) / hbm, flops / peak_flops))
    message_s = link_latency_us * 1e-6 + batch * spec.hidden * dtype_bytes / (link_gbs * 1e9)
    messages = messages_per_forward(spec, mode=mode, degree=degree)
    latency = per_token_latency(
        compute_s=compute, mode=mode, messages=messages, message_s=message_s
    )
    slowest = max(compute) + (message_s if degree > 1 else 0.0)
    return {
        "mode": mode,
        "degree": degree,
        "batch": batch,
        "context": context,
        "gpu": gpu,
        "bytes_read_per_rank": read,
        "compute_s_per_rank": compute,
        "messages": messages,
        "message_s": message_s,
        "latency_s": latency,
        "tokens_per_s": batch / latency,
        "pipelined_tokens_per_s": batch / slowest if mode == "placement" else batch / latency,
        "fits": max(read) <= GPUS[gpu].memory_gib * GIB,
    }


def cache_capacity(
    spec: ModelSpec,
    *,
    gpu: str = "H100 80GB",
    tp: int = 1,
    pp: int = 1,
    dtype_bytes: int = 2,
    utilization: float = 0.9,
) -> dict:
    """How many cached positions (summed over all sequences) fit beside the weights when a share
    ``utilization`` of each GPU may be used (vLLM's ``gpu_memory_utilization``):
    (utilization·memory − weights) / cache bytes per position, on the tightest rank. Negative free
    memory: the weights alone do not fit."""
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not one of {tuple(GPUS)}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if tp > 1 and pp > 1:
        raise ValueError("cache_capacity models tp or pp, not both; set one of them to 1")
    if pp > 1:
        mode = "placement"
        degree = pp
    else:
        mode = "tp"
        degree = tp
    weights = weight_bytes_per_rank(spec, mode=mode, degree=degree, dtype_bytes=dtype_bytes)
    per_token = [
        kv_cache_bytes_per_token(
            spec, tp=tp, pp=pp, stage=s if pp > 1 else 0, dtype_bytes=dtype_bytes
        )
        for s in range(degree)
    ]
    free = [utilization * GPUS[gpu].memory_gib * GIB - w for w in weights]
    tokens = min(int(f // p) if f > 0 else 0 for f, p in zip(free, per_token))
    return {
        "gpu": gpu,
        "tp": tp,
        "pp": pp,
        "weight_bytes_per_rank": weights,
        "free_bytes_per_rank": free,
        "kv_bytes_per_token_per_rank": per_token,
        "tokens": tokens,
    }


def preset_table(
    *, seq: int = 8192, gpu: str = "H100 80GB", tp: int = 8, dtype_bytes: int = 2
) -> str:
    """Per Llama preset: cache bytes per position, per sequence of ``seq`` positions, and the
    positions that fit beside the weights on ``tp`` GPUs (bf16 by default)."""
    lines = [
        f"{'preset':<13}{'KiB/position':>13}{f'MiB/seq of {seq}':>18}"
        f"{f'positions on {tp} x {gpu}':>30}"
    ]
    for name, spec in PRESETS.items():
        if spec.arch != "llama":
            continue
        per = kv_cache_bytes_per_token(spec, dtype_bytes=dtype_bytes)
        room = cache_capacity(spec, gpu=gpu, tp=tp, dtype_bytes=dtype_bytes)["tokens"]
        lines.append(f"{name:<13}{per / 1024:>13.1f}{per * seq / 2**20:>18.0f}{room:>30,}")
    return "\n".join(lines)


def serving_figures(
    name: str,
    *,
    degree: int = 8,
    batch: int = 1,
    seq: int = 4096,
    gpu: str = "H100 80GB",
    dtype_bytes: int = 2,
) -> dict:
    """The cache, its capacity and the decode time for preset ``name``, for TP and for placement
    on ``degree`` GPUs (``python -m labs.theory infer``)."""
    spec = preset(name)
    out = {
        "preset": name,
        "degree": degree,
        "batch": batch,
        "seq": seq,
        "gpu": gpu,
        "kv_bytes_per_token": kv_cache_bytes_per_token(spec, dtype_bytes=dtype_bytes),
    }
    for mode in MODES:
        tp = degree if mode == "tp" else 1
        pp = 1 if mode == "tp" else degree
        cache = [
            kv_cache_bytes_per_rank(
                spec,
                batch=batch,
                seq=seq,
                tp=tp,
                pp=pp,
                stage=s if pp > 1 else 0,
                dtype_bytes=dtype_bytes,
            )
            for s in range(degree)
        ]
        capacity = cache_capacity(spec, gpu=gpu, tp=tp, pp=pp, dtype_bytes=dtype_bytes)
        out[mode] = {
            "kv_cache_bytes_per_rank": cache,
            "capacity_tokens": capacity["tokens"],
            **decode_time(
                spec,
                mode=mode,
                degree=degree,
                batch=batch,
                context=seq,
                gpu=gpu,
                dtype_bytes=dtype_bytes,
            ),
        }
    return out


def format_result(r: dict) -> str:
    """``serving_figures``' result: one line for the cache, one per mode."""
    lines = [
        f"{r['preset']} on {r['degree']} x {r['gpu']}, B={r['batch']}, T={r['seq']}: "
        f"KV cache {r['kv_bytes_per_token'] / 1024:.0f} KiB per position on one GPU"
    ]
    for mode in MODES:
        m = r[mode]
        cache_gib = max(m["kv_cache_bytes_per_rank"]) / GIB
        lines.append(
            f"{mode:<10} cache/rank {cache_gib:7.2f} GiB, room for"
            f" {m['capacity_tokens']:>9,} positions; {m['latency_s'] * 1e3:7.2f} ms/token,"
            f" {m['tokens_per_s']:8.0f} tokens/s ({m['pipelined_tokens_per_s']:.0f} with"
            f" {r['degree']} batches in flight){'' if m['fits'] else ', DOES NOT FIT'}"
        )
    return "\n".join(lines)
