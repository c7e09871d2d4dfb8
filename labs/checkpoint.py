"""Sharded ZeRO checkpoints (notebook 03): save on N ranks, load on M ranks or in one process.

    save(z, path)                        # every rank of the ZeRO wrapper ``z`` writes its shards
    load(z, path)                        # any number of ranks: each reads the pieces it now owns
    optimizer = load_full(path, model, cfg)   # one process, no torch.distributed:
                                              # a plain model + AdamW

A ZeRO rank owns the slice [r·S_u, (r+1)·S_u) of each unit's flat buffer of Ψ_u elements
(padding left out). Written as a ``DTensor`` of global shape [Ψ_u] with placement
``Shard(0)`` (torch.chunk's split: ceil(Ψ_u/N) per rank, the last rank shorter), the slice
carries its offset, and ``torch.distributed.checkpoint`` (DCP) records it in the
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
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from labs.runtime.flat import FlatBuffer
from labs.train import TrainConfig, make_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


class ZeroOptions(Protocol):
    """The options of a ZeRO wrapper a checkpoint reads (the exercise's ``ZeroConfig``)."""

    @property
    def stage(self) -> int: ...

    @property
    def offload(self) -> bool: ...


class ShardedModel(Protocol):
    """What a checkpoint reads and fills of a ZeRO wrapper (``zero.shard_model``'s result):
    the model, its units (one flat buffer each, this rank owning ``[lo, hi)``) and the AdamW
    that updates the units' shards."""

    model: torch.nn.Module
    units: list[FlatBuffer]
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    zero: ZeroOptions


def layout(z: ShardedModel) -> str:
    """The units' parameter names and shapes, as JSON: what a checkpoint must match to load."""
    names = {p: n for n, p in z.model.named_parameters()}
    return json.dumps([[u.name, [[names[p], list(p.shape)] for p in u.params]] for u in z.units])


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"frozen.{n}": p.detach() for n, p in model.named_parameters() if not p.requires_grad}


def _restore_frozen(model: torch.nn.Module, sd: dict) -> None:
    """Copy the checkpoint's ``frozen.<name>`` entries of ``sd`` back into ``model``
    (call under no_grad)."""
    params = dict(model.named_parameters())
    for key, value in sd.items():
        if key.startswith("frozen."):
            params[key[len("frozen.") :]].copy_(value)


def _sharded(
    z: ShardedModel, local_of: Callable[[FlatBuffer, str], torch.Tensor]
) -> dict[str, DTensor]:
    """One DTensor [Ψ_u] per unit and tensor kind; ``local_of(u, kind)`` is this rank's piece."""
    mesh = DeviceMesh.from_group(z.group or dist.group.WORLD, z.units[0].shard_param.device.type)
    out = {}
    for k, u in enumerate(z.units):
        for kind in ("param",) + MOMENTS:
            out[f"unit{k}.{kind}"] = DTensor.from_local(
                local_of(u, kind), mesh, [Shard(0)], run_check=False, shape=(u.numel,), stride=(1,)
            )
    return out


def _owned(u: FlatBuffer) -> slice:
    """This rank's elements of the unpadded [Ψ_u] (empty past the end)."""
    return slice(0, max(0, min(u.hi, u.numel) - u.lo))


def _opt_param(z: ShardedModel, u: FlatBuffer) -> torch.Tensor:
    return u.host if z.zero.offload else u.shard_param


def _step(z: ShardedModel) -> torch.Tensor:
    states = [z.optimizer.state.get(_opt_param(z, u), {}) for u in z.units]
    return torch.tensor(float(max((s["step"] for s in states if "step" in s), default=0.0)))


def save(z: ShardedModel, path: str | Path) -> None:
    """Write ``z``'s model and optimizer state to the folder ``path`` (call on every rank)."""

    def local(u: FlatBuffer, kind: str) -> torch.Tensor:
        if kind == "param":
            return u.shard_param.detach()[_owned(u)]
        state = z.optimizer.state.get(_opt_param(z, u), {})
        return (
            state[kind][_owned(u)].to(u.shard_param.device)
            if kind in state
            else torch.zeros(_owned(u).stop, dtype=u.shard_param.dtype, device=u.shard_param.device)
        )

    sd = _sharded(z, local) | _frozen(z.model) | {"step": _step(z), "layout": layout(z)}
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


def load(z: ShardedModel, path: str | Path) -> None:
    """Fill ``z``'s shards and AdamW state from the checkpoint at ``path`` (call on every rank;
    any rank count). The model's full parameters follow at the next gather (stage 3) or now."""
    path = _check_exists(path)
    _check_layout(path, layout(z))
    pieces = {}

    def local(u: FlatBuffer, kind: str) -> torch.Tensor:
        pieces[(u, kind)] = torch.zeros(
            _owned(u).stop, dtype=u.shard_param.dtype, device=u.shard_param.device
        )
        return pieces[(u, kind)]

    sd = (
        _sharded(z, local)
        | {k: torch.empty_like(v) for k, v in _frozen(z.model).items()}
        | {"step": torch.tensor(0.0)}
    )
    _read(sd, path, no_dist=False)
    with torch.no_grad():
        for u in z.units:
            u.shard_param.zero_()[_owned(u)] = pieces[(u, "param")]
            state = {"step": sd["step"].clone()}
            for kind in MOMENTS:
                state[kind] = torch.zeros_like(_opt_param(z, u))
                state[kind][_owned(u)] = pieces[(u, kind)].to(state[kind].device)
            z.optimizer.state[_opt_param(z, u)] = state
            if z.zero.offload:
                u.host.copy_(u.shard_param)
            if z.zero.stage < 3:  # whole parameters live in the full buffer: gather them now
                dist.all_gather_single(u.full, u.full[u.lo : u.hi], group=z.group)
        _restore_frozen(z.model, sd)


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
