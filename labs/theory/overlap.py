"""Data parallelism on paper: gradient buckets and the comm/compute overlap of a backward pass.
Pure Python.

Symbols: G bytes of gradients, N data-parallel ranks, β the bandwidth each rank sends
at (bytes/s, the "bus bandwidth" of ``labs.theory.comm.bus_bandwidth``), α the fixed
cost (latency) of one all-reduce call, C the bucket capacity in bytes.

Every DDP variant sends the same 2 (N-1)/N G bytes per rank per step; they differ in
*when* (after backward, or while it runs) and in *how many* calls:

    variant     all-reduce calls        launched                 exposed communication
    naive       one per tensor          after the whole          all of it:
                                        backward                 Σ (α + 2(N-1)/N K_i / β)
    overlapped  one per tensor          when the tensor's        what is left after
                                        grad is ready            backward ends
    bucketed    one per bucket (≈ G/C)  when the bucket's        idem, with fewer α's
                                        last grad is ready

Buckets (``bucket_layout``) follow torch's DDP rule (``_compute_bucket_assignment_by_size``):
walk the tensors in backward order, add each to the open bucket, close the bucket once
it holds at least C bytes. A bucket may thus exceed C by one tensor; C = 0 puts every
tensor in its own bucket.

Timeline model (``simulate_backward``): backward computes the tensors' gradients one
after another (tensor i ready at Σ_{j<=i} t_j); all-reduces run one at a time on a
single communication channel, each starting when its bucket is ready and the channel
is free. Exposed communication = max(0, end of the last all-reduce - end of backward):
the time the optimizer step waits. Li et al., "PyTorch Distributed", VLDB 2020, §3.2;
the Ultra-Scale Playbook, "Data parallelism".
"""

from __future__ import annotations

from collections.abc import Iterable

from labs.theory.comm import all_reduce_bytes
from labs.theory.dims import check_positive

MiB = 1 << 20  # torch's DDP counts bucket_cap_mb in MiB, and so do we
VARIANTS = ("naive", "overlapped", "bucketed")


def _check_bytes(grad_bytes: Iterable[float]) -> list[float]:
    grad_bytes = list(grad_bytes)
    if not grad_bytes:
        raise ValueError("grad_bytes must list at least one gradient tensor's bytes")
    if any(b < 0 for b in grad_bytes):
        raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes}")
    return grad_bytes


def bucket_layout(grad_bytes: Iterable[float], bucket_bytes: float) -> list[list[int]]:
    """Indices into ``grad_bytes`` (tensors in backward order) of each bucket, in launch order."""
    grad_bytes = _check_bytes(grad_bytes)
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    buckets = []
    current = []  # the open bucket
    size = 0.0  # its bytes
    for i, b in enumerate(grad_bytes):
        current.append(i)
        size += b
        if size >= bucket_bytes:
            buckets.append(current)
            current = []
            size = 0.0
    if current:
        buckets.append(current)
    return buckets


def all_reduce_calls(
    variant: str, grad_bytes: Iterable[float], bucket_bytes: float = 25 * MiB
) -> int:
    """All-reduces per step: one per gradient tensor (naive, overlapped) or one per bucket."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    grad_bytes = _check_bytes(grad_bytes)
    if variant == "bucketed":
        return len(bucket_layout(grad_bytes, bucket_bytes))
    return len(grad_bytes)


def simulate_backward(
    *,
    grad_bytes: Iterable[float],
    compute_s: Iterable[float],
    bucket_bytes: float,
    ranks: int,
    bandwidth: float,
    latency_s: float = 0.0,
    overlap: bool = True,
) -> dict:
    """Timeline of one backward pass with its gradient all-reduces.

    ``grad_bytes[i]`` and ``compute_s[i]``: bytes and backward compute time of tensor i,
    in backward order. ``overlap=False`` launches every all-reduce after backward (naive).
    Returns the spans (dicts with lane "compute" or "comm", start, end, bucket, and
    bytes for comm) and the totals: backward_s, comm_s, exposed_s, step_s (backward +
    exposed), hidden_fraction (share of communication time hidden behind compute),
    calls, sent_bytes (per rank).
    """
    grad_bytes = _check_bytes(grad_bytes)
    compute_s = list(compute_s)
    if len(compute_s) != len(grad_bytes):
        raise ValueError(
            f"compute_s has {len(compute_s)} entries but grad_bytes has {len(grad_bytes)}"
        )
    if any(t < 0 for t in compute_s):
        raise ValueError(f"compute_s must be >= 0, got {compute_s}")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    ready = []  # tensor i's gradient is ready once the backward reached it
    t = 0.0
    for c in compute_s:
        t += c
        ready.append(t)
    backward_s = t
    spans = []
    channel_free = 0.0  # when the communication channel is next free
    previous_ready = 0.0
    buckets = bucket_layout(grad_bytes, bucket_bytes)
    for b, members in enumerate(buckets):
        bucket_ready = ready[members[-1]]
        spans.append({"lane": "compute", "start": previous_ready, "end": bucket_ready, "bucket": b})
        previous_ready = bucket_ready
        k = sum(grad_bytes[i] for i in members)
        start = max(bucket_ready if overlap else backward_s, channel_free)
        channel_free = start + latency_s + all_reduce_bytes(k, ranks) / bandwidth
        spans.append({"lane": "comm", "start": start, "end": channel_free, "bucket": b, "bytes": k})
    comm_s = sum(s["end"] - s["start"] for s in spans if s["lane"] == "comm")
    exposed = max(0.0, channel_free - backward_s)
    return {
        "spans": spans,
        "buckets": buckets,
        "backward_s": backward_s,
        "comm_s": comm_s,
        "exposed_s": exposed,
        "step_s": backward_s + exposed,
        "hidden_fraction": 1.0 - exposed / comm_s if comm_s > 0 else 1.0,
        "calls": len(buckets),
        "sent_bytes": all_reduce_bytes(sum(grad_bytes), ranks),
    }


def uniform_model(
    *,
    params: float,
    layers: int,
    tokens: float,
    flops: float,
    bytes_per_grad: int = 2,
    tensors_per_layer: int = 4,
) -> tuple[list[float], list[float]]:
    """Gradient bytes and backward seconds per tensor for a model of ``layers`` identical layers.

    Backward costs 4 FLOPs per parameter per token (twice the forward's 2), at ``flops``
    FLOP/s; each layer has ``tensors_per_layer`` equal weight tensors (e.g. attention in/out,
    MLP in/out). Returns (grad_bytes, compute_s) in backward order.
    """
    check_positive(
        layers=layers, tensors_per_layer=tensors_per_layer, bytes_per_grad=bytes_per_grad
    )
    for name, v in (("params", params), ("tokens", tokens), ("flops", flops)):
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    n = layers * tensors_per_layer
    per_tensor = params / n
    grad_bytes = [per_tensor * bytes_per_grad] * n
    compute_s = [4 * per_tensor * tokens / flops] * n
    return grad_bytes, compute_s


def simulate_ddp(
    *,
    variant: str = "bucketed",
    params_m: float = 350.0,
    layers: int = 24,
    bucket_mb: float = 25.0,
    bandwidth_gbs: float = 50.0,
    tflops: float = 400.0,
    tokens_per_rank: int = 16384,
    ranks: int = 8,
    latency_us: float = 20.0,
    bytes_per_grad: int = 2,
) -> dict:
    """The overlap widget's scenario: a ``params_m`` million-parameter model, one DDP variant.

    ``bandwidth_gbs`` in GB/s (1e9 bytes/s) per rank, ``tflops`` achieved TFLOP/s,
    ``latency_us`` per all-reduce call. Returns ``simulate_backward``'s result plus the inputs.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    check_positive(ranks=ranks)
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
    grad_bytes, compute_s = uniform_model(
        params=params_m * 1e6,
        layers=layers,
        tokens=tokens_per_rank,
        flops=tflops * 1e12,
        bytes_per_grad=bytes_per_grad,
    )
    result = simulate_backward(
        grad_bytes=grad_bytes,
        compute_s=compute_s,
        bucket_bytes=bucket_mb * MiB if variant == "bucketed" else 0.0,
        ranks=ranks,
        bandwidth=bandwidth_gbs * 1e9,
        latency_s=latency_us * 1e-6,
        overlap=variant != "naive",
    )
    result.update(
        variant=variant,
        params_m=params_m,
        layers=layers,
        bucket_mb=bucket_mb,
        bandwidth_gbs=bandwidth_gbs,
        tflops=tflops,
        tokens_per_rank=tokens_per_rank,
        ranks=ranks,
        latency_us=latency_us,
        grad_bytes=sum(grad_bytes),
    )
    return result


def exposed_from_spans(spans: list[dict]) -> float:
    """Exposed communication of a timeline (simulated, or measured and converted to the same
    span dicts): how long the last all-reduce runs past the end of the last compute span."""
    compute_end = max((s["end"] for s in spans if s["lane"] == "compute"), default=0.0)
    comm_end = max((s["end"] for s in spans if s["lane"] == "comm"), default=0.0)
    return max(0.0, comm_end - compute_end)
