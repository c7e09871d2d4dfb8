"""The launcher: results in rank order, failures named and shown, timeouts, no leftovers."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.runtime import LaunchTimeout, RankError, choose_backend
from labs.runtime.proc import child_pids
from tests.helpers import ROOT, alive


def rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item() + offset,
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def raise_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("rank two is unhappy")
    dist.barrier()


def sleep_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(60)
    return dist.get_rank()


def skip_all_reduce_on_rank_1():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))
    time.sleep(60)


def kill_self_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def start_grandchild_then_fail(pid_file):
    child = subprocess.Popen(["sleep", "300"])
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(child.pid))
    dist.barrier()
    raise RuntimeError("failing with a grandchild still running")


def exit_on_rank_0():
    if dist.get_rank() == 0:
        sys.exit(3)
    dist.barrier()


def test_results_come_back_in_rank_order():
    results = launch(rank_and_sum, 4, 0.5)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 6.5 for r in results)
    assert all(r["threads"] == 1 and r["backend"] == "gloo" for r in results)
    # the backend the ranks' process group ran, as rank 0 read it, travels with the results
    assert results.backend == results[0]["backend"]


def test_single_rank_and_notebook_style_function():
    def local_function(x):  # defined inside a function, like a notebook cell: works under fork
        return x * (dist.get_rank() + 1)

    assert launch(local_function, 1, 21) == [21]


def test_rank_error_names_rank_and_shows_its_traceback():
    with pytest.raises(RankError) as info:
        launch(raise_on_rank_2, 4)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "rank two is unhappy" in str(err)
    assert "raise_on_rank_2" in err.rank_traceback  # the rank's own frames
    assert not child_pids()


def test_timeout_names_the_unfinished_ranks():
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(sleep_on_rank_1, 3, timeout=2)
    assert time.monotonic() - t0 < 10
    assert info.value.unfinished == [1]
    assert "rank(s) [1] had not finished" in str(info.value)
    assert not child_pids()


def test_mismatched_collective_fails_within_the_timeout():
    """Rank 1 skips an all_reduce the others wait on: the launch ends, it does not hang."""
    t0 = time.monotonic()
    with pytest.raises((LaunchTimeout, RankError)) as info:
        launch(skip_all_reduce_on_rank_1, 3, timeout=3)
    assert time.monotonic() - t0 < 15
    assert "rank" in str(info.value)
    assert not child_pids()


def test_rank_killed_by_signal_is_reported_with_the_signal():
    with pytest.raises(RuntimeError, match="rank 1 died from SIGKILL"):
        launch(kill_self_on_rank_1, 2)
    assert not child_pids()


def test_sys_exit_in_a_rank_is_a_rank_error():
    with pytest.raises(RankError, match="SystemExit"):
        launch(exit_on_rank_0, 2)


def test_grandchildren_are_killed_too(tmp_path):
    pid_file = tmp_path / "grandchild"
    with pytest.raises(RankError):
        launch(start_grandchild_then_fail, 2, str(pid_file))
    pids = [int((tmp_path / f"grandchild.{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_keyboard_interrupt_leaves_nothing_behind_and_next_launch_works():
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(sleep_on_rank_1, 2, timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not child_pids()
    assert [r["rank"] for r in launch(rank_and_sum, 2, 0)] == [0, 1]


def test_two_launches_at_once_do_not_collide():
    code = (
        "from tests.test_launcher import rank_and_sum; from labs import launch; "
        "print(sum(r['sum'] for r in launch(rank_and_sum, 2, 0)))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["2.0", "2.0"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fn=rank_and_sum, nprocs=0), "nprocs must be an integer >= 1"),
        (dict(fn=rank_and_sum, nprocs=2.5), "nprocs must be an integer >= 1"),
        (dict(fn="not a function", nprocs=2), "fn must be callable"),
        (dict(fn=rank_and_sum, nprocs=2, backend="mpi"), "backend='mpi' is not one of"),
        (dict(fn=rank_and_sum, nprocs=2, timeout=0), "timeout must be a positive"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    fn = kwargs.pop("fn")
    nprocs = kwargs.pop("nprocs")
    with pytest.raises(ValueError, match=message):
        launch(fn, nprocs, **kwargs)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the error on a machine without enough GPUs"
)
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        choose_backend(2, "nccl")


@pytest.mark.parametrize(
    "gpus, fix", [(0, "use backend='gloo' or 'auto'"), (1, "use nprocs<=1 or backend='gloo'")]
)
def test_nccl_error_suggests_only_values_that_work(monkeypatch, gpus, fix):
    """With no GPU, fewer ranks cannot help: the error must not say "use nprocs<=0"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ValueError, match="needs one GPU per rank") as error:
        choose_backend(2, "nccl")
    assert fix in str(error.value) and "nprocs<=0" not in str(error.value)


def test_the_start_method_is_forced_by_argument_then_environment(monkeypatch):
    from labs.runtime.launcher import START_METHOD_ENV, choose_start_method

    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert choose_start_method() == "fork"  # Linux, CUDA not initialised
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert choose_start_method() == "spawn"
    assert choose_start_method("fork") == "fork"  # the argument wins
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="LABS_START_METHOD='forkserver' is not one of"):
        launch(rank_and_sum, 2, 0)
    with pytest.raises(ValueError, match="start_method must be 'fork' or 'spawn'"):
        launch(rank_and_sum, 2, 0, start_method="thread")


def test_native_windows_gets_a_clear_message(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(RuntimeError, match="does not run on native Windows.*Use WSL2"):
        launch(rank_and_sum, 2, 0)


def test_a_rank_finds_its_gpu_from_local_rank_not_its_global_rank(monkeypatch):
    """On the second node of a job, rank 5 is LOCAL_RANK 1: its GPU is cuda:1. The one helper
    that reads LOCAL_RANK, and what a gloo rank binds its process group to (nothing)."""
    from labs.runtime.device import local_rank
    from labs.runtime.rank import _bind_device

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_rank() == 1
    monkeypatch.delenv("LOCAL_RANK")
    assert local_rank() == 0
    threads = torch.get_num_threads()
    try:
        assert _bind_device("gloo") is None and torch.get_num_threads() == 1
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_num_threads(threads)


def exercise_raises_on_rank_1():
    import torch

    from labs.runtime import exercise

    tensor = torch.ones(4) if dist.get_rank() == 0 else None  # rank 1 passes nothing
    exercise("collectives").ring_all_reduce(tensor)


def test_a_rank_error_shows_the_learners_frames_and_names_the_exercise_line():
    with pytest.raises(RankError) as info:
        launch(exercise_raises_on_rank_1, 2)
    err = info.value
    assert re.fullmatch(r"(labs|solutions)/collectives\.py:\d+", err.location), err.location
    assert str(err).startswith(f"rank 1 raised AttributeError in {err.location}: ")
    assert "exercise_raises_on_rank_1" in err.rank_traceback  # the caller's frame
    assert "ring_all_reduce" in err.rank_traceback  # the exercise's frame
    assert "labs/runtime" not in err.rank_traceback  # the launcher's frames are left out


def test_the_parent_sees_no_frame_of_the_launcher_below_launch():
    import traceback

    import labs.runtime.launcher as launcher

    with pytest.raises(RankError) as info:
        launch(raise_on_rank_2, 3)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "launch" and frames[-1].filename == launcher.__file__
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # IPython hides a frame that sets __tracebackhide__ unless it is the last one
    for function in (launcher.launch, launcher._run_ranks, launcher._collect):
        assert "__tracebackhide__" in function.__code__.co_varnames, function.__name__


def frozen_objects():
    import gc

    return gc.get_freeze_count()


@pytest.mark.skipif(
    sys.platform != "linux" or os.environ.get("LABS_START_METHOD") == "spawn",
    reason="ranks are spawned here, not forked",
)
def test_a_forked_rank_freezes_what_it_inherits():
    """A forked rank's garbage collections leave the objects it inherited alone (``gc.freeze``):
    visiting them would write to, and so copy, the parent's memory page by page, ~1 CPU-second a
    rank from a grown pytest worker or notebook kernel."""
    import gc

    inherited = len(gc.get_objects())
    assert all(count > 0.9 * inherited for count in launch(frozen_objects, 2, timeout=60))


def thread_priorities() -> list[tuple[str, int]]:
    """(name, nice) of each thread of this process."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat
        with open(f"/proc/self/task/{tid}/comm") as f:
            found.append((f.read().strip(), nice))
    return sorted(found)


def priorities_before_and_after_a_new_group():
    from labs.runtime.rank import lower_gloo_loop_priority

    before = thread_priorities()  # the launcher's process group only
    dist.new_group(list(range(dist.get_world_size())))
    lowered = lower_gloo_loop_priority()
    return before, lowered, thread_priorities()


@pytest.mark.skipif(sys.platform != "linux", reason="threads are read from /proc")
def test_gloo_loop_threads_run_at_the_lowest_priority_and_the_rest_at_normal():
    """gloo's event-loop threads spin while a peer's message waits for its buffer; at nice 19
    they leave the core to the threads that post it (``lower_gloo_loop_priority``): the launch's
    process group's at once, a new group's when asked again; no other thread."""
    normal = os.getpriority(os.PRIO_PROCESS, 0)  # what the ranks inherit (0 unless run under nice)
    if normal == 19:
        pytest.skip("the suite itself runs at nice 19: nothing to lower")

    def split(threads):
        loops = [nice for name, nice in threads if name.startswith("gloo_tcp_loop")]
        return loops, {nice for name, nice in threads if not name.startswith("gloo_tcp_loop")}

    for before, lowered, after in launch(
        priorities_before_and_after_a_new_group, 2, backend="gloo", timeout=60
    ):
        assert split(before) == ([19], {normal}), before
        assert split(after) == ([19, 19], {normal}), after
        assert lowered == 2
