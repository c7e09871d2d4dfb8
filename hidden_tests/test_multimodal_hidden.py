"""Hidden checks for exercise 11 (graded, never released): the multimodal model with other
micro-batch counts, three data-parallel ranks, ZeRO-1, and a smaller tensor-parallel batch.

The public tests run the pipeline with 4 micro-batches, data parallelism on 2 and 4 ranks with DDP,
ZeRO-2 and ZeRO-3, and tensor parallelism with a batch of 8. Each run below is the lab's own (two
steps): losses, gradients, bytes sent and state held against the single-process run and the
theory.
"""

import pytest

from labs.experiments import multimodal as experiment

pytestmark = pytest.mark.exercise


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="pp", nproc=2, microbatches=8, split=(1, 3)),
        dict(mode="pp", nproc=3, microbatches=2, split=(1, 2, 1)),
        dict(mode="dp", nproc=3, batch_size=6, zero=0),
        dict(mode="dp", nproc=3, batch_size=6, zero=2),
        dict(mode="dp", nproc=2, zero=1),
        dict(mode="tp", nproc=2, batch_size=4),
    ],
    ids=["pp2-M8", "pp3-M2", "dp3-ddp", "dp3-zero2", "dp2-zero1", "tp2-batch4"],
)
def test_other_plans_match_the_single_process_run(kw):
    s = experiment.run(steps=2, **kw)
    assert s.passed, s.verdict()
    assert s["matches_reference"], s.verdict()
