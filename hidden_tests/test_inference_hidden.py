"""Hidden checks for exercise 09 (graded, never released): prompts of one token, a vocabulary that
does not split evenly in bytes per rank, greedy on a sub-group, other model shapes, and placement on
four devices.

The public tests generate from prompts of 6 to 16 tokens with the 4-layer course model, run greedy
on the default group of 2 or 4 ranks (vocabulary 256), TP on 2 and 4 ranks and placement on 2 and
3. Here: a one-token prompt beside longer ones (left padding of 15), greedy over 3 ranks on a
vocabulary of 258 and over two groups of two, plain multi-head attention with 3 layers in both
modes, and one layer per device on 4 devices.
"""

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import infer
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from tests.helpers import in_child

pytestmark = pytest.mark.exercise


def test_a_one_token_prompt_beside_longer_ones():
    model = build_model(infer.CONFIG, seed=0).eval()
    prompts = [infer.make_prompts(3)[1], [72], infer.make_prompts(3)[0][:2]]  # 1 and 2 tokens
    with torch.no_grad():
        reference = infer.no_cache_tokens(model, prompts, 5)
    together, alone = in_child(_generated, prompts)
    assert torch.equal(together, reference), (together, reference)
    assert torch.equal(alone[0], reference[1]), "the one-token prompt alone"


def _generated(prompts):
    """The learner's tokens for ``prompts`` together, and for the one-token prompt alone (in a
    child: exercise code never runs in the test process)."""
    model = build_model(infer.CONFIG, seed=0).eval()
    with torch.no_grad():
        together = exercise("inference").generate(model, prompts, new_tokens=5).tokens
        alone = exercise("inference").generate(model, [[72]], new_tokens=5).tokens
    return together.detach().clone(), alone.detach().clone()


def greedy_worker(vocab, groups):
    """Logits [4, V] split over the ranks of this rank's group. Rows: a tie between the first and
    the last rank's parts (the lower id wins), a maximum in the middle rank's part, all equal, a
    maximum at the very last id."""
    handles = [dist.new_group(g) for g in groups]
    rank = dist.get_rank()
    members, group = next((g, h) for g, h in zip(groups, handles) if rank in g)
    full = torch.randn(4, vocab, generator=torch.Generator().manual_seed(members[0]))
    full[0, [3, vocab - 2]] = 9.0
    full[1, vocab // 2] = 9.0
    full[2] = -1.0
    full[3, vocab - 1] = 9.0
    mine = full.chunk(len(members), dim=-1)[members.index(rank)]
    return exercise("inference").greedy(mine, group), full.argmax(-1)


@pytest.mark.parametrize(
    "nproc, vocab, groups",
    [(3, 258, [[0, 1, 2]]), (4, 256, [[0, 2], [1, 3]])],
    ids=["3-ranks-vocab-258", "two-groups-of-2"],
)
def test_vocab_parallel_greedy_on_odd_splits_and_sub_groups(nproc, vocab, groups):
    for rank, (got, expected) in enumerate(launch(greedy_worker, nproc, vocab, groups)):
        assert expected[[0, 1, 2, 3]].tolist() == [3, vocab // 2, 0, vocab - 1]
        assert torch.equal(got, expected), f"rank {rank}: {got.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize(
    "kw",
    [
        dict(nproc=2, mode="both", model_cfg=ModelConfig(n_layer=3, n_head=4, n_kv_head=4)),
        dict(nproc=4, mode="placement", model_cfg=ModelConfig(n_layer=4)),
    ],
    ids=["mha-3-layers-both-modes", "placement-one-layer-per-device"],
)
def test_other_models_and_placements_match_their_reference(kw):
    """Tokens against generation without a cache; cache and weight bytes per rank and the
    collectives per token against labs.theory.inference."""
    s = infer.run(steps=1, prompts=3, new_tokens=5, **kw)
    assert s.passed, s.verdict()
    assert s["matches_reference"], s.verdict()
