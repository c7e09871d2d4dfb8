"""``transformers`` models built from a config, offline: no hub, no download.

    hf = build_hf_llama(cfg, seed=0)        # LlamaForCausalLM with the course model's dims
    hf = to_hf_llama(course_model)          # the same weights as ``course_model``
    gpt2 = build_hf_gpt2(n_layer=2, n_embd=64, n_head=4)

The course model uses Llama's module layout, so the weight copy is a rename
(``tok_emb`` -> ``model.embed_tokens``, ``layers.i.attn_norm`` ->
``model.layers.i.input_layernorm``, ...). A test checks the two give the same logits: the course
model *is* a Llama.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from labs.models.transformer import ModelConfig, build_model

if TYPE_CHECKING:
    from transformers import (
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PretrainedConfig,
        PreTrainedModel,
    )

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the course never downloads
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """A ``transformers.LlamaConfig`` with the course model's dimensions."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )


def hf_llama_name(name: str) -> str:
    """The ``LlamaForCausalLM`` parameter name for a course-model parameter name."""
    if name == "tok_emb.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    name = name.replace("attn_norm", "input_layernorm")
    name = name.replace("mlp_norm", "post_attention_layernorm")
    name = name.replace(".attn.", ".self_attn.")
    return "model." + name


def to_hf_llama(model: torch.nn.Module) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding copies of the course model's weights."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(llama_config(model.cfg)).to(next(model.parameters()).dtype)
    state = {hf_llama_name(k): v for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"weight names do not line up: missing {missing}, unexpected {unexpected}"
        )
    return hf.eval()


def build_hf_llama(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` with the weights the course model gets from ``seed``."""
    return to_hf_llama(build_model(cfg, seed))


def build_hf_gpt2(
    *,
    vocab_size: int = 256,
    seq_len: int = 64,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    seed: int = 0,
) -> GPT2LMHeadModel:
    """A small ``GPT2LMHeadModel`` (learned positions, LayerNorm, GELU MLP, tied head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """Instantiate a ``transformers`` config on the meta device: shapes only, no memory.
    Used to count parameters of Llama-3 70B or 405B on a laptop."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
