"""``device_map`` as the libraries compute it (notebooks 05 and 09): on a meta-device course model,
"auto" is "balanced" (it spreads the layers), "sequential" fills device 0 first, the placement
helper computes what ``transformers.from_pretrained(device_map=...)`` computes, and the theory's
fill order is accelerate's "sequential"."""

import pytest

from labs.experiments import placement
from labs.experiments.pp import layer_costs
from labs.models.transformer import ModelConfig
from labs.theory import pipeline as theory


def by_strategy(rows):
    return {r["strategy"]: r for r in rows if "strategy" in r}


def test_auto_is_balanced_and_spreads_where_sequential_packs_device_0():
    rows = by_strategy(placement.device_maps(layers=8, devices=4, budget=1.0))
    assert rows["auto"]["device_map"] == rows["balanced"]["device_map"]
    # room to spare: "sequential" puts the whole model on device 0, "auto" spreads it
    assert rows["sequential"]["layers"] == [8, 0, 0, 0] and rows["sequential"]["embedding"] == 0
    assert max(rows["auto"]["layers"]) < 8 and sum(n > 0 for n in rows["auto"]["layers"]) >= 3
    # get_balanced_memory lowered every budget but the last; "sequential" kept the given ones
    budgets = rows["auto"]["max_memory"]
    assert (
        budgets[0] == budgets[1] == budgets[2] < budgets[3] == rows["sequential"]["max_memory"][3]
    )
    # balanced_low_0 keeps device 0 empty when the others can hold the model
    assert rows["balanced_low_0"]["layers"][0] == 0 and rows["balanced_low_0"]["bytes"][0] == 0
    total = sum(rows["sequential"]["bytes"])
    assert all(sum(r["bytes"]) == total for r in rows.values())  # every byte placed once


def test_sequential_fills_device_after_device_keeping_room_for_a_layer_on_device_0():
    """Half the model per device: "sequential" fills in order, each device until the next module
    would not fit; device 0 (a "main device") keeps room for the largest layer, in case one
    offloaded to the CPU must come back. The theory's fill (the lab's naive placement), which
    keeps no such room, puts one layer more on device 0."""
    rows = by_strategy(
        placement.device_maps(layers=8, devices=4, budget=0.5, strategies=("sequential",))
    )
    seq = rows["sequential"]
    budget = seq["max_memory"][0]
    layer = 4 * layer_costs(ModelConfig(n_layer=8))[0][0]  # bytes of one block, fp32
    assert seq["layers"] == [3, 4, 1, 0]
    assert seq["bytes"][0] <= budget - layer < seq["bytes"][0] + layer  # device 0: room kept
    assert seq["bytes"][1] <= budget < seq["bytes"][1] + layer  # device 1: full
    costs, first, last = layer_costs(ModelConfig(n_layer=8))
    capacity = budget // 4  # in parameters
    assert theory.fill_plan(costs, 4, capacity=capacity, first_extra=first, last_extra=last) == (
        4,
        4,
        0,
        0,
    )


@pytest.mark.parametrize("strategy", ["auto", "balanced_low_0", "sequential"])
def test_the_helper_computes_what_transformers_from_pretrained_computes(strategy):
    from accelerate import init_empty_weights
    from transformers.integrations.accelerate import _get_device_map

    from labs.models.hf import llama_config

    with init_empty_weights():
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(ModelConfig(n_layer=8)))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    max_memory = {d: total // 2 for d in range(4)}
    with placement._quiet_accelerate():
        theirs = _get_device_map(model, strategy, dict(max_memory), None)
    ours, _ = placement.accelerate_device_map(
        model, strategy, max_memory, no_split_module_classes=model._no_split_modules
    )
    assert dict(theirs) == ours


def test_a_bad_strategy_or_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="strategy='fill' is not one of"):
        placement.accelerate_device_map(placement.meta_model(ModelConfig()), "fill", {0: 1})
    with pytest.raises(ValueError, match="budget=0 must be > 0"):
        placement.device_maps(budget=0)
