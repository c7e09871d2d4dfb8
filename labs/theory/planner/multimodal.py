"""The planner with an encoder in front of the decoder (notebook 11). Pure Python.

    plan_with_encoder(
        preset("llama3-8b"),
        ENCODERS["siglip-so400m"],
        text_tokens=1024,
        gpus=64,
        gpus_per_node=8,
        gpu_mem_gib=80,
    )
    python -m labs.theory multimodal --preset llama3-8b --encoder siglip-so400m \
        --text-tokens 1024 --gpus 16 --layout 4,1,4,1,1 --global-batch 1024

The decoder is planned by ``labs.theory.planner`` for T = P + C tokens per sequence; the encoder
then goes where the lab (notebook 11) puts it: on pipeline stage 0, replicated over TP and CP,
sharded over DP by ZeRO. Memory comes from
``labs.theory.multimodal.memory_per_rank_with_encoder``; time from each stage's FLOPs at the
planner's efficiency, run through 1F1B on paper (``simulate_stages``) with the planner's split and
with ``balanced_split``'s. The planner's own step time knows the decoder's layers and its head
(it runs at its slowest stage's pace) but not the encoder; the stage table shows how far from
equal the stages are (the encoder on the first stage, and a large vocabulary's head on the
last).
"""

from __future__ import annotations

import dataclasses
import functools

from labs.theory.model import ModelSpec
from labs.theory.multimodal import (
    EncoderSpec,
    balanced_split,
    encoder_flops,
    encoder_param_counts,
    encoder_spec,
    memory_per_rank_with_encoder,
    pipeline_balance,
    simulate_stages,
)
from labs.theory.planner.cost import ASSUMPTIONS, TOKENS_PER_BATCH, Cluster, evaluate
from labs.theory.planner.search import plan


def plan_with_encoder(
    spec: ModelSpec,
    enc: EncoderSpec,
    *,
    text_tokens: int,
    gpus: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    layout: dict | None = None,
    global_batch: int | None = None,
    peak_tflops: float = 989.0,
    **assumptions: object,
) -> dict:
    """The planner (``labs.theory.planner``) with an encoder in front of the decoder. The decoder
    is planned for T = P + C tokens per sequence (``plan``, or ``evaluate`` for a given ``layout``
    {dp, tp, pp, cp, zero}); the encoder then goes where the lab puts it: on pipeline stage 0,
    replicated over TP and CP, sharded by ZeRO. Returns ``decoder`` (the planner's figures:
    layout, memory, step time, bubble), ``memory`` (``memory_per_rank_with_encoder`` for that
    layout), ``fits``, ``encoder_params``, and the pipeline with the planner's split (``split``,
    ``stage_time_s`` per micro-batch, ``bubble``, ``step_time_s``; ``decoder_only_*`` the same
    split without the encoder) next to ``balanced_split``'s (``rebalanced_*``, and
    ``rebalanced_memory``). Times: FLOPs at ``peak_tflops`` times the planner's efficiency, plus
    the decoder's exposed communication."""
    seq = enc.tokens + text_tokens
    # the lab's pipeline is 1F1B over micro-batches of one sample unless told otherwise
    assumptions = {"mbs": 1, "schedule": "1f1b", **assumptions}
    if layout is None:
        p = plan(
            spec,
            seq=seq,
            gpus=gpus,
            gpus_per_node=gpus_per_node,
            gpu_mem_gib=gpu_mem_gib,
            global_batch=global_batch,
            peak_tflops=peak_tflops,
            **assumptions,
        )
        a = p["assumptions"]
    else:
        a = {**ASSUMPTIONS, **assumptions}
        if global_batch is not None:
            batch = global_batch
        else:
            batch = max(1, TOKENS_PER_BATCH // seq)
        cluster = Cluster(gpus, gpus_per_node, gpu_mem_gib, peak_tflops)
        figures = evaluate(
            spec,
            {k: layout[k] for k in ("dp", "tp", "pp", "cp", "zero")},
            seq=seq,
            global_batch=batch,
            cluster=cluster,
            **a,
        )
        p = {**layout, **figures}
    dp, tp, pp, cp, zero, m = (p[k] for k in ("dp", "tp", "pp", "cp", "zero", "microbatches"))
    mbs = a["mbs"]
    memory_with_split = functools.partial(
        memory_per_rank_with_encoder,
        spec,
        enc,
        text_tokens=text_tokens,
        mbs=mbs,
        precision=a["precision"],
        optimizer=a["optimizer"],
        zero=zero,
        dp=dp * cp if zero else 1,
        tp=tp,
        pp=pp,
        sp=tp > 1,
        cp=cp,
        microbatches=m,
        schedule=a["schedule"],
        recompute=a["recompute"],
    )
    memory = memory_with_split()  # the calculator's own split
    rate = peak_tflops * 1e12 * a["efficiency"]
    out = {
        "seq": seq,
        "layout": {k: p[k] for k in ("dp", "tp", "pp", "cp", "zero")},
        "microbatches": m,
        "decoder": {
            "memory_bytes": p["memory"]["total_bytes"],
            "step_time_s": p["step_time_s"],
            "bubble": p["bubble"],
        },
        "memory": memory,
        "fits": memory["total_bytes"] <= p["budget_bytes"],
        "budget_bytes": p["budget_bytes"],
        "encoder_params": encoder_param_counts(enc, text_hidden=spec.hidden)["total"],
    }
    exposed = p["exposed_comm_s"]
    if pp == 1:
        f = encoder_flops(enc, mbs=mbs, text_hidden=spec.hidden)
        # replicated over TP and CP: every GPU runs it
        encoder_s = m * (f["forward"] + f["backward"]) / rate
        out.update(
            split=None,
            encoder_time_s=encoder_s,
            step_time_s=p["step_time_s"] + encoder_s,
            bubble=0.0,
            rebalanced_split=None,
        )
        return out
    rebalanced = balanced_split(spec, enc, stages=pp, text_tokens=text_tokens, mbs=mbs, tp=tp)
    for key, split in (("", memory["split"]), ("rebalanced_", rebalanced)):
        r = pipeline_balance(
            spec,
            enc,
            split=split,
            text_tokens=text_tokens,
            mbs=mbs,
            microbatches=m,
            flops_per_s=rate,
            tp=tp,
        )
        out.update(
            {
                f"{key}split": split,
                f"{key}stage_time_s": r["stage_time"],
                f"{key}imbalance": r["imbalance"],
                f"{key}bubble": r["bubble_fraction"],
                f"{key}step_time_s": r["step_time"] + exposed,
            }
        )
        if not key:
            # the same split without the encoder: how much of the imbalance is the encoder's
            f = encoder_flops(enc, mbs=mbs, text_hidden=spec.hidden)
            t_f = [r["t_forward"][0] - f["forward"] / rate] + r["t_forward"][1:]
            t_b = [r["t_backward"][0] - f["backward"] / rate] + r["t_backward"][1:]
            alone = simulate_stages(t_f, t_b, m)
            out.update(
                decoder_only_stage_time_s=[x + y for x, y in zip(t_f, t_b)],
                decoder_only_bubble=alone["bubble_fraction"],
                decoder_only_step_time_s=alone["makespan"] + exposed,
            )
    out["rebalanced_memory"] = memory_with_split(split=out["rebalanced_split"])
    return out


ENCODER_DIMS = ("tokens", "hidden", "n_layers", "n_heads", "ffn_hidden", "patch_dim")


def parse_layout(text: str) -> dict:
    """``"dp,tp,pp,cp,zero"`` (five integers, e.g. ``"4,1,4,1,1"``) as a layout dict."""
    values = text.split(",")
    if len(values) != 5 or not all(v.strip().isdigit() for v in values):
        raise ValueError(f"layout={text!r} must be five integers dp,tp,pp,cp,zero, e.g. 4,1,4,1,1")
    return dict(zip(("dp", "tp", "pp", "cp", "zero"), map(int, values)))


def report(
    spec: ModelSpec,
    *,
    text_tokens: int,
    gpus: int,
    model: str = "custom",
    encoder: str = "siglip-so400m",
    encoder_dims: dict | None = None,
    layout: str | None = None,
    gpus_per_node: int = 8,
    gpu_mem: float = 80.0,
    peak_tflops: float = 989.0,
    global_batch: int | None = None,
) -> dict:
    """What ``python -m labs.theory multimodal`` prints: ``plan_summary`` of
    ``plan_with_encoder`` for the encoder ``encoder`` (``encoder_dims``: fields of
    ``EncoderSpec`` that override its own; None or 0 keeps the encoder's) and a ``layout``
    "dp,tp,pp,cp,zero" (None: the planner's choice)."""
    overrides = {k: v for k, v in (encoder_dims or {}).items() if v}
    enc = dataclasses.replace(encoder_spec(encoder), **overrides)
    r = plan_with_encoder(
        spec,
        enc,
        text_tokens=text_tokens,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        gpu_mem_gib=gpu_mem,
        peak_tflops=peak_tflops,
        global_batch=global_batch,
        layout=parse_layout(layout) if layout else None,
    )
    return plan_summary(r, model=model, encoder=encoder)


def plan_summary(r: dict, *, model: str = "custom", encoder: str = "custom") -> dict:
    """``plan_with_encoder``'s result as plain JSON (memory per stage in GiB), what
    ``format_result`` prints."""
    keep = {k: v for k, v in r.items() if k not in ("memory", "rebalanced_memory")}
    keep["memory_gib"] = [b / 2**30 for b in r["memory"]["stage_total_bytes"]]
    keep["decoder_only_memory_gib"] = [b / 2**30 for b in r["memory"]["decoder_only_bytes"]]
    return {"model": model, "encoder": encoder, **keep}


def format_result(r: dict) -> str:
    """``report``'s result: the layout, memory per stage, and the pipeline per split."""
    lay = r["layout"]
    memory = " ".join(f"{g:6.1f}" for g in r["memory_gib"])
    decoder_memory = " ".join(f"{g:6.1f}" for g in r["decoder_only_memory_gib"])
    lines = [
        f"{r['model']} + {r['encoder']}: {r['seq']} decoder tokens per sample;"
        f" layout DP={lay['dp']} TP={lay['tp']} PP={lay['pp']} CP={lay['cp']}"
        f" ZeRO-{lay['zero']}, {r['microbatches']} micro-batches per step",
        f"memory per stage (GiB)  {memory}   fits: {r['fits']}",
        f"  decoder alone         {decoder_memory}",
    ]
    if r["split"] is None:
        lines.append(
            f"no pipeline: every GPU runs the encoder, {r['encoder_time_s']:.3g} s per step "
            f"(step {r['decoder']['step_time_s']:.3g} s -> {r['step_time_s']:.3g} s)"
        )
        return "\n".join(lines)
    for label, key in (
        ("decoder alone", "decoder_only_"),
        ("with encoder", ""),
        ("rebalanced", "rebalanced_"),
    ):
        split = r["split"] if key != "rebalanced_" else r["rebalanced_split"]
        stage_ms = " ".join(f"{t * 1e3:6.1f}" for t in r[f"{key}stage_time_s"])
        lines.append(
            f"{label:14} split {str(split):26} stage ms {stage_ms}"
            f"   bubble {r[f'{key}bubble']:.1%}, step {r[f'{key}step_time_s']:.3g} s"
        )
    lines.append(
        f"(the planner's estimate, decoder only: bubble {r['decoder']['bubble']:.1%}, "
        f"step {r['decoder']['step_time_s']:.3g} s)"
    )
    return "\n".join(lines)
