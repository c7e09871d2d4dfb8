"""The checks every lab's verdict is made of: comparisons, scale hints and the verdict table."""

import pytest
import torch

from labs.experiments.checks import (
    Check,
    compare_tensors,
    compare_values,
    passed,
    scale_hint,
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
    }
    assert "checks" not in dict(s) and s.verdict().endswith("PASS: 1 checks")
