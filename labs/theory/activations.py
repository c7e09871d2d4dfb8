"""Activation memory: the bytes autograd keeps for backward, per rank and per micro-batch.
Pure Python.

Two models of the same thing (notebook 01 compares them):

``arch="llama"``: exact for the course model (RMSNorm computed in fp32, rotary positions, GQA
attention through SDPA's flash kernel, SwiGLU MLP). Every tensor autograd saves is listed
below, per token of one layer, with e = bytes of the compute dtype (4 fp32, 2 bf16) and
h = hidden, nh/nkv = query/key-value heads, hd = head dim, F = MLP hidden. A test counts the
saved tensors of the real model with saved-tensor hooks and finds these numbers to the byte.

    each RMSNorm (x2)  input cast to fp32 4h, 1/rms 4, normalized x e·h,
                       output e·h (the next matmul's input)
    attention          rotated q e·nh·hd, rotated k e·nkv·hd, v e·nkv·hd, output e·nh·hd,
                       log-sum-exp 4·nh (the flash kernel keeps it instead of the T x T scores)
    SwiGLU MLP         gate, silu(gate), up, silu(gate)·up: 4·e·F

There is no s² term: the flash kernel recomputes the attention probabilities in backward.
Outside the layers: token ids 8 (first stage), the rotary tables 2·hd·e per position, the
final norm, and the loss's fp32 log-softmax 4·V plus targets 8 per token (last stage).

``arch="gpt"``: the Ultra-Scale Playbook's approximation (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4, eq. 1-5) for eager attention with
dropout, 16-bit activations and 1-byte dropout masks, per layer

    s·b·h·(34 + 5·a·s/h)              no parallelism
    s·b·h·(10 + 24/t + 5·a·s/(h·t))   tensor parallel t (eq. 2)
    s·b·h·(34 + 5·a·s/h) / t          tensor + sequence parallel (eq. 5): the attention scores
                                      are split too, which the playbook's widget misses

The playbook's formula is not a model of a Llama with flash attention: for Llama-3 8B at 4,096
tokens it gives about four times the course model's bytes per layer, because its 5·a·s/h
term (the stored T x T scores) is 160 h there and the flash kernel keeps none of it
(``labs.theory.memory_report.playbook_comparison`` prints the ratio for every preset).

Recomputation (``recompute``):
    none       everything above
    selective  gpt: Korthikanti's selective recomputation, drop the attention-core term 5·a·s/h.
               llama: flash attention already recomputes the attention core, so we go one
               step further, as torchtitan's op-level selective AC does: keep the outputs of every
               matmul and of the attention kernel, recompute norms, rotary and SwiGLU's pointwise
               ops (``torch.utils.checkpoint.create_selective_checkpoint_contexts``). The outputs
               of the row-parallel o_proj and down_proj are kept after the reduction that follows
               them (torchtitan's policy saves the reduce-scatter's output, not the partial sum):
               sequence-sharded under SP, whole without it.
    full       checkpoint each block: keep only its input, e·h per token (recomputing the block in
               backward needs one block's activations for a moment; that transient is not counted).
               Under sequence parallelism that input is sequence-sharded, e·h/t per token, as
               Megatron-LM keeps it ([s/t, b, h], the layer's input in the sequence-parallel
               region); Korthikanti et al. 2022, Table 2 lists full recomputation as 2sbh, the
               input without SP, which is what we count with TP alone.

The order full <= selective <= none holds for every layout (a property test checks it over the
presets and every parallel degree and schedule).

FP8 training (``fp8=True``; DeepSeek-V3 §3.3, NVIDIA Transformer Engine): the linear layers
multiply in FP8 and keep their inputs for the weight gradient in FP8, 1 byte instead of e: the
norm outputs that feed q/k/v and gate/up, and SwiGLU's output that feeds down_proj (terms marked
``fp8``). A tensor that another op also keeps (the attention output, kept by the flash kernel)
stays in e bytes, and so do the embedding, the head and the loss.

Mixture of experts (``spec.n_experts > 1``, top-k routing): each token runs through k experts,
so the MLP's per-token terms count k times, plus the router's fp32 probabilities 4·E, the k
dispatched copies of the token (the experts' inputs) and the k expert outputs the weighted
combine keeps: a model of a dropless MoE block, not measured (the dense terms are).

Parallelism: tensor parallelism (t) splits terms tagged "tp" (heads, F, vocab); "sp" terms (the
norm region, block inputs, the reduced outputs of the row-parallel matmuls) are replicated
across TP ranks unless sequence parallelism splits them too (as Megatron does, the
column-parallel input is saved sequence-sharded and re-gathered in backward); "rep" terms are
never split by TP (token ids, rotary tables, targets). Context parallelism (c) gives each rank
s/c tokens of every per-token term.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from labs.theory.model import ModelSpec

RECOMPUTE = ("none", "selective", "full")


class Term(NamedTuple):
    """One tensor autograd saves."""

    name: str
    bytes: float  # per ``per``
    split: str  # "tp", "sp" or "rep": which degrees divide it (see the module docstring)
    per: str = "token"  # per token, per sequence position ("position") or per micro-batch ("step")
    fp8: bool = False  # a linear layer's own saved input: 1 byte per value under FP8 training


def _norm(prefix: str, h: int, e: int) -> list[Term]:
    """RMSNorm in fp32 (as Llama does): saves the fp32 input, 1/rms, the normalized x and the
    output."""
    return [
        Term(f"{prefix}.input_fp32", 4 * h, "sp"),
        Term(f"{prefix}.rsqrt", 4, "sp"),
        Term(f"{prefix}.normalized", e * h, "sp"),
        Term(f"{prefix}.output", e * h, "sp", fp8=True),
    ]


def layer_terms(
    spec: ModelSpec,
    *,
    seq: int,
    dtype_bytes: int,
    recompute: str = "none",
    fp8: bool = False,
) -> list[Term]:
    """What one layer saves for backward, per token (see the module docstring). With ``fp8``
    the terms marked fp8 take 1 byte per value instead of ``dtype_bytes``."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    terms = _layer_terms(spec, seq=seq, e=dtype_bytes, recompute=recompute)
    if not fp8:
        return terms
    return [t._replace(bytes=t.bytes / dtype_bytes) if t.fp8 else t for t in terms]


def _layer_terms(spec: ModelSpec, *, seq: int, e: int, recompute: str) -> list[Term]:
    h = spec.hidden
    nh = spec.n_heads
    F = spec.ffn
    if recompute == "full":  # torch.utils.checkpoint keeps the block's input
        return [Term("block_input", e * h, "sp")]
    if spec.arch == "gpt":  # the playbook's formula, term by term (Korthikanti et al. 2022, §4.1)
        terms = [
            Term("layernorm_inputs", 2 * e * h, "sp"),
            Term("attn_input", e * h, "sp", fp8=True),
            Term("attn_dropout_mask", h, "sp"),
            Term("mlp_input", e * h, "sp", fp8=True),
            Term("mlp_dropout_mask", h, "sp"),
            Term("q_k", 2 * e * h, "tp"),
            Term("v", e * h, "tp"),
            Term("attn_proj_input", e * h, "tp", fp8=True),
            Term("gelu_input", e * F, "tp"),
            Term("gelu_output", e * F, "tp", fp8=True),
        ]
        if recompute == "none":
            # softmax output, its dropout mask, dropout output: a·s values per token
            terms.append(Term("attn_scores", (2 * e + 1) * nh * seq, "tp"))
        return terms
    # query width, key/value width
    q = nh * spec.hd
    kv = spec.kv_heads * spec.hd
    k = spec.top_k if spec.n_experts > 1 else 1  # experts each token runs through
    if recompute == "selective":
        # outputs of every matmul and of the attention kernel, plus the block input; the
        # row-parallel outputs after their reduction (sequence-sharded under SP)
        attention = [
            Term("block_input", e * h, "sp"),
            Term("q_proj_out", e * q, "tp"),
            Term("k_proj_out", e * kv, "tp"),
            Term("v_proj_out", e * kv, "tp"),
            Term("attn_out", e * q, "tp"),
            Term("attn_logsumexp", 4 * nh, "tp"),
            Term("o_proj_out", e * h, "sp"),
        ]
        mlp = [
            Term("gate_proj_out", k * e * F, "tp"),
            Term("up_proj_out", k * e * F, "tp"),
            Term("down_proj_out", k * e * h, "sp"),
        ]
        return attention + _router_terms(spec, e, k, outputs=False) + mlp
    attention = [
        *_norm("attn_norm", h, e),
        Term("q_rotated", e * q, "tp"),
        Term("k_rotated", e * kv, "tp"),
        Term("v", e * kv, "tp"),
        Term("attn_out", e * q, "tp"),
        Term("attn_logsumexp", 4 * nh, "tp"),
    ]
    mlp = [
        Term("gate", k * e * F, "tp"),
        Term("silu_gate", k * e * F, "tp"),
        Term("up", k * e * F, "tp"),
        Term("swiglu_out", k * e * F, "tp", fp8=True),
    ]
    return attention + _norm("mlp_norm", h, e) + _router_terms(spec, e, k, outputs=True) + mlp


def _router_terms(spec: ModelSpec, e: int, k: int, *, outputs: bool) -> list[Term]:
    """A mixture-of-experts block's own tensors (none for a dense MLP): the router's fp32
    probabilities, the k dispatched copies of each token and (without recomputation) the k
    expert outputs the weighted combine keeps."""
    if spec.n_experts == 1:
        return []
    h = spec.hidden
    terms = [
        Term("router_probs_fp32", 4 * spec.n_experts, "sp"),
        Term("expert_inputs", k * e * h, "sp", fp8=True),
    ]
    if outputs:
        terms.append(Term("expert_outputs", k * e * h, "sp"))
    return terms


def model_terms(spec: ModelSpec, *, dtype_bytes: int) -> dict[str, list[Term]]:
    """What the model saves outside its layers, by part. The playbook's formula (gpt) counts layers
    only."""
    if spec.arch == "gpt":
        return {"embedding": [], "rotary": [], "final_norm": [], "loss": []}
    e = dtype_bytes
    return {
        "embedding": [Term("token_ids", 8, "rep")],  # int64 ids for the embedding's backward
        # [T, hd] cos and sin tables
        "rotary": [Term("rotary_cos_sin", 2 * spec.hd * e, "rep", "position")],
        # the head that reads the final norm's output stays in e bytes under FP8
        "final_norm": [t._replace(fp8=False) for t in _norm("final_norm", spec.hidden, e)],
        "loss": [
            Term("log_softmax_fp32", 4 * spec.vocab_size, "tp"),  # cross-entropy on fp32 logits
            Term("targets", 8, "rep"),
            Term("loss_weight", 4, "rep", "step"),
        ],
    }


def terms_bytes(
    terms: list[Term], *, seq: int, mbs: int, tp: int = 1, sp: bool = False, cp: int = 1
) -> float:
    """Bytes of ``terms`` for one micro-batch on one rank: per-token terms times mbs·seq/cp tokens,
    divided by tp where the term's split applies."""
    total = 0.0
    for t in terms:
        count = {"token": mbs * seq / cp, "position": seq / cp, "step": 1}[t.per]
        divide = tp if t.split == "tp" or (t.split == "sp" and sp) else 1
        total += t.bytes * count / divide
    return total


def stage_activation_bytes(
    spec: ModelSpec,
    *,
    seq: int,
    mbs: int,
    dtype_bytes: int,
    layers: float,
    first: bool = True,
    last: bool = True,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    recompute: str = "none",
    fp8: bool = False,
) -> dict[str, float]:
    """Activation bytes one rank holds for ONE micro-batch of a pipeline stage with ``layers``
    layers (the first stage has the embedding, the last the final norm and the loss). Returns the
    parts (``per_layer``, ``layers``, ``embedding``, ``rotary``, ``final_norm``, ``loss``) and
    ``total``. ``layers`` may be a fraction: an interleaved chunk's share of a stage."""
    sums = _part_sums(spec, seq, dtype_bytes, recompute, fp8, tp, sp)
    tokens = mbs * seq / cp
    positions = seq / cp

    def size(part: str) -> float:
        per_token, per_position, per_step = sums[part]
        return per_token * tokens + per_position * positions + per_step

    per_layer = size("layer")
    out = {
        "per_layer": per_layer,
        "layers": layers * per_layer,
        "embedding": size("embedding") if first else 0.0,
        "rotary": size("rotary") if layers else 0.0,
        "final_norm": size("final_norm") if last else 0.0,
        "loss": size("loss") if last else 0.0,
    }
    out["total"] = sum(v for k, v in out.items() if k != "per_layer")
    return out


@lru_cache(maxsize=4096)
def _part_sums(
    spec: ModelSpec, seq: int, dtype_bytes: int, recompute: str, fp8: bool, tp: int, sp: bool
) -> dict[str, tuple[float, float, float]]:
    """Per part (a layer, then the model's parts), the bytes per token, per position and per
    micro-batch on one TP rank: ``terms_bytes`` factored so the planner can reuse it."""
    parts = {
        "layer": layer_terms(spec, seq=seq, dtype_bytes=dtype_bytes, recompute=recompute, fp8=fp8),
        **model_terms(spec, dtype_bytes=dtype_bytes),
    }
    out = {}
    for name, terms in parts.items():
        sums = {"token": 0.0, "position": 0.0, "step": 0.0}
        for t in terms:
            divide = tp if t.split == "tp" or (t.split == "sp" and sp) else 1
            sums[t.per] += t.bytes / divide
        out[name] = (sums["token"], sums["position"], sums["step"])
    return out


def playbook_layer_bytes(
    *, seq: int, mbs: int, hidden: int, heads: int, tp: int = 1, sp: bool = False
) -> float:
    """The playbook's closed form for one layer in 16-bit: s·b·h·(34 + 5·a·s/h), split as in
    Korthikanti et al. eq. 2 (TP) and eq. 5 (TP + SP). Used to check the term table above."""
    sbh = seq * mbs * hidden
    if sp:
        return sbh * (34 + 5 * heads * seq / hidden) / tp
    return sbh * (10 + 24 / tp + 5 * heads * seq / (hidden * tp))
