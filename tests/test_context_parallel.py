"""Exercise 06: ring attention equals full attention (outputs and gradients), its bytes, work and
memory equal the theory, and the context-parallel course model trains like the reference."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs import launch
from labs.experiments import cp as lab
from labs.runtime import exercise
from labs.theory import context_parallel as cpt
from labs.train import max_rel_diff, rule
from tests.helpers import checks_ok, in_child, lab_json

TOL = rule("value", torch.float32).rel  # 1e-5: the ring adds the softmax terms in another order
RING = ("ring attention output", "ring attention dq", "ring attention dk, dv")
# The lab's parts (PARTS in labs/context_parallel.py): the forward ring (layout, mask, merge) is the
# core; RingAttention.backward and the context-parallel model are the "backward" extension.
BACKWARD = pytest.mark.part("backward")


@pytest.fixture(scope="module", params=[2, 4])
def forward_checked(request):
    """The four (causal, zigzag) cases on ``cp`` ranks, forward only, launched once per degree."""
    return request.param, lab.attention_check(nproc=request.param, backward=False)


@pytest.fixture(scope="module", params=[2, 4])
def checked(request):
    """The four (causal, zigzag) cases on ``cp`` ranks, launched once per degree."""
    return request.param, lab.attention_check(nproc=request.param)


@pytest.mark.exercise
def test_forward_output_bytes_and_work_equal_full_attention_and_the_stepper(forward_checked):
    """The core alone: the output, the forward's K/V messages (none in backward), the blocks each
    rank computes (the stepper's; zig-zag balances them) and the bytes saved for backward."""
    cp, rows = forward_checked
    assert len(rows) == 4
    for row in rows:
        where = f"cp={cp} causal={row['causal']} {row['layout']}"
        assert list(row["max_rel_diff"]) == ["out"], row["max_rel_diff"]
        assert row["max_rel_diff"]["out"] <= TOL, (where, row["max_rel_diff"])
        assert row["sent_forward"] == [(cp - 1) / cp * row["kv_bytes"]] * cp, where
        assert row["sent_backward"] == [0] * cp, where
        assert row["blocks_measured_forward"] == row["blocks_theory"], where
        assert row["saved_bytes"] == [row["theory_saved_bytes"]] * cp, where
        assert all(c.ok for c in row["checks"]), (
            where,
            [c.name for c in row["checks"] if not c.ok],
        )
    by_case = {(r["causal"], r["zigzag"]): r["blocks_measured_forward"] for r in rows}
    assert len(set(by_case[True, True])) == 1, f"zig-zag work is unequal: {by_case[True, True]}"


@pytest.mark.exercise
@BACKWARD
def test_output_and_gradients_equal_full_attention(checked):
    cp, rows = checked
    assert len(rows) == 4
    for row in rows:
        for name, diff in row["max_rel_diff"].items():
            assert diff <= TOL, (
                f"cp={cp} causal={row['causal']} {row['layout']}: {name} differs from full "
                f"attention by {diff:.2e} (relative) > {TOL:g}"
            )


@pytest.mark.exercise
@BACKWARD
def test_kv_bytes_sent_equal_the_ring_formula(checked):
    cp, rows = checked
    for row in rows:
        kv = row["kv_bytes"]
        assert row["sent_forward"] == [(cp - 1) / cp * kv] * cp, row["sent_forward"]
        assert row["sent_backward"] == [2 * (cp - 1) / cp * kv] * cp, row["sent_backward"]


@pytest.mark.exercise
@BACKWARD
def test_measured_work_per_rank_is_the_steppers_and_zigzag_balances_it(checked):
    cp, rows = checked
    for row in rows:
        # Forward: matmul FLOPs really spent, in units of one chunk block; backward: block kernel
        # calls.
        assert row["blocks_measured_forward"] == row["blocks_theory"], row
        assert row["blocks_measured_backward"] == row["blocks_theory"], row
    by_case = {(r["causal"], r["zigzag"]): r["blocks_measured_forward"] for r in rows}
    assert len(set(by_case[True, True])) == 1, f"zig-zag work is unequal: {by_case[True, True]}"
    assert (
        by_case[True, False] == sorted(by_case[True, False])
        and len(set(by_case[True, False])) == cp
    )
    assert sum(by_case[True, True]) == sum(by_case[True, False]) == cp * (2 * cp + 1)


@pytest.mark.exercise
@BACKWARD
def test_saved_activations_equal_the_formula(checked):
    cp, rows = checked
    for row in rows:
        assert row["saved_bytes"] == [row["theory_saved_bytes"]] * cp


def test_sequence_not_divisible_by_two_cp_is_a_clear_error(exercise):
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2\*cp"):
        exercise("context_parallel").split_sequence(torch.zeros(1, 10), cp=4, rank=0)
    with pytest.raises(ValueError, match=r"seq_len=36 is not divisible by cp\*2=8"):
        lab.run(nproc=4, seq=36)  # before any rank starts


def zigzag_case(exercise, y):
    """The learner's splits of a small sequence, chunk ids, round trips of ``y`` and block
    kinds."""
    cpm = exercise("context_parallel")
    x = torch.arange(8).view(1, 8)
    seen = {
        "splits": [
            cpm.split_sequence(x, cp=2, rank=0).tolist(),
            cpm.split_sequence(x, cp=2, rank=1).tolist(),
            cpm.split_sequence(x, cp=2, rank=1, zigzag=False).tolist(),
        ],
        "kinds": [cpm.block_kind(2, k) for k in (1, 2, 3)],
    }
    for cp in (1, 2, 3, 4):
        for zigzag in (True, False):
            parts = [cpm.split_sequence(y, cp=cp, rank=r, zigzag=zigzag) for r in range(cp)]
            seen[cp, zigzag] = (
                [cpm.chunk_ids(r, cp, zigzag) for r in range(cp)],
                cpm.unsplit_sequence(parts, zigzag=zigzag),
            )
    return seen


@pytest.mark.exercise
def test_zigzag_split_and_unsplit(exercise):
    y = torch.randn(2, 24, 3)
    seen = in_child(zigzag_case, exercise, y)
    assert seen["splits"] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]], [[4, 5, 6, 7]]]
    for cp in (1, 2, 3, 4):
        for zigzag in (True, False):
            chunk_ids, round_trip = seen[cp, zigzag]
            assert chunk_ids == [cpt.chunk_ids(r, cp, zigzag) for r in range(cp)]
            assert torch.equal(round_trip, y)
    assert seen["kinds"] == ["full", "diagonal", "masked"]


def merge_case(exercise, q, k, v):
    """The learner's attention over three blocks of keys, merged in two orders."""
    cpm = exercise("context_parallel")
    parts = [
        cpm.attention_block(q, k[:, :, s], v[:, :, s], causal=False, scale=8**-0.5)
        for s in (slice(0, 3), slice(3, 7), slice(7, 10))
    ]
    (o1, l1), (o2, l2), (o3, l3) = parts
    out, lse = cpm.merge_partials(*cpm.merge_partials(o1, l1, o2, l2), o3, l3)
    swapped, _ = cpm.merge_partials(*cpm.merge_partials(o3, l3, o1, l1), o2, l2)
    return out, lse, swapped


@pytest.mark.exercise
def test_merge_rule_equals_attention_over_all_keys(exercise):
    g = torch.Generator().manual_seed(0)
    # large logits: a naive exp(lse) would overflow
    q = torch.randn(2, 4, 6, 8, generator=g) * 30
    k = torch.randn(2, 2, 10, 8, generator=g)
    v = torch.randn(2, 2, 10, 8, generator=g)
    whole = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out, lse, swapped = in_child(merge_case, exercise, q, k, v)
    assert max_rel_diff(out, whole) <= TOL
    assert (
        max_rel_diff(lse, (q @ k.repeat_interleave(2, 1).transpose(-2, -1) * 8**-0.5).logsumexp(-1))
        <= TOL
    )
    assert max_rel_diff(swapped, whole) <= TOL  # the order of the blocks does not matter
    assert torch.isfinite(out).all()


def subgroup_worker(shape, backward):
    cpm = exercise("context_parallel")
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[dist.get_rank() % 2]
    me = dist.get_rank(group)
    cp = dist.get_world_size(group)
    q, k, v, dout = (cpm.split_sequence(t, cp=cp, rank=me, dim=2) for t in lab.make_qkv(shape))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cpm.ring_attention(q, k, v, group, causal=True, zigzag=True)
    if not backward:
        return {"out": out.detach()}
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.exercise
@pytest.mark.parametrize("backward", [False, pytest.param(True, marks=BACKWARD)])
def test_ring_on_a_sub_group_uses_global_ranks_for_its_peers(exercise, backward):
    shape = lab.AttnShape(seq_len=32)
    per_rank = launch(subgroup_worker, 4, shape, backward)
    ref = lab.reference_attention(shape, causal=True)
    for members in ([0, 2], [1, 3]):
        for name in ("out", "dq", "dk", "dv") if backward else ("out",):
            got = lab.reassemble([per_rank[r][name] for r in members], zigzag=True, dim=2)
            assert max_rel_diff(got, ref[name]) <= TOL, f"group {members}: {name}"


def event_worker(shape, backward):
    """The order of this rank's exchanges and block computations, forward and backward."""
    cpm = exercise("context_parallel")
    events = []

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return wrapper

    me = dist.get_rank()
    cp = dist.get_world_size()
    q, k, v, dout = (cpm.split_sequence(t, cp=cp, rank=me, dim=2) for t in lab.make_qkv(shape))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with (
        mock.patch.object(dist, "batch_isend_irecv", recording("post", dist.batch_isend_irecv)),
        mock.patch.object(cpm, "attention_block", recording("block", cpm.attention_block)),
        mock.patch.object(
            cpm, "attention_block_backward", recording("block", cpm.attention_block_backward)
        ),
    ):
        out = cpm.ring_attention(q, k, v, dist.group.WORLD, causal=False)
        forward = list(events)
        events.clear()
        if backward:
            out.backward(dout)
    return forward, events


def _posted_before_each_step(events, cp):
    """True when each of the first cp-1 runs of block computations directly follows a post."""
    starts = [
        i for i, e in enumerate(events) if e == "block" and (i == 0 or events[i - 1] != "block")
    ]
    return len(starts) == cp and all(i > 0 and events[i - 1] == "post" for i in starts[:-1])


@pytest.mark.exercise
@pytest.mark.parametrize("with_backward", [False, pytest.param(True, marks=BACKWARD)])
def test_the_next_kv_block_is_posted_before_computing_on_this_one(with_backward):
    forward, backward = launch(event_worker, 4, lab.AttnShape(seq_len=32), with_backward)[0]
    # No mask: 4 blocks per step; each of the first 3 steps posts the next K/V first, then computes.
    assert forward == ["post", "block", "block", "block", "block"] * 3 + ["block"] * 4, forward
    if with_backward:
        assert _posted_before_each_step(backward, 4) and backward.count("post") >= 6, backward


def backward_posts_worker(shape):
    """The messages this rank posts in the backward pass: (what, to rank, from rank) in order."""
    cpm = exercise("context_parallel")
    me = dist.get_rank()
    cp = dist.get_world_size()
    q, k, v, dout = (cpm.split_sequence(t, cp=cp, rank=me, dim=2) for t in lab.make_qkv(shape))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cpm.ring_attention(q, k, v, dist.group.WORLD, causal=True)
    posts = []
    post_exchange = cpm.post_exchange

    def recording(send, recv, to_rank, from_rank, group=None, tag=0):
        what = {cpm.KV_TAG: "K/V", cpm.DKV_TAG: "dK/dV"}[tag]
        posts.append((what, to_rank, from_rank))
        return post_exchange(send, recv, to_rank, from_rank, group, tag)

    with mock.patch.object(cpm, "post_exchange", recording):
        out.backward(dout)
    return posts


@pytest.mark.exercise
@BACKWARD
def test_the_backward_ring_sends_what_the_stepper_draws():
    """Notebook 06's stepper, backward view (``labs.theory.context_parallel.
    ring_backward_schedule``): every step but the last posts the next K/V to r+1, every step but
    the first sends the dK/dV accumulator on to r+1; dQ never travels."""
    cp = 4
    posts = launch(backward_posts_worker, cp, lab.AttnShape(seq_len=32))
    for r, mine in enumerate(posts):
        expected = []
        for step in cpt.ring_backward_schedule(cp):
            e = step[r]
            expected += [("K/V", e["sends_kv_to"], (r - 1) % cp)] * (e["sends_kv_to"] is not None)
            expected += [("dK/dV", e["sends_dkv_to"], (r - 1) % cp)] * (
                e["sends_dkv_to"] is not None
            )
        assert mine == expected, (r, mine)


@pytest.mark.exercise
@BACKWARD
@pytest.mark.parametrize("cp, zigzag", [(2, True), (4, True), (4, False)])
def test_cp_model_trains_like_the_reference(cp, zigzag):
    summary = lab.run(nproc=cp, steps=5, zigzag=zigzag, seq=32)
    assert checks_ok(summary, *RING), summary.verdict()
    assert summary["matches_reference"], (summary["losses"], summary["reference_losses"])
    assert summary["max_rel_grad_diff"] <= TOL and checks_ok(summary, "gradients after step 1")
    assert summary["comm_bytes_by_phase"] == summary["theory_comm_bytes_by_phase"]
    assert summary.passed, summary.verdict()
    assert summary["state_bytes_per_rank"] == [summary["theory_state_bytes_per_rank"]] * cp
    assert summary["theory_saved_activation_bytes"] == summary["saved_activation_bytes_per_rank"][0]


@pytest.mark.exercise
@BACKWARD
def test_activation_memory_per_rank_falls_as_one_over_cp():
    rows = lab.memory_scaling(cps=(1, 2, 4))
    for row in rows:
        assert row["attention_saved"] == row["attention_theory"]
        assert row["attention_fraction"] == 1 / row["cp"]
        # The whole model: every saved tensor is per token, but for cross-entropy's 4-byte scalar.
        assert row["model_fraction"] == pytest.approx(1 / row["cp"], rel=1e-4)
        # Notebook 01's calculator (labs.theory.memory.memory_per_rank).
        assert row["calculator"] == row["model_saved"], row


@pytest.mark.exercise
@BACKWARD
def test_cli_summary_without_a_causal_mask():
    summary = lab_json(
        "cp",
        "--nproc",
        "2",
        "--no-causal",
        "--no-zigzag",
        "--seq",
        "16",
        "--json",
    )
    assert (
        summary["lab"] == "cp"
        and summary["nproc"] == 2
        and not summary["causal"]
        and not summary["zigzag"]
    )
    assert checks_ok(summary, *RING) and "skipped" in summary["training"]
