"""Hidden checks for exercise 06 (graded, never released): ring attention and the
context-parallel model on three ranks, and attention shapes the public tests do not use.

The public tests run cp = 2 and 4 with 4 query heads on 2 kv heads (head dim 8, batch 2). Here:
cp = 3 (6 chunks; zig-zag pairs chunk r with 5 - r), plain multi-head attention, 4 query heads per
kv head, head dim 16 and a batch of one, each causal and not, zig-zag and contiguous.
"""

import pytest
import torch

from labs.experiments import cp as lab
from labs.train import rule

pytestmark = pytest.mark.exercise

TOL = rule("value", torch.float32).rel  # 1e-5: the ring adds the softmax terms in another order


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
def test_three_ranks_train_like_the_reference(zigzag):
    """Ring attention (output, dq, dk, dv), the bytes it sends, the blocks each rank computes and
    the bytes it saves; then the course model trained two steps against the reference."""
    s = lab.run(nproc=3, steps=2, seq=24, zigzag=zigzag)
    assert s.passed, s.verdict()
    ring = ("ring attention output", "ring attention dq", "ring attention dk, dv")
    assert s["matches_reference"] and all(s.check(name).ok for name in ring), s.verdict()


@pytest.mark.parametrize(
    "nproc, shape",
    [
        (2, lab.AttnShape(batch=1, n_head=4, n_kv_head=4, head_dim=16, seq_len=16)),
        (3, lab.AttnShape(batch=1, n_head=8, n_kv_head=2, head_dim=8, seq_len=24)),
    ],
    ids=["cp2-mha-hd16-b1", "cp3-4-queries-per-kv-head"],
)
def test_other_attention_shapes_equal_full_attention(nproc, shape):
    """The four (causal, zig-zag) cases: outputs and gradients against full attention, bytes sent
    against the ring formula, blocks computed against the stepper."""
    rows = lab.attention_check(nproc=nproc, shape=shape)
    assert len(rows) == 4
    for row in rows:
        where = f"cp={nproc} causal={row['causal']} {row['layout']}"
        for name, diff in row["max_rel_diff"].items():
            assert diff <= TOL, f"{where}: {name} differs from full attention by {diff:.2e}"
        kv = row["kv_bytes"]
        assert row["sent_forward"] == [(nproc - 1) / nproc * kv] * nproc, where
        assert row["sent_backward"] == [2 * (nproc - 1) / nproc * kv] * nproc, where
        assert row["blocks_measured_forward"] == row["blocks_theory"], where
        assert row["saved_bytes"] == [row["theory_saved_bytes"]] * nproc, where
