"""Sharded ZeRO checkpoints (notebook 03): save on N ranks, load on M ranks or in one process.

    save(model, optimizer, path)   # every rank writes its shards (ZeRO-1/2: optimizer is a
                                   # ShardedOptimizer; ZeRO-3: model went through fully_shard)
    load(model, optimizer, path)   # any number of ranks: each reads the pieces it now owns
    optimizer = load_full(path, model, cfg)   # one process, no torch.distributed:
                                              # a plain model + AdamW

A ZeRO rank owns the slice [r·S_u, (r+1)·S_u) of each unit's flat buffer of Ψ_u elements
(padding left out): the ``ShardedOptimizer``'s shard of a parameter group, or the pieces of a
``fully_shard`` unit's parameters laid end to end. Written as a ``DTensor`` of global shape [Ψ_u]
with placement ``Shard(0)`` (torch.chunk's split: ceil(Ψ_u/N) per rank, the last rank shorter),
the slice carries its offset, and ``torch.distributed.checkpoint`` (DCP) records it in the
checkpoint's metadata. Loading asks for the slices the *loading* layout needs; DCP reads
the overlapping pieces from whichever files hold them: resharding is free. Saved per unit:
the parameters and AdamW's two moments; also the step count, the frozen parameters and
the layout (every parameter's name and shape, in order), which a load checks first.

A missing checkpoint raises ``FileNotFoundError`` and an unreadable one ``ValueError``,
both naming the path, on every rank (DCP gathers the ranks' errors, so none is left waiting).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from labs.runtime.flat import FlatBuffer
from labs.runtime.impl import exercise
from labs.train import TrainConfig, make_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


class _Unit:
    """One unit as a checkpoint sees it: its layout (``flat``), this rank's unpadded elements of
    the parameters and of each optimizer moment, and how to put loaded ones back."""

    def __init__(self, model: torch.nn.Module, optimizer, flat: FlatBuffer, zero3=None):
        self.model = model
        self.optimizer = optimizer
        self.flat = flat
        self.zero3 = zero3  # the fully_shard unit, or None (a ShardedOptimizer's group)
        self.count = max(0, min(flat.hi, flat.numel) - flat.lo)  # this rank's real elements

    @property
    def device(self) -> torch.device:
        return self.zero3.shard.device if self.zero3 else self.flat.shard_param.device

    def _target(self) -> torch.Tensor:
        return self.flat.host if self.optimizer.offload else self.flat.shard_param

    def values(self) -> torch.Tensor:
        if self.zero3:
            return self.zero3.device_shard()[: self.count]
        return self.flat.shard_param.detach()[: self.count]

    def moment(self, kind: str) -> torch.Tensor:
        if self.zero3:
            parts = []
            for p, (a, b, _) in zip(self.flat.params, self.flat.piece_bounds()):
                state = self.optimizer.state.get(p, {})
                parts.append(state[kind].to(self.device) if kind in state else self._zeros(b - a))
            return torch.cat(parts) if parts else self._zeros(0)
        state = self.optimizer.state.get(self._target(), {})
        return (
            state[kind][: self.count].to(self.device) if kind in state else self._zeros(self.count)
        )

    def step(self) -> float:
        params = self.flat.params if self.zero3 else [self._target()]
        steps = [
            float(self.optimizer.state[p]["step"])
            for p in params
            if "step" in self.optimizer.state.get(p, {})
        ]
        return max(steps, default=0.0)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.flat.params[0].dtype, device=self.device)

    def put(self, values: torch.Tensor, moments: dict[str, torch.Tensor], step: torch.Tensor):
        """This rank's loaded elements into the shard and the optimizer (under no_grad)."""
        if self.zero3:
            u = self.zero3
            u.shard.zero_()[: self.count] = values
            if u.offload:
                u.host.copy_(u.shard)
            for p, (a, b, o) in zip(self.flat.params, self.flat.piece_bounds()):
                self.optimizer.state[p] = {"step": step.clone()} | {
                    kind: m[o : o + b - a].to(p.device).clone() for kind, m in moments.items()
                }
            return
        u = self.flat
        u.shard_param.zero_()[: self.count] = values
        target = self._target()
        state = {"step": step.clone()}
        for kind, m in moments.items():
            state[kind] = torch.zeros_like(target)
            state[kind][: self.count] = m.to(state[kind].device)
        self.optimizer.state[target] = state
        if self.optimizer.offload:
            u.host.copy_(u.shard_param)
        dist.all_gather_single(u.full, u.full[u.lo : u.hi], group=self.optimizer.group)


def _units(model: torch.nn.Module, optimizer) -> tuple[list[_Unit], dist.ProcessGroup | None]:
    """The units of a ZeRO-1/2 ``ShardedOptimizer`` or of a ``fully_shard``-ed model."""
    zero = exercise("zero")
    if isinstance(optimizer, zero.ShardedOptimizer):
        return [_Unit(model, optimizer, u) for u in optimizer.units], optimizer.group
    units = [u for u in zero.sharded_units(model) if u.flat is not None]
    if not units:
        raise ValueError(
            "a ZeRO checkpoint needs a ShardedOptimizer or a model sharded with fully_shard"
        )
    return [_Unit(model, optimizer, u.flat, u) for u in units], units[0].owner.group


def layout(model: torch.nn.Module, flats: list[FlatBuffer]) -> str:
    """The units' parameter names and shapes, as JSON: what a checkpoint must match to load."""
    names = {p: n for n, p in model.named_parameters()}
    return json.dumps(
        [[u.name, [[names[p], list(s)] for p, s in zip(u.params, u.shapes)]] for u in flats]
    )


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"frozen.{n}": p.detach() for n, p in model.named_parameters() if not p.requires_grad}


def _restore_frozen(model: torch.nn.Module, sd: dict) -> None:
    """Copy the checkpoint's ``frozen.<name>`` entries of ``sd`` back into ``model``
    (call under no_grad)."""
    params = dict(model.named_parameters())
    for key, value in sd.items():
        if key.startswith("frozen."):
            params[key[len("frozen.") :]].copy_(value)


def _sharded(units: list[_Unit], group, local_of) -> dict[str, DTensor]:
    """One DTensor [Ψ_u] per unit and tensor kind; ``local_of(unit, kind)`` is this rank's piece."""
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, units[0].device.type)
    out = {}
    for k, u in enumerate(units):
        for kind in ("param",) + MOMENTS:
            out[f"unit{k}.{kind}"] = DTensor.from_local(
                local_of(u, kind),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=(u.flat.numel,),
                stride=(1,),
            )
    return out


def save(model: torch.nn.Module, optimizer, path: str | Path) -> None:
    """Write the model's and ``optimizer``'s state to the folder ``path`` (every rank calls it)."""
    units, group = _units(model, optimizer)

    def local(u: _Unit, kind: str) -> torch.Tensor:
        return u.values() if kind == "param" else u.moment(kind)

    step = torch.tensor(max(u.step() for u in units))
    lay = layout(model, [u.flat for u in units])
    sd = _sharded(units, group, local) | _frozen(model) | {"step": step, "layout": lay}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), overwrite=True))


def _check_exists(path: str | Path) -> Path:
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: {path / '.metadata'} does not exist")
    return path


def _read(sd: dict, path: Path, no_dist: bool) -> None:
    try:
        # no_dist=True: DCP warns it will read in a single process; we asked it to
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(path), no_dist=no_dist)
    # DCP gathers the ranks' errors (a BaseException)
    except (Exception, dcp.CheckpointException) as e:
        reason = str(e).strip().splitlines()
        raise ValueError(
            f"checkpoint at {path} is corrupted or incomplete: {type(e).__name__}: "
            f"{reason[-1] if reason else ''}"
        ) from e


def _saved_layout(path: Path) -> str:
    sd = {"layout": ""}
    _read(sd, path, no_dist=True)
    return sd["layout"]


def _check_layout(path: Path, expected: str) -> None:
    saved = _saved_layout(path)
    if saved != expected:
        raise ValueError(
            f"checkpoint at {path} was saved from another model or unit split:\n"
            f"saved    {saved[:300]}\nexpected {expected[:300]}"
        )


def load(model: torch.nn.Module, optimizer, path: str | Path) -> None:
    """Fill the shards of ``model`` / ``optimizer`` and the optimizer's state from the
    checkpoint at ``path`` (every rank calls it; any rank count). ZeRO-1/2's whole parameters
    are all-gathered now; ZeRO-3's are gathered at their next use."""
    path = _check_exists(path)
    units, group = _units(model, optimizer)
    _check_layout(path, layout(model, [u.flat for u in units]))
    pieces = {}

    def local(u: _Unit, kind: str) -> torch.Tensor:
        pieces[(id(u), kind)] = torch.zeros(u.count, dtype=u.flat.params[0].dtype, device=u.device)
        return pieces[(id(u), kind)]

    sd = (
        _sharded(units, group, local)
        | {k: torch.empty_like(v) for k, v in _frozen(model).items()}
        | {"step": torch.tensor(0.0)}
    )
    _read(sd, path, no_dist=False)
    with torch.no_grad():
        for u in units:
            moments = {kind: pieces[(id(u), kind)] for kind in MOMENTS}
            u.put(pieces[(id(u), "param")], moments, sd["step"])
        _restore_frozen(model, sd)


def load_full(path: str | Path, model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Load the checkpoint into a plain single-process ``model`` (no process group needed);
    returns the AdamW optimizer (``labs.train.make_optimizer``) holding the saved state."""
    path = _check_exists(path)
    units = json.loads(_saved_layout(path))
    params = dict(model.named_parameters())
    missing = [n for _, ps in units for n, _ in ps if n not in params]
    if missing:
        raise ValueError(f"checkpoint at {path} names parameters this model lacks: {missing[:5]}")
    sd = {"step": torch.tensor(0.0)} | {k: torch.empty_like(v) for k, v in _frozen(model).items()}
    for k, (_, ps) in enumerate(units):
        numel = sum(params[n].numel() for n, _ in ps)
        sd |= {f"unit{k}.{kind}": torch.zeros(numel) for kind in ("param",) + MOMENTS}
    _read(sd, path, no_dist=True)
    optimizer = make_optimizer(model.parameters(), cfg)
    with torch.no_grad():
        for k, (_, ps) in enumerate(units):
            offset = 0
            for name, shape in ps:
                p = params[name]
                if list(p.shape) != shape:
                    raise ValueError(
                        f"checkpoint at {path}: {name} has shape {shape}, the model {list(p.shape)}"
                    )
                piece = slice(offset, offset + p.numel())
                p.copy_(sd[f"unit{k}.param"][piece].view_as(p))
                optimizer.state[p] = {"step": sd["step"].clone()} | {
                    kind: sd[f"unit{k}.{kind}"][piece].view_as(p).clone() for kind in MOMENTS
                }
                offset += p.numel()
        _restore_frozen(model, sd)
    return optimizer
