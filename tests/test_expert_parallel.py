"""Exercise 07: the MoE layer equals transformers' Mixtral block; expert parallelism (EP = 2, 4; EP
× DP) equals the single-process layer and model in outputs, drops, router and expert gradients and
losses; the ledger's all-to-all bytes equal the routing's rows × H × 4; bad settings are clear
errors."""

import pytest
import torch

from labs import launch
from labs.experiments import moe as experiment
from labs.experiments.common import SUMMARY_KEYS
from labs.models import ModelConfig
from labs.models.moe import MoEConfig, ReferenceMoELayer, build_moe_model, keep_within_capacity
from labs.models.transformer import init_weights
from labs.runtime import RankError, exercise
from labs.theory.moe import MoESpec, moe_param_counts
from labs.train import rule
from tests.helpers import checks_ok, in_child, lab_json, run_lab_main

TOL = rule("value", torch.float32).rel  # 1e-5: fp32 sums split across ranks add in another order
exercise_test = pytest.mark.exercise


def _layer(moe, seed=0, **kw):
    return init_weights(exercise("expert_parallel").MoELayer(experiment.LAYER_CFG, moe, **kw), seed)


@exercise_test
@pytest.mark.parametrize("n_experts", [4, 8])
def test_moe_layer_equals_transformers_mixtral_block(n_experts):
    """Top-2, renormalised weights, no capacity: our layer is Mixtral's sparse MoE block, our
    load-balancing loss times k is transformers' ``load_balancing_loss_func`` (it counts k pairs per
    token), and the z-loss is its formula in float64."""
    r = in_child(experiment.mixtral_check, n_experts=n_experts)
    assert r["max_rel_output_diff"] <= TOL, r["max_rel_output_diff"]
    assert r["aux_loss_times_k"] == pytest.approx(r["hf_aux_loss"], rel=1e-6)
    assert r["z_loss"] == pytest.approx(r["z_loss_formula"], rel=1e-6)


def capacity_case(chosen):
    """The learner's keep masks, expert order and counts, and a layer's output with its drops."""
    xp = exercise("expert_parallel")
    keep = xp.capacity_keep(chosen, 3, 2)
    order, counts = xp.sort_by_expert(chosen, keep, 3)
    layer = _layer(MoEConfig(n_experts=4, top_k=1, capacity_factor=0.25))  # capacity 1 of 16 tokens
    y = layer(torch.randn(1, 16, experiment.LAYER_CFG.n_embd))
    return {
        "keep": keep.tolist(),
        "keep in groups": xp.capacity_keep(chosen, 3, 1, groups=2).tolist(),
        "keep all": bool(xp.capacity_keep(chosen, 3, None).all()),
        "order": order.tolist(),
        "counts": counts.tolist(),
        "y": y.detach(),
        "dropped": ~layer.routing["keep"][:, 0],
    }


@exercise_test
def test_capacity_priority_drops_and_residual_pass_through():
    """E=3, capacity 2: first choices fill the experts in token order, then second choices;
    a token with every choice dropped leaves the layer as exactly zero (its residual carries it)."""
    r = in_child(capacity_case, torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]]))
    assert r["keep"] == [[True, True], [True, True], [False, False], [True, False]]
    # Two groups of two tokens, capacity 1 each: the groups decide independently.
    assert r["keep in groups"] == [
        [True, True],
        [False, True],
        [True, False],
        [True, False],
    ]
    assert r["keep all"]
    assert r["counts"] == [2, 2, 1] and r["order"] == [0, 2, 1, 6, 3]
    y, dropped = r["y"], r["dropped"]
    assert dropped.sum() >= 12 and (y[0][dropped] == 0).all() and (y[0][~dropped] != 0).any()


def router_gradient():
    layer = _layer(MoEConfig(n_experts=4, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0))
    layer(torch.randn(2, 8, experiment.LAYER_CFG.n_embd)).pow(2).sum().backward()
    return float(layer.router.weight.grad.abs().max())


@exercise_test
def test_switch_top1_router_learns_from_the_loss_alone():
    """k = 1 weighs by the raw probability, so the router gets a gradient without any aux loss."""
    assert in_child(router_gradient) > 0


@exercise_test
@pytest.mark.parametrize(
    "ep, nproc, top_k, capacity_factor",
    [
        (2, 2, 2, None),
        (2, 2, 1, 0.5),
        (2, 2, 2, 1.0),
        (4, 4, 2, None),
        (4, 4, 1, 1.0),
        (4, 4, 2, 0.75),
        (2, 4, 2, 0.75),  # EP × DP: two EP groups of two ranks
    ],
)
def test_expert_parallel_layer_equals_single_process(ep, nproc, top_k, capacity_factor):
    r = in_child(
        experiment.layer_check, ep=ep, nproc=nproc, top_k=top_k, capacity_factor=capacity_factor
    )
    assert r["max_rel_output_diff"] <= TOL, r["max_rel_output_diff"]
    assert r["max_rel_input_grad_diff"] <= TOL, r["max_rel_input_grad_diff"]
    assert r["max_rel_grad_diff"] <= TOL, r["max_rel_grad_diff"]
    assert r["max_rel_router_grad_diff"] <= TOL, r["max_rel_router_grad_diff"]
    assert r["aux_loss"] == pytest.approx(r["reference_aux_loss"], rel=TOL)
    assert r["same_drops"], (
        "the EP layer dropped other (token, choice) pairs than the single-process layer"
    )
    if capacity_factor is not None:
        assert r["dropped_pairs"] > 0, "this setting is meant to drop pairs"
    assert r["experts_per_rank"][1] == [str(e) for e in range(8 // ep, 2 * 8 // ep)]
    assert r["a2a_bytes_per_rank"] == r["theory_a2a_bytes_per_rank"]
    assert r["matches_reference"] and all(c.ok for c in r["checks"]), [
        c for c in r["checks"] if not c.ok
    ]


@exercise_test
@pytest.mark.parametrize(
    "nproc, ep, top_k, capacity_factor", [(2, 2, 2, 1.0), (4, 4, 1, None), (4, 2, 2, 0.75)]
)
def test_moe_model_trains_like_the_reference(nproc, ep, top_k, capacity_factor):
    s = in_child(
        experiment.run, nproc=nproc, ep=ep, steps=5, top_k=top_k, capacity_factor=capacity_factor
    )
    assert s["matches_reference"], (s["losses"], s["reference_losses"])
    assert checks_ok(s, "gradients after step 1"), s["max_rel_grad_diff"]
    assert checks_ok(s, "forward all_to_all bytes per call", "backward all_to_all bytes per call")
    assert (
        s["comm_bytes_per_rank"] == s["theory_comm_bytes_per_rank"]
        and min(s["comm_bytes_per_rank"]) > 0
    )
    assert all(
        b == pytest.approx(s["theory_grad_sync_bytes"], rel=1e-9)
        for b in s["grad_sync_bytes_per_rank"]
    )
    assert s["state_bytes_per_rank"] == [s["theory_state_bytes_per_rank"]] * nproc
    assert (
        s["params_per_rank"] == s["theory_params_per_rank"]
        and s["measured_params_total"] == s["params_total"]
    )
    if capacity_factor is not None:
        assert any(
            sum(c) < sum(k)
            for r_c, r_k in zip(s["kept_per_expert"], s["chosen_per_expert"])
            for c, k in zip(r_c, r_k)
        ), "expected some drops"


@exercise_test
def test_active_parameters_are_those_one_token_touches():
    """Measured: after one token's forward and backward, the parameters of a block with a nonzero
    gradient are its attention, norms, router and k experts: the theory's active count per layer.
    (A one-token sequence attends only to itself, so the softmax is 1 and q_proj, k_proj get no
    gradient although the token uses them: they are counted in by name.)"""
    cfg = ModelConfig(n_layer=2)
    moe = MoEConfig(n_experts=8, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)
    spec = MoESpec(experiment.model_spec(cfg, moe).dense, 8, 2)
    per_layer = moe_param_counts(spec)["per_layer_active"]
    for touched, experts in in_child(touched_per_block, cfg, moe):
        assert touched == per_layer and experts == 2


def touched_per_block(cfg, moe):
    """Per block of the learner's MoE model after one token's step: parameters with a gradient
    (q_proj and k_proj counted in by name) and experts with a gradient."""
    model = build_moe_model(cfg, moe, layer=exercise("expert_parallel").MoELayer, seed=1)
    model(torch.tensor([[65]]), torch.tensor([[66]]))[1].backward()
    rows = []
    for block in model.layers:
        touched = sum(
            p.numel()
            for n, p in block.named_parameters()
            if n in ("attn.q_proj.weight", "attn.k_proj.weight") or p.grad.abs().max() > 0
        )
        experts = {
            n.split(".")[2]
            for n, p in block.named_parameters()
            if n.startswith("mlp.experts.") and p.grad.abs().max() > 0
        }
        rows.append((touched, len(experts)))
    return rows


def _build_ep_layer(n_experts):
    exercise("expert_parallel").ExpertParallelMoE(
        experiment.LAYER_CFG, MoEConfig(n_experts=n_experts)
    )


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="top_k=9 is larger than n_experts=8"):
        MoEConfig(n_experts=8, top_k=9)
    for cf in (0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            MoEConfig(capacity_factor=cf)
    # only the degrees that divide n_experts and the 4 ranks: ep=3 would fail in turn
    with pytest.raises(
        ValueError,
        match=r"n_experts=6 is not divisible by ep=4; use ep in \{1,2\} \(those that also divide "
        r"dp\*cp=4\) or change n_experts",
    ):
        experiment.run(nproc=4, ep=4, experts=6)  # before any rank starts
    with pytest.raises(ValueError, match="ep=3 must divide"):
        experiment.layer_check(ep=3, nproc=4)
    with pytest.raises(RankError, match="n_experts=6 is not divisible by ep=4") as info:
        launch(_build_ep_layer, 4, 6)  # inside a rank, before any collective
    assert info.value.exc_type == "ValueError"


def test_cli_rejects_bad_settings_in_one_line():
    code, _, err = run_lab_main("moe", "--nproc", "4", "--ep", "4", "--experts", "6")
    assert code == 2 and "n_experts=6" in err, err
    assert len(err.strip().splitlines()) == 1, err


@exercise_test
def test_cli_json():
    s = lab_json("moe", "--nproc", "2", "--steps", "3", "--top-k", "1", "--json")
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["lab"] == "moe" and s["matches_reference"] and s["passed"] and s["ep"] == 2


def test_the_reference_layer_keeps_pairs_by_gshards_priority():
    """The reference's capacity rule (``labs.models.moe.keep_within_capacity``, written apart from
    the exercise) on the example above; keeping pairs token by token gives another answer, which
    the lab's capacity check names."""
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert keep_within_capacity(chosen, 3, 2).tolist() == [
        [True, True],
        [True, True],
        [False, False],
        [True, False],
    ]
    assert keep_within_capacity(chosen, 3, 1, groups=2).tolist() == [
        [True, True],
        [False, True],
        [True, False],
        [True, False],
    ]
    assert keep_within_capacity(chosen, 3, None).all()
    token_by_token = experiment.keep_token_by_token(chosen, 3, 2)
    assert token_by_token.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    routing = [[{"chosen": chosen, "keep": token_by_token}]]
    check = experiment.capacity_rule_check(routing, 3, 2)
    assert not check.ok and "kept token by token" in check.hint
    routing = [[{"chosen": chosen, "keep": keep_within_capacity(chosen, 3, 2)}]]
    assert experiment.capacity_rule_check(routing, 3, 2).ok
    routing = [[{"chosen": chosen, "keep": torch.ones_like(chosen, dtype=torch.bool)}]]
    assert (
        "kept 4 pairs where its capacity is C = 2"
        in experiment.capacity_rule_check(routing, 3, 2).hint
    )


def layer_against_reference(top_k, capacity_factor, groups) -> dict:
    """In a child: the learner's ``MoELayer`` and ``ReferenceMoELayer`` from the same seed, one
    forward and backward each on the same batch; what the test compares."""
    moe = MoEConfig(n_experts=8, top_k=top_k, capacity_factor=capacity_factor)
    ours = _layer(moe, groups=groups)
    ref = init_weights(ReferenceMoELayer(experiment.LAYER_CFG, moe, groups=groups), 0)
    names = [[n for n, _ in layer.named_parameters()] for layer in (ours, ref)]
    x = torch.randn(
        groups, 32, experiment.LAYER_CFG.n_embd, generator=torch.Generator().manual_seed(1)
    )
    outputs = []
    for layer in (ours, ref):
        with torch.no_grad():
            layer.router.weight.mul_(5)  # confident routing: real drops
        y = layer(x)
        (y.pow(2).sum() + layer.aux_loss).backward()
        outputs.append(y.detach())
    return {
        "names": names,
        "same_keep": torch.equal(ours.routing["keep"], ref.routing["keep"]),
        "reference_dropped": not ref.routing["keep"].all().item(),
        "output_diff": (outputs[0] - outputs[1]).abs().max().item(),
        "output_scale": outputs[1].abs().max().item(),
        "aux_losses": (ours.aux_loss.item(), ref.aux_loss.item()),
        "grads": [
            (name, (p.grad - q.grad).abs().max().item(), q.grad.abs().max().item())
            for (name, p), q in zip(ours.named_parameters(), ref.parameters())
        ],
    }


@exercise_test
@pytest.mark.parametrize("top_k, capacity_factor, groups", [(2, None, 1), (2, 1.0, 2), (1, 0.5, 4)])
def test_the_layer_equals_the_reference_layer(top_k, capacity_factor, groups):
    """Your ``MoELayer`` against the reference the MoE runs are checked with
    (``ReferenceMoELayer``): the same weights from the same seed (the same parameter names), the
    same outputs, drops, aux loss and gradients."""
    r = in_child(layer_against_reference, top_k, capacity_factor, groups)
    assert r["names"][0] == r["names"][1]
    assert r["same_keep"]
    assert capacity_factor is None or r["reference_dropped"]
    assert r["output_diff"] <= TOL * r["output_scale"]
    ours, ref = r["aux_losses"]
    assert ours == pytest.approx(ref, rel=TOL)
    for name, diff, scale in r["grads"]:
        assert diff <= TOL * scale, name
