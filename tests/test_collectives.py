"""Exercise 00: the ring all-reduce equals the sum over ranks, is built from point-to-point sends
and receives (no torch collective), and sends 2(N-1)/N K bytes per rank in 2(N-1) rounds of one
chunk each.

Each rank's input comes from a generator seeded by its rank, so the expected sum is computed here,
in the test process, from the same inputs: the verdict never rests on what a rank says torch
computed. How the ring ran is read in the rank: ``CommDebugMode`` sees every torch collective
(``dist.all_reduce`` or a process group's own ``allreduce``) and no send or receive; the ledger
sees each send and its bytes."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from labs import launch
from labs.measure import CommLedger
from labs.runtime import exercise
from labs.theory.comm import all_reduce_bytes

pytestmark = pytest.mark.exercise
POINT_TO_POINT = {"send", "isend", "recv", "irecv"}


def rank_input(rank, shape, dtype):
    g = torch.Generator().manual_seed(rank)
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def expected_sum(nproc, shape, dtype):
    """The sum over ranks of their inputs, exact (integers) or in float64 (floats)."""
    inputs = [rank_input(r, shape, dtype) for r in range(nproc)]
    if dtype.is_floating_point:
        return torch.stack([x.double() for x in inputs]).sum(0).to(dtype)
    return torch.stack(inputs).sum(0)


def ring_case(shape, dtype):
    ring = exercise("collectives")
    world = dist.get_world_size()
    x = rank_input(dist.get_rank(), shape, dtype)
    ours = x.clone()
    with CommDebugMode() as torch_collectives, CommLedger() as ledger:
        out = ring.ring_all_reduce(ours)
    return {
        "same_object": out is ours,
        "ours": ours,
        "torch_collectives": torch_collectives.get_total_counts(),
        "ops": sorted(ledger.summary()),
        "sent_per_round": ledger.calls_by_op().get("isend", [])
        + ledger.calls_by_op().get("send", []),
        "sent": ledger.sent_bytes(),
        "k": x.numel() * x.element_size(),
        "chunks": sorted(
            {c.numel() * x.element_size() for c in torch.tensor_split(x.view(-1), world)}
        ),
    }


def assert_a_ring(r, nproc):
    """Point-to-point only, 2(N-1) rounds, each sending one of the N chunks."""
    assert r["torch_collectives"] == 0, (
        f"ring_all_reduce called {r['torch_collectives']} torch collective(s): build it from "
        "send and recv (labs.runtime.ring.exchange)"
    )
    assert set(r["ops"]) <= POINT_TO_POINT, f"ring_all_reduce used {r['ops']}"
    rounds = r["sent_per_round"]
    assert len(rounds) == 2 * (nproc - 1), f"{len(rounds)} sends; a ring sends 2(N-1)"
    assert set(rounds) <= set(r["chunks"]), (
        f"bytes sent per round {sorted(set(rounds))}: each round sends one chunk, {r['chunks']}"
    )


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_integer_all_reduce_is_exact(nproc):
    expected = expected_sum(nproc, (8, 12), torch.int64)
    for r in launch(ring_case, nproc, (8, 12), torch.int64):
        assert r["same_object"], "ring_all_reduce must work in place and return its argument"
        assert torch.equal(r["ours"], expected)
        assert_a_ring(r, nproc)


@pytest.mark.parametrize("nproc", [2, 4])
# 3 elements on 4 ranks: one empty chunk
@pytest.mark.parametrize("shape", [(1000,), (7, 13), (3,)])
def test_float_all_reduce_matches_within_rounding(nproc, shape):
    expected = expected_sum(nproc, shape, torch.float32)
    for r in launch(ring_case, nproc, shape, torch.float32):
        # against the float64 sum: N fp32 additions of values below ~10 err by a few 1e-6
        torch.testing.assert_close(r["ours"], expected, rtol=1e-6, atol=1e-5)
        assert_a_ring(r, nproc)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_bytes_sent_per_rank_equal_the_ring_formula(nproc):
    numel = 12 * 1024  # divisible by 2, 3 and 4: every chunk has the same size
    for r in launch(ring_case, nproc, (numel,), torch.float32):
        assert r["sent"] == all_reduce_bytes(r["k"], nproc)
        assert_a_ring(r, nproc)
        assert r["sent_per_round"] == [r["k"] // nproc] * (2 * (nproc - 1))


def non_contiguous_case():
    ring = exercise("collectives")
    # a transposed, non-contiguous view
    x = torch.arange(24.0).view(4, 6).t() * (dist.get_rank() + 1)
    with CommDebugMode() as torch_collectives:
        ring.ring_all_reduce(x)
    return x, torch_collectives.get_total_counts()


def test_non_contiguous_tensor():
    base = torch.arange(24.0).view(4, 6).t()
    expected = base * sum(r + 1 for r in range(3))
    for x, torch_collectives in launch(non_contiguous_case, 3):
        assert torch.equal(x, expected)
        assert torch_collectives == 0, "ring_all_reduce called a torch collective"
