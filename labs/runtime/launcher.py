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
  ``import torch`` per rank). Functions defined in a notebook work. Otherwise ranks
  are *spawned*, and ``fn`` must be importable (defined in a ``.py`` module);
* rendezvous: through a ``FileStore`` in a fresh temporary folder, so two launches
  at once never collide and no port is hard-coded (gloo and NCCL then connect on
  ports the OS picks). A ``TCPStore`` hosted here failed about one launch in ten
  between forked ranks on our 2-core test machine; the file store never did;
* failure: a rank that raises makes ``launch`` raise :class:`RankError` with that
  rank's traceback (its own frames: this package's are left out, and an exercise that raised is
  named by file and line, ``labs/ddp.py:57``), raised from ``launch`` itself: in the parent too
  the launcher's inner frames are left out (and IPython hides ``launch``'s frame unless it is
  the last, ``__tracebackhide__``); a rank killed by a signal is named with the signal; a run that
  exceeds ``timeout`` raises :class:`LaunchTimeout` naming the ranks still running.
  In every case (KeyboardInterrupt included) all ranks and their children are
  killed before ``launch`` returns, so the next launch works.

Under ``torchrun`` (RANK/WORLD_SIZE in the environment) ``launch`` does not start
anything: this process *is* one rank, so it joins the job, runs ``fn`` and returns
every rank's result, gathered. The same lab code runs on a laptop, on a GPU box
and across nodes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist

from labs.runtime import audit

# choose_backend lives with the device choice; its name stays importable from here. (The device
# module also asks torch to count GPUs through NVML, so that this process never initialises CUDA.)
from labs.runtime.device import BACKENDS, choose_backend, exact_fp32, local_rank
from labs.runtime.errors import (
    LaunchTimeout,
    RankDied,
    RankError,
    raise_failure,
    rank_traceback,
    read_stderr,
)

__all__ = [
    "BACKENDS",
    "RankResults",
    "choose_backend",
    "launch",
    "report_progress",
    "under_torchrun",
]
# The channel to the parent, set in each launched rank (None under torchrun).
_parent_conn = None
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
    whole run and every collective inside it. ``start_method`` forces "fork" or "spawn".
    ``progress=N`` draws a progress bar of N ticks in this process; ranks tick it with
    :func:`report_progress`. ``env`` sets environment variables in the ranks before the
    process group starts (e.g. ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``).

    What a rank writes to stderr (Python warnings, torch's C++ logs) is captured: it is
    replayed here, prefixed with the rank, when the run ends, and the failing rank's last
    lines are part of the error.
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
    # The device audit (tests): ranks that would run NCCL on a GPU box, so not a forced gloo.
    audit_label = audit.lab_label(fn) if audit.requested() and backend != "gloo" else None
    backend = choose_backend(nprocs, backend)
    method = start_method or _default_start_method()
    if method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
    if method == "fork" and backend == "nccl" and torch.cuda.is_initialized():
        raise ValueError(
            "cannot fork NCCL ranks after CUDA was initialised in this process; "
            "use start_method='spawn' (fn must then live in a .py module) or restart the kernel"
        )
    if method == "spawn":
        _check_picklable(fn)
    try:
        return _run_ranks(
            fn, nprocs, args, backend, timeout, method, progress, desc, dict(env or {}), audit_label
        )
    except (RankError, RankDied, LaunchTimeout) as failure:
        # Raised afresh from here: the launcher's frames below this one tell the learner nothing
        # (the rank's own traceback is in the message).
        raise failure.with_traceback(None) from None


def report_progress(n: int = 1) -> None:
    """Tick the parent's progress bar by ``n``. Call it on rank 0 only; a no-op elsewhere."""
    if _parent_conn is not None and dist.is_initialized() and dist.get_rank() == 0:
        _parent_conn.send_bytes(pickle.dumps(("progress", n)))


def _default_start_method() -> str:
    if sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _check_picklable(fn) -> None:
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(
        fn, "__qualname__", ""
    ):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)} is defined in a notebook or inside a function, so"
            " spawned ranks cannot import it. Move it into a .py module (e.g. next to the notebook)"
            " and import it, or use start_method='fork' (Linux, CUDA not yet initialised)."
        )


def _run_ranks(
    fn, nprocs, args, backend, timeout, method, progress, desc, env, audit_label
) -> RankResults:
    __tracebackhide__ = True
    if method == "fork":
        # Building any torch optimizer imports torch._dynamo: ~1 s, several seconds on a busy
        # 2-core machine. Imported once here, every forked rank inherits it instead of paying it.
        importlib.import_module("torch._dynamo")
    ctx = mp.get_context(method)
    procs = []
    conns = []
    bar = _progress_bar(progress, desc)
    # Rendezvous through a file in a fresh folder: nothing to collide with, no port to pick.
    with tempfile.TemporaryDirectory(prefix="labs-launch-") as folder:
        stderr_paths = [os.path.join(folder, f"rank{r}.stderr") for r in range(nprocs)]
        succeeded = False
        try:
            for rank in range(nprocs):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_rank_main,
                    name=f"rank{rank}",
                    args=(
                        fn,
                        args,
                        rank,
                        nprocs,
                        os.path.join(folder, "store"),
                        backend,
                        timeout,
                        child_end,
                        conns + [parent_end],
                        stderr_paths[rank],
                        env,
                        audit_label,
                    ),
                )
                p.start()
                child_end.close()  # the child holds the only other end: EOF tells us it is gone
                procs.append(p)
                conns.append(parent_end)
            results = _collect(procs, conns, timeout, bar, stderr_paths)
            succeeded = True
            return results
        finally:
            for c in conns:
                c.close()  # EOF tells every rank to exit
            _kill_all(procs, grace=2.0 if succeeded else 0.0)
            if bar is not None:
                bar.close()
            _replay_stderr(stderr_paths)


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


def _collect(procs, conns, timeout, bar, stderr_paths) -> RankResults:
    """Wait for every rank's result; raise on the first failure or on timeout."""
    __tracebackhide__ = True
    n = len(procs)
    results = [None] * n
    backends = [None] * n
    errors = {}
    deaths = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(done) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            unfinished = [r for r in range(n) if r not in done]
            raise LaunchTimeout(timeout, unfinished, sorted(done))
        waiting = {conns[r]: r for r in range(n) if r not in done}
        for conn in connection.wait(list(waiting), timeout=min(left, 0.5)):
            rank = waiting[conn]
            try:
                kind, *payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the rank's end closed without a result
                procs[rank].join(timeout=2)
                deaths[rank] = procs[rank].exitcode
                done.add(rank)
                continue
            if kind == "progress":
                if bar is not None:
                    bar.update(payload[0])
            elif kind == "ok":
                results[rank] = payload[0]
                backends[rank] = payload[1]
                done.add(rank)
            else:
                errors[rank] = payload
                done.add(rank)
        if errors or deaths:
            # The others are most likely blocked in a collective with the failed rank:
            # give simultaneous failures a moment to arrive, then report the lowest rank.
            _drain(conns, done, errors, deaths, procs, grace=0.3)
            returned = [r for r in range(n) if r in done and r not in errors and r not in deaths]
            raise_failure(errors, deaths, returned, stderr_paths)
    return RankResults(results, backend=backends[0])


def _drain(conns, done, errors, deaths, procs, grace):
    end = time.monotonic() + grace
    while time.monotonic() < end:
        waiting = {conns[r]: r for r in range(len(conns)) if r not in done}
        if not waiting:
            return
        for conn in connection.wait(list(waiting), timeout=max(0.0, end - time.monotonic())):
            rank = waiting[conn]
            try:
                kind, *payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                deaths[rank] = procs[rank].exitcode
                done.add(rank)
                continue
            if kind == "error":
                errors[rank] = payload
                done.add(rank)


def _kill_all(procs, grace: float) -> None:
    """Stop every rank and anything it started (each rank leads its own process group)."""
    deadline = time.monotonic() + grace
    for p in procs:  # after a success, ranks exit by themselves once their pipe closes
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank, if still alive, and its children
        except (ProcessLookupError, PermissionError):
            pass
        p.join(timeout=5)


def _progress_bar(total, desc):
    if not total:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=True)


def _rank_main(
    fn,
    args,
    rank,
    world_size,
    store_path,
    backend,
    timeout,
    conn,
    parent_ends,
    stderr_path,
    env,
    audit_label,
):
    """Entry point of one launched rank (under the device audit when ``audit_label`` is set)."""
    global _parent_conn
    os.setpgid(0, 0)  # own process group: the parent can kill us and our children together
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Forked copies of the parent's pipe ends would hide the EOF we wait for.
    for end in parent_ends:
        end.close()
    _parent_conn = conn
    stderr_file = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stderr.flush()
    os.dup2(stderr_file, 2)  # C++ logs and Python warnings: captured for the parent to show
    if getattr(sys.stderr, "fileno", None) is None or _not_fd2(sys.stderr):
        # e.g. a Jupyter stream: write to fd 2 too
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    if faulthandler.is_enabled():  # a crash's Python stack goes to the captured stderr too
        faulthandler.enable(file=sys.stderr)
    os.environ.update(env)
    if "TORCH_DISTRIBUTED_DEBUG" in env:
        # read once at import, and this process imported torch before fork
        dist.set_debug_level_from_env()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        with audit.audited(audit_label, rank) if audit_label else contextlib.nullcontext():
            _init_rank(rank, world_size, backend, timeout, store_path)
            used = dist.get_backend()  # read now: fn may destroy the process group
            result = fn(*args)
        message = ("ok", _to_cpu(result), used)
    except BaseException as e:  # SystemExit and KeyboardInterrupt are failures too
        # the learner's frames and torch's; this launcher's are left out
        tb, location = rank_traceback(e)
        message = ("error", type(e).__name__, str(e), tb, location)
    try:
        payload = pickle.dumps(message)
    except Exception as e:  # an unpicklable result is the rank's error, not a mystery
        payload = pickle.dumps(
            ("error", "TypeError", f"rank result cannot be pickled: {e}", traceback.format_exc())
        )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.send_bytes(payload)
        # Stay until the parent has every rank's result (it then closes the pipe). A rank
        # that exited as soon as its own last collective returned could close its sockets
        # while a peer is still reading, and the peer would fail with "connection reset".
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(0)  # skip the parent's atexit handlers (a forked Jupyter kernel has plenty)


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


def _init_rank(rank, world_size, backend, timeout, store_path):
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=_bind_device(backend),
    )


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
            device = _bind_device(backend)
            store, rank, world_size = next(dist.rendezvous("env://"))
            # Each launch of this job meets under a fresh prefix: the previous launch's group
            # left its keys in torchrun's store, and a rank reading those would connect to a
            # socket that is closed ("Connection refused"), one launch in a few.
            store = dist.PrefixStore(f"labs-launch-{next(_torchrun_launches)}", store)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
                device_id=device,
            )
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
