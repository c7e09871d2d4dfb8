"""Hidden checks for exercise 03 (graded, never released): ZeRO-1, -2 and -3 on three ranks, and
a unit with fewer elements than ranks.

The public tests run 2 and 4 ranks, where every shard of the course model and of the awkward
model's 8,009 elements holds parameters. Here N = 3 (shards of ceil(Ψ/3), another padding) and a
two-element layer on four ranks, where two ranks' shards are padding only and their pieces empty.
Everything in float64 against the same loop in one process (the tolerance table's float64 rule).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs import launch
from labs.models.toy import AwkwardModel
from labs.runtime import exercise
from labs.train import rule

F64 = rule("value", torch.float64).rel


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _token_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, 256, (batch, 8), generator=g),
            torch.randint(0, 256, (batch, 8), generator=g),
        )
        for _ in range(steps)
    ]


def _train(model, optimizer, batches, loss_of, rank=0, n=1):
    """The loop a user writes; the loss logged is the global batch's (all-reduced)."""
    losses = []
    for x, y in batches:
        loss = loss_of(model, x.chunk(n)[rank], y.chunk(n)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        if n > 1:
            dist.all_reduce(t)
        losses.append(float(t) / n)
    return losses


def _lm_loss(model, x, y):
    return model(x, y)[1]


def _sharded_worker(shard_grads: bool, steps: int):
    model = AwkwardModel(seed=0).double()
    optimizer = exercise("zero").ShardedOptimizer(
        model.parameters(), torch.optim.SGD, shard_grads=shard_grads, lr=0.1, momentum=0.9
    )
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = _train(model, optimizer, _token_batches(steps, 6), _lm_loss, rank, n)
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.exercise
@pytest.mark.parametrize("shard_grads", [False, True], ids=["zero-1", "zero-2"])
def test_sharded_optimizer_on_three_ranks(shard_grads):
    steps = 3
    model = AwkwardModel(seed=0).double()
    reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses = _train(model, reference, _token_batches(steps, 6), _lm_loss)
    for rank, (losses, params) in enumerate(launch(_sharded_worker, 3, shard_grads, steps)):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= F64, (rank, losses)
        for key, p in model.named_parameters():
            assert _max_rel(params[key], p) <= F64, f"rank {rank}: {key}"


class Blocks(nn.Module):
    """Three residual blocks of odd widths (a ZeRO-3 unit each) and a head."""

    def __init__(self, width: int = 13):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, 2 * width + 1), nn.Tanh(), nn.Linear(2 * width + 1, width)
            )
            for _ in range(3)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # [B, W]
        for block in self.blocks:
            h = h + block(h)  # [B, W]
        return self.head(h)  # [B, 3]


def _vector_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,)))
        for _ in range(steps)
    ]


def _class_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _zero3_worker(prefetch: bool, offload: bool, steps: int):
    zero = exercise("zero")
    model = Blocks().double()
    for block in model.blocks:
        zero.fully_shard(block, prefetch=prefetch, offload=offload)
    zero.fully_shard(model, prefetch=prefetch, offload=offload)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = _train(model, optimizer, _vector_batches(steps, 6), _class_loss, rank, n)
    with zero.summon_full_params(model):
        whole = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, whole


@pytest.mark.exercise
@pytest.mark.parametrize("prefetch, offload", [(True, False), (False, True)])
def test_zero3_on_three_ranks(prefetch, offload):
    """Four units (three blocks and the root's rest) on N = 3, with and without prefetch, with the
    shards on the host."""
    steps = 3
    model = Blocks().double()
    ref_losses = _train(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), _vector_batches(steps, 6), _class_loss
    )
    for rank, (losses, whole) in enumerate(launch(_zero3_worker, 3, prefetch, offload, steps)):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= F64, (rank, losses)
        for key, p in model.named_parameters():
            assert _max_rel(whole[key], p) <= F64, f"rank {rank}: {key}"


class Tiny(nn.Module):
    """Two layers: 4·3 + 3 = 15 elements, and a 1 -> 1 layer: 2 elements (a unit of its own under
    ZeRO-3, smaller than the world of 4)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.wide = nn.Linear(4, 3)
        self.one = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x) * self.one(x[:, :1])  # [B, 3]


def _tiny_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,)))
        for _ in range(steps)
    ]


def _tiny_worker(stage: int, steps: int):
    zero = exercise("zero")
    model = Tiny().double()
    if stage == 3:
        zero.fully_shard(model.one)
        zero.fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    else:
        groups = [
            {"params": list(model.wide.parameters())},
            {"params": list(model.one.parameters())},
        ]
        optimizer = zero.ShardedOptimizer(
            groups, torch.optim.SGD, shard_grads=stage == 2, lr=0.2, momentum=0.5
        )
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = _train(model, optimizer, _tiny_batches(steps), _class_loss, rank, n)
    if stage == 3:
        with zero.summon_full_params(model):
            whole = {k: p.detach().clone() for k, p in model.named_parameters()}
    else:
        whole = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, whole


@pytest.mark.exercise
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_smaller_than_the_world(stage):
    """The 1 -> 1 layer's 2 elements on 4 ranks: shards of 1, two of them padding only (ZeRO-3:
    two ranks hold empty pieces of its weight and bias). Training still equals one process."""
    steps = 3
    model = Tiny().double()
    ref_losses = _train(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        _tiny_batches(steps),
        _class_loss,
    )
    for rank, (losses, whole) in enumerate(launch(_tiny_worker, 4, stage, steps)):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= F64, (rank, losses)
        for key, p in model.named_parameters():
            assert _max_rel(whole[key], p) <= F64, f"stage {stage}, rank {rank}: {key}"
