"""Profiling your own step: the trace analysis on made-up traces with known answers, the step
timer's profiler hook, and ``python -m labs.run ddp --profile DIR`` for real on 2 ranks."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments.profiling import exposed_table, profile_report, profiled_labs
from labs.experiments.spec import command_labs
from labs.measure.profile import PROFILE_ENV, WAIT_EVENT, profiling, trace_path
from labs.measure.timing import StepTimer
from labs.measure.trace import (
    format_figures,
    intersect,
    lanes_of,
    length,
    load_run,
    load_trace,
    merge,
    plot_lanes,
    step_figures,
    subtract,
)
from labs.run import main

# --- interval arithmetic --------------------------------------------------------------------


def test_merge_intersect_subtract():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    a = [(0, 3), (5, 8)]
    b = [(2, 6), (7, 10)]
    assert intersect(a, b) == [(2, 3), (5, 6), (7, 8)]
    assert subtract(a, b) == [(0, 2), (6, 7)]
    assert subtract(b, a) == [(3, 5), (8, 10)]
    assert subtract(a, []) == a and intersect(a, []) == []
    # |a| = |a ∩ b| + |a \ b| for any a, b
    assert length(a) == length(intersect(a, b)) + length(subtract(a, b))


# --- made-up traces with known lanes ----------------------------------------------------------


def _event(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def _cpu_trace(rank=0, base_ns=0, shift=0.0):
    """One profiled step, 0..100 µs, on thread 1. Compute: operators 0-30 (with a nested one)
    and 50-80; a collective call 30-35 on the compute thread; gloo's work 20-60 on thread 2.
    Communication = 20-60; hidden under compute = 20-30 and 50-60; exposed = 30-50: 20 µs."""
    events = [
        _event("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _event("aten::mm", 0, 30),
        _event("aten::addmm", 10, 5),  # nested: counted once
        _event("c10d::allreduce_", 30, 5),
        _event("aten::add", 50, 30),
        _event("gloo:all_reduce", 20, 40, tid=2, cat="user_annotation"),
        _event("aten::mul", 200, 10),  # outside the step: not in its figures
    ]
    events = [dict(e, ts=e["ts"] + shift) for e in events]
    return {
        "traceEvents": events,
        "baseTimeNanoseconds": base_ns,
        "distributedInfo": {"rank": rank},
    }


def _in_us(rows):
    """Intervals (or (step, start, end) rows) in seconds -> whole microseconds."""
    return [tuple(x if isinstance(x, int) else round(x * 1e6) for x in row) for row in rows]


def test_cpu_trace_lanes_and_exposed_time():
    lanes = lanes_of(_cpu_trace())
    us = 1e-6
    assert lanes.device == "cpu" and lanes.rank == 0
    assert _in_us(lanes.steps) == [(1, 0, 100)]
    assert _in_us(lanes.compute) == [(0, 30), (50, 80), (200, 210)]
    assert _in_us(lanes.comm) == [(20, 60)]
    assert _in_us(lanes.exposed) == [(30, 50)]
    (row,) = step_figures([lanes])
    assert row["step"] == 1 and row["step_s"] == pytest.approx(100 * us)
    assert row["compute_s"] == pytest.approx(60 * us)
    assert row["comm_s"] == pytest.approx(40 * us)
    assert row["exposed_comm_s"] == pytest.approx(20 * us)
    assert "rank  step" in format_figures([row])


def test_a_wait_inside_an_operator_is_communication():
    """ZeRO-3 waits for an all-gather inside a backward hook, i.e. inside an autograd operator:
    the marked wait is cut out of the compute lane and counts as (exposed) communication."""
    events = [
        _event("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _event("torch::autograd::AccumulateGrad", 0, 60),
        _event(WAIT_EVENT, 10, 40, cat="user_annotation"),
        _event("gloo:all_gather", 5, 45, tid=2, cat="user_annotation"),
    ]
    (row,) = step_figures([lanes_of({"traceEvents": events})])
    assert row["compute_s"] == pytest.approx(20e-6)  # 0-10 and 50-60
    assert row["comm_s"] == pytest.approx(45e-6)  # 5-50
    assert row["exposed_comm_s"] == pytest.approx(40e-6)  # 10-50: the wait


def test_gpu_trace_uses_kernels():
    """With kernels in the trace the lanes are the device's: NCCL kernels communicate."""
    events = [
        _event("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _event("aten::mm", 0, 5),  # the host queueing work: not the GPU's compute
        _event("ampere_sgemm_128x64", 10, 40, tid=7, cat="kernel"),
        _event("ncclDevKernel_AllReduce_Sum_f32", 30, 40, tid=8, cat="kernel"),
    ]
    lanes = lanes_of({"traceEvents": events})
    (row,) = step_figures([lanes])
    assert lanes.device == "cuda"
    assert row["compute_s"] == pytest.approx(40e-6)
    assert row["comm_s"] == pytest.approx(40e-6)
    assert row["exposed_comm_s"] == pytest.approx(20e-6)  # 50-70: after the matmul ended


def test_load_run_puts_ranks_on_one_clock(tmp_path):
    # rank 1's trace counts from a wall clock 1 ms later and its step starts 0.5 ms later
    (tmp_path / "rank0.json").write_text(json.dumps(_cpu_trace(0, base_ns=10**12)))
    (tmp_path / "rank1.json").write_text(
        json.dumps(_cpu_trace(1, base_ns=10**12 + 10**6, shift=-500))
    )
    r0, r1 = load_run(tmp_path)
    assert (r0.rank, r1.rank) == (0, 1)
    assert r0.steps[0][1] == pytest.approx(0.0)
    assert r1.steps[0][1] == pytest.approx(0.5e-3)  # 1 ms later on the wall, 0.5 ms earlier in ts
    rows = step_figures([r0, r1])
    assert [r["exposed_comm_s"] for r in rows] == pytest.approx([20e-6, 20e-6])
    plot_lanes([r0, r1])


def test_bad_traces_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--profile"):
        load_trace(tmp_path / "rank0.json")
    (tmp_path / "rank0.json").write_text("[]")
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(tmp_path / "rank0.json")
    with pytest.raises(FileNotFoundError, match="--profile"):
        load_run(tmp_path / "empty")


# --- the step timer's hook ----------------------------------------------------------------


def _two_loops():
    """A 2-step loop, then a 4-step one: the rank's trace is the first loop's step 1 only. Returns
    whether ``Work.wait`` was marked while profiling and restored after."""
    wait = dist.Work.wait
    first = StepTimer()
    marked = []
    for _ in range(2):
        with first.step():
            torch.ones(8).sum()
            dist.all_reduce(torch.ones(8), async_op=True).wait()
            marked.append(dist.Work.wait is not wait)
    first.step_time()  # the loop ended before step 3: the trace is written here
    restored = dist.Work.wait is wait
    second = StepTimer()
    for _ in range(4):
        with second.step():
            torch.zeros(8).sum()
    second.step_time()
    return marked == [False, True] and restored


def test_step_timer_profiles_the_first_loop_of_each_rank(tmp_path, capfd):
    with profiling(tmp_path):
        assert launch(_two_loops, 2, timeout=60) == [True, True]
    # Kineto's start/stop markers on the ranks' stderr are not replayed into the notebook
    assert "profiler_start" not in capfd.readouterr().err
    for rank in range(2):
        events = load_trace(trace_path(tmp_path, rank))["traceEvents"]
        names = {e.get("name") for e in events}
        assert "ProfilerStep#1" in names and "ProfilerStep#2" not in names
        assert "aten::ones" in names and "aten::zeros" not in names
        assert WAIT_EVENT in names and "gloo:all_reduce" in names
    assert PROFILE_ENV not in os.environ  # restored
    with profiling(tmp_path):  # this process is not a rank: never profiled
        timer = StepTimer()
        for _ in range(3):
            with timer.step():
                pass
        assert timer.profiler is None


# --- labs.run LAB --profile DIR ----------------------------------------------------------------


def test_labs_run_ddp_profile_writes_traces_and_prints_figures(tmp_path, capsys):
    folder = tmp_path / "traces"
    code = main(
        ["ddp", "--nproc", "2", "--steps", "3", "--impl", "solutions", "--profile", str(folder)]
    )
    out = capsys.readouterr().out
    assert code == 0
    for rank in range(2):
        trace = json.loads(trace_path(folder, rank).read_text())
        assert trace["traceEvents"] and trace["distributedInfo"]["rank"] == rank
    assert f"profile: 2 traces in {folder}" in out
    table = out[out.index("rank  step") :].splitlines()[1:]
    # steps 1 and 2 (3 steps: step 0 is the warm-up) on both ranks
    assert [line.split()[:2] for line in table] == [["0", "1"], ["0", "2"], ["1", "1"], ["1", "2"]]
    report = profile_report(folder, nproc=2)
    for row in report["steps"]:
        # bucketed DDP all-reduces every step; none of the figures exceeds the step
        assert 0 < row["comm_s"] <= row["step_s"] and 0 < row["compute_s"] <= row["step_s"]
        assert 0 <= row["exposed_comm_s"] <= row["comm_s"]
    assert "exposed" in exposed_table({"DDP": report})


def test_labs_run_profile_json_and_refusals(tmp_path, capsys):
    argv = ["ddp", "--nproc", "2", "--steps", "2", "--json", "--impl", "solutions"]
    code = main([*argv, "--profile", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["step"] for r in summary["profile"]["steps"]] == [1, 1]
    assert set(summary["profile"]) == {"folder", "traces", "steps", "medians"}
    for lab in sorted(set(command_labs()) - set(profiled_labs())):  # they time something else
        assert main([lab, "--profile", str(tmp_path)]) == 2
        assert "--profile applies to labs whose ranks run training steps" in capsys.readouterr().err
    assert main(["ddp", "--steps", "1", "--profile", str(tmp_path)]) == 2
    assert "steps >= 2" in capsys.readouterr().err
