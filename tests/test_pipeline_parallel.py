"""Exercise 05: pipeline schedules equal the single-process reference (losses and every gradient),
run each rank's operations in the schedule's order, hold the activations the theory says (GPipe:
all M micro-batches; 1F1B: at most P; ZB-H1: P on every stage, measured with saved-tensor hooks),
send the bytes it says, and show the bubble in a measured timeline. DualPipeV runs through torch's
ScheduleDualPipeV on our stages. Bad options fail before any rank starts."""

import functools

import pytest
import torch

from labs import launch
from labs.experiments import pp as lab
from labs.models.transformer import ModelConfig, build_model
from labs.theory import pipeline as th
from labs.train import TrainConfig, assert_close_tensors, data_for, rule
from tests.helpers import checks_ok, lab_json

MODEL = ModelConfig(n_layer=8)
# The lab's parts (PARTS in labs/pipeline_parallel.py): stages, naive placement, GPipe and 1F1B are
# the core; interleaved 1F1B and zero bubble (ZB-H1, with DualPipeV through torch) are extensions.
INTERLEAVED = pytest.mark.part("interleaved")
ZERO_BUBBLE = pytest.mark.part("zero-bubble")


@functools.cache
def reference(batch_size: int):
    return lab.reference_run(MODEL, TrainConfig(steps=2, batch_size=batch_size))


def sweep(schedule, microbatch_counts, virtual, plan, batch_size):
    """On each rank: two training steps of ``schedule`` for every M, with the lab's worker."""
    cfg = TrainConfig(steps=2, batch_size=batch_size)
    return [
        lab.pipeline_worker(schedule, MODEL, cfg, m, virtual, plan, op_time=0.0)
        for m in microbatch_counts
    ]


def check_sweep(schedule, nproc, microbatch_counts, virtual=1, batch_size=16):
    plan = lab.make_plan(schedule, MODEL, nproc, virtual)
    ref = reference(batch_size)  # first: it imports what AdamW needs once, before the ranks fork
    per_rank = launch(
        sweep, nproc, schedule, microbatch_counts, virtual, plan, batch_size, timeout=240
    )
    for i, m in enumerate(microbatch_counts):
        ranks = [r[i] for r in per_rank]
        where = f"{schedule} P={nproc} V={virtual} M={m}"
        losses = ranks[-1]["losses"]
        for step, (loss, expected) in enumerate(zip(losses, ref.losses)):
            assert abs(loss - expected) <= rule("value", torch.float32).rel * abs(expected), (
                f"{where} step {step}: loss"
            )
        for rank, r in enumerate(ranks):
            assert_close_tensors(
                r["grads"],
                {n: ref.grads[n] for n in r["grads"]},
                what=f"{where} gradient",
                step=1,
                rank=rank,
            )
        names = [n for r in ranks for n in r["grads"]]
        assert sorted(names) == sorted(ref.grads), (
            f"{where}: the stages must hold every parameter exactly once"
        )
        order = th.schedule_ops(schedule, nproc, m, virtual)
        for rank, r in enumerate(ranks):  # the sequence of operations, whatever their timing
            assert [tuple(o) for o in r["order"]] == order[rank], (
                f"{where} rank {rank}: order of F/B"
            )
            assert r["held"] == th.in_flight_microbatches(schedule, nproc, m, rank, virtual), (
                f"{where} rank {rank}: micro-batches held"
            )
            assert r["sent_bytes"] == th.p2p_bytes_per_rank(
                schedule,
                nproc,
                rank,
                batch=batch_size,
                seq_len=32,
                hidden=MODEL.n_embd,
                virtual=virtual,
            )


@pytest.mark.exercise
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_schedules_match_the_reference(schedule, nproc):
    check_sweep(schedule, nproc, [1, nproc, 2 * nproc, 4 * nproc])


@pytest.mark.exercise
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", pytest.param("zb-h1", marks=ZERO_BUBBLE)])
@pytest.mark.parametrize("nproc, microbatches", [(2, 3), (4, 6)])
def test_microbatches_not_a_multiple_of_stages(nproc, microbatches, schedule):
    check_sweep(schedule, nproc, [microbatches], batch_size=12)


@pytest.mark.exercise
@ZERO_BUBBLE
@pytest.mark.parametrize("nproc", [2, 4])
def test_zero_bubble_h1_matches_the_reference(nproc):
    """B and W split every backward; the W's held back still reach every gradient, the order is
    ZB-H1's (each W after its B, stage s's last s W's after its last B) and every stage holds
    min(P, M) micro-batches, since a W needs its micro-batch's graph."""
    check_sweep("zb-h1", nproc, [nproc, 2 * nproc, 4 * nproc])


@pytest.mark.exercise
@INTERLEAVED
@pytest.mark.parametrize("nproc", [2, 4])
def test_interleaved_matches_the_reference(nproc):
    check_sweep("interleaved", nproc, [nproc, 2 * nproc, 4 * nproc], virtual=2)


def two_pipelines_on_sub_groups():
    """4 ranks as two pipelines of 2 stages on the sub-groups {0, 2} and {1, 3} (as the mesh lab's
    pp groups are): peers come from the group, not from the global rank."""
    import torch.distributed as dist

    from labs.runtime.impl import exercise
    from labs.runtime.pipe import pipe_group

    pp = exercise("pipeline_parallel")
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe = pipe_group(groups[dist.get_rank() % 2])
    stage = pp.build_stage(build_model(MODEL), plan=(4, 4), stage=pipe.rank)
    x, y = data_for(TrainConfig(steps=1, batch_size=16))[0]
    loss = pp.train_step_1f1b(stage, lab.split_microbatches(x, y, 4), pipe=pipe)
    return {
        "peers": (pipe.prev, pipe.next),
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
    }


@pytest.mark.exercise
def test_pipeline_on_a_sub_group():
    ref = reference(16)
    results = launch(two_pipelines_on_sub_groups, 4, timeout=120)
    assert [r["peers"] for r in results] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    for rank, r in enumerate(results):
        assert_close_tensors(
            r["grads"], {n: ref.grads[n] for n in r["grads"]}, what="gradient", step=1, rank=rank
        )
    assert results[2]["loss"] == pytest.approx(ref.losses[0], rel=1e-5) == results[3]["loss"]


@pytest.mark.exercise
def test_naive_placement_matches_the_full_model():
    s = lab.run(nproc=4, steps=2, schedule="naive", op_time=0.01)
    # the same arithmetic, cut in four
    assert s["max_rel_logit_diff"] == 0.0 and s["matches_reference"] and s.passed, s.verdict()
    assert checks_ok(s, "logits equal the unsplit model's", "p2p bytes per send", "schedule order")
    assert s["comm_bytes_per_rank"] == s["theory_comm_bytes_per_rank"]
    assert s["theory_bubble_fraction"] == 0.75
    assert s["bubble_fraction"] > 0.6  # one stage computes at a time


def check_measured_bubble(*runs):
    """Each measured bubble (operations padded) is no better than the formula and within 0.25 of
    it; the schedule run on paper with the run's own mean delay per operation lands within 0.1."""
    for s in runs:
        where = (
            s["schedule"],
            s["microbatches"],
            s["bubble_fraction"],
            s["theory_bubble_fraction"],
        )
        assert (
            s["theory_bubble_fraction"] - 0.03
            <= s["bubble_fraction"]
            <= s["theory_bubble_fraction"] + 0.25
        ), where
        assert abs(s["bubble_fraction"] - s["delay_bubble_fraction"]) <= 0.1, (
            where,
            s["delay_bubble_fraction"],
        )
        assert checks_ok(s, "schedule order"), s.verdict()


@pytest.mark.exercise
def test_measured_bubble_follows_the_formula():
    """Timing on a shared 2-core machine is noisy, so the bounds are loose (operations padded to 40
    ms; ``check_measured_bubble``), and more micro-batches shrink the measured bubble as they shrink
    the formula's."""
    few = lab.run(nproc=4, steps=1, schedule="1f1b", microbatches=4, op_time=0.04)
    many = lab.run(nproc=4, steps=1, schedule="1f1b", microbatches=16, op_time=0.04)
    check_measured_bubble(few, many)
    assert few["bubble_fraction"] > many["bubble_fraction"] + 0.1


@pytest.mark.exercise
@INTERLEAVED
def test_interleaved_measured_bubble_follows_the_formula():
    """As 1F1B's, within the same loose bounds. (Interleaving's gain is not asserted: its twice as
    many operations and messages pay delays a busy laptop makes large.)"""
    inter = lab.run(
        nproc=4, steps=1, schedule="interleaved", microbatches=4, virtual=2, op_time=0.04
    )
    check_measured_bubble(inter)


@pytest.mark.exercise
@ZERO_BUBBLE
def test_zero_bubble_measured_bubble_is_as_close_to_its_formula_as_1f1bs():
    """ZB-H1 and 1F1B on 4 ranks, M = 8, operations padded alike (F = B = W = 50 ms, 1F1B's
    backward 100 ms), the least idle of 3 padded steps: ZB-H1's measured bubble is well below
    1F1B's (the formulas' 3/27 against 3/11), and its gap to its formula is no larger than
    1F1B's gap to its own, give or take 0.08: ZB-H1 runs half again as many operations per
    step as 1F1B, each starting a delay late on a shared 2-core machine, in a shorter step."""
    runs = {
        schedule: lab.run(
            nproc=4, steps=1, schedule=schedule, microbatches=8, op_time=0.05, measure_steps=3
        )
        for schedule in ("1f1b", "zb-h1")
    }
    assert runs["zb-h1"]["theory_bubble_fraction"] == pytest.approx(3 / 27)
    gaps = {}
    for schedule, s in runs.items():
        assert s.passed, s.verdict()
        assert len(s["measured_bubble_fractions"]) == 3
        assert s["bubble_fraction"] == min(s["measured_bubble_fractions"])
        gaps[schedule] = s["bubble_fraction"] - s["theory_bubble_fraction"]
        assert gaps[schedule] >= -0.03, schedule  # no schedule beats its formula
        assert abs(s["bubble_fraction"] - s["delay_bubble_fraction"]) <= 0.1, schedule
    assert runs["zb-h1"]["bubble_fraction"] < runs["1f1b"]["bubble_fraction"] - 0.08, gaps
    assert gaps["zb-h1"] <= gaps["1f1b"] + 0.08, gaps


@pytest.mark.exercise
@ZERO_BUBBLE
def test_dualpipev_through_torch_matches_the_reference():
    """torch's ScheduleDualPipeV over our stages in a V (rank r: stages r and 2P-1-r): losses,
    every gradient and parameter by name, the order torch ran = labs.theory.pipeline's DualPipeV,
    the bytes (rank P-1 passes between its two stages in memory) and 2P+1 chunk micro-batches
    held on every rank."""
    s = lab.run(nproc=4, steps=2, schedule="dualpipev", microbatches=8, op_time=0.0)
    assert s.passed, s.verdict()
    assert s["virtual"] == 2 and s["plan"] == [1] * 8
    assert s["microbatches_held"] == s["theory_microbatches_held"] == [9, 9, 9, 9]
    assert s["comm_bytes_per_rank"] == s["theory_comm_bytes_per_rank"]
    assert s["theory_bubble_fraction"] == pytest.approx(3 / 27)  # as ZB-H1 (DeepSeek's table)


@pytest.mark.exercise
def test_cli_side_by_side_with_torch():
    s = lab_json(
        "pp",
        "--schedule",
        "1f1b",
        "--nproc",
        "4",
        "--microbatches",
        "8",
        "--steps",
        "3",
        "--vs-torch",
        "--json",
    )
    assert s["matches_reference"] and checks_ok(s, "gradients after step 1", "p2p bytes per send")
    assert s["comm_bytes_per_rank"] == s["theory_comm_bytes_per_rank"]
    assert s["torch_max_abs_loss_diff"] <= 1e-5 * s["reference_loss"]
    assert s["step_time_s"] > 0 and s["torch_step_time_s"] > 0
    assert s["theory_bubble_fraction"] == pytest.approx(3 / 11) and 0 < s["bubble_fraction"] < 1
    assert s["state_bytes_per_rank"] == s["theory_state_bytes_per_rank"]


@pytest.mark.exercise
@pytest.mark.parametrize(
    "schedule, virtual",
    [
        ("gpipe", 1),
        pytest.param("interleaved", 2, marks=INTERLEAVED),
        pytest.param("zb-h1", 1, marks=ZERO_BUBBLE),
        pytest.param("dualpipev", 2, marks=ZERO_BUBBLE),
    ],
)
def test_torch_pipelining_gives_the_same_losses(schedule, virtual):
    """GPipe, interleaved, ZB-H1 (torch's ScheduleInterleavedZeroBubble, one stage per rank) and
    DualPipeV (beside torch's ScheduleZBVZeroBubble on the same V)."""
    s = lab.run(
        nproc=2,
        steps=2,
        schedule=schedule,
        microbatches=4,
        virtual=virtual,
        vs_torch=True,
        op_time=0.0,
    )
    assert s["matches_reference"], schedule
    assert max(abs(a - b) for a, b in zip(s["torch_losses"], s["losses"])) <= 1e-5 * s["loss"], (
        schedule
    )


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(nproc=4, layers=2), "pp=4 x virtual_stages=1 = 4 stages but only n_layer=2"),
        # not "use pp*virtual_stages <= 0": no pipeline fits 0 layers
        (dict(nproc=4, layers=0), "layers must be an integer >= 1, got 0"),
        (dict(nproc=2, schedule="interleaved", virtual=2, layers=3), "only n_layer=3"),
        (
            dict(nproc=4, schedule="interleaved", microbatches=6, batch_size=12),
            "microbatches divisible by stages",
        ),
        (
            dict(nproc=2, schedule="1f1b", virtual=2),
            "virtual=2 only applies to schedule='interleaved'",
        ),
        (dict(nproc=2, microbatches=3), "batch_size=16 is not divisible by microbatches=3"),
        (dict(nproc=2, schedule="zero-bubble"), "schedule='zero-bubble' is not one of"),
        (dict(nproc=4, schedule="zb-h1", microbatches=2), "use microbatches >= 4"),
        (dict(nproc=4, schedule="dualpipev", microbatches=4), "use microbatches >= 8"),
        (dict(nproc=2, schedule="dualpipev", virtual=3), "dualpipev holds 2 chunks per rank"),
        (dict(nproc=2, schedule="naive", microbatches=4), "use microbatches=1"),
        (dict(nproc=2, plan=(3, 3)), r"plan=\(3, 3\) must give 2 stages"),
        (dict(nproc=2, op_time=-1.0), "op_time=-1.0"),
        (dict(nproc=2, measure_steps=0), "measure_steps=0 must be >= 1"),
    ],
)
def test_bad_options_fail_before_any_rank_starts(options, message):
    with pytest.raises(ValueError, match=message):
        lab.run(**options)


def test_a_model_without_layers_is_an_error_naming_n_layer():
    from labs.theory.dims import ParallelDims

    with pytest.raises(ValueError, match="n_layer must be an integer >= 1, got 0"):
        ParallelDims(pp=4).check_model(n_layer=0)


def test_plans():
    assert lab.make_plan("1f1b", MODEL, 4, 1) == (2, 2, 2, 2)
    assert lab.make_plan("interleaved", MODEL, 2, 2) == (2, 2, 2, 2)
    assert lab.make_plan("1f1b", MODEL, 2, 1, plan=(5, 3)) == (5, 3)
    # naive fills device after device up to the balanced split's largest stage
    assert sum(lab.make_plan("naive", ModelConfig(n_layer=6), 4, 1)) == 6
    counts = lab.stage_params(MODEL, (2, 2, 2, 2), 4)
    model = build_model(MODEL)
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    # DualPipeV's V: rank 0 holds the first stage (embedding) and the last (norm and head)
    v = lab.stage_params(MODEL, (1,) * 8, 4, "dualpipev")
    assert sum(v) == sum(counts) and v[0] == max(v) and v[1] == v[2] == v[3]
    assert lab.loss_rank("dualpipev", 4, 2) == 0 and lab.loss_rank("1f1b", 4, 1) == 3


def bf16_one_f_one_b(microbatches: int) -> dict:
    """A 2-stage 1F1B step of the bf16 course model (tables, activations and messages in bf16), on
    this rank's device, under the ledger."""
    from labs.measure import CommLedger
    from labs.runtime.device import rank_device
    from labs.runtime.impl import exercise
    from labs.runtime.pipe import pipe_group

    pp = exercise("pipeline_parallel")
    device = rank_device()
    pipe = pipe_group(dtype=torch.bfloat16)
    model = build_model(MODEL, device=device, dtype=torch.bfloat16)
    stage = pp.build_stage(model, plan=(4, 4), stage=pipe.rank)
    x, y = data_for(TrainConfig(steps=1, batch_size=8))[0]
    batches = lab.split_microbatches(x.to(device), y.to(device), microbatches)
    with CommLedger() as ledger:
        loss = pp.train_step_1f1b(stage, batches, pipe=pipe)
    return {
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
        "sent": [r.payload_bytes for r in ledger.records if r.op == "isend"],
    }


@pytest.mark.exercise
def test_a_bf16_pipeline_matches_a_bf16_reference():
    """Stages build their rotary tables in the model's dtype (through the model's own block
    runner) and the point-to-point messages carry it: a bf16 1F1B pipeline on gloo equals the bf16
    model run in one process, within the table's bf16 tolerance."""
    model = build_model(MODEL, dtype=torch.bfloat16)
    x, y = data_for(TrainConfig(steps=1, batch_size=8))[0]
    _, ref_loss = model(x, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    first, last = launch(bf16_one_f_one_b, 2, 2, timeout=120)
    tol = rule("value", torch.bfloat16, "gloo").rel
    assert last["loss"] == pytest.approx(ref_loss.item(), rel=tol)
    for rank, r in enumerate((first, last)):
        assert {g.dtype for g in r["grads"].values()} == {torch.bfloat16}
        assert_close_tensors(
            r["grads"],
            {n: ref_grads[n] for n in r["grads"]},
            dtype=torch.bfloat16,
            what="gradient",
            step=1,
            rank=rank,
        )
    # each message is a micro-batch's [b, T, H] activation (or its gradient) in bf16: 2 bytes
    message = 4 * TrainConfig().seq_len * MODEL.n_embd * torch.bfloat16.itemsize
    assert first["sent"] == [message] * 2 and last["sent"] == [message] * 2


def test_the_schedules_carry_no_instrumentation():
    """A schedule's signature is the lesson's: its stage(s), the micro-batches and the pipe; the
    timeline is the harness's (``labs.runtime.pipe.record_ops``)."""
    import inspect

    from labs.runtime.impl import exercise

    pp = exercise("pipeline_parallel")
    for name in ("train_step_afab", "train_step_1f1b", "train_step_zb_h1"):
        assert list(inspect.signature(getattr(pp, name)).parameters) == [
            "stage",
            "microbatches",
            "pipe",
        ], name
    assert list(inspect.signature(pp.train_step_interleaved).parameters) == [
        "chunks",
        "microbatches",
        "pipe",
    ]
    assert list(inspect.signature(pp.naive_forward).parameters) == ["stage", "tokens", "pipe"]


def test_record_ops_names_each_operation_by_micro_batch_and_chunk():
    """The pipe's record of a schedule, in one process: a forward's micro-batch is found from its
    targets (the same tensor or a view of the same memory), a backward's from the output it starts
    from, a chunk from the stage; a stage's forward outside forward_step (naive) is an "F" of its
    own; the lesson's functions are restored afterwards."""
    import types

    from labs.measure import Timeline
    from labs.runtime.pipe import record_ops

    lesson = types.ModuleType("lesson")
    lesson.forward_step = lambda stage, inputs, targets, *, n_microbatches: stage(inputs) * 2
    lesson.backward_step = lambda inputs, output, output_grad: None
    lesson.backward_input_step = lambda inputs, output, output_grad: None
    lesson.backward_weight_step = lambda stage, output, output_grad: None
    original = lesson.forward_step
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    y = torch.arange(8).view(4, 2)
    targets = y.chunk(2)
    timeline = Timeline(barrier=False)
    x = torch.ones(2, 2)
    with record_ops(lesson, timeline, chunks=chunks, targets=targets):
        late = lesson.forward_step(chunks[1], x, y.chunk(2)[1], n_microbatches=2)  # a new view
        early = lesson.forward_step(chunks[0], x, targets[0], n_microbatches=2)
        lesson.backward_input_step(x, late, None)
        lesson.backward_weight_step(chunks[1], late, None)
        lesson.backward_step(x, early, None)
        chunks[0](x)  # naive placement: the stage called directly
    assert lesson.forward_step is original
    assert [(e.name, e.meta["microbatch"], e.meta["chunk"]) for e in timeline.events] == [
        ("F", 1, 1),
        ("F", 0, 0),
        ("B", 1, 1),
        ("W", 1, 1),
        ("B", 0, 0),
        ("F", 1, 0),  # chunk 0's second forward
    ]
    assert not chunks[0]._forward_pre_hooks and not chunks[0]._forward_hooks
