"""Run one grading item to its end or to its time limit, reading what it says on three channels,
and make sure nothing it started is still running afterwards.

The item's channels, each a pipe the grader reads as the item runs:

==========  ======================================================================================
output      stdout and stderr together: the log. However much is printed, the log keeps its first
            and last ``LOG_KEEP_BYTES``; the total is counted
results     the results channel (``LABS_GRADE_FD`` in the item's environment): what the pytest
            plugin or the notebook runner report, at most ``results_limit`` bytes
status      the sandbox's init says how the item ended (exit code, processes left, a limit hit);
            only that process holds it
==========  ======================================================================================

In a sandbox (``labs.grade.sandbox``) the item's processes live in their own PID namespace:
when its init exits, the kernel kills all of them, and ``run_item`` waits for that. At the time
limit the grader kills bubblewrap and the init. Without a sandbox (``--unsafe-no-sandbox``) the
item runs in its own process group; the grader is a Linux *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``), so processes the item daemonised come back to it, and
``kill_leftovers`` kills every descendant of the grader: grade one student at a time there.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from labs.grade.cgroups import Group
from labs.runtime.proc import descendants

PR_SET_CHILD_SUBREAPER = 36
LOG_KEEP_BYTES = 100_000  # of the start of the log, and as much of its end
STATUS_LIMIT = 4096
DRAIN_S = 10.0  # after the item ended or was killed, how long its pipes may take to close
_running: dict = {}  # the items running now (several with labs.grade --jobs)
_running_lock = threading.Lock()
_stopping = threading.Event()  # set by stop_all: no item starts any more


@dataclass
class Finished:
    """How one item ended."""

    exit_code: int | None  # None: killed (time limit, a limit of the sandbox, a signal)
    signal: int | None  # the signal that ended its first process, if one did
    timed_out: bool
    seconds: float
    leftover: int  # processes still running when its first process exited (then killed)
    limit: str | None  # "memory", "processes", "open files", "cpu time": the sandbox stopped it
    results: bytes  # what came on the results channel
    results_overflow: bool  # more than results_limit bytes came: the rest was dropped
    output_bytes: int  # printed in all (the log keeps the start and the end)
    cpu_seconds: float | None = None  # user + sys of the item (its init's report); None: unknown


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux only; False elsewhere)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def kill_leftovers() -> int:
    """SIGKILL every descendant of this process still alive; returns how many there were. Only for
    a grader that runs one item at a time: it kills the other items' processes too."""
    killed = set()
    for _ in range(20):  # a process may fork while we kill: look again until nothing is left
        pids = descendants()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
        _reap()
    _reap()
    return len(killed)


class _Log:
    """The item's output: the first and the last LOG_KEEP_BYTES, and how much there was."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = LOG_KEEP_BYTES - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * LOG_KEEP_BYTES:
            del self.tail[:-LOG_KEEP_BYTES]

    def write(self, path: Path) -> None:
        tail = self.tail[-LOG_KEEP_BYTES:]
        cut = self.total - len(self.head) - len(tail)
        middle = f"\n[... {cut} bytes of output cut by the grader ...]\n".encode() if cut else b""
        path.write_bytes(bytes(self.head) + middle + bytes(tail))


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pid: int | None) -> None:
    """Wait until ``pid`` (the sandbox's init) has exited, which the kernel lets happen only once
    every other process of its PID namespace is gone; reap it if it came back to us."""
    if pid is None:
        return
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not ours: bubblewrap reaped it, or init will
            pass
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.01)


def run_item(
    argv: list[str],
    *,
    env: dict,
    timeout: float,
    log: Path,
    results_limit: int,
    sandboxed: bool,
    pipes: dict[str, tuple[int, int]],
    inputs: tuple[int, ...] = (),
    cpus: set[int] | None = None,
    group: Group | None = None,
) -> Finished:
    """Run ``argv`` (a bubblewrap command when ``sandboxed``) for at most ``timeout`` seconds.

    ``pipes`` are the (read end, write end) pairs, made with ``os.pipe()``, of the channels the
    command was told about: "results", "status" and, sandboxed, "info" (bubblewrap's
    ``--info-fd``, which says the sandbox init's pid). This function passes the write ends to the
    command, reads the read ends, and closes both. ``inputs`` are descriptors the command reads
    (bubblewrap's ``--seccomp`` program): passed, then closed here. The command runs on the cores
    ``cpus`` (its affinity, which the sandbox's seccomp filter keeps it from changing) and in the
    cgroup ``group``, joined before it starts. Output goes to ``log``."""
    if _stopping.is_set():
        for pipe in pipes.values():
            os.close(pipe[0])
            os.close(pipe[1])
        for fd in inputs:
            os.close(fd)
        raise KeyboardInterrupt("grading was interrupted")
    out_read, out_write = os.pipe()
    t0 = time.perf_counter()

    def place() -> None:  # in the child, before exec: only system calls, no Python locks
        if cpus:
            os.sched_setaffinity(0, cpus)
        if group is not None:
            group.join()

    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out_write,
            stderr=out_write,
            pass_fds=tuple(write_end for _, write_end in pipes.values()) + tuple(inputs),
            start_new_session=True,
            preexec_fn=place if (cpus or group is not None) else None,
        )
    except BaseException:
        for read_end, _ in pipes.values():
            os.close(read_end)
        os.close(out_read)
        raise
    finally:
        os.close(out_write)
        for _, write_end in pipes.values():
            os.close(write_end)
        for fd in inputs:
            os.close(fd)
    channels = {out_read: "output", **{read_end: name for name, (read_end, _) in pipes.items()}}
    run = _Run(proc, sandboxed, results_limit)
    with _running_lock:
        _running[proc.pid] = run
    try:
        run.read(channels, deadline=time.monotonic() + timeout)
    finally:
        with _running_lock:
            _running.pop(proc.pid, None)
        run.stop()
        for fd in channels:
            os.close(fd)
        proc.wait()
        _wait_gone(run.init_pid)
    run.output.write(log)
    report = _status(run.status)
    limit = report.get("limit")
    if group is not None:
        if group.memory_killed():
            limit = "memory"
        group.remove()
    return Finished(
        exit_code=None if run.timed_out else report.get("exit"),
        signal=report.get("signal"),
        timed_out=run.timed_out,
        seconds=time.perf_counter() - t0,
        leftover=int(report.get("leftover") or 0) + run.leftover_outside,
        limit=limit,
        results=bytes(run.results),
        results_overflow=run.overflow,
        output_bytes=run.output.total,
        cpu_seconds=_cpu(report),
    )


def stop_all() -> None:
    """Kill every item running now and start no other (the grader was interrupted): their
    ``run_item`` returns, the next one raises KeyboardInterrupt."""
    _stopping.set()
    with _running_lock:
        runs = list(_running.values())
    for run in runs:
        run.stopped = True
        run.stop()


class _Run:
    """The reading side of one running item."""

    def __init__(self, proc: subprocess.Popen, sandboxed: bool, results_limit: int) -> None:
        self.proc = proc
        self.sandboxed = sandboxed
        self.results_limit = results_limit
        self.output = _Log()
        self.results = bytearray()
        self.status = bytearray()
        self.info = bytearray()
        self.overflow = False
        self.init_pid: int | None = None
        self.timed_out = False
        self.stopped = False  # by stop_all
        self.leftover_outside = 0

    def read(self, channels: dict[int, str], deadline: float) -> None:
        """Read every channel until all are closed; stop the item at ``deadline``."""
        selector = selectors.DefaultSelector()
        for fd, name in channels.items():
            selector.register(fd, selectors.EVENT_READ, name)
        ended_at = None
        while selector.get_map():
            now = time.monotonic()
            if ended_at is None and self.proc.poll() is not None:
                ended_at = now
                if not self.sandboxed:  # daemons outside any namespace keep our pipes open
                    self.leftover_outside += kill_leftovers()
            elif ended_at is None and (now >= deadline or self.stopped):
                ended_at = now
                self.timed_out = True
                self.stop()
            elif ended_at is not None and now - ended_at > DRAIN_S:
                break
            wait = 0.2 if ended_at is not None else min(0.5, max(deadline - now, 0.01))
            for key, _ in selector.select(wait):
                data = os.read(key.fd, 65536)
                if data:
                    self.take(key.data, data)
                else:
                    selector.unregister(key.fd)
        selector.close()

    def take(self, channel: str, data: bytes) -> None:
        if channel == "output":
            self.output.add(data)
        elif channel == "results":
            room = max(self.results_limit - len(self.results), 0)
            self.overflow = self.overflow or len(data) > room
            self.results += data[:room]
        elif channel == "status":
            self.status += data[: max(STATUS_LIMIT - len(self.status), 0)]
        elif channel == "info":
            self.info += data
            self.init_pid = self.init_pid or _child_pid(self.info)
            if self.timed_out:
                _kill(self.init_pid)

    def stop(self) -> None:
        """Kill the item if it still runs: the sandbox init (the kernel then ends its namespace)
        and bubblewrap; without a sandbox, its process group and whatever it left."""
        if self.proc.poll() is not None and self.sandboxed:
            return
        if self.sandboxed:
            _kill(self.init_pid)
            _kill(self.proc.pid)
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.leftover_outside += kill_leftovers()


def _child_pid(info: bytearray) -> int | None:
    """The sandbox init's pid, from bubblewrap's --info-fd JSON once it is complete."""
    try:
        return int(json.loads(bytes(info))["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _cpu(report: dict) -> float | None:
    """The item's CPU seconds from its init's report; None when it said none (it was killed:
    the item timed out)."""
    cpu = report.get("cpu_s")
    return float(cpu) if isinstance(cpu, (int, float)) and cpu >= 0 else None


def _status(raw: bytearray) -> dict:
    """The init's report (one JSON line), or {} when there is none (killed, or no sandbox)."""
    try:
        report = json.loads(bytes(raw).decode().splitlines()[0])
    except (ValueError, IndexError, UnicodeDecodeError):
        return {}
    return report if isinstance(report, dict) else {}
