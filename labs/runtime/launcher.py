"""Start N ranks, run one function on each, bring the results (or the failure) home.

    results = launch(fn, 4, *args)        # -> [fn(*args) on rank 0, ..., on rank 3]
    results.backend                       # -> "gloo" or "nccl": what the ranks' process group ran

Every lab in the course runs through this one function, from a notebook, from
``python -m labs.run`` and from the tests. It does the plumbing so the labs can be
about the parallelism:

* backend: NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU
  with ``torch.set_num_threads(1)`` per rank (so 4 ranks do not fight over 2 cores);
* start: on Linux, with CUDA not initialised in this process, ranks are *forked*
  from the already-imported interpreter (~0.1 s for 4 ranks instead of ~9 s of
  ``import torch`` per rank). Otherwise (macOS, a notebook that initialised CUDA) ranks are
  *spawned*: ``fn`` and ``args`` travel by value (cloudpickle), so a function defined in a
  notebook cell works there too, and the rank processes stay warm between launches
  (``labs.runtime.pool``: the second launch of 4 ranks starts in well under a second).
  ``LABS_START_METHOD=spawn|fork`` in the environment forces one (``start_method=`` wins over
  it). Native Windows is not supported (it has no process groups to stop a rank with its
  children): ``launch`` says so and points to WSL2;
* rendezvous: through a ``FileStore`` in a fresh temporary folder, so two launches
  at once never collide and no port is hard-coded (gloo and NCCL then connect on
  ports the OS picks). A ``TCPStore`` hosted here failed about one launch in ten
  between forked ranks on our 2-core test machine; the file store never did;
* results: each rank sends its return value home in ``torch.save``'s format, and this process
  reads it with torch's restricted unpickler (``labs.runtime.wire``): plain data and tensors come
  back; anything whose unpickling would run code is refused, and nothing a rank sends ever runs
  here (a grader's verdict is computed in this process);
* failure: a rank that raises makes ``launch`` raise :class:`RankError` with that
  rank's traceback (its own frames: this package's are left out, and an exercise that raised is
  named by file and line, ``labs/ddp.py:57``), raised from ``launch`` itself: in the parent too
  the launcher's inner frames are left out (and IPython hides ``launch``'s frame unless it is
  the last, ``__tracebackhide__``); a rank killed by a signal is named with the signal; a run that
  exceeds ``timeout`` raises :class:`LaunchTimeout` naming the ranks still running.
  In every case (KeyboardInterrupt included) all ranks and their children are
  killed before ``launch`` returns (a warm spawned worker that finished cleanly is kept), so the
  next launch works.

Under ``torchrun`` (RANK/WORLD_SIZE in the environment) ``launch`` does not start
anything: this process *is* one rank, so it joins the job, runs ``fn`` and returns
every rank's result, gathered. The same lab code runs on a laptop, on a GPU box
and across nodes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing import connection

import torch
import torch.distributed as dist

from labs.runtime import audit, pool, wire
from labs.runtime.audit import lab_label

# choose_backend lives with the device choice; its name stays importable from here. (The device
# module also asks torch to count GPUs through NVML, so that this process never initialises CUDA.)
from labs.runtime.device import BACKENDS, choose_backend, local_rank
from labs.runtime.errors import (
    LaunchTimeout,
    RankDied,
    RankError,
    raise_failure,
    read_stderr,
    refused_message,
)
from labs.runtime.proc import kill_process_group
from labs.runtime.rank import RankJob, _to_cpu, join_group, report_progress, run_rank

__all__ = [
    "BACKENDS",
    "START_METHODS",
    "START_METHOD_ENV",
    "RankResults",
    "choose_backend",
    "launch",
    "choose_start_method",
    "report_progress",
    "under_torchrun",
]
START_METHOD_ENV = "LABS_START_METHOD"  # "fork" or "spawn": forces how ranks start
START_METHODS = ("fork", "spawn")
# Launches so far in this torchrun worker (all its ranks launch the same sequence).
_torchrun_launches = itertools.count()


class RankResults(list):
    """What ``launch`` returns: every rank's return value, in rank order (a list), and in
    ``backend`` the backend the ranks' process group actually ran ("gloo" or "nccl"), as rank 0's
    ``dist.get_backend()`` read it while its process group was up."""

    def __init__(self, results, backend: str):
        super().__init__(results)
        self.backend = backend


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_start_method(requested: str | None = None) -> str:
    """How a launch from this process starts its ranks: ``requested`` (``launch``'s
    ``start_method=``) if given, else ``LABS_START_METHOD`` from the environment, else "fork" on
    Linux with CUDA not initialised here and "spawn" everywhere else."""
    if requested is not None:
        if requested not in START_METHODS:
            raise ValueError(f"start_method must be 'fork' or 'spawn', got {requested!r}")
        return requested
    forced = os.environ.get(START_METHOD_ENV, "")
    if forced:
        if forced not in START_METHODS:
            raise ValueError(
                f"{START_METHOD_ENV}={forced!r} is not one of {START_METHODS}; unset it to let"
                " the launcher choose (fork on Linux, spawn elsewhere)"
            )
        return forced
    if sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def launch(
    fn: Callable[..., object],
    nprocs: int,
    *args,
    backend: str = "auto",
    timeout: float = 120.0,
    start_method: str | None = None,
    progress: int | None = None,
    desc: str = "steps",
    env: dict[str, str] | None = None,
) -> RankResults:
    """Run ``fn(*args)`` on ``nprocs`` ranks with the default process group initialised.

    Returns the per-rank return values in rank order, a :class:`RankResults` whose ``backend``
    says which backend the ranks used. ``timeout`` (seconds) bounds the
    whole run and every collective inside it. ``start_method`` forces "fork" or "spawn" (else
    ``LABS_START_METHOD``, else the platform's choice: see :func:`choose_start_method`).
    ``progress=N`` draws a progress bar of N ticks in this process; ranks tick it with
    :func:`report_progress`. ``env`` sets environment variables in the ranks before the
    process group starts (e.g. ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``).

    What a rank writes to stderr (Python warnings, torch's C++ logs) is captured: it is
    replayed here, prefixed with the rank, when the run ends, and the failing rank's last
    lines are part of the error. What a rank returns comes back as plain data (numbers,
    strings, containers, tensors): see ``labs.runtime.wire``.
    """
    __tracebackhide__ = True  # IPython shows the rank's error, not the launcher's frames
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if under_torchrun():
        return _join_torchrun_job(fn, nprocs, args, backend, timeout)
    _check_platform()
    method = choose_start_method(start_method)
    # The device audit (tests): ranks that would run NCCL on a GPU box, so not a forced gloo.
    audit_label = lab_label(fn) if audit.requested() and backend != "gloo" else None
    backend = choose_backend(nprocs, backend)
    if method == "fork" and backend == "nccl" and torch.cuda.is_initialized():
        raise ValueError(
            "cannot fork NCCL ranks after CUDA was initialised in this process; "
            "use start_method='spawn' (or LABS_START_METHOD=spawn) or restart the kernel"
        )
    try:
        return _run_ranks(
            fn, nprocs, args, backend, timeout, method, progress, desc, dict(env or {}), audit_label
        )
    except (RankError, RankDied, LaunchTimeout) as failure:
        # Raised afresh from here: the launcher's frames below this one tell the learner nothing
        # (the rank's own traceback is in the message).
        raise failure.with_traceback(None) from None


def _check_platform() -> None:
    if sys.platform == "win32":
        raise RuntimeError(
            "labs.launch does not run on native Windows: it starts each rank as a POSIX process"
            " group (os.setpgid, os.killpg) so that a failed or interrupted launch can stop a rank"
            " with everything it started. Use WSL2 (Ubuntu) and run the course there: it works"
            " as on Linux. (The calculators and widgets, labs.theory and labs.widgets, start no"
            " ranks.)"
        )


def _by_value(fn, args) -> bytes:
    """``fn`` and ``args`` pickled for spawned ranks with cloudpickle: by value what the ranks
    could not import (a function defined in a notebook cell or inside a function, a lambda), by
    reference what they can (a function in a ``.py`` module)."""
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args))
    except Exception as e:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ValueError(
            f"spawned ranks receive {name} and its arguments by value (cloudpickle), and these"
            f" cannot be pickled: {e}. A function defined in a notebook takes along every global"
            " it uses: make unpicklable things (widgets, open files, locks, generators) inside the"
            " function, or pass plain data as arguments."
        ) from None


def _run_ranks(
    fn, nprocs, args, backend, timeout, method, progress, desc, env, audit_label
) -> RankResults:
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout
    # Rendezvous through a file in a fresh folder: nothing to collide with, no port to pick.
    with tempfile.TemporaryDirectory(prefix="labs-launch-") as folder:
        jobs = [
            RankJob(
                fn=fn,
                args=args,
                rank=rank,
                world_size=nprocs,
                store_path=os.path.join(folder, "store"),
                backend=backend,
                timeout=timeout,
                stderr_path=os.path.join(folder, f"rank{rank}.stderr"),
                env=env,
                audit_label=audit_label,
            )
            for rank in range(nprocs)
        ]
        stderr_paths = [job.stderr_path for job in jobs]
        started = _forked_ranks(jobs) if method == "fork" else _spawned_ranks(jobs, deadline)
        bar = _progress_bar(progress, desc)
        try:
            with started as ranks:
                return _collect(ranks, deadline, timeout, bar, lab_label(fn), stderr_paths)
        finally:
            if bar is not None:
                bar.close()
            _replay_stderr(stderr_paths)


@contextlib.contextmanager
def _forked_ranks(jobs: list[RankJob]) -> Iterator[list[_ForkedRank]]:
    """Fork one process per job; on the way out close every pipe (EOF tells a rank to exit) and
    kill what is left, each rank with its children (a rank leads its own process group)."""
    # Building any torch optimizer imports torch._dynamo: ~1 s, several seconds on a busy
    # 2-core machine. Imported once here, every forked rank inherits it instead of paying it.
    importlib.import_module("torch._dynamo")
    if jobs[0].audit_label is not None:
        audit.mark_host_tensors()  # here, once: the ranks inherit the marks (see there)
    ctx = mp.get_context("fork")
    ranks: list[_ForkedRank] = []
    grace = 0.0
    try:
        for job in jobs:
            parent_end, child_end = ctx.Pipe(duplex=True)
            others = [r.conn for r in ranks] + [parent_end]
            process = ctx.Process(
                target=_forked_rank_main, name=f"rank{job.rank}", args=(job, child_end, others)
            )
            process.start()
            child_end.close()  # the child holds the only other end: EOF tells us it is gone
            ranks.append(_ForkedRank(process, parent_end))
        yield ranks
        grace = 2.0  # after a success, ranks exit by themselves once their pipe closes
    finally:
        for rank in ranks:
            rank.conn.close()
        _kill_all(ranks, grace)


@contextlib.contextmanager
def _spawned_ranks(jobs: list[RankJob], deadline: float) -> Iterator[list[pool.Worker]]:
    """Hand each job to a warm spawned worker (``labs.runtime.pool``); on the way out, the pool
    keeps the workers that finished cleanly and replaces the others."""
    call = _by_value(jobs[0].fn, jobs[0].args)
    workers = pool.worker_pool().start(jobs, call, deadline)
    outcome = "interrupted"  # Ctrl-C, or anything unexpected: no worker is kept
    try:
        yield workers
        outcome = "ok"
    except (RankError, RankDied, LaunchTimeout):
        outcome = "failed"
        raise
    finally:
        pool.worker_pool().finish(workers, outcome)


class _ForkedRank:
    """One forked rank, as the parent sees it: its process and the parent's end of its pipe."""

    def __init__(self, process: mp.Process, conn: connection.Connection):
        self.process = process
        self.conn = conn
        self.reported = False  # its result or its error arrived

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it has exited (negative: the signal), None while it runs."""
        self.process.join(timeout=timeout)
        return self.process.exitcode


def _replay_stderr(paths) -> None:
    """Show what each rank wrote to stderr, prefixed with its rank, on this process's stderr."""
    for rank, path in enumerate(paths):
        text = read_stderr(path)
        if text.strip():
            print(
                "\n".join(f"[rank {rank}] {line}" for line in text.splitlines()),
                file=sys.stderr,
                flush=True,
            )


class _Gathered:
    """What the ranks of one launch have sent so far."""

    def __init__(self, n: int):
        self.results: list[object] = [None] * n
        self.backends: list[str | None] = [None] * n
        self.errors: dict[int, tuple] = {}  # rank -> a RankFailure's fields
        self.deaths: dict[int, int | None] = {}  # rank -> exit code
        self.done: set[int] = set()

    def take(self, rank: int, ranks, bar, label: str) -> None:
        """Read one message from ``ranks[rank]`` and file it."""
        try:
            data = ranks[rank].conn.recv_bytes()
        except (EOFError, OSError):  # the rank's end closed without a result
            self.deaths[rank] = ranks[rank].wait(timeout=2)
            self.done.add(rank)
            return
        message = _well_formed(wire.decode(data, label))
        kind = message[0]
        if kind == "progress":
            if bar is not None:
                bar.update(message[1])
            return
        self.done.add(rank)
        if kind == "ok":
            self.results[rank] = message[1]
            self.backends[rank] = message[2]
            ranks[rank].reported = True
        elif kind == "error":
            self.errors[rank] = message[1:]
            ranks[rank].reported = True
        else:  # refused: nothing of it was built, and the rank is not trusted again
            self.errors[rank] = refused_message(rank, message[1])

    def returned(self) -> list[int]:
        return [r for r in sorted(self.done) if r not in self.errors and r not in self.deaths]


def _well_formed(message) -> tuple:
    """``message`` if it has the shape of a rank's message, else ("refused", RefusedMessage)."""
    if isinstance(message, wire.RefusedMessage):
        return ("refused", message)
    shapes = {"progress": (int,), "ok": (object, str), "error": (str, str, str, str)}
    if (
        isinstance(message, tuple)
        and message
        and message[0] in shapes
        and len(message) == 1 + len(shapes[message[0]])
        and all(isinstance(v, t) for v, t in zip(message[1:], shapes[message[0]]))
    ):
        return message
    kind = type(message).__name__
    return (
        "refused",
        wire.RefusedMessage("", f"a {kind} that is not one of the launcher's messages"),
    )


def _collect(ranks, deadline: float, timeout: float, bar, label: str, stderr_paths) -> RankResults:
    """Wait for every rank's result; raise on the first failure or on timeout."""
    __tracebackhide__ = True
    n = len(ranks)
    got = _Gathered(n)
    while len(got.done) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            unfinished = [r for r in range(n) if r not in got.done]
            raise LaunchTimeout(timeout, unfinished, sorted(got.done))
        waiting = {ranks[r].conn: r for r in range(n) if r not in got.done}
        for conn in connection.wait(list(waiting), timeout=min(left, 0.5)):
            got.take(waiting[conn], ranks, bar, label)
        if got.errors or got.deaths:
            # The others are most likely blocked in a collective with the failed rank:
            # give simultaneous failures a moment to arrive, then report the lowest rank.
            _drain(got, ranks, bar, label, grace=0.3)
            raise_failure(got.errors, got.deaths, got.returned(), stderr_paths)
    return RankResults(got.results, backend=got.backends[0])


def _drain(got: _Gathered, ranks, bar, label: str, grace: float) -> None:
    end = time.monotonic() + grace
    while time.monotonic() < end:
        waiting = {ranks[r].conn: r for r in range(len(ranks)) if r not in got.done}
        if not waiting:
            return
        for conn in connection.wait(list(waiting), timeout=max(0.0, end - time.monotonic())):
            got.take(waiting[conn], ranks, bar, label)


def _kill_all(ranks, grace: float) -> None:
    """Stop every rank and anything it started (each rank leads its own process group)."""
    deadline = time.monotonic() + grace
    for rank in ranks:  # after a success, ranks exit by themselves once their pipe closes
        rank.wait(timeout=max(0.0, deadline - time.monotonic()))
    for rank in ranks:
        if rank.pid is not None:
            kill_process_group(rank.pid)  # the rank, if still alive, and its children
            rank.wait(timeout=5)


def _progress_bar(total, desc):
    if not total:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=True)


def _forked_rank_main(job: RankJob, conn, parent_ends) -> None:
    """Entry point of a forked rank: its own process group, then :func:`run_rank`, then exit."""
    # Every object inherited from the parent shares its memory page until someone writes to it.
    # A garbage collection writes to each object it visits, so the rank's first full collection
    # would copy most of the parent's heap: ~1 CPU-second per rank forked from a 1 GB pytest
    # worker or notebook kernel. Frozen, the inherited objects are never visited (the rank's own
    # objects are collected as usual). 20 launches of 2 ranks from a 1 GB parent: 24 → 2
    # CPU-seconds (measured on 2 cores).
    gc.freeze()
    os.setpgid(0, 0)  # own process group: the parent can kill us and our children together
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Forked copies of the parent's pipe ends would hide the EOF we wait for.
    for end in parent_ends:
        end.close()
    run_rank(job, conn)
    os._exit(0)  # skip the parent's atexit handlers (a forked Jupyter kernel has plenty)


def _join_torchrun_job(fn, nprocs, args, backend, timeout) -> RankResults:
    world = int(os.environ["WORLD_SIZE"])
    if nprocs != world:
        raise ValueError(
            f"nprocs={nprocs} but torchrun started WORLD_SIZE={world} ranks; pass --nproc {world}"
        )
    audited = audit.requested() and backend != "gloo" and not dist.is_initialized()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    joined_here = not dist.is_initialized()
    with audit.audited(audit.lab_label(fn), local_rank()) if audited else contextlib.nullcontext():
        if joined_here:
            store, rank, world_size = next(dist.rendezvous("env://"))
            # Each launch of this job meets under a fresh prefix: the previous launch's group
            # left its keys in torchrun's store, and a rank reading those would connect to a
            # socket that is closed ("Connection refused"), one launch in a few.
            store = dist.PrefixStore(f"labs-launch-{next(_torchrun_launches)}", store)
            join_group(backend, store, rank, world_size, timeout)
        used = dist.get_backend()
        result = fn(*args)
    gathered = [None] * world
    dist.all_gather_object(gathered, _to_cpu(result))
    if joined_here:
        # Leave together and tear gloo down explicitly: a process that exits with the group still
        # up can abort in gloo's destructors ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    return RankResults(gathered, backend=used)
