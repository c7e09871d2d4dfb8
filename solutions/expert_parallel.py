"""Exercise 07 (notebooks/07_mixture_of_experts.ipynb): a mixture-of-experts layer, then expert
parallelism.

The layer. A router (Linear H -> E, softmax) scores each token; the token goes to its top-k experts
(SwiGLU MLPs) and leaves as their outputs weighted by the router: the k probabilities renormalised
to sum to 1 when k > 1 (Mixtral), the raw probability when k = 1 (Switch, so the loss still trains
the router).

Capacity (GShard, Lepikhin et al. 2020, §2.2). Tokens are routed in *groups*: a group is the tokens
one rank holds (B·T of them). Per group each expert accepts at most C = ceil(cf·k·N/E) (token,
choice) pairs, in this priority: every first choice (in token order) before any second choice. A
dropped pair adds nothing; a token whose pairs are all dropped leaves as zero and the block's
residual carries it. Decided inside a group, dropping needs no communication, and the EP layer (its
tokens = one group) drops exactly what the single-process layer drops on the concatenated global
batch with one group per rank: that layer, on that batch, is the reference of every test, with EP
alone or EP × DP.

Losses (they reach the router). Load balancing (Switch, Fedus et al. 2021, eq. 4): E·Σ_e f_e·P_e per
group, f_e the share of the group's k·N pairs choosing e (before dropping), P_e the mean probability
of e; 1 when balanced, averaged over groups. Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5):
mean over tokens of logsumexp(logits)².

Expert parallelism. The ep ranks of an EP group hold E/ep experts each (rank r: experts r·E/ep ..
(r+1)·E/ep - 1) and their own tokens; router, attention, norms and embeddings are replicated and
data-parallel. Per MoE layer, on the EP group:

    forward   all_to_all_single of counts   [ep, E/ep] int64: how many rows each rank will receive
              all_to_all_single dispatch    my kept rows, sorted by expert = by destination
                                            (uneven splits)
              local experts on the received rows, then the reverse all_to_all_single (combine)
    backward  the two token all-to-alls in reverse (AllToAll.backward), the same bytes

Bytes a rank r sends per layer per step (``labs.theory.moe``), rows(s -> d) = kept pairs s routes to
d: dispatch sum_{d!=r} rows(r->d)·H·b, combine sum_{s!=r} rows(s->r)·H·b, counts 8·(ep-1)·E/ep;
backward sends dispatch + combine again. Uniform routing without drops: N·k·(ep-1)/ep·H·b each way.

EP × DP: world = ep × world/ep ranks, all with different tokens. After backward the gradients are
summed, experts over the ranks holding the same experts (expert-DP group), the rest over all ranks,
and divided by the world size (``allreduce_gradients``); see the Ultra-Scale Playbook, "Expert
parallelism".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from labs.models.moe import MoEConfig
from labs.models.transformer import MLP, ModelConfig
from labs.theory.dims import check_divides
from labs.theory.moe import expert_capacity

NOTEBOOK = "07_mixture_of_experts.ipynb"
# The lab has one part, its core, and the minutes it takes at the notebook's pace
# (labs.check.parts); each function's docstring names its part.
PARTS = {"core": 75}


# --- routing ---
def route(
    tokens: torch.Tensor, router: nn.Linear, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score the tokens and pick their experts.

    tokens: [N, H]; router: Linear(H, E). Returns ``(logits, probs, weights, chosen)``: logits [N,
    E], probs [N, E] (softmax of the logits), chosen [N, k] (the k most probable experts, ``topk``
    order) and weights [N, k] (their probabilities, renormalised to sum to 1 when k > 1; raw when k
    = 1).

    Part: core.
    """
    ### BEGIN SOLUTION
    logits = router(tokens)  # [N, E]
    probs = logits.softmax(dim=-1)  # [N, E]
    weights, chosen = probs.topk(top_k, dim=-1)  # [N, k]
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, probs, weights, chosen
    ### END SOLUTION


def capacity_keep(
    chosen: torch.Tensor, n_experts: int, capacity: int | None, groups: int = 1
) -> torch.Tensor:
    """Which (token, choice) pairs fit their expert's capacity: bool [N, k].

    chosen: [N, k] expert ids of N tokens in ``groups`` contiguous groups. In each group every
    expert keeps its first ``capacity`` pairs in this order: all first choices in token order, then
    all second choices, ... ``capacity=None`` keeps every pair. Hint: a one-hot [G, k·N/G, E] in
    that order, and its cumulative sum along the pairs is each pair's slot in its expert.

    Part: core.
    """
    ### BEGIN SOLUTION
    if capacity is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    n, k = chosen.shape
    onehot = F.one_hot(chosen, n_experts).view(groups, n // groups, k, n_experts)  # [G, N/G, k, E]
    # [G, k·N/G, E]: all first choices, then all second choices, ...
    onehot = onehot.transpose(1, 2).reshape(groups, k * n // groups, n_experts)
    slot = onehot.cumsum(dim=1) - 1  # [G, k·N/G, E]
    keep = ((slot < capacity) & (onehot > 0)).any(dim=-1)  # [G, k·N/G]
    return keep.view(groups, k, n // groups).transpose(1, 2).reshape(n, k)  # [N, k]
    ### END SOLUTION


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Switch's auxiliary loss E·sum_e f_e·P_e, per group of the N tokens, averaged over the groups.

    probs: [N, E]; chosen: [N, k]. f_e: the share of a group's k·N/G pairs that chose e, before
    dropping (a count: no gradient); P_e: the group's mean of probs[:, e] (the gradient flows here).
    1.0 when balanced.

    Part: core.
    """
    ### BEGIN SOLUTION
    e = probs.shape[-1]
    f = F.one_hot(chosen, e).to(probs.dtype).view(groups, -1, e).mean(dim=1)  # [G, E]
    p = probs.view(groups, -1, e).mean(dim=1)  # [G, E]
    return (e * (f * p).sum(dim=-1)).mean()
    ### END SOLUTION


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)², for logits [N, E].

    Part: core.
    """
    ### BEGIN SOLUTION
    return torch.logsumexp(logits, dim=-1).pow(2).mean()
    ### END SOLUTION


# --- dispatch and combine on one process ---
def sort_by_expert(
    chosen: torch.Tensor, keep: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept pairs ordered by expert: ``(order, counts)``.

    order: [M] indices into the N·k pairs (pair i is token i // k, choice i % k), kept pairs only,
    sorted by expert, ties in pair order (a stable sort), so every expert sees its tokens in token
    order. counts: [E] kept pairs per expert.

    Part: core.
    """
    ### BEGIN SOLUTION
    # [N·k]; a dropped pair goes to expert E, sorted last
    flat = chosen.flatten().masked_fill(~keep.flatten(), n_experts)
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]
    order = torch.argsort(flat, stable=True)[: int(counts.sum())]
    return order, counts
    ### END SOLUTION


def run_experts(
    rows: torch.Tensor, counts: torch.Tensor, experts: Iterable[nn.Module]
) -> torch.Tensor:
    """Expert i on the next counts[i] rows: rows [M, H] grouped by expert -> [M, H]."""
    chunks = rows.split(counts.tolist())
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' outputs back in pair order, each token's k summed with the router's weights.

    rows: [M, H] in ``order`` (from :func:`sort_by_expert`); weights: [N, k]. Returns [N, H];
    a dropped pair contributes zero.

    Part: core.
    """
    ### BEGIN SOLUTION
    n, k = weights.shape
    out = rows.new_zeros(n * k, rows.shape[-1]).index_copy(0, order, rows)  # [N·k, H]
    return (weights.unsqueeze(-1) * out.view(n, k, -1)).sum(dim=1)  # [N, H]
    ### END SOLUTION


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward on one process: a drop-in for the course model's ``MLP``.

    ``router``: Linear(H, E); ``experts[str(e)]``: SwiGLU MLPs with the course model's dims
    (``experts``: the ids held, all E by default). The B·T tokens of a forward form ``groups``
    contiguous groups (capacity and the aux loss per group). Each forward leaves ``aux_loss`` (the
    coefficient-weighted load-balancing + z-loss, with gradient) and ``routing`` (``chosen`` and
    ``keep``, detached).
    """

    def __init__(
        self, cfg: ModelConfig, moe: MoEConfig, *, groups: int = 1, experts: range | None = None
    ):
        super().__init__()
        self.cfg = cfg
        self.moe = moe
        self.groups = groups
        self.router = nn.Linear(cfg.n_embd, moe.n_experts, bias=False)
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg) for e in (range(moe.n_experts) if experts is None else experts)}
        )
        self.aux_loss = None
        self.routing = None

    def capacity(self, tokens: int) -> int | None:
        """Pairs one expert accepts from a group of ``tokens`` tokens (None: no limit)."""
        cf = self.moe.capacity_factor
        if cf is None:
            return None
        return expert_capacity(tokens, self.moe.top_k, self.moe.n_experts, cf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]: route, drop what exceeds capacity, run the experts,
        combine."""
        tokens = x.reshape(-1, x.shape[-1])  # [N, H]
        check_divides(tokens.shape[0], "tokens", self.groups, "groups")
        # logits, probs [N, E]; weights, chosen [N, k]
        logits, probs, weights, chosen = route(tokens, self.router, self.moe.top_k)
        capacity = self.capacity(tokens.shape[0] // self.groups)
        keep = capacity_keep(chosen, self.moe.n_experts, capacity, self.groups)  # [N, k]
        out = self.experts_forward(tokens, weights, chosen, keep)  # [N, H]
        balance = self.moe.aux_loss_coef * load_balancing_loss(probs, chosen, self.groups)
        z_loss = self.moe.z_loss_coef * router_z_loss(logits)
        self.aux_loss = balance + z_loss
        self.routing = {"chosen": chosen.detach(), "keep": keep.detach()}
        return out.view(x.shape)

    def experts_forward(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Every kept pair's token through its expert, combined: tokens [N, H] -> [N, H]."""
        order, counts = sort_by_expert(chosen, keep, self.moe.n_experts)  # [M], [E]
        rows = tokens[order // self.moe.top_k]  # [M, H] by expert
        return combine(run_experts(rows, counts, self.experts.values()), order, weights)


# --- expert parallelism ---
class AllToAll(torch.autograd.Function):
    """fwd: all_to_all_single of rows, ``send[i]`` rows to rank i, ``recv[i]`` from it; bwd: the
    reverse all-to-all of the gradients (splits swapped). Megatron's ``_AllToAll``
    (core/tensor_parallel/mappings.py)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        rows: torch.Tensor,
        send: list[int],
        recv: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """rows: [sum(send), H] -> [sum(recv), H], in source-rank order.

        Part: core.
        """
        ### BEGIN SOLUTION
        ctx.send = send
        ctx.recv = recv
        ctx.group = group
        out = rows.new_empty(sum(recv), rows.shape[-1])  # [sum(recv), H]
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """grad: [sum(recv), H] -> [sum(send), H].

        Part: core.
        """
        ### BEGIN SOLUTION
        out = grad.new_empty(sum(ctx.send), grad.shape[-1])  # [sum(send), H]
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None
        ### END SOLUTION


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The counts go first: ``send`` [ep, E/ep] (rows I route to each rank's local experts) becomes
    ``recv`` [ep, E/ep] (rows each rank routes to my experts). One all_to_all_single, E/ep int64 per
    rank.

    Part: core.
    """
    ### BEGIN SOLUTION
    recv = torch.empty_like(send)  # [ep, E/ep]
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv
    ### END SOLUTION


class ExpertParallelMoE(MoELayer):
    """The MoE layer with its experts spread over the ``ep`` ranks of ``group``: E/ep each, as
    ``experts[str(global id)]`` (so parameter names match the single-process layer's). The router is
    replicated; this rank's tokens are one group. Expert parameters are tagged
    ``expert_parallel``."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, group: dist.ProcessGroup | None = None):
        ep = dist.get_world_size(group)
        check_divides(moe.n_experts, "n_experts", ep, "ep")
        local = moe.n_experts // ep
        first = dist.get_rank(group) * local
        super().__init__(cfg, moe, groups=1, experts=range(first, first + local))
        self.group = group
        self.ep = ep
        self.local = local
        for p in self.experts.parameters():
            p.expert_parallel = True  # averaged over the expert-DP group only (allreduce_gradients)

    @classmethod
    def from_full(
        cls, layer: MoELayer, *, group: dist.ProcessGroup | None = None
    ) -> ExpertParallelMoE:
        """This rank's share of a single-process layer: the router and this rank's experts,
        copied."""
        ep_layer = cls(layer.cfg, layer.moe, group=group).to(layer.router.weight.device)
        ep_layer.router.load_state_dict(layer.router.state_dict())
        for name, expert in ep_layer.experts.items():
            expert.load_state_dict(layer.experts[name].state_dict())
        return ep_layer

    def experts_forward(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Send each kept pair's token to the rank holding its expert, run the local experts, bring
        the outputs back and combine them: tokens [N, H] -> [N, H].

        1. ``sort_by_expert``: rows [M, H] by expert, hence by destination rank (experts sit in
           blocks);
        2. ``exchange_counts`` of ``counts.view(ep, E/ep)``, then ``AllToAll`` the rows (uneven
           splits);
        3. regroup the received rows by local expert (stable: by source rank, then token order),
           ``run_experts``, and undo the regrouping;
        4. ``AllToAll`` back (splits swapped) and ``combine``.

        Part: core.
        """
        ### BEGIN SOLUTION
        order, counts = sort_by_expert(chosen, keep, self.moe.n_experts)  # [M], [E]
        rows = tokens[order // self.moe.top_k]  # [M, H] by destination
        send = counts.view(self.ep, self.local)  # [ep, E/ep]
        recv = exchange_counts(send, self.group)  # [ep, E/ep]
        to_ranks = send.sum(dim=1).tolist()
        from_ranks = recv.sum(dim=1).tolist()
        # [M_in, H] by (source, expert)
        received = AllToAll.apply(rows, to_ranks, from_ranks, self.group)
        local_expert = torch.arange(self.local, device=rows.device).repeat(self.ep)  # [ep·E/ep]
        # [M_in]: the received rows regrouped by local expert
        by_expert = torch.argsort(local_expert.repeat_interleave(recv.flatten()), stable=True)
        # [M_in, H] by expert
        out = run_experts(received[by_expert], recv.sum(dim=0), self.experts.values())
        out = out[torch.argsort(by_expert)]  # [M_in, H] by (source, expert)
        returned = AllToAll.apply(out, from_ranks, to_ranks, self.group)  # [M, H] in ``order``
        return combine(returned, order, weights)
        ### END SOLUTION


def allreduce_gradients(
    model: nn.Module,
    *,
    expert_dp_group: dist.ProcessGroup | None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """EP × DP after backward: every gradient summed over the ranks holding that parameter, then
    divided by the world size of ``group`` (the data-parallel ranks); in place.

    Expert parameters (``p.expert_parallel``) are summed over ``expert_dp_group`` (ranks with the
    same experts), everything else over ``group``. One division fits both: each rank's loss is a
    mean over its tokens, and the all-to-all backward already brought the EP group's tokens into
    each expert's gradient.

    Part: core.
    """
    ### BEGIN SOLUTION
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(p.grad, group=expert_dp_group)
        else:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)
    ### END SOLUTION
