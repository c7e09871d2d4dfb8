# Your exercise module, generated from solutions/zero.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 03 (notebooks/03_zero_and_fsdp.ipynb): ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) from scratch,
behind the entry points of the tools that come next (torch's ``ZeroRedundancyOptimizer`` and
FSDP2's ``fully_shard``), so a plain training loop runs unchanged:

    # ZeRO-1 (ZeRO-2 with shard_grads=True): a sharded optimizer, any torch optimizer inside
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
    # or ZeRO-3: shard each unit, then the root; any optimizer on what is left (the shards)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for x, y in batches:                       # the same loop, single-process or not
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

Data parallelism keeps N copies of the training state; ZeRO keeps one, cut into N shards.
A *unit* (a parameter group of ``ShardedOptimizer``; a ``fully_shard``-ed module) has its
trainable parameters flattened into one buffer of Ψ_u elements, zero-padded to N·S_u with
S_u = ceil(Ψ_u/N), so any size works on any N: rank r owns [r·S_u, (r+1)·S_u).

Communication contract, on the data-parallel ``group`` of N ranks, per step
(P = Σ_u 4·N·S_u bytes, the padded fp32 parameters; ``labs.theory.zero.comm_bytes``):

    ZeRO-1  step: reduce-scatter each unit's full gradient buffer in place (rank r's slice
            becomes the average), the optimizer on the shard, all-gather the updated
            shards into the full parameter buffer.                            2 (N-1)/N · P
    ZeRO-2  backward: once a unit's gradients are complete, reduce-scatter them into a
            persistent shard and free them. step: optimizer, all-gather.       2 (N-1)/N · P
    ZeRO-3  forward: all-gather unit k before its forward (and prefetch unit k+1), free it
            after. backward: all-gather unit k again (prefetch k-1), reduce-scatter its
            gradients, free parameters and gradients. step: the user's optimizer on the
            shards, no communication.                                          3 (N-1)/N · P
    offload ZeRO-1/2: the optimizer and its state live on the host (an fp32 copy of the
            shard); ZeRO-3: the shards the optimizer steps live on the host. 4·S_u bytes of
            gradient go down and 4·S_u of parameters come up per unit and step.
    replicate (ZeRO-3) the chosen small parameters stay whole on every rank: their gradients
            are all-reduced (2 (N-1)/N of their bytes), their optimizer state is not sharded.

What a learner sees. Under ZeRO-1/2 every parameter is whole between steps. Under ZeRO-3 a
module's parameters are, between uses, this rank's *pieces* of them (1-D, maybe empty: the
elements of the rank's shard that belong to that parameter), and after backward each piece's
``.grad`` is the same piece of the averaged gradient: read, log and clip them by name
(``clip_grad_norm_`` adds the pieces' norms over the ranks). ``summon_full_params(model)``
gathers the whole parameters for a while (FSDP's context manager of that name). Reading a
parameter never touches freed memory, at any moment of a step.

Mixed precision (``mixed_precision=MixedPrecision(param_dtype, reduce_dtype)``, as FSDP2's
``MixedPrecisionPolicy``; ``labs.train``): the gathered parameters, the compute and the whole
gradients are bf16 (or fp16); the reductions run in ``reduce_dtype`` (fp32 by default: the bf16
gradient buffer is cast up before its reduce-scatter, 4 bytes per element on the wire instead of
2); the master weights and the optimizer state are fp32 on this rank's shard.

    ZeRO-1/2  cast the model first (``model.to(torch.bfloat16)``): the flat buffers are bf16, the
            gradient (shard) too; ``ShardedOptimizer`` keeps an fp32 master of its shard
            (``u.master``), steps it with the shard's gradient cast to fp32, and rounds it back
            into the bf16 shard before the all-gather (which carries bf16).
    ZeRO-3  the shard the user's optimizer steps is fp32 (the master itself, FSDP2's layout);
            each gather casts it to bf16 first, so the unit computes in bf16 and the all-gather
            carries bf16; the reduced gradient shard is fp32 (never rounded to bf16).
    fp16    a ``labs.train.LossScaler`` scales the loss; ``ShardedOptimizer(loss_scaler=...)``
            divides its master gradients by the scale and skips a step that overflowed on any
            rank (an all-reduce of the flag: each rank sees only its shard); under ZeRO-3 the
            loop calls ``scaler.step(optimizer, group=group)``, which does the same.

Memory held per rank: ``labs.theory.zero.held_bytes`` (ZeRO-3: 16·Σ S_u bytes, mixed precision
too: ``precision="bf16-mixed"``). The plumbing
(a buffer's layout and pieces, freeing its storage, hooks that report a unit's gradients
complete) is in ``labs/runtime/flat.py``. As torch's optimizers, parameters whose gradient is
None (unused) are not updated; frozen parameters stay whole on every rank and are never touched.

Rajbhandari et al., "ZeRO" (SC 2020), §5 (stages) and §7 (communication); Ren et al.,
"ZeRO-Offload" (ATC 2021), §4; Zhao et al., "PyTorch FSDP" (VLDB 2023), §3.2-3.3.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.runtime.flat import FlatBuffer, GradReadiness
from labs.train import LossScaler, MixedPrecision, overflowed

NOTEBOOK = "03_zero_and_fsdp.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
# The "checkpoints" part asks for no code: its tests check that labs.checkpoint saves and loads
# what your ZeRO-3 holds, on any number of ranks.
PARTS = {"core": 60, "zero3": 30, "offload": 10, "checkpoints": 10, "mixed-precision": 20}

# Their update of an element depends on other elements (a row's, a matrix's), or they take sparse
# gradients or many evaluations per step: they cannot run on a flat shard.
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon", "SparseAdam")


class FlatUnit(FlatBuffer):
    """One unit's trainable parameters as one flat buffer (layout and memory: ``FlatBuffer``).

    ``numel`` elements padded to ``padded = world * shard``; this rank owns ``[lo, hi)``."""

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The tensors (one per parameter; None counts as zeros) laid end to end, then zeros
        up to ``padded`` elements: ``[padded]``, same dtype and device as the parameters.

        Part: core.
        """
        raise NotImplementedError(
            "exercise FlatUnit.flatten is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeRO shards over the ranks of a process group, and none is initialised: run this"
            " on every rank (labs.launch(fn, nproc) from a notebook, or torchrun)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_alike(name: str, params: Sequence[torch.Tensor]) -> None:
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(
            f"unit {name!r} mixes dtypes or devices {sorted(map(str, kinds))}: one flat buffer"
            " holds one dtype on one device; put the others in their own parameter group or unit"
        )


# --- ZeRO-1 and ZeRO-2: the sharded optimizer ---------------------------------------------------
class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(**defaults)`` on this rank's shard of every parameter group: ZeRO-1 (with
    ``shard_grads=True``, ZeRO-2). A ``torch.optim.Optimizer``, as torch's
    ``ZeroRedundancyOptimizer`` is: ``params`` are parameters or parameter groups (dicts with
    their own hyperparameters; a group may carry a ``"name"``), ``param_groups`` are the user's
    (a learning-rate scheduler changes them), ``step(closure)``, ``zero_grad()``,
    ``state_dict()`` / ``load_state_dict()``. ``optimizer_cls`` must update each element on its
    own (SGD, Adam, AdamW, Adagrad, RMSprop, ...): it sees one flat shard per group.

    Each group is one flat unit: its parameters become views of one buffer [padded] (their
    values and shapes do not change) and the inner optimizer steps this rank's slice
    [lo, hi), so it holds the state of 1/N of the parameters (``state``: the inner
    optimizer's, by shard). After ``step()`` every rank holds the updated parameters.

    ``average_grads=True``: the ``.grad`` are each rank's own (a plain model) and ``step()``
    averages them (reduce-scatter, ÷N: ZeRO proper, 2(N-1)/N·P per step with the all-gather).
    ``False``: they are averaged already (a model under DDP, as ``ZeroRedundancyOptimizer``
    expects): each rank takes its slice of its own. ``shard_grads`` (ZeRO-2): reduce-scatter
    each group as soon as backward completes its gradients and free them (``.grad`` is None
    after backward). ``offload``: the inner optimizer steps an fp32 copy of the shard on the
    host. ZeRO-1 keeps its flat gradient buffer as DDP keeps its buckets: ``zero_grad`` zeroes
    it in place whatever ``set_to_none``.

    ``mixed_precision`` (a ``labs.train.MixedPrecision``): the flat buffers hold the parameters
    in ``param_dtype`` (the model's parameters become bf16 views of them), each unit keeps an fp32
    master of this rank's shard (``u.master`` [S]) that the inner optimizer steps, and gradients
    are reduce-scattered in ``reduce_dtype``. ``loss_scaler`` (fp16): a ``labs.train.LossScaler``
    whose ``scale(loss)`` the loop backpropagates; ``step()`` unscales the master gradients and
    skips the step when any rank's overflowed.

    State dicts: ``state_dict()`` is this rank's shard (it loads back on the same rank of the
    same group size); after ``consolidate_state_dict(to)`` (every rank calls it) rank ``to``'s
    ``state_dict()`` is the whole optimizer's, in the format of ``optimizer_cls`` on the same
    parameters unsharded. ``load_state_dict`` takes either, the whole one on any group size.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup | None = None,
        shard_grads: bool = False,
        average_grads: bool = True,
        offload: bool = False,
        mixed_precision: MixedPrecision | None = None,
        loss_scaler: LossScaler | None = None,
        **defaults: Any,
    ) -> None:
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW),"
                f" got {optimizer_cls!r}"
            )
        if optimizer_cls.__name__ in NOT_ELEMENTWISE:
            raise ValueError(
                f"optimizer_cls={optimizer_cls.__name__} updates an element from others (or needs"
                " sparse gradients or a closure per step): it cannot step a flat shard; use an"
                " elementwise one (SGD, Adam, AdamW, Adagrad, RMSprop, ...)"
            )
        if shard_grads and not average_grads:
            raise ValueError(
                "shard_grads=True reduce-scatters the gradients in backward, so it averages them:"
                " average_grads=False (gradients averaged by DDP) needs shard_grads=False"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of dicts, not one tensor")
        _check_mixed(mixed_precision, loss_scaler, offload)
        self.group = group
        self.rank, self.world = _rank_and_world(group)
        self.shard_grads = shard_grads
        self.average_grads = average_grads
        self.offload = offload
        self.mixed_precision = mixed_precision
        self.loss_scaler = loss_scaler
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [dict(g, params=list(g["params"])) for g in groups]
        self.units: list[FlatUnit] = []
        for i, g in enumerate(groups):
            name = g.get("name", f"group {i}")
            trainable = list(dict.fromkeys(p for p in g["params"] if p.requires_grad))
            _check_alike(name, trainable)
            self.units.append(FlatUnit(name, trainable, self.rank, self.world))
        for u in self.units:
            self._shard(u)
        targets = [self._target(k) for k in range(len(self.units))]
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [t]}
            for g, t in zip(groups, targets)
        ]
        self.inner = optimizer_cls(inner_groups, **defaults)
        super().__init__(groups, self.inner.defaults)
        self._built = True
        self.state = self.inner.state  # what this rank holds: the state of its shards
        self.ready = GradReadiness([u.params for u in self.units], self._on_grads_complete)
        self.host_bytes = 0  # bytes copied between device and host (offload)
        self._consolidated: dict | None = None

    def _shard(self, u: FlatUnit) -> None:
        """Bind the unit's parameters to one flat buffer; its slice [lo, hi) is what the inner
        optimizer steps (mixed precision: an fp32 master copy of it); the gradient buffers of
        ZeRO-1 (full, bound to the ``.grad``) or ZeRO-2 (this rank's shard)."""
        flat = u.flatten([p.detach() for p in u.params])  # [N*S], padded
        if self.mixed_precision is not None:
            u.master = nn.Parameter(flat[u.lo : u.hi].to(torch.float32, copy=True))  # [S] fp32
            flat = flat.to(self.mixed_precision.param_dtype)  # [N*S] what the model computes with
        u.bind(flat)
        u.shard_param = nn.Parameter(u.full[u.lo : u.hi])  # a view: the optimizer writes into full
        if self.shard_grads:
            u.shard_grad = torch.zeros(u.shard, dtype=u.full.dtype, device=u.full.device)
            u.shard_param.grad = u.shard_grad
        else:
            u.full_grad = torch.zeros_like(u.full)
            for p, g in zip(u.params, u.views(u.full_grad)):
                p.grad = g  # autograd accumulates into it
            u.shard_param.grad = u.full_grad[u.lo : u.hi]
        if (
            self.offload
        ):  # ZeRO-Offload: the optimizer updates an fp32 copy of the shard on the host
            u.host = nn.Parameter(u.shard_param.detach().to("cpu", copy=True))
            u.host.grad = torch.zeros_like(u.host)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(
                "ShardedOptimizer cuts each parameter group into shards when it is built: pass"
                " every group to the constructor (a new ShardedOptimizer for a new group)"
            )
        super().add_param_group(param_group)

    def _on_grads_complete(self, k: int) -> None:
        if self.shard_grads:  # unit k's gradients are complete: shard them now, free the rest
            self.reduce_scatter_grads(k)

    def _collect_grads(self, u: FlatUnit) -> None:
        """ZeRO-1: make the flat gradient buffer hold every parameter's ``.grad`` (None: zeros),
        re-binding a ``.grad`` that someone replaced (``model.zero_grad()``, a hand-set one)."""
        for p, view in zip(u.params, u.views(u.full_grad)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across the device-host link, counted in ``host_bytes``."""
        dst.copy_(src)
        self.host_bytes += src.numel() * src.element_size()

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are summed over the group in (None: the parameters' own)."""
        return self.mixed_precision.reduce_dtype if self.mixed_precision else None

    def reduce_scatter_grads(self, k: int) -> None:
        """Average unit k's gradients over the group, keeping this rank's shard.

        ZeRO-1: the parameters' ``.grad`` are views of ``u.full_grad`` [padded]: reduce-scatter it
        in place (output: its slice [lo, hi)), then divide that slice by N; with
        ``average_grads=False`` the slice is averaged already: nothing to do.
        ZeRO-2: flatten the ``.grad`` of ``u.params`` (None: zeros) into [padded], reduce-scatter
        into a new [shard] tensor, divide by N, add it to ``u.shard_grad`` (gradients accumulate
        until ``zero_grad``), set every ``.grad`` to None.
        Mixed precision: reduce-scatter a copy cast to ``self.reduce_dtype`` (when it is not the
        gradients' own) and round the averaged slice back into the bf16 gradient buffer.
        Collective: ``dist.reduce_scatter_single`` (SUM) on ``self.group``; (N-1)/N · padded
        elements of the reduce dtype.

        Part: core; the ``reduce_dtype`` cast comes with mixed-precision (an extension).
        """
        u = self.units[k]
        raise NotImplementedError(
            "exercise ShardedOptimizer.reduce_scatter_grads is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    @contextlib.contextmanager
    def keeping_untouched(self) -> Iterator[None]:
        """Around the inner step: elements of parameters that got no gradient this step
        (``u.untouched``) keep their values and their optimizer state, as torch's optimizers
        skip such parameters (weight decay and momentum included)."""
        targets = [self._target(k) for k in range(len(self.units))]
        masks = [u.untouched(self.ready.got_grad) for u in self.units]
        kept = []
        for t, m in zip(targets, masks):
            if m is None:
                kept.append(None)
                continue
            m = m.to(t.device)
            state = {
                key: v[m].clone()
                for key, v in self.inner.state.get(t, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == t.shape
            }
            kept.append((m, t.detach()[m].clone(), state))
        yield
        with torch.no_grad():
            for t, saved in zip(targets, kept):
                if saved is None:
                    continue
                m, values, state = saved
                t[m] = values
                for key, v in state.items():
                    self.inner.state[t][key][m] = v

    def unscale_grads(self) -> bool:
        """Loss scaling: divide every unit's master gradient (``u.master.grad``, fp32) by the scale
        (``self.loss_scaler.value``) in place, and return whether any rank's master gradients
        hold an inf or a nan (``labs.train.overflowed`` on this rank's). A rank holds only its
        shard, so the answer is a 0/1 flag (a tensor on the gradients' device) all-reduced with
        MAX over ``self.group``: every rank must skip the same steps.

        Part: mixed-precision (an extension).
        """
        raise NotImplementedError(
            "exercise ShardedOptimizer.unscale_grads is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def update_shards(self) -> None:
        """The inner optimizer (``self.inner``, whose parameters are the units' ``shard_param``,
        their ``master`` copies under mixed precision, or their ``host`` copies with offload)
        steps this rank's shards, inside ``self.keeping_untouched()``.

        Offload: first ``self.transfer`` each ``shard_param.grad`` into ``host.grad`` (device
        to host), step, then ``self.transfer`` each ``host`` into ``shard_param`` (host to device).
        Mixed precision: first each ``u.master.grad`` = the shard's gradient cast to fp32; with
        a loss scaler, skip the step if ``self.unscale_grads()`` says it overflowed, and
        ``self.loss_scaler.update(overflow)`` either way; after a step, copy each master into
        ``u.shard_param`` (rounding to bf16: the all-gather then sends bf16); finally drop the
        masters' fp32 gradients (None: they live only during the step).

        Part: core; the offload lines come with offload, the masters' with mixed-precision
        (extensions).
        """
        raise NotImplementedError(
            "exercise ShardedOptimizer.update_shards is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def _sync_hyperparameters(self) -> None:
        """The user's groups (a scheduler may have changed their lr) into the inner optimizer's."""
        for g, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (after ``loss.backward()``; ``closure`` re-evaluates the loss first).

        ZeRO-1 reduce-scatters every unit's gradients (ZeRO-2 did during backward), then
        ``update_shards``, then all-gathers each unit's updated shard into its ``full`` buffer
        in place (``dist.all_gather_single(u.full, u.full[u.lo:u.hi])``), so every rank's
        model holds the new parameters.

        Part: core.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._consolidated = None
        if not self.shard_grads:
            for u in self.units:
                self._collect_grads(u)
        raise NotImplementedError(
            "exercise ShardedOptimizer.step is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )
        self.ready.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """ZeRO-1: zero the flat gradient buffer in place (the ``.grad`` stay bound to it);
        ZeRO-2: zero the gradient shards, every ``.grad`` None."""
        for u in self.units:
            if u.full_grad is not None:
                u.full_grad.zero_()
                for p, g in zip(u.params, u.views(u.full_grad)):
                    p.grad = g
            else:
                u.shard_grad.zero_()
                for p in u.params:
                    p.grad = None

    # -- state dicts ------------------------------------------------------------------------------
    def _target(self, k: int) -> torch.Tensor:
        """What the inner optimizer steps for unit k: the host copy (offload), the fp32 master
        (mixed precision) or the shard itself."""
        u = self.units[k]
        if self.offload:
            return u.host
        return u.master if self.mixed_precision is not None else u.shard_param

    def _groups_for_state_dict(self) -> tuple[list[dict], dict[torch.Tensor, int]]:
        index: dict[torch.Tensor, int] = {}
        groups = []
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(p, len(index))
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [index[p] for p in g["params"]],
                }
            )
        return groups, index

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (``{"state": {group: {...}}, "param_groups",
        "zero_shard": layout}``), or, on the rank a ``consolidate_state_dict`` named since the
        last step, the whole optimizer's state dict."""
        if self._consolidated is not None:
            return self._consolidated
        groups, _ = self._groups_for_state_dict()
        state = {k: dict(self.inner.state.get(self._target(k), {})) for k in range(len(self.units))}
        layout = {
            "rank": self.rank,
            "world_size": self.world,
            "numels": [u.numel for u in self.units],
        }
        return {"state": state, "param_groups": groups, "zero_shard": layout}

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the whole optimizer state (every rank calls this: one all-gather per state
        tensor, on ``self.group``) into rank ``to``'s next ``state_dict()`` (``to=None``: every
        rank's). Format: ``optimizer_cls``'s own state dict on the unsharded parameters."""
        groups, index = self._groups_for_state_dict()
        state: dict[int, dict[str, Any]] = {}
        for k, u in enumerate(self.units):
            shard_state = self.inner.state.get(self._target(k), {})
            for key, value in sorted(shard_state.items()):
                if isinstance(value, torch.Tensor) and value.shape == (u.shard,):
                    full = torch.empty(u.padded, dtype=value.dtype, device=u.full.device)
                    dist.all_gather_single(full, value.to(u.full.device), group=self.group)
                    per_param = [v.clone() for v in u.views(full)]
                elif isinstance(value, torch.Tensor):
                    per_param = [value.clone() for _ in u.params]
                else:
                    per_param = [value for _ in u.params]
                for p, v in zip(u.params, per_param):
                    state.setdefault(index[p], {})[key] = v
        if to is None or to == self.rank:
            self._consolidated = {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of either kind (``state_dict``'s docstring): this rank's shard
        (the same rank and group size that saved it) or the whole optimizer's (any group size:
        each rank keeps its slice)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} parameter groups, this optimizer"
                f" {len(self.param_groups)}: load one saved from the same parameter groups"
            )
        shard = state_dict.get("zero_shard")
        if shard is not None:
            mine = {
                "rank": self.rank,
                "world_size": self.world,
                "numels": [u.numel for u in self.units],
            }
            if shard != mine:
                raise ValueError(
                    f"this sharded state dict is rank {shard['rank']}'s of {shard['world_size']}"
                    f" (groups of {shard['numels']} elements), this optimizer is rank {self.rank}"
                    f" of {self.world} ({mine['numels']}): load it on the rank that saved it, or"
                    " save a whole one (consolidate_state_dict, then state_dict)"
                )
            for k in range(len(self.units)):
                target = self._target(k)
                saved = state_dict["state"].get(k, state_dict["state"].get(str(k), {}))
                self.inner.state[target] = {
                    key: v.to(target.device) if isinstance(v, torch.Tensor) and v.dim() else v
                    for key, v in saved.items()
                }
        else:
            self._load_whole(state_dict, groups)
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self._sync_hyperparameters()

    def _load_whole(self, state_dict: dict[str, Any], groups: list[dict]) -> None:
        """Each rank's slice of a whole state dict: per-element state laid out as the flat
        buffer (a parameter without state counts as zeros), scalars (``step``) copied."""
        _, index = self._groups_for_state_dict()
        states = {int(i): s for i, s in state_dict["state"].items()}
        for k, u in enumerate(self.units):
            target = self._target(k)
            per_param = [states.get(index[p], {}) for p in u.params]
            new = {}
            for key in sorted({key for s in per_param for key in s}):
                values = [s.get(key) for s in per_param]
                if any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                    flat = u.flatten(values)  # [N*S]
                    new[key] = flat[u.lo : u.hi].to(target.device, target.dtype).clone()
                else:
                    first = next(v for v in values if v is not None)
                    new[key] = first.clone() if isinstance(first, torch.Tensor) else first
            self.inner.state[target] = new


def _check_mixed(
    mixed_precision: MixedPrecision | None, loss_scaler: LossScaler | None, offload: bool
) -> None:
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            "mixed_precision must be a labs.train.MixedPrecision(param_dtype, reduce_dtype),"
            f" got {mixed_precision!r}"
        )
    if mixed_precision is not None and offload:
        raise ValueError(
            "offload=True with mixed_precision is not part of this lab (the host would hold the"
            " fp32 masters): use one or the other"
        )
    if loss_scaler is not None and mixed_precision is None:
        raise ValueError(
            "loss_scaler needs mixed_precision (fp16 weights, fp32 masters): fp32 training has no"
            " gradients to rescue from underflow"
        )


# --- ZeRO-3: fully_shard -------------------------------------------------------------------------
class ShardedUnit:
    """One ``fully_shard`` call: its modules, its flat unit (``flat``; None if every parameter is
    replicated or claimed by an inner unit), the parameters it keeps whole (``replicated``) and
    this rank's ``shard`` [S] (on the device; with offload the optimizer steps ``host`` [S]).

    Between uses every parameter's data is its piece of the shard (``rest``); while the unit
    computes, a view of the gathered ``flat.full`` (``use``). The storage of ``flat.full`` is
    freed only when no parameter views it, so no read ever touches freed memory.

    Mixed precision (``mixed_precision``): ``shard`` is fp32 (the master weights, what the user's
    optimizer steps through the pieces), ``flat.full`` is ``param_dtype`` (gathered from a cast
    copy of the shard), and ``reduce_dtype`` is what the gradients are reduce-scattered in."""

    def __init__(
        self,
        name: str,
        modules: list[nn.Module],
        params: list[nn.Parameter],
        replicated: list[nn.Parameter],
        rank: int,
        world: int,
        offload: bool,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        self.name = name
        self.modules = modules
        self.replicated = replicated
        self.offload = offload
        self.reduce_dtype = mixed_precision.reduce_dtype if mixed_precision else None
        self.owner: Zero3 | None = None
        self.index = 0  # position in the owner's forward order
        self.in_use = False  # the parameters are views of the gathered full buffer
        self.stale = False  # offload: the host shard changed since the device copy was made
        self.grad_shard: torch.Tensor | None = None  # [S] the last averaged gradient shard
        self.stash: dict[nn.Parameter, torch.Tensor | None] = {}  # .grad from before backward
        self.flat = FlatUnit(name, params, rank, world) if params else None
        self.shard: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        if self.flat is not None:
            _check_alike(name, params)
            flat = self.flat.flatten([p.detach() for p in params])  # [N*S]
            # [S]: the copy kept (fp32 under mixed precision: the masters)
            shard_dtype = torch.float32 if mixed_precision else flat.dtype
            self.shard = flat[self.flat.lo : self.flat.hi].to(shard_dtype, copy=True)
            self.flat.bind(flat.to(mixed_precision.param_dtype) if mixed_precision else flat)
            if offload:
                self.host = self.shard.to("cpu", copy=True)
            self.rest()
            self.flat.release()
        self.ready = GradReadiness([params + replicated], self._on_grads_complete)

    def _on_grads_complete(self, _: int) -> None:
        self.owner.after_backward(self.index)

    def device_shard(self) -> torch.Tensor:
        """This rank's shard on the device [S] (offload: copied up from the host first if the
        optimizer changed it since)."""
        if self.stale:
            self.owner.transfer(self.shard, self.host)
            self.stale = False
        return self.shard

    def use(self) -> None:
        """Every parameter's data: its view of the gathered ``flat.full``."""
        for p, view in zip(self.flat.params, self.flat.views(self.flat.full)):
            p.data = view
        self.in_use = True

    def rest(self) -> None:
        """Every parameter's data: its piece of this rank's shard (``host`` with offload); a
        ``.grad`` set aside before backward comes back where backward left none (or a whole one,
        interrupted)."""
        source = self.host if self.offload else self.shard
        for p, piece in zip(self.flat.params, self.flat.pieces(source)):
            p.data = piece
            if p in self.stash and (p.grad is None or p.grad.shape != piece.shape):
                p.grad = self.stash[p]
        self.in_use = False

    def stash_grads(self) -> None:
        """Before backward: set aside the pieces' ``.grad`` (autograd accumulates whole ones)."""
        for p in self.flat.params:
            if p not in self.stash:
                self.stash[p] = p.grad
                p.grad = None

    def assign_grads(self) -> None:
        """After the reduce-scatter: each parameter that got a gradient gets its piece of
        ``grad_shard`` as ``.grad`` (added to one from before backward); the others keep theirs."""
        source = self.grad_shard
        if self.offload:
            source = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            self.owner.transfer(source, self.grad_shard)
            self.stale = True  # the optimizer will step the host shard
        got = self.ready.got_grad
        for p, piece in zip(self.flat.params, self.flat.pieces(source)):
            old = self.stash.get(p)
            if p in got:
                p.grad = piece if old is None else old + piece
            else:
                p.grad = old
        self.stash = {}
        self.ready.clear()


class Zero3:
    """The units of one model sharded with ``fully_shard``, in forward order (the outermost
    first), and what a step of them shares: ``group``, ``prefetch``, the all-gathers in flight
    (``inflight``: unit index -> work), the most parameter bytes held at once (``peak``) and
    the bytes copied to and from the host (``host_bytes``, offload)."""

    def __init__(self, group: dist.ProcessGroup | None, prefetch: bool) -> None:
        self.group = group
        self.rank, self.world = _rank_and_world(group)
        self.prefetch = prefetch
        self.units: list[ShardedUnit] = []
        self.inflight: dict[int, dist.Work] = {}
        self.peak = {"forward": 0, "backward": 0}
        self.host_bytes = 0
        self.seen: list[ShardedUnit] | None = []  # the first forward's order; None once applied

    def learn_order(self) -> None:
        """After the first forward: put the units in the order their forwards ran (registration
        order, the guess until then, need not be it), so prefetching takes the next one run."""
        order = self.seen + [u for u in self.units if u not in self.seen]
        self.seen = None
        moved = {u.index: k for k, u in enumerate(order)}
        self.inflight = {moved[k]: work for k, work in self.inflight.items()}
        self.units = order
        for k, u in enumerate(order):
            u.index = k

    def transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across the device-host link, counted in ``host_bytes``."""
        dst.copy_(src)
        self.host_bytes += src.numel() * src.element_size()

    def param_bytes(self) -> int:
        """Parameter bytes on the device now: every shard plus every allocated full buffer."""
        return sum(
            u.shard.untyped_storage().nbytes() + u.flat.full.untyped_storage().nbytes()
            for u in self.units
            if u.flat is not None
        )

    def begin_forward(self) -> None:
        """The outermost unit's forward starts a step: whatever an interrupted step left (an
        all-gather in flight, a unit in use, a half-counted backward) is put back to rest."""
        for work in self.inflight.values():
            work.wait()
        self.inflight.clear()
        for u in self.units:
            if u.flat is not None and (u.in_use or u.flat.allocated()):
                self.release(u.index)
            u.stash = {}
            u.ready.reset()

    def release(self, k: int) -> None:
        """Free unit k's full buffer: its parameters go back to their pieces first (a
        prefetch still in flight is waited for: its output must not be freed under it)."""
        u = self.units[k]
        if u.flat is None:
            return
        if k in self.inflight:
            self.inflight.pop(k).wait()
        u.rest()
        if u.flat.allocated():
            u.flat.release()

    def check_gathered(self, k: int, hook: str) -> None:
        """After ``hook``: unit k's full buffer must be gathered and no longer in flight."""
        u = self.units[k]
        if u.flat is None:
            return
        if k in self.inflight:
            raise RuntimeError(
                f"unit {u.name!r}: its all-gather is still in flight after {hook}: wait for it"
                f" (self.gather(k) without async_op) before the unit computes"
            )
        if not u.flat.allocated():
            raise RuntimeError(
                f"unit {u.name!r} is not gathered after {hook}: its full parameters are freed"
                f" and the unit would read freed memory: {hook} must gather unit k"
                " (self.gather(k)) before it runs"
            )

    def gather(self, k: int, async_op: bool = False) -> None:
        """Make unit k's ``flat.full`` buffer hold all N shards.

        If not ``u.flat.allocated()``: ``u.flat.allocate()`` and start
        ``dist.all_gather_single(u.flat.full, u.device_shard(), async_op=True)`` on
        ``self.group``, keeping its work in ``self.inflight[k]``. Unless ``async_op`` (a
        prefetch), wait for unit k's work. Sends (N-1)/N · 4 padded bytes. Mixed precision: the
        shard is fp32 and ``u.flat.full`` bf16: send a copy of the shard cast to
        ``u.flat.full.dtype`` (the all-gather carries 2 bytes per element).

        Part: zero3 (an extension); the cast comes with mixed-precision.
        """
        u = self.units[k]
        if u.flat is None:
            return
        raise NotImplementedError(
            "exercise Zero3.gather is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
        self.peak[phase] = max(self.peak[phase], self.param_bytes())

    def pre_forward(self, k: int) -> None:
        """Before unit k's forward: gather it; with ``self.prefetch`` start gathering unit
        k+1.

        Part: zero3 (an extension).
        """
        raise NotImplementedError(
            "exercise Zero3.pre_forward is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def post_forward(self, k: int) -> None:
        """After unit k's forward: free its full parameters (``self.release``).

        Part: zero3 (an extension).
        """
        raise NotImplementedError(
            "exercise Zero3.post_forward is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def pre_backward(self, k: int) -> None:
        """Before unit k's backward: gather it again; with prefetch start gathering unit k-1.

        Part: zero3 (an extension).
        """
        raise NotImplementedError(
            "exercise Zero3.pre_backward is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def reduce_scatter_grads(self, k: int) -> None:
        """Average unit k's gradients over the group into this rank's shard.

        Flatten the ``.grad`` of ``u.flat.params`` (whole, None: zeros) into [padded],
        reduce-scatter into a new [shard] tensor, divide it by N and keep it as ``u.grad_shard``,
        set every ``.grad`` to None (the pieces get theirs from ``u.grad_shard`` afterwards).
        Mixed precision: the flat gradients are bf16; reduce-scatter a copy cast to
        ``u.reduce_dtype``, and keep ``u.grad_shard`` in the shard's dtype (fp32, the masters').
        Collective: ``dist.reduce_scatter_single`` (SUM) on ``self.group``; (N-1)/N · padded
        elements of the reduce dtype.

        Part: zero3 (an extension); the cast comes with mixed-precision.
        """
        u = self.units[k]
        if u.flat is None:
            return
        raise NotImplementedError(
            "exercise Zero3.reduce_scatter_grads is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def post_backward(self, k: int) -> None:
        """Unit k's gradients are complete: reduce-scatter them and free its full parameters.

        Part: zero3 (an extension).
        """
        raise NotImplementedError(
            "exercise Zero3.post_backward is not written yet: "
            "see its docstring and notebooks/03_zero_and_fsdp.ipynb"
        )

    def average_replicated(self, k: int) -> None:
        """The gradients of unit k's replicated parameters, all-reduced and divided by N (one
        call for all of them; None counts as zeros so every rank sends the same bytes)."""
        params = self.units[k].replicated
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # -- the hooks: plumbing around the five methods above ----------------------------------------
    def before_forward(self, k: int) -> None:
        u = self.units[k]
        if torch._C._current_graph_task_id() >= 0:  # recomputation inside backward
            self.gather(k)
            if u.flat is not None:
                u.use()
            return
        if k == 0:
            self.begin_forward()
        if self.seen is not None and u not in self.seen:
            self.seen.append(u)
        self.pre_forward(k)
        self.check_gathered(k, "pre_forward")
        if u.flat is not None:
            u.use()

    def after_forward(self, k: int, output: Any) -> None:
        if torch._C._current_graph_task_id() >= 0:  # recomputation: backward still needs it
            return
        self.post_forward(k)
        unit = self.units[k]
        if k == 0 and self.seen is not None:
            self.learn_order()
        tensors = [
            t
            for t in torch.utils._pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # runs when the first gradient w.r.t. the unit's output arrives: before its backward
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: self.before_backward(unit.index), mode="any"
            )

    def before_backward(self, k: int) -> None:
        u = self.units[k]
        u.ready.expect()
        if u.flat is None:
            return
        u.stash_grads()
        self.pre_backward(k)
        self.check_gathered(k, "pre_backward")
        u.use()

    def after_backward(self, k: int) -> None:
        u = self.units[k]
        if u.flat is not None:
            self.post_backward(k)
            u.assign_grads()
        self.average_replicated(k)


def _unit_of(module: nn.Module) -> ShardedUnit | None:
    return getattr(module, "_zero_unit", None)


def sharded_units(module: nn.Module) -> list[ShardedUnit]:
    """The ``fully_shard`` units inside ``module`` (itself included), outermost first."""
    out = []
    for m in module.modules():
        u = _unit_of(m)
        if u is not None and u not in out:
            out.append(u)
    return out


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ZeRO-3 parameter (its data, between uses, a piece of a shard)."""
    return getattr(p, "_zero_unit", None) is not None


def _check_guard(unit: ShardedUnit, module: nn.Module, args: Any) -> None:
    if unit.in_use or torch._C._current_graph_task_id() >= 0:
        return
    raise RuntimeError(
        f"{type(module).__name__} belongs to ZeRO-3 unit {unit.name!r}, whose parameters are"
        f" sharded now (this rank holds pieces of them): call the unit itself"
        f" ({type(unit.modules[0]).__name__}), or read them whole inside"
        " `with summon_full_params(model):`"
    )


def _check_ties(root: ShardedUnit) -> None:
    """Every parameter is used by modules of the unit that shards it (or an inner unit's)."""

    def visit(module: nn.Module, prefix: str, unit: ShardedUnit | None) -> None:
        unit = _unit_of(module) or unit
        for pname, p in module._parameters.items():
            owner = getattr(p, "_zero_unit", None) if p is not None else None
            if owner is not None and owner is not unit:
                where = unit.name if unit is not None else "no unit"
                raise ValueError(
                    f"{prefix}{pname} is sharded by unit {owner.name!r} but used by {where!r}"
                    " too (a tied weight): fully_shard a module that contains every use of it"
                    " (the root), not each"
                )
        for cname, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", unit)

    for i, m in enumerate(root.modules):
        visit(m, f"[{i}]." if len(root.modules) > 1 else "", root)


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    group: dist.ProcessGroup | None = None,
    prefetch: bool = True,
    offload: bool = False,
    replicate: Iterable[nn.Parameter] = (),
    name: str | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> nn.Module | Sequence[nn.Module]:
    """ZeRO-3 on ``module`` (or on a list of modules run one after the other, as one unit), in
    FSDP2's style: apply it to each unit, then to the root (last), then train with any
    optimizer on ``model.parameters()``. Returns ``module``.

    The unit's trainable parameters not already in an inner unit are flattened and sharded
    over ``group``: each parameter's data becomes its piece of this rank's shard (the optimizer
    steps those), gathered whole around the unit's forward and backward by hooks on its first
    and last module. ``replicate``: parameters (norms, biases) to keep whole on every rank, their
    gradients all-reduced. ``prefetch``: gather the next unit while one computes. ``offload``:
    the pieces (and so the optimizer and its state) live on the host. ``name``: the unit's name
    (default: the module's class name; the root's: "model"). ``mixed_precision``: FSDP2's
    ``MixedPrecisionPolicy``, ours (``labs.train.MixedPrecision``): the pieces are fp32 masters,
    the unit computes in ``param_dtype``, gradients are reduced in ``reduce_dtype``; give every
    unit of a model the same policy."""
    modules = list(module) if isinstance(module, list | tuple) else [module]
    _check_mixed(mixed_precision, None, offload)
    replicate = set(replicate)
    if mixed_precision is not None and replicate:
        raise ValueError(
            "replicate with mixed_precision is not supported: a replicated parameter would have"
            " no fp32 master; shard it (leave it out of replicate)"
        )
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard takes a module or a list of modules, got {module!r}")
    for m in modules:
        if _unit_of(m) is not None:
            raise ValueError(f"{type(m).__name__} is already sharded (unit {_unit_of(m).name!r})")
    rank, world = _rank_and_world(group)
    inner = [u for m in modules for u in sharded_units(m)]
    inner = list(dict.fromkeys(inner))
    claimed = {p for u in inner for p in (u.flat.params if u.flat else []) + u.replicated}
    params: list[nn.Parameter] = []
    replicated: list[nn.Parameter] = []
    for m in modules:
        for pname, p in m.named_parameters():
            taken = set(params) | set(replicated)
            if not p.requires_grad or p in claimed or p in taken:
                continue
            if is_sharded(p):
                raise ValueError(
                    f"{pname} is already sharded by unit {p._zero_unit.name!r} (a weight tied"
                    " across units): fully_shard a module that contains every use of it"
                )
            (replicated if p in replicate else params).append(p)
    default = "model" if inner else type(modules[0]).__name__
    unit = ShardedUnit(
        name or default, modules, params, replicated, rank, world, offload, mixed_precision
    )
    owner = Zero3(group, prefetch)
    owner.units = [unit] + inner
    for k, u in enumerate(owner.units):
        u.owner = owner
        u.index = k
    for p in params:
        p._zero_unit = unit
    for m in modules:
        m._zero_unit = unit
    _check_ties(unit)
    modules[0].register_forward_pre_hook(lambda m, args: unit.owner.before_forward(unit.index))
    modules[-1].register_forward_hook(
        lambda m, args, out: unit.owner.after_forward(unit.index, out)
    )
    mine = set(params)
    for m in modules:
        for sub in m.modules():
            if _unit_of(sub) in (None, unit) and any(p in mine for p in sub._parameters.values()):
                sub.register_forward_pre_hook(partial(_check_guard, unit))
        m.register_load_state_dict_post_hook(partial(_mark_stale, unit))
    return module


def _mark_stale(unit: ShardedUnit, module: nn.Module, incompatible: Any) -> None:
    unit.stale = unit.offload  # loading wrote into the host pieces


@contextlib.contextmanager
def summon_full_params(module: nn.Module, *, writeback: bool = False) -> Iterator[None]:
    """Inside the block every parameter of ``module``'s ZeRO-3 units is whole (all-gathered into
    fresh buffers: keep or save what you read, it stays valid after the block). ``writeback``:
    changes made inside are copied back into the shards at the end. Every rank must enter it (one
    all-gather per unit on its group); not during backward."""
    if torch._C._current_graph_task_id() >= 0:
        raise RuntimeError("summon_full_params cannot run during backward")
    units = [u for u in sharded_units(module) if u.flat is not None]
    gathered = []
    for u in units:
        full = torch.empty(u.flat.padded, dtype=u.shard.dtype, device=u.shard.device)
        dist.all_gather_single(full, u.device_shard(), group=u.owner.group)
        for p, view in zip(u.flat.params, u.flat.views(full)):
            p.data = view
        gathered.append((u, full, u.in_use))
    try:
        yield
    finally:
        for u, full, was_in_use in gathered:
            if writeback:
                u.shard.copy_(full[u.flat.lo : u.flat.hi])
                if u.offload:
                    u.host.copy_(u.shard)
            if was_in_use:
                u.use()
            else:
                u.rest()


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also knows ZeRO-3's pieces: their gradients are
    this rank's share of a whole gradient, so their norm terms are summed (max-ed, for inf) over
    the unit's group, whole gradients' are counted once. Scales every gradient by
    ``max_norm / (total + 1e-6)`` when that is below 1; returns the total norm. Every rank must
    call it with the same parameters (a collective when any of them is sharded)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    sharded = [p for p in params if is_sharded(p)]
    groups = {id(p._zero_unit.owner.group): p._zero_unit.owner.group for p in sharded}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the parameters are sharded over different groups")
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))

    def term(ps: list[torch.Tensor]) -> torch.Tensor:
        gs = [p.grad.detach().to(device).reshape(-1).double() for p in ps if p.grad is not None]
        if not gs:
            return torch.zeros((), dtype=torch.float64, device=device)
        g = torch.cat(gs)
        if math.isinf(norm_type):
            return g.abs().max() if g.numel() else torch.zeros((), dtype=g.dtype, device=device)
        return g.abs().pow(norm_type).sum()

    shared = term(sharded)
    if sharded:
        shared = shared.to(sharded[0]._zero_unit.shard.device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(shared, op=op, group=next(iter(groups.values())))
    whole = term([p for p in params if not is_sharded(p)]).to(shared.device)
    if math.isinf(norm_type):
        total = torch.maximum(shared, whole)
    else:
        total = (shared + whole) ** (1.0 / norm_type)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1:
        for g in grads:
            g.detach().mul_(coef)
    return total.to(grads[0].dtype if grads else torch.float32)
