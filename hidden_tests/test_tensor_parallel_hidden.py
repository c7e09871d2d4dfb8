"""Hidden checks for exercise 04, part 2 (graded, never released): tensor and sequence parallelism
on model shapes and degrees the public tests do not use, and on sub-groups.

The public tests run the course model (8 query heads, 4 kv heads, untied) on tp = 2 and 4. Here:
tp = 3 with sequence parallelism (6 heads, 3 kv heads, a vocabulary of 258); plain multi-head
attention with tied embeddings and three layers; 4 query heads per kv head on a rank; and two
tensor-parallel groups of two ranks side by side on four ranks.
"""

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import tp as experiment
from labs.experiments.checks import matches
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from labs.train import TrainConfig, data_for, rule

pytestmark = pytest.mark.exercise

TOL = rule("value", torch.float32).rel  # fp32: a sum over ranks adds in another order


@pytest.mark.parametrize(
    "tp, sp, cfg, seq_len",
    [
        (
            3,
            True,
            ModelConfig(n_embd=48, n_head=6, n_kv_head=3, ffn_hidden=96, vocab_size=258),
            24,
        ),
        (2, False, ModelConfig(n_layer=3, n_head=4, n_kv_head=4, tie_embeddings=True), 32),
        (2, True, ModelConfig(n_kv_head=2), 32),
    ],
    ids=["tp3-sp-6-heads-vocab-258", "tp2-mha-tied-3-layers", "tp2-sp-4-queries-per-kv-head"],
)
def test_other_shapes_and_degrees_pass_the_verdict(tp, sp, cfg, seq_len):
    """Two steps: logits, loss, every gradient and the losses against the unsharded model, the
    collectives and bytes against the theory, the state held against the calculator."""
    s = experiment.run(nproc=tp, steps=2, sp=sp, model_cfg=cfg, seq_len=seq_len)
    assert s.passed, s.verdict()
    assert s["matches_reference"] and matches(s.checks, "theory"), s.verdict()
    assert s["max_rel_logit_diff"] <= TOL and s["max_rel_grad_diff"] <= TOL, s.verdict()
    assert s["logits_shape_per_rank"][-1] == cfg.vocab_size // tp  # the vocabulary stays split


def two_tp_groups(sp):
    """Ranks {0, 1} and {2, 3}: two tensor-parallel copies of the same model, each on its group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[dist.get_rank() // 2]
    cfg = ModelConfig()
    model = exercise("tensor_parallel").apply_tensor_parallel(
        build_model(cfg, seed=0), group=group, sequence_parallel=sp
    )
    x, y = data_for(TrainConfig(batch_size=4, seq_len=32))[0]
    logits, loss = model(x, y)
    loss.backward()
    norm = model.norm.weight.grad  # replicated: every rank of a group holds the whole gradient
    return logits.detach(), loss.item(), norm.clone()


@pytest.mark.parametrize("sp", [False, True])
def test_two_tensor_parallel_groups_side_by_side(sp):
    cfg = ModelConfig()
    full = build_model(cfg, seed=0)
    x, y = data_for(TrainConfig(batch_size=4, seq_len=32))[0]
    logits, loss = full(x, y)
    loss.backward()
    logits, loss = logits.detach(), loss.item()
    results = launch(two_tp_groups, 4, sp, timeout=120)
    for first in (0, 2):
        pair = results[first : first + 2]
        joined = torch.cat([r[0] for r in pair], dim=-1)  # [B, T, V]: rank order is vocab order
        rel = float((joined - logits).abs().max() / logits.abs().max())
        assert rel <= TOL, f"ranks {first}, {first + 1}: logits off by {rel:.2e}"
        for rank, (_, rank_loss, norm_grad) in enumerate(pair, start=first):
            assert abs(rank_loss - loss) <= TOL * loss, f"rank {rank}: loss"
            torch.testing.assert_close(
                norm_grad, full.norm.weight.grad, rtol=TOL, atol=1e-7, msg=f"rank {rank}: norm"
            )
