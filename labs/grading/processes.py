"""Run one grading item in its own process group with a time limit, then kill whatever it left
behind.

The grader makes itself a Linux *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process
that a submission daemonises (double fork, ``setsid``) is re-parented to the grader rather than to
init when its parent exits, so ``kill_leftovers`` finds it among the grader's descendants.
Call these only from the grader's own process (``python -m labs.grade``): ``kill_leftovers``
kills every descendant of the calling process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from labs.runtime.proc import descendants

PR_SET_CHILD_SUBREAPER = 36
LOG_KEEP_BYTES = 200_000


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
    """SIGKILL every descendant of this process still alive; returns how many there were."""
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


def run_item(
    cmd: list[str], *, cwd: Path, env: dict, timeout: float, log: Path
) -> tuple[int | None, float, int]:
    """Run ``cmd`` in a new process group, at most ``timeout`` seconds. Returns (exit code, or None
    when it ran out of time; seconds; how many processes it left behind, now killed). Output goes to
    ``log``, of which the last 200 kB are kept."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also on KeyboardInterrupt: the group goes first, then anything that left it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    elapsed = time.perf_counter() - t0
    leftovers = kill_leftovers()
    if log.stat().st_size > LOG_KEEP_BYTES:
        tail = log.read_bytes()[-LOG_KEEP_BYTES:]
        log.write_bytes(b"[... output cut ...]\n" + tail)
    return rc, elapsed, leftovers
