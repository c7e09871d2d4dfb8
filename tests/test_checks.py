"""The checks every lab's verdict is made of: comparisons, scale hints and the verdict table."""

import pytest
import torch

from labs.experiments.checks import (
    Check,
    calls_check,
    collectives_checks,
    compare_tensors,
    compare_values,
    find,
    losses_check,
    matches,
    passed,
    ranks_check,
    scale_hint,
    training_checks,
    verdict_table,
)
from labs.experiments.common import RunSummary


def tensors(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": scale * torch.randn(4, 3, generator=g), "b": scale * torch.ones(2)}


@pytest.mark.parametrize(
    "scale, words",
    [
        (4.0, "did you divide the sum by the world size"),
        (0.25, "each rank kept only its own share"),
        (2.0, "reduced twice"),
        (0.0, "zero or missing"),
        (-1.0, "wrong sign"),
    ],
)
def test_a_scaled_gradient_fails_with_the_classic_cause(scale, words):
    check = compare_tensors(
        "gradients after step 1",
        tensors(scale),
        tensors(),
        tolerance=1e-5,
        where="rank 1",
        world_size=4,
        what="gradients",
    )
    assert not check.ok and words in check.hint, check
    assert check.where.startswith("rank 1, ") and check.tolerance == 1e-5


def test_equal_tensors_pass_and_report_their_largest_difference():
    actual = tensors()
    actual["b"] = actual["b"] + 1e-7
    check = compare_tensors("parameters", actual, tensors(), tolerance=1e-5)
    assert check.ok and check.hint == "" and 0 < check.measured < 1e-5 and "b" in check.where


def test_missing_and_misshapen_tensors_are_named():
    partial = tensors()
    del partial["b"]
    missing = compare_tensors("gradients", partial, tensors(), tolerance=1e-5, where="rank 0")
    assert not missing.ok and "b" in missing.where and "never arrived" in missing.hint
    wrong = tensors()
    wrong["a.weight"] = wrong["a.weight"][:2]
    shape = compare_tensors("gradients", wrong, tensors(), tolerance=1e-5)
    assert not shape.ok and shape.measured == [2, 3] and shape.expected == [4, 3]


def test_an_unexplained_difference_still_names_the_tensor():
    noisy = tensors()
    noisy["a.weight"] = noisy["a.weight"] + torch.linspace(0, 1, 12).view(4, 3)
    check = compare_tensors("parameters", noisy, tensors(), tolerance=1e-5, world_size=2)
    assert not check.ok and "a.weight" in check.hint


def test_a_lab_diagnoses_the_worst_tensor_by_name_when_no_scale_explains_it():
    """A hint may be a function of the worst tensor's name (DDP: "the ranks hold different
    gradients for <name>"); a scale the numbers show still comes first."""
    noisy = tensors()
    noisy["a.weight"] = noisy["a.weight"] + torch.linspace(0, 1, 12).view(4, 3)
    seen = []

    def diagnose(name: str) -> str:
        seen.append(name)
        return f"{name}: its all-reduce never ran"

    check = compare_tensors("gradients", noisy, tensors(), tolerance=1e-5, hint=diagnose)
    assert not check.ok and check.hint == "a.weight: its all-reduce never ran"
    assert seen == ["a.weight"] and check.tensor == "a.weight"  # the name, as a field
    doubled = compare_tensors(
        "gradients", tensors(2.0), tensors(), tolerance=1e-5, what="gradients", hint=diagnose
    )
    assert "reduced twice" in doubled.hint
    assert compare_tensors("gradients", tensors(), tensors(), tolerance=1e-5, hint=diagnose).ok


def test_checks_say_what_they_compare_against_and_one_rule_reads_the_reference():
    ref = tensors()
    checks = training_checks(
        losses=[1.0], reference_losses=[1.0], grads=[ref], reference_grads=ref, world_size=1
    )
    checks.append(calls_check("bytes per call", [[8.0]], [[16.0]]))
    checks.append(Check("ranks hold identical parameters", True))
    assert [c.against for c in checks] == ["reference", "reference", "theory", ""]
    assert matches(checks, "reference") is True and matches(checks, "theory") is False
    assert matches(checks, "torch") is None and not passed(checks)
    assert find(checks, "bytes per call").expected == 16.0
    with pytest.raises(KeyError, match="no check named 'nope'"):
        find(checks, "nope")


def test_values_exact_and_relative():
    assert compare_values("calls", 4, 4).ok
    assert not compare_values("calls", 5, 4).ok
    assert compare_values("bytes", [100.0, 100.0], [100.0, 100.0000001], tolerance=1e-6).ok
    bytes_ = compare_values("bytes per call", [0, 0], [96, 96], world_size=2, what="bytes")
    assert not bytes_.ok and "zero or missing" in bytes_.hint
    given = compare_values("order", ["F0", "B0"], ["F0", "F1"], hint="look at the warm-up")
    assert not given.ok and given.hint == "look at the warm-up"
    assert not compare_values("order", ["F0"], ["F0", "F1"]).ok


def test_no_hint_for_a_scale_that_means_nothing():
    assert scale_hint("gradients", 1.37, 4) == ""


def test_verdict_table_pass_and_fail():
    good = [Check("losses", True, 1e-7, 0.0, 1e-5, "every step")]
    assert passed(good) and verdict_table(good, lab="ddp").endswith("ddp: PASS: 1 checks")
    bad = good + [Check("gradients", False, 3.0, 0.0, 1e-5, "rank 1, w", "divide by N?")]
    text = verdict_table(bad, lab="ddp")
    assert not passed(bad)
    assert "FAIL gradients [rank 1, w]" in text and "ddp: FAIL: 1 of 2 checks failed" in text
    assert text.splitlines()[-1] == "  hint (gradients): divide by N?"
    assert not passed([]) and "made no checks" in verdict_table([])


def test_summary_carries_the_verdict_into_its_json():
    s = RunSummary(lab="ddp", nproc=2, backend="gloo", impl="solutions", steps=1)
    assert not s.passed
    s.add_checks([Check("losses", True, 0.0, 0.0, 1e-5)])
    out = s.to_dict()
    assert out["passed"] is True and out["checks"][0]["name"] == "losses"
    assert set(out["checks"][0]) == {
        "name",
        "ok",
        "measured",
        "expected",
        "tolerance",
        "where",
        "hint",
        "against",
        "tensor",
    }
    assert "checks" not in dict(s) and s.verdict().endswith("PASS: 1 checks")


def test_losses_tell_a_wrong_forward_from_a_wrong_update():
    ref = [5.0, 4.0, 3.0]
    assert losses_check([5.0, 4.0, 3.0], ref, tolerance=1e-5).ok
    forward = losses_check([5.5, 4.0, 3.0], ref, tolerance=1e-5)
    assert not forward.ok and "step 1" in forward.hint and forward.where == "step 1 of 3"
    update = losses_check([5.0, 4.0, 3.3], ref, tolerance=1e-5)
    assert not update.ok and "step 3 does not" in update.hint and update.where == "step 3 of 3"
    assert not losses_check([5.0], ref, tolerance=1e-5).ok


def test_long_runs_get_a_bound_per_step_that_grows_only_after_the_first_steps():
    """Two correct runs part exponentially over a long run (labs.train._DRIFT): the losses check
    allows each step its own bound, so step 200 may differ by 2e-4 (measured on 4 ranks) while a
    wrong update at step 2 still fails at 1e-5."""
    from labs.train import rule

    value = rule("value", torch.float32)
    bounds = value.per_step(200)
    assert bounds[:20] == [1e-5] * 20 and bounds == sorted(bounds)
    assert value.at(40) == pytest.approx(2e-5) and value.at(10_000) == pytest.approx(1e-2)
    ref = [5.0 - 0.01 * s for s in range(200)]
    # doubling every 20 steps from 2e-7 to 2e-4 at step 200 (measured: every ~26, 2e-4 at 200)
    drifted = [r * (1 + 2e-7 * 2 ** ((s + 1) / 20)) for s, r in enumerate(ref)]
    assert not losses_check(drifted, ref, tolerance=1e-5).ok  # a fixed 1e-5 fails correct code
    check = losses_check(drifted, ref, tolerance=bounds)
    assert check.ok and check.tolerance == bounds[int(check.where.split()[1]) - 1]
    wrong = [*ref[:1], ref[1] * (1 + 2e-5), *ref[2:]]
    early = losses_check(wrong, ref, tolerance=bounds)
    assert not early.ok and early.where == "step 2 of 200" and early.tolerance == 1e-5
    param = rule("param", torch.float32)
    assert param.at(50) == 1e-3 and param.at(150) == pytest.approx(4e-3)
    assert param.at(10_000) == pytest.approx(1e-2)  # never so loose that a wrong update passes


def test_every_rank_is_compared_and_the_failing_one_is_named():
    good = tensors()
    expected = tensors()
    check = ranks_check("gradients", [good, None, tensors(2.0)], expected, tolerance=1e-5, step=1)
    assert not check.ok and check.where.startswith("rank 2, step 1, ") and "2x" in check.hint
    assert ranks_check("gradients", [good, good], [expected, expected], tolerance=1e-5).ok
    missing = dict(good, b=None)  # a gradient that never arrived
    gone = ranks_check("gradients", [missing], expected, tolerance=1e-5, what="gradients")
    assert not gone.ok and "never arrived" in gone.hint and gone.where.endswith("b")


def test_a_tensor_zero_in_exact_arithmetic_is_compared_to_the_largest():
    # both sides rounding noise around an exact zero: relative to itself it differs by 200%
    expected = {"w": torch.ones(3), "k_proj.bias": torch.full((3,), 1e-11)}
    noise = {"w": torch.ones(3), "k_proj.bias": torch.full((3,), -1e-11)}
    assert not compare_tensors("g", noise, expected, tolerance=1e-5).ok
    assert compare_tensors("g", noise, expected, tolerance=1e-5, absolute=("k_proj.bias",)).ok


def test_a_lab_names_its_own_factors():
    check = compare_tensors(
        "gradients",
        tensors(256.0),
        tensors(),
        tolerance=1e-5,
        world_size=2,
        what="gradients",
        known_scales={256.0: "divide by the tokens"},
    )
    assert check.hint == "gradients are 256x the reference: divide by the tokens"


def test_calls_are_counted_then_compared_one_by_one():
    assert calls_check("bytes per call", [[4.0, 4.0], [4.0, 4.0]], [[4.0, 4.0]] * 2).ok
    count = calls_check("bytes per call", [[4.0, 4.0], [4.0]], [[4.0, 4.0]] * 2, count_hint="2")
    assert not count.ok and count.where == "rank 1: calls" and count.hint == "2"
    assert (count.measured, count.expected) == (1, 2)
    size = calls_check("bytes per call", [[4.0, 8.0]], [[4.0, 4.0]], world_size=4)
    assert not size.ok and size.where == "rank 0, call 2 of 2" and "2x" in size.hint


def test_collectives_are_checked_per_phase_and_op():
    measured = [[("forward", "all_reduce", 8.0), ("backward", "all_reduce", 8.0)]]
    expected = [[("forward", "all_reduce", 8.0), ("backward", "all_gather", 4.0)]]
    checks = {c.name: c for c in collectives_checks(measured, expected, prefix="tp: ")}
    assert set(checks) == {
        "tp: backward all_gather bytes per call",
        "tp: backward all_reduce bytes per call",
        "tp: forward all_reduce bytes per call",
    }
    assert checks["tp: forward all_reduce bytes per call"].ok
    assert not checks["tp: backward all_gather bytes per call"].ok  # never issued
    assert not checks["tp: backward all_reduce bytes per call"].ok  # not in the theory


def test_training_checks_point_at_the_update_when_only_parameters_differ():
    ref = tensors()
    checks = training_checks(
        losses=[1.0, 2.0],
        reference_losses=[1.0, 2.0],
        grads=[ref, ref],
        reference_grads=ref,
        params=[ref, tensors(1.5)],
        reference_params=ref,
        world_size=2,
        prefix="naive: ",
    )
    assert [c.name for c in checks] == [
        "naive: losses",
        "naive: gradients after step 1",
        "naive: parameters after step 2",
    ]
    assert [c.ok for c in checks] == [True, True, False]
    params = find(checks, "naive: parameters after step 2")
    assert "zeroed at the start of every step" in params.hint
    assert params.tolerance == 1e-3  # the table's rule for parameters after AdamW steps
