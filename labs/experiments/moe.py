"""Experiment 07: expert parallelism, alone and with data parallelism, against the single-process
MoE and the theory.

    check = layer_check(ep=4, top_k=2, capacity_factor=1.0)    # one MoE layer: outputs, drops,
                                                               # every gradient
    summary = run(nproc=4, ep=2, experts=8, top_k=2)           # notebook 07
    curves = balance_run(aux_loss_coefs=(0.0, 0.1), steps=30)  # load imbalance, with and without
                                                               # the aux loss
    python -m labs.run moe --nproc 4 --ep 2 --json

The reference (see ``solutions/expert_parallel.py``): on ``nproc`` data-parallel ranks, each with
its own tokens, the EP run must equal the single-process MoE on the concatenated global batch with
one routing group per rank (``groups=nproc``): capacity C = ceil(cf·k·N/E) with N a rank's tokens,
and the aux loss per group, averaged. That single-process MoE is ``labs.models.moe``'s
``ReferenceMoELayer``, written apart from the exercise (``reference_run``, ``layer_reference``):
a mistake in the learner's ``MoELayer`` cannot move the reference with it. EP groups are ``ep``
consecutive ranks; ranks holding the same experts (every ep-th rank) average the experts'
gradients (``labs.theory.moe.ep_rank_groups``).

Checks: losses of every step and gradients of the first step (router, experts, the rest) within 1e-5
relative (fp32); the pairs each rank's layers kept at step 1 against the capacity rule applied to
the pairs they chose (``keep_within_capacity``); the bytes the ledger counts in each layer's
dispatch and combine all-to-alls equal the rows the routing decisions send off the rank × H × 4;
gradient all-reduce bytes and state bytes per rank equal ``labs.theory``. PyTorch has no
expert-parallel layer to time against; the exercise's single-process layer is compared with
``transformers``' ``MixtralSparseMoeBlock`` (in the run and in the tests) instead.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from labs.data import rank_batches
from labs.experiments.checks import matches
from labs.experiments.common import RunSummary, course_spec, fill_losses, new_summary
from labs.experiments.spec import Lab, option
from labs.measure import CommLedger, state_bytes
from labs.measure.timing import StepTimer
from labs.models.moe import (
    MoEConfig,
    ReferenceMoELayer,
    build_moe_model,
    keep_within_capacity,
    swap_mlp,
)
from labs.models.transformer import ModelConfig, count_params, init_weights
from labs.runtime.device import one_thread, rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.runtime.rank import lower_gloo_loop_priority
from labs.theory import moe as theory
from labs.theory.comm import all_reduce_bytes
from labs.theory.dims import ParallelDims, check_positive
from labs.theory.memory import state_bytes as theory_state_bytes
from labs.train import TrainConfig, make_optimizer, max_rel_diff, rule, train_reference

# One MoE layer for the layer check: small enough for 4 ranks on 2 cores, big enough to route.
LAYER_CFG = ModelConfig(n_embd=32, ffn_hidden=64, n_head=4, n_kv_head=2)


def model_spec(cfg: ModelConfig, moe: MoEConfig) -> theory.MoESpec:
    """The theory's description of the course model with MoE layers."""
    return theory.MoESpec(course_spec(cfg), moe.n_experts, moe.top_k)


def check_options(*, nproc: int, ep: int, moe: MoEConfig) -> ParallelDims:
    """Validate before starting anything: ep divides nproc and the number of experts."""
    check_positive(nproc=nproc, ep=ep)
    dims = ParallelDims(dp=nproc, ep=ep)
    dims.check_model(n_experts=moe.n_experts)
    return dims


def make_groups(ep: int):
    """(this rank's EP group, this rank's expert-DP group). Every rank creates every group, in
    order."""
    rank = dist.get_rank()
    mine = {}
    for kind, groups in theory.ep_rank_groups(dist.get_world_size(), ep).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    lower_gloo_loop_priority()  # each new group has a gloo loop thread
    return mine["ep"], mine["expert_dp"]


def routing_counts(layer, n_experts: int) -> dict:
    """Pairs per expert from a layer's last routing, before (``chosen``) and after (``kept``)
    dropping."""
    chosen = layer.routing["chosen"]
    keep = layer.routing["keep"]
    return {
        "chosen": torch.bincount(chosen.flatten(), minlength=n_experts).tolist(),
        "kept": torch.bincount(chosen[keep], minlength=n_experts).tolist(),
    }


def routing_of(layer) -> dict:
    """A layer's last routing, ``chosen`` and ``keep`` [N, k], on the CPU (for the parent)."""
    return {k: layer.routing[k].cpu() for k in ("chosen", "keep")}


def _a2a_total(rank_bytes: dict) -> float:
    """All of a rank's all-to-all bytes in a step: ``{"forward": [...], "backward": [...]}``."""
    return sum(rank_bytes["forward"]) + sum(rank_bytes["backward"])


def _a2a_bytes(ledger, phase):
    return [
        r.sent_bytes for r in ledger.records if r.op == "all_to_all_single" and r.phase == phase
    ]


# --- one process: the numbers, the router, the Mixtral block --------------------------------------
def param_report(
    *, experts: int = 8, top_k: int = 2, ep: int = 4, cfg: ModelConfig | None = None
) -> dict:
    """Total, active and per-EP-rank parameters of the course model with MoE layers: theory and
    measured."""
    cfg = cfg or ModelConfig()
    moe = MoEConfig(n_experts=experts, top_k=top_k)
    counts = theory.moe_param_counts(model_spec(cfg, moe), ep=ep)
    dense = theory.moe_param_counts(model_spec(cfg, MoEConfig(n_experts=1, top_k=1)))["total"]
    return {
        "dense_model": dense,
        "total": counts["total"],
        "measured_total": count_params(
            build_moe_model(cfg, moe, layer=exercise("expert_parallel").MoELayer)
        ),
        "active": counts["active"],
        "active_share": round(counts["active"] / counts["total"], 3),
        "per_rank": counts["per_rank"],
        "ep": ep,
    }


def routing_table(
    *,
    tokens: int = 8,
    experts: int = 4,
    top_k: int = 2,
    capacity_factor: float | None = 1.0,
    seed: int = 0,
) -> str:
    """One MoE layer routes ``tokens`` random tokens: each token's experts, weights and which pairs
    were kept (``x``: dropped over capacity). Returns the table as text."""
    layer = init_weights(
        exercise("expert_parallel").MoELayer(
            LAYER_CFG, MoEConfig(n_experts=experts, top_k=top_k, capacity_factor=capacity_factor)
        ),
        seed,
    )
    with torch.no_grad():
        layer.router.weight.mul_(20)  # a trained router is confident; a fresh one is nearly uniform
        x = torch.randn(
            1, tokens, LAYER_CFG.n_embd, generator=torch.Generator().manual_seed(seed + 1)
        )
        layer(x)
        _, _, weights, _ = exercise("expert_parallel").route(x[0], layer.router, top_k)
    chosen = layer.routing["chosen"].tolist()
    keep = layer.routing["keep"].tolist()
    lines = [
        f"capacity {layer.capacity(tokens)} pairs per expert"
        f" (cf={capacity_factor}, k={top_k}, E={experts}, N={tokens})",
        "token  " + "  ".join(f"choice {j}: expert (weight)" for j in range(top_k)),
    ]
    for t in range(tokens):
        cells = [
            f"e{e} ({w:.2f}){'' if k else ' x'}"
            for e, w, k in zip(chosen[t], weights[t].tolist(), keep[t])
        ]
        lines.append(f"{t:>5}  " + "  ".join(f"{c:<26}" for c in cells))
    return "\n".join(lines)


def mixtral_check(*, n_experts: int = 4, tokens: int = 30, seed: int = 0) -> dict:
    """Our single-process layer (top-2, no capacity) against ``transformers``'
    ``MixtralSparseMoeBlock`` holding the same weights: the outputs, and the load-balancing loss
    (ours x k = theirs, which counts k pairs per token)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralSparseMoeBlock,
        load_balancing_loss_func,
    )

    xp = exercise("expert_parallel")
    cfg = LAYER_CFG
    layer = init_weights(xp.MoELayer(cfg, MoEConfig(n_experts=n_experts, top_k=2)), seed)
    block = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=cfg.n_embd,
            intermediate_size=cfg.ffn_hidden,
            num_local_experts=n_experts,
            num_experts_per_tok=2,
            experts_implementation="eager",
        )
    )
    with torch.no_grad():
        layer.router.weight.mul_(30)  # confident, well-separated choices
        block.gate.weight.copy_(layer.router.weight)
        for e, expert in layer.experts.items():
            block.experts.gate_up_proj[int(e)].copy_(
                torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
            )
            block.experts.down_proj[int(e)].copy_(expert.down_proj.weight)
        x = torch.randn(1, tokens, cfg.n_embd, generator=torch.Generator().manual_seed(seed + 1))
        ours = layer(x)
        theirs = block(x)
        logits = layer.router(x[0])
    # the aux loss and its gradient with respect to the router's logits (it trains the router)
    logits = logits.detach().requires_grad_()
    aux = 2 * xp.load_balancing_loss(logits.softmax(-1), layer.routing["chosen"])
    hf_aux = load_balancing_loss_func((logits,), n_experts, 2)
    grads = [
        torch.autograd.grad(loss, logits, allow_unused=True)[0] if loss.requires_grad else None
        for loss in (aux, hf_aux)
    ]
    grads = [torch.zeros_like(logits) if g is None else g for g in grads]
    return {
        "max_rel_output_diff": max_rel_diff(ours, theirs),
        "aux_loss_times_k": aux.item(),
        "hf_aux_loss": hf_aux.item(),
        "max_rel_aux_grad_diff": max_rel_diff(grads[0], grads[1]),
        "z_loss": xp.router_z_loss(logits).item(),
        "z_loss_formula": torch.log(logits.double().exp().sum(-1)).pow(2).mean().item(),
    }


# --- one layer ------------------------------------------------------------------------------------
def _layer_inputs(cfg, world, tokens_per_rank, seed):
    g = torch.Generator().manual_seed(seed + 1)
    # [ranks, N, H]: rank r's tokens in row r
    x = torch.randn(world, tokens_per_rank, cfg.n_embd, generator=g)
    return x, torch.randn(x.shape, generator=g)


def layer_worker(
    cfg: ModelConfig, moe: MoEConfig, ep: int, tokens_per_rank: int, seed: int
) -> dict:
    xp = exercise("expert_parallel")
    rank = dist.get_rank()
    world = dist.get_world_size()
    ep_group, expert_dp = make_groups(ep)
    device = rank_device()
    layer = xp.ExpertParallelMoE.from_full(
        init_weights(xp.MoELayer(cfg, moe), seed).to(device), group=ep_group
    )
    x_all, dy_all = _layer_inputs(cfg, world, tokens_per_rank, seed)
    x = x_all[rank : rank + 1].to(device).requires_grad_()  # [1, N, H]: this rank's tokens
    with CommLedger() as ledger:
        with ledger.phase("forward"):
            y = layer(x)
            objective = (y * dy_all[rank : rank + 1].to(device)).sum() + layer.aux_loss
        with ledger.phase("backward"):
            objective.backward()
    xp.allreduce_gradients(layer, expert_dp_group=expert_dp)
    return {
        "y": y.detach()[0],
        "x_grad": x.grad[0],
        "keep": layer.routing["keep"],
        "aux": layer.aux_loss.item(),
        "grads": {n: p.grad for n, p in layer.named_parameters()},
        "experts": list(layer.experts),
        "counts": routing_counts(layer, moe.n_experts),
        "routing": [routing_of(layer)],
        "forward_a2a": _a2a_bytes(ledger, "forward"),
        "backward_a2a": _a2a_bytes(ledger, "backward"),
    }


def layer_check(
    *,
    ep: int = 2,
    nproc: int | None = None,
    experts: int = 8,
    top_k: int = 2,
    capacity_factor: float | None = None,
    tokens_per_rank: int = 64,
    seed: int = 0,
    backend: str = "auto",
    timeout: float = 120.0,
) -> dict:
    """One MoE layer on ``nproc`` ranks (EP groups of ``ep``) against the single-process layer on
    all the tokens (``groups=nproc``): outputs, input gradients, every parameter gradient, dropped
    pairs, bytes."""
    nproc = nproc or ep
    moe = MoEConfig(n_experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    check_options(nproc=nproc, ep=ep, moe=moe)
    per_rank = launch(
        layer_worker,
        nproc,
        LAYER_CFG,
        moe,
        ep,
        tokens_per_rank,
        seed,
        backend=backend,
        timeout=timeout,
    )
    ref = layer_reference(moe, nproc=nproc, tokens_per_rank=tokens_per_rank, seed=seed)
    ref_grads = ref["grads"]
    grad_diffs = [
        max(max_rel_diff(g, ref_grads[n]) for n, g in r["grads"].items()) for r in per_rank
    ]
    router_diff = max(
        max_rel_diff(r["grads"]["router.weight"], ref_grads["router.weight"]) for r in per_rank
    )
    keep_ref = ref["keep"].view(nproc, tokens_per_rank, top_k)
    result = {
        "ep": ep,
        "nproc": nproc,
        "experts": experts,
        "top_k": top_k,
        "capacity_factor": capacity_factor,
        "tokens_per_rank": tokens_per_rank,
        "capacity": ref["capacity"],
        "max_rel_output_diff": max_rel_diff(torch.stack([r["y"] for r in per_rank]), ref["y"]),
        "max_rel_input_grad_diff": max_rel_diff(
            torch.stack([r["x_grad"] for r in per_rank]), ref["x_grad"] * nproc
        ),
        "max_rel_grad_diff": max(grad_diffs),
        "max_rel_router_grad_diff": router_diff,
        "aux_loss": sum(r["aux"] for r in per_rank) / nproc,
        "reference_aux_loss": ref["aux"],
        "same_drops": all(torch.equal(r["keep"], keep_ref[i]) for i, r in enumerate(per_rank)),
        "dropped_pairs": int((~ref["keep"]).sum()),
        "pairs": ref["keep"].numel(),
        "experts_per_rank": [r["experts"] for r in per_rank],
    }
    result.update(
        _bytes_vs_theory(per_rank, [[r["counts"]] for r in per_rank], ep, experts, LAYER_CFG.n_embd)
    )
    result["checks"] = layer_checks(result, per_rank, ref_grads)
    result["matches_reference"] = matches(result["checks"], "reference")
    return result


def layer_reference(moe: MoEConfig, *, nproc: int, tokens_per_rank: int, seed: int) -> dict:
    """``layer_check``'s reference: ``ReferenceMoELayer`` (``labs.models.moe``, not the exercise's
    layer) on every rank's tokens at once, one routing group per rank, and the mean of the ranks'
    objectives. Returns ``y`` [nproc, N, H], ``x_grad``, ``grads`` (by name), ``keep`` [nproc·N,
    k], ``aux`` and ``capacity`` (a rank's)."""
    with one_thread():
        layer = init_weights(ReferenceMoELayer(LAYER_CFG, moe, groups=nproc), seed)
        x_all, dy_all = _layer_inputs(LAYER_CFG, nproc, tokens_per_rank, seed)
        x = x_all.clone().requires_grad_()
        y = layer(x)
        objective = (y * dy_all).sum() / nproc + layer.aux_loss  # the mean of the ranks'
        objective.backward()
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in layer.named_parameters()},
        "keep": layer.routing["keep"],
        "aux": layer.aux_loss.item(),
        "capacity": layer.capacity(tokens_per_rank),
    }


def layer_verdict(result: dict) -> str:
    """The verdict table of a ``layer_check`` result."""
    from labs.experiments.checks import verdict_table

    return verdict_table(result["checks"], lab=f"MoE layer, ep={result['ep']}")


def layer_checks(result: dict, per_rank: list[dict], ref_grads: dict) -> list:
    """The verdict of ``layer_check``: outputs, input gradients and every parameter's gradient on
    every rank, the dropped pairs, the all-to-alls call by call."""
    from labs.experiments.checks import Check, calls_check, ranks_check

    tol = rule("value", torch.float32, per_rank.backend).rel
    n = len(per_rank)
    grads = ranks_check(
        "parameter gradients",
        [r["grads"] for r in per_rank],
        [{k: ref_grads[k] for k in r["grads"]} for r in per_rank],
        tolerance=tol,
        what="gradients",
        world_size=n,
        hint=routing_hint,
    )
    checks = [
        Check(
            "layer outputs",
            result["max_rel_output_diff"] <= tol,
            result["max_rel_output_diff"],
            0.0,
            tol,
            where="every rank's tokens",
            hint=MOE_FORWARD_HINT.replace("at step 1", "for these tokens"),
            against="reference",
        ),
        Check(
            "input gradients",
            result["max_rel_input_grad_diff"] <= tol,
            result["max_rel_input_grad_diff"],
            0.0,
            tol,
            where="every rank's tokens",
            hint="the tokens' gradients come back through the combine and the two all-to-alls' "
            "backwards (the reverse exchange, splits swapped)",
            against="reference",
        ),
        grads,
        Check(
            "same pairs dropped as the single-process layer",
            result["same_drops"],
            result["dropped_pairs"],
            "the reference's",
            where=f"capacity {result['capacity']}",
            hint="capacity is decided per group (a rank's tokens): every first choice in token "
            "order before any second choice, at most C pairs per expert",
            against="reference",
        ),
        capacity_rule_check(
            [r["routing"] for r in per_rank], result["experts"], result["capacity"]
        ),
    ]
    for phase in ("forward", "backward"):
        checks.append(
            calls_check(
                f"{phase} all_to_all bytes per call",
                [m[phase] for m in result["a2a_bytes_per_rank"]],
                [t[phase] for t in result["theory_a2a_bytes_per_rank"]],
                world_size=n,
                count_hint=A2A_COUNT_HINT,
                hint=A2A_HINT,
            )
        )
    return checks


def _bytes_vs_theory(per_rank, counts, ep, experts, hidden) -> dict:
    """Ledger vs theory per rank: the forward all-to-alls, layer by layer, are [counts, dispatch,
    combine]; the backward ones, last layer first, are combine's gradient (sent the way dispatch
    went, so dispatch's bytes) then dispatch's gradient (combine's bytes). ``counts[rank][layer]``
    comes from the routing."""
    measured = []
    predicted = []
    for rank, r in enumerate(per_rank):
        first = rank - rank % ep  # this rank's EP group: ranks first .. first+ep-1
        expected = []
        for layer in range(len(counts[rank])):
            rows = theory.rows_between_ranks(
                [counts[s][layer]["kept"] for s in range(first, first + ep)]
            )
            b = theory.all_to_all_bytes(rows, rank % ep, hidden, 4)
            expected.append(
                [theory.counts_exchange_bytes(experts, ep), b["dispatch"], b["combine"]]
            )
        backward = [[dispatch, combine] for _, dispatch, combine in reversed(expected)]
        measured.append({"forward": r["forward_a2a"], "backward": r["backward_a2a"]})
        predicted.append(
            {
                "forward": [x for b in expected for x in b],
                "backward": [x for b in backward for x in b],
            }
        )
    return {"a2a_bytes_per_rank": measured, "theory_a2a_bytes_per_rank": predicted}


def bytes_table(result: dict) -> str:
    """Per rank and MoE layer, the forward all-to-alls: bytes the ledger counted vs the routing's
    figure (from ``layer_check`` or ``run``), and what uniform routing would send on average."""
    lines = ["rank  layer  counts     dispatch: ledger / theory     combine: ledger / theory"]
    for rank, (m, t) in enumerate(
        zip(result["a2a_bytes_per_rank"], result["theory_a2a_bytes_per_rank"])
    ):
        for layer in range(len(m["forward"]) // 3):
            c, d, b = m["forward"][3 * layer : 3 * layer + 3]
            _, td, tb = t["forward"][3 * layer : 3 * layer + 3]
            lines.append(
                f"{rank:>4}  {layer:>5}  {c:>6.0f}  {d:>12.0f} / {td:<12}  {b:>12.0f} / {tb:<12}"
            )
    return "\n".join(lines)


# --- training the course model with MoE layers ----------------------------------------------------
def train_worker(cfg: ModelConfig, moe: MoEConfig, train: TrainConfig, ep: int) -> dict:
    xp = exercise("expert_parallel")
    rank = dist.get_rank()
    world = dist.get_world_size()
    ep_group, expert_dp = make_groups(ep)
    device = rank_device()
    model = build_moe_model(cfg, moe, layer=xp.MoELayer, seed=train.seed, device=device)
    swap_mlp(model, lambda i, layer: xp.ExpertParallelMoE.from_full(layer, group=ep_group))
    optimizer = make_optimizer(model.parameters(), train)
    batches = rank_batches(
        steps=train.steps,
        batch_size=train.per_rank_batch(world),
        seq_len=train.seq_len,
        rank=rank,
        world_size=world,
        seed=train.data_seed,
    )
    losses = []
    out = {}
    ledger = CommLedger()
    timer = StepTimer(device)
    for step, (x, y) in enumerate(batches):
        x = x.to(device)
        y = y.to(device)
        with timer.step():
            # the first step's messages are every step's
            with ledger if step == 0 else nullcontext():
                with ledger.phase("forward"):
                    _, loss = model(x, y)
                with ledger.phase("backward"):
                    loss.backward()
                with ledger.phase("grad_sync"):
                    xp.allreduce_gradients(model, expert_dp_group=expert_dp)
            if step == 0:
                out.update(
                    grads={
                        n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()
                    },
                    grad_sync_per_call=[
                        b for b in ledger.calls_by_op("grad_sync").get("all_reduce", []) if b
                    ],
                    expected_grad_sync=[
                        b
                        for p in model.parameters()
                        for b in [
                            all_reduce_bytes(
                                p.numel() * p.element_size(),
                                world // ep if getattr(p, "expert_parallel", False) else world,
                            )
                        ]
                        if b
                    ],
                    counts=[routing_counts(layer, moe.n_experts) for layer in model.moe_layers()],
                    routing=[routing_of(layer) for layer in model.moe_layers()],
                    forward_a2a=_a2a_bytes(ledger, "forward"),
                    backward_a2a=_a2a_bytes(ledger, "backward"),
                    grad_sync_bytes=ledger.sent_bytes("all_reduce", "grad_sync"),
                    expert_param_bytes=sum(
                        p.numel() * p.element_size()
                        for p in model.parameters()
                        if getattr(p, "expert_parallel", False)
                    ),
                    other_param_bytes=sum(
                        p.numel() * p.element_size()
                        for p in model.parameters()
                        if not getattr(p, "expert_parallel", False)
                    ),
                )
            optimizer.step()
            if step == 0:  # parameters, gradients and optimizer state are all alive here
                out["state_bytes"] = state_bytes(model, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        # the reference's loss: the mean over all tokens = the mean of the ranks'
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        report_progress()
    return {
        **out,
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "step_time_s": timer.step_time(),
        "n_params": count_params(model),
    }


@dataclass(frozen=True)
class Options:
    """The MoE lab's options (``run``'s keywords, ``python -m labs.run moe``'s flags)."""

    experts: int = option(8, "experts per MoE layer (E)")
    top_k: int = option(2, "experts per token (k)")
    capacity_factor: float | None = option(
        1.25,
        "expert capacity as a multiple of an even share (> 0); 0 is rejected",
        none_flag=("--no-capacity", "no capacity: drop nothing"),
    )
    ep: int | None = option(None, "expert-parallel ranks per group (default: --nproc)")
    aux_loss_coef: float = option(1e-2, command_line=False)
    z_loss_coef: float = option(1e-3, command_line=False)
    seed: int = option(0)

    def moe(self) -> MoEConfig:
        return MoEConfig(
            n_experts=self.experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
        )

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        check_options(nproc=nproc, ep=self.ep or nproc, moe=self.moe())
        TrainConfig(steps=steps, seed=self.seed).per_rank_batch(nproc)  # the batch must split


LAB = Lab(
    name="moe",
    notebook="07_mixture_of_experts",
    exercises=("expert_parallel",),
    reference=("reference_run", "layer_reference"),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 2},
    profiled=True,
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 120.0,
    **options,
) -> RunSummary:
    """Train the course model with MoE layers on ``nproc`` ranks (default ``LAB.ranks``; EP groups
    of ``ep``, default all of them, data parallel across groups; the ``options``: ``Options``) and
    check it against the single-process reference and the theory."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    ep = o.ep or nproc
    moe = o.moe()
    cfg = ModelConfig()
    train = TrainConfig(steps=steps, seed=o.seed)
    tokens = train.per_rank_batch(nproc) * train.seq_len  # a rank's tokens
    per_rank = launch(
        train_worker,
        nproc,
        cfg,
        moe,
        train,
        ep,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc="MoE steps",
    )
    ref, n_params = reference_run(cfg, moe, train, dp=nproc)
    summary = new_summary(
        "moe",
        nproc=nproc,
        backend=per_rank.backend,
        steps=steps,
        ep=ep,
        dp=nproc,
        experts=o.experts,
        top_k=o.top_k,
        capacity_factor=o.capacity_factor,
    )
    fill_losses(summary, per_rank[0]["losses"], ref.losses)
    grad_diff = max(
        max_rel_diff(g, ref.grads[n]) if g is not None else 1.0
        for r in per_rank
        for n, g in r["grads"].items()
    )
    summary["max_rel_grad_diff"] = grad_diff
    # Bytes: all-to-alls against the routing decisions, gradient all-reduces and state against the
    # theory.
    a2a = _bytes_vs_theory(per_rank, [r["counts"] for r in per_rank], ep, o.experts, cfg.n_embd)
    counts = theory.moe_param_counts(model_spec(cfg, moe), ep=ep)
    r0 = per_rank[0]
    summary.update(a2a)
    # a step's all-to-all bytes, forward and backward, per rank
    summary["comm_bytes_per_rank"] = [_a2a_total(b) for b in a2a["a2a_bytes_per_rank"]]
    summary["theory_comm_bytes_per_rank"] = [
        _a2a_total(b) for b in a2a["theory_a2a_bytes_per_rank"]
    ]
    # 4 all-to-alls per MoE layer and step: dispatch and combine, forward and backward
    uniform = theory.expected_all_to_all_bytes(tokens, o.top_k, ep, cfg.n_embd, 4)
    summary.update(
        uniform_routing_comm_bytes=4 * cfg.n_layer * uniform,
        grad_sync_bytes_per_rank=[r["grad_sync_bytes"] for r in per_rank],
        theory_grad_sync_bytes=(
            all_reduce_bytes(r0["other_param_bytes"], nproc)
            + all_reduce_bytes(r0["expert_param_bytes"], nproc // ep)
        ),
        state_bytes_per_rank=[r["state_bytes"] for r in per_rank],
        theory_state_bytes_per_rank=theory_state_bytes(counts["per_rank"])["total_bytes"],
        params_per_rank=r0["n_params"],
        theory_params_per_rank=counts["per_rank"],
        params_total=counts["total"],
        params_active=counts["active"],
        measured_params_total=n_params,
        step_time_s=max(r["step_time_s"] for r in per_rank),
        torch_step_time_s=None,  # PyTorch ships no expert-parallel layer to time against
        tokens_per_rank=tokens,
        capacity=None
        if o.capacity_factor is None
        else theory.expert_capacity(tokens, o.top_k, o.experts, o.capacity_factor),
        chosen_per_expert=[[c["chosen"] for c in r["counts"]] for r in per_rank],
        kept_per_expert=[[c["kept"] for c in r["counts"]] for r in per_rank],
    )
    summary.add_checks(moe_checks(per_rank, ref, summary))
    summary.add_checks(layer_vs_mixtral(mixtral_check(n_experts=4, seed=o.seed)))
    return summary


def reference_run(cfg: ModelConfig, moe: MoEConfig, train: TrainConfig, *, dp: int):
    """The MoE run's reference: the course model with ``ReferenceMoELayer`` in every block (not
    the exercise's layer), one routing group per data-parallel rank, trained single-process on
    the global batches (``train_reference``). Returns (the ``ReferenceResult``, its parameter
    count)."""
    model = build_moe_model(cfg, moe, layer=ReferenceMoELayer, seed=train.seed, groups=dp)
    return train_reference(cfg, train, dp=dp, model=model, return_grads=True), count_params(model)


# --- the verdict ----------------------------------------------------------------------------------
A2A_COUNT_HINT = (
    "per MoE layer the forward runs 3 all-to-alls (the counts, the dispatch, the combine) and the "
    "backward the two token all-to-alls in reverse (AllToAll.backward)"
)
A2A_HINT = (
    "dispatch sends each kept pair's row to the rank holding its expert (rows sorted by expert, "
    "so by destination: counts.view(ep, E/ep).sum(1) rows to each rank) and combine sends the "
    "same rows back: check the splits and which pairs were kept"
)
MOE_FORWARD_HINT = (
    "the MoE forward differs at step 1: the routing (top-k experts, weights renormalised to sum "
    "to 1 when k > 1), the capacity dropping (first choices before second, at most C pairs per "
    "expert), the combine (each expert's output weighted by the router), or where the rows travel "
    "(dispatch, the regrouping by local expert and its undoing, combine)"
)


def routing_hint(name: str) -> str:
    """What a wrong gradient of ``name`` most likely means in an MoE model."""
    if name.startswith("router") or ".router." in name:
        return (
            f"the router's gradient differs ({name}): it reaches the router through the combine's"
            " weights, the load-balancing loss's P_e (the mean probabilities: f_e is a count, "
            "without gradient) and the z-loss"
        )
    if ".experts." in name:
        return (
            f"an expert's gradient differs ({name}): expert parameters are summed over the ranks "
            "holding the same experts only (expert_dp_group), everything else over all ranks, "
            "then divided by the world size"
        )
    return ""


def layer_vs_mixtral(m: dict) -> list:
    """The single-process layer's building blocks against ``transformers``' Mixtral block
    (``mixtral_check``): the EP run is compared with this very layer, so a mistake in the routing,
    the combine or the losses would be in both; this is where it shows."""
    from labs.experiments.checks import Check

    tol = rule("value", torch.float32).rel  # one process, on the CPU
    aux_diff = abs(m["aux_loss_times_k"] - m["hf_aux_loss"]) / abs(m["hf_aux_loss"])
    return [
        Check(
            "single-process layer vs Mixtral's block",
            m["max_rel_output_diff"] <= tol,
            m["max_rel_output_diff"],
            0.0,
            tol,
            where="top-2, no capacity",
            hint="the layer's output differs from transformers' MixtralSparseMoeBlock on the same "
            "weights: route (softmax, top-k, the k weights renormalised to sum to 1 when k > 1) "
            "and combine (each expert's output weighted by the router, summed per token)",
            against="reference",
        ),
        Check(
            "load-balancing loss vs Mixtral's",
            aux_diff <= tol and m["max_rel_aux_grad_diff"] <= tol,
            [aux_diff, m["max_rel_aux_grad_diff"]],
            [0.0, 0.0],
            tol,
            where="value x k, and its gradient to the router's logits",
            hint="E·Σ_e f_e·P_e per group: f_e, the share of the pairs choosing e, is a count (no "
            "gradient); P_e, the mean probability of e, carries the gradient to the router",
            against="reference",
        ),
        Check(
            "router z-loss vs its formula",
            abs(m["z_loss"] - m["z_loss_formula"]) <= tol * abs(m["z_loss_formula"]),
            m["z_loss"],
            m["z_loss_formula"],
            tol,
            hint="the mean over tokens of logsumexp(logits)², computed with logsumexp (stable)",
            against="theory",
        ),
    ]


def moe_checks(per_rank: list[dict], ref, summary: RunSummary) -> list:
    """Losses, every rank's gradients after step 1 and parameters after the last step by name
    (its own experts and the replicated rest), the all-to-alls call by call against the routing,
    the gradients' all-reduces call by call, capacity, state."""
    from labs.experiments.checks import Check, calls_check, compare_values, training_checks

    n = len(per_rank)
    ep = summary["ep"]
    checks = training_checks(
        losses=summary["losses"],
        reference_losses=ref.losses,
        grads=[r["grads"] for r in per_rank],
        reference_grads=[{k: ref.grads[k] for k in r["grads"]} for r in per_rank],
        params=[r["params"] for r in per_rank],
        reference_params=[{k: ref.params[k] for k in r["params"]} for r in per_rank],
        backend=summary["backend"],
        world_size=n,
        first_step_hint=MOE_FORWARD_HINT,
        grad_hint=routing_hint,
    )
    checks = [expert_division_diagnosis(c, per_rank, ref.grads, nproc=n, ep=ep) for c in checks]
    for phase in ("forward", "backward"):
        checks.append(
            calls_check(
                f"{phase} all_to_all bytes per call",
                [m[phase] for m in summary["a2a_bytes_per_rank"]],
                [t[phase] for t in summary["theory_a2a_bytes_per_rank"]],
                world_size=n,
                count_hint=A2A_COUNT_HINT,
                hint=A2A_HINT,
            )
        )
    checks.append(
        calls_check(
            "gradient all_reduce bytes per call",
            [sorted(r["grad_sync_per_call"]) for r in per_rank],
            [sorted(r["expected_grad_sync"]) for r in per_rank],
            world_size=n,
            count_hint="one all-reduce per parameter with a gradient: experts over the ranks "
            "holding the same experts (expert_dp_group), the rest over all ranks",
            hint="an all-reduce ran on another group than its parameter's: experts over "
            "expert_dp_group, the rest over all ranks",
        )
    )
    checks.append(
        capacity_rule_check(
            [r["routing"] for r in per_rank], summary["experts"], summary["capacity"]
        )
    )
    capacity = summary["capacity"]
    if capacity is not None:
        kept = max(k for r in summary["kept_per_expert"] for layer in r for k in layer)
        checks.append(
            Check(
                "pairs kept per expert within capacity",
                kept <= capacity,
                kept,
                capacity,
                where="the busiest expert, step 1",
                hint="an expert keeps at most C = ceil(cf·k·N/E) pairs of a group (slots 0 .. C-1"
                " in priority order): check capacity_keep's comparison",
                against="theory",
            )
        )
    checks.append(
        compare_values(
            "state bytes per rank",
            summary["state_bytes_per_rank"],
            [summary["theory_state_bytes_per_rank"]] * n,
            hint="a rank holds E/ep experts and all of the replicated rest",
        )
    )
    return checks


def keep_token_by_token(chosen: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """The classic mistake's ``keep`` [N, k]: pairs accepted token by token (token 0's k choices,
    then token 1's, ...) instead of every first choice before any second choice."""
    n, k = chosen.shape
    flat = keep_within_capacity(chosen.reshape(n * k, 1), n_experts, capacity)  # [N·k, 1]
    return flat.view(n, k)


def capacity_rule_check(routing: list[list[dict]], n_experts: int, capacity: int | None):
    """The pairs each rank's MoE layers kept at step 1 (``routing[rank][layer]``: ``chosen`` and
    ``keep`` [N, k]) against the capacity rule applied to the pairs they chose
    (``labs.models.moe.keep_within_capacity``, a rank's tokens being one group). A mismatch is
    diagnosed from the pairs themselves: kept token by token, more than C for an expert, or none
    dropped."""
    from labs.experiments.checks import Check

    name = "pairs kept by the capacity rule"
    where = "every rank and MoE layer, step 1"
    for rank, layers in enumerate(routing):
        for i, r in enumerate(layers):
            chosen, keep = r["chosen"], r["keep"]
            want = keep_within_capacity(chosen, n_experts, capacity)
            if torch.equal(keep, want):
                continue
            per_expert = torch.bincount(chosen[keep], minlength=n_experts)
            if capacity is not None and torch.equal(
                keep, keep_token_by_token(chosen, n_experts, capacity)
            ):
                hint = (
                    "the pairs were kept token by token (token 0's choices, then token 1's, ...):"
                    " capacity takes every first choice, in token order, before any second choice"
                    " (GShard's priority), so a later token's first choice beats an earlier"
                    " token's second. In capacity_keep, order the pairs choice-major (the one-hot's"
                    " [k, N] order) before the cumulative sum"
                )
            elif capacity is not None and int(per_expert.max()) > capacity:
                hint = (
                    f"an expert kept {int(per_expert.max())} pairs where its capacity is C ="
                    f" {capacity}: it keeps slots 0 .. C-1 only (check capacity_keep's comparison)"
                )
            elif bool(keep.all()):
                hint = (
                    f"every pair was kept though some expert was chosen more than C = {capacity}"
                    " times: is the capacity applied (capacity_keep, with the layer's capacity)?"
                )
            else:
                hint = (
                    "other pairs were kept than the capacity rule keeps: per group (a rank's"
                    " tokens), every first choice in token order, then every second choice, each"
                    " expert taking its first C pairs"
                )
            wrong = int((keep != want).sum())
            return Check(
                name,
                False,
                f"{wrong} pairs differ",
                "the rule's",
                where=f"rank {rank}, layer {i}, step 1, capacity {capacity}",
                hint=hint,
                against="reference",
            )
    return Check(name, True, "the rule's", "the rule's", where=where, against="reference")


def expert_division_diagnosis(check, per_rank: list[dict], ref_grads: dict, *, nproc: int, ep: int):
    """``check`` (a training check), with its hint replaced when the numbers show expert gradients
    divided by their own group's size: every expert gradient ep = world / |expert_dp_group| times
    the reference's, every other gradient right."""
    from labs.experiments.checks import tensor_scale

    if check.ok or not check.name.startswith("gradients") or nproc == 1:
        return check
    expert_scales = []
    for r in per_rank:
        for name, g in r["grads"].items():
            ref = ref_grads.get(name)
            if g is None or ref is None or not float(ref.abs().max()):
                continue
            scale, residual = tensor_scale(g, ref)
            if ".experts." in name:
                expert_scales.append((scale, residual))
            elif max_rel_diff(g, ref) > rule("value", torch.float32).rel * 10:
                return check  # something else is wrong too
    group = nproc // ep  # ranks holding the same experts
    if expert_scales and all(abs(s - ep) < 0.02 * ep and res < 1e-3 for s, res in expert_scales):
        return dataclasses.replace(
            check,
            hint=(
                f"every expert gradient is {ep}x the reference's (= world size {nproc} / the"
                f" {group} ranks of its expert_dp_group), every other gradient is right: the"
                f" experts' sums were divided by the size of the group they were summed over"
                f" ({group}) instead of the world size ({nproc}). Divide every gradient by the"
                " world size: each rank's loss is a mean over its own tokens, and the all-to-all"
                " backward already brought the EP group's tokens into each expert's gradient"
            ),
        )
    return check


# --- load balance over a short run ----------------------------------------------------------------
def balance_run(
    *,
    aux_loss_coefs=(0.0, 0.1),
    steps: int = 30,
    experts: int = 8,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    groups: int = 2,
    seed: int = 0,
) -> dict:
    """Train the MoE model single-process (``groups`` routing groups, as on that many ranks) once
    per aux-loss coefficient; per step: the imbalance (max/mean pairs per expert, worst layer and
    group), the share of pairs dropped, the loss and the pairs per expert
    (``counts[step][layer][group][e]``). Returns {coef: {"imbalance", "dropped_share", "loss",
    "counts", "capacity"}}."""
    cfg = ModelConfig()
    train = TrainConfig(steps=steps, seed=seed)
    with one_thread():
        return {
            coef: _balance_curve(
                cfg,
                train,
                groups,
                MoEConfig(
                    n_experts=experts,
                    top_k=top_k,
                    aux_loss_coef=coef,
                    capacity_factor=capacity_factor,
                ),
            )
            for coef in aux_loss_coefs
        }


def _balance_curve(cfg: ModelConfig, train: TrainConfig, groups: int, moe: MoEConfig) -> dict:
    model = build_moe_model(
        cfg, moe, layer=exercise("expert_parallel").MoELayer, seed=train.seed, groups=groups
    )
    optimizer = make_optimizer(model.parameters(), train)
    rows = {
        "imbalance": [],
        "dropped_share": [],
        "loss": [],
        "counts": [],
        "capacity": model.moe_layers()[0].capacity(train.batch_size * train.seq_len // groups),
    }
    batches = rank_batches(
        steps=train.steps, batch_size=train.batch_size, seq_len=train.seq_len, seed=train.data_seed
    )
    for x, y in tqdm(batches, desc=f"aux coef {moe.aux_loss_coef:g}", leave=False):
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_group = [
            [
                torch.bincount(
                    layer.routing["chosen"].view(groups, -1)[g], minlength=moe.n_experts
                ).tolist()
                for g in range(groups)
            ]
            for layer in model.moe_layers()
        ]  # [layer][group][e]
        keep = torch.cat([layer.routing["keep"].flatten() for layer in model.moe_layers()])
        rows["imbalance"].append(max(theory.imbalance(c) for layer in per_group for c in layer))
        rows["dropped_share"].append(1 - keep.float().mean().item())
        rows["loss"].append(loss.item())
        rows["counts"].append(per_group)
    return rows
