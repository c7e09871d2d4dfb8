"""Tensor and sequence parallelism on paper: what each rank holds, computes and sends.
Pure Python.

    # one block, op by op: shapes per rank, collectives
    block_flow(spec, tp=2, sp=True, batch=8, seq=32)
    # {"block"|"model": {phase: {op: calls/bytes}}}
    comm_summary(spec, tp=2, sp=True, batch=8, seq=32)
    # 1/tp of the matrices + the replicated norms
    param_bytes_per_rank(spec, tp=2)
    # exact for solutions/tensor_parallel.py
    saved_activation_bytes(spec, tp=2, sp=True, batch=8, seq=32)
    # why TP stays in a node
    layer_comm_vs_compute(PRESETS["llama3-70b"], tp=8, seq=4096, link_gbs=450)

Drives the sharding visualizer of notebook 04 (``labs.widgets.tensor_parallel``); the tests check
every count and byte against the communication ledger and the saved-tensor hooks.

Symbols: B batch, T sequence, H hidden, nh/nkv query/key-value heads, hd head dim, F MLP hidden,
V vocabulary, L layers, N = tp, e bytes per element of the model's dtype, K = B·T·H·e.
Ring volumes come from ``labs.theory.comm``: an all-reduce sends 2(N-1)/N·K per rank, an
all-gather or a reduce-scatter (N-1)/N·K, K being the full tensor.

Per block (Megatron-LM, Shoeybi et al. 2019, §3; sequence parallelism, Korthikanti et al. 2022,
§4.2.2):

    without SP  forward   all-reduce after o_proj and after down_proj (g):
                          2 x all-reduce(K)
                backward  all-reduce of the attention and MLP input gradients (f):
                          2 x all-reduce(K)
    with SP     forward   all-gather before attention and MLP, reduce-scatter after:
                          2 x AG(K) + 2 x RS(K)
                backward  the conjugates, 2 x RS(K) + 2 x AG(K), the same volume as two
                          all-reduces, plus 2 x all-reduce(H·e) of the norm weights' gradients
                          (each rank saw T/N tokens)

Outside the blocks: the vocab-parallel embedding's g (all-reduce, or with SP reduce-scatter /
all-gather), the head's f (all-reduce in backward, or with SP all-gather / reduce-scatter), the
final norm's weight (SP), and the vocab-parallel loss: an all-reduce (max) of B·T fp32 numbers and
one of 2·B·T (sum of exp, target logit).

Saved activations (``saved_activation_bytes``) list what the course's implementation keeps for
backward, tensor by tensor (a test matches them to the byte): with SP the norm region (residual
inputs, 1/rms, normalised x) holds T/N tokens, but each column-parallel group still saves its
*gathered* input [B, T, H]. Megatron-LM saves the T/N shard instead and all-gathers it again in
backward (one more all-gather per block entry); ``labs.theory.activations`` models that variant.
"""

from __future__ import annotations

from typing import NamedTuple

from labs.theory.comm import BYTES_PER_RANK, all_reduce_bytes
from labs.theory.dims import ParallelDims, check_divides, check_positive
from labs.theory.model import ModelSpec, param_counts
from labs.theory.presets import PRESETS


class OpPair(NamedTuple):
    """The collectives of a region boundary (None: nothing runs)."""

    forward: str | None
    backward: str | None


# f and g, and what replaces them with sequence parallelism (key: sp)
F_OP = {False: OpPair(None, "all_reduce"), True: OpPair("all_gather", "reduce_scatter")}
G_OP = {False: OpPair("all_reduce", None), True: OpPair("reduce_scatter", "all_gather")}
COURSE_MODEL = PRESETS["tiny"]  # labs.models.transformer.ModelConfig()'s dimensions
# Nominal one-direction bandwidth per GPU (GB/s): the two kinds of link a TP group can sit on.
LINKS = {"NVLink 4 (H100 SXM, in a node)": 450.0, "InfiniBand NDR 400 Gb/s (between nodes)": 50.0}


def check(
    spec: ModelSpec,
    *,
    tp: int,
    sp: bool = False,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> None:
    """ValueError unless the course's TP applies: a Llama-style spec, tp dividing heads, kv heads,
    hidden, F and vocabulary, and with SP the sequence."""
    if spec.arch != "llama":
        raise ValueError(
            f"spec.arch={spec.arch!r}: the tensor-parallel lab models the course's Llama; "
            "use arch='llama'"
        )
    check_positive(tp=tp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    ParallelDims(tp=tp).check_model(
        n_head=spec.n_heads,
        n_kv_head=spec.kv_heads,
        n_embd=spec.hidden,
        ffn_hidden=spec.ffn,
        vocab_size=spec.vocab_size,
    )
    if sp:
        check_divides(seq, "seq", tp, "tp")


def weight_shards(spec: ModelSpec, *, tp: int) -> list[dict]:
    """The weights of one block, of the embedding and of the head: full shape (as
    ``nn.Linear.weight``, [out, in]), how they split (``column``: dim 0, ``row``: dim 1, ``vocab``:
    dim 0, ``replicated``) and each rank's shape."""
    check(spec, tp=tp)
    h = spec.hidden
    q = spec.n_heads * spec.hd
    kv = spec.kv_heads * spec.hd
    F = spec.ffn
    V = spec.vocab_size
    rows = [
        ("tok_emb", (V, h), "vocab"),
        ("attn_norm", (h,), "replicated"),
        ("attn.q_proj", (q, h), "column"),
        ("attn.k_proj", (kv, h), "column"),
        ("attn.v_proj", (kv, h), "column"),
        ("attn.o_proj", (h, q), "row"),
        ("mlp_norm", (h,), "replicated"),
        ("mlp.gate_proj", (F, h), "column"),
        ("mlp.up_proj", (F, h), "column"),
        ("mlp.down_proj", (h, F), "row"),
        ("norm", (h,), "replicated"),
        ("lm_head", (V, h), "column"),
    ]
    out = []
    for name, shape, split in rows:
        dim = {"column": 0, "vocab": 0, "row": 1}.get(split)
        rank_shape = tuple(n // tp if i == dim else n for i, n in enumerate(shape))
        out.append(
            {
                "name": name,
                "shape": shape,
                "split": split,
                "dim": dim,
                "rank_shape": rank_shape,
                "in_block": name not in ("tok_emb", "norm", "lm_head"),
            }
        )
    return out


def _collective(name: str, ops: OpPair, k: int, tp: int, where: str) -> dict:
    return {
        "op": name,
        "kind": "collective",
        "where": where,
        "forward": ops.forward,
        "backward": ops.backward,
        "payload_bytes": k,
        "forward_sent_bytes": BYTES_PER_RANK[ops.forward](k, tp) if ops.forward else 0.0,
        "backward_sent_bytes": BYTES_PER_RANK[ops.backward](k, tp) if ops.backward else 0.0,
    }


def block_flow(
    spec: ModelSpec,
    *,
    tp: int,
    sp: bool = False,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> list[dict]:
    """One block's forward, op by op: each rank's output shape (``shape``) and whether ranks hold
    the same tensor (``layout``: "replicated", "split T", "split heads", "split F", "partial sums");
    the collectives (kind "collective") with their forward and backward ops, payload K and bytes
    sent per rank."""
    check(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    B = batch
    T = seq
    H = spec.hidden
    hd = spec.hd
    F = spec.ffn
    nh = spec.n_heads // tp
    nkv = spec.kv_heads // tp
    k = B * T * H * dtype_bytes
    if sp:
        x_shape = (B, T // tp, H)
        x_layout = "split T"
        f = "all-gather T"
        g = "reduce-scatter T"
    else:
        x_shape = (B, T, H)
        x_layout = "replicated"
        f = "f"
        g = "g"

    def compute(op: str, shape: tuple[int, ...], layout: str) -> dict:
        return {"op": op, "kind": "compute", "shape": shape, "layout": layout}

    norm_grad = []  # with SP, each rank's norm weight saw T/tp tokens: its gradient is summed
    if sp:
        norm_grad.append(
            {
                "op": "norm weight grad",
                "kind": "collective",
                "where": "norm",
                "forward": None,
                "backward": "all_reduce",
                "payload_bytes": H * dtype_bytes,
                "forward_sent_bytes": 0.0,
                "backward_sent_bytes": all_reduce_bytes(H * dtype_bytes, tp),
            }
        )
    flow = [
        compute("input x", x_shape, x_layout),
        compute("attn_norm", x_shape, x_layout),
        *norm_grad,
        _collective(f, F_OP[sp], k, tp, "attention input"),
        compute("attention input", (B, T, H), "replicated"),
        compute("q_proj", (B, T, nh * hd), "split heads"),
        compute("k_proj, v_proj", (B, T, nkv * hd), "split heads"),
        compute("attention (SDPA)", (B, T, nh * hd), "split heads"),
        compute("o_proj", (B, T, H), "partial sums"),
        _collective(g, G_OP[sp], k, tp, "attention output"),
        compute("x + attention", x_shape, x_layout),
        compute("mlp_norm", x_shape, x_layout),
        *norm_grad,
        _collective(f, F_OP[sp], k, tp, "MLP input"),
        compute("MLP input", (B, T, H), "replicated"),
        compute("gate_proj, up_proj", (B, T, F // tp), "split F"),
        compute("silu(gate) * up", (B, T, F // tp), "split F"),
        compute("down_proj", (B, T, H), "partial sums"),
        _collective(g, G_OP[sp], k, tp, "MLP output"),
        compute("x + MLP", x_shape, x_layout),
    ]
    return flow


def collectives(
    spec: ModelSpec,
    *,
    tp: int,
    sp: bool = False,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> list[dict]:
    """Every collective of one training step (forward and backward) of the whole model, one entry
    per call: ``where``, ``phase``, ``op`` ("all_reduce" | "all_gather" | "reduce_scatter"),
    ``payload_bytes`` (the full tensor K) and ``sent_bytes`` per rank."""
    check(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    k = batch * seq * spec.hidden * dtype_bytes
    n_tok = batch * seq
    calls = []

    def add(where: str, phase: str, op: str | None, payload: int) -> None:
        if op is not None:
            calls.append(
                {
                    "where": where,
                    "phase": phase,
                    "op": op,
                    "payload_bytes": payload,
                    "sent_bytes": BYTES_PER_RANK[op](payload, tp),
                }
            )

    def region(where: str, ops: OpPair) -> None:
        """The collective pair at a region boundary."""
        add(where, "forward", ops.forward, k)
        add(where, "backward", ops.backward, k)

    region("tok_emb", G_OP[sp])
    for i in range(spec.n_layers):
        for part in ("attn", "mlp"):
            region(f"layers.{i}.{part} input", F_OP[sp])
            region(f"layers.{i}.{part} output", G_OP[sp])
            if sp:
                add(
                    f"layers.{i}.{part}_norm weight",
                    "backward",
                    "all_reduce",
                    spec.hidden * dtype_bytes,
                )
    if sp:
        add("norm weight", "backward", "all_reduce", spec.hidden * dtype_bytes)
    region("lm_head input", F_OP[sp])
    add("loss: max logit", "forward", "all_reduce", 4 * n_tok)
    add("loss: sum of exp, target logit", "forward", "all_reduce", 2 * 4 * n_tok)
    return calls


def summarise(calls: list[dict]) -> dict:
    """{phase: {op: {"calls", "payload_bytes", "sent_bytes"}}} of a list of collectives."""
    out: dict = {}
    for c in calls:
        entry = out.setdefault(c["phase"], {}).setdefault(
            c["op"], {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0}
        )
        entry["calls"] += 1
        entry["payload_bytes"] += c["payload_bytes"]
        entry["sent_bytes"] += c["sent_bytes"]
    return out


def comm_summary(
    spec: ModelSpec,
    *,
    tp: int,
    sp: bool = False,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> dict:
    """Collectives of one step summarised for one block (``block``, the layer-0 calls) and for the
    model (``model``), plus ``sent_bytes_per_step``: what one rank sends in a forward and
    backward."""
    calls = collectives(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    block = [c for c in calls if c["where"].startswith("layers.0.")]
    return {
        "block": summarise(block),
        "model": summarise(calls),
        "sent_bytes_per_step": sum(c["sent_bytes"] for c in calls),
    }


def param_bytes_per_rank(spec: ModelSpec, *, tp: int, dtype_bytes: int = 4) -> dict:
    """Parameter bytes one TP rank holds: 1/tp of every matrix (attention, MLP, embedding, head; a
    tied head shares the embedding's shard) plus the replicated norm weights."""
    check(spec, tp=tp)
    c = param_counts(spec)
    sharded = c["embedding"] + c["head"] + spec.n_layers * (c["attention"] + c["mlp"])
    replicated = spec.n_layers * c["norms"] + c["final_norm"]
    return {
        "sharded_params": sharded,
        "replicated_params": replicated,
        "params": sharded // tp + replicated,
        "bytes": (sharded // tp + replicated) * dtype_bytes,
        "unsharded_bytes": c["total"] * dtype_bytes,
    }


def saved_activation_bytes(
    spec: ModelSpec,
    *,
    tp: int,
    sp: bool = False,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> dict:
    """Bytes one rank keeps for backward in one forward of ``solutions/tensor_parallel.py``, by
    tensor: ``per_block`` and ``outside`` (name -> bytes), ``block_total``, ``total``. RMSNorm
    computes in fp32 (input and 1/rms kept in fp32), the attention kernel keeps its log-sum-exp in
    fp32, the loss's softmax is fp32; token ids are int64 and the vocab masks bool."""
    check(spec, tp=tp, sp=sp, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
    e = dtype_bytes
    B = batch
    T = seq
    H = spec.hidden
    F = spec.ffn
    hd = spec.hd
    t_norm = T // tp if sp else T  # tokens in the norm region on one rank
    nh = spec.n_heads // tp
    nkv = spec.kv_heads // tp

    def norm(prefix: str) -> dict[str, int]:
        return {
            f"{prefix} input (fp32)": 4 * B * t_norm * H,
            f"{prefix} 1/rms": 4 * B * t_norm,
            f"{prefix} normalised": e * B * t_norm * H,
        }

    per_block = {
        **norm("attn_norm"),
        "attention input [B, T, H]": e * B * T * H,
        "q (rotated)": e * B * nh * T * hd,
        "k (rotated)": e * B * nkv * T * hd,
        "v": e * B * nkv * T * hd,
        "attention output": e * B * nh * T * hd,
        "log-sum-exp (fp32)": 4 * B * nh * T,
        **norm("mlp_norm"),
        "MLP input [B, T, H]": e * B * T * H,
        "gate, silu(gate), up, product": 4 * e * B * T * (F // tp),
    }
    outside = {
        "token ids (int64)": 8 * B * T,
        "embedding mask (bool)": B * T,
        "rotary cos, sin (fp32)": 2 * 4 * T * hd,
        **norm("final norm"),
        "lm_head input [B, T, H]": e * B * T * H,
        "softmax [B*T, V/tp] (fp32)": 4 * B * T * (spec.vocab_size // tp),
        "targets (int64)": 8 * B * T,
        "target mask (bool)": B * T,
    }
    block_total = sum(per_block.values())
    return {
        "per_block": per_block,
        "outside": outside,
        "block_total": block_total,
        "total": spec.n_layers * block_total + sum(outside.values()),
    }


def layer_comm_vs_compute(
    spec: ModelSpec,
    *,
    tp: int,
    seq: int,
    mbs: int = 1,
    dtype_bytes: int = 2,
    link_gbs: float,
    peak_tflops: float = 989.0,
    mfu: float = 0.5,
) -> dict:
    """One layer's forward + backward on one TP rank: bytes sent (4 all-reduces of
    K = mbs·seq·H·e, SP moves the same), seconds on a link of ``link_gbs`` GB/s, and compute
    seconds for its FLOPs (6·P_layer + 12·H·seq per token, split tp ways) at ``mfu`` of
    ``peak_tflops``. TP's collectives sit on the critical path between matmuls, so
    ``comm_s / compute_s`` is roughly the slowdown they add."""
    check_positive(tp=tp, seq=seq, mbs=mbs, dtype_bytes=dtype_bytes)
    if link_gbs <= 0 or peak_tflops <= 0 or not 0 < mfu <= 1:
        raise ValueError(
            "link_gbs and peak_tflops must be > 0 and mfu in (0, 1];"
            f" got {link_gbs}, {peak_tflops}, {mfu}"
        )
    k = mbs * seq * spec.hidden * dtype_bytes
    sent = 4 * all_reduce_bytes(k, tp)
    tokens = mbs * seq
    flops = (6 * param_counts(spec)["per_layer"] + 12 * spec.hidden * seq) * tokens / tp
    comm_s = sent / (link_gbs * 1e9)
    compute_s = flops / (peak_tflops * 1e12 * mfu)
    return {
        "tp": tp,
        "sent_bytes": sent,
        "comm_s": comm_s,
        "flops": flops,
        "compute_s": compute_s,
        "comm_over_compute": comm_s / compute_s,
    }
