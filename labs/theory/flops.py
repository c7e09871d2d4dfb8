"""Training FLOPs per step and model FLOPs utilisation (MFU). Pure Python.

A matmul of an [m, k] by a [k, n] matrix costs 2·m·k·n FLOPs; its backward costs twice that
(the gradient for the input and the gradient for the weight). A weight with P entries therefore
costs 6·P FLOPs per token per training step, and attention's two seq-long matmuls (q·kᵀ and
probabilities·v) cost 2·2·seq·nh·hd per token forward, three times that with backward:

    FLOPs per token = 6·P_matmul + 12·L·nh·hd·seq

P_matmul counts the weights that are multiplied: every weight matrix and the output head (tied
or not), but not the embedding table (a lookup), norm weights or biases (elementwise). In a
mixture of experts a token multiplies the router and its top-k experts only (the active
parameters of ``labs.theory.moe``). The
playbook's 6N + 12·L·h·seq uses all N parameters: ~7% high for Llama-3 8B, whose embedding
has 525 M entries. Causal attention needs only half of the seq x seq products; the usual
convention (PaLM, Chowdhery et al. 2022, App. B) counts all of them, and so do we. A test
counts the FLOPs of the course model with ``torch.utils.flop_counter.FlopCounterMode``.

Recomputation makes the hardware do more than the model needs: ``full`` reruns each block's
forward in backward, about 8 instead of 6 FLOPs per weight: +2·(P_layers - L·h·F) + 4·L·nh·hd·seq
per token (torch.utils.checkpoint stops once backward has what it needs, so each block's last
matmul, down_proj, whose output nothing saves, is not rerun);
``selective`` reruns gpt's attention core (+4·L·nh·hd·seq) and, for llama (which keeps every
matmul and attention output), only pointwise ops that FLOP counts leave out. MFU counts model
FLOPs (recompute="none"); hardware FLOPs utilisation (HFU) counts what was executed.

Conventions differ for selective recomputation: we count the rerun attention core's forward,
4·b·s²·h per layer, against the whole step, 0.9 % for GPT-3 (s = 2,048, h = 12,288).
Korthikanti et al. 2022 give 2.7 % for GPT-3, and the HFU - MFU gaps of their Table 5 (as
Megatron-LM's README reprints it: 22B 43.7 / 41.5 %, 175B 52.8 / 51.4 %, 530B 57.0 / 56.0 %, 1T
57.0 / 56.3 %) are three times ours within rounding: the same FLOPs against the forward pass
alone, a third of a step (4·b·s²·h / (24·b·s·h²·(1 + s/6h)) = 2.7 % for GPT-3).
``labs.theory.planner.published`` holds both side by side.

    MFU = FLOPs per step / (step time · peak FLOP/s per GPU · GPUs)
"""

from __future__ import annotations

from labs.theory.activations import RECOMPUTE
from labs.theory.dims import check_positive
from labs.theory.model import ModelSpec, param_count


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a matmul: q, k, v, o and the MLP matrices of every layer, and the
    head."""
    h = spec.hidden
    F = spec.ffn
    L = spec.n_layers
    if spec.arch == "gpt":
        per_layer = 4 * h * h + 2 * h * F
    else:
        router = h * spec.n_experts if spec.moe else 0
        mlp = spec.top_k * 3 * h * F + router  # top_k is 1 for a dense MLP
        per_layer = 2 * h * spec.n_heads * spec.hd + 2 * h * spec.kv_heads * spec.hd + mlp
    return L * per_layer + spec.vocab_size * h


def flops_per_token(
    spec: ModelSpec, *, seq: int, exact: bool = True, recompute: str = "none"
) -> float:
    """Training (forward + backward) FLOPs per token: 6·P_matmul + 12·L·nh·hd·seq, or with
    ``exact=False`` the playbook's 6·N + 12·L·h·seq; plus what ``recompute`` reruns."""
    check_positive(seq=seq)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    attention_fwd = 4 * spec.n_layers * spec.n_heads * spec.hd * seq  # q·kᵀ and probabilities·v
    if exact:
        flops = 6 * matmul_params(spec) + 3 * attention_fwd
    else:
        flops = 6 * param_count(spec) + 12 * spec.n_layers * spec.hidden * seq
    if recompute == "full":
        # one more forward of every block but its last matmul (the head is not checkpointed)
        layer_weights = matmul_params(spec) - spec.vocab_size * spec.hidden
        down = spec.n_layers * spec.top_k * spec.hidden * spec.ffn  # down_proj is not rerun
        flops += 2 * (layer_weights - down) + attention_fwd
    elif recompute == "selective" and spec.arch == "gpt":
        flops += attention_fwd
    return flops


def training_flops(
    spec: ModelSpec, *, seq: int, tokens: int, exact: bool = True, recompute: str = "none"
) -> float:
    """FLOPs of one training step over ``tokens`` tokens (global batch x sequence length)."""
    check_positive(tokens=tokens)
    return flops_per_token(spec, seq=seq, exact=exact, recompute=recompute) * tokens


def mfu(flops_per_step: float, *, step_time_s: float, peak_flops: float, n_gpus: int = 1) -> float:
    """Model FLOPs utilisation: the share of the GPUs' peak the step's useful FLOPs achieve."""
    for name, value in (
        ("step_time_s", step_time_s),
        ("peak_flops", peak_flops),
        ("n_gpus", n_gpus),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    return flops_per_step / (step_time_s * peak_flops * n_gpus)
