"""One rank of a launch, from the inside: what a launched process does with its job.

    run_rank(job, conn)     # be rank job.rank: join the process group, run job.fn, report

The launcher (``labs.runtime.launcher``) hands each rank a :class:`RankJob`: a forked rank runs it
once and exits; a warm spawned worker (``labs.runtime.pool``) runs one after another. Either way
the rank captures its stderr for the parent, joins the launch's process group, runs the function
and sends home its result or its failure over a pipe, encoded by ``labs.runtime.wire`` (the
parent decodes plain data only). Ranks tick the parent's progress bar with
:func:`report_progress`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist

from labs.runtime import audit, wire
from labs.runtime.device import exact_fp32, local_rank
from labs.runtime.errors import rank_traceback

# The channel to the parent, set while this process runs a launched rank (None otherwise, and
# under torchrun).
_parent_conn = None


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What one rank of a launch runs, in a forked process or in a warm spawned worker."""

    fn: Callable[..., object]
    args: tuple
    rank: int
    world_size: int
    store_path: str  # the FileStore file every rank of the launch meets at
    backend: str
    timeout: float  # seconds, for every collective
    stderr_path: str  # where the rank's stderr goes, for the parent to show
    env: dict[str, str]  # set in the rank before its process group starts (launch's env=)
    audit_label: str | None  # run under the device audit, with this name, when set


def report_progress(n: int = 1) -> None:
    """Tick the parent's progress bar by ``n``. Call it on rank 0 only; a no-op elsewhere."""
    if _parent_conn is not None and dist.is_initialized() and dist.get_rank() == 0:
        _parent_conn.send_bytes(wire.encode(("progress", int(n))))


def run_rank(job: RankJob, conn: connection.Connection) -> None:
    """Be rank ``job.rank`` of a launch in this process, and report to the parent on ``conn``.

    Captures stderr into ``job.stderr_path``, sets the environment, joins the process group,
    runs ``job.fn(*job.args)`` (under the device audit when ``job.audit_label`` is set) and sends
    back its result or its failure, encoded by ``labs.runtime.wire``. Returns once the parent has
    every rank's result (it closes the pipe, or sends ``release``), with the process group still
    up: a forked rank then exits; a warm worker destroys it and resets itself."""
    global _parent_conn
    _parent_conn = conn
    _capture_stderr(job.stderr_path)
    os.environ.update(job.env)
    if "TORCH_DISTRIBUTED_DEBUG" in job.env:
        # read once at import, and this process imported torch before the job came
        dist.set_debug_level_from_env()
    os.environ.update(
        RANK=str(job.rank),
        LOCAL_RANK=str(job.rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_WORLD_SIZE=str(job.world_size),
    )
    audited = audit.audited(job.audit_label, job.rank) if job.audit_label else None
    try:
        with audited or contextlib.nullcontext():
            store = dist.FileStore(job.store_path, job.world_size)
            join_group(job.backend, store, job.rank, job.world_size, job.timeout)
            used = dist.get_backend()  # read now: fn may destroy the process group
            result = job.fn(*job.args)
        message = ("ok", _to_cpu(result), used)
    except BaseException as e:  # SystemExit and KeyboardInterrupt are failures too
        # the learner's frames and torch's; this launcher's are left out
        tb, location = rank_traceback(e)
        message = ("error", type(e).__name__, str(e), tb, location)
    try:
        payload = wire.encode(message)
    except Exception as e:  # an unpicklable result is the rank's error, not a mystery
        text = f"rank result cannot be pickled: {e}"
        payload = wire.encode(("error", "TypeError", text, traceback.format_exc(), ""))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.send_bytes(payload)
        # Stay until the parent has every rank's result. A rank that left as soon as its own
        # last collective returned could close its sockets while a peer is still reading, and
        # the peer would fail with "connection reset".
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    _parent_conn = None


def _capture_stderr(path: str) -> None:
    """Send this process's stderr (fd 2: C++ logs, Python warnings) to ``path``."""
    stderr_file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stderr.flush()
    os.dup2(stderr_file, 2)
    os.close(stderr_file)
    if getattr(sys.stderr, "fileno", None) is None or _not_fd2(sys.stderr):
        # e.g. a Jupyter stream: write to fd 2 too
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    if faulthandler.is_enabled():  # a crash's Python stack goes to the captured stderr too
        faulthandler.enable(file=sys.stderr)


def _not_fd2(stream) -> bool:
    try:
        return stream.fileno() != 2
    except (OSError, ValueError, AttributeError):
        return True


def _to_cpu(result):
    """Results travel to the parent as CPU tensors: unpickling a CUDA tensor there would
    initialise CUDA in the parent and forbid the next fork."""
    return torch.utils._pytree.tree_map(
        lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, result
    )


def join_group(backend, store, rank, world_size, timeout):
    """This rank's process group on ``store``, bound to its device (``_bind_device``)."""
    device = _bind_device(backend)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=device,
    )
    lower_gloo_loop_priority()


def lower_gloo_loop_priority() -> int:
    """Give this process's gloo event-loop threads the lowest CPU priority (nice 19); returns how
    many it found. Call it again after creating process groups: each has its own thread.

    gloo's TCP transport reads every socket of a process group on one thread, "gloo_tcp_loop". A
    message that arrives before this rank has posted the buffer it goes to stays unread, the socket
    stays readable, and the thread spins on ``epoll_wait`` until the buffer is posted, taking the
    core from the threads that would post it. With more ranks than cores, an all-reduce of 10 floats
    by 4 ranks costs ~840 ``epoll_wait`` calls per rank on one core, and 1.2 ms of CPU per rank on 2
    cores. At nice 19 the loop still runs at once on an idle core, but yields a busy one: 0.6 ms on
    2 cores, and the DDP lab's tests take 20 % less CPU time. The cost: a thread that keeps a core
    busy at normal priority in the same session slows the ranks' messages (two busy loops beside 4
    ranks: an all-reduce in 37 ms instead of 5); one in another session (another terminal; each
    grading sandbox is its own) hardly does (6 ms instead of 5), where the kernel shares the CPU
    between sessions first (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in most
    distributions).
    Linux only (``/proc/self/task``); elsewhere nothing is changed and it returns 0."""
    found = 0
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("gloo_tcp_loop"):
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)  # a thread id: this thread only
            found += 1
        except OSError:  # the thread ended while we looked
            pass
    return found


def _bind_device(backend: str) -> torch.device | None:
    """Prepare this rank for ``backend``; returns the device to bind the process group to.

    NCCL: this rank's GPU (``local_rank()``) becomes the current device, and the process group is
    bound to it (``device_id``: NCCL connects at once, and no collective has to guess the GPU).
    gloo: one intra-op thread per rank, so N ranks do not fight over the cores. Both: TF32 off,
    since the labs compare fp32 results with a reference to 1e-5 (``exact_fp32``)."""
    exact_fp32()
    if backend == "nccl":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(1)
    return None
