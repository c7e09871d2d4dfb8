"""Exercise 00: the ring all-reduce equals dist.all_reduce and sends 2(N-1)/N K bytes per rank."""

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.measure import CommLedger
from labs.runtime import exercise
from labs.theory.comm import all_reduce_bytes

pytestmark = pytest.mark.exercise


def ring_vs_torch(shape, dtype):
    ring = exercise("collectives")
    g = torch.Generator().manual_seed(dist.get_rank())
    x = (
        torch.randint(-100, 100, shape, generator=g)
        if not dtype.is_floating_point
        else torch.randn(shape, generator=g)
    ).to(dtype)
    ours = x.clone()
    theirs = x.clone()
    with CommLedger() as ledger:
        out = ring.ring_all_reduce(ours)
    dist.all_reduce(theirs)
    return {
        "same_object": out is ours,
        "ours": ours,
        "theirs": theirs,
        "sent": ledger.sent_bytes(),
        "sends": ledger.calls("isend"),
        "k": x.numel() * x.element_size(),
    }


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_integer_all_reduce_is_exact(nproc):
    for r in launch(ring_vs_torch, nproc, (8, 12), torch.int64):
        assert r["same_object"], "ring_all_reduce must work in place and return its argument"
        assert torch.equal(r["ours"], r["theirs"])


@pytest.mark.parametrize("nproc", [2, 4])
# 3 elements on 4 ranks: one empty chunk
@pytest.mark.parametrize("shape", [(1000,), (7, 13), (3,)])
def test_float_all_reduce_matches_within_rounding(nproc, shape):
    for r in launch(ring_vs_torch, nproc, shape, torch.float32):
        torch.testing.assert_close(r["ours"], r["theirs"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_bytes_sent_per_rank_equal_the_ring_formula(nproc):
    numel = 12 * 1024  # divisible by 2, 3 and 4: every chunk has the same size
    for r in launch(ring_vs_torch, nproc, (numel,), torch.float32):
        assert r["sent"] == all_reduce_bytes(r["k"], nproc)
        assert r["sends"] == 2 * (nproc - 1)


def non_contiguous_case():
    ring = exercise("collectives")
    # a transposed, non-contiguous view
    x = torch.arange(24.0).view(4, 6).t() * (dist.get_rank() + 1)
    expected = x.clone()
    dist.all_reduce(expected)
    ring.ring_all_reduce(x)
    return torch.equal(x, expected)


def test_non_contiguous_tensor():
    assert all(launch(non_contiguous_case, 3))
