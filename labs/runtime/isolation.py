"""What a rank must not reach in the process that launched it: its memory, its descriptors, the
environment variables it names.

    from labs.runtime import keep_from_ranks, protect_from_ranks

    protect_from_ranks()                               # Linux: nobody of this user may read
                                                       # /proc/<this pid>/mem or fd/, or ptrace it
    keep_from_ranks(fds=[results_fd], env=["TOKEN"])   # never in a rank: the descriptor is
                                                       # /dev/null there, the variable unset

Made for the grader: its pytest process computes the verdict while the ranks it launches run a
submission's code. The results channel back from a rank is decoded safely (``labs.runtime.wire``);
these two calls close the other ways in.

* :func:`protect_from_ranks` makes this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``):
  another process of the same user, a rank included, can no longer open ``/proc/<pid>/mem``,
  ``/proc/<pid>/fd/*`` or ``/proc/<pid>/environ``, nor attach a debugger. Forked ranks inherit
  the flag. A process with ``CAP_SYS_PTRACE`` (root outside a user namespace) is not stopped by
  it: run untrusted ranks unprivileged.
* :func:`keep_from_ranks` registers descriptors and environment variables that no rank may hold.
  In every child forked from this process (``os.register_at_fork``: the fork launcher's ranks,
  and any ``os.fork``) each descriptor is replaced by ``/dev/null`` opened read-only, so writing
  to it fails and a later close of that number closes nothing else; each variable is unset.
  Spawned ranks start without the variables and inherit no descriptor at all.

A forked rank is a copy of this process's memory: a secret held in a Python object here is in
every forked rank too. Keep secrets out of a process that forks ranks, or spawn them
(``LABS_START_METHOD=spawn``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable, Mapping

_PR_SET_DUMPABLE = 4  # <linux/prctl.h>
_PR_GET_DUMPABLE = 3
# What no rank may hold (see keep_from_ranks), and whether the fork hook is installed.
_kept_fds: set[int] = set()
_kept_env: set[str] = set()
_hook_installed = False


def protect_from_ranks() -> bool:
    """Make this process non-dumpable, so that no process of this user (a forked or spawned
    rank included) can read its memory or descriptors through ``/proc`` or ptrace it. True when
    done; False where the system has no such switch (macOS, Windows). Lasts until the process
    ends."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(errno)}")
    return True


def is_protected() -> bool:
    """True when this process is non-dumpable (``protect_from_ranks`` ran here or in a parent
    that forked it)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0


def keep_from_ranks(*, fds: Iterable[int] = (), env: Iterable[str] = ()) -> None:
    """From now on, no rank this process starts holds the descriptors ``fds`` or sees the
    environment variables ``env`` (see the module docstring for how)."""
    global _hook_installed
    fds = list(fds)
    env = list(env)
    bad = [fd for fd in fds if isinstance(fd, bool) or not isinstance(fd, int) or fd < 3]
    if bad:
        raise ValueError(f"fds must be descriptor numbers >= 3 (not stdin/out/err), got {bad}")
    _kept_fds.update(fds)
    _kept_env.update(env)
    if not _hook_installed:
        os.register_at_fork(after_in_child=_in_forked_child)
        _hook_installed = True


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables ``keep_from_ranks`` named: what a spawned rank gets."""
    return {name: value for name, value in environ.items() if name not in _kept_env}


def kept_env() -> frozenset[str]:
    """The environment variables no rank may see."""
    return frozenset(_kept_env)


def _in_forked_child() -> None:
    if _kept_fds:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in _kept_fds:
            os.dup2(null, fd, inheritable=False)
        os.close(null)
    for name in _kept_env:
        os.environ.pop(name, None)
