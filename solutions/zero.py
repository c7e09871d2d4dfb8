"""Exercise 03 (notebooks/03_zero_and_fsdp.ipynb): ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) from scratch.

Data parallelism keeps N copies of the training state; ZeRO keeps one, cut into N shards.
Each *unit* of the model (the embedding, each transformer block, the head) has its
trainable parameters flattened into one buffer of Ψ_u elements, zero-padded to N·S_u
with S_u = ceil(Ψ_u/N), so any size works on any N: rank r owns [r·S_u, (r+1)·S_u).

Communication contract, on the data-parallel ``group`` of N ranks, per step
(P = Σ_u 4·N·S_u bytes, the padded fp32 parameters; ``labs.theory.zero.comm_bytes``):

    stage 1  step: reduce-scatter each unit's full gradient buffer in place (rank r's
             slice becomes the average), AdamW on the shard, all-gather the updated
             shards into the full parameter buffer.                      2 (N-1)/N · P
    stage 2  backward: once a unit's gradients are complete, reduce-scatter them into a
             persistent shard and free them. step: AdamW, all-gather.      2 (N-1)/N · P
    stage 3  forward: all-gather unit k before its forward (and prefetch unit k+1), free
             it after. backward: all-gather unit k again (prefetch k-1), reduce-scatter
             its gradients, free parameters and gradients. step: AdamW on the shards.
                                                                           3 (N-1)/N · P
    offload  any stage: AdamW and its state live on the host (an fp32 copy of the shard);
             4·S_u bytes of gradient go down and 4·S_u of parameters come up per unit.

Memory held per rank: ``labs.theory.zero.held_bytes`` (stage 3: 16·Σ S_u bytes). The
plumbing (freeing a buffer's storage; hooks that report a unit's gradients complete) is
in ``labs/runtime/flat.py``. As torch's AdamW, parameters whose gradient is None (unused)
are not updated; frozen parameters stay whole on every rank and are never touched.

Rajbhandari et al., "ZeRO" (SC 2020), §5 (stages) and §7 (communication); Ren et al.,
"ZeRO-Offload" (ATC 2021), §4; Zhao et al., "PyTorch FSDP" (VLDB 2023), §3.2-3.3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.runtime.flat import FlatBuffer, GradReadiness
from labs.train import TrainConfig, make_optimizer

NOTEBOOK = "03_zero_and_fsdp.ipynb"


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 3  # 1: optimizer state sharded; 2: + gradients; 3: + parameters
    offload: bool = False  # AdamW and its state on the host (ZeRO-Offload)
    prefetch: bool = True  # ZeRO-3: all-gather unit k+1 while unit k computes

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"stage={self.stage!r} is not one of (1, 2, 3); stage 0 is plain data parallelism"
            )


class FlatUnit(FlatBuffer):
    """One unit's trainable parameters as one flat buffer (layout and memory: ``FlatBuffer``).

    ``numel`` elements padded to ``padded = world * shard``; this rank owns ``[lo, hi)``.
    The wrappers below give it ``full`` [padded] (the parameters are views of it),
    ``shard_param`` [shard] (the ``nn.Parameter`` AdamW updates), ``full_grad`` [padded]
    (stage 1) or ``shard_grad`` [shard], and with offload ``host`` [shard] on the CPU."""

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The tensors (one per parameter; None counts as zeros) laid end to end, then zeros
        up to ``padded`` elements: ``[padded]``, same dtype and device as the parameters."""
        ### BEGIN SOLUTION
        p0 = self.params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat
        ### END SOLUTION


Units = Sequence[tuple[str, Sequence[nn.Module]]]  # [(name, [modules]), ...] in forward order


class _Sharded:
    """What every stage shares: units, the sharded optimizer, the gradient reduction."""

    def __init__(
        self,
        model: nn.Module,
        units: Units | None,
        cfg: TrainConfig,
        zero: ZeroConfig,
        group: dist.ProcessGroup | None,
    ):
        self.model = model
        self.zero = zero
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        units = units if units is not None else [("model", [model])]
        self.modules = [modules for _, modules in units]
        self.units = []
        seen = set()
        for name, modules in units:  # a parameter shared by two units (tied) belongs to the first
            params = [
                p for m in modules for p in m.parameters() if p.requires_grad and p not in seen
            ]
            seen.update(params)
            self.units.append(FlatUnit(name, params, self.rank, self.world))
        self.ready = GradReadiness(self.units, self.post_backward)
        self.host_bytes = 0  # bytes copied between device and host (offload)
        self._build()
        for u in self.units:
            u.shard_param.grad = u.full_grad[u.lo : u.hi] if zero.stage == 1 else u.shard_grad
            if zero.offload:  # ZeRO-Offload: AdamW updates an fp32 copy of the shard on the host
                u.host = nn.Parameter(u.shard_param.detach().to("cpu", copy=True))
                u.host.grad = torch.zeros_like(u.host)
        self.optimizer = make_optimizer(
            [u.host if zero.offload else u.shard_param for u in self.units], cfg
        )

    def zero_grad(self) -> None:
        self.ready.reset()
        for u in self.units:
            if u.full_grad is not None:
                u.full_grad.zero_()

    def transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across the device-host link, counted in ``host_bytes``."""
        dst.copy_(src)
        self.host_bytes += src.numel() * src.element_size()

    def reduce_scatter_grads(self, k: int) -> None:
        """Average unit k's gradients over the group, keeping this rank's shard.

        Stage 1: the parameters' ``.grad`` are views of ``full_grad`` [padded]: reduce-scatter
        it in place (output: its slice [lo, hi)), then divide that slice by N.
        Stages 2-3: flatten the ``.grad`` of ``u.params`` (None: zeros) into [padded],
        reduce-scatter into ``shard_grad`` [shard], divide by N, set every ``.grad`` to None.
        Collective: ``dist.reduce_scatter_single`` (SUM) on ``self.group``; (N-1)/N · padded bytes.
        """
        u = self.units[k]
        ### BEGIN SOLUTION
        if self.zero.stage == 1:
            dist.reduce_scatter_single(u.full_grad[u.lo : u.hi], u.full_grad, group=self.group)
            u.full_grad[u.lo : u.hi].div_(self.world)
            return
        flat = u.flatten([p.grad for p in u.params])  # [N*S]
        dist.reduce_scatter_single(u.shard_grad, flat, group=self.group)  # [S]
        u.shard_grad.div_(self.world)
        for p in u.params:
            p.grad = None
        ### END SOLUTION

    def update_shards(self) -> None:
        """AdamW on this rank's shards (``self.optimizer``, whose params are the units'
        ``shard_param``, or their ``host`` copies with offload).

        Offload: first ``self.transfer`` each ``shard_param.grad`` into ``host.grad`` (device
        to host), step, then ``self.transfer`` each ``host`` into ``shard_param`` (host to device).
        Elements of parameters that got no gradient (``u.untouched(self.ready.got_grad)``) keep
        their values: torch's AdamW skips such parameters, weight decay included.
        """
        ### BEGIN SOLUTION
        targets = [u.host if self.zero.offload else u.shard_param for u in self.units]
        if self.zero.offload:
            for u in self.units:
                self.transfer(u.host.grad, u.shard_param.grad)
        masks = [u.untouched(self.ready.got_grad) for u in self.units]
        masks = [m if m is None else m.to(t.device) for m, t in zip(masks, targets)]
        kept = [t.detach()[m] if m is not None else None for t, m in zip(targets, masks)]
        self.optimizer.step()
        with torch.no_grad():
            for t, m, old in zip(targets, masks, kept):
                if m is not None:
                    t[m] = old
        if self.zero.offload:
            for u in self.units:
                self.transfer(u.shard_param.data, u.host.detach())
        ### END SOLUTION


class Zero12(_Sharded):
    """ZeRO-1 (optimizer state sharded) and ZeRO-2 (+ gradients sharded). Parameters stay whole."""

    def _build(self) -> None:
        for u in self.units:
            u.bind(u.flatten([p.detach() for p in u.params]))  # [N*S], padded
            u.shard_param = nn.Parameter(u.full[u.lo : u.hi])  # a view: AdamW writes into full
            if self.zero.stage == 1:
                u.full_grad = torch.zeros_like(u.full)
                for p, g in zip(u.params, u.views(u.full_grad)):
                    p.grad = g  # autograd accumulates into it
            else:
                u.shard_grad = torch.zeros(u.shard, dtype=u.full.dtype, device=u.full.device)

    def post_backward(self, k: int) -> None:
        if self.zero.stage == 2:  # unit k's gradients are complete: shard them now, free the rest
            self.reduce_scatter_grads(k)

    def step(self) -> None:
        """After ``loss.backward()``: stage 1 reduce-scatters every unit's gradients (stage 2
        did during backward), then update the shards, then all-gather each unit's updated
        shard into its ``full`` buffer in place (``dist.all_gather_single(u.full,
        u.full[u.lo:u.hi])``), so every rank's model holds the new parameters."""
        ### BEGIN SOLUTION
        if self.zero.stage == 1:
            for k in range(len(self.units)):
                self.reduce_scatter_grads(k)
        self.update_shards()
        for u in self.units:
            dist.all_gather_single(u.full, u.full[u.lo : u.hi], group=self.group)
        ### END SOLUTION


class Zero3(_Sharded):
    """ZeRO-3 / FSDP: parameters sharded too, gathered one unit at a time around its use."""

    def _build(self) -> None:
        self.inflight: dict[int, dist.Work] = {}  # unit -> async all-gather work
        self.peak = {"forward": 0, "backward": 0}  # most parameter bytes held at once
        for k, u in enumerate(self.units):
            full = u.flatten([p.detach() for p in u.params])
            u.shard_param = nn.Parameter(full[u.lo : u.hi].clone())  # [S]: the only copy kept
            u.shard_grad = torch.zeros_like(u.shard_param)
            u.bind(full)
            u.release()
            first = self.modules[k][0]
            last = self.modules[k][-1]
            first.register_forward_pre_hook(lambda m, args, k=k: self.pre_forward(k))
            last.register_forward_hook(lambda m, args, out, k=k: self._after_forward(k, out))

    def _after_forward(self, k: int, out: object) -> None:
        self.post_forward(k)
        tensors = [
            t
            for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # The hook runs when the first gradient w.r.t. the unit's output arrives: before its
        # backward.
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: self.pre_backward(k), mode="any"
            )

    def param_bytes(self) -> int:
        """Parameter bytes held now: every shard plus every allocated full buffer."""
        return sum(
            u.shard_param.numel() * u.shard_param.element_size() + u.full.untyped_storage().nbytes()
            for u in self.units
        )

    def gather(self, k: int, async_op: bool = False) -> None:
        """Make unit k's ``full`` buffer hold all N shards.

        If not ``u.allocated()``: ``u.allocate()`` and start ``dist.all_gather_single(u.full,
        u.shard_param.detach(), async_op=True)`` on ``self.group``, keeping its work in
        ``self.inflight[k]``. Unless ``async_op`` (a prefetch), wait for unit k's work.
        Sends (N-1)/N · 4 padded bytes.
        """
        u = self.units[k]
        ### BEGIN SOLUTION
        if not u.allocated():
            u.allocate()
            self.inflight[k] = dist.all_gather_single(
                u.full, u.shard_param.detach(), group=self.group, async_op=True
            )
        if not async_op and k in self.inflight:
            self.inflight.pop(k).wait()
        ### END SOLUTION
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
        self.peak[phase] = max(self.peak[phase], self.param_bytes())

    def pre_forward(self, k: int) -> None:
        """Before unit k's forward: gather it; with ``self.zero.prefetch`` start gathering unit
        k+1."""
        ### BEGIN SOLUTION
        self.gather(k)
        if self.zero.prefetch and k + 1 < len(self.units):
            self.gather(k + 1, async_op=True)
        ### END SOLUTION

    def post_forward(self, k: int) -> None:
        """After unit k's forward: free its full parameters (``release``)."""
        ### BEGIN SOLUTION
        self.units[k].release()
        ### END SOLUTION

    def pre_backward(self, k: int) -> None:
        """Before unit k's backward: gather it again; with prefetch start gathering unit k-1."""
        ### BEGIN SOLUTION
        self.gather(k)
        if self.zero.prefetch and k > 0:
            self.gather(k - 1, async_op=True)
        ### END SOLUTION

    def post_backward(self, k: int) -> None:
        """Unit k's gradients are complete: reduce-scatter them and free its full parameters."""
        ### BEGIN SOLUTION
        self.reduce_scatter_grads(k)
        self.units[k].release()
        ### END SOLUTION

    def step(self) -> None:
        """After ``loss.backward()`` (every unit already reduce-scattered): update the shards.
        No all-gather: the next forward gathers each unit when it needs it."""
        ### BEGIN SOLUTION
        self.update_shards()
        ### END SOLUTION


def shard_model(
    model: nn.Module,
    *,
    stage: int,
    cfg: TrainConfig,
    units: Units | None = None,
    offload: bool = False,
    prefetch: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Zero12 | Zero3:
    """Wrap ``model`` for ZeRO ``stage`` (1, 2 or 3) on ``group``. ``units``: [(name, [modules])]
    run in that order (default: the whole model is one unit). Train with
    ``loss.backward(); z.step(); z.zero_grad()``."""
    zero = ZeroConfig(stage=stage, offload=offload, prefetch=prefetch)
    return (Zero3 if stage == 3 else Zero12)(model, units, cfg, zero, group)
