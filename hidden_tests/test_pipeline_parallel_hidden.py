"""Hidden checks for exercise 05 (graded, never released): every schedule on three stages with
uneven layer plans, a stage with no layers, one micro-batch, and ZB-H1 and interleaved 1F1B on
process sub-groups.

The public tests run 2 and 4 stages with balanced plans, and only 1F1B on sub-groups. Each run
below is the lab's own (two steps, no padding): losses, step-1 gradients, parameters after the
last step, each rank's order of operations, bytes per send, micro-batches held and state bytes
against the reference and the theory.
"""

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import pp as lab
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from labs.runtime.pipe import pipe_group
from labs.train import TrainConfig, assert_close_tensors, data_for

pytestmark = pytest.mark.exercise


@pytest.mark.parametrize(
    "schedule, microbatches, plan, virtual",
    [
        ("gpipe", 5, (1, 2, 3), None),
        ("1f1b", 5, (3, 2, 1), None),
        ("zb-h1", 5, (2, 3, 1), None),
        ("interleaved", 3, (1, 1, 1, 1, 1, 1), 2),
        ("1f1b", 1, (2, 2, 2), None),  # one micro-batch: warm-up and cool-down only
    ],
    ids=["gpipe-M5-1.2.3", "1f1b-M5-3.2.1", "zb-h1-M5-2.3.1", "interleaved-V2-M3", "1f1b-M1"],
)
def test_three_stages_uneven_plans(schedule, microbatches, plan, virtual):
    s = lab.run(
        nproc=3,
        steps=2,
        schedule=schedule,
        microbatches=microbatches,
        virtual=virtual,
        layers=6,
        plan=plan,
        batch_size=3 * microbatches,
        op_time=0.0,
    )
    assert s.passed, s.verdict()


def test_naive_placement_with_an_empty_middle_stage():
    """device_map-style placement with nothing on the second device: its stage only passes the
    activations on. The logits equal the unsplit model's."""
    s = lab.run(nproc=3, steps=1, schedule="naive", layers=6, plan=(3, 0, 3), batch_size=4)
    assert s.passed, s.verdict()


MODEL = ModelConfig(n_layer=4)


def pipelines_on_sub_groups(schedule):
    """4 ranks as two pipelines of 2 stages on the sub-groups {0, 2} and {1, 3} (the mesh lab's pp
    groups): the peers come from the group, not from the global rank."""
    pp = exercise("pipeline_parallel")
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe = pipe_group(groups[dist.get_rank() % 2])
    model = build_model(MODEL)
    x, y = data_for(TrainConfig(steps=1, batch_size=8))[0]
    microbatches = lab.split_microbatches(x, y, 4)
    if schedule == "interleaved":  # chunk c of this rank is virtual stage c·P + rank: 1 layer each
        chunks = [
            pp.build_stage(model, plan=(1, 1, 1, 1), stage=c * 2 + pipe.rank) for c in range(2)
        ]
        loss = pp.train_step_interleaved(chunks, microbatches, pipe=pipe)
        params = {n: p for chunk in chunks for n, p in chunk.named_parameters()}
    else:
        stage = pp.build_stage(model, plan=(2, 2), stage=pipe.rank)
        loss = pp.train_step_zb_h1(stage, microbatches, pipe=pipe)
        params = dict(stage.named_parameters())
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in params.items()}}


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
def test_zero_bubble_and_interleaved_on_sub_groups(schedule):
    ref = lab.reference_run(MODEL, TrainConfig(steps=1, batch_size=8))
    results = launch(pipelines_on_sub_groups, 4, schedule, timeout=120)
    for rank, r in enumerate(results):
        assert_close_tensors(
            r["grads"], {n: ref.grads[n] for n in r["grads"]}, what="gradient", step=1, rank=rank
        )
    for rank in (0, 1):  # first stages: every parameter is in one of the two stages of a pipeline
        names = set(results[rank]["grads"]) | set(results[rank + 2]["grads"])
        assert names == set(ref.grads), f"pipeline of rank {rank}: {sorted(names)}"
    for rank in (2, 3):  # the last stages hold the loss
        assert results[rank]["loss"] == pytest.approx(ref.losses[0], rel=1e-5), rank
    assert torch.isfinite(torch.tensor(ref.losses[0]))
