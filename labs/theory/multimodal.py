"""An encoder in front of the decoder: its parameters, activations, FLOPs, and what it does to
a pipeline. Pure Python.

    enc = ENCODERS["siglip-so400m"]        # or EncoderSpec(tokens=..., hidden=..., ...)
    memory_per_rank_with_encoder(
        preset("llama3-8b"), enc, text_tokens=1024, mbs=1, pp=4, zero=1, dp=8
    )
    # per-stage time, bubble
    pipeline_balance(spec, enc, split=(0, 2, 1, 1), text_tokens=24, mbs=2, microbatches=4)
    # the fix
    balanced_split(spec, enc, stages=4, text_tokens=24, mbs=2)
    plan_with_encoder(
        preset("llama3-8b"), enc, text_tokens=1024, gpus=64, gpus_per_node=8, gpu_mem_gib=80
    )

Symbols: encoder ``tokens`` P (image patches, or audio frames), width E, ``n_layers`` L_e,
heads, MLP width F_e, ``patch_dim`` D = channels·patch² (the features of one patch); the decoder
(``labs.theory.memory.ModelSpec``) has width H and reads T = P + C tokens per sample: the P
projected image tokens, then C text tokens.

Parameters (SigLIP's vision tower, ``labs.models.vision``; biases everywhere, LayerNorm weight
and bias):

    patch embedding   D·E + E
    positions         P·E
    per layer         4(E² + E) + 2·E·F_e + F_e + E + 4E
    final norm        2E
    projector         E·H + H + H² + H   (LLaVA-1.5's MLP)

Activations saved for backward, per sample (exact for the model in fp32: a test counts them with
saved-tensor hooks; e = bytes per element, norm statistics and the attention's log-sum-exp in
fp32):

    images                 P·D·e   (the patch convolution keeps its input)
    per layer, per token   e·(8E + 2F_e) + 16 + 4·nh: norm inputs and outputs 4E, q, k, v 3E,
                           attention output E, MLP hidden twice 2F_e, mean and 1/std of both
                           norms 16, log-sum-exp 4 per head
    final norm, per token  e·2E + 8
    projector, per token   e·2H

The decoder's are ``labs.theory.activations`` at sequence length T.

FLOPs per sample, forward (a matmul of [m, k] x [k, n] costs 2mkn): patches 2·P·D·E; per layer
2·P·(4E² + 2E·F_e) + 4·P²·E (full attention: every patch sees every patch); projector
2·P·(E·H + H²). Backward is twice the forward except the patch convolution's (images need no
gradient: 2·P·D·E once). The decoder's layers: 2·(its matmul weights)·T + 4·T²·H per layer
forward (``labs.theory.flops``), the head 2·V·H·T.

In a pipeline the encoder sits on stage 0 (with the *fusion*, the caption's embedding and the
concatenation, and ``split[0]`` decoder layers); stage s holds ``split[s]`` decoder layers, the
last also norm and head. The schedule (1F1B) advances at the pace of the slowest stage:
``simulate_stages`` runs it on paper with each stage's own forward and backward time, and the
idle share of ranks x time is the bubble. With equal stages it is (P-1)/(M+P-1); an imbalance
adds idle time on every faster stage in every steady-state step. ``balanced_split`` moves decoder
layers onto (or off) the encoder's stage to minimise the slowest stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from labs.theory import tensor_parallel
from labs.theory.activations import stage_activation_bytes
from labs.theory.comm import BYTES_PER_RANK, all_reduce_bytes
from labs.theory.dims import check_positive
from labs.theory.flops import matmul_params
from labs.theory.memory import (
    PRECISIONS,
    ModelSpec,
    layers_on_stage,
    layers_params,
    memory_per_rank,
    state_bytes,
)
from labs.theory.pipeline import in_flight_microbatches, simulate


@dataclass(frozen=True)
class EncoderSpec:
    """A ViT-style encoder (SigLIP's layout) and its projector into the decoder's width."""

    tokens: int = 16  # P: patches per image (or frames per clip), one prefix token each
    hidden: int = 64  # E
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128  # F_e
    patch_dim: int = 48  # D: channels x patch x patch

    def __post_init__(self):
        for name in ("tokens", "hidden", "n_layers", "n_heads", "ffn_hidden", "patch_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"encoder {name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"encoder hidden={self.hidden} is not divisible by n_heads={self.n_heads}"
            )


ENCODERS = {
    # labs.models.vision's default
    "course": EncoderSpec(),
    # 384 px, patch 14 (PaliGemma, Idefics)
    "siglip-so400m": EncoderSpec(
        tokens=729, hidden=1152, n_layers=27, n_heads=16, ffn_hidden=4304, patch_dim=3 * 14 * 14
    ),
    # LLaVA-1.5's (its CLS token left out)
    "clip-vit-l-336": EncoderSpec(
        tokens=576, hidden=1024, n_layers=24, n_heads=16, ffn_hidden=4096, patch_dim=3 * 14 * 14
    ),
}


def encoder_spec(name_or_spec: str | EncoderSpec) -> EncoderSpec:
    """``name_or_spec`` itself, or the ``ENCODERS`` entry it names."""
    if isinstance(name_or_spec, EncoderSpec):
        return name_or_spec
    if name_or_spec not in ENCODERS:
        raise ValueError(f"encoder={name_or_spec!r} is not one of {tuple(ENCODERS)}")
    return ENCODERS[name_or_spec]


# --- parameters, activations, FLOPs ------------------------------------------------------------


def encoder_param_counts(enc: EncoderSpec, *, text_hidden: int) -> dict[str, int]:
    """Exact parameter counts: ``patch_embedding``, ``position_embedding``, ``per_layer``,
    ``layers``, ``post_layernorm``, ``encoder`` (their sum), ``projector`` and ``total``."""
    E = enc.hidden
    F = enc.ffn_hidden
    H = text_hidden
    per_layer = 4 * (E * E + E) + (E * F + F) + (F * E + E) + 2 * 2 * E
    out = {
        "patch_embedding": enc.patch_dim * E + E,
        "position_embedding": enc.tokens * E,
        "per_layer": per_layer,
        "layers": enc.n_layers * per_layer,
        "post_layernorm": 2 * E,
    }
    parts = ("patch_embedding", "position_embedding", "layers", "post_layernorm")
    out["encoder"] = sum(out[k] for k in parts)
    out["projector"] = E * H + H + H * H + H
    out["total"] = out["encoder"] + out["projector"]
    return out


def encoder_activation_bytes(
    enc: EncoderSpec, *, mbs: int, text_hidden: int, dtype_bytes: int = 4
) -> dict:
    """Bytes the encoder and projector save for backward for one micro-batch of ``mbs`` samples
    (module docstring)."""
    check_positive(mbs=mbs, text_hidden=text_hidden)
    e = dtype_bytes
    E = enc.hidden
    P = mbs * enc.tokens
    per_layer = P * (e * (8 * E + 2 * enc.ffn_hidden) + 16 + 4 * enc.n_heads)
    out = {
        "images": P * enc.patch_dim * e,
        "per_layer": per_layer,
        "layers": enc.n_layers * per_layer,
        "post_layernorm": P * (2 * e * E + 8),
        "projector": P * 2 * e * text_hidden,
    }
    out["total"] = out["images"] + out["layers"] + out["post_layernorm"] + out["projector"]
    return out


def encoder_flops(enc: EncoderSpec, *, mbs: int, text_hidden: int) -> dict:
    """FLOPs of one micro-batch through encoder and projector: ``forward``, ``backward``, and the
    attention's share of the forward (``attention_forward``, the P x P products)."""
    check_positive(mbs=mbs, text_hidden=text_hidden)
    E = enc.hidden
    F = enc.ffn_hidden
    P = enc.tokens
    H = text_hidden
    patch = 2 * P * enc.patch_dim * E
    attention = enc.n_layers * 4 * P * P * E
    matmuls = enc.n_layers * 2 * P * (4 * E * E + 2 * E * F)
    projector = 2 * P * (E * H + H * H)
    forward = patch + matmuls + attention + projector
    return {
        "forward": mbs * forward,
        "backward": mbs * (2 * forward - patch),
        "attention_forward": mbs * attention,
    }


def decoder_flops(spec: ModelSpec, *, seq: int, mbs: int) -> dict:
    """Forward FLOPs of one micro-batch (``mbs`` sequences of ``seq`` tokens): ``per_layer``
    (matmuls and attention) and ``head``. Backward is twice each (the embedding is a lookup)."""
    check_positive(seq=seq, mbs=mbs)
    head = spec.vocab_size * spec.hidden
    layer_weights = (matmul_params(spec) - head) // spec.n_layers
    per_layer = mbs * seq * (2 * layer_weights + 4 * spec.n_heads * spec.hd * seq)
    return {"per_layer": per_layer, "head": mbs * seq * 2 * head}


# --- a pipeline with the encoder on stage 0 ----------------------------------------------------


def _layer_counts(split: tuple) -> bool:
    """Whether every entry of ``split`` is an integer >= 0 (a bool is not)."""
    return all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in split)


def check_split(
    split: Iterable[int], *, n_layers: int, stages: int | None = None
) -> tuple[int, ...]:
    """``split`` (decoder layers per pipeline stage, the encoder's stage 0 included) as a tuple;
    ValueError unless it has >= 2 entries (``stages`` of them, if given), each an integer >= 0,
    summing to ``n_layers``."""
    split = tuple(split)
    stages = stages if stages is not None else len(split)
    if stages < 2 or len(split) != stages or sum(split) != n_layers or not _layer_counts(split):
        stages = max(stages, 2)
        raise ValueError(
            f"split={split} must give {stages} stages >= 0 decoder layers each (stage 0 also"
            f" holds the encoder), {n_layers} layers in all,"
            f" e.g. {default_split(n_layers, stages)}"
        )
    return split


def default_split(n_layers: int, stages: int) -> tuple[int, ...]:
    """The encoder alone on stage 0, the decoder's layers spread over the others (the earlier ones
    one more)."""
    check_positive(n_layers=n_layers, stages=stages)
    rest = max(stages - 1, 1)
    return (0,) + tuple(n_layers // rest + (1 if s < n_layers % rest else 0) for s in range(rest))


def stage_costs(
    spec: ModelSpec,
    enc: EncoderSpec,
    *,
    split: Iterable[int],
    text_tokens: int,
    mbs: int,
    tp: int = 1,
    dtype_bytes: int = 4,
) -> list[dict]:
    """Per stage of ``split`` (decoder layers per stage; the encoder on stage 0): ``layers``,
    ``encoder``, ``params`` (one TP rank; the encoder is replicated, not split), ``forward_flops``
    and ``backward_flops`` of one micro-batch (the encoder's work is not split by TP either),
    ``activation_bytes`` per micro-batch."""
    split = check_split(split, n_layers=spec.n_layers)
    seq = enc.tokens + text_tokens
    dec = decoder_flops(spec, seq=seq, mbs=mbs)
    ef = encoder_flops(enc, mbs=mbs, text_hidden=spec.hidden)
    ep = encoder_param_counts(enc, text_hidden=spec.hidden)
    ea = encoder_activation_bytes(enc, mbs=mbs, text_hidden=spec.hidden, dtype_bytes=dtype_bytes)
    out = []
    for s, layers in enumerate(split):
        first = s == 0
        last = s == len(split) - 1
        fwd = layers * dec["per_layer"] / tp + (dec["head"] / tp if last else 0)
        bwd = 2 * fwd
        params = layers_params(spec, layers=layers, first=first, last=last, pp=len(split), tp=tp)
        acts = stage_activation_bytes(
            spec,
            seq=seq,
            mbs=mbs,
            dtype_bytes=dtype_bytes,
            layers=layers,
            first=first,
            last=last,
            tp=tp,
        )["total"]
        if first:
            fwd += ef["forward"]
            bwd += ef["backward"]
            params += ep["total"]
            acts += ea["total"]
        out.append(
            {
                "stage": s,
                "layers": layers,
                "encoder": first,
                "params": params,
                "forward_flops": fwd,
                "backward_flops": bwd,
                "activation_bytes": acts,
            }
        )
    return out


def simulate_stages(
    t_forward: Sequence[float],
    t_backward: Sequence[float],
    microbatches: int,
    t_delay: float = 0.0,
) -> dict:
    """1F1B on paper with stage s taking ``t_forward[s]`` / ``t_backward[s]`` per micro-batch
    (``labs.theory.pipeline.simulate`` with a time per stage). Returns ``events``, ``makespan``,
    ``busy`` per stage and ``bubble_fraction`` (idle share of stages x time)."""
    P = len(t_forward)
    if P < 1 or len(t_backward) != P or min(t_forward) <= 0 or min(t_backward) < 0 or t_delay < 0:
        raise ValueError(
            "t_forward and t_backward need one time per stage, forward > 0, backward and"
            " t_delay >= 0"
        )
    sim = simulate("1f1b", P, microbatches, 1, list(t_forward), list(t_backward), t_delay)
    busy = [microbatches * (t_forward[s] + t_backward[s]) for s in range(P)]
    return {
        "events": sim["events"],
        "makespan": sim["makespan"],
        "busy": busy,
        "bubble_fraction": sim["bubble_fraction"],
    }


def pipeline_balance(
    spec: ModelSpec,
    enc: EncoderSpec,
    *,
    split: Iterable[int],
    text_tokens: int,
    mbs: int,
    microbatches: int,
    flops_per_s: float = 1.0,
    tp: int = 1,
) -> dict:
    """What ``split`` does to 1F1B: per stage ``stage_time`` (forward + backward of one micro-batch
    at ``flops_per_s``), ``imbalance`` (slowest / mean stage), the simulated ``bubble_fraction``,
    ``step_time``, ``balanced_bubble_fraction`` = (P-1)/(M+P-1) (equal stages) and
    ``ideal_step_time`` (all the work on P ranks with no idle time at all)."""
    check_positive(microbatches=microbatches)
    costs = stage_costs(spec, enc, split=split, text_tokens=text_tokens, mbs=mbs, tp=tp)
    t_f = [c["forward_flops"] / flops_per_s for c in costs]
    t_b = [c["backward_flops"] / flops_per_s for c in costs]
    sim = simulate_stages(t_f, t_b, microbatches)
    times = [f + b for f, b in zip(t_f, t_b)]
    P = len(costs)
    return {
        "split": tuple(split),
        "stages": costs,
        "t_forward": t_f,
        "t_backward": t_b,
        "stage_time": times,
        "imbalance": max(times) / (sum(times) / P),
        "bubble_fraction": sim["bubble_fraction"],
        "step_time": sim["makespan"],
        "ideal_step_time": microbatches * sum(times) / P,
        "balanced_bubble_fraction": (P - 1) / (microbatches + P - 1),
        "events": sim["events"],
    }


def balanced_split(
    spec: ModelSpec, enc: EncoderSpec, *, stages: int, text_tokens: int, mbs: int = 1, tp: int = 1
) -> tuple[int, ...]:
    """The split of the decoder's layers over ``stages`` (the encoder on stage 0) whose slowest
    stage (forward + backward FLOPs, ``stage_costs``) is fastest: ``split_for_costs`` with FLOPs as
    the costs."""
    check_positive(stages=stages)
    n = spec.n_layers
    all_on_last = (0,) * max(stages - 1, 1) + (n,)
    last = stage_costs(spec, enc, split=all_on_last, text_tokens=text_tokens, mbs=mbs, tp=tp)
    # forward + backward
    layer = decoder_flops(spec, seq=enc.tokens + text_tokens, mbs=mbs)["per_layer"] * 3 / tp
    encoder = last[0]["forward_flops"] + last[0]["backward_flops"]
    head = last[-1]["forward_flops"] + last[-1]["backward_flops"] - n * layer
    return split_for_costs(encoder=encoder, layer=layer, head=head, n_layers=n, stages=stages)


def split_for_costs(
    *, encoder: float, layer: float, head: float, n_layers: int, stages: int
) -> tuple[int, ...]:
    """Decoder layers per stage minimising the slowest stage, when stage 0 costs ``encoder`` (plus
    its layers), every layer ``layer`` and the last stage also ``head``: FLOPs (``balanced_split``)
    or measured seconds. Any stage may hold no layer (a heavy encoder may fill stage 0 alone); of
    equal splits, the first found with the fewest layers early."""
    check_positive(n_layers=n_layers, stages=stages)
    if stages < 2:
        raise ValueError(
            f"stages={stages}: a pipeline with the encoder on stage 0 needs stages >= 2"
        )
    if min(encoder, layer, head) < 0:
        raise ValueError(
            f"costs must be >= 0, got encoder={encoder!r}, layer={layer!r}, head={head!r}"
        )
    # layers placed so far -> (slowest stage so far, split so far), stage by stage
    best = {0: (0.0, ())}
    for s in range(stages):
        extra = (encoder if s == 0 else 0.0) + (head if s == stages - 1 else 0.0)
        nxt = {}
        for used, (worst, plan) in best.items():
            for k in range(n_layers - used + 1) if s < stages - 1 else [n_layers - used]:
                cand = (max(worst, extra + k * layer), plan + (k,))
                if used + k not in nxt or cand[0] < nxt[used + k][0]:
                    nxt[used + k] = cand
        best = nxt
    return best[n_layers][1]


# --- the memory calculator and the planner, with an encoder -----------------------------------


def memory_per_rank_with_encoder(
    spec: ModelSpec,
    enc: EncoderSpec,
    *,
    text_tokens: int,
    mbs: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    zero: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    sp: bool = False,
    cp: int = 1,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    split: Iterable[int] | None = None,
    recompute: str = "none",
) -> dict:
    """``labs.theory.memory.memory_per_rank`` with the encoder and projector on stage 0 (every rank
    when pp=1), replicated over TP and CP (every such rank runs it on the micro-batch's images),
    sharded over DP like the rest by ZeRO; the decoder reads T = P + C tokens, split by SP and CP as
    the calculator says. ``split``: decoder layers per stage (default: the calculator's,
    ``layers_on_stage``). Returns ``stages`` (per stage: params, state and activation bytes,
    ``decoder_bytes`` and ``encoder_bytes`` of its total, ``total_bytes``), the busiest stage's
    figures at the top level and ``decoder_only_bytes`` (the calculator's stage totals without the
    encoder, for comparison)."""
    seq = enc.tokens + text_tokens
    m = microbatches or pp
    # validates every argument
    base = memory_per_rank(
        spec,
        seq=seq,
        mbs=mbs,
        precision=precision,
        optimizer=optimizer,
        zero=zero,
        dp=dp,
        tp=tp,
        pp=pp,
        sp=sp,
        cp=cp,
        microbatches=microbatches,
        schedule=schedule,
        recompute=recompute,
    )
    e = PRECISIONS[precision]["param"]
    if split is None:
        split = tuple(layers_on_stage(spec.n_layers, pp, s) for s in range(pp))
    else:
        split = tuple(split)
    if len(split) != pp or not _layer_counts(split) or sum(split) != spec.n_layers:
        raise ValueError(
            f"split={split} must give pp={pp} stages >= 0 decoder layers each,"
            f" {spec.n_layers} in all"
        )
    enc_params = encoder_param_counts(enc, text_hidden=spec.hidden)["total"]
    enc_acts = encoder_activation_bytes(enc, mbs=mbs, text_hidden=spec.hidden, dtype_bytes=e)
    enc_acts = enc_acts["total"]
    stages = []
    for s, layers in enumerate(split):
        first = s == 0
        last = s == pp - 1
        dec = layers_params(spec, layers=layers, first=first, last=last, pp=pp, tp=tp)
        held = in_flight_microbatches(schedule, pp, m, s) if pp > 1 else 1
        act = stage_activation_bytes(
            spec,
            seq=seq,
            mbs=mbs,
            dtype_bytes=e,
            layers=layers,
            first=first,
            last=last,
            tp=tp,
            sp=sp,
            cp=cp,
            recompute=recompute,
        )["total"]
        kw = dict(precision=precision, optimizer=optimizer, zero=zero, dp=dp)
        dec_state = state_bytes(dec, **kw)["total_bytes"]
        all_state = state_bytes(dec + (enc_params if first else 0), **kw)
        row = {
            "stage": s,
            "layers": layers,
            "encoder": first,
            "params": dec + (enc_params if first else 0),
            "param_bytes": all_state["param_bytes"],
            "grad_bytes": all_state["grad_bytes"],
            "optimizer_bytes": all_state["optimizer_bytes"],
            "in_flight": held,
            "activation_bytes": held * (act + (enc_acts if first else 0)),
            "decoder_bytes": dec_state + held * act,
        }
        row["total_bytes"] = all_state["total_bytes"] + row["activation_bytes"]
        row["encoder_bytes"] = row["total_bytes"] - row["decoder_bytes"]
        stages.append(row)
    worst = max(stages, key=lambda r: r["total_bytes"])
    return {
        **worst,
        "stages": stages,
        "split": split,
        "seq": seq,
        "stage_total_bytes": [r["total_bytes"] for r in stages],
        "decoder_only_bytes": base["stage_total_bytes"],
        "imbalance_bytes": worst["total_bytes"] - min(r["total_bytes"] for r in stages),
    }


def encoder_tp_or_replicate(
    enc: EncoderSpec,
    *,
    tp: int,
    mbs: int,
    text_hidden: int,
    dtype_bytes: int = 2,
    flops_per_s: float = 989e12 * 0.6,
    bytes_per_s: float = 450e9,
    latency_s: float = 20e-6,
) -> dict:
    """Two ways to run the encoder on a TP group of ``tp`` GPUs, per micro-batch of ``mbs``
    samples. Split it Megatron-style: 4 all-reduces of [mbs·P, E] per layer (2 forward, 2
    backward), each 2(tp-1)/tp of the tensor per GPU plus a start-up ``latency_s``, on the critical
    path. Or replicate it: no bytes, but every GPU runs the whole encoder, (tp-1)/tp of it
    redundantly. Defaults: an H100 at 60% of its bf16 peak, NVLink 450 GB/s, ~20 µs per small
    all-reduce. Returns both in bytes / FLOPs and seconds."""
    check_positive(tp=tp, mbs=mbs)
    activation = mbs * enc.tokens * enc.hidden * dtype_bytes
    sent = 4 * enc.n_layers * all_reduce_bytes(activation, tp)
    f = encoder_flops(enc, mbs=mbs, text_hidden=text_hidden)
    extra = (f["forward"] + f["backward"]) * (tp - 1) / tp
    return {
        "tp_bytes": sent,
        "tp_seconds": sent / bytes_per_s + 4 * enc.n_layers * latency_s,
        "collectives": 4 * enc.n_layers,
        "replicate_extra_flops": extra,
        "replicate_extra_seconds": extra / flops_per_s,
    }


def tp_collectives(
    spec: ModelSpec, *, tp: int, batch: int, n_prefix: int, caption_len: int, dtype_bytes: int = 4
) -> list[dict]:
    """Every collective of one step of the tensor-parallel decoder with a replicated encoder:
    notebook 04's (``labs.theory.tensor_parallel.collectives``) at T = P + C, except that the
    vocab-parallel embedding all-reduces the caption's embeddings only ([B, C, H]) and the loss
    reduces over the B·C caption positions. The encoder and projector add nothing: they are
    replicated and their gradients arrive complete."""
    check_positive(n_prefix=n_prefix, caption_len=caption_len)
    calls = tensor_parallel.collectives(
        spec, tp=tp, batch=batch, seq=n_prefix + caption_len, dtype_bytes=dtype_bytes
    )
    text = {
        "tok_emb": batch * caption_len * spec.hidden * dtype_bytes,
        "loss: max logit": 4 * batch * caption_len,
        "loss: sum of exp, target logit": 2 * 4 * batch * caption_len,
    }
    for c in calls:
        if c["where"] in text:
            c["payload_bytes"] = text[c["where"]]
            c["sent_bytes"] = BYTES_PER_RANK[c["op"]](c["payload_bytes"], tp)
    return calls
