"""Hidden checks for exercise 04, part 1 (graded, never released): the conjugate operators and the
async linear on process sub-groups, on three ranks and in float32.

The public tests run every operator on the default group of 2 or 4 ranks, in float64. Here each
rank works in its own tensor-parallel group: {0, 2} and {1, 3} on four ranks (a group rank is not
the global rank, and two groups run at once), or all three ranks (N = 3). An operator that
communicates on the default group, or takes its chunk by global rank, gets other numbers. Each
result is compared with its definition computed from every member's tensors.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs import launch
from labs.runtime import exercise

pytestmark = pytest.mark.exercise

GROUPS = {4: [[0, 2], [1, 3]], 3: [[0, 1, 2]]}


def _my_group(nproc):
    """(every member's global rank, this rank's place among them, the group): every rank creates
    every group, in the same order."""
    handles = [dist.new_group(members) for members in GROUPS[nproc]]
    rank = dist.get_rank()
    for members, group in zip(GROUPS[nproc], handles):
        if rank in members:
            return members, members.index(rank), group
    raise AssertionError(f"rank {rank} is in no group")


def _tensors(members, shape, salt, dtype):
    """Every member's tensor, built identically on every rank."""
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + m), dtype=dtype)
        for m in members
    ]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def operators_worker(nproc, dtype):
    comm = exercise("tensor_parallel_comm")
    members, r, group = _my_group(nproc)
    n = len(members)
    B, T, H = 2, 2 * n, 3 * n

    def part(t, dim):  # this rank's chunk of t along dim
        return t.chunk(n, dim)[r]

    def op(cls):
        return lambda x: cls.apply(x, group)

    def region(fn, sp):
        return lambda x: fn(x, group, sp)

    cases = {  # name: (call, input shape, upstream gradient shape, expected output, expected grad)
        "CopyToModelParallelRegion": (
            op(comm.CopyToModelParallelRegion),
            (B, T, H),
            (B, T, H),
            lambda xs: xs[r],
            lambda gs: sum(gs),
        ),
        "ReduceFromModelParallelRegion": (
            op(comm.ReduceFromModelParallelRegion),
            (B, T, H),
            (B, T, H),
            lambda xs: sum(xs),
            lambda gs: gs[r],
        ),
        "GatherFromModelParallelRegion": (
            op(comm.GatherFromModelParallelRegion),
            (B, T, H // n),
            (B, T, H),
            lambda xs: torch.cat(xs, -1),
            lambda gs: part(gs[r], -1),
        ),
        "ScatterToModelParallelRegion": (
            op(comm.ScatterToModelParallelRegion),
            (B, T, H),
            (B, T, H // n),
            lambda xs: part(xs[r], -1),
            lambda gs: torch.cat(gs, -1),
        ),
        "GatherFromSequenceParallelRegion": (
            op(comm.GatherFromSequenceParallelRegion),
            (B, T // n, H),
            (B, T, H),
            lambda xs: torch.cat(xs, 1),
            lambda gs: part(sum(gs), 1),
        ),
        "ReduceScatterToSequenceParallelRegion": (
            op(comm.ReduceScatterToSequenceParallelRegion),
            (B, T, H),
            (B, T // n, H),
            lambda xs: part(sum(xs), 1),
            lambda gs: torch.cat(gs, 1),
        ),
        "enter_parallel_region": (
            region(comm.enter_parallel_region, False),
            (B, T, H),
            (B, T, H),
            lambda xs: xs[r],
            lambda gs: sum(gs),
        ),
        "enter_parallel_region, SP": (
            region(comm.enter_parallel_region, True),
            (B, T // n, H),
            (B, T, H),
            lambda xs: torch.cat(xs, 1),
            lambda gs: part(sum(gs), 1),
        ),
        "exit_parallel_region": (
            region(comm.exit_parallel_region, False),
            (B, T, H),
            (B, T, H),
            lambda xs: sum(xs),
            lambda gs: gs[r],
        ),
        "exit_parallel_region, SP": (
            region(comm.exit_parallel_region, True),
            (B, T, H),
            (B, T // n, H),
            lambda xs: part(sum(xs), 1),
            lambda gs: torch.cat(gs, 1),
        ),
    }
    out = {}
    for salt, (name, (call, x_shape, g_shape, want_out, want_grad)) in enumerate(cases.items()):
        xs = _tensors(members, x_shape, salt, dtype)
        gs = _tensors(members, g_shape, salt + 50, dtype)
        x = xs[r].clone().requires_grad_()
        y = call(x)
        y.backward(gs[r])
        out[name] = {
            "forward": _rel(y, want_out(xs)),
            "backward": _rel(x.grad, want_grad(gs)),
            "dtypes": (y.dtype, x.grad.dtype),
            "input unchanged": torch.equal(x.detach(), xs[r]),
        }
    return out


@pytest.mark.parametrize("nproc, dtype", [(4, torch.float64), (3, torch.float32)])
def test_operators_on_sub_groups_and_three_ranks(nproc, dtype):
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6  # only the order of a sum may differ
    for rank, results in enumerate(launch(operators_worker, nproc, nproc, dtype, timeout=60)):
        for name, got in results.items():
            where = f"rank {rank} (group {GROUPS[nproc]}), {name}, {dtype}"
            assert got["forward"] <= tolerance, f"{where}: forward off by {got['forward']:.2e}"
            assert got["backward"] <= tolerance, f"{where}: backward off by {got['backward']:.2e}"
            assert got["dtypes"] == (dtype, dtype), f"{where}: dtypes {got['dtypes']}"
            assert got["input unchanged"], f"{where}: the operator modified its input"


def async_linear_worker(nproc, sp):
    comm = exercise("tensor_parallel_comm")
    members, r, group = _my_group(nproc)
    n = len(members)
    B, T, IN, OUTS = 2, 2 * n, 5, (2 * n, 3 * n)  # two column-parallel weights sharing one input
    dtype = torch.float64
    xs = _tensors(members, (B, T // n if sp else T, IN), 1, dtype)
    weights = [_tensors(members, (out // n, IN), 2 + i, dtype) for i, out in enumerate(OUTS)]
    grads = [_tensors(members, (B, T, out // n), 5 + i, dtype) for i, out in enumerate(OUTS)]
    x = xs[r].clone().requires_grad_()
    ws = [w[r].clone().requires_grad_() for w in weights]
    ys = comm.LinearWithAsyncCommunication.apply(x, group, sp, *ws)
    torch.autograd.backward(list(ys), [g[r] for g in grads])
    # the definition: the input gathered along T (SP) or as is; its gradient summed over the group
    whole = torch.cat(xs, 1) if sp else xs[r]
    want_y = [F.linear(whole, w[r]) for w in weights]
    terms = sum(g[m] @ w[m] for g, w in zip(grads, weights) for m in range(n))  # [B, T, IN]
    want_gx = terms.chunk(n, 1)[r] if sp else terms
    want_gw = [g[r].flatten(0, 1).t() @ whole.flatten(0, 1) for g in grads]
    return {
        "forward": max(_rel(y, w) for y, w in zip(ys, want_y)),
        "input grad": _rel(x.grad, want_gx),
        "weight grads": max(_rel(w.grad, want) for w, want in zip(ws, want_gw)),
    }


@pytest.mark.parametrize("nproc", [4, 3])
@pytest.mark.parametrize("sp", [False, True])
def test_async_linear_on_sub_groups_and_three_ranks(nproc, sp):
    for rank, got in enumerate(launch(async_linear_worker, nproc, nproc, sp, timeout=60)):
        for what, diff in got.items():
            assert diff <= 1e-12, (
                f"rank {rank} (group {GROUPS[nproc]}), sp={sp}: {what} off by {diff:.2e}"
            )
