"""labs.theory.overlap: bucket boundaries (checked against torch's own bucketing) and the overlap
timeline."""

import pytest
import torch
import torch.distributed as dist

from labs.theory.comm import all_reduce_bytes
from labs.theory.overlap import (
    MiB,
    all_reduce_calls,
    bucket_layout,
    exposed_from_spans,
    simulate_backward,
    simulate_ddp,
    uniform_model,
)
from tests.helpers import assert_torch_free


@pytest.mark.parametrize(
    "sizes, cap, expected",
    [
        ([4, 4, 4], 8, [[0, 1], [2]]),
        ([4, 4, 4], 0, [[0], [1], [2]]),  # C = 0: one tensor per bucket
        ([4, 4, 4], 100, [[0, 1, 2]]),  # everything fits: one bucket, closed at the end
        ([10, 1, 1], 5, [[0], [1, 2]]),  # a tensor larger than C closes its bucket at once
        ([3, 3, 3, 3, 3], 7, [[0, 1, 2], [3, 4]]),  # a bucket may pass C by one tensor
    ],
)
def test_bucket_layout(sizes, cap, expected):
    assert bucket_layout(sizes, cap) == expected


@pytest.mark.parametrize(
    "numels, cap_bytes",
    [
        ([96, 3552, 148, 3552, 24576, 112], 3700),
        ([1000] * 7, 8000),
        ([5, 70000, 3, 3, 9000], 4096),
        ([256] * 10, 1),
    ],
)
def test_bucket_layout_equals_torch_ddp_assignment(numels, cap_bytes):
    """Our bucket layout is torch DDP's, which assigns buckets in C++.

    torch's rule: ``dist._compute_bucket_assignment_by_size``; same rule, same result."""
    tensors = [torch.empty(n) for n in numels]
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [cap_bytes])
    assert bucket_layout([4 * n for n in numels], cap_bytes) == [list(b) for b in torch_buckets]


def test_all_reduce_calls():
    sizes = [4 * MiB, 4 * MiB, 4 * MiB, 30 * MiB]
    assert all_reduce_calls("naive", sizes) == all_reduce_calls("overlapped", sizes) == 4
    assert all_reduce_calls("bucketed", sizes, 25 * MiB) == 1
    assert all_reduce_calls("bucketed", sizes, 8 * MiB) == 2


def test_simulated_timeline_by_hand():
    """Two 100-byte gradients, 1 s of backward each; 2 ranks send 2(N-1)/N*100 = 100 bytes per
    all-reduce at 100 B/s."""
    common = dict(grad_bytes=[100, 100], compute_s=[1.0, 1.0], ranks=2, bandwidth=100.0)
    overlapped = simulate_backward(bucket_bytes=0, **common)
    assert [(s["start"], s["end"]) for s in overlapped["spans"] if s["lane"] == "comm"] == [
        (1.0, 2.0),
        (2.0, 3.0),
    ]
    assert (
        overlapped["backward_s"] == 2.0
        and overlapped["exposed_s"] == 1.0
        and overlapped["step_s"] == 3.0
    )
    assert overlapped["hidden_fraction"] == 0.5
    naive = simulate_backward(bucket_bytes=0, overlap=False, **common)
    assert [(s["start"], s["end"]) for s in naive["spans"] if s["lane"] == "comm"] == [
        (2.0, 3.0),
        (3.0, 4.0),
    ]
    assert naive["exposed_s"] == 2.0 and naive["hidden_fraction"] == 0.0
    # ready only at the end: nothing to overlap with
    one_bucket = simulate_backward(bucket_bytes=1000, **common)
    assert one_bucket["calls"] == 1 and one_bucket["exposed_s"] == 2.0
    with_latency = simulate_backward(bucket_bytes=0, latency_s=0.5, **common)
    assert with_latency["exposed_s"] == 2.0  # comm 1.0-2.5, 2.5-4.0; backward ends at 2.0
    for sim in (overlapped, naive, one_bucket, with_latency):
        # the variants differ in timing, not in bytes
        assert sim["sent_bytes"] == all_reduce_bytes(200, 2)
        assert exposed_from_spans(sim["spans"]) == sim["exposed_s"]


def test_a_channel_runs_one_all_reduce_at_a_time():
    sim = simulate_backward(
        grad_bytes=[1000] * 6, compute_s=[0.1] * 6, bucket_bytes=0, ranks=4, bandwidth=1000.0
    )
    comm = [s for s in sim["spans"] if s["lane"] == "comm"]
    assert all(b["start"] >= a["end"] for a, b in zip(comm, comm[1:]))
    assert all(
        c["start"] >= r["end"]
        for c, r in zip(comm, (s for s in sim["spans"] if s["lane"] == "compute"))
    )


def test_fast_network_hides_communication_and_slow_one_exposes_it():
    fast = simulate_ddp(bandwidth_gbs=1000.0, latency_us=0.0)
    slow = simulate_ddp(bandwidth_gbs=1.0)
    assert fast["exposed_s"] < 0.05 * fast["backward_s"] and fast["hidden_fraction"] > 0.9
    # at most backward's length is hidden
    assert slow["exposed_s"] > slow["comm_s"] - slow["backward_s"] - 1e-12
    naive = simulate_ddp(variant="naive")
    assert naive["exposed_s"] == pytest.approx(naive["comm_s"])  # naive hides nothing


def test_bucketing_saves_latency():
    kw = dict(params_m=100, layers=32, bandwidth_gbs=100.0, latency_us=500.0)
    bucketed = simulate_ddp(variant="bucketed", bucket_mb=25, **kw)
    overlapped = simulate_ddp(variant="overlapped", **kw)
    assert bucketed["comm_s"] < overlapped["comm_s"] and bucketed["calls"] < overlapped["calls"]


def test_uniform_model_totals():
    grads, compute = uniform_model(params=1e9, layers=16, tokens=1000, flops=1e15, bytes_per_grad=2)
    assert len(grads) == 64 and sum(grads) == pytest.approx(2e9)
    # backward = 4 FLOPs per parameter per token
    assert sum(compute) == pytest.approx(4 * 1e9 * 1000 / 1e15)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bucket_layout([], 10), "grad_bytes"),
        (lambda: bucket_layout([1], -1), "bucket_bytes"),
        (lambda: all_reduce_calls("ring", [1]), "variant='ring' is not one of"),
        (
            lambda: simulate_backward(
                grad_bytes=[1], compute_s=[1, 2], bucket_bytes=0, ranks=2, bandwidth=1
            ),
            "compute_s",
        ),
        (
            lambda: simulate_backward(
                grad_bytes=[1], compute_s=[1], bucket_bytes=0, ranks=2, bandwidth=0
            ),
            "bandwidth",
        ),
        (lambda: simulate_ddp(ranks=0), "ranks"),
        (lambda: simulate_ddp(bucket_mb=-1), "bucket_mb"),
        (lambda: uniform_model(params=1, layers=0, tokens=1, flops=1), "layers"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_overlap_theory_does_not_import_torch():
    assert_torch_free("import labs.theory.overlap as o; o.simulate_ddp()")
