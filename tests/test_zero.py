"""Exercise 03: ZeRO-1/2/3 equal the single-process reference, hold and send what the theory says.

Each run trains 5 AdamW steps on gloo through the exercise's public entry points
(``ShardedOptimizer``, ``fully_shard``) and must PASS its own verdict (``labs.experiments.
zero_checks``); besides, on every rank: losses and final full parameters (by name) against
``labs.train.train_reference``; the bytes held after a step
against ``labs.theory.zero.held_bytes`` (the memory calculator's figure when N divides every
unit); the ledger's bytes sent per step against ``comm_bytes``; ZeRO-3's peak parameter bytes
against ``peak_param_bytes``. Parameters are compared in float64 on 4 ranks: in float32,
AdamW turns the last-bit differences of a sum split four ways into ~1e-4 relative changes
of a few elements, for plain data parallelism and torch's FSDP2 alike (see ``run``).
"""

import pytest

from labs.experiments.zero import run
from labs.theory.memory import state_bytes
from labs.theory.zero import comm_bytes
from tests.helpers import checks_ok, lab_json, run_lab_main


def part(stage: int, *, offload: bool = False, precision: str | None = None):
    """The part of the lab (PARTS in labs/zero.py) a run needs last: ZeRO-1/2 are the core,
    then the extensions zero3, offload, checkpoints, mixed-precision."""
    if precision:
        return pytest.mark.part("mixed-precision")
    if offload:
        return pytest.mark.part("offload")
    return pytest.mark.part("zero3" if stage == 3 else "core")


STAGES = [1, 2, pytest.param(3, marks=part(3))]


def check(s, *, stage, nproc, calculator: bool):
    assert s.passed, s.verdict()
    names = {c.name for c in s.checks}
    assert {"losses", "gradients after step 1", "parameters after the last step"} <= names
    assert {"bytes per call", "bytes sent per op", "state held per rank"} <= names
    assert s["matches_reference"], (s["losses"], s["reference_losses"])
    assert checks_ok(s, "parameters after the last step"), (
        f"{s['worst_param']}: max relative difference {s['max_rel_param_diff']:.2e}"
    )
    assert checks_ok(s, "state held per rank"), (s["state_breakdown"], s["theory_breakdown"])
    assert checks_ok(s, "bytes sent per op"), (
        s["comm_bytes_per_rank"],
        s["theory_comm_bytes_per_rank"],
    )
    assert s["comm_by_op"].keys() == (
        {"reduce_scatter_single", "all_gather_single"} if stage else {"all_reduce"}
    )
    if calculator:  # no padding: the calculator's figure exactly, and 2Ψ / 3Ψ exactly
        calc = state_bytes(
            s["n_params"],
            precision="fp32",
            optimizer="adamw",
            zero=stage,
            dp=nproc,
            exact_shards=True,
        )["total_bytes"]
        assert (
            s["state_bytes_per_rank"] == [calc * (8 if s["dtype"] == "float64" else 4) // 4] * nproc
        )
        assert s["psi_equivalent"] == pytest.approx(3 if stage == 3 else 2, rel=1e-12)
    if stage == 3:
        assert checks_ok(s, "peak parameter bytes"), (
            s["peak_param_bytes_per_rank"],
            s["theory_peak_param_bytes"],
        )
        assert s["peak_param_bytes_backward"] == s["peak_param_bytes_per_rank"]


@pytest.mark.exercise
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("nproc, dtype", [(2, "float32"), (4, "float64")])
def test_course_model_matches_reference_and_theory(stage, nproc, dtype):
    s = run(nproc=nproc, stage=stage, dtype=dtype, steps=5)
    check(s, stage=stage, nproc=nproc, calculator=True)
    assert s["offload"] is False and "host_bytes_per_step" not in s


@pytest.mark.exercise
@pytest.mark.parametrize(
    "stage, nproc, dtype, offload",
    [
        pytest.param(stage, nproc, dtype, offload, marks=part(stage, offload=offload))
        for stage in (1, 2, 3)
        for nproc, dtype, offload in [(2, "float32", False), (4, "float64", True)]
    ],
)
def test_awkward_model_any_size_tied_frozen_unused(stage, nproc, dtype, offload):
    """8,009 trainable elements (padded on 2 and 4 ranks), a tied weight, a frozen layer and an
    unused parameter."""
    s = run(nproc=nproc, stage=stage, dtype=dtype, offload=offload, model="awkward", steps=5)
    check(s, stage=stage, nproc=nproc, calculator=False)
    if offload:
        assert s["state_breakdown"]["optimizer"] == 0 and s["state_breakdown"]["host"] > 0
        assert s["host_bytes_per_step"] == s["theory_host_bytes_per_step"]


@pytest.mark.exercise
@part(3)
def test_zero3_without_prefetch_holds_one_unit_at_a_time():
    s = run(nproc=2, stage=3, prefetch=False, steps=5)
    # peak = shards + the largest unit, nothing prefetched
    check(s, stage=3, nproc=2, calculator=True)
    assert s["theory_peak_param_bytes"] == 4 * (sum(s["unit_numels"]) // 2 + max(s["unit_numels"]))


@pytest.mark.exercise
@part(3)
def test_cli_reports_ours_and_torch_fsdp2_side_by_side():
    s = lab_json("zero", "--stage", "3", "--nproc", "4", "--vs-torch", "--json")
    assert s["lab"] == "zero" and s["stage"] == 3 and s["nproc"] == 4
    assert s["step_time_s"] > 0 and s["torch_step_time_s"] > 0
    assert s["state_bytes_per_rank"] == [s["theory_state_bytes_per_rank"]] * 4
    # FSDP2 shards every parameter along dim 0; here each divides by 4, so it holds what we hold
    assert s["torch_state_bytes_per_rank"] == s["state_bytes_per_rank"]
    assert s["torch_max_rel_loss_diff"] < 1e-5
    assert s["theory_comm_bytes_per_rank"] == comm_bytes(s["unit_numels"], stage=3, dp=4)["total"]
    assert s["torch_impl"] == "FSDP2 fully_shard" and s["passed"] is True
    assert {c["name"] for c in s["checks"]} >= {"gradients after step 1", "peak parameter bytes"}


@pytest.mark.exercise
def test_sharded_optimizer_beside_torchs_zero_redundancy_optimizer():
    s = run(nproc=2, stage=1, steps=3, vs_torch=True)
    check(s, stage=1, nproc=2, calculator=True)
    assert s["torch_impl"] == "ZeroRedundancyOptimizer (under DDP)"
    assert s["torch_max_rel_loss_diff"] < 1e-5 and s["torch_step_time_s"] > 0
    # torch's keeps whole parameters and gradients too; its optimizer state is split by parameter
    assert s["torch_state_breakdown"]["params"] == s["state_breakdown"]["params"]


@pytest.mark.exercise
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=part(3))])
def test_awkward_model_beside_torch(stage):
    """The awkward model beside torch's own: ZeroRedundancyOptimizer under DDP (its unused
    parameter needs find_unused_parameters) and FSDP2 (its frozen layer comes back a DTensor)."""
    s = run(nproc=2, stage=stage, steps=3, model="awkward", vs_torch=True)
    assert s.passed, s.verdict()
    assert s["torch_max_rel_loss_diff"] < 1e-5 and s["torch_max_rel_param_diff"] < 1e-3


def test_stage_zero_baseline_is_data_parallel():
    """Stage 0 (harness code, not an exercise): all-reduce, the whole state on every rank."""
    s = run(nproc=2, stage=0, steps=5)
    check(s, stage=0, nproc=2, calculator=True)


# --- mixed precision ---------------------------------------------------------------------------
def check_mixed(s, *, stage, nproc, reduce_dtype):
    """A mixed-precision run: PASS against the reference under the same policy, the calculator's
    bf16-mixed bytes in total (role by role for stages 0-2; ZeRO-3 in FSDP2's layout), and the
    reductions in the reduce dtype, the all-gathers in bf16."""
    assert s.passed, s.verdict()
    psi = s["n_params"]
    calc = state_bytes(psi, precision="bf16-mixed", optimizer="adamw", zero=stage, dp=nproc)
    assert s["state_bytes_per_rank"] == [calc["total_bytes"]] * nproc
    roles = {k: s["state_breakdown"][k] for k in ("params", "grads", "optimizer")}
    if stage < 3:
        assert roles == {
            "params": calc["param_bytes"],
            "grads": calc["grad_bytes"],
            "optimizer": calc["optimizer_bytes"],
        }
    else:  # fp32 shards (the masters), fp32 gradient shards, AdamW's moments: 4 + 4 + 8
        shard = psi // nproc
        assert roles == {"params": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard}
    wire = 4 if reduce_dtype == "fp32" else 2
    sent = s["comm_by_op"]
    if stage == 0:
        assert sent["all_reduce"] == (nproc - 1) / nproc * 2 * wire * psi
    else:
        assert sent["reduce_scatter_single"] == (nproc - 1) / nproc * wire * psi
        assert sent["all_gather_single"] == (nproc - 1) / nproc * 2 * psi * (2 if stage == 3 else 1)


@pytest.mark.exercise
@part(1, precision="bf16-mixed")
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    "nproc, precision, reduce_dtype",
    [(2, "bf16-mixed", "fp32"), (4, "bf16-mixed", "bf16"), (4, "fp16-mixed", "fp32")],
)
def test_mixed_precision_holds_the_calculators_bf16_bytes(stage, nproc, precision, reduce_dtype):
    s = run(nproc=nproc, stage=stage, steps=5, precision=precision, reduce_dtype=reduce_dtype)
    check_mixed(s, stage=stage, nproc=nproc, reduce_dtype=reduce_dtype)
    assert s["precision"] == precision and s["reduce_dtype"] == reduce_dtype
    if precision == "fp16-mixed":  # the first step overflows fp16 and is skipped on every rank
        assert s["skipped_steps"] == s["reference_skipped_steps"] and s["skipped_steps"][0] == 1
        assert s["comm_by_op"]["all_reduce"] == (nproc - 1) / nproc * 2 * 4  # the overflow flag
    if stage == 3 and reduce_dtype == "fp32":
        # the reduced gradient stays fp32 (never rounded to bf16): the reference's numbers
        assert s["max_rel_param_diff"] < 1e-6 and s["max_rel_loss_diff"] < 1e-6


def test_mixed_precision_stage_zero_baseline():
    """Stage 0 (harness code): fp32 masters beside the bf16 model, all-reduce in fp32."""
    s = run(nproc=2, stage=0, steps=5, precision="bf16-mixed")
    check_mixed(s, stage=0, nproc=2, reduce_dtype="fp32")


@pytest.mark.exercise
@part(3, precision="bf16-mixed")
def test_zero3_bf16_beside_fsdp2s_mixed_precision_policy():
    """FSDP2 with MixedPrecisionPolicy(bf16, fp32) keeps the same fp32 shards, gradients and
    moments as ours, and trains the same model."""
    s = run(nproc=2, stage=3, steps=5, precision="bf16-mixed", vs_torch=True)
    check_mixed(s, stage=3, nproc=2, reduce_dtype="fp32")
    assert s["torch_state_breakdown"] == s["state_breakdown"]
    assert s["torch_max_rel_loss_diff"] < 1e-6 and s["torch_max_rel_param_diff"] < 1e-6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stage": 4}, "stage=4 is not one of"),
        ({"precision": "fp8"}, "precision='fp8' is not one of"),
        ({"reduce_dtype": "bf16"}, "reduce_dtype='bf16' needs a mixed precision"),
        ({"precision": "bf16-mixed", "offload": True}, "offload=True with precision"),
        ({"precision": "bf16-mixed", "dtype": "float64"}, "mixed precision keeps fp32 masters"),
        ({"precision": "bf16-mixed", "stage": 2, "vs_torch": True}, "use stage=3"),
        ({"precision": "fp16-mixed", "stage": 3, "vs_torch": True}, "precision='bf16-mixed'"),
        ({"stage": 2, "nproc": 1}, "nproc=1"),
        ({"stage": 0, "offload": True}, "offload=True needs stage"),
        ({"model": "gpt"}, "model='gpt' is not one of"),
        ({"dtype": "float16"}, "dtype='float16' is not one of"),
        ({"nproc": 3}, r"nproc=3 does not divide the lab's global batch of 8 .* \{2,4,8\}"),
        ({"stage": 0, "nproc": 3}, r"use nproc in \{1,2,4,8\}"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(**{"nproc": 2, **kwargs})


def test_cli_bad_stage_exits_2():
    code, _, err = run_lab_main("zero", "--stage", "5")
    assert code == 2 and "invalid choice" in err
