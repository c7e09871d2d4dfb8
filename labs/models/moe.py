"""The course model with mixture-of-experts feed-forward layers (notebook 07).

    moe = MoEConfig(n_experts=8, top_k=2, capacity_factor=1.25)
    xp = exercise("expert_parallel")
    model = build_moe_model(ModelConfig(), moe, layer=xp.MoELayer)  # every block's MLP -> MoE
    logits, loss = model(x, y)  # loss = cross-entropy + every layer's aux + z loss
    swap_mlp(model, lambda i, layer: xp.ExpertParallelMoE.from_full(layer, group=ep_group))

The blocks are the course model's (``labs.models.transformer``), unchanged: only
``block.mlp`` is swapped for an MoE module, whose experts are the course model's SwiGLU
``MLP`` with the same dimensions. The MoE layer class is an argument: the caller passes the
exercise module's (``exercise("expert_parallel").MoELayer``), so a learner's layer trains
inside the real model while this module never imports learner code.

Every MoE layer leaves ``layer.aux_loss`` behind after its forward (the load-balancing
and router z-losses times their coefficients); :class:`MoETransformer` adds them to the
cross-entropy, so the router learns to balance while the model learns the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from labs.models.transformer import ModelConfig, Transformer, init_weights
from labs.theory.dims import check_positive
from labs.theory.moe import check_capacity_factor, check_top_k


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 8  # E
    top_k: int = 2  # k experts per token (1: Switch, 2: GShard/Mixtral)
    capacity_factor: float | None = (
        None  # None: no capacity, nothing dropped; 1.0: an even share per expert
    )
    aux_loss_coef: float = 1e-2  # Switch Transformer's alpha for the load-balancing loss
    z_loss_coef: float = 1e-3  # ST-MoE's router z-loss coefficient

    def __post_init__(self):
        check_positive(n_experts=self.n_experts, top_k=self.top_k)
        check_top_k(self.top_k, self.n_experts)
        check_capacity_factor(self.capacity_factor)
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class MoETransformer(Transformer):
    """The course model whose blocks' MLPs are MoE layers; the loss adds their auxiliary losses."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__(cfg)
        self.moe = moe
        swap_mlp(self, lambda i, _: make_layer(i))

    def moe_layers(self) -> list[nn.Module]:
        return [block.mlp for block in self.layers]

    def forward(self, idx, targets=None, positions=None):
        """idx: [B, T] -> logits [B, T, V]; with targets, also cross-entropy + sum of the layers'
        aux losses."""
        out = super().forward(idx, targets, positions)
        if targets is None:
            return out
        logits, loss = out
        return logits, loss + sum(layer.aux_loss for layer in self.moe_layers())


def swap_mlp(model: Transformer, make: Callable[[int, nn.Module], nn.Module]) -> Transformer:
    """Replace each block's ``mlp`` with ``make(layer_index, current_mlp)``, in place; returns
    ``model``."""
    for i, block in enumerate(model.layers):
        block.mlp = make(i, block.mlp)
    return model


def build_moe_model(
    cfg: ModelConfig,
    moe: MoEConfig,
    *,
    layer: Callable[..., nn.Module],
    seed: int = 0,
    groups: int = 1,
    device: torch.device | str = "cpu",
) -> MoETransformer:
    """The course model with ``layer(cfg, moe, groups=groups)`` in every block (``layer``: the
    ``MoELayer`` class of ``exercise("expert_parallel")``), weights from ``seed`` (the course
    model's ``init_weights``: same seed, same weights, on every rank). ``groups``: the token groups
    capacity and the aux loss are computed over (the single-process reference of a run on
    ``groups`` data-parallel ranks uses one group per rank; see the exercise module)."""
    model = MoETransformer(cfg, moe, lambda i: layer(cfg, moe, groups=groups))
    return init_weights(model, seed).to(device)
