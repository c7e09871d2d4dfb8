"""Lab 01: the calculator equals measurement on the real model, to the byte.

Activations are counted with saved-tensor hooks (labs.measure.SavedActivations) on several
shapes of the course model (GQA and plain multi-head, tied head, other widths, batch and sequence
sizes), in fp32 and bf16, with no, selective and full recomputation, region by region. The lab
run adds parameters, gradients and optimizer state, the reference losses and the CLI.
Harness and theory only (the memory lab has no exercise to fill in): not marked exercise.
"""

import pytest
import torch

from labs.experiments.common import SUMMARY_KEYS
from labs.experiments.memory import course_spec, run, saved_activations
from labs.experiments.memory_report import matches_calculator
from labs.models.transformer import ModelConfig, build_model
from labs.theory.activations import stage_activation_bytes
from tests.helpers import checks_ok, lab_json, run_lab_main

SHAPES = {
    "course": (ModelConfig(), 4, 32),
    "mha-tied": (ModelConfig(n_kv_head=8, tie_embeddings=True, n_layer=3), 3, 24),
    "narrow": (ModelConfig(n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=96, vocab_size=100), 2, 40),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_activations_equal_the_formula_region_by_region(shape, precision, recompute):
    cfg, batch, seq = SHAPES[shape]
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = build_model(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2))
    loss, total, regions = saved_activations(model, x, y, recompute=recompute)
    loss.backward()  # the recomputation works, too
    parts = stage_activation_bytes(
        course_spec(cfg),
        seq=seq,
        mbs=batch,
        dtype_bytes=dtype.itemsize,
        layers=cfg.n_layer,
        recompute=recompute,
    )
    assert regions["embedding"] == parts["embedding"]
    assert regions[f"layer{cfg.n_layer - 1}"] == parts["per_layer"]
    assert (
        sum(regions[f"layer{i}"] for i in range(cfg.n_layer)) == parts["layers"] + parts["rotary"]
    )
    assert regions["final_norm"] == parts["final_norm"]
    assert regions["loss"] == parts["loss"]
    assert total == parts["total"]


def test_lab_on_one_rank_matches_theory_and_reference_exactly():
    s = run(nproc=1, steps=2)
    assert all(matches_calculator(s, r) for r in s["rows"]), [
        (r["precision"], r["recompute"], r["measured"], r["predicted"]) for r in s["rows"]
    ]
    assert len(s["rows"]) == 6 and s["matches_reference"] and s.passed, s.verdict()
    assert s["max_abs_loss_diff"] == 0.0  # fp32, one rank: the reference's arithmetic, bit for bit
    assert not s["recompute_changes_loss"]
    fp32 = {
        r["recompute"]: r["measured"]["activation_bytes"]
        for r in s["rows"]
        if r["precision"] == "fp32"
    }
    predicted = {
        r["recompute"]: r["predicted"]["activation_bytes"]
        for r in s["rows"]
        if r["precision"] == "fp32"
    }
    # what recomputation buys
    assert fp32["none"] - fp32["full"] == predicted["none"] - predicted["full"] > 0
    bf16 = next(r for r in s["rows"] if r["precision"] == "bf16-mixed" and r["recompute"] == "none")
    n = sum(p.numel() for p in build_model(ModelConfig()).parameters())
    assert (
        bf16["measured"]["param_bytes"] == 2 * n and bf16["measured"]["optimizer_bytes"] == 12 * n
    )
    assert bf16["playbook_activation_bytes"] != bf16["measured"]["activation_bytes"]


def test_two_data_parallel_ranks_and_fp32_gradient_accumulation():
    s = run(
        nproc=2,
        steps=2,
        precisions=("bf16-mixed",),
        recomputes=("none", "full"),
        fp32_grad_accum=True,
    )
    assert s.passed and s["matches_reference"], s.verdict()
    assert checks_ok(s, "bf16-mixed/none: all_reduce bytes per call")
    n = sum(p.numel() for p in build_model(ModelConfig()).parameters())
    assert s["rows"][0]["measured"]["grad_bytes"] == (2 + 4) * n
    assert s["state_bytes_per_rank"] == [s["theory_state_bytes_per_rank"]] * 2


def test_cli_summary_and_bad_arguments():
    summary = lab_json(
        "memory",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--json",
        "--impl",
        "solutions",
        "--precisions",
        "fp32",
    )
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["lab"] == "memory" and summary["passed"] and summary["matches_reference"]
    assert [r["recompute"] for r in summary["rows"]] == ["none", "selective", "full"]
    code, _, err = run_lab_main("memory", "--nproc", "1", "--steps", "1")
    assert code == 2 and "steps must be >= 2" in err, err
    with pytest.raises(ValueError, match="precisions="):
        run(nproc=1, precisions=("fp16",))
    with pytest.raises(ValueError, match="fp32_grad_accum"):
        run(nproc=1, fp32_grad_accum=True)
