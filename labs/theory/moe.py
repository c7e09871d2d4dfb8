"""Mixture of experts on paper: total vs active parameters, expert capacity, all-to-all bytes.
Pure Python.

Symbols: E experts per MoE layer, k experts per token (top-k), h hidden, F an expert's
SwiGLU hidden size, L layers (every one an MoE layer), N tokens in one *group* (the tokens
one rank holds), cf the capacity factor, ep expert-parallel ranks, b bytes per element.

Parameters (Llama-style blocks whose MLP is E SwiGLU experts plus a linear router):

    per layer, total   attention + norms + h·E (router) + E · 3hF
    per layer, active  attention + norms + h·E          + k · 3hF      (what one token uses)
    model              embeddings + head + final norm + L · per layer   (both counts)
    per rank under EP  everything but the experts, plus E/ep experts per layer

Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1: h 4096, L 32, 32 heads,
8 key/value heads, F 14336, V 32000, E 8, k 2) has 46.7 B parameters and uses 12.9 B per
token: ``moe_param_counts(MIXTRAL_8X7B)``. Its name counts 8 x 7 B, but only the MLPs are
replicated; attention and embeddings are shared, hence 47 B and not 56 B.

Capacity (GShard, Lepikhin et al. 2020, §2.2; Switch Transformer, Fedus et al. 2021, §2.2):
each expert takes at most

    C = ceil(cf · k · N / E)

(token, choice) pairs per group; pairs beyond its C-th are *dropped* (the token's residual
passes through unchanged). An expert chosen n_e times drops max(0, n_e - C) of them.

All-to-all bytes for one MoE layer's forward, per rank r, in one direction: the rows that
leave the rank. With rows(s -> d) the kept (token, choice) pairs rank s routes to experts
on rank d (measured from the routing decisions):

    dispatch  sum_{d != r} rows(r -> d) · h · b       (my tokens to other ranks' experts)
    combine   sum_{s != r} rows(s -> r) · h · b       (their tokens back from my experts)

and with uniform routing and no drops, on average N·k·(ep-1)/ep · h · b each. Backward
sends the same again (the gradients travel the reverse way). A first all-to-all of the
counts, ep·(E/ep) int64 per rank (8·(ep-1)·E/ep bytes leave it), tells every rank how many
rows to expect.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from labs.theory.dims import check_divides, check_positive
from labs.theory.model import ModelSpec, param_counts


def check_top_k(top_k: int, n_experts: int) -> None:
    """Raise unless a token can pick ``top_k`` distinct experts of ``n_experts``."""
    if top_k > n_experts:
        choices = ",".join(map(str, range(1, n_experts + 1)))
        raise ValueError(
            f"top_k={top_k} is larger than n_experts={n_experts}: a token cannot pick more"
            f" experts than exist; use top_k in {{{choices}}}"
        )


def check_capacity_factor(capacity_factor: float | None) -> None:
    """None means no capacity (nothing dropped); otherwise a number > 0."""
    if capacity_factor is None:
        return
    is_number = isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
    if not is_number or not capacity_factor > 0:
        raise ValueError(
            "capacity_factor must be > 0 (1.0 = an even share per expert) or None for no"
            f" dropping, got {capacity_factor!r}"
        )


@dataclass(frozen=True)
class MoESpec:
    """A Llama-style model whose every MLP is ``n_experts`` SwiGLU experts (``dense.ffn`` wide
    each)."""

    dense: ModelSpec
    n_experts: int = 8
    top_k: int = 2

    def __post_init__(self):
        check_positive(n_experts=self.n_experts, top_k=self.top_k)
        check_top_k(self.top_k, self.n_experts)
        if self.dense.arch != "llama":
            raise ValueError(
                f"dense.arch={self.dense.arch!r}: MoESpec counts SwiGLU experts; use arch='llama'"
            )


# Mixtral 8x7B's published configuration (config.json of mistralai/Mixtral-8x7B-v0.1).
MIXTRAL_8X7B = MoESpec(
    ModelSpec(
        vocab_size=32000, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336
    ),
    n_experts=8,
    top_k=2,
)


def moe_param_counts(spec: MoESpec, ep: int = 1) -> dict[str, int]:
    """``total``, ``active`` (per token), ``expert`` (one expert), ``router`` (one layer),
    ``per_layer_total``, ``per_layer_active`` and ``per_rank`` (held by one of ``ep`` ranks)."""
    check_positive(ep=ep)
    check_divides(spec.n_experts, "n_experts", ep, "ep")
    dense = param_counts(spec.dense)  # one MLP per layer: the size of one expert
    expert = dense["mlp"]
    router = spec.dense.hidden * spec.n_experts
    shared = dense["attention"] + dense["norms"] + router
    outside = dense["embedding"] + dense["final_norm"] + dense["head"]
    L = spec.dense.n_layers
    per_layer_total = shared + spec.n_experts * expert
    per_layer_active = shared + spec.top_k * expert
    return {
        "expert": expert,
        "router": router,
        "per_layer_total": per_layer_total,
        "per_layer_active": per_layer_active,
        "total": outside + L * per_layer_total,
        "active": outside + L * per_layer_active,
        "per_rank": outside + L * (shared + spec.n_experts // ep * expert),
    }


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int:
    """C = ceil(cf · k · N / E): the (token, choice) pairs one expert accepts from a group of N
    tokens."""
    check_positive(tokens=tokens, top_k=top_k, n_experts=n_experts)
    check_top_k(top_k, n_experts)
    check_capacity_factor(capacity_factor)
    if capacity_factor is None:
        raise ValueError("capacity_factor=None has no capacity: every pair is kept")
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


def dropped_pairs(counts: list[int], capacity: int | None) -> int:
    """(token, choice) pairs dropped in one group whose experts were chosen ``counts[e]`` times."""
    return 0 if capacity is None else sum(max(0, n - capacity) for n in counts)


def imbalance(counts: list[int]) -> float:
    """max / mean of the load per expert: 1.0 is perfectly balanced, E means one expert takes
    all."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 1.0


def ep_rank_groups(world_size: int, ep: int) -> dict[str, list[list[int]]]:
    """Ranks that exchange tokens (``ep``: consecutive ranks, like a TP group on one node) and
    ranks that hold the same experts and average their gradients (``expert_dp``: every ep-th
    rank). Expert parallelism is carved out of the data-parallel ranks:
    world_size = ep · (world_size/ep)."""
    check_positive(world_size=world_size, ep=ep)
    check_divides(world_size, "world_size", ep, "ep")
    replicas = world_size // ep
    return {
        "ep": [[g * ep + i for i in range(ep)] for g in range(replicas)],
        "expert_dp": [[g * ep + i for g in range(replicas)] for i in range(ep)],
    }


def rows_between_ranks(kept_per_expert: list[list[int]]) -> list[list[int]]:
    """rows[s][d]: kept pairs rank s sends to rank d, from each EP rank's kept pairs per expert
    (``kept_per_expert[s][e]``; experts are placed in contiguous blocks of E/ep per rank)."""
    ep = len(kept_per_expert)
    n_experts = len(kept_per_expert[0])
    check_divides(n_experts, "n_experts", ep, "ep")
    per = n_experts // ep
    return [[sum(row[d * per : (d + 1) * per]) for d in range(ep)] for row in kept_per_expert]


def all_to_all_bytes(
    rows: list[list[int]], rank: int, hidden: int, itemsize: int
) -> dict[str, int]:
    """Bytes ``rank`` sends in one MoE layer's forward all-to-alls of tokens: ``dispatch``,
    ``combine`` and their ``total`` (the counts go first: :func:`counts_exchange_bytes`).
    ``rows[s][d]`` as :func:`rows_between_ranks` gives."""
    ep = len(rows)
    if not 0 <= rank < ep:
        raise ValueError(f"rank={rank} is outside 0..{ep - 1}")
    row = hidden * itemsize
    dispatch = sum(rows[rank][d] for d in range(ep) if d != rank) * row
    combine = sum(rows[s][rank] for s in range(ep) if s != rank) * row
    return {"dispatch": dispatch, "combine": combine, "total": dispatch + combine}


def counts_exchange_bytes(n_experts: int, ep: int) -> int:
    """Bytes a rank sends in the all-to-all of counts: E/ep int64 to each of the ep-1 others."""
    check_divides(n_experts, "n_experts", ep, "ep")
    return 8 * (ep - 1) * (n_experts // ep)


def expected_all_to_all_bytes(
    tokens: int, top_k: int, ep: int, hidden: int, itemsize: int
) -> float:
    """Dispatch (or combine) bytes per rank with uniform routing and no drops:
    N·k·(ep-1)/ep · h · b."""
    check_positive(tokens=tokens, top_k=top_k, ep=ep, hidden=hidden, itemsize=itemsize)
    return tokens * top_k * (ep - 1) / ep * hidden * itemsize


def synthetic_routing(
    *, tokens: int, n_experts: int, top_k: int, ranks: int = 1, skew: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """A router to play with: each rank's ``tokens`` tokens pick ``top_k`` distinct experts,
    expert e with weight exp(-skew · e / E) (skew 0: uniform). Returns ``counts[rank][e]`` (pairs
    before dropping)."""
    check_positive(tokens=tokens, n_experts=n_experts, top_k=top_k, ranks=ranks)
    check_top_k(top_k, n_experts)
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    rng = random.Random(seed)
    logits = [-skew * e / n_experts for e in range(n_experts)]
    counts = []
    for _ in range(ranks):
        row = [0] * n_experts
        for _ in range(tokens):
            # Gumbel top-k: sampling k experts without replacement in proportion to exp(logit).
            keys = sorted(
                range(n_experts),
                key=lambda e: logits[e] - math.log(-math.log(rng.random() or 1e-300)),
                reverse=True,
            )
            for e in keys[:top_k]:
                row[e] += 1
        counts.append(row)
    return counts


def capacity_sweep(
    counts: list[list[int]], tokens: int, top_k: int, factors: list[float]
) -> list[dict]:
    """Share of pairs dropped at each capacity factor, for per-group counts ``counts[g][e]``."""
    n_experts = len(counts[0])
    pairs = sum(map(sum, counts))
    out = []
    for cf in factors:
        c = expert_capacity(tokens, top_k, n_experts, cf)
        dropped = sum(dropped_pairs(row, c) for row in counts)
        out.append(
            {
                "capacity_factor": cf,
                "capacity": c,
                "dropped": dropped,
                "dropped_share": dropped / pairs,
            }
        )
    return out


def param_summary(spec: MoESpec, *, ep: int = 1) -> dict:
    """``moe_param_counts`` with the active share and ``ep`` (``python -m labs.theory moe``)."""
    counts = moe_param_counts(spec, ep=ep)
    return {**counts, "active_share": counts["active"] / counts["total"], "ep": ep}


def format_result(r: dict) -> str:
    """``param_summary``'s result as one sentence."""
    return (
        f"{r['total'] / 1e9:.2f} B parameters in all, {r['active'] / 1e9:.2f} B active per token"
        f" ({100 * r['active_share']:.0f}%); {r['per_rank'] / 1e9:.2f} B per rank"
        f" with ep={r['ep']}"
    )
