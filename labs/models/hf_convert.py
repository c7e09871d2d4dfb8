"""The course model from a ``transformers`` ``LlamaForCausalLM`` (the inverse of
``labs.models.hf.to_hf_llama``).

    full = course_model_from(hf_llama)   # a course Transformer with the same weights (same logits)
    full = course_model_from(course)     # returned as it is

Labs that cut a model into shards (tensor parallelism, notebook 04) accept either kind:
they read the dimensions and the rotary base from the HF config, rename the weights
(``model.layers.i.self_attn.q_proj`` -> ``layers.i.attn.q_proj``, ...), and then work on
the course's module layout. Configs the course model cannot express (biases, rotary
scaling, another activation) are a ``ValueError``, not a silently different model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from labs.models.hf import hf_llama_name
from labs.models.transformer import ModelConfig, Transformer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def course_config_from_hf(config: PretrainedConfig) -> ModelConfig:
    """The ``ModelConfig`` of a ``transformers.LlamaConfig``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    unsupported = [
        name
        for name, differs in (
            ("attention_bias", bool(getattr(config, "attention_bias", False))),
            ("mlp_bias", bool(getattr(config, "mlp_bias", False))),
            ("rope_type", rope.get("rope_type", "default") != "default"),
            ("hidden_act", getattr(config, "hidden_act", "silu") != "silu"),
            ("head_dim", head_dim * heads != config.hidden_size),
        )
        if differs
    ]
    if unsupported:
        raise ValueError(
            f"this Llama config differs from the course model in {unsupported}; supported:"
            " no biases, default rotary, silu, head_dim = hidden_size / num_attention_heads"
        )
    return ModelConfig(
        vocab_size=config.vocab_size,
        seq_len=config.max_position_embeddings,
        n_layer=config.num_hidden_layers,
        n_embd=config.hidden_size,
        n_head=config.num_attention_heads,
        n_kv_head=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        ffn_hidden=config.intermediate_size,
        tie_embeddings=bool(config.tie_word_embeddings),
        rope_theta=float(theta),
        norm_eps=config.rms_norm_eps,
    )


def course_model_from(model: nn.Module) -> Transformer:
    """``model`` itself if it is the course model, else a course ``Transformer`` holding copies of
    a ``LlamaForCausalLM``'s weights (same dtype, same device)."""
    if isinstance(model, Transformer):
        return model
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(
            f"model must be the course Transformer or a transformers LlamaForCausalLM, "
            f"got {type(model).__name__}"
        )
    first = next(model.parameters())
    full = Transformer(course_config_from_hf(config)).to(device=first.device, dtype=first.dtype)
    state = model.state_dict()
    full.load_state_dict({name: state[hf_llama_name(name)] for name in full.state_dict()})
    return full
