"""Experiment 03: ZeRO stages 0-3 against the single-process reference, the theory and torch's
own (``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``).

    summary = run(nproc=4, stage=3)               # notebook 03
    print(summary.verdict())                      # PASS, or FAIL: what, where, and a hint
    run(nproc=4, stage=2, offload=True)           # ZeRO-2 with the optimizer on the host
    run(nproc=4, stage=3, vs_torch=True)          # + torch's fully_shard (FSDP2) on the same model
    run(nproc=4, stage=3, precision="bf16-mixed", vs_torch=True)   # + FSDP2's MixedPrecisionPolicy
    python -m labs.run zero --stage 3 --json
    python -m labs.run zero --stage 2 --precision bf16-mixed --reduce-dtype bf16 --json

The views of a summary (``report``, ``plot_stages``) are in ``labs.experiments.zero_report``;
its checks in ``labs.experiments.zero_checks``; saving and resuming a checkpoint in
``labs.experiments.zero_checkpoint``.

Every rank trains the same model from the same seed on its share of each global batch, with
the exercise module's public entry points and a plain loop (``loss.backward();
optimizer.step(); optimizer.zero_grad()``): stage 0 is plain data parallelism (all-reduce,
written here as the baseline), stages 1 and 2 ``ShardedOptimizer`` (one parameter group per
unit), stage 3 ``fully_shard`` on each unit, then the root, and AdamW on what is left. Checks
(``zero_checks``), on every rank:

* reference: every step's loss, every gradient by name after step 1 (this rank's shard of it)
  and every parameter after the last step against ``labs.train.train_reference`` on the same
  global batches, within the tolerance table (``labs.train.rule``);
* theory: bytes held after a step (storages counted once, freed buffers as 0) against
  ``labs.theory.zero.held_bytes`` (= the memory calculator's figure when N divides every unit);
  the ledger's bytes per call and per op against ``comm_bytes``; ZeRO-3's peak parameter bytes
  in forward against ``peak_param_bytes``; offload's host traffic against ``offload_bytes``;
* torch: stage 1-2 against ``ZeroRedundancyOptimizer`` (under torch's DDP), stage 3 against
  ``fully_shard``: their step time, state bytes and losses.

Mixed precision (``precision`` "bf16-mixed" or "fp16-mixed", ``reduce_dtype``): the model is cast
to bf16 (fp16) on every rank; stage 0 keeps fp32 masters here, stages 1-2 in
``ShardedOptimizer(mixed_precision=...)``, stage 3 in ``fully_shard(mixed_precision=...)``'s fp32
shards. The reference runs under the same policy (``train_reference(mixed=...)``), with the
tolerance table's mixed rows; bytes held equal ``held_bytes(precision=...)`` role by role and the
calculator's bf16-mixed figure in total; the reductions carry the reduce dtype, the all-gathers
bf16; fp16 skips exactly the reference's overflowed steps. ``vs_torch`` at stage 3 in bf16-mixed
runs FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)``.
"""

from __future__ import annotations

import hashlib
import importlib
import statistics
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from labs.data import rank_batches
from labs.experiments.common import RunSummary, fill_losses, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.experiments.zero_checks import comm_itemsizes
from labs.measure.ledger import CommLedger
from labs.measure.memory import optimizer_bytes
from labs.measure.timing import StepTimer
from labs.models.toy import AwkwardModel
from labs.models.transformer import ModelConfig, build_model
from labs.runtime.device import ddp_device_ids, deterministic_algorithms, rank_device
from labs.runtime.errors import RankDied, RankError
from labs.runtime.flat import FlatBuffer, course_units
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.theory import zero as theory
from labs.theory.dims import check_positive, divisors
from labs.train import (
    FP16_LOSS_SCALE,
    LossScaler,
    MixedPrecision,
    PrecisionOptions,
    TrainConfig,
    compare_losses,
    make_optimizer,
    max_rel_diff,
    mixed_precision,
    overflowed,
    rule,
    train_reference,
)

MODELS = ("course", "awkward")
HARNESS = "harness"  # the ledger's phase for the checks' own collectives
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# PyTorch's counterpart of each stage, for ``vs_torch``
TORCH = {0: "ddp", 1: "zero_redundancy", 2: "zero_redundancy", 3: "fsdp2"}
TORCH_NAMES = {
    "ddp": "DistributedDataParallel",
    "zero_redundancy": "ZeroRedundancyOptimizer (under DDP)",
    "fsdp2": "FSDP2 fully_shard",
}


@dataclass(frozen=True)
class Options(PrecisionOptions):
    """The ZeRO lab's options (``run``'s keywords, ``python -m labs.run zero``'s flags)."""

    stage: int = option(
        3,
        "0: data parallel, 1: + optimizer sharded, 2: + gradients, 3: + parameters",
        choices=theory.STAGES,
    )
    offload: bool = option(False, "optimizer state and update on the host")
    prefetch: bool = option(True, "ZeRO-3: no prefetch")
    model: str = option("course", "awkward: 8,009 elements, tied weights", choices=MODELS)
    dtype: str = option(
        "float32",
        "float64 checks parameters beyond AdamW-amplified rounding",
        choices=tuple(DTYPES),
    )

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        check_options(
            self.stage,
            self.offload,
            self.model,
            nproc,
            steps,
            self.dtype,
            self.precision,
            self.reduce_dtype,
            vs_torch,
        )
        self.mixed(self.dtype)


LAB = Lab(
    name="zero",
    notebook="03_zero_and_fsdp",
    exercises=("zero",),
    reference=("build", "used_parameters"),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 2},
    bench=(
        Bench(
            options={"stage": 1},
            torch="ZeroRedundancyOptimizer under DDP",
            note="The same job, two algorithms: ours reduce-scatters the gradients and all-gathers"
            " the updated shards (2Ψ per step); torch's DDP all-reduces them (2Ψ), then"
            " ZeroRedundancyOptimizer broadcasts each rank's updated parameters (Ψ more).",
        ),
        Bench(options={"stage": 3}, torch="FSDP2 fully_shard"),
    ),
    profiled=True,
)


@dataclass(frozen=True)
class RunSpec:
    """One training run on every rank. ``start``: steps already taken (data resumes there)."""

    stage: int = 3
    offload: bool = False
    prefetch: bool = True
    model: str = "course"
    steps: int = 5
    start: int = 0
    load: str | None = None  # checkpoint folder to resume from
    save: str | None = None  # checkpoint folder to write after the last step
    torch_impl: str | None = None  # train with torch's own instead: a key of TORCH_NAMES
    dtype: str = "float32"  # float64: parameter checks beyond AdamW's amplified rounding (see run)
    deterministic: bool = False  # a GPU rank runs deterministic kernels (bit-for-bit reruns)
    precision: str = "fp32"  # or "bf16-mixed", "fp16-mixed"
    reduce_dtype: str | None = None  # mixed precision: "fp32" (None) or the parameters' dtype
    loss_scale: float = FP16_LOSS_SCALE  # fp16-mixed: the first loss scale

    @property
    def mixed(self) -> MixedPrecision | None:
        """The mixed-precision policy, or None (fp32)."""
        return mixed_precision(self.precision, self.reduce_dtype)


def check_model(model: str, dtype: str = "float32") -> None:
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {MODELS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(DTYPES)}")


def build(model: str, seed: int = 0, dtype: str = "float32") -> torch.nn.Module:
    """The course model (``ModelConfig()``) or the awkward toy model, from ``seed``."""
    check_model(model, dtype)
    net = build_model(ModelConfig(), seed=seed) if model == "course" else AwkwardModel(seed=seed)
    return net.to(DTYPES[dtype])


def units_of(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """The ZeRO units: embedding, each block, final norm + head (the course model), or the
    whole model as one unit (any other model, e.g. the awkward one with its tied weights)."""
    return course_units(model) if hasattr(model, "layers") else [("model", [model])]


def unit_params(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """Each unit's trainable parameters, in order (a parameter shared by two units: the first)."""
    seen = set()
    out = []
    for name, modules in units_of(model):
        params = [p for m in modules for p in m.parameters() if p.requires_grad and p not in seen]
        seen.update(params)
        out.append((name, params))
    return out


def unit_numels(model) -> list[int]:
    """Trainable parameters of each unit (a parameter shared by two units counts in the first)."""
    return [sum(p.numel() for p in params) for _, params in unit_params(model)]


class DataParallel:
    """Stage 0, the baseline: whole state on every rank, gradients all-reduced per unit, then
    AdamW (``step`` and ``zero_grad``, as an optimizer). Mixed precision: the all-reduce runs in
    the reduce dtype, AdamW steps fp32 masters (``masters``), and the bf16 weights are rounded
    from them; with a ``loss_scaler`` a step that overflowed is skipped."""

    def __init__(
        self,
        model,
        *,
        cfg,
        group=None,
        mixed: MixedPrecision | None = None,
        loss_scaler: LossScaler | None = None,
    ):
        self.model = model
        self.group = group
        self.buckets = [params for _, params in unit_params(model)]
        self.mixed = mixed
        self.loss_scaler = loss_scaler
        trainable = [p for p in model.parameters() if p.requires_grad]
        # parameter -> its fp32 master (mixed precision)
        self.masters = {p: p.detach().float() for p in trainable} if mixed else {}
        self.optimizer = make_optimizer(list(self.masters.values()) or trainable, cfg)

    def step(self):
        n = dist.get_world_size(self.group)
        for params in self.buckets:
            # zeros for unused parameters keep every rank's call the same size
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.mixed is not None:
                flat = flat.to(self.mixed.reduce_dtype)
            dist.all_reduce(flat, group=self.group)
            flat /= n
            offset = 0
            for p in params:
                if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.mixed is None:
            self.optimizer.step()
            return
        scale = self.loss_scaler.value if self.loss_scaler else 1.0
        for p, master in self.masters.items():
            master.grad = None if p.grad is None else p.grad.float() / scale
        grads = [m.grad for m in self.masters.values() if m.grad is not None]
        overflow = self.loss_scaler is not None and overflowed(grads)
        if not overflow:
            self.optimizer.step()
            with torch.no_grad():
                for p, master in self.masters.items():
                    p.copy_(master)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        for master in self.masters.values():
            master.grad = None

    def zero_grad(self):
        self.model.zero_grad(set_to_none=False)  # keep the buffers, as DDP keeps its buckets


def shard(
    model: torch.nn.Module,
    spec: RunSpec,
    cfg: TrainConfig,
    *,
    group=None,
    loss_scaler: LossScaler | None = None,
):
    """(module to call, optimizer) for ZeRO ``spec.stage`` through the exercise's public entry
    points: stage 0 ``DataParallel`` (the baseline), 1-2 ``ShardedOptimizer`` with one parameter
    group per unit, 3 ``fully_shard`` on each unit, then the root, and AdamW. Mixed precision
    (``spec.mixed``): the policy goes to each entry point, and ``loss_scaler`` (fp16) to the
    optimizers that own it (stages 0-2; stage 3's loop calls ``loss_scaler.step``)."""
    mixed = spec.mixed
    if spec.stage == 0:
        return model, DataParallel(
            model, cfg=cfg, group=group, mixed=mixed, loss_scaler=loss_scaler
        )
    zero = exercise("zero")
    if spec.stage in (1, 2):
        groups = [{"params": params, "name": name} for name, params in unit_params(model)]
        extra = {"mixed_precision": mixed, "loss_scaler": loss_scaler} if mixed else {}
        optimizer = zero.ShardedOptimizer(
            groups,
            torch.optim.AdamW,
            group=group,
            shard_grads=spec.stage == 2,
            offload=spec.offload,
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            foreach=False,
            **extra,
        )
        return model, optimizer
    units = units_of(model)
    options = {"group": group, "prefetch": spec.prefetch, "offload": spec.offload}
    if mixed:
        options["mixed_precision"] = mixed
    for name, modules in units:
        if modules != [model]:
            zero.fully_shard(modules, name=name, **options)
    zero.fully_shard(model, name="model", **options)
    return model, make_optimizer(model.parameters(), cfg)


def wrap_for_zero(model, spec: RunSpec, cfg: TrainConfig, *, mp_policy=None, loss_scaler=None):
    """(module to call, optimizer) for ``spec``: ours (``shard``) or, with ``spec.torch_impl``,
    torch's: DDP and AdamW, ``ZeroRedundancyOptimizer`` under DDP, or FSDP2's ``fully_shard`` on
    the same units (with ``mp_policy``, a ``MixedPrecisionPolicy``, if given; the lab's fp32 runs
    give none, its bf16-mixed ones ``torch_policy``'s)."""
    if spec.torch_impl in ("ddp", "zero_redundancy"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=ddp_device_ids(rank_device()),
            # the awkward model's ``unused`` parameter never gets a gradient (see labs.models.toy)
            find_unused_parameters=spec.model == "awkward",
        )
        if spec.torch_impl == "ddp":
            return ddp, make_optimizer(ddp.parameters(), cfg)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.AdamW,
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
        return ddp, optimizer
    if spec.torch_impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = mp_policy or MixedPrecisionPolicy()
        for _, modules in units_of(model)[:-1]:
            fully_shard(modules, mp_policy=policy)
        fully_shard(model, mp_policy=policy)  # the root unit: whatever is left (norm + head)
        return model, make_optimizer(model.parameters(), cfg)
    if spec.torch_impl is not None:
        raise ValueError(f"torch_impl={spec.torch_impl!r} is not one of {tuple(TORCH_NAMES)}")
    return shard(model, spec, cfg, loss_scaler=loss_scaler)


def torch_policy(mixed: MixedPrecision):
    """FSDP2's ``MixedPrecisionPolicy`` for our policy: the same param and reduce dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype)


def _zero_parts(model, optimizer):
    """(the model's fully_shard units with a flat buffer, the ShardedOptimizer or None)."""
    zero = exercise("zero")
    units = [u for u in zero.sharded_units(model) if u.flat is not None]
    sharded = optimizer if isinstance(optimizer, zero.ShardedOptimizer) else None
    return units, sharded


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds, by role, counting each storage once (a freed one is 0 bytes):
    ``params``, ``grads``, ``optimizer`` (device) and ``host`` (offloaded), ``total`` (device).
    ``optimizer``: whatever steps the model (ours, ``DataParallel``, or a torch optimizer)."""
    units, sharded = _zero_parts(model, optimizer)
    roles = {"params": [], "grads": [], "host": [], "masters": []}
    mine = set()
    offload = False
    for u in units:
        mine.update(u.flat.params)
        roles["params"] += [u.shard, u.flat.full]
        if u.offload:
            offload = True
            roles["grads"].append(u.grad_shard)
            roles["host"] += [u.host] + [p.grad for p in u.flat.params]
        else:
            roles["grads"] += [p.grad for p in u.flat.params]
    for p in model.parameters():
        if p not in mine:
            roles["params"].append(p)
            roles["grads"].append(p.grad)
    if sharded is not None:
        offload = sharded.offload
        for u in sharded.units:
            roles["params"] += [u.full, u.shard_param]
            roles["grads"] += [u.full_grad, u.shard_grad]
            roles["masters"] += [u.master, u.master.grad] if u.master is not None else []
            if sharded.offload:
                roles["host"] += [u.host, u.host.grad]
    if isinstance(optimizer, DataParallel):
        roles["masters"] += [t for m in optimizer.masters.values() for t in (m, m.grad)]
    out = {}
    seen = set()
    for role, tensors in roles.items():
        out[role] = 0
        for t in tensors:
            storage = t.untyped_storage() if t is not None else None
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out[role] += storage.nbytes()
    # the fp32 masters (mixed precision) count as optimizer state, as the calculator counts them
    opt = optimizer_bytes(getattr(optimizer, "optimizer", optimizer)) + out.pop("masters")
    out["optimizer"] = 0 if offload else opt
    out["host"] += opt if offload else 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole: ZeRO-3's gathered (``summon_full_params``, a collective),
    FSDP2's DTensors as full tensors."""
    with exercise("zero").summon_full_params(model):
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }


def trained_params(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole, as the optimizer steps it: the fp32 masters under mixed
    precision (stage 0's, or ZeRO-1/2's shards all-gathered: a collective), else ``full_params``
    (ZeRO-3's shards are the masters already)."""
    names = {p: n for n, p in model.named_parameters()}
    if isinstance(optimizer, DataParallel) and optimizer.masters:
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.update({names[p]: m.detach().clone() for p, m in optimizer.masters.items()})
        return out
    _, sharded = _zero_parts(model, optimizer)
    if sharded is None or sharded.mixed_precision is None:
        return full_params(model)
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for u in sharded.units:
        full = torch.empty(u.padded, dtype=u.master.dtype, device=u.master.device)  # [N*S]
        dist.all_gather_single(full, u.master.detach(), group=sharded.group)
        for p, view in zip(u.params, u.views(full)):
            out[names[p]] = view.clone()
    return out


def grad_shards(model, optimizer) -> list[tuple[FlatBuffer, torch.Tensor]]:
    """(flat unit, this rank's averaged gradient shard [S]) of every ZeRO-1/2/3 unit, after a
    step's backward (ZeRO-3) or step (ZeRO-1/2)."""
    units, sharded = _zero_parts(model, optimizer)
    if sharded is not None:
        return [
            (u, u.full_grad[u.lo : u.hi] if u.full_grad is not None else u.shard_grad)
            for u in sharded.units
        ]
    return [(u.flat, u.grad_shard) for u in units]


def named_grads(model, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """This rank's averaged gradient of every parameter, by name (a copy): whole, or for one
    in a ZeRO unit this rank's piece of it, with the elements [a, b) of the whole flattened
    gradient the piece is (``ranges``)."""
    names = {p: n for n, p in model.named_parameters()}
    grads = {}
    ranges = {}
    for u, shard_ in grad_shards(model, optimizer):
        for p, (a, b, o) in zip(u.params, u.piece_bounds()):
            if shard_ is not None:
                grads[names[p]] = shard_[o : o + b - a].detach().clone()
                ranges[names[p]] = (a, b)
    for p, n in names.items():
        if n not in grads and p.grad is not None:
            grads[n] = p.grad.detach().clone()
    return grads, ranges


def train_worker(spec: RunSpec, cfg: TrainConfig) -> dict:
    rank = dist.get_rank()
    n = dist.get_world_size()
    device = rank_device()
    if spec.deterministic:
        deterministic_algorithms()  # before the first matmul
    model = build(spec.model, seed=cfg.seed, dtype=spec.dtype).to(device)
    mixed = spec.mixed
    scaler = LossScaler(spec.loss_scale) if mixed and mixed.loss_scaling else None
    policy = None
    if mixed and spec.torch_impl == "fsdp2":  # FSDP2 keeps fp32 shards: start from bf16 values
        model.to(mixed.param_dtype).float()
        policy = torch_policy(mixed)
    elif mixed:
        model.to(mixed.param_dtype)  # every rank computes in bf16 (fp16) from the same weights
    module, optimizer = wrap_for_zero(model, spec, cfg, mp_policy=policy, loss_scaler=scaler)
    loaded = None
    if spec.load:
        from labs.checkpoint import load

        load(model, optimizer, spec.load)
        loaded = full_params(model)  # what the checkpoint gave, before any training
    data = rank_batches(
        steps=spec.start + spec.steps,
        batch_size=cfg.per_rank_batch(n),
        seq_len=cfg.seq_len,
        rank=rank,
        world_size=n,
        seed=cfg.data_seed,
    )[spec.start :]
    losses = []
    held = None
    grads = ranges = first = None
    grads_step = 1
    calls = []
    timer = StepTimer(device)
    with CommLedger() as ledger:
        for step, (x, y) in enumerate(data):
            x = x.to(device)
            y = y.to(device)
            first_call = len(ledger.records)
            with timer.step():
                with ledger.phase("forward"):
                    _, loss = module(x, y)
                with ledger.phase("backward"):
                    (scaler.scale(loss) if scaler else loss).backward()
                with ledger.phase("step"):
                    if scaler is not None and spec.stage == 3:  # a plain optimizer: the loop's
                        scaler.step(optimizer, group=None)
                    else:
                        optimizer.step()
            losses.append(loss.item())
            loss_dtype = str(loss.dtype).removeprefix("torch.")  # the course model's: fp32 always
            skipped = scaler is not None and scaler.history[-1][1]
            if grads is None and not skipped and spec.torch_impl is None:
                # the first step taken's averaged gradients; mixed precision: in fp32, unscaled
                grads, ranges = named_grads(model, optimizer)
                grads_step = step + 1
                if mixed and spec.stage < 3:  # ZeRO-3's are the fp32 masters', unscaled already
                    used = scaler.history[-1][0] if scaler else 1.0
                    grads = {n: g.float() / used for n, g in grads.items()}
            if step == 0 and spec.torch_impl is None:
                with ledger.phase(HARNESS):  # the check's all-gathers: not the lab's traffic
                    first = trained_params(model, optimizer)
            if step == len(data) - 1:
                # what the calculator counts: state after the step, gradients held
                if spec.torch_impl is None:
                    held = held_bytes(model, optimizer)
                else:
                    held = _torch_bytes(module, optimizer)
                calls = [
                    (r.op, r.payload_bytes)
                    for r in ledger.records[first_call:]
                    if r.phase != HARNESS
                ]
            optimizer.zero_grad()
            report_progress()
    if spec.save:
        from labs.checkpoint import save

        save(model, optimizer, spec.save)
    params = trained_params(model, optimizer) if spec.torch_impl is None else full_params(model)
    zero3 = exercise("zero").sharded_units(model) if spec.torch_impl is None else []
    owner = zero3[0].owner if zero3 else None
    host = owner.host_bytes if owner else getattr(optimizer, "host_bytes", 0)
    return {
        "losses": losses,
        "loss_dtype": loss_dtype,
        "step_time_s": timer.step_time(),
        "held": held,
        "params": params,
        "grads": grads,
        "grad_ranges": ranges,
        "grads_step": grads_step,
        "loss_scales": scaler.scales if scaler else [],
        "skipped_steps": scaler.skipped_steps if scaler else [],
        "params_step1": first,
        "calls_last_step": calls,
        "loaded_params": loaded if rank == 0 else None,
        "sent_per_step": (ledger.sent_bytes() - ledger.sent_bytes(phase=HARNESS)) / len(data),
        "sent_by_op": {
            op: (v["sent_bytes"] - ledger.sent_bytes(op, HARNESS)) / len(data)
            for op, v in ledger.summary().items()
            if ledger.calls(op) > ledger.calls(op, HARNESS)
        },
        "peak_param_bytes": dict(owner.peak) if owner else {},
        "host_bytes_per_step": host / len(data),
    }


def _torch_bytes(model, optimizer) -> dict[str, int]:
    from labs.measure.memory import state_bytes

    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    b = state_bytes(model, optimizer)
    return {
        "params": b["params"],
        "grads": b["grads"],
        "optimizer": b["optimizer"],
        "host": 0,
        "total": b["total"],
    }


def warm_imports(*, fsdp: bool = False) -> None:
    """Import here, once, what every forked rank would otherwise import by itself (seconds each
    on 2 cores): FSDP2 and ZeroRedundancyOptimizer are large. (``launch`` itself preloads
    ``torch._dynamo``.)"""
    if fsdp:
        importlib.import_module("torch.distributed.fsdp")
        importlib.import_module("torch.distributed.optim")


def check_options(
    stage,
    offload,
    model,
    nproc,
    steps,
    dtype="float32",
    precision="fp32",
    reduce_dtype=None,
    vs_torch=False,
):
    mixed = mixed_precision(precision, reduce_dtype, dtype)
    if mixed is not None and offload:
        raise ValueError(
            f"offload=True with precision={precision!r} is not part of this lab (the host would"
            " hold the fp32 masters): use offload with precision='fp32'"
        )
    if mixed is not None and vs_torch and (stage < 3 or mixed.loss_scaling):
        raise ValueError(
            f"vs_torch with precision={precision!r} compares stage 3 with FSDP2's bf16"
            " MixedPrecisionPolicy (torch's DDP and ZeroRedundancyOptimizer keep no fp32 masters,"
            " fp16 would need its ShardedGradScaler): use stage=3 and precision='bf16-mixed'"
        )
    if stage not in theory.STAGES:
        raise ValueError(f"stage={stage!r} is not one of {theory.STAGES}")
    check_positive(nproc=nproc)
    if stage > 0 and nproc < 2:
        raise ValueError(
            f"stage={stage} shards over ranks but nproc={nproc}; use nproc >= 2 or stage=0"
        )
    batch = TrainConfig().batch_size  # the lab's global batch: each rank trains on batch/nproc
    if batch % nproc:
        valid = [d for d in divisors(batch) if d >= (2 if stage > 0 else 1)]
        raise ValueError(
            f"nproc={nproc} does not divide the lab's global batch of {batch} sequences (each"
            f" rank trains on batch/nproc of them); use nproc in {{{','.join(map(str, valid))}}}"
        )
    if offload and stage == 0:
        raise ValueError(
            "offload=True needs stage 1, 2 or 3 (stage 0 keeps the optimizer on every rank)"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_model(model, dtype)


def crashed(s: RunSummary, error: RankError | RankDied) -> RunSummary:
    """``s`` with the verdict of a run a rank did not finish: a FAIL naming the rank and why."""
    from labs.experiments.checks import Check

    if isinstance(error, RankError):
        measured = f"{error.exc_type}: {error.message.splitlines()[0] if error.message else ''}"
        hint = error.message
    else:
        measured = f"died ({error.signal_name or error.exit_code})"
        hint = (
            "the rank died without a Python error: a segfault is memory read after it was freed"
            " (a unit's full buffer released while a parameter or a saved tensor still views it)"
        )
    s["error"] = str(error)
    s.add_checks(
        [Check("run completes", False, measured, "no error", None, f"rank {error.rank}", hint)]
    )
    return s


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    **options,
) -> RunSummary:
    """Train ``steps`` AdamW steps with ZeRO ``stage`` on ``nproc`` ranks (default ``LAB.ranks``;
    ``options``: ``Options``); check it three ways and give a verdict (``summary.checks``,
    ``summary.verdict()``; see ``zero_checks``).

    The verdict's losses are within 1e-5 relative of the single-process reference's, and so
    would be the final parameters in float64. In float32 the parameters hold that on 2 ranks but
    not always on 4, whatever the stage (plain data parallelism and torch's
    FSDP2 miss it alike): AdamW divides each gradient element by its own RMS, so an element
    whose gradient is tiny because large terms cancel moves by ~lr whatever its sign, and the
    last-bit differences of a sum split over ranks become ~1e-4 relative parameter changes
    (the tolerance table's "param" rule allows 1e-3). ``dtype="float64"`` shrinks them below
    1e-12 (the tests check parameters that way).

    ``precision`` "bf16-mixed" or "fp16-mixed" (``reduce_dtype`` "fp32" by default, or the
    weights' "bf16"/"fp16"; ``loss_scale``: fp16's first): see the module docstring;
    ``max_rel_loss_diff_vs_fp32``: how far the losses are from the fp32 reference's.

    A rank that raises (other than an unwritten exercise's NotImplementedError) or dies gives a
    FAIL verdict naming the rank and the error, not an exception.
    """
    from labs.experiments import zero_checks

    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    cfg = TrainConfig(steps=steps)
    spec = RunSpec(
        stage=o.stage,
        offload=o.offload,
        prefetch=o.prefetch,
        model=o.model,
        steps=steps,
        dtype=o.dtype,
        precision=o.precision,
        reduce_dtype=o.reduce_dtype,
        loss_scale=o.loss_scale,
    )
    mixed = spec.mixed
    warm_imports(fsdp=vs_torch)
    s = new_summary(
        "zero",
        nproc=nproc,
        backend=backend,
        steps=steps,
        stage=o.stage,
        offload=o.offload,
        prefetch=o.prefetch,
        model=o.model,
        dtype=o.dtype,
        precision=o.precision,
        reduce_dtype=o.reduce_dtype or "fp32",
    )
    try:
        per_rank = launch(
            train_worker,
            nproc,
            spec,
            cfg,
            backend=backend,
            timeout=timeout,
            progress=steps,
            desc=f"ZeRO-{o.stage}" if o.stage else "data parallel",
        )
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            raise
        return crashed(s, e)
    except RankDied as e:
        return crashed(s, e)
    s["backend"] = per_rank.backend
    net = build(o.model, seed=cfg.seed, dtype=o.dtype)
    ref = train_reference(
        ModelConfig(),
        cfg,
        dp=nproc,
        model=net,
        return_grads=True,
        mixed=mixed,
        loss_scale=o.loss_scale,
    )
    s["loss_dtype"] = per_rank[0]["loss_dtype"]
    fill_losses(s, mean_losses(per_rank), ref.losses)
    if mixed is not None:
        fp32_ref = train_reference(ModelConfig(), cfg, dp=nproc, model=build(o.model, cfg.seed))
        s["fp32_reference_losses"] = fp32_ref.losses
        s["max_rel_loss_diff_vs_fp32"] = compare_losses(s["losses"], fp32_ref.losses)[
            "max_rel_loss_diff"
        ]
    if mixed is not None and mixed.loss_scaling:
        s["loss_scales"] = per_rank[0]["loss_scales"]
        s["skipped_steps"] = per_rank[0]["skipped_steps"]
        s["reference_skipped_steps"] = ref.skipped_steps
    s.update(param_diff(per_rank[0]["params"], ref.params))
    s["params_sha1"] = digest(per_rank[0]["params"])
    used = ref.grads or used_parameters(o.model, cfg, nproc)  # fp16 may have taken no step
    gradless = sum(
        p.numel() for n, p in net.named_parameters() if p.requires_grad and n not in used
    )
    frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    _fill_theory(
        s,
        per_rank,
        unit_numels(net),
        nproc=nproc,
        stage=o.stage,
        offload=o.offload,
        prefetch=o.prefetch,
        frozen_numel=frozen,
        gradless=gradless,
        itemsize=DTYPES[o.dtype].itemsize,
        mixed=mixed,
        stepped=len(per_rank[0]["skipped_steps"]) < steps,
    )
    if o.stage == 3:  # the user's optimizer keeps state per piece: no state for padding or unused
        expected = [
            zero3_held(net, s["theory_breakdown"], ref.grads, nproc, r, o.offload, o.dtype)
            for r in range(nproc)
        ]
        s["theory_breakdown_per_rank"] = expected
        s["theory_state_bytes_per_rank"] = [e["total"] for e in expected]
        if len(set(s["theory_state_bytes_per_rank"])) == 1:
            s["theory_state_bytes_per_rank"] = s["theory_state_bytes_per_rank"][0]
    s["step_time_s"] = max(r["step_time_s"] for r in per_rank)
    # the reference after one step: the all-gather's slices are told apart before errors spread
    one = train_reference(
        ModelConfig(),
        replace(cfg, steps=1),
        dp=nproc,
        model=build(o.model, seed=cfg.seed, dtype=o.dtype),
        mixed=mixed,
        loss_scale=o.loss_scale,
    )
    s.add_checks(zero_checks.checks(s, per_rank, ref, net, units=unit_params(net), first=one))
    if vs_torch:
        _vs_torch(s, spec, cfg, ref, nproc=nproc, backend=backend, timeout=timeout)
    return s


def _vs_torch(s, spec, cfg, ref, *, nproc, backend, timeout) -> None:
    impl = TORCH[spec.stage]
    t = launch(
        train_worker,
        nproc,
        replace(spec, torch_impl=impl),
        cfg,
        backend=backend,
        timeout=timeout,
        progress=spec.steps,
        desc=f"torch {TORCH_NAMES[impl]}",
    )
    s["torch_impl"] = TORCH_NAMES[impl]
    s["torch_step_time_s"] = max(r["step_time_s"] for r in t)
    s["torch_state_bytes_per_rank"] = [r["held"]["total"] for r in t]
    s["torch_state_breakdown"] = t[0]["held"]
    s["torch_losses"] = mean_losses(t)
    torch_loss_diff = compare_losses(s["torch_losses"], ref.losses)
    s["torch_max_rel_loss_diff"] = torch_loss_diff["max_rel_loss_diff"]
    s["torch_max_rel_param_diff"] = param_diff(t[0]["params"], ref.params)["max_rel_param_diff"]


def used_parameters(model: str, cfg: TrainConfig, nproc: int) -> set[str]:
    """The names of the parameters a backward gives a gradient (one step of the reference)."""
    return set(
        train_reference(
            ModelConfig(),
            replace(cfg, steps=1),
            dp=nproc,
            model=build(model, cfg.seed),
            return_grads=True,
        ).grads
    )


def zero3_held(net, theory_held: dict, ref_grads: dict, dp: int, rank: int, offload: bool, dtype):
    """What rank ``rank`` holds under ``fully_shard`` with AdamW on the pieces: the theory's
    figures, except that the optimizer keeps two moments per element of this rank's pieces of
    the parameters that got a gradient (the flat shard's padding, and unused parameters, have
    none; with offload the host holds them beside its parameter and gradient shards)."""
    itemsize = DTYPES[dtype].itemsize
    names = {p: n for n, p in net.named_parameters()}
    moments = 0
    shards = 0
    for name, params in unit_params(net):
        flat = FlatBuffer(name, params, rank, dp)
        shards += flat.shard
        for p, (a, b, _) in zip(params, flat.piece_bounds()):
            if names[p] in ref_grads:
                moments += 2 * (b - a)
    out = dict(theory_held)
    if offload:
        out["host"] = (2 * shards + moments) * itemsize
    else:
        out["optimizer"] = moments * itemsize
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _look(fn) -> str:
    """What ``fn()`` gives a curious learner: a shape, None, or the error's first line."""
    try:
        out = fn()
    except Exception as e:  # what the learner would see: the error is the answer here
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "None" if out is None else str(list(out.shape))


def _sees_worker(stage: int, cfg: TrainConfig) -> dict[str, str]:
    """One step of the course model under ``stage``, then what reading one weight gives."""
    zero = exercise("zero")
    rank = dist.get_rank()
    n = dist.get_world_size()
    model = build("course").to(rank_device())
    module, optimizer = shard(model, RunSpec(stage=stage), cfg)
    linear = model.layers[0].attn.q_proj
    x, y = rank_batches(steps=1, batch_size=2, seq_len=8, rank=rank, world_size=n, seed=0)[0]
    x = x.to(rank_device())
    y = y.to(rank_device())
    seen = {"whole shape": str(list(build("course").layers[0].attn.q_proj.weight.shape))}
    _, loss = module(x, y)
    loss.backward()
    seen["its .grad after backward"] = _look(lambda: linear.weight.grad)
    optimizer.step()
    optimizer.zero_grad()
    seen["the weight between steps"] = _look(lambda: linear.weight.detach().clone())
    seen["its sum between steps"] = _look(lambda: linear.weight.sum().reshape(1))
    with zero.summon_full_params(model):
        seen["inside summon_full_params"] = _look(lambda: linear.weight.detach().clone())
    seen["its module called alone"] = _look(lambda: linear(torch.zeros(1, 64, device=x.device)))
    return seen


def what_a_rank_sees(nproc: int = 2, *, backend: str = "auto", timeout: float = 120.0) -> dict:
    """For stages 1-3: what rank 0 reads of one weight (``layers.0.attn.q_proj.weight``) of the
    course model around a training step: its ``.grad`` after backward, the weight and its sum
    between steps (a released unit under ZeRO-3: this rank's piece, never freed memory), inside
    ``summon_full_params``, and its module called on its own. {stage: {what: shape or error}}."""
    cfg = TrainConfig(steps=1)
    return {
        stage: launch(_sees_worker, nproc, stage, cfg, backend=backend, timeout=timeout)[0]
        for stage in (1, 2, 3)
    }


def same_model(s: RunSummary, s0: RunSummary) -> bool:
    """Whether two ZeRO runs (e.g. stage 3 and stage 0, plain data parallelism) trained the same
    model, by the tolerance table's "zero_stages" rule for their backend: bit for bit (equal
    ``params_sha1``) on gloo; on NCCL, both within the parameter tolerance of the reference."""
    for run_ in (s, s0):
        if run_["backend"] != s0["backend"]:
            raise ValueError(f"runs on {run_['backend']} and {s0['backend']}: compare alike")
    tolerance = rule("zero_stages", None, s0["backend"]).rel
    if tolerance == 0.0:
        return s["params_sha1"] == s0["params_sha1"]
    return max(s["max_rel_param_diff"], s0["max_rel_param_diff"]) <= tolerance


def digest(params: dict) -> str:
    """SHA-1 of the parameters' bytes, by name: equal digests mean bit-identical models."""
    h = hashlib.sha1()
    for name in sorted(params):
        h.update(
            name.encode() + params[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
    return h.hexdigest()


def param_diff(params: dict, reference: dict) -> dict:
    """``max_rel_param_diff`` over every parameter (by name) and the ``worst_param`` (whether it
    is within the table's rule is the "parameters after the last step" check's to say)."""
    missing = sorted(set(reference) - set(params))
    if missing:
        raise AssertionError(f"parameters missing from the parallel run: {missing}")
    diffs = {n: max_rel_diff(params[n].double(), ref.double()) for n, ref in reference.items()}
    worst = max(diffs, key=diffs.get)
    return {"max_rel_param_diff": diffs[worst], "worst_param": worst}


def mean_losses(per_rank: list[dict]) -> list[float]:
    """The global loss of each step: the mean of the ranks' losses (equal batch sizes)."""
    return [statistics.fmean(step) for step in zip(*(r["losses"] for r in per_rank))]


def _fill_theory(
    s: RunSummary,
    per_rank: list[dict],
    units: list[int],
    *,
    nproc: int,
    stage: int,
    offload: bool,
    prefetch: bool,
    frozen_numel: int,
    gradless: int,
    itemsize: int,
    mixed: MixedPrecision | None = None,
    stepped: bool = True,
) -> None:
    """Bytes sent and held, measured on every rank, beside ``labs.theory.zero``'s figures
    (``stepped=False``: fp16 skipped every step, AdamW has no moments yet)."""
    held = theory.held_bytes(
        units,
        stage=stage,
        dp=nproc,
        offload=offload,
        frozen_numel=frozen_numel,
        gradless_numel=gradless,
        itemsize=itemsize,
        precision="fp32" if mixed is None else "bf16-mixed",  # fp16-mixed: the same bytes
        stepped=stepped,
    )
    sizes = comm_itemsizes(itemsize, mixed)
    comm = theory.comm_bytes(units, stage=stage, dp=nproc, **sizes)
    s.update(
        unit_numels=units,
        n_params=sum(units),
        comm_bytes_per_rank=[r["sent_per_step"] for r in per_rank],
        theory_comm_bytes_per_rank=comm["total"],
        comm_by_op=per_rank[0]["sent_by_op"],
        theory_comm_by_op=comm,
        psi_equivalent=per_rank[0]["sent_per_step"]
        / ((nproc - 1) / nproc * sizes["itemsize"] * sum(units)),
        state_bytes_per_rank=[r["held"]["total"] for r in per_rank],
        theory_state_bytes_per_rank=held["total"],
        state_breakdown=per_rank[0]["held"],
        theory_breakdown=held,
        calculator_bytes=held["calculator"],
    )
    if stage == 3:
        s["peak_param_bytes_per_rank"] = [r["peak_param_bytes"]["forward"] for r in per_rank]
        s["peak_param_bytes_backward"] = [r["peak_param_bytes"]["backward"] for r in per_rank]
        s["theory_peak_param_bytes"] = theory.peak_param_bytes(
            units, dp=nproc, prefetch=prefetch, itemsize=sizes["itemsize"], shard_itemsize=itemsize
        )
    if offload:
        host = theory.offload_bytes(units, dp=nproc, itemsize=itemsize)
        s["host_bytes_per_step"] = per_rank[0]["host_bytes_per_step"]
        s["theory_host_bytes_per_step"] = host["total"]
