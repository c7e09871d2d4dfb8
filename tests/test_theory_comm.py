"""Collective volume formulas and the collective semantics behind the visualizer (no processes)."""

import json

import pytest

from labs.theory import comm
from labs.theory.collectives import OPS, simulate
from tests.helpers import assert_torch_free, run_cli


def test_ring_formulas():
    assert comm.all_reduce_bytes(1000, 4) == 1500
    assert comm.reduce_scatter_bytes(1000, 4) == comm.all_gather_bytes(1000, 4) == 750
    # an all-reduce is a reduce-scatter followed by an all-gather
    halves = comm.reduce_scatter_bytes(1000, 4) + comm.all_gather_bytes(1000, 4)
    assert comm.all_reduce_bytes(1000, 4) == halves
    assert comm.all_reduce_bytes(1000, 1) == 0
    assert comm.ring_steps("all_reduce", 8) == 14


def test_collective_time_uses_nccl_tests_bus_factors():
    """nccl-tests (doc/PERFORMANCE.md, src/*.cu): busbw = algbw x f with f = 2(N-1)/N for
    all-reduce, (N-1)/N for reduce-scatter, all-gather and all-to-all, 1 for broadcast, whose K
    bytes must all leave the root: a broadcast takes K/B, not its average bytes per rank / B."""
    k, n, bw = 8e9, 8, 1e9
    assert comm.collective_seconds("broadcast", k, n, bw) == 8.0
    assert comm.broadcast_bytes(k, n) / bw == 7.0  # what the ledger counts per rank, on average
    assert comm.collective_seconds("all_reduce", k, n, bw) == comm.all_reduce_bytes(k, n) / bw
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.collective_seconds(op, k, n, bw) == comm.BYTES_PER_RANK[op](k, n) / bw
    t = comm.collective_seconds("broadcast", k, n, bw)
    assert comm.bus_bandwidth("broadcast", k, n, t) == bw  # = algbw for a broadcast
    t = comm.collective_seconds("all_reduce", k, n, bw)
    assert comm.bus_bandwidth("all_reduce", k, n, t) == pytest.approx(bw)  # busbw: the link's
    assert comm.collective(op="broadcast", k=k, n=n, bandwidth_gbs=1)["seconds"] == 8.0


@pytest.mark.parametrize("k, n", [(-1, 4), (10, 0), (10, 2.5), (10, True)])
def test_bad_sizes_are_rejected(k, n):
    with pytest.raises(ValueError):
        comm.all_reduce_bytes(k, n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_simulated_collectives_have_the_textbook_semantics(n):
    start = [[(r + 1) * 10 + i for i in range(n)] for r in range(n)]
    values = {op: [[v for v, _ in row] for row in simulate(op, n)["after"]] for op in OPS}
    column_sums = [sum(start[r][i] for r in range(n)) for i in range(n)]
    assert values["all_reduce"] == [column_sums] * n
    assert values["reduce_scatter"] == [[s] for s in column_sums]
    assert values["broadcast"] == [start[0]] * n
    assert values["all_to_all"] == [[start[src][dst] for src in range(n)] for dst in range(n)]
    assert values["all_gather"] == [[(r + 1) * 10 for r in range(n)]] * n
    assert values["send_recv"] == [start[(r - 1) % n] for r in range(n)]
    assert simulate("all_reduce", n)["chunks_sent_per_rank"] == 2 * (n - 1)


def test_simulate_rejects_bad_input():
    with pytest.raises(ValueError, match="op="):
        simulate("allreduce", 4)
    with pytest.raises(ValueError, match="world size"):
        simulate("all_reduce", 0)
    with pytest.raises(ValueError, match="root"):
        simulate("broadcast", 4, root=4)


def test_comm_cli():
    proc = run_cli(
        "-m",
        "labs.theory",
        "comm",
        "--op",
        "all_reduce",
        "--bytes",
        "1000",
        "--ranks",
        "4",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bytes_per_rank"] == 1500
    bad = run_cli(
        "-m", "labs.theory", "comm", "--op", "all_reduce", "--bytes", "1000", "--ranks", "0"
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_theory_cli_does_not_import_torch():
    assert_torch_free(
        "import labs.theory.__main__ as m\n"
        "m.main(['comm', '--op', 'all_gather', '--bytes', '8', '--ranks', '2'])"
    )
