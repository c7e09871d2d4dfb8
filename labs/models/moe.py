"""The course model with mixture-of-experts feed-forward layers (notebook 07), and the
single-process MoE layer every MoE run is checked against.

    moe = MoEConfig(n_experts=8, top_k=2, capacity_factor=1.25)
    xp = exercise("expert_parallel")
    model = build_moe_model(ModelConfig(), moe, layer=xp.MoELayer)  # every block's MLP -> MoE
    logits, loss = model(x, y)  # loss = cross-entropy + every layer's aux + z loss
    swap_mlp(model, lambda i, layer: xp.ExpertParallelMoE.from_full(layer, group=ep_group))
    reference = build_moe_model(ModelConfig(), moe, layer=ReferenceMoELayer, groups=4)

The blocks are the course model's (``labs.models.transformer``), unchanged: only
``block.mlp`` is swapped for an MoE module, whose experts are the course model's SwiGLU
``MLP`` with the same dimensions. The MoE layer class is an argument: the caller passes the
exercise module's (``exercise("expert_parallel").MoELayer``), so a learner's layer trains
inside the real model while this module never imports learner code.

:class:`ReferenceMoELayer` is the reference: the same routing rules, capacity and losses as the
exercise asks for (``solutions/expert_parallel.py``'s docstring), the same parameters under the
same names, written apart from it and plainly (a loop over the pairs in priority order for the
capacity, a loop over the experts for dispatch and combine), so that a learner's mistake in the
exercise cannot move the reference with it (issue 31).

Every MoE layer leaves ``layer.aux_loss`` behind after its forward (the load-balancing
and router z-losses times their coefficients); :class:`MoETransformer` adds them to the
cross-entropy, so the router learns to balance while the model learns the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from labs.models.transformer import MLP, ModelConfig, Transformer, init_weights
from labs.theory.dims import check_positive
from labs.theory.moe import check_capacity_factor, check_top_k, expert_capacity


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


def keep_within_capacity(
    chosen: torch.Tensor, n_experts: int, capacity: int | None, groups: int = 1
) -> torch.Tensor:
    """Which (token, choice) pairs an expert accepts: bool [N, k] for ``chosen`` [N, k] (expert ids
    of N tokens in ``groups`` contiguous groups). GShard's priority, per group: every first choice
    in token order, then every second choice, ...; an expert takes the first ``capacity`` pairs
    that reach it (None: all). Written as the rule reads, one pair at a time."""
    n, k = chosen.shape
    if capacity is None:
        return torch.ones(n, k, dtype=torch.bool, device=chosen.device)
    experts = chosen.tolist()
    keep = [[False] * k for _ in range(n)]
    size = n // groups
    for first in range(0, n, size):  # each group decides alone
        taken = [0] * n_experts  # pairs each expert has accepted in this group
        for choice in range(k):
            for token in range(first, first + size):
                e = experts[token][choice]
                if taken[e] < capacity:
                    taken[e] += 1
                    keep[token][choice] = True
    return torch.tensor(keep, dtype=torch.bool, device=chosen.device)


class ReferenceMoELayer(nn.Module):
    """The single-process MoE layer the MoE runs are checked against (not the exercise's):
    ``router`` Linear(H, E) and ``experts[str(e)]`` (the course model's SwiGLU ``MLP``), named
    as the exercise's ``MoELayer`` names them, so the same seed gives the same weights.

    Forward on x [B, T, H], its B·T tokens in ``groups`` contiguous groups (one per data-parallel
    rank of the run it is the reference of):

    * route: softmax of the router's logits, the k most probable experts (``topk`` order), their
      probabilities renormalised to sum to 1 when k > 1 (Mixtral), raw when k = 1 (Switch);
    * capacity: C = ceil(cf·k·N/E) pairs per expert and group (``labs.theory.moe``), kept by
      ``keep_within_capacity``; a dropped pair adds nothing;
    * output: for each expert, its kept tokens through it (in token order); each token's k outputs
      times their weights, summed (a dropped pair adds zero);
    * ``aux_loss``: aux_loss_coef · E·Σ_e f_e·P_e (Switch's load balancing per group, f_e the share
      of the group's k·N pairs choosing e before dropping, P_e the group's mean probability of e;
      averaged over the groups) + z_loss_coef · mean(logsumexp(logits)²) (ST-MoE);
    * ``routing``: ``chosen`` [N, k] and ``keep`` [N, k], detached, as the exercise's layer
      leaves them.
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, groups: int = 1):
        super().__init__()
        check_positive(groups=groups)
        self.cfg = cfg
        self.moe = moe
        self.groups = groups
        self.router = nn.Linear(cfg.n_embd, moe.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(cfg) for e in range(moe.n_experts)})
        self.aux_loss = None
        self.routing = None

    def capacity(self, tokens: int) -> int | None:
        """Pairs one expert accepts from a group of ``tokens`` tokens (None: no limit)."""
        if self.moe.capacity_factor is None:
            return None
        return expert_capacity(tokens, self.moe.top_k, self.moe.n_experts, self.moe.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]."""
        moe = self.moe
        tokens = x.reshape(-1, x.shape[-1])  # [N, H]
        n = tokens.shape[0]
        if n % self.groups:
            raise ValueError(
                f"{n} tokens do not split into groups={self.groups}: use a batch whose B·T is a"
                f" multiple of {self.groups}"
            )
        logits = self.router(tokens)  # [N, E]
        probs = torch.softmax(logits, dim=-1)  # [N, E]
        top, chosen = torch.topk(probs, moe.top_k, dim=-1)  # [N, k]
        weights = top / top.sum(dim=-1, keepdim=True) if moe.top_k > 1 else top  # [N, k]
        keep = keep_within_capacity(
            chosen, moe.n_experts, self.capacity(n // self.groups), self.groups
        )
        # the kept pairs expert by expert, each expert's in token order: (token, choice) of each
        rows, slots = zip(
            *(torch.nonzero((chosen == e) & keep, as_tuple=True) for e in range(moe.n_experts))
        )
        counts = [len(r) for r in rows]  # kept pairs per expert
        rows = torch.cat(rows)  # [M]
        slots = torch.cat(slots)  # [M]
        inputs = tokens[rows].split(counts)  # E chunks [M_e, H]
        outputs = torch.cat([expert(x) for expert, x in zip(self.experts.values(), inputs)])
        # each token's k expert outputs (zero where dropped), weighted and summed
        pairs = tokens.new_zeros(n, moe.top_k, tokens.shape[-1]).index_put((rows, slots), outputs)
        out = (weights.unsqueeze(-1) * pairs).sum(dim=1)  # [N, H]
        self.aux_loss = moe.aux_loss_coef * self._balance(probs, chosen) + moe.z_loss_coef * (
            torch.logsumexp(logits, dim=-1).pow(2).mean()
        )
        self.routing = {"chosen": chosen.detach(), "keep": keep.detach()}
        return out.view(x.shape)

    def _balance(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch's load-balancing loss, per group, averaged over the groups."""
        e = self.moe.n_experts
        losses = []
        for group_probs, group_chosen in zip(probs.chunk(self.groups), chosen.chunk(self.groups)):
            counts = torch.bincount(group_chosen.flatten(), minlength=e)  # [E], no gradient
            share = counts.to(probs.dtype) / group_chosen.numel()  # f_e
            mean_prob = group_probs.mean(dim=0)  # P_e [E]
            losses.append(e * (share * mean_prob).sum())
        return torch.stack(losses).mean()


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
    ``MoELayer`` class of ``exercise("expert_parallel")``, or :class:`ReferenceMoELayer` for the
    reference), weights from ``seed`` (the course
    model's ``init_weights``: same seed, same weights, on every rank). ``groups``: the token groups
    capacity and the aux loss are computed over (the single-process reference of a run on
    ``groups`` data-parallel ranks uses one group per rank; see the exercise module)."""
    model = MoETransformer(cfg, moe, lambda i: layer(cfg, moe, groups=groups))
    return init_weights(model, seed).to(device)
