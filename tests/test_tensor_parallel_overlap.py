"""Exercise 04, §11: the overlapped column-parallel linear (``LinearWithAsyncCommunication``,
``apply_async_communication``) changes when the backward waits and nothing else: the same
gradients bit for bit, the same collectives call for call, the lab's verdict, and less exposed
communication in a profiled backward. Also the tools that measure it: the log of async
collectives and the matmul padding."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import tp as experiment
from labs.experiments.tp_overlap import PaddedMatmuls, overlap_runs, plot_overlap, same_results
from labs.measure import CommLedger
from labs.measure.async_collectives import AsyncCollectives
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from labs.runtime.device import rank_device
from tests.helpers import lab_json
from tests.test_tensor_parallel import summary as sync_summary

CASES = [(2, False), (2, True), (4, False), (4, True)]
# §11 is the lab's last extension, "async" (PARTS in labs/tensor_parallel.py): its function,
# LinearWithAsyncCommunication.backward, is in labs/tensor_parallel_comm.py.
pytestmark = pytest.mark.part("async")


# --- the tools ------------------------------------------------------------------------------------
def async_patterns() -> tuple[list[dict], bool]:
    """Three async collectives (overlapped, waited at once, never waited) and a synchronous one
    under the log, with the ledger recording alongside."""
    device = rank_device()
    x = torch.ones(8, device=device)
    a = torch.ones(4, 4, device=device)
    rows = torch.ones(2 * dist.get_world_size(), 3, device=device)
    original = dist.all_reduce
    with CommLedger() as ledger, AsyncCollectives() as log:
        work = dist.all_reduce(x, async_op=True)
        a @ a
        a @ a
        work.wait()
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        a @ a
        late = dist.reduce_scatter_single(torch.empty(2, 3, device=device), rows, async_op=True)
        dist.all_reduce(x)  # synchronous: not an async collective
    late.wait()  # after the log: it never saw this wait
    return log.summary(), dist.all_reduce is original and ledger.calls() == 4


def test_the_async_log_sees_overlap_waits_and_missing_waits():
    for summary, restored in launch(async_patterns, 2, timeout=60):
        assert summary == [
            {"op": "all_reduce", "waited": True, "matmuls_in_flight": 2},
            {"op": "all_reduce", "waited": True, "matmuls_in_flight": 0},
            {"op": "reduce_scatter_single", "waited": False, "matmuls_in_flight": None},
        ]
        assert restored  # the ledger saw every call, and both put torch.distributed back


def test_padded_matmuls_last_op_time_and_nothing_else():
    a = torch.ones(8, 8)
    with PaddedMatmuls(0.02):
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        padded = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(3):
            a + a
        unpadded = time.perf_counter() - start
    assert padded >= 0.06 and unpadded < 0.02, (padded, unpadded)
    with pytest.raises(ValueError, match="op_time=-1 must be >= 0"):
        PaddedMatmuls(-1)
    with pytest.raises(ValueError, match="op_time=-0.5 must be >= 0"):
        experiment.run(nproc=2, op_time=-0.5)


# --- the overlapped model -------------------------------------------------------------------------
def sync_and_async(sp: bool) -> dict:
    """One step of the TP model, f then the matmuls against apply_async_communication: the loss,
    every gradient by name, and the collectives in call order, on this rank."""
    tp = exercise("tensor_parallel")
    idx = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    idx = idx.to(rank_device())
    out = {}
    for name in ("sync", "async"):
        model = tp.apply_tensor_parallel(
            build_model(ModelConfig(), 0, device=rank_device()), sequence_parallel=sp
        )
        if name == "async":
            model = tp.apply_async_communication(model)
        with CommLedger() as ledger:
            _, loss = model(idx, idx)
            loss.backward()
        out[name] = {
            "loss": loss.item(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "calls": [(r.op, r.phase, r.payload_bytes, r.sent_bytes) for r in ledger.records],
        }
    sync, overlapped = out["sync"], out["async"]
    return {
        "same loss": sync["loss"] == overlapped["loss"],
        "same names": list(sync["grads"]) == list(overlapped["grads"]),
        "different grads": [
            n for n, g in sync["grads"].items() if not torch.equal(g, overlapped["grads"][n])
        ],
        "same calls": sync["calls"] == overlapped["calls"],
        "calls": len(sync["calls"]),
    }


@pytest.mark.exercise
@pytest.mark.parametrize("tp, sp", CASES)
def test_the_overlap_changes_no_bit_and_no_collective(tp, sp):
    for r in launch(sync_and_async, tp, sp, timeout=120):
        assert r["same loss"] and r["same names"] and r["calls"] > 0, r
        assert r["different grads"] == [], r  # bit for bit, by name
        assert r["same calls"], r  # op, phase, payload and bytes sent, in call order


@pytest.mark.exercise
@pytest.mark.parametrize("tp, sp", CASES)
def test_the_async_lab_passes_its_verdict_with_the_sync_runs_figures(tp, sp):
    s = experiment.run(nproc=tp, steps=5, sp=sp, async_linear=True)
    sync = sync_summary(tp, sp, "course")
    assert s.passed, s.verdict()
    async_checks = [c for c in s.checks if "async" in c.name or "in flight" in c.name]
    assert len(async_checks) == 3 and all(c.ok for c in async_checks)
    # the head's, then (MLP, attention) per block from the last: each waited, each overlapped
    log = s["async_collectives"]
    assert [c["op"] for c in log] == ["reduce_scatter_single" if sp else "all_reduce"] * 5
    assert all(c["waited"] and c["matmuls_in_flight"] >= 1 for c in log), log
    assert s["losses"] == sync["losses"]  # bit for bit
    for key in ("comm", "comm_bytes_per_rank", "saved_activation_bytes", "state_bytes_per_rank"):
        assert s[key] == sync[key], key


@pytest.mark.exercise
def test_tied_embeddings_stay_tied_in_the_overlapped_model():
    s = experiment.run(
        nproc=2, steps=2, async_linear=True, model_cfg=ModelConfig(tie_embeddings=True)
    )
    assert s.passed, s.verdict()
    assert s["param_bytes_per_rank"] == [s["theory_param_bytes_per_rank"]] * 2


@pytest.mark.exercise
def test_the_cli_runs_the_overlapped_variant_and_profiles_it(tmp_path):
    s = lab_json(
        "tp",
        "--nproc",
        "2",
        "--steps",
        "4",
        "--async-linear",
        "--op-time",
        "0.001",
        "--profile",
        str(tmp_path),
        "--json",
    )
    assert s["async_linear"] is True and s["op_time_s"] == 0.001 and s["passed"]
    assert len(s["profile"]["traces"]) == 2 and len(s["profile"]["steps"]) == 2 * 3


@pytest.mark.exercise
def test_profiled_backward_hides_communication_only_when_overlapped(tmp_path):
    """Matmuls padded to 5 ms leave the cores to gloo: the async backward's collectives run under
    the weight-gradient matmuls, the synchronous ones under nothing."""
    runs = overlap_runs(tmp_path, nproc=2, op_time=0.005)
    same = same_results(runs["sync"]["summary"], runs["async"]["summary"])
    assert all(same.values()), same

    def hidden_ms(run):  # communication under compute in backward, summed over ranks and steps
        return sum(r["comm_s"] - r["exposed_comm_s"] for r in run["backward"]) * 1e3

    assert len(runs["async"]["backward"]) == 2 * 3  # every rank, every profiled step
    assert hidden_ms(runs["async"]) > max(1.0, 5 * hidden_ms(runs["sync"])), {
        name: hidden_ms(run) for name, run in runs.items()
    }
    # the picture: one panel per variant, zoomed on the backward passes of step 1
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_overlap(runs)
    left, right = fig.axes[0].get_xlim()
    steps = [row["step_s"] for run in runs.values() for row in run["steps"] if row["step"] == 1]
    assert len(fig.axes) == 2 and 0 < left < right < max(steps) * 1e3 * 1.5
    assert all("backward of step 1" in ax.get_title() for ax in fig.axes)
