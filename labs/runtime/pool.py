"""Warm rank processes for the spawn path: torch is imported once per process, not once per launch.

    workers = worker_pool().start(jobs, call, deadline)   # one ready worker per rank, job sent
    ...                                                 # launch() collects from workers[r].conn
    worker_pool().finish(workers, "ok")                  # clean workers wait for the next launch

Where ranks cannot be forked (macOS, a notebook that initialised CUDA, or
``LABS_START_METHOD=spawn``), each rank is a new interpreter, and ``import torch`` costs about
2.5 CPU-seconds: 4 ranks take ~10 s on 2 cores, at every launch. So the processes outlive a
launch. A worker is a ``python`` started here (``subprocess``, in its own process group) that
imports torch and the launcher, says "ready", and then runs one rank of one launch at a time
(``labs.runtime.rank.run_rank``) for as long as it stays clean.

**Reuse with a reset, not spare fresh processes.** A spare process per rank per launch would
start every rank pristine, but it costs the same 2.5 CPU-seconds per rank per launch, only
moved to the background: on 2 cores, a notebook's back-to-back launches would wait for the
spares or compete with them. A worker that ran a launch is instead reset to how it started:

* before each launch: the exercise modules (``labs.<exercise>``), the reference (``solutions``)
  and every module from a file outside the installed packages and outside ``labs/`` (a
  learner's own ``.py`` next to the notebook, a test file) are forgotten, so the launch imports
  them afresh from disk (an edited exercise is seen at once); this process's environment,
  working directory and ``sys.path`` are copied in; the random generators (torch, Python,
  numpy) are put back to the state they had when the worker started;
* after: the process group (and any subgroup) is destroyed; the environment, the working
  directory, ``sys.path``, warnings filters, stdout and stderr and the process-wide torch
  settings in ``_TORCH_SETTINGS`` are put back; processes the launch left in the worker's
  process group are killed; CUDA's cache and peak-memory counters are reset.

A worker that cannot be made clean is never reused: it is killed (with its process group) and
replaced by a fresh one started at once, to be warm by the next launch. That is every worker
still running when its launch ended (hung, timed out, blocked in a collective with a failed
peer, interrupted by Ctrl-C), one that died or sent something the parent refused, one that left
a thread running or did not reset within ``RESET_TIMEOUT``, and every worker of a launch given
``env=`` (torch reads some variables once per process and keeps process-wide state from them:
the flight recorder's ring buffer). Workers started for a launch get its environment, and serve
a later launch only when its variables that torch and its libraries read once at start
(``READ_ONCE``) are the same.

Workers die with this process: an idle one reads EOF on its pipe, a busy one notices within a
second that its parent changed (``_die_with_parent``), and an ``atexit`` handler kills them all.
What a worker sends home is decoded by ``labs.runtime.wire``, never unpickled. The reset undoes
what a launch may change by accident, not what code set on tampering with the worker does (it
could patch the launcher itself): where launches must not trust each other, fork them, each
from this process.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import linecache
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from labs.runtime import isolation, wire
from labs.runtime.errors import LaunchTimeout, RankDied
from labs.runtime.impl import EXERCISES
from labs.runtime.proc import group_members, kill_process_group
from labs.runtime.rank import RankJob, run_rank

RESET_TIMEOUT = 5.0  # seconds a worker gets to reset after a launch before it is replaced
# Environment variables read once per process (by NCCL, CUDA, OpenMP and the BLAS libraries,
# gloo, torch's flight recorder and C++ logging, Python's hash seed): a worker serves a launch only
# when these are as it started with. (Not every TORCH* variable: torch sets some itself, such as
# TORCHINDUCTOR_CACHE_DIR, and reads most of them when used.)
READ_ONCE = (
    "NCCL_",
    "TORCH_NCCL_",
    "TORCH_FR_",
    "TORCH_CPP_LOG_LEVEL",
    "CUDA_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "GLOO_",
    "PYTHONHASHSEED",
)
_LABS_DIR = Path(__file__).resolve().parent.parent
_INSTALLED = tuple(
    {str(Path(p).resolve()) for p in (*sysconfig.get_paths().values(), sys.prefix, sys.base_prefix)}
)
# What a worker runs: ``python -c _BOOT <fd of its pipe> <the folder labs imports from>``.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[2]); "
    "from labs.runtime.pool import worker_main; worker_main(int(sys.argv[1]))"
)


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _backend_flags() -> tuple[bool, bool, bool, bool]:
    cudnn = torch.backends.cudnn
    return (
        torch.backends.cuda.matmul.allow_tf32,
        cudnn.allow_tf32,
        cudnn.deterministic,
        cudnn.benchmark,
    )


def _set_backend_flags(flags: tuple[bool, bool, bool, bool]) -> None:
    cudnn = torch.backends.cudnn
    (
        torch.backends.cuda.matmul.allow_tf32,
        cudnn.allow_tf32,
        cudnn.deterministic,
        cudnn.benchmark,
    ) = flags


# Process-wide torch settings a launch may change, as (read, write): each is read when a worker
# starts and written back after every launch, so that the next launch starts as a fresh process.
_TORCH_SETTINGS = (
    (torch.get_num_threads, torch.set_num_threads),
    (torch.get_default_dtype, torch.set_default_dtype),
    # "cpu" is the default already: setting it would install a TorchFunctionMode for nothing
    (torch.get_default_device, lambda d: torch.set_default_device(None if d.type == "cpu" else d)),
    (torch.is_grad_enabled, torch.set_grad_enabled),
    (torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (_deterministic, lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    (_backend_flags, _set_backend_flags),
)
# Signal handlers a launch may install, put back after it (SIGINT stays ignored: Ctrl-C is the
# parent's to handle).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)


def read_once(environ: dict[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a process reads once at start (``READ_ONCE``)."""
    return {k: v for k, v in environ.items() if k.startswith(READ_ONCE)}


# --- the parent's side ----------------------------------------------------------------------
class Worker:
    """A warm rank process as the parent sees it: the process, the parent's end of its pipe."""

    def __init__(self, environ: dict[str, str], retire: bool = False):
        parent_end, child_end = mp.Pipe(duplex=True)
        root = str(_LABS_DIR.parent)  # where ``labs`` imports from
        self.process = subprocess.Popen(
            [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _BOOT]
            + [str(child_end.fileno()), root],
            env=environ,
            pass_fds=[child_end.fileno()],
            stdin=subprocess.DEVNULL,
            process_group=0,  # its own process group: killed with whatever it starts
        )
        child_end.close()
        self.conn = parent_end
        self.read_once = read_once(environ)
        self.variables = frozenset(environ)  # the names in its environment from the start
        self.retire = retire  # killed after its launch instead of kept (a launch with env=)
        self.ready = False  # said "ready": started, or reset after a launch
        self.reported = False  # its rank's result or error arrived in the current launch

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it has exited (negative: the signal), None while it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        return self.process.returncode

    def kill(self) -> None:
        """Kill the worker and everything in its process group; wait for it."""
        if self.process.returncode is None:
            kill_process_group(self.pid)
            self.wait(timeout=5)
        self.conn.close()

    def await_message(self, deadline: float) -> object:
        """The next message it sends (decoded by ``wire``), None if none comes by ``deadline``
        or it is gone."""
        left = deadline - time.monotonic()
        if left <= 0 or not self.conn.poll(left):
            return None
        try:
            return wire.decode(self.conn.recv_bytes(), "worker")
        except (EOFError, OSError):
            return None


@dataclass
class LaunchStart:
    """How one spawned launch started: ``ranks``, how many ran on ``warm`` workers (ready
    before the launch), and ``seconds`` from asking for workers to every job sent."""

    ranks: int
    warm: int
    seconds: float


@dataclass
class WorkerPool:
    """This process's warm workers. ``keep``: how many to keep, the most ranks one launch used."""

    idle: list[Worker] = field(default_factory=list)
    keep: int = 0
    history: list[LaunchStart] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # why each replaced worker was not kept

    def start(self, jobs, call: bytes, deadline: float) -> list[Worker]:
        """One worker per job, each sent its job: warm ones that match the launch first, then
        new ones (waited for until ``deadline``). ``call`` is the launched function and its
        arguments, pickled (cloudpickle)."""
        t0 = time.monotonic()
        n = len(jobs)
        env = jobs[0].env
        environ = {**isolation.rank_environment(os.environ), **env}
        self.keep = max(self.keep, n)
        self._retire_unusable()
        workers = [] if env else sorted(self.idle, key=lambda w: not w.ready)[:n]
        for w in workers:
            self.idle.remove(w)
        warm = sum(w.ready for w in workers)
        workers += [Worker(environ, retire=bool(env)) for _ in range(n - len(workers))]
        try:
            _await_ready(workers, deadline, jobs[0].timeout)
        except BaseException:
            # nothing of the launch ran in them: alive, they stay for the next launch
            self.idle += [w for w in workers if w.alive() and not w.retire]
            for w in workers:
                if w not in self.idle:
                    w.kill()
            raise
        context = {"environ": environ, "cwd": os.getcwd(), "path": list(sys.path)}
        for worker, job in zip(workers, jobs):
            fields = {k: v for k, v in vars(job).items() if k not in ("fn", "args")}
            worker.ready = False
            worker.reported = False
            worker.conn.send_bytes(pickle.dumps((context, fields, call)))
        self.history.append(LaunchStart(n, warm, time.monotonic() - t0))
        return workers

    def finish(self, workers: list[Worker], outcome: str) -> None:
        """After a launch (``outcome``: "ok", "failed" or "interrupted"): the workers whose rank
        reported and that reset cleanly are kept; every other is killed and replaced (why:
        ``replaced``)."""
        why = {}
        for rank, w in enumerate(workers):
            if outcome == "interrupted":
                why[rank] = "the launch was interrupted"
            elif w.retire:
                why[rank] = "its launch set env="
            elif not w.alive():
                why[rank] = "it died"
            elif not w.reported:
                why[rank] = "it was still running (hung, or blocked by a failed rank)"
        try:
            for rank, w in enumerate(workers):
                if rank in why:
                    w.kill()  # first: a peer blocked in a collective must not hold up the reset
            kept = [w for rank, w in enumerate(workers) if rank not in why]
            for w in kept:
                try:
                    w.conn.send_bytes(b"release")
                except OSError:
                    w.kill()
            deadline = time.monotonic() + RESET_TIMEOUT
            for w in kept:
                answer = w.await_message(deadline) if w.alive() else None
                if answer == ("ready",):
                    w.ready = True
                    self.idle.append(w)
                elif isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "dirty":
                    why[workers.index(w)] = f"it was not clean after the launch: {answer[1]}"
                else:
                    why[workers.index(w)] = "it did not reset"
        finally:
            for w in workers:
                if w not in self.idle:
                    w.kill()
            self.replaced += [f"rank {rank}: {text}" for rank, text in sorted(why.items())]
            self._top_up()

    def pids(self) -> list[int]:
        """The process ids of the idle workers (warm or still starting)."""
        return [w.pid for w in self.idle]

    def shutdown(self) -> None:
        """Kill every idle worker (the next spawned launch starts cold)."""
        for w in self.idle:
            w.kill()
        self.idle.clear()
        self.keep = 0

    def _retire_unusable(self) -> None:
        """Kill idle workers that died, that started for other read-once variables than this
        process has now (a launch's own ``env=`` does not count: it gets fresh workers), or that
        started with a variable ``keep_from_ranks`` has named since."""
        now = read_once(isolation.rank_environment(os.environ))
        for w in list(self.idle):
            changed = sorted({name for name, _ in set(now.items()) ^ set(w.read_once.items())})
            kept = sorted(w.variables & isolation.kept_env())
            if changed:
                why = f"{changed} changed"
            elif kept:
                why = f"{kept} must be kept from ranks"
            elif not w.alive():
                why = "it died"
            else:
                continue
            self.idle.remove(w)
            w.kill()
            self.replaced.append(f"idle: {why}")

    def _top_up(self) -> None:
        """Start workers, in the background, until ``keep`` are idle."""
        environ = isolation.rank_environment(os.environ)
        while len(self.idle) < self.keep:
            self.idle.append(Worker(environ))


def _await_ready(workers: list[Worker], deadline: float, timeout: float) -> None:
    """Wait until every worker has said "ready" (a new one once torch is imported)."""
    waiting = {w.conn: rank for rank, w in enumerate(workers) if not w.ready}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchTimeout(
                timeout,
                sorted(waiting.values()),
                [],
                cause="Their processes were still starting (importing torch): on a busy machine,"
                " raise timeout, or launch again now that they are warm.",
            )
        for conn in connection.wait(list(waiting), timeout=min(left, 0.5)):
            rank = waiting.pop(conn)
            worker = workers[rank]
            try:
                message = wire.decode(conn.recv_bytes(), "worker")
            except (EOFError, OSError):
                message = None
            if message != ("ready",):
                code = worker.wait(timeout=2)
                raise RankDied(
                    rank,
                    code,
                    f"rank {rank}'s spawned process ended while starting (exit code {code}): the"
                    " lines it wrote to stderr, above, say why (torch or labs not importable by"
                    f" {sys.executable}?)",
                )
            worker.ready = True


_pool: WorkerPool | None = None


def worker_pool() -> WorkerPool:
    """This process's pool of warm workers, made on first use (and shut down at exit)."""
    global _pool
    if _pool is None:
        _pool = WorkerPool()
        atexit.register(_pool.shutdown)
    return _pool


# --- the worker's side -----------------------------------------------------------------------
def worker_main(fd: int) -> None:
    """A worker's life: warm up, say "ready", then one launch's rank at a time until the parent
    closes the pipe. ``fd``: the worker's end of its pipe to the parent."""
    conn = connection.Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(
        target=_die_with_parent, args=(os.getppid(),), name="labs-die-with-parent", daemon=True
    ).start()
    state = _WorkerState.capture()  # warm: torch, torch.distributed and the launcher imported
    conn.send_bytes(wire.encode(("ready",)))
    while True:
        try:
            # from the parent, which this process trusts (the other way, nothing is unpickled)
            context, fields, call = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the parent closed the pool, or died
        state.enter(context)
        try:
            import cloudpickle

            fn, args = cloudpickle.loads(call)
        except Exception as e:  # e.g. the function's module is not importable here
            fn, args = functools.partial(_reraise, e), ()
        with state.guard():
            run_rank(RankJob(fn=fn, args=args, **fields), conn)
        problem = state.reset()
        try:
            conn.send_bytes(wire.encode(("dirty", problem) if problem else ("ready",)))
        except OSError:
            os._exit(0)
        if problem:
            os._exit(0)


def _reraise(error: Exception) -> None:
    raise error


def _die_with_parent(parent: int) -> None:
    """Kill this worker and its process group once its parent is gone (checked every second)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os.killpg(0, signal.SIGKILL)


@dataclass
class _WorkerState:
    """How a worker was when it started: what ``reset`` puts back after every launch."""

    modules: set[str]  # the names in sys.modules once warm
    environ: dict[str, str]
    cwd: str
    path: list[str]
    threads: set[threading.Thread]
    rng: tuple
    torch_settings: list[object]
    handlers: dict[int, object]
    stdout: object
    stderr: object
    stderr_fd: int  # a copy of fd 2 as it was: a launch points fd 2 at its rank's stderr file

    @classmethod
    def capture(cls) -> _WorkerState:
        return cls(
            modules=set(sys.modules),
            environ=dict(os.environ),
            cwd=os.getcwd(),
            path=list(sys.path),
            threads=set(threading.enumerate()),
            rng=(torch.get_rng_state(), random.getstate(), numpy.random.get_state()),
            torch_settings=[read() for read, _ in _TORCH_SETTINGS],
            handlers={s: signal.getsignal(s) for s in _SIGNALS},
            stdout=sys.stdout,
            stderr=sys.stderr,
            stderr_fd=os.dup(2),
        )

    def enter(self, context: dict) -> None:
        """Before a launch: forget the learner's modules; take the parent's environment,
        directory and import path; the random generators as when this worker started."""
        _forget_learner_modules(self.modules)
        _set_environ(context["environ"])
        os.chdir(context["cwd"])
        sys.path[:] = context["path"]
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        numpy.random.set_state(self.rng[2])
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(torch.initial_seed())

    @contextlib.contextmanager
    def guard(self):
        """Around a launch: warnings filters as they were before it (``catch_warnings``)."""
        import warnings

        with warnings.catch_warnings():
            yield

    def reset(self) -> str:
        """After a launch: put everything back; "" when this worker is clean, else why not."""
        problems = []
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:
            problems.append(f"its process group did not close ({e})")
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.stderr_fd, 2)
        sys.stdout = self.stdout
        sys.stderr = self.stderr
        _set_environ(self.environ)
        dist.set_debug_level_from_env()
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for (read, write), value in zip(_TORCH_SETTINGS, self.torch_settings):
            if read() != value:  # (writing some imports a lot: determinism imports inductor)
                write(value)
        for number, handler in self.handlers.items():
            signal.signal(number, handler)
        signal.setitimer(signal.ITIMER_REAL, 0)
        problems += _end_leftover_processes()
        problems += self._threads_left()
        if torch.cuda.is_initialized():
            # tensors in reference cycles hold GPU memory the next launch would count as its own
            gc.collect()
            torch.cuda.empty_cache()
            for device in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(device)
        return "; ".join(problems)

    def _threads_left(self) -> list[str]:
        deadline = time.monotonic() + 1.0
        extra = [t for t in threading.enumerate() if t not in self.threads]
        for t in extra:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        names = [t.name for t in extra if t.is_alive()]
        return [f"thread(s) {names} still running"] if names else []


def _set_environ(environ: dict[str, str]) -> None:
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


@functools.cache
def _installed(path: str) -> bool:
    """True for a file of the Python installation or its site-packages (resolved once)."""
    return str(Path(path).resolve()).startswith(_INSTALLED)


def _editable(name: str, module) -> bool:
    """True for a module a learner may have edited since it was imported."""
    if name.startswith("__"):  # __main__, __mp_main__
        return False
    if name == "solutions" or name.startswith("solutions."):
        return True
    if name.startswith("labs.") and name.split(".")[1] in EXERCISES:
        return True
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isabs(file):
        return False  # built in, a namespace package, or torch.ops (whose __file__ is "_ops.py")
    return not _installed(file) and not Path(file).resolve().is_relative_to(_LABS_DIR)


def _forget_learner_modules(baseline: set[str]) -> None:
    """Drop every module a learner may have edited from ``sys.modules`` (and from its package's
    attributes, which ``from package import module`` reads first): the next import reads its
    file again, as a fresh process would. Modules of the ``baseline`` (those the worker imported
    to warm up: torch, the runtime) are not looked at."""
    for name, module in list(sys.modules.items()):
        if name not in baseline and module is not None and _editable(name, module):
            del sys.modules[name]
            package, _, child = name.rpartition(".")
            if getattr(sys.modules.get(package), child, None) is module:
                delattr(sys.modules[package], child)
    importlib.invalidate_caches()
    linecache.clearcache()


def _end_leftover_processes() -> list[str]:
    """Kill what the launch left in this worker's process group and reap this worker's
    children; a child still running after that (one that left the group) is a problem."""
    me = os.getpid()
    for pid in group_members(me):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []  # no child left
        if pid == 0:  # children left, none exited yet
            if time.monotonic() > deadline:
                return ["a child process outlived the launch"]
            time.sleep(0.01)
