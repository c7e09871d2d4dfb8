"""The ring-attention stepper's backward view (notebook 06): which dQ, dK, dV pieces travel where,
on paper and drawn headless. ``tests/test_context_parallel.py`` checks the same messages against
the lab running on gloo."""

import matplotlib.pyplot as plt
import pytest

from labs.theory import context_parallel as cpt
from labs.widgets.context_parallel import (
    _rows_html,
    draw_ring_step,
    gradient_progress,
    ring_stepper,
    step_rows,
)
from tests.helpers import assert_torch_free


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_blocks_gradient_gathers_every_ranks_share_once_and_ends_home(cp):
    schedule = cpt.ring_backward_schedule(cp)
    forward = cpt.ring_schedule(cp)
    shares = {b: [b] for b in range(cp)}  # step 0: each owner keeps its own share
    for s, step in enumerate(schedule):
        for e, f in zip(step, forward[s]):
            assert e["blocks"] == f["blocks"] and e["kv_from"] == f["kv_from"]  # recomputed
            assert e["dq_chunks"] == e["q_chunks"] and e["dkv_block"] == e["kv_from"]
            if s > 0:
                assert e["acc_ranks"][-1] == e["rank"]  # it adds its share last
        arrived = [e for e in step if e["dkv_home"]]
        for e in arrived:
            assert e["sends_dkv_to"] == e["dkv_block"]  # the owner
            shares[e["dkv_block"]] += e["acc_ranks"]
    for b, ranks in shares.items():
        assert sorted(ranks) == list(range(cp)), (b, ranks)


@pytest.mark.parametrize("cp", [2, 4])
def test_messages_per_rank_are_the_backwards_bytes(cp):
    """CP−1 K/V blocks and CP−1 accumulators of the same size: 2 (CP−1)/CP · KV."""
    kv = 12288
    per_message = kv / cp
    for r in range(cp):
        sent = sum(
            (e[r]["sends_kv_to"] is not None) + (e[r]["sends_dkv_to"] is not None)
            for e in cpt.ring_backward_schedule(cp)
        )
        assert sent * per_message == cpt.ring_bytes_per_rank(cp=cp, kv=kv)["backward"]


def test_the_stepper_draws_the_backward_headless():
    for step in range(4):
        fig, rows = draw_ring_step(4, step, backward=True)
        plt.close(fig)
        assert [r["dkv_block"] for r in rows] == [(r - step) % 4 for r in range(4)]
    progress = [gradient_progress(4, s) for s in range(4)]
    assert [p["home"] + p["travelling"] for p in progress[1]] == [2] * 4  # owner + one rank
    assert progress[2][0]["at_rank"] == 3  # block 0's accumulator, two hops from home
    assert [p["home"] for p in progress[-1]] == [4] * 4 and progress[-1][0]["at_rank"] is None
    table = _rows_html(step_rows(4, 3, backward=True))
    assert "to rank 1 (home), with the shares of ranks [2, 3, 0]" in table
    assert "keeps it (its own block)" in _rows_html(step_rows(4, 0, backward=True))
    ui = ring_stepper(cp=3)
    plt.close("all")
    toggles = [
        c for c in ui.children[0].children if getattr(c, "description", "") == "backward pass"
    ]
    assert len(toggles) == 1
    toggles[0].value = True  # redraws the backward view
    plt.close("all")
    assert "dQ of its queries (local)" in ui.children[3].value


def test_the_backward_view_needs_no_torch():
    assert_torch_free(
        "import labs.widgets.context_parallel as w\nw.draw_ring_step(3, 2, backward=True)"
    )
