"""Hints read from what a run measured (issue 31, item 9): each names the cause the numbers show,
on made-up measurements, no processes. The classic-bug catalogue (tests/classic_bugs.py) plants
the same mistakes in the solutions and runs the labs."""

from __future__ import annotations

import torch

from labs.experiments import memory, mesh, moe, zero_checks
from labs.experiments.checks import Check
from labs.theory.dims import ParallelDims


def test_memory_names_a_gradient_left_over_from_the_step_before():
    g1 = {"w": torch.tensor([1.0, -2.0, 3.0])}
    g2 = {"w": torch.tensor([0.5, 0.5, -1.0])}
    reference = [g1, g2]  # the reference's gradient at each step's weights
    right = memory.step_grads_check("g", [[g1, g2]], reference, tolerance=1e-5, world_size=1)
    assert right.ok
    piled = [[g1, {"w": g1["w"] + g2["w"]}]]  # the buffer still holds step 1's
    check = memory.step_grads_check("g", piled, reference, tolerance=1e-5, world_size=1, accum=True)
    assert not check.ok and check.where == "rank 0, step 2, w"
    assert "step 2's gradients are the reference's plus this run's step 1 gradients" in check.hint
    assert "gradient-accumulation buffer" in check.hint
    other = [[g1, {"w": -g2["w"] * 3 + 1}]]
    check = memory.step_grads_check("g", other, reference, tolerance=1e-5, world_size=1)
    assert not check.ok and "left over" not in check.hint and "at the same weights" in check.hint
    # a wrong step 1 keeps the scale-read hint (2x on 2 ranks: the world size)
    doubled = [[{"w": 2 * g1["w"]}, g2]]
    check = memory.step_grads_check("g", doubled, reference, tolerance=1e-5, world_size=2)
    assert "did you divide the sum by the world size?" in check.hint


def test_zero_names_an_all_reduce_of_the_whole_gradient():
    calls = zero_checks.expected_calls([1000, 3000], stage=1, n=2, itemsize=4)
    buffers = calls["reduce_scatter_single"]
    hint = zero_checks._all_reduce_hint(buffers, [], calls, stage=1)
    assert "whole gradient buffer" in hint and "where ZeRO-1 reduce-scatters it" in hint
    assert "fp16" not in hint and "overflow" not in hint
    hint = zero_checks._all_reduce_hint([400, 400], [], calls, stage=2)
    assert "never all-reduced" in hint
    fp16 = zero_checks.expected_calls([1000], stage=2, n=2, itemsize=2, overflow_flag=True)
    hint = zero_checks._all_reduce_hint([], fp16["all_reduce"], fp16, stage=2)
    assert "overflow flag must be all-reduced" in hint


def test_mesh_names_the_positions_a_cp_rank_dropped():
    assert mesh.zigzag_positions(16, 2, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert mesh.zigzag_positions(16, 2, 1) == list(range(4, 12))
    dims = ParallelDims(cp=2)
    ranks = [
        {"rank": r, "coords": {"cp": r}, "positions": mesh.zigzag_positions(16, 2, r)}
        for r in range(2)
    ]
    assert mesh.positions_check(ranks, dims, 16).ok
    assert mesh.positions_check(ranks, ParallelDims(dp=2), 16) is None  # no CP: nothing to check
    ranks[0]["positions"] = None
    check = mesh.positions_check(ranks, dims, 16)
    assert not check.ok and "without its tokens' positions" in check.hint
    assert "zig-zag chunks 0 and 3" in check.hint and "ZeRO" not in check.hint
    ranks[0]["positions"] = list(range(8))  # the model's default, 0..T/cp-1
    assert "without its tokens' positions" in mesh.positions_check(ranks, dims, 16).hint
    ranks[0]["positions"] = mesh.zigzag_positions(16, 2, 1)
    assert "other tokens than it holds" in mesh.positions_check(ranks, dims, 16).hint


def test_moe_names_expert_gradients_divided_by_their_groups_size():
    ref = {"router.weight": torch.ones(2, 3), "layers.0.mlp.experts.0.w": torch.arange(6.0)}
    failed = Check("gradients after step 1", False, hint="something was reduced twice")
    # world 4, ep 2: each expert-DP group holds 2 ranks; dividing by 2 leaves the experts 2x
    per_rank = [
        {"grads": {"router.weight": ref["router.weight"], "layers.0.mlp.experts.0.w": 2 * e}}
        for e in [ref["layers.0.mlp.experts.0.w"]] * 4
    ]
    check = moe.expert_division_diagnosis(failed, per_rank, ref, nproc=4, ep=2)
    assert "divided by the size of the group they were summed over (2)" in check.hint
    assert "instead of the world size (4)" in check.hint
    # the router wrong too: not this mistake, the hint stays
    per_rank[0]["grads"]["router.weight"] = 3 * ref["router.weight"]
    assert moe.expert_division_diagnosis(failed, per_rank, ref, nproc=4, ep=2) is failed
