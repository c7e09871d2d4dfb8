"""Notebook 10's failure scenarios: each ends with the expected, readable error, within its
bound, and leaves no process behind."""

import time

import pytest

from labs.experiments import failures
from labs.runtime import LaunchTimeout, RankDied, RankError
from labs.runtime.proc import child_pids

EXPECTED = {
    "skipped_collective": (LaunchTimeout, "rank(s) [0, 2] had not finished (rank(s) [1] returned)"),
    "wrong_shape": (RankDied, "Received data size doesn't match expected size"),
    "wrong_shape_detail": (RankError, "Detected mismatch between collectives on ranks"),
    "port_in_use": (RankError, "EADDRINUSE"),
    "crashed_rank": (RankDied, "rank 1 died from SIGKILL"),
    "out_of_memory": (RankError, "can't allocate memory"),
    "straggler": (RankError, "Rank 1 failed to pass monitoredBarrier"),
}


@pytest.mark.parametrize("name", failures.SCENARIOS)
def test_scenario_fails_readably_in_bounded_time_and_leaves_nothing(name):
    error, text = EXPECTED[name]
    before = child_pids()
    t0 = time.monotonic()
    with pytest.raises(error) as info:
        failures.reproduce(name, timeout=5.0)
    assert time.monotonic() - t0 < 15
    assert text in str(info.value)
    assert child_pids() == before


def test_calculator_predicts_the_out_of_memory():
    prediction = failures.oom_prediction(failures.OOM_PARAMS, failures.OOM_BUDGET)
    assert prediction["needed_bytes"] == 16 * failures.OOM_PARAMS and not prediction["fits"]
    assert failures.oom_prediction(1 << 10, failures.OOM_BUDGET)["fits"]


def test_diagnose_reports_the_error_and_no_leftovers():
    report = failures.diagnose("crashed_rank")
    assert report["error"] == "RankDied" and report["processes_left"] == 0


def test_straggler_shows_on_the_timeline():
    result = failures.straggler_timeline(nproc=3, steps=4, work=160, slowdown=4.0)
    # Each rank's quickest compute span: a rank the OS preempted (3 ranks share 2 cores, and
    # CI may be busy) has a few long spans, but its least disturbed one shows its real work.
    compute = {
        r: min(e.duration for e in result["events"] if e.rank == r and e.name == "compute")
        for r in range(3)
    }
    assert compute[1] > 1.5 * max(compute[0], compute[2]), compute
    assert all(p["compute"] > 0 and p["communication"] > 0 for p in result["profile_s"])


def test_gloo_only_scenarios_say_why_and_force_gloo(monkeypatch):
    """The scenarios in GLOO_ONLY run on gloo even where NCCL would be picked; the others take
    the launcher's choice (NCCL on a GPU box), with their tensors on the rank's device."""
    backends = {}

    def fake_launch(fn, nprocs, *args, backend="auto", **kwargs):
        backends[fn.__name__, kwargs.get("env") is not None] = backend

    monkeypatch.setattr(failures, "launch", fake_launch)
    for name in failures.SCENARIOS:
        failures.reproduce(name)
    assert set(failures.GLOO_ONLY) == {"wrong_shape", "straggler"}
    assert all(len(why) > 20 for why in failures.GLOO_ONLY.values())
    assert backends == {
        ("skipped_collective_rank", False): "auto",
        ("wrong_shape_rank", False): "gloo",
        ("wrong_shape_rank", True): "auto",  # TORCH_DISTRIBUTED_DEBUG=DETAIL checks on NCCL too
        ("port_in_use_rank", False): "auto",
        ("crashed_rank", False): "auto",
        ("out_of_memory_rank", False): "auto",
        ("straggler_rank", False): "gloo",
    }
