"""Context parallelism on paper: who holds which tokens, which attention blocks each rank
computes at each ring step, the work per rank, and the bytes and memory ring attention costs.
Pure Python (no torch): the ring-attention stepper of notebook 06 draws from here, and the
tests check every figure against ``solutions/context_parallel.py`` running on gloo.

Symbols: CP ranks on the ring; the sequence of T tokens is cut into 2·CP chunks of
c = T/(2·CP) tokens, and every rank holds two of them:

    zig-zag      rank r holds chunks r and 2·CP−1−r   (one early, one late: Llama 3 §3.3.2)
    contiguous   rank r holds chunks 2r and 2r+1     (T/CP consecutive tokens)

Ring step s = 0..CP−1: rank r holds the K/V of rank (r − s) mod CP. A query chunk a
against a key chunk b, under a causal mask, is

    "full"      b < a   every query sees every key: compute the whole c×c block
    "diagonal"  b = a   lower triangle: compute the block, mask its upper half
    "masked"    b > a   no query sees any key: skip the block entirely

(without a causal mask every block is "full"). Work per rank = blocks computed (full +
diagonal), each 4·B·nh·c²·hd FLOPs forward (Q·Kᵀ and P·V) and 10·B·nh·c²·hd backward.

Bytes per rank per attention layer, KV = 2·B·T·nkv·hd·itemsize (all of K and V, the
unrepeated nkv heads under grouped-query attention):

    forward    (CP−1)/CP · KV     each rank's K/V block makes CP−1 hops
    backward 2 (CP−1)/CP · KV     K/V go round again, and their gradient accumulators follow

Saved for backward per layer per rank (no T×T matrix: it is recomputed, as FlashAttention
does): q, k, v, out and the fp32 log-sum-exp,

    (B·(T/CP)·hd·(2·nh + 2·nkv)) · itemsize  +  B·nh·(T/CP) · 4
"""

from __future__ import annotations

from collections.abc import Iterable

from labs.theory.dims import check_divides, check_positive

KINDS = ("full", "diagonal", "masked")
LAYOUTS = {True: "zig-zag", False: "contiguous"}


def check_cp(cp: int, seq_len: int | None = None) -> None:
    """``cp`` >= 1 and, when given, ``seq_len`` divisible by 2·cp (two chunks per rank)."""
    check_positive(cp=cp)
    if seq_len is not None:
        check_positive(seq_len=seq_len)
        check_divides(seq_len, "seq_len", 2 * cp, "2*cp")


def chunk_ids(rank: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The two global chunk indices (of 2·cp) that ``rank`` holds, in the order it stores them."""
    check_cp(cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is outside 0..{cp - 1}")
    return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)


def block_kind(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """ "full", "diagonal" or "masked": what a causal mask leaves of query chunk × key chunk."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "masked"


def ring_schedule(cp: int, *, causal: bool = True, zigzag: bool = True) -> list[list[dict]]:
    """``schedule[s][r]``: at ring step ``s``, what rank ``r`` holds and computes.

    Each entry: ``kv_from`` (the rank whose K/V it holds), ``q_chunks``, ``kv_chunks`` and
    ``blocks``, a list of ``(q_chunk, k_chunk, kind)`` for all four chunk pairs.
    """
    check_cp(cp)
    schedule = []
    for s in range(cp):
        step = []
        for r in range(cp):
            src = (r - s) % cp
            q_ids = chunk_ids(r, cp, zigzag)
            k_ids = chunk_ids(src, cp, zigzag)
            blocks = [(a, b, block_kind(a, b, causal)) for a in q_ids for b in k_ids]
            step.append(
                {"rank": r, "kv_from": src, "q_chunks": q_ids, "kv_chunks": k_ids, "blocks": blocks}
            )
        schedule.append(step)
    return schedule


def ring_backward_schedule(
    cp: int, *, causal: bool = True, zigzag: bool = True
) -> list[list[dict]]:
    """``schedule[s][r]``: at backward ring step ``s``, what rank ``r`` computes and sends.

    K/V go round the ring again, as in forward: at step s rank r holds the K/V of rank
    ``kv_from`` = (r − s) mod CP and, for the same chunk pairs (``blocks``, as ``ring_schedule``),
    computes three gradients. dQ of its own queries (``dq_chunks``) adds up locally: it never
    travels. dK, dV of the block it holds belong to that block's owner: they go into the block's
    gradient *accumulator*, which travels one hop behind the block. At step 0 a rank keeps its
    share of its own block's gradient at home; from step 1 on it adds its share to the
    accumulator that arrived from r − 1 (none at step 1: it starts one) and sends it on to r + 1
    (``sends_dkv_to``). ``acc_ranks`` lists whose shares that accumulator then carries; at the
    last step it goes to the block's owner (``dkv_home``: True), who adds it to what it kept: the
    shares of all CP ranks.

    Messages per rank: CP−1 K/V blocks (``sends_kv_to``, every step but the last) and CP−1
    accumulators of the same size: 2 (CP−1)/CP · KV bytes (``ring_bytes_per_rank``).
    """
    forward = ring_schedule(cp, causal=causal, zigzag=zigzag)
    schedule = []
    for s, step in enumerate(forward):
        rows = []
        for e in step:
            r = e["rank"]
            src = e["kv_from"]
            carried = [(src + 1 + i) % cp for i in range(s)]  # ranks src+1 .. r
            rows.append(
                {
                    **e,
                    "dq_chunks": e["q_chunks"],
                    "dkv_block": src,
                    "acc_ranks": [r] if s == 0 else carried,
                    "sends_kv_to": (r + 1) % cp if s < cp - 1 else None,
                    "sends_dkv_to": (r + 1) % cp if s > 0 else None,
                    "dkv_home": s == cp - 1 and cp > 1 and (r + 1) % cp == src,
                }
            )
        schedule.append(rows)
    return schedule


def work_per_rank(
    cp: int, *, causal: bool = True, zigzag: bool = True, upto_step: int | None = None
) -> list[dict]:
    """Per rank: counts of full, diagonal and masked blocks, and ``computed`` = full + diagonal,
    over the ring steps 0..``upto_step`` (all steps by default)."""
    schedule = ring_schedule(cp, causal=causal, zigzag=zigzag)
    last = cp - 1 if upto_step is None else upto_step
    if not 0 <= last < cp:
        raise ValueError(f"upto_step={upto_step} is outside 0..{cp - 1}")
    out = []
    for r in range(cp):
        counts = dict.fromkeys(KINDS, 0)
        for step in schedule[: last + 1]:
            for _, _, kind in step[r]["blocks"]:
                counts[kind] += 1
        counts["computed"] = counts["full"] + counts["diagonal"]
        out.append({"rank": r, **counts})
    return out


def imbalance(work: list[dict]) -> float:
    """max / mean of the blocks computed per rank: 1.0 is perfect balance, and the step
    takes as long as the busiest rank."""
    computed = [w["computed"] for w in work]
    return max(computed) * len(computed) / sum(computed)


def block_flops(
    *, batch: int, n_head: int, chunk: int, head_dim: int, backward: bool = False
) -> int:
    """FLOPs of one c×c attention block: Q·Kᵀ and P·V forward (2 matmuls); backward
    recomputes Q·Kᵀ and adds dV, dP, dQ, dK (5 matmuls). 2 FLOPs per multiply-add."""
    matmuls = 5 if backward else 2
    return matmuls * 2 * batch * n_head * chunk * chunk * head_dim


def kv_bytes(*, batch: int, seq_len: int, n_kv_head: int, head_dim: int, itemsize: int = 4) -> int:
    """KV: bytes of one layer's full K and V (all T tokens, unrepeated kv heads)."""
    check_positive(
        batch=batch, seq_len=seq_len, n_kv_head=n_kv_head, head_dim=head_dim, itemsize=itemsize
    )
    return 2 * batch * seq_len * n_kv_head * head_dim * itemsize


def ring_bytes_per_rank(*, cp: int, kv: float) -> dict[str, float]:
    """Bytes one rank sends per attention layer: forward (CP−1)/CP·KV, backward 2(CP−1)/CP·KV."""
    check_cp(cp)
    forward = (cp - 1) / cp * kv
    return {"forward": forward, "backward": 2 * forward, "total": 3 * forward}


def tokens_to_hide_comm(
    *,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    flops_per_s: float,
    bytes_per_s: float,
    itemsize: int = 2,
    causal: bool = True,
) -> float:
    """Local tokens s = T/CP above which one ring step's compute outlasts its K/V transfer, so the
    overlap hides the ring completely. Per step a rank computes s queries × s keys,
    4·s²·nh·hd FLOPs (half of it under a balanced causal mask) and sends 2·s·nkv·hd·itemsize
    bytes: compute grows as s², communication as s."""
    check_positive(n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, itemsize=itemsize)
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(
            f"flops_per_s and bytes_per_s must be > 0, got {flops_per_s}, {bytes_per_s}"
        )
    flops_per_token2 = 4 * n_head * head_dim * (0.5 if causal else 1.0)
    return 2 * n_kv_head * head_dim * itemsize * flops_per_s / (bytes_per_s * flops_per_token2)


def attention_saved_bytes(
    *,
    batch: int,
    seq_len: int,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    cp: int = 1,
    itemsize: int = 4,
    lse_itemsize: int = 4,
) -> float:
    """Bytes ring attention keeps for backward per layer per rank: q, k, v, out of the local
    T/CP tokens, plus the fp32 log-sum-exp of each local query. Falls as 1/CP."""
    check_cp(cp)
    local = seq_len / cp
    return (
        batch * local * head_dim * (2 * n_head + 2 * n_kv_head) * itemsize
        + batch * n_head * local * lse_itemsize
    )


def activation_bytes(
    *,
    seq_len: int,
    batch: int,
    hidden: int,
    n_head: int,
    n_layer: int,
    cp: int = 1,
    flash: bool = True,
) -> float:
    """The Ultra-Scale Playbook's activation memory per rank, half precision, no recomputation:
    L·s·b·h·(34 + 5·a·s/h) bytes for s = T/CP local tokens. The 5·a·s/h term is the T×T
    attention matrix (scores, softmax, dropout mask); a fused kernel (``flash=True``) never
    stores it. In ring attention each rank's local s×T scores are not kept either. The
    playbook's estimate for GPT-style layers: the course's own figure is
    ``long_context_table``'s (the memory calculator)."""
    check_positive(seq_len=seq_len, batch=batch, hidden=hidden, n_head=n_head, n_layer=n_layer)
    check_cp(cp)
    s = seq_len / cp
    per_token = 34 + (0 if flash else 5 * n_head * seq_len / hidden)
    return n_layer * s * batch * hidden * per_token


SEQ_LENS = (4096, 16384, 32768, 65536, 131072)


def long_context_table(
    *,
    seq_lens: Iterable[int] = SEQ_LENS,
    batch: int = 1,
    preset: str = "llama3-8b",
    cps: Iterable[int] = (1, 2, 4, 8, 16),
    flash: bool = True,
) -> list[dict]:
    """Activation GiB per rank for each sequence length and CP degree, bf16, no recomputation.

    ``flash=True`` (the course's figure): the memory calculator's activations for the whole
    model (``labs.theory.memory.memory_per_rank``: every layer, the embedding, the final norm
    and the fp32 loss), the model of notebook 01 that equals the course model's saved tensors to
    the byte. ``flash=False``: the Ultra-Scale Playbook's formula with eager attention (its
    5·a·s/h term, the T x T scores), for the same layers, labelled as such by
    ``format_long_context``."""
    from labs.theory.memory import GIB, memory_per_rank
    from labs.theory.presets import preset as get_preset

    spec = get_preset(preset)
    rows = []
    for t in seq_lens:
        row = {"seq_len": t}
        for cp in cps:
            if flash:
                nbytes = memory_per_rank(spec, seq=t, mbs=batch, cp=cp)["activation_bytes"]
            else:
                nbytes = activation_bytes(
                    seq_len=t,
                    batch=batch,
                    hidden=spec.hidden,
                    n_head=spec.n_heads,
                    n_layer=spec.n_layers,
                    cp=cp,
                    flash=False,
                )
            row[f"cp={cp}"] = nbytes / GIB
        rows.append(row)
    return rows


def format_long_context(rows: list[dict], *, flash: bool = True) -> str:
    """``long_context_table``'s rows as a table in GiB per rank, headed by where the numbers come
    from."""
    source = (
        "the memory calculator (flash attention, whole model)"
        if flash
        else "the playbook's formula L·s·b·h·(34 + 5as/h), eager attention"
    )
    keys = [k for k in rows[0] if k.startswith("cp=")]
    lines = [
        f"activations per rank, GiB: {source}",
        f"{'seq_len':>8}" + "".join(f"{k:>10}" for k in keys),
    ]
    for r in rows:
        lines.append(f"{r['seq_len']:>8}" + "".join(f"{r[k]:>10.3g}" for k in keys))
    return "\n".join(lines)


def work_summary(cp: int, *, causal: bool = True, zigzag: bool = True) -> dict:
    """Blocks computed and masked per rank, and the imbalance (``python -m labs.theory cp``)."""
    work = work_per_rank(cp, causal=causal, zigzag=zigzag)
    return {
        "cp": cp,
        "causal": causal,
        "layout": LAYOUTS[zigzag],
        "blocks_computed_per_rank": [w["computed"] for w in work],
        "blocks_masked_per_rank": [w["masked"] for w in work],
        "imbalance": imbalance(work),
    }
