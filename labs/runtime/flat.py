"""Flat parameter buffers and gradient-readiness hooks: the plumbing under ZeRO
(``solutions/zero.py``).

    buf = FlatBuffer("block 0", params, rank=1, world=4)   # layout: numel, shard, padded, [lo, hi)
    buf.bind(full)                  # every parameter's data becomes a view of ``full`` [padded]
    buf.pieces(shard)               # each parameter's part of this rank's shard [S]: 1-D views
    buf.release()                   # free ``full``'s memory (no parameter may still view it)
    buf.allocate()                  # re-allocate it (contents undefined until gathered into)
    ready = GradReadiness([buf.params], on_complete)   # on_complete(k) once per backward per list

Freeing a unit's parameters after its forward must free the memory that autograd saved
for backward too (a linear layer keeps a view of its weight). Resizing the *storage* to
0 bytes does: every view shares it, and after ``allocate`` plus an all-gather into
``full`` they all see the gathered values again (the trick FSDP uses, Zhao et al. 2023, §4.2).
A tensor whose storage has 0 bytes must never be read (its elements point at freed memory: a
segfault, not an error), so ZeRO-3 points every parameter at its shard piece before it releases
a unit: a parameter a learner reads between uses is always this rank's piece.

A rank owns elements [lo, hi) of a unit's flat buffer; parameter i occupies [start_i, stop_i).
Its *piece* on this rank is the overlap: its elements [a, b) (flattened), stored at
[start_i + a − lo, start_i + b − lo) of the rank's shard. A piece may be empty.

A unit's gradients are complete when every parameter's ``AccumulateGrad`` has run (a
post-accumulate-grad hook per parameter counts them; a tied weight accumulates once).
A parameter the forward never used never reports, so whatever is still waiting when
backward ends is completed by a callback queued on the autograd engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

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


class Piece(NamedTuple):
    """Parameter i's part of this rank's shard: its flattened elements [a, b), stored at
    [offset, offset + b − a) of the shard."""

    a: int
    b: int
    offset: int


class FlatBuffer:
    """One unit's parameters as one flat buffer: ``numel`` elements padded to
    ``padded = world * shard``; this rank owns elements ``[lo, hi)``."""

    def __init__(
        self, name: str, params: Sequence[torch.nn.Parameter], rank: int, world: int
    ) -> None:
        if not params:
            raise ValueError(f"unit {name!r} has no trainable parameters")
        self.name = name
        self.params = list(params)
        # the whole parameters' shapes (under ZeRO-3 a parameter's data is a piece between uses)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.rank = rank
        self.world = world
        self.numel = sum(self.numels)
        self.shard = math.ceil(self.numel / world)
        self.padded = self.shard * world
        self.lo = rank * self.shard
        self.hi = (rank + 1) * self.shard
        # Set by ZeRO (solutions/zero.py) as it shards the unit:
        self.full: torch.Tensor | None = None  # [padded] the whole parameters, when gathered
        self.full_grad: torch.Tensor | None = None  # [padded] gradients (ZeRO-1)
        self.shard_grad: torch.Tensor | None = None  # [shard] this rank's gradients (ZeRO-2, 3)
        self.shard_param: torch.nn.Parameter | None = None  # [shard] what the optimizer steps
        self.host: torch.nn.Parameter | None = None  # [shard] on the CPU (offload)
        self.master: torch.nn.Parameter | None = None  # [shard] fp32 (mixed precision)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat buffer, shaped like the parameter."""
        out = []
        offset = 0
        for shape, numel in zip(self.shapes, self.numels):
            out.append(flat[offset : offset + numel].view(shape))
            offset += numel
        return out

    def piece_bounds(self) -> list[Piece]:
        """Each parameter's piece on this rank (see the module docstring); empty ones too."""
        out = []
        start = 0
        for numel in self.numels:
            lo = min(max(self.lo, start), start + numel)
            hi = max(min(self.hi, start + numel), lo)
            out.append(Piece(lo - start, hi - start, lo - self.lo))
            start += numel
        return out

    def pieces(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of this rank's ``shard`` [shard]: 1-D views, maybe empty."""
        return [shard[o : o + b - a] for a, b, o in self.piece_bounds()]

    def bind(self, full: torch.Tensor) -> None:
        """Make each parameter's data a view of ``full``: gathering into ``full`` updates the
        model."""
        if tuple(full.shape) != (self.padded,):
            raise ValueError(
                f"unit {self.name!r}: a flat buffer must have shape [{self.padded}] (padded ="
                f" world · shard = {self.world} · {self.shard}: {self.numel} elements, then zeros"
                f" up to a multiple of {self.world}), got {list(full.shape)}: check flatten's"
                " padding"
            )
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
            [torch.full((n,), p not in got_grad) for p, n in zip(self.params, self.numels)]
            + [torch.zeros(self.padded - self.numel, dtype=torch.bool)]
        )
        return mask[self.lo : self.hi].to(self.params[0].device)


class GradReadiness:
    """Calls ``on_complete(k)`` once per backward for each list k of parameters, as soon as all
    of them have their gradient, or at the end of backward for lists still waiting (a list whose
    completion is ``expect``-ed completes then even if none of its parameters got a gradient).
    ``got_grad``: the parameters that received a gradient since the last ``clear``."""

    def __init__(
        self,
        param_lists: Sequence[Sequence[torch.nn.Parameter]],
        on_complete: Callable[[int], None],
    ) -> None:
        self.param_lists = [list(ps) for ps in param_lists]
        self.on_complete = on_complete
        self.got_grad: set[torch.nn.Parameter] = set()
        self.reset()
        for k, params in enumerate(self.param_lists):
            for p in params:
                p.register_post_accumulate_grad_hook(partial(self._on_grad, k))

    def reset(self) -> None:
        """Forget this backward's progress (the next backward starts counting afresh)."""
        self.waiting = [len(ps) for ps in self.param_lists]
        self.done = [False] * len(self.param_lists)
        self._queued = False

    def clear(self) -> None:
        """Forget which parameters got a gradient (after the optimizer step consumed them)."""
        self.got_grad = set()

    def expect(self) -> None:
        """Make sure the end of this backward completes every list still waiting."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, k: int, p: torch.nn.Parameter) -> None:
        self.got_grad.add(p)
        self.waiting[k] -= 1
        self.expect()
        if self.waiting[k] == 0:
            self._complete(k)

    def _end_of_backward(self) -> None:
        for k in reversed(range(len(self.param_lists))):
            self._complete(k)
        self.reset()

    def _complete(self, k: int) -> None:
        if not self.done[k]:
            self.done[k] = True
            self.on_complete(k)
