"""Flat parameter buffers and gradient-readiness hooks: the plumbing under ZeRO
(``solutions/zero.py``).

    buf = FlatBuffer("block 0", params, rank=1, world=4)   # layout: numel, shard, padded, [lo, hi)
    buf.bind(full)                  # every parameter's data becomes a view of ``full`` [padded]
    buf.release()                   # free ``full``'s memory; the views follow
    buf.allocate()                  # re-allocate it (contents undefined until gathered into)
    ready = GradReadiness(units, on_complete)   # on_complete(k) once per backward per unit

Freeing a unit's parameters after its forward must free the memory that autograd saved
for backward too (a linear layer keeps a view of its weight). Resizing the *storage* to
0 bytes does: every view shares it, and after ``allocate`` plus an all-gather into
``full`` they all see the gathered values again (the trick FSDP uses, Zhao et al. 2023, §4.2).

A unit's gradients are complete when every parameter's ``AccumulateGrad`` has run (a
post-accumulate-grad hook per parameter counts them; a tied weight accumulates once).
A parameter the forward never used never reports, so whatever is still waiting when
backward ends is completed by a callback queued on the autograd engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch


def course_units(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """ZeRO's units of the course model, or of a pipeline stage of it, in forward order: the
    embedding, each block, the final norm with the head (each part that the module has; a stage's
    blocks keep their layer numbers). ``labs.theory.zero.course_units`` counts the same units'
    parameters."""
    blocks = (
        model.layers.items()
        if isinstance(model.layers, torch.nn.ModuleDict)
        else enumerate(model.layers)
    )
    units = [("embedding", [model.tok_emb])] if getattr(model, "tok_emb", None) is not None else []
    units += [(f"block {i}", [block]) for i, block in blocks]
    if getattr(model, "lm_head", None) is not None:
        units.append(("norm + head", [model.norm, model.lm_head]))
    return units


class FlatBuffer:
    """One unit's parameters as one flat buffer: ``numel`` elements padded to
    ``padded = world * shard``; this rank owns elements ``[lo, hi)``."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], rank: int, world: int):
        if not params:
            raise ValueError(f"unit {name!r} has no trainable parameters")
        self.name = name
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard = math.ceil(self.numel / world)
        self.padded = self.shard * world
        self.lo = rank * self.shard
        self.hi = (rank + 1) * self.shard
        # Set by ZeRO (solutions/zero.py) as it shards the unit:
        self.full: torch.Tensor | None = None  # [padded] every parameter's data is a view of it
        self.full_grad: torch.Tensor | None = None  # [padded] gradients (stage 1)
        self.shard_grad: torch.Tensor | None = None  # [shard] this rank's gradients (stages 2, 3)
        self.shard_param: torch.nn.Parameter | None = None  # [shard] what the optimizer steps
        self.host: torch.nn.Parameter | None = None  # [shard] on the CPU (offload)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat buffer, shaped like the parameter."""
        out = []
        offset = 0
        for p in self.params:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def bind(self, full: torch.Tensor) -> None:
        """Make each parameter's data a view of ``full``: gathering into ``full`` updates the
        model."""
        self.full = full
        for p, view in zip(self.params, self.views(full)):
            p.data = view

    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Give ``full`` its memory back (contents undefined until gathered into)."""
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def release(self) -> None:
        self.full.untyped_storage().resize_(0)

    def untouched(self, got_grad: set[torch.nn.Parameter]) -> torch.Tensor | None:
        """bool [shard]: this rank's elements of parameters that got no gradient (None: all did)."""
        if all(p in got_grad for p in self.params):
            return None
        mask = torch.cat(
            [torch.full((p.numel(),), p not in got_grad) for p in self.params]
            + [torch.zeros(self.padded - self.numel, dtype=torch.bool)]
        )
        return mask[self.lo : self.hi].to(self.params[0].device)


class GradReadiness:
    """Calls ``on_complete(k)`` once per backward for each unit k, as soon as all its
    parameters have their gradient, or at the end of backward for units still waiting.
    ``got_grad``: the parameters that received a gradient since the last ``reset``."""

    def __init__(self, units: list[FlatBuffer], on_complete: Callable[[int], None]):
        self.units = units
        self.on_complete = on_complete
        self.reset()
        for k, u in enumerate(units):
            for p in u.params:
                p.register_post_accumulate_grad_hook(partial(self._on_grad, k))

    def reset(self) -> None:
        self.got_grad: set[torch.nn.Parameter] = set()
        self.waiting = [len(u.params) for u in self.units]
        self.done = [False] * len(self.units)
        self._queued = False

    def _on_grad(self, k: int, p: torch.nn.Parameter) -> None:
        self.got_grad.add(p)
        self.waiting[k] -= 1
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.waiting[k] == 0:
            self._complete(k)

    def _end_of_backward(self) -> None:
        for k in reversed(range(len(self.units))):
            self._complete(k)

    def _complete(self, k: int) -> None:
        if not self.done[k]:
            self.done[k] = True
            self.on_complete(k)
