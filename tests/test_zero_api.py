"""Exercise 03's public entry points from a user's side: ``ShardedOptimizer`` is a torch
optimizer, ``fully_shard`` runs a plain loop with any optimizer, gradients are reachable by name,
and no parameter read ever touches freed memory.

* ``ShardedOptimizer`` against the same optimizer unsharded (SGD with momentum, Adam, AdamW,
  parameter groups with their own learning rates, a scheduler, a closure), its state per rank
  against the calculator, its sharded and whole state dicts;
* ``fully_shard``: per-parameter gradient pieces by name, ``summon_full_params``, replicated
  norms, ``clip_grad_norm_``;
* every parameter touched at every moment of a step, in every stage, also after an exception
  mid-forward and mid-backward (a segfault would kill the rank: the launcher reports it);
* a foreign training loop (a user's model and optimizer class, clipping by name, state dicts
  saved and loaded in the middle) under our DDP, the sharded optimizer and ZeRO-3 on 2 and 4
  ranks, against the same loop in one process, within the tolerance table.

Comparisons run in float64 where the point is exactness (the table's float64 rows, 1e-12), and
in float32 for the foreign loop (the table's float32 rows).
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs import launch
from labs.models.toy import AwkwardModel
from labs.runtime.impl import exercise
from labs.train import LossScaler, MixedPrecision, rule

F64 = rule("value", torch.float64).rel


def _batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, 8), generator=g),
            torch.randint(0, 256, (batch, 8), generator=g),
        )
        for _ in range(steps)
    ]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) / (float(b.abs().max()) or 1.0)


# --- ShardedOptimizer ---------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=3e-3, betas=(0.9, 0.95))),
    "adamw": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1)),
}


def _groups(model: nn.Module, lrs: bool):
    """Parameter groups with their own learning rates (the embedding's ten times smaller)."""
    if not lrs:
        return model.parameters()
    rest = [p for n, p in model.named_parameters() if not n.startswith("embed")]
    return [{"params": [model.embed.weight], "lr": 1e-4}, {"params": rest}]


def _closure(model, optimizer, x, y):
    optimizer.zero_grad()
    _, loss = model(x, y)
    loss.backward()
    return loss


def _train(model, optimizer, batches, rank=0, n=1, scheduler=None):
    losses = []
    for x, y in batches:
        closure = partial(_closure, model, optimizer, x.chunk(n)[rank], y.chunk(n)[rank])
        loss = optimizer.step(closure)
        if scheduler is not None:
            scheduler.step()
        t = loss.detach().clone()
        if n > 1:
            dist.all_reduce(t)
        losses.append(float(t) / n)
    return losses


def _sharded_worker(name: str, lrs: bool, steps: int):
    zero = exercise("zero")
    cls, kwargs = OPTIMIZERS[name]
    model = AwkwardModel(seed=0).double()
    optimizer = zero.ShardedOptimizer(_groups(model, lrs), cls, **kwargs)
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = _train(model, optimizer, _batches(steps, 8), rank, n, scheduler)
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )
    optimizer.consolidate_state_dict(to=0)
    whole = optimizer.state_dict() if rank == 0 else None
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, params, state, [u.shard for u in optimizer.units], whole


@pytest.mark.exercise
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("nproc, lrs", [(2, False), (4, True)])
def test_sharded_optimizer_is_the_unsharded_optimizer(name, nproc, lrs):
    """Losses, parameters and (consolidated) state of every step's optimizer match torch's own
    on the whole batch; each rank holds the state of its shard only: the calculator's bytes."""
    steps = 4
    cls, kwargs = OPTIMIZERS[name]
    model = AwkwardModel(seed=0).double()
    reference = cls(_groups(model, lrs), **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    ref_losses = _train(model, reference, _batches(steps, 8), scheduler=scheduler)
    out = launch(_sharded_worker, nproc, name, lrs, steps, timeout=120)
    for rank, (losses, params, state, shards, _) in enumerate(out):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= F64, (rank, losses)
        for key, p in model.named_parameters():
            assert _max_rel(params[key], p) <= F64, (rank, key)
        moments = 1 if name == "sgd-momentum" else 2
        assert state == moments * 8 * sum(shards), (rank, state, shards)
    # the whole state dict is torch's own format and numbers: loadable by the unsharded optimizer
    whole = out[0][4]
    mine = reference.state_dict()
    assert [g["lr"] for g in whole["param_groups"]] == [g["lr"] for g in mine["param_groups"]]
    for i, s in mine["state"].items():
        for key, v in s.items():
            assert _max_rel(whole["state"][i][key], v) <= F64, (i, key)
    cls(_groups(AwkwardModel(seed=0).double(), lrs), **kwargs).load_state_dict(whole)


def _resume_worker(whole: dict, steps: int):
    zero = exercise("zero")
    model = AwkwardModel(seed=0).double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), whole["params"]):
            p.copy_(v)
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
    optimizer.load_state_dict(whole["optimizer"])  # the whole one, from one process
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = _train(model, optimizer, _batches(steps, 8, seed=1), rank, n)
    sharded = optimizer.state_dict()  # this rank's shard, back in: nothing changes
    optimizer.load_state_dict(sharded)
    return losses


@pytest.mark.exercise
def test_a_whole_state_dict_from_one_process_resumes_on_four_ranks():
    model = AwkwardModel(seed=0).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, optimizer, _batches(2, 8))
    whole = {
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),  # it refers to the live state
    }
    ref = _train(model, optimizer, _batches(3, 8, seed=1))
    for losses in launch(_resume_worker, 4, whole, 3, timeout=120):
        assert max(abs(a - b) / b for a, b in zip(losses, ref)) <= F64, (losses, ref)


def test_sharded_optimizer_refuses_what_it_cannot_do():
    zero = exercise("zero")
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="LBFGS updates an element from others"):
        zero.ShardedOptimizer(params, torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer_cls must be a torch.optim.Optimizer class"):
        zero.ShardedOptimizer(params, "adamw")
    with pytest.raises(ValueError, match="average_grads=False .* needs shard_grads=False"):
        zero.ShardedOptimizer(params, torch.optim.SGD, shard_grads=True, average_grads=False)
    with pytest.raises(RuntimeError, match="none is initialised"):
        zero.ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="none is initialised"):
        zero.fully_shard(nn.Linear(2, 2))


# --- fully_shard ----------------------------------------------------------------------------------
class UserNet(nn.Module):
    """A user's model: an input projection, residual MLP blocks with a LayerNorm each, a final
    LayerNorm and a classifier head. ``forward(x) -> logits``."""

    def __init__(self, width: int = 24, blocks: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(12, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width + 1),
                nn.GELU(),
                nn.Linear(2 * width + 1, width),
            )
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # [B, W]
        for block in self.blocks:
            h = h + block(h)  # [B, W]
        return self.head(self.norm(h))  # [B, 5]


def _user_batches(steps: int, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g))
        for _ in range(steps)
    ]


def _norms(model: nn.Module) -> list[nn.Parameter]:
    return [
        p
        for n, p in model.named_parameters()
        if "norm" in n or n.endswith(".0.weight") or n.endswith(".0.bias")
    ]


def _zero3(model: nn.Module, **kwargs) -> nn.Module:
    zero = exercise("zero")
    for i, block in enumerate(model.blocks):
        zero.fully_shard(block, name=f"block {i}", **kwargs)
    zero.fully_shard(model, **kwargs)
    return model


def _grads_worker(replicate: bool):
    zero = exercise("zero")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = UserNet().double()
    names = [k for k, _ in model.named_parameters()]
    _zero3(model, replicate=_norms(model) if replicate else ())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _user_batches(1)[0]
    loss = F.cross_entropy(model(x.double().chunk(n)[rank]), y.chunk(n)[rank])
    loss.backward()
    grads = {}
    for k, p in model.named_parameters():  # every gradient by name: the rank's piece, or whole
        grads[k] = (p.grad.clone(), zero.is_sharded(p), tuple(p.shape))
    total = zero.clip_grad_norm_(model.parameters(), max_norm=1e9)
    optimizer.step()
    with zero.summon_full_params(model):
        whole = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert list(whole) == names
    units = {u.name: u for u in zero.sharded_units(model)}
    pieces = {}
    for u in units.values():
        if u.flat is not None:
            for p, b in zip(u.flat.params, u.flat.piece_bounds()):
                pieces[next(k for k, q in model.named_parameters() if q is p)] = (b.a, b.b)
    return grads, pieces, float(total), whole


@pytest.mark.exercise
@pytest.mark.part("zero3")
@pytest.mark.parametrize("replicate", [False, True])
def test_zero3_gradients_by_name_are_the_ranks_pieces(replicate):
    """After backward each parameter's .grad is this rank's piece of the averaged gradient
    (replicated norms: the whole averaged gradient); the norm over the pieces is the whole
    gradient's; after a step the gathered parameters equal the single process's."""
    model = UserNet().double()
    x, y = _user_batches(1)[0]
    F.cross_entropy(model(x.double()), y).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    ref_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in ref.values()])))
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    replicated = {id(p) for p in _norms(model)} if replicate else set()
    for grads, pieces, total, whole in launch(_grads_worker, 4, replicate, timeout=120):
        assert abs(total - ref_norm) <= F64 * ref_norm
        for k, p in model.named_parameters():
            g, sharded, shape = grads[k]
            assert sharded == (id(p) not in replicated), k
            if sharded:
                a, b = pieces[k]
                assert (
                    shape == (b - a,) and _max_rel(g, ref[k].reshape(-1)[a:b]) <= F64
                    if b > a
                    else g.numel() == 0
                ), k
            else:
                assert shape == tuple(p.shape) and _max_rel(g, ref[k]) <= F64, k
            assert _max_rel(whole[k], p.detach()) <= F64, k


def test_clip_grad_norm_is_torchs_on_whole_gradients():
    zero = exercise("zero")
    for norm_type in (2.0, 1.0, math.inf):
        a = UserNet()
        b = UserNet()
        for m in (a, b):
            x, y = _user_batches(1)[0]
            F.cross_entropy(m(x), y).backward()
        ours = zero.clip_grad_norm_(a.parameters(), 0.1, norm_type=norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, norm_type=norm_type)
        assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
        for p, q in zip(a.parameters(), b.parameters()):
            assert _max_rel(p.grad, q.grad) <= 1e-6


# --- never a segfault ---------------------------------------------------------------------------
def _touch(model: nn.Module, where: str, seen: list) -> None:
    """Read every element of every parameter and gradient (a read of freed memory segfaults)."""
    total = 0.0
    for _, p in model.named_parameters():
        total += float(p.detach().double().sum())
        if p.grad is not None:
            total += float(p.grad.detach().double().sum())
    seen.append((where, math.isfinite(total)))


def _touch_hook(model: nn.Module, where: str, seen: list, *_) -> None:
    _touch(model, where, seen)


def _touch_worker(stage: int, offload: bool):
    zero = exercise("zero")
    rank, n = dist.get_rank(), dist.get_world_size()
    model = AwkwardModel(seed=0)
    seen: list = []
    if stage == 3:
        zero.fully_shard(model.mix, name="mix", offload=offload)
        zero.fully_shard(model.back, name="back", offload=offload)
        zero.fully_shard(model, offload=offload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        optimizer = zero.ShardedOptimizer(
            model.parameters(), torch.optim.AdamW, lr=3e-3, shard_grads=stage == 2, offload=offload
        )
    modules = [m for m in model.modules() if m is not model]
    handles = []
    for m in modules:  # after each module's forward and after each module's backward
        handles.append(m.register_forward_hook(partial(_touch_hook, model, f"forward {m}", seen)))
        handles.append(
            m.register_full_backward_hook(partial(_touch_hook, model, f"backward {m}", seen))
        )
    data = _batches(3, 8)
    _touch(model, "before the first step", seen)
    x, y = (t.chunk(n)[rank] for t in data[0])
    _, loss = model(x, y)
    _touch(model, "between forward and backward", seen)
    loss.register_hook(lambda g: _touch(model, "in backward", seen))
    loss.backward()
    _touch(model, "after backward", seen)
    optimizer.step()
    _touch(model, "after the step", seen)
    optimizer.zero_grad()
    _touch(model, "after zero_grad", seen)
    for h in handles:
        h.remove()
    # an exception in the middle of a forward, then in the middle of a backward
    failing = model.back.register_forward_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x, y)
    failing.remove()
    _touch(model, "after an exception mid-forward", seen)
    _, loss = model(x, y)

    def fail(_):
        raise ArithmeticError("mid-backward")

    loss.register_hook(fail)
    with pytest.raises(ArithmeticError):
        loss.backward()
    _touch(model, "after an exception mid-backward", seen)
    optimizer.zero_grad()
    # training goes on as if nothing happened
    losses = []
    for x, y in data[1:]:
        x, y = x.chunk(n)[rank], y.chunk(n)[rank]
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / n)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    error = ""
    if stage == 3:
        assert model.mix(torch.zeros(1, 24)).shape == (1, 37)  # a unit called alone gathers itself
        try:  # a submodule of a released unit called on its own: a clear error
            model.embed(torch.zeros(1, 3, dtype=torch.long))
        except RuntimeError as e:
            error = str(e)
    return seen, shapes, error, losses


@pytest.mark.exercise
@pytest.mark.parametrize(
    "stage, offload",
    [
        (1, False),
        (2, False),
        pytest.param(3, False, marks=pytest.mark.part("zero3")),
        pytest.param(3, True, marks=pytest.mark.part("offload")),
    ],
)
def test_every_parameter_can_be_read_at_every_moment(stage, offload):
    model = AwkwardModel(seed=0)
    data = _batches(3, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, loss = model(*data[0])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ref = []
    for x, y in data[1:]:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref.append(loss.item())
    whole = {k: tuple(p.shape) for k, p in AwkwardModel().named_parameters()}
    for rank, (seen, shapes, error, losses) in enumerate(
        launch(_touch_worker, 4, stage, offload, timeout=120)
    ):
        moments = {w for w, _ in seen}
        assert {"in backward", "after an exception mid-backward"} <= moments
        assert sum(w.startswith("backward ") for w in moments) >= 4  # after each module's backward
        assert sum(w.startswith("forward ") for w in moments) >= 4
        assert all(ok for _, ok in seen), seen
        if stage < 3:
            assert shapes == whole  # whole between steps
        else:  # this rank's pieces: 1-D, together the rank's shard of each unit
            assert all(
                len(s) == 1
                for k, s in shapes.items()
                if k != "frozen.weight" and k != "frozen.bias"
            )
            assert "summon_full_params" in error and "unit 'model'" in error, error
        assert max(abs(a - b) / b for a, b in zip(losses, ref)) <= rule("value").rel, (
            rank,
            losses,
            ref,
        )


# --- a foreign loop ------------------------------------------------------------------------------
class UserSGD(torch.optim.Optimizer):
    """A user's optimizer: SGD with momentum and decoupled weight decay, written by hand."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(buf, alpha=-group["lr"])
        return loss


def _nothing() -> None:
    pass


def user_loop(
    model, optimizer, batches, *, rank, world, folder, after_backward=_nothing, zero=None
):
    """A training loop as PyTorch's tutorials write it: clip gradients by name, save a
    checkpoint after step 2, take a wrong step, and load the checkpoint back. ``zero``: the
    exercise module, whose ``clip_grad_norm_`` and ``summon_full_params`` the loop calls (None:
    the single-process reference, with torch's own clip and nothing to summon, so that it never
    runs the learner's code)."""
    clip_grad_norm_ = zero.clip_grad_norm_ if zero else torch.nn.utils.clip_grad_norm_
    summon_full_params = zero.summon_full_params if zero else (lambda model: nullcontext())
    losses = []
    for step, (x, y) in enumerate(batches):
        x = x.chunk(world)[rank]
        y = y.chunk(world)[rank]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        after_backward()
        # clip by name: biases by value, the weights by their global norm
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        torch.nn.utils.clip_grad_value_(biases, 0.02)
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        clip_grad_norm_(weights, 0.5)
        optimizer.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(float(t) / world)
        if step == 1:
            path = folder / f"rank{rank}.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            bad = F.cross_entropy(model(x * 10), (y + 1) % 5)  # a step the checkpoint undoes
            bad.backward()
            after_backward()
            optimizer.step()
            optimizer.zero_grad()
            saved = torch.load(path, weights_only=False)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
    with summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params


def _foreign_worker(mode: str, folder):
    zero = exercise("zero")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = UserNet()
    after_backward = _nothing
    if mode == "ddp":
        model = exercise("ddp").BucketedDDP(model)
        optimizer = UserSGD(model.parameters())
        after_backward = model.finish_gradient_synchronization
    elif mode == "sharded optimizer":
        model = exercise("ddp").BucketedDDP(model)
        optimizer = zero.ShardedOptimizer(model.parameters(), UserSGD, average_grads=False)
        after_backward = model.finish_gradient_synchronization
    else:
        _zero3(model, replicate=_norms(model))
        optimizer = UserSGD(model.parameters())
    losses, params = user_loop(
        model,
        optimizer,
        _user_batches(6),
        rank=rank,
        world=world,
        folder=folder,
        after_backward=after_backward,
        zero=zero,
    )
    return losses, {k.removeprefix("module."): v for k, v in params.items()}


@pytest.mark.exercise
@pytest.mark.parametrize(
    "mode", ["ddp", "sharded optimizer", pytest.param("zero-3", marks=pytest.mark.part("zero3"))]
)
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_foreign_loop_runs_unchanged(mode, nproc, tmp_path):
    model = UserNet()
    ref_losses, ref_params = user_loop(
        model, UserSGD(model.parameters()), _user_batches(6), rank=0, world=1, folder=tmp_path
    )
    value = rule("value", torch.float32).rel
    param = rule("param", torch.float32).rel
    for rank, (losses, params) in enumerate(
        launch(_foreign_worker, nproc, mode, tmp_path, timeout=120)
    ):
        worst = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
        assert worst <= value, (mode, rank, losses, ref_losses)
        for k, p in ref_params.items():
            assert _max_rel(params[k], p) <= param, (mode, rank, k)


# --- mixed precision ------------------------------------------------------------------------------
def _mixed_worker(stage: int) -> dict[str, object]:
    """One bf16-mixed step of the user's model under ZeRO ``stage``: the dtypes a learner meets."""
    zero = exercise("zero")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = UserNet().to(torch.bfloat16)
    if stage == 3:
        _zero3(model, mixed_precision=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = zero.ShardedOptimizer(
            model.parameters(), torch.optim.AdamW, mixed_precision=policy, lr=1e-2
        )
    seen = {}

    def note_dtype(module: nn.Module, args: tuple) -> None:
        seen["computes in"] = module.weight.dtype

    model.head.register_forward_pre_hook(note_dtype)
    x, y = _user_batches(1)[0]
    loss = F.cross_entropy(model(x.chunk(world)[rank].bfloat16()), y.chunk(world)[rank])
    loss.backward()
    optimizer.step()
    seen["optimizer steps"] = {
        v.dtype for state in optimizer.state.values() for v in state.values() if v.dim()
    }
    seen["between steps"] = model.head.weight.dtype
    with zero.summon_full_params(model):
        seen["whole"] = model.head.weight.dtype
    return seen


@pytest.mark.exercise
@pytest.mark.part("mixed-precision")
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_computes_in_bf16_and_steps_fp32(stage):
    """ZeRO-1 keeps bf16 parameters and fp32 masters inside the optimizer; ZeRO-3's pieces are the
    fp32 masters themselves (FSDP2's layout) and the unit computes in bf16 while gathered."""
    for seen in launch(_mixed_worker, 2, stage, timeout=120):
        assert seen["computes in"] == torch.bfloat16
        assert seen["optimizer steps"] == {torch.float32}
        assert seen["between steps"] == (torch.float32 if stage == 3 else torch.bfloat16)
        assert seen["whole"] == seen["between steps"]


def test_mixed_precision_options_refused_with_the_fix():
    zero = exercise("zero")
    policy = MixedPrecision()
    params = [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="loss_scaler needs mixed_precision"):
        zero.ShardedOptimizer(params, torch.optim.SGD, loss_scaler=LossScaler(), lr=0.1)
    with pytest.raises(ValueError, match="offload=True with mixed_precision"):
        zero.ShardedOptimizer(params, torch.optim.SGD, mixed_precision=policy, offload=True)
    with pytest.raises(TypeError, match="labs.train.MixedPrecision"):
        zero.ShardedOptimizer(params, torch.optim.SGD, mixed_precision=torch.bfloat16)
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="replicate with mixed_precision"):
        zero.fully_shard(net, mixed_precision=policy, replicate=[net.bias])
    with pytest.raises(ValueError, match="reduce_dtype=torch.float16 must be torch.float32"):
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
