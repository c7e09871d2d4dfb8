"""The spawn path (macOS, Windows, a notebook that initialised CUDA, LABS_START_METHOD=spawn):
functions by value, warm workers reused with a reset, and the launcher's whole contract kept.

All tests of this file share this process's pool (``labs.runtime.pool``): the first spawned launch
starts the workers (torch imported in each, seconds), the others find them warm.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.runtime import LaunchTimeout, RankDied, RankError, isolation
from labs.runtime.device import rank_device
from labs.runtime.pool import Worker, WorkerPool, worker_pool
from labs.runtime.proc import child_pids
from tests.helpers import ROOT, alive


def spawned(fn, nprocs, *args, **kw):
    return launch(fn, nprocs, *args, start_method="spawn", timeout=kw.pop("timeout", 180), **kw)


def no_rank_left() -> bool:
    """Only the pool's idle workers are children of this process (a killed or hung worker is
    gone, and nothing a rank started is left)."""
    return child_pids() <= set(worker_pool().pids())


def rank_and_pid(x):
    return dist.get_rank(), x, os.getpid()


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """4 warm workers for the file (the cold start is measured once here), and none after."""
    t0 = time.monotonic()
    spawned(rank_and_pid, 4, 0)
    print(f"cold start of 4 spawned ranks: {time.monotonic() - t0:.1f} s")
    yield
    worker_pool().shutdown()


def test_a_notebook_function_reaches_spawned_ranks_by_value():
    offset = 10

    def local(x):  # defined inside a function, like a notebook cell: travels by value
        return x * (dist.get_rank() + 1) + offset

    assert spawned(local, 2, 21) == [31, 52]
    assert spawned(lambda: dist.get_world_size(), 3) == [3, 3, 3]


def test_later_launches_reuse_the_warm_workers_and_start_at_once():
    first = spawned(rank_and_pid, 4, 1)
    t0 = time.monotonic()
    second = spawned(rank_and_pid, 4, 2)
    elapsed = time.monotonic() - t0
    assert [r[:2] for r in second] == [(0, 2), (1, 2), (2, 2), (3, 2)]  # rank order
    assert {r[2] for r in second} == {r[2] for r in first}  # the same 4 processes
    start = worker_pool().history[-1]
    assert start.ranks == 4 and start.warm == 4 and start.seconds < 0.5, start
    assert elapsed < 2.0, f"a warm launch of 4 ranks took {elapsed:.2f} s"  # cold: ~10 s


def test_an_unpicklable_function_is_a_clear_error():
    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(ValueError, match="cannot be pickled.*make unpicklable things"):
        spawned(holds_a_lock, 2)


def exercise_imported_at_start():
    """Whether the exercise module was imported when this launch began, and the module's id."""
    before = "solutions.collectives" in sys.modules
    from labs.runtime import exercise

    return before, id(exercise("collectives"))


def test_exercise_modules_are_imported_afresh_by_every_launch():
    first = spawned(exercise_imported_at_start, 2)
    second = spawned(exercise_imported_at_start, 2)
    assert [before for before, _ in first + second] == [False] * 4
    assert first[0][1] != second[0][1]  # a new module object, read from the file again


def test_an_edited_module_is_seen_by_the_next_launch(tmp_path, monkeypatch):
    (tmp_path / "learner_helpers.py").write_text("def value():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import learner_helpers

    def call_value():
        return learner_helpers.value()  # imported by name in the rank: by reference

    assert spawned(call_value, 2) == [1, 1]
    (tmp_path / "learner_helpers.py").write_text("def value():\n    return 1234\n")  # new size
    assert spawned(call_value, 2) == [1234, 1234]


def leave_state_behind():
    """Change what a rank may change in its process, and report what it found first."""
    found = {
        "rand": torch.rand(1).item(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "var": os.environ.get("LABS_TEST_LEFT_BEHIND"),
        "cwd": os.getcwd(),
        "pg": dist.is_initialized(),
        "debug": str(dist.get_debug_level()),
        "pid": os.getpid(),
    }
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["LABS_TEST_LEFT_BEHIND"] = "1"
    os.chdir("/")
    dist.new_group()  # a subgroup too: destroyed with the default group
    return found


def test_a_reused_worker_starts_each_launch_as_a_fresh_process():
    """Nothing of a launch survives into the next one in the same process (RNG included: each
    launch starts from the state the worker's generators had when it started)."""
    first = spawned(leave_state_behind, 4)
    second = spawned(leave_state_behind, 4)
    assert worker_pool().history[-1].warm == 4
    by_pid = {found.pop("pid"): found for found in first}
    assert {found.pop("pid"): found for found in second} == by_pid
    found = by_pid[next(iter(by_pid))]
    assert found["dtype"] == "torch.float32" and found["grad"] and found["pg"]
    assert found["var"] is None and found["cwd"] == os.getcwd()


def read_env():
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG"), str(dist.get_debug_level()), os.getpid()


def test_a_launch_with_env_gets_fresh_workers_that_retire():
    warm = set(worker_pool().pids())
    results = spawned(read_env, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert [r[:2] for r in results] == [("DETAIL", "DebugLevel.DETAIL")] * 2
    pids = {r[2] for r in results}
    assert not pids & warm  # new processes: torch reads such variables once per process
    assert not pids & set(worker_pool().pids()) and not any(alive(p) for p in pids)
    after = spawned(read_env, 2)
    assert [r[:2] for r in after] == [(None, "DebugLevel.OFF")] * 2


def raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(60)
    return os.getpid()


def kill_self_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def start_grandchild_then_return(pid_file):
    child = subprocess.Popen(["sleep", "300"])
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(child.pid))
    return os.getpid()


def test_failures_are_reported_and_the_failed_workers_replaced():
    pids = {r[2] for r in spawned(rank_and_pid, 2, 0)}
    with pytest.raises(RankError) as info:
        spawned(raise_on_rank_1, 2)
    assert info.value.rank == 1 and "rank one is unhappy" in str(info.value)
    assert "raise_on_rank_1" in info.value.rank_traceback
    assert no_rank_left()

    with pytest.raises(LaunchTimeout) as timeout:
        spawned(hang_on_rank_1, 2, timeout=8)
    assert timeout.value.unfinished == [1]
    assert no_rank_left()

    with pytest.raises(RankDied, match="rank 1 died from SIGKILL"):
        spawned(kill_self_on_rank_1, 2)
    assert no_rank_left()
    # the pool started replacements; the next launch runs (some workers are new)
    assert [r[0] for r in spawned(rank_and_pid, 2, 0)] == [0, 1]
    assert pids != set(worker_pool().pids())


def test_what_a_rank_starts_dies_with_the_launch(tmp_path):
    pid_file = tmp_path / "grandchild"
    workers = spawned(start_grandchild_then_return, 2, str(pid_file))
    children = [int((tmp_path / f"grandchild.{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in children)
    assert set(workers) <= set(worker_pool().pids())  # the workers themselves stay warm


def test_ctrl_c_kills_the_launch_and_the_next_one_works():
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            spawned(hang_on_rank_1, 2, timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert no_rank_left()
    assert [r[0] for r in spawned(rank_and_pid, 2, 0)] == [0, 1]


def sleep_a_minute():
    time.sleep(60)


def test_workers_die_with_their_parent():
    """A parent killed outright (no atexit, no finally): its idle worker reads EOF, its busy
    worker notices within a second that its parent is gone."""
    script = textwrap.dedent(
        """
        import json
        from labs import launch
        from labs.runtime.pool import worker_pool
        from tests.test_launcher_spawn import rank_and_pid, sleep_a_minute
        launch(rank_and_pid, 2, 0, start_method="spawn", timeout=300)
        print(json.dumps(worker_pool().pids()), flush=True)
        launch(sleep_a_minute, 1, start_method="spawn", timeout=300)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    workers = json.loads(parent.stdout.readline())
    assert len(workers) == 2 and all(alive(p) for p in workers)
    time.sleep(1.0)  # the second launch is running: one worker busy, one idle
    parent.kill()
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)


def all_reduce_a_host_tensor():
    dist.all_reduce(torch.zeros(4))  # the bug: made on the host, not on rank_device()


def all_reduce_on_the_device():
    device = rank_device()
    buffer = torch.zeros(4, device=device)
    dist.all_reduce(buffer)
    return str(device), str(buffer.device)


def test_the_device_audit_runs_in_spawned_ranks(monkeypatch):
    """Spawned ranks audit too (tests/test_device_audit.py, instructor-only, proves the rest)."""
    monkeypatch.setenv("LABS_DEVICE_AUDIT", "1")
    with pytest.raises(RankError, match="dist.all_reduce\\(\\) got a CPU tensor"):
        spawned(all_reduce_a_host_tensor, 2)
    assert spawned(all_reduce_on_the_device, 2)[1] == ("cpu:1", "cpu:1")


def test_the_launchers_contract_holds_under_labs_start_method(monkeypatch):
    from tests.test_launcher import rank_and_sum

    monkeypatch.setenv("LABS_START_METHOD", "spawn")
    results = launch(rank_and_sum, 2, 0.5, timeout=180)
    assert [r["sum"] for r in results] == [1.5, 1.5] and results.backend == "gloo"
    assert worker_pool().history[-1].warm == 2  # it went through the pool


def test_a_worker_is_not_reused_once_a_read_once_variable_changed(monkeypatch):
    """NCCL, CUDA, OpenMP read their variables once per process: a warm worker started without
    the new value would ignore it. A variable torch sets itself (inductor's cache) is not one."""
    pool = WorkerPool()
    pool.idle.append(Worker(dict(os.environ)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    pool._retire_unusable()
    assert len(pool.idle) == 1
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    pool._retire_unusable()
    assert pool.idle == [] and pool.replaced == ["idle: ['NCCL_DEBUG'] changed"]


def test_a_worker_started_with_a_variable_kept_from_ranks_is_not_reused(monkeypatch):
    monkeypatch.setattr(isolation, "_kept_env", set())
    monkeypatch.setenv("LABS_TEST_TOKEN", "secret")
    pool = WorkerPool()
    pool.idle.append(Worker(dict(os.environ)))
    monkeypatch.setattr(isolation, "_kept_env", {"LABS_TEST_TOKEN"})
    pool._retire_unusable()
    assert pool.idle == [] and pool.replaced == [
        "idle: ['LABS_TEST_TOKEN'] must be kept from ranks"
    ]
    fresh = Worker(isolation.rank_environment(os.environ))  # what the pool starts now
    fresh.kill()
    assert "LABS_TEST_TOKEN" not in fresh.variables
