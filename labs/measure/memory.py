"""Memory accounting: exact bytes held in training state, and bytes saved for backward.

    state_bytes(model, optimizer)      # {"params", "grads", "optimizer", "total"} on this rank
    with SavedActivations(model) as saved:
        loss = model(x, y)[1]
    saved.bytes                        # bytes of tensors autograd keeps for backward

Every figure is counted from real tensors (``numel * element_size``), never estimated,
so the theory in ``labs.theory.memory`` can be tested against it. Tensors that share
storage (views, tied weights) are counted once.

Saved activations are measured with ``torch.autograd.graph.saved_tensors_hooks``:
autograd hands every tensor it keeps for backward to our pack hook. Parameters are
saved too (a linear layer keeps its weight), but they are already counted as
parameters, so their storages are excluded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its whole storage)."""
    return t.numel() * t.element_size()


def _unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor_bytes(t)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank really holds, for DTensor parameters (torch's TP and FSDP2)."""
    return t.to_local() if hasattr(t, "to_local") else t


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the parameters this rank holds (shared storage counted once)."""
    return _unique_bytes(_local(p) for p in params)


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the parameters' gradients this rank holds."""
    return _unique_bytes(_local(p.grad) for p in params if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's tensor state (Adam's moments, momentum buffers, master copies).
    Scalar step counters are bookkeeping, not per-parameter state, and are left out."""
    if optimizer is None:
        return 0
    tensors = [
        _local(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return _unique_bytes(tensors)


def state_bytes(
    model_or_params: torch.nn.Module | Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, int] | None = None,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank.

    ``model_or_params`` is a module or an iterable of tensors (a ZeRO rank's shards).
    ``extra`` adds named entries (e.g. ``{"master_params": ...}`` for fp32 master weights).
    """
    params = (
        list(model_or_params.parameters())
        if isinstance(model_or_params, torch.nn.Module)
        else list(model_or_params)
    )
    out = {
        "params": param_bytes(params),
        "grads": grad_bytes(params),
        "optimizer": optimizer_bytes(optimizer),
    }
    out.update(extra or {})
    out["total"] = sum(out.values())
    return out


class SavedActivations:
    """Counts the bytes autograd saves for backward while the block runs.

    ``exclude``: a module (or tensors) whose parameters are not activations.
    Results: ``bytes`` (unique storages), ``count``, ``by_dtype``, and ``by_region``
    when code inside wraps parts with ``saved.region("name")``.
    """

    def __init__(self, exclude: torch.nn.Module | Iterable[torch.Tensor] | None = None):
        if isinstance(exclude, torch.nn.Module):
            exclude = list(exclude.parameters())
        self._excluded = {_local(p).untyped_storage().data_ptr() for p in (exclude or [])}
        self._seen: set[tuple] = set()
        self.bytes = 0
        self.count = 0
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.by_region: dict[str, int] = defaultdict(int)
        self._region = "other"
        self._hooks = None

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute what is saved inside the ``with`` block to ``name``."""
        previous = self._region
        self._region = name
        try:
            yield
        finally:
            self._region = previous

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if (
                storage.data_ptr() not in self._excluded
                and key not in self._seen
                and storage.nbytes() > 0
            ):
                self._seen.add(key)
                self.bytes += storage.nbytes()
                self.count += 1
                self.by_dtype[str(t.dtype).replace("torch.", "")] += storage.nbytes()
                self.by_region[self._region] += storage.nbytes()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def peak_device_bytes(device: torch.device) -> int | None:
    """Peak bytes the CUDA allocator handed out since the last reset; None on CPU (no allocator
    stats)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None
