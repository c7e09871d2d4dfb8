"""MoE theory (labs.theory.moe): parameter counts against built models, capacity, drops, all-to-all
bytes. No processes; the formulas are checked against real modules and simulated routing."""

import pytest

from labs.theory import cli
from labs.theory import moe as theory
from labs.theory.memory import ModelSpec
from tests.helpers import assert_torch_free


def test_mixtral_8x7b_has_47b_parameters_and_13b_active():
    """The published figures (Mixtral of Experts, 2024): 46.7 B parameters, 12.9 B active."""
    counts = theory.moe_param_counts(theory.MIXTRAL_8X7B)
    assert round(counts["total"] / 1e9, 1) == 46.7
    assert round(counts["active"] / 1e9, 1) == 12.9
    # The name says 8 x 7 B = 56 B, but attention and embeddings are shared by the experts.
    dense = theory.moe_param_counts(
        theory.MoESpec(theory.MIXTRAL_8X7B.dense, n_experts=1, top_k=1)
    )["total"]
    assert round(dense / 1e9, 1) == 7.2 and counts["total"] < 8 * dense


def test_mixtral_count_equals_transformers_mixtral_built_from_its_config():
    """The same count from ``transformers``' MixtralForCausalLM, instantiated on the meta device."""
    from transformers import MixtralConfig

    from labs.models.hf import meta_model

    d = theory.MIXTRAL_8X7B.dense
    config = MixtralConfig(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden,
        intermediate_size=d.ffn_hidden,
        num_hidden_layers=d.n_layers,
        num_attention_heads=d.n_heads,
        num_key_value_heads=d.n_kv_heads,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = meta_model(config)
    assert (
        sum(p.numel() for p in model.parameters())
        == theory.moe_param_counts(theory.MIXTRAL_8X7B)["total"]
    )


@pytest.mark.parametrize("n_experts, top_k, ep", [(8, 2, 1), (8, 2, 4), (4, 1, 2), (6, 3, 3)])
def test_counts_equal_the_course_moe_model(n_experts, top_k, ep):
    """Total: every parameter of the course model with MoE layers. Per rank: one EP rank's."""
    from labs.experiments.moe import model_spec
    from labs.models import ModelConfig, count_params
    from labs.models.moe import MoEConfig, build_moe_model
    from labs.runtime.impl import exercise

    cfg = ModelConfig(n_layer=3)
    moe = MoEConfig(n_experts=n_experts, top_k=top_k)
    model = build_moe_model(cfg, moe, layer=exercise("expert_parallel").MoELayer)
    counts = theory.moe_param_counts(model_spec(cfg, moe), ep=ep)
    assert counts["total"] == count_params(model)
    expert = sum(p.numel() for p in model.layers[0].mlp.experts["0"].parameters())
    assert counts["expert"] == expert
    assert counts["total"] - counts["active"] == cfg.n_layer * (n_experts - top_k) * expert
    assert (
        counts["per_rank"] == counts["total"] - cfg.n_layer * (n_experts - n_experts // ep) * expert
    )


def test_capacity_and_drops():
    assert theory.expert_capacity(64, 2, 8, 1.25) == 20  # ceil(1.25 * 2 * 64 / 8)
    assert theory.expert_capacity(10, 1, 4, 1.0) == 3  # ceil(2.5)
    assert theory.dropped_pairs([5, 1, 0, 2], 2) == 3
    assert theory.dropped_pairs([5, 1, 0, 2], None) == 0
    assert theory.imbalance([4, 4, 4, 4]) == 1.0 and theory.imbalance([16, 0, 0, 0]) == 4.0


@pytest.mark.parametrize(
    "bad, match", [(0, "capacity_factor"), (-1.0, "capacity_factor"), (True, "capacity_factor")]
)
def test_bad_capacity_factor_is_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        theory.expert_capacity(64, 2, 8, bad)


def test_bad_experts_and_top_k_are_rejected():
    with pytest.raises(ValueError, match=r"top_k=3 is larger than n_experts=2.*\{1,2\}"):
        theory.MoESpec(ModelSpec(), n_experts=2, top_k=3)
    with pytest.raises(
        ValueError, match=r"n_experts=6 is not divisible by ep=4; use ep in \{1,2,3,6\}"
    ):
        theory.moe_param_counts(theory.MoESpec(ModelSpec(), n_experts=6, top_k=2), ep=4)
    with pytest.raises(ValueError, match="world_size=6 is not divisible by ep=4"):
        theory.ep_rank_groups(6, 4)


def test_ep_groups_are_consecutive_and_expert_replicas_stride():
    groups = theory.ep_rank_groups(8, 4)
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_all_to_all_bytes_from_rows():
    kept = [[3, 1, 0, 2], [0, 0, 5, 1]]  # 2 ranks, 4 experts: rank 0 holds e0, e1
    rows = theory.rows_between_ranks(kept)
    assert rows == [[4, 2], [0, 6]]
    assert theory.all_to_all_bytes(rows, 0, hidden=8, itemsize=4) == {
        "dispatch": 2 * 32,
        "combine": 0,
        "total": 64,
    }
    assert theory.all_to_all_bytes(rows, 1, hidden=8, itemsize=4) == {
        "dispatch": 0,
        "combine": 64,
        "total": 64,
    }
    assert theory.counts_exchange_bytes(8, 4) == 8 * 3 * 2


def test_expected_bytes_are_the_mean_of_uniform_routing():
    """Simulated uniform routing, no drops: the average dispatch bytes approach
    N·k·(ep-1)/ep·h·b."""
    tokens = 512
    k = 2
    ep = 4
    h = 16
    counts = theory.synthetic_routing(
        tokens=tokens, n_experts=8, top_k=k, ranks=ep, skew=0.0, seed=1
    )
    rows = theory.rows_between_ranks(counts)
    measured = sum(theory.all_to_all_bytes(rows, r, h, 4)["dispatch"] for r in range(ep)) / ep
    expected = theory.expected_all_to_all_bytes(tokens, k, ep, h, 4)
    assert abs(measured - expected) / expected < 0.03, (measured, expected)


def test_synthetic_router():
    a = theory.synthetic_routing(tokens=300, n_experts=6, top_k=2, ranks=3, skew=2.0, seed=5)
    assert a == theory.synthetic_routing(
        tokens=300, n_experts=6, top_k=2, ranks=3, skew=2.0, seed=5
    )
    assert all(sum(row) == 300 * 2 and max(row) <= 300 for row in a)  # k distinct experts per token
    total = [sum(col) for col in zip(*a)]
    assert total[0] > total[-1]  # skew favours the first experts
    with pytest.raises(ValueError, match="skew"):
        theory.synthetic_routing(tokens=1, n_experts=2, top_k=1, skew=-1)


def test_capacity_sweep_drops_less_as_capacity_grows():
    counts = theory.synthetic_routing(tokens=128, n_experts=8, top_k=2, ranks=2, skew=1.5)
    sweep = theory.capacity_sweep(counts, 128, 2, [0.25, 0.5, 1.0, 2.0, 8.0])
    shares = [r["dropped_share"] for r in sweep]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.5 and shares[-1] == 0.0
    # cf = E/k: every expert can take every token, nothing can be dropped.
    assert theory.capacity_sweep(counts, 128, 2, [4.0])[0]["dropped"] == 0


def test_cli_function_and_no_torch():
    result = cli.run(["moe", "--preset", "mixtral-8x7b", "--ep", "8"])
    assert result["total"] == theory.moe_param_counts(theory.MIXTRAL_8X7B)["total"]
    assert "46.70 B parameters" in theory.format_result(result)
    assert_torch_free("import labs.theory.moe as m; m.moe_param_counts(m.MIXTRAL_8X7B)")


def test_widget_draws_headless():
    """The visualizer's drawing agrees with the theory it draws.

    The real-run drawings take run outputs."""
    import matplotlib.pyplot as plt

    from labs.widgets import moe as widget

    fig, facts = widget.draw_synthetic(
        tokens=64, n_experts=4, top_k=2, ranks=3, skew=3.0, capacity_factor=1.0
    )
    counts = theory.synthetic_routing(tokens=64, n_experts=4, top_k=2, ranks=3, skew=3.0)
    assert facts["capacity"] == theory.expert_capacity(64, 2, 4, 1.0) == 32
    assert facts["dropped"] == sum(theory.dropped_pairs(row, 32) for row in counts) > 0
    assert facts["pairs"] == 3 * 64 * 2
    heat = fig.axes[0].images[0].get_array()
    assert heat.tolist() == counts  # the heat map shows the counts
    plt.close(fig)
    curves = {
        0.0: {
            "imbalance": [1.5, 4.0],
            "dropped_share": [0.1, 0.5],
            "loss": [5.0, 4.0],
            "capacity": 3,
            "counts": [[[[1, 2], [3, 0]]], [[[0, 3], [3, 0]]]],
        }
    }
    plt.close(widget.draw_balance(curves))
    plt.close(widget.draw_balance_loads(curves, step=-1, layer=0))
    summary = {
        "chosen_per_expert": [[[5, 1]], [[2, 4]]],
        "capacity": 4,
        "nproc": 2,
        "ep": 2,
        "top_k": 1,
    }
    ax = widget.draw_run_load(summary, layer=0)
    assert ax.images[0].get_array().tolist() == [[5, 1], [2, 4]]
    plt.close(ax.figure)


def test_visualizer_builds_and_keeps_top_k_valid():
    from labs.widgets.moe import routing_visualizer

    box = routing_visualizer(tokens=32, n_experts=4, top_k=2, ranks=2)
    sliders = {child.description: child for row in box.children[:2] for child in row.children}
    sliders["experts"].value = 2
    sliders["top-k"].value = 4  # more than the experts: clamped, no error
    assert sliders["top-k"].value == 2
    assert "pairs dropped" in box.children[2].value
