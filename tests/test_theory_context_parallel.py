"""Context-parallel theory and the ring stepper's logic: pure Python, no processes, no torch."""

import pytest

from labs.theory import cli
from labs.theory import context_parallel as cpt
from tests.helpers import assert_torch_free


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [True, False])
def test_every_chunk_is_held_by_exactly_one_rank(cp, zigzag):
    held = sorted(c for r in range(cp) for c in cpt.chunk_ids(r, cp, zigzag))
    assert held == list(range(2 * cp))


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert [cpt.chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [cpt.chunk_ids(r, 4, zigzag=False) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_block_kinds():
    assert [cpt.block_kind(2, k) for k in (1, 2, 3)] == ["full", "diagonal", "masked"]
    assert {cpt.block_kind(2, k, causal=False) for k in range(5)} == {"full"}


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("zigzag", [True, False])
def test_the_ring_visits_every_block_once_and_each_rank_holds_a_different_kv(cp, zigzag):
    schedule = cpt.ring_schedule(cp, zigzag=zigzag)
    pairs = [(a, b) for step in schedule for e in step for a, b, _ in e["blocks"]]
    assert sorted(pairs) == [(a, b) for a in range(2 * cp) for b in range(2 * cp)]
    for s, step in enumerate(schedule):
        # a permutation: nothing held twice
        assert sorted(e["kv_from"] for e in step) == list(range(cp))
        assert all(e["kv_from"] == (e["rank"] - s) % cp for e in step)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(cp):
    zig = cpt.work_per_rank(cp, causal=True, zigzag=True)
    cont = cpt.work_per_rank(cp, causal=True, zigzag=False)
    # Each rank: 2(cp-1) full blocks from the other ranks, and its own 2 diagonals + 1 full.
    assert [w["computed"] for w in zig] == [2 * cp + 1] * cp
    assert [w["diagonal"] for w in zig] == [2] * cp
    # Contiguous: rank r sees 4 full blocks from each of the r ranks before it, plus its own 3.
    assert [w["computed"] for w in cont] == [4 * r + 3 for r in range(cp)]
    # The same total work either way: the lower triangle of a 2cp x 2cp grid, diagonal included.
    total = 2 * cp * (2 * cp + 1) // 2
    assert sum(w["computed"] for w in zig) == sum(w["computed"] for w in cont) == total
    assert cpt.imbalance(zig) == 1.0
    assert cpt.imbalance(cont) == pytest.approx((4 * cp - 1) / (2 * cp + 1))


def test_without_a_mask_every_rank_computes_every_block():
    for zigzag in (True, False):
        assert [w["computed"] for w in cpt.work_per_rank(4, causal=False, zigzag=zigzag)] == [
            16
        ] * 4


def test_work_accumulates_step_by_step():
    steps = [cpt.work_per_rank(4, zigzag=False, upto_step=s) for s in range(4)]
    assert [w["computed"] for w in steps[0]] == [3] * 4  # step 0: every rank its own block
    assert steps[-1] == cpt.work_per_rank(4, zigzag=False)
    with pytest.raises(ValueError, match="upto_step=4 is outside 0..3"):
        cpt.work_per_rank(4, upto_step=4)


def test_ring_bytes():
    kv = cpt.kv_bytes(batch=2, seq_len=48, n_kv_head=2, head_dim=8, itemsize=4)
    assert kv == 2 * 2 * 48 * 2 * 8 * 4
    assert cpt.ring_bytes_per_rank(cp=4, kv=kv) == {
        "forward": 0.75 * kv,
        "backward": 1.5 * kv,
        "total": 2.25 * kv,
    }
    assert cpt.ring_bytes_per_rank(cp=1, kv=kv)["total"] == 0


def test_saved_bytes_fall_as_one_over_cp():
    kw = dict(batch=2, seq_len=48, n_head=4, n_kv_head=2, head_dim=8)
    full = cpt.attention_saved_bytes(**kw)
    assert full == 2 * 48 * 8 * (2 * 4 + 2 * 2) * 4 + 2 * 4 * 48 * 4
    assert [cpt.attention_saved_bytes(cp=cp, **kw) for cp in (2, 4, 8)] == [
        full / 2,
        full / 4,
        full / 8,
    ]


def test_activation_formula_is_the_playbooks_at_cp1_and_divides_by_cp_with_flash():
    kw = dict(seq_len=4096, batch=1, hidden=4096, n_head=32, n_layer=32)
    naive = cpt.activation_bytes(flash=False, **kw)
    assert naive == 32 * 4096 * 1 * 4096 * (34 + 5 * 32 * 4096 / 4096)
    assert cpt.activation_bytes(cp=8, **kw) == cpt.activation_bytes(**kw) / 8


def test_long_context_table_is_the_memory_calculator_in_gib():
    """Notebook 06's table: the calculator's whole-model activations (notebook 01's model), in GiB;
    the playbook's formula only where asked for, and labelled."""
    from labs.theory.memory import GIB, memory_per_rank
    from labs.theory.presets import preset

    table = cpt.long_context_table(seq_lens=[4096, 131072], cps=(1, 8))
    spec = preset("llama3-8b")
    for row in table:
        for cp in (1, 8):
            want = memory_per_rank(spec, seq=row["seq_len"], mbs=1, cp=cp)["activation_bytes"]
            assert row[f"cp={cp}"] == want / GIB
    # linear in the tokens (flash attention keeps no T x T scores), split by CP but for the
    # loss's one scalar weight
    assert table[1]["cp=1"] == pytest.approx(32 * table[0]["cp=1"], rel=1e-6)
    assert table[1]["cp=8"] == pytest.approx(table[1]["cp=1"] / 8, rel=1e-9)
    assert table[0]["cp=1"] == pytest.approx(26.60, abs=0.01)  # = notebook 01's figure
    eager = cpt.long_context_table(seq_lens=[4096], cps=(1,), flash=False)
    playbook = cpt.activation_bytes(
        seq_len=4096, batch=1, hidden=4096, n_head=32, n_layer=32, flash=False
    )
    assert eager[0]["cp=1"] == playbook / GIB
    assert "GiB: the memory calculator" in cpt.format_long_context(table)
    assert "GiB: the playbook's formula" in cpt.format_long_context(eager, flash=False)


def test_above_the_threshold_a_ring_step_computes_longer_than_it_sends():
    kw = dict(n_head=32, n_kv_head=8, head_dim=128, itemsize=2)
    flops = 400e12
    bw = 50e9
    s = cpt.tokens_to_hide_comm(flops_per_s=flops, bytes_per_s=bw, **kw)
    # zig-zag: 2 full c x c
    compute = cpt.block_flops(batch=1, n_head=32, chunk=s / 2, head_dim=128) * 2 / flops
    transfer = cpt.kv_bytes(batch=1, seq_len=int(s), n_kv_head=8, head_dim=128, itemsize=2) / bw
    assert compute == pytest.approx(transfer)
    assert (
        cpt.block_flops(batch=1, n_head=2, chunk=4, head_dim=8, backward=True)
        == 2.5 * cpt.block_flops(batch=1, n_head=2, chunk=4, head_dim=8)
        == 2.5 * 2 * 2 * 1 * 2 * 4 * 4 * 8
    )
    assert cpt.tokens_to_hide_comm(
        flops_per_s=flops, bytes_per_s=bw, causal=False, **kw
    ) == pytest.approx(s / 2)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: cpt.check_cp(4, seq_len=36),
            r"seq_len=36 is not divisible by 2\*cp=8; use 2\*cp in \{1,2,3,4,6,9",
        ),
        (lambda: cpt.check_cp(0), "cp must be an integer >= 1"),
        (lambda: cpt.chunk_ids(4, 4), "rank=4 is outside 0..3"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_cli_result():
    result = cli.run(["cp", "--cp", "4", "--no-zigzag"])
    assert result == cpt.work_summary(4, causal=True, zigzag=False)
    assert result["blocks_computed_per_rank"] == [3, 7, 11, 15] and result["layout"] == "contiguous"


def test_theory_and_stepper_never_import_torch():
    assert_torch_free(
        "import labs.theory.context_parallel, labs.widgets.context_parallel as w\n"
        "w.draw_ring_step(3, 1)"
    )


def test_stepper_draws_each_step_and_reports_the_same_work():
    import matplotlib.pyplot as plt

    from labs.widgets.context_parallel import draw_ring_step, ring_stepper, step_rows

    for step in range(4):
        fig, rows = draw_ring_step(4, step, causal=True, zigzag=True)
        plt.close(fig)
        assert [r["kv_from"] for r in rows] == [(r - step) % 4 for r in range(4)]
        assert all(r["computed"] + r["masked"] == 4 for r in rows)
    per_rank = [
        sum(step_rows(4, s, zigzag=False)[r]["computed"] for s in range(4)) for r in range(4)
    ]
    assert per_rank == [w["computed"] for w in cpt.work_per_rank(4, zigzag=False)]
    with pytest.raises(ValueError, match="step=4 is outside 0..3"):
        step_rows(4, 4)
    ui = ring_stepper(cp=3)
    plt.close("all")
    assert len(ui.children) == 4
