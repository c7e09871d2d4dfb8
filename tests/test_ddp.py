"""Exercise 02: naive, overlapped and bucketed DDP equal single-process training, send 2(N-1)/N G
bytes per rank per step in the predicted number of calls, and match torch's DDP.

Losses and step-1 gradients match in fp32 within 1e-5. Parameters after 5 AdamW steps are
compared in fp32 within the tolerance table's "param" rule (AdamW magnifies the rounding of a split
sum, for *any* DDP, torch's included) and tightly in float64 on 4 ranks.
"""

import functools
import json

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import ddp as lab
from labs.experiments import ddp_timeline as timeline
from labs.measure import CommLedger
from labs.models.toy import build_awkward
from labs.run import main as cli
from labs.runtime import exercise
from labs.theory.comm import all_reduce_bytes
from labs.theory.memory import state_bytes
from labs.theory.overlap import VARIANTS, MiB, all_reduce_calls, bucket_layout
from labs.train import (
    LossScaler,
    TrainConfig,
    assert_close_tensors,
    compare_losses,
    data_for,
    rule,
    train_reference,
)
from tests.helpers import checks_ok, in_child

TOL = rule("value", torch.float32).rel
PARAM_TOL = rule("param", torch.float32).rel
# The lab's parts (PARTS in labs/ddp.py): naive and overlapped DDP, with accumulation, are the core;
# BucketedDDP is the "buckets" extension, MixedPrecisionOptimizer and reduce_dtype the
# "mixed-precision" one. A job trains the core's variants together, or the bucketed one alone, so
# that the core's tests run before BucketedDDP is written.
BUCKETS = pytest.mark.part("buckets")
MIXED = pytest.mark.part("mixed-precision")
CORE_VARIANTS = ("naive", "overlapped")
EACH_VARIANT = [*CORE_VARIANTS, pytest.param("bucketed", marks=BUCKETS)]


def trained_with(variant: str) -> tuple[str, ...]:
    """The variants a job trains beside ``variant``: the core's together, bucketed alone."""
    return CORE_VARIANTS if variant in CORE_VARIANTS else (variant,)


@functools.cache
def trained(nproc: int, **job_options):
    """Every rank's results for a job, the reference, and the theory's figures (computed here)."""
    job = lab.Job(variants=job_options.pop("variants", VARIANTS), **job_options)
    per_rank = launch(lab.worker, nproc, job, False, timeout=180)
    model = lab.build(job)
    ref = train_reference(job.model_cfg, job.train, dp=nproc, model=model, return_grads=True)
    trainable = [
        p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad
    ]
    used = [g.numel() * g.element_size() for g in ref.grads.values()]
    return job, per_rank, ref, trainable, used


def check_against_reference(nproc, variant, *, params=True, **job_options):
    job, per_rank, ref, _, _ = trained(nproc, variants=trained_with(variant), **job_options)
    runs = [r["variants"][variant] for r in per_rank]
    losses = [sum(step) / nproc for step in zip(*(r["losses"] for r in runs))]
    diff = compare_losses(losses, ref.losses)
    assert diff["max_rel_loss_diff"] <= TOL, f"{variant}: losses {losses} vs reference {ref.losses}"
    for rank, r in enumerate(runs):
        assert sorted(r["first_grads"]) == sorted(ref.grads), (
            f"rank {rank}: gradients present differ"
        )
        assert_close_tensors(r["first_grads"], ref.grads, what="gradient", step=1, rank=rank)
        if params:
            assert_close_tensors(r["params"], ref.params, step=job.train.steps, rank=rank)
        assert all(torch.equal(r["params"][n], runs[0]["params"][n]) for n in ref.params), (
            f"rank {rank} holds other parameters than rank 0: the ranks diverged"
        )
    return runs


@pytest.mark.exercise
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("variant", EACH_VARIANT)
def test_losses_and_gradients_match_the_reference_in_fp32(variant, nproc):
    check_against_reference(nproc, variant)


@pytest.mark.exercise
@pytest.mark.parametrize("variant", EACH_VARIANT)
def test_parameters_after_5_adamw_steps_match_in_float64_on_4_ranks(variant):
    check_against_reference(4, variant, dtype="float64")


@pytest.mark.exercise
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("variant", EACH_VARIANT)
def test_bytes_and_calls_per_step_equal_the_theory(variant, nproc):
    job, per_rank, ref, trainable, used = trained(nproc, variants=trained_with(variant))
    expected_calls = all_reduce_calls(variant, used, job.bucket_mb * MiB)
    assert variant != "bucketed" or 1 < expected_calls < len(used), (
        "the course model should need several buckets"
    )
    for rank, r in enumerate(per_rank):
        r = r["variants"][variant]
        assert r["broadcasts"] == r["wrap_calls"] == len(ref.params), (
            f"rank {rank}: one broadcast per tensor at wrap"
        )
        for step, (calls, sent, other) in enumerate(
            zip(r["calls"], r["sent"], r["other_calls"]), start=1
        ):
            where = f"{variant}, rank {rank}, step {step}"
            assert calls == expected_calls, f"{where}: {calls} all-reduces, theory {expected_calls}"
            assert sent == pytest.approx(all_reduce_bytes(sum(used), nproc), rel=1e-12), where
            assert other == 0, f"{where}: {other} collectives besides all-reduce"


# The awkward model: tied embedding/head, a frozen layer, an unused parameter. Tensors in backward
# order: 96, 3552, 148, 3552, 24576 bytes, then the unused one's 112. Capacities giving 1 bucket
# (the
# unused tensor shares it: flushed at the end), 2 (the unused one alone), 3, and one per tensor.
BUCKET_MB = {1: 1.0, 2: 20000 / MiB, 3: 3700 / MiB, 6: 1 / MiB}


def check_awkward(nproc, variants, n_buckets=None, **options):
    """The awkward model on ``variants``: frozen and unused parameters untouched and never
    reduced, the tied weight reduced once; bucketed: ``n_buckets`` buckets, the unused slot sent."""
    job, per_rank, ref, trainable, used = trained(nproc, variants=variants, **options)
    initial = dict(build_awkward(job.train.seed).named_parameters())
    for variant in variants:
        runs = check_against_reference(nproc, variant, **options)
        for rank, r in enumerate(runs):
            where = f"{variant}, rank {rank}"
            assert r["no_grad"] == ["frozen.bias", "frozen.weight", "unused"], where
            for name in ("frozen.weight", "frozen.bias", "unused"):
                assert torch.equal(r["params"][name], initial[name].detach()), (
                    f"{where}: {name} changed"
                )
            # the tied weight is one tensor: reduced once (5 gradients, not 6); buckets also send
            # the unused slot
            expected = {"bucketed": (n_buckets, sum(trainable))}.get(variant, (5, sum(used)))
            assert all(c == expected[0] for c in r["calls"]), (
                f"{where}: calls {r['calls']} != {expected[0]}"
            )
            assert all(
                s == pytest.approx(all_reduce_bytes(expected[1], nproc), rel=1e-12)
                for s in r["sent"]
            ), where


@pytest.mark.exercise
@pytest.mark.parametrize("nproc", [2, 4])
def test_awkward_model_unused_frozen_and_tied(nproc):
    check_awkward(nproc, CORE_VARIANTS, model="awkward")


@pytest.mark.exercise
@BUCKETS
@pytest.mark.parametrize("nproc, n_buckets", [(2, 1), (2, 2), (2, 3), (2, 6), (4, 3)])
def test_awkward_model_bucket_boundaries_unused_frozen_and_tied(nproc, n_buckets):
    options = dict(model="awkward", bucket_mb=BUCKET_MB[n_buckets])
    job, _, _, trainable, _ = trained(nproc, variants=("bucketed",), **options)
    assert all_reduce_calls("bucketed", trainable, job.bucket_mb * MiB) == n_buckets
    check_awkward(nproc, ("bucketed",), n_buckets, **options)


def bucket_names(model_name, caps):
    out = []
    for cap in caps:
        model = lab.build(lab.Job(variants=("bucketed",), model=model_name))
        names = {p: n for n, p in model.named_parameters()}
        out.append(
            [
                [names[p] for p in bucket]
                for bucket in lab.wrap("bucketed", model, bucket_mb=cap).bucket_params
            ]
        )
    return out


@pytest.mark.exercise
@BUCKETS
@pytest.mark.parametrize(
    "model_name, caps", [("awkward", list(BUCKET_MB.values())), ("course", [0.02, 0.1, 0.3, 25])]
)
def test_buckets_follow_the_backward_order(model_name, caps):
    """Bucket contents, by name, are the theory's layout of the trainable parameters, reversed."""
    model = lab.build(lab.Job(variants=(), model=model_name))
    order = [n for n, p in reversed(list(model.named_parameters())) if p.requires_grad]
    sizes = lab.backward_order_bytes(model)
    for cap, got in zip(caps, launch(bucket_names, 2, model_name, caps)[0]):
        expected = [[order[i] for i in bucket] for bucket in bucket_layout(sizes, cap * MiB)]
        assert got == expected, f"bucket_mb={cap}: buckets {got}, expected {expected}"


@pytest.mark.exercise
@pytest.mark.parametrize(
    "nproc, grad_accum, dtype, variants",
    [
        (2, 4, "float32", CORE_VARIANTS),
        (4, 2, "float64", CORE_VARIANTS),
        pytest.param(2, 4, "float32", ("bucketed",), marks=BUCKETS),
        pytest.param(4, 2, "float64", ("bucketed",), marks=BUCKETS),
    ],
)
def test_gradient_accumulation_equals_the_global_batch_and_communicates_once(
    nproc, grad_accum, dtype, variants
):
    """Micro-batches of 1 sequence: fp32 checks losses and step-1 gradients; float64 the parameters
    too (in fp32 AdamW amplifies the last-bit differences of 1-sequence micro-batches past 1e-5, as
    above)."""
    _, per_rank, _, _, used = trained(nproc, variants=variants, grad_accum=grad_accum, dtype=dtype)
    for variant in variants:
        check_against_reference(
            nproc, variant, params=dtype == "float64", grad_accum=grad_accum, dtype=dtype
        )
        expected = all_reduce_calls(variant, used, lab.DEFAULT_BUCKET_MB * MiB)
        for rank, r in enumerate(per_rank):  # the no_sync micro-steps must not communicate
            assert r["variants"][variant]["calls"] == [expected] * 5, f"{variant}, rank {rank}"


def no_sync_is_local(variant):
    """Inside no_sync a backward communicates nothing and leaves the local gradient untouched."""
    model = lab.build(lab.Job(variants=(variant,)))
    wrapped = lab.wrap(variant, model)
    x, y = data_for(TrainConfig(steps=1), dist.get_world_size())[0]
    x = x.chunk(dist.get_world_size())[dist.get_rank()]
    y = y.chunk(dist.get_world_size())[dist.get_rank()]
    with CommLedger() as ledger, wrapped.no_sync():
        wrapped(x, y)[1].backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    differs_across_ranks = [torch.empty(0)] * dist.get_world_size()
    dist.all_gather_object(differs_across_ranks, local["lm_head.weight"])
    return ledger.calls(), all(
        not torch.equal(differs_across_ranks[0], g) for g in differs_across_ranks[1:]
    )


@pytest.mark.exercise
@pytest.mark.parametrize("variant", ["overlapped", pytest.param("bucketed", marks=BUCKETS)])
def test_no_sync_backward_stays_local(variant):
    for calls, ranks_differ in launch(no_sync_is_local, 2, variant):
        assert calls == 0 and ranks_differ


def wrap_models_from_different_seeds(variants):
    out = []
    for variant in variants:  # every rank starts from its own weights; wrapping imposes rank 0's
        model = lab.build(lab.Job(variants=(variant,), train=TrainConfig(seed=dist.get_rank())))
        lab.wrap(variant, model)
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.exercise
@pytest.mark.parametrize("variants", [CORE_VARIANTS, pytest.param(("bucketed",), marks=BUCKETS)])
def test_wrapping_broadcasts_rank_0s_weights(variants):
    rank0 = dict(lab.build(lab.Job(variants=("naive",))).named_parameters())
    for rank, results in enumerate(launch(wrap_models_from_different_seeds, 3, variants)):
        for variant, params in zip(variants, results):
            for name, p in rank0.items():
                assert torch.equal(params[name], p.detach()), (
                    f"{variant}, rank {rank}: {name} is not rank 0's"
                )


def data_of_this_rank(cfg, grad_accum):
    return exercise("ddp").rank_data(cfg, grad_accum=grad_accum)


@pytest.mark.exercise
@pytest.mark.parametrize("nproc, grad_accum", [(4, 1), (2, 2)])
def test_rank_data_is_disjoint_and_forms_the_global_batch(nproc, grad_accum):
    cfg = TrainConfig(steps=3, batch_size=8)
    per_rank = launch(data_of_this_rank, nproc, cfg, grad_accum)
    for step, (x, y) in enumerate(data_for(cfg, nproc)):
        micro = [mb for rank in per_rank for mb in rank[step]]
        assert all(mx.shape == (8 // (nproc * grad_accum), cfg.seq_len) for mx, _ in micro), (
            f"step {step}"
        )
        assert torch.equal(torch.cat([mx for mx, _ in micro]), x)
        assert torch.equal(torch.cat([my for _, my in micro]), y)
        rows = [tuple(row.tolist()) for mx, _ in micro for row in mx]
        assert len(set(rows)) == len(rows), f"step {step}: ranks share samples"


def train_on_subgroups(variant):
    """Ranks {0,1} and {2,3} are two data-parallel groups. Every rank builds its model from its own
    seed; wrapping must give each group its first rank's weights (seed 0 for ranks 0-1, 1 for
    2-3)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    job = lab.Job(
        variants=(variant,), train=TrainConfig(seed=rank // 2 if rank % 2 == 0 else 10 + rank)
    )
    return lab.train_variant(variant, job, group=groups[rank // 2])


@pytest.mark.exercise
@pytest.mark.parametrize("variant", ["overlapped", pytest.param("bucketed", marks=BUCKETS)])
def test_groups_are_passed_explicitly(variant):
    per_rank = launch(train_on_subgroups, 4, variant)
    for g in (0, 1):
        ref = train_reference(lab.Job(variants=()).model_cfg, TrainConfig(seed=g), dp=2)
        pair = zip(per_rank[2 * g]["losses"], per_rank[2 * g + 1]["losses"])
        assert (
            compare_losses([(a + b) / 2 for a, b in pair], ref.losses)["max_rel_loss_diff"] <= TOL
        ), f"group {g}"
        for rank in (2 * g, 2 * g + 1):
            assert_close_tensors(per_rank[rank]["params"], ref.params, step=5, rank=rank)
            assert per_rank[rank]["broadcasts"] == len(ref.params)


@pytest.mark.exercise
@pytest.mark.parametrize(
    "variant", ["naive", "overlapped", pytest.param("bucketed", marks=BUCKETS)]
)
def test_measured_timeline_shows_when_all_reduces_run(variant):
    trace = timeline.measure_overlap(nproc=2, steps=2, variant=variant)
    for rank, r in enumerate(trace["per_rank"]):
        assert r["all_reduces"] == trace["theory_calls"], f"rank {rank}"
        assert r["backward_s"] > 0 and r["wait_s"] >= 0
    for rank in (0, 1):
        spans = [s for s in trace["spans"] if s["rank"] == rank]
        backward_end = max(s["end"] for s in spans if s["kind"] == "backward")
        comm = [s for s in spans if s["lane"] == "comm"]
        assert all(s["end"] >= s["start"] for s in comm)
        if variant == "naive":  # nothing starts before backward is over
            assert all(s["start"] >= backward_end for s in comm), f"rank {rank}"
        else:  # every all-reduce is launched from a gradient hook, inside backward
            assert all(s["start"] <= backward_end for s in comm), f"rank {rank}"


@pytest.mark.exercise
def test_with_compute_padded_overlapping_hides_the_all_reduces_naive_exposes():
    """Each matmul padded to 5 ms, as notebooks 04 and 05 pad compute: the overlapped variant's
    all-reduces run under backward, so far less communication is left when it ends than naive's
    21 all-reduces after it (medians of 5 steps, seen from the rank that finished backward last;
    on a quiet machine the step is shorter by about that much, on a busy one the exposed time is
    the steady figure)."""
    traces = timeline.overlap_gain(nproc=2, op_time=0.005, steps=6)
    assert list(traces) == ["naive", "overlapped"]

    exposed = {variant: trace["median_exposed_s"] for variant, trace in traces.items()}
    assert exposed["overlapped"] < 0.75 * exposed["naive"], timeline.overlap_table(traces)
    assert all(t["op_time"] == 0.005 for t in traces.values())
    table = timeline.overlap_table(traces).splitlines()
    assert len(table) == 3 and "padded to 5 ms" in table[0]
    with pytest.raises(ValueError, match="op_time=-1 must be >= 0"):
        timeline.measure_overlap(op_time=-1)


@pytest.mark.exercise
@BUCKETS
def test_cli_vs_torch_ddp(capsys):
    """``python -m labs.run ddp --vs-torch --json``.

    Its main() runs in this process, so torch is not imported a second time."""
    assert (
        cli(
            ["ddp", "--nproc", "2", "--steps", "4", "--variant", "bucketed", "--vs-torch", "--json"]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["lab"] == "ddp" and summary["nproc"] == 2 and summary["backend"] == "gloo"
    assert summary["matches_reference"] and summary["passed"]
    assert checks_ok(
        summary,
        "bucketed: parameters after step 4",
        "bucketed: all_reduce bytes per call",
        "bucketed: broadcast bytes per call at wrap",
    )
    assert (
        summary["step_time_s"] > 0
        and summary["torch_step_time_s"] > 0
        and summary["torch_cpu_s_per_step"] > 0
    )
    assert summary["ours_over_torch"] == pytest.approx(
        summary["step_time_s"] / summary["torch_step_time_s"]
    )
    # torch's DDP trained the same model on the same data: it lands on the same numbers
    assert summary["torch_max_rel_loss_diff"] <= TOL
    assert summary["torch_max_rel_param_diff"] <= PARAM_TOL


# --- mixed precision ---------------------------------------------------------------------------


@pytest.mark.exercise
@MIXED
@pytest.mark.parametrize(
    "nproc, precision, reduce_dtype",
    [
        (2, "bf16-mixed", "fp32"),
        (4, "bf16-mixed", "fp32"),
        (4, "bf16-mixed", "bf16"),
        (2, "fp16-mixed", "fp32"),
        (4, "fp16-mixed", "fp16"),
    ],
)
def test_mixed_precision_matches_its_reference_and_the_calculator(nproc, precision, reduce_dtype):
    """bf16/fp16 weights and gradients, fp32 masters: every variant PASSes against the reference
    under the same policy; a rank holds the calculator's bf16-mixed bytes role by role (2 + 2 +
    12 per parameter); the all-reduces carry the reduce dtype (fp32: 4 bytes per gradient
    element, bf16: 2); fp16 skips the overflowed steps the reference skips."""
    s = lab.run(nproc=nproc, steps=5, variant="all", precision=precision, reduce_dtype=reduce_dtype)
    assert s.passed, s.verdict()
    assert s["precision"] == precision and s["reduce_dtype"] == reduce_dtype
    psi = s["n_params"]
    calc = state_bytes(psi, precision="bf16-mixed", optimizer="adamw")
    assert s["state_breakdown"] == {
        "params": calc["param_bytes"],
        "grads": calc["grad_bytes"],
        "optimizer": calc["optimizer_bytes"],
    }
    assert s["state_bytes_per_rank"] == [16 * psi] * nproc
    wire = 4 if reduce_dtype == "fp32" else 2
    assert s["comm_bytes_per_rank"] == [all_reduce_bytes(wire * psi, nproc)] * nproc
    # bf16 costs something against fp32, within a few 1e-4 of the loss on this model
    assert 0 < s["max_rel_loss_diff_vs_fp32"] < (1e-2 if precision == "bf16-mixed" else 0.5)
    if precision == "fp16-mixed":
        # 2^19 overflows fp16 in step 1's backward: skipped, and the scale halves
        assert s["skipped_steps"] == s["reference_skipped_steps"] and 1 in s["skipped_steps"]
        assert s["loss_scales"][:2] == [2.0**19, 2.0**18]


@pytest.mark.exercise
@MIXED
def test_reducing_in_bf16_on_two_ranks_rounds_as_fp32_does():
    """On 2 ranks a bf16 all-reduce adds two bf16 numbers once: rounding that sum is rounding the
    exact one, so the fp32 reduction (rounded to bf16 once) gives the very same model; the
    reduction's dtype shows in the bytes only."""
    runs = {
        r: lab.run(nproc=2, steps=3, precision="bf16-mixed", reduce_dtype=r)
        for r in ("fp32", "bf16")
    }
    assert runs["fp32"]["losses"] == runs["bf16"]["losses"]
    assert runs["fp32"]["comm_bytes_per_rank"][0] == 2 * runs["bf16"]["comm_bytes_per_rank"][0]


def mixed_precision_steps(exercise):
    """A step, then a step with an inf in a gradient: the master and the weight after each."""
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float16))
    scaler = LossScaler(2.0**10)
    opt = exercise("ddp").MixedPrecisionOptimizer(
        [weight], torch.optim.SGD, loss_scaler=scaler, lr=0.5
    )
    seen = {"master": opt.masters[0].detach().clone(), "weight": weight.detach().clone()}
    weight.grad = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float16) * 2.0**10  # scaled
    opt.step()
    seen["stepped"] = (opt.masters[0].detach().clone(), weight.detach().clone())
    seen["master grad"] = opt.masters[0].grad
    weight.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float16)
    opt.step()
    seen["overflowed"] = opt.masters[0].detach().clone()
    seen["scaler"] = (scaler.history, scaler.value)
    return seen


@pytest.mark.exercise
@MIXED
def test_mixed_precision_optimizer_skips_an_overflowed_step_and_halves_the_scale(exercise):
    """One process, no group: the masters take a step in fp32 and round into the bf16 weights;
    an inf in a gradient skips the step (weights and masters unchanged) and halves the scale."""
    seen = in_child(mixed_precision_steps, exercise)
    master, weight = seen["master"], seen["weight"]
    assert master.dtype == torch.float32 and torch.equal(master, weight.float())
    master, weight = seen["stepped"]
    assert torch.equal(master, torch.tensor([0.5, -3.0, 1.0]))
    assert weight.dtype == torch.float16 and torch.equal(weight, master.half())
    assert seen["master grad"] is None, "fp32 gradients live only during the step"
    assert torch.equal(seen["overflowed"], torch.tensor([0.5, -3.0, 1.0])), (
        "an overflow was stepped"
    )
    history, value = seen["scaler"]
    assert history == [(2.0**10, False), (2.0**10, True)] and value == 2.0**9


def test_loss_scaler_follows_torchs_grad_scaler():
    """Our LossScaler's rule is torch.amp.GradScaler's: the same scales for the same overflows."""
    ours = LossScaler(2.0**8, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    for overflow in [False, False, True, False, True, True, False, False, False]:
        loss = theirs.scale((param * torch.tensor([float("inf") if overflow else 1.0, 0.0])).sum())
        opt.zero_grad()
        loss.backward()
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
        assert ours.value == theirs.get_scale()


def test_mixed_precision_optimizer_refuses_fp32_weights(exercise):
    with pytest.raises(ValueError, match="cast the model first"):
        exercise("ddp").MixedPrecisionOptimizer(
            [torch.nn.Parameter(torch.zeros(2))], torch.optim.AdamW
        )


@pytest.mark.exercise
@BUCKETS
def test_awkward_model_beside_torch_ddp():
    """torch's DDP on the awkward model: its unused parameter needs find_unused_parameters (without
    it torch's reducer raises at step 2)."""
    s = lab.run(nproc=2, steps=3, model="awkward", vs_torch=True)
    assert s.passed, s.verdict()
    assert s["torch_max_rel_loss_diff"] <= TOL
    assert s["torch_max_rel_param_diff"] <= PARAM_TOL


@pytest.mark.slow
@pytest.mark.exercise
@BUCKETS
def test_a_long_run_passes_its_verdict_as_torchs_ddp_would():
    """120 steps on 4 ranks in fp32: the loss drifts past 1e-5 (1.3e-5 by step 100, measured;
    torch's DDP alike) because the runs part like any chaotic trajectories; the table's bound grows
    with the steps (labs.train._DRIFT), so correct code passes."""
    s = lab.run(nproc=4, steps=120)
    assert s["max_rel_loss_diff"] > TOL  # what a fixed 1e-5 would fail (measured: 1.9e-5)
    assert s.passed and s["matches_reference"], s.verdict()
    assert checks_ok(s, "bucketed: parameters after step 120"), s.verdict()


# --- harness: no learner code --------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(variant="ring"), "variant='ring' is not one of"),
        (dict(bucket_mb=0), "bucket_mb must be > 0"),
        (dict(grad_accum=3), "batch_size=8 is not divisible by nproc\\*grad_accum=12"),
        (dict(model="gpt"), "model='gpt' is not one of"),
        (dict(dtype="bf16"), "dtype='bf16' is not one of"),
        (dict(precision="fp8"), "precision='fp8' is not one of"),
        (dict(reduce_dtype="bf16"), "reduce_dtype='bf16' needs a mixed precision"),
        (dict(precision="bf16-mixed", reduce_dtype="fp16"), "reduce in 'fp32' or in"),
        (dict(precision="bf16-mixed", dtype="float64"), "mixed precision keeps fp32 masters"),
        (dict(precision="fp16-mixed", loss_scale=0), "loss_scale must be > 0"),
    ],
)
def test_bad_options_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        lab.run(**{"nproc": 4, **options})


def test_cli_rejects_bad_options_with_exit_2(capsys):
    assert cli(["ddp", "--nproc", "3"]) == 2
    assert "batch_size=8 is not divisible by nproc*grad_accum=3" in capsys.readouterr().err


def test_forgetting_set_epoch_repeats_the_order():
    without = lab.sampler_epochs(world_size=2, epochs=2, set_epoch=False)
    with_epoch = lab.sampler_epochs(world_size=2, epochs=2, set_epoch=True)
    assert without[0] == without[1], "without set_epoch every epoch repeats the first one's order"
    assert with_epoch[0] != with_epoch[1] and with_epoch[0] == without[0]
    for epoch in with_epoch:
        assert not set(epoch[0]) & set(epoch[1]), "ranks must see disjoint samples"
        assert sorted(epoch[0] + epoch[1]) == sorted(set(epoch[0] + epoch[1]))


def test_overlap_drawing_headless():
    from labs.theory.overlap import simulate_ddp
    from labs.widgets.ddp import draw_overlap

    measured = {
        "variant": "bucketed",
        "nproc": 2,
        "per_rank": [{"exposed_s": 0.001, "backward_s": 0.01, "all_reduces": 2}] * 2,
        "spans": [
            {"rank": r, "lane": lane, "kind": kind, "start": a, "end": b, "bucket": k}
            for r in (0, 1)
            for lane, kind, a, b, k in [
                ("compute", "forward", 0.0, 0.004, None),
                ("compute", "backward", 0.004, 0.008, 0),
                ("compute", "backward", 0.008, 0.014, 1),
                ("comm", "all_reduce", 0.008, 0.012, 0),
                ("comm", "all_reduce", 0.011, 0.015, 1),
                ("compute", "wait", 0.014, 0.015, None),
            ]
        ],
    }
    fig = draw_overlap(simulate_ddp(variant="naive"), measured)
    top, bottom = fig.axes
    assert "exposed" in top.get_title() and "measured" in bottom.get_title()
    assert len(bottom.get_yticks()) == 4  # two lanes per rank
    assert len(bottom.patches) >= 12


@pytest.mark.exercise
@MIXED
def test_precision_curves_table_and_plot_headless():
    """Notebook 02's and 03's mixed-precision section: three runs, a table, two panels."""
    from labs.experiments.precision import format_curves, loss_curves, plot_curves

    curves = loss_curves("ddp", nproc=2, steps=2)
    assert list(curves) == ["fp32", "bf16, reduce in fp32", "bf16, reduce in bf16"]
    table = format_curves(curves)
    assert table.count("PASS") == 3 and "1,709,056" in table
    fig = plot_curves(curves)
    left, right = fig.axes
    assert len(left.lines) == 3 and len(right.lines) == 4  # two bf16 runs, their gap, zero
    with pytest.raises(ValueError, match="lab='tp' is not one of"):
        loss_curves("tp")
