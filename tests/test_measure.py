"""Measurement tools: the ledger (cross-checked with torch's CommDebugMode), memory, timeline."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from labs import launch
from labs.measure import (
    CommLedger,
    SavedActivations,
    Timeline,
    idle_fraction,
    plot_gantt,
    state_bytes,
)
from labs.measure.timeline import Event
from labs.models import ModelConfig, build_model
from labs.train import TrainConfig, make_optimizer


def issue_collectives():
    n = dist.get_world_size()
    rank = dist.get_rank()
    x = torch.ones(1024)  # 4096 bytes
    with CommLedger() as ledger, CommDebugMode() as debug:
        with ledger.phase("one"):
            dist.all_reduce(x)
            dist.all_gather_single(torch.empty(1024 * n), x)
        dist.reduce_scatter_single(torch.empty(1024 // n), x)
        dist.broadcast(x, src=0)
        splits = [r + 1 for r in range(n)]  # uneven: rank r sends r'+1 rows to rank r'
        out = torch.empty(n * (rank + 1), 4)
        dist.all_to_all_single(out, torch.ones(sum(splits), 4), [rank + 1] * n, splits)
        ops = [
            dist.P2POp(dist.isend, x, (rank + 1) % n),
            dist.P2POp(dist.irecv, torch.empty(1024), (rank - 1) % n),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    counts = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    return (
        ledger.summary(),
        ledger.calls(phase="one"),
        counts,
        ledger.sent_bytes("all_to_all_single"),
    )


def test_ledger_records_kinds_and_ring_bytes():
    n = 4
    summary, in_phase, debug_counts, a2a_sent = launch(issue_collectives, n)[1]
    k = 4096
    assert summary["all_reduce"] == {
        "calls": 1,
        "payload_bytes": k,
        "sent_bytes": 2 * (n - 1) / n * k,
    }
    assert summary["all_gather_single"]["sent_bytes"] == (n - 1) / n * k * n
    assert summary["reduce_scatter_single"]["sent_bytes"] == (n - 1) / n * k
    assert summary["isend"]["sent_bytes"] == k and summary["irecv"]["sent_bytes"] == 0
    assert in_phase == 2
    # rank 1 sends 1, 2, 3, 4 rows (of 16 bytes) to ranks 0..3 and keeps its own 2
    assert a2a_sent == (1 + 3 + 4) * 16
    # torch's own counter (c10d op names) agrees on every collective it sees
    torch_names = {
        "all_reduce": "allreduce_",
        "all_gather_single": "_allgather_base_",
        "reduce_scatter_single": "_reduce_scatter_base_",
        "broadcast": "broadcast_",
        "all_to_all_single": "alltoall_base_",
    }
    assert {op: summary[op]["calls"] for op in torch_names} == {
        op: debug_counts[c] for op, c in torch_names.items()
    }


def test_ledger_restores_torch_distributed():
    original = dist.all_reduce
    with CommLedger():
        assert dist.all_reduce is not original
    assert dist.all_reduce is original


def test_state_bytes_are_exact_and_count_tied_weights_once():
    cfg = ModelConfig(tie_embeddings=True)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    opt = make_optimizer(model.parameters(), TrainConfig())
    model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))[1].backward()
    opt.step()
    s = state_bytes(model, opt)
    assert s == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "total": 16 * n}


def test_saved_activations_excludes_parameters():
    lin = torch.nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedActivations(exclude=lin) as saved:
        y = torch.relu(lin(x))  # linear saves x (and its weight: excluded); relu saves its output
    assert saved.bytes == x.numel() * 4 + y.numel() * 4


def test_timeline_and_idle_fraction():
    events = [
        Event(0, "F", 0.0, 1.0),
        Event(0, "B", 1.0, 3.0),
        Event(1, "F", 1.0, 2.0),
        Event(1, "B", 2.0, 4.0),
    ]
    assert idle_fraction(events) == pytest.approx(1 - 6 / 8)
    ax = plot_gantt(events)
    assert len(ax.patches) == 4


def record_spans():
    t = Timeline()
    with t.span("F", microbatch=0):
        sum(range(10000))
    return t.events


def test_timeline_records_each_rank():
    events = [e for rank_events in launch(record_spans, 2) for e in rank_events]
    assert sorted(e.rank for e in events) == [0, 1]
    assert all(e.end >= e.start >= 0 for e in events)


def ring_of_sends():
    """Each rank sends a tensor of its rank id to the next rank and receives from the previous."""
    from labs.runtime.ring import exchange, ring_neighbours

    ring = ring_neighbours()
    mine = torch.full((3,), float(ring.rank))
    incoming = torch.empty(3)
    with CommLedger(keep_sent=True) as ledger:
        exchange(mine, incoming, ring.next, ring.prev)
        dist.all_reduce(torch.ones(4))
    return ledger.sent_tensors, ledger.calls_by_op()


def test_ledger_keeps_what_each_send_carried_and_lists_calls_by_op():
    for rank, (sent, calls) in enumerate(launch(ring_of_sends, 2)):
        assert len(sent) == 1 and torch.equal(sent[0], torch.full((3,), float(rank)))
        # a receive lists the bytes it received; a collective, the bytes it sent
        assert calls == {"isend": [12.0], "irecv": [12.0], "all_reduce": [16.0]}
