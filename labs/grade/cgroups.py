"""Limits the kernel keeps for one graded item: a control group (cgroup) of its own, where the
machine lets the grader make one.

A cgroup's memory controller counts every page its processes' work costs the kernel: their own
memory, the files they hold in a tmpfs or a ``memfd``, shared memory, pipe buffers and other
kernel memory (and, under cgroup v2, socket buffers), all of which the sum of the processes'
resident sizes misses. Over the limit, the kernel reclaims, then kills a process of the group:
the grader reads that from the group's counters and reports "memory".

Which kind, found once per grading run (``detect``):

===========  ============================================================================
``v2``       the grader's own cgroup v2 (the ``0::`` line of ``/proc/self/cgroup``) is
             writable, offers the ``memory`` controller, and holds only the grader's own
             process (a delegated cgroup: ``systemd-run --user --scope -p Delegate=yes``, or a
             container's). The grader moves itself into the leaf ``grader``, enables the
             controllers for its children, and each item gets ``item-N`` with ``memory.max``,
             ``memory.swap.max=0``, ``memory.oom.group=1`` (an item over its memory is
             stopped whole), ``pids.max`` and ``cpu.max`` (its cores' worth) where offered
``v1``       the grader's memory cgroup v1 (a ``memory`` line of ``/proc/self/cgroup``, the
             hierarchy mounted under ``/sys/fs/cgroup/memory``) is writable (a root grader on a
             machine with cgroup v1): each item gets ``labs-grade-PID/item-N`` with
             ``memory.limit_in_bytes`` and, where swap is accounted,
             ``memory.memsw.limit_in_bytes``
``None``     neither: the sandbox's init watches the memory itself, and the sandbox refuses the
             calls whose memory it could not see (``memfd_create``, ``shmget``); pipe and socket
             buffers stay uncounted (bounded by the open-files limit)
===========  ============================================================================

A process joins its item's cgroup before it starts the sandbox (``Group.join``, in the child
between fork and exec), so everything of the item is in it from its first instruction.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # cpu.max's period


@dataclass
class Controller:
    """The cgroup tree the grader makes its items' groups in."""

    kind: str  # "v2" or "v1"
    base: Path  # v2: the grader's delegated cgroup; v1: labs-grade-<pid> under its memory cgroup
    controllers: tuple[str, ...]  # v2: the controllers enabled for items
    _count = itertools.count()

    def new_group(self, memory_bytes: int, processes: int, cores: int) -> Group:
        path = self.base / f"item-{next(self._count)}"
        path.mkdir()
        group = Group(self.kind, path)
        try:
            if self.kind == "v2":
                _write(path / "memory.max", memory_bytes)
                _write_if_there(path / "memory.swap.max", 0)
                _write(path / "memory.oom.group", 1)
                if "pids" in self.controllers:
                    _write(path / "pids.max", processes)
                if "cpu" in self.controllers:
                    _write(path / "cpu.max", f"{cores * PERIOD_US} {PERIOD_US}")
            else:
                _write(path / "memory.limit_in_bytes", memory_bytes)
                _write_if_there(path / "memory.memsw.limit_in_bytes", memory_bytes)
        except OSError:
            group.remove()
            raise
        return group

    def close(self) -> None:
        """Remove what the grader made (its items' groups are gone by now)."""
        if self.kind == "v1":
            _rmdir(self.base)


@dataclass
class Group:
    """One item's cgroup."""

    kind: str
    path: Path

    @property
    def procs(self) -> bytes:
        """The path a process writes ``0`` to, to join the group."""
        return os.fsencode(self.path / "cgroup.procs")

    def join(self) -> None:
        """Move the calling process into the group (between fork and exec: no Python locks)."""
        fd = os.open(self.procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def memory_killed(self) -> bool:
        """Did the kernel kill a process of the group for its memory limit?"""
        events = "memory.events" if self.kind == "v2" else "memory.oom_control"
        try:
            text = (self.path / events).read_text()
        except OSError:
            return False
        counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        return int(counts.get("oom_kill", 0)) > 0 or int(counts.get("oom_group_kill", 0)) > 0

    def remove(self) -> None:
        _rmdir(self.path)


def detect(pid: int | None = None) -> Controller | None:
    """The cgroup kind this grader can give its items (see the module docstring), set up; None
    when it can give them none."""
    pid = pid or os.getpid()
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    unified = next((path for hid, ctl, path in entries if hid == "0" and ctl == ""), None)
    if unified is not None:
        found = _v2(unified)
        if found:
            return found
    memory = next((path for _, ctl, path in entries if "memory" in ctl.split(",")), None)
    if memory is not None:
        return _v1(memory)
    return None


def _v2(own: str) -> Controller | None:
    mount = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else None
    mount = mount or (CGROUP_ROOT / "unified")
    base = mount / own.lstrip("/")
    try:
        offered = (base / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    if "memory" not in offered or not os.access(base / "cgroup.subtree_control", os.W_OK):
        return None
    try:
        others = [p for p in (base / "cgroup.procs").read_text().split() if int(p) != os.getpid()]
        if others:
            return None  # not ours alone: the grader cannot make it an inner node
        leaf = base / "grader"
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", os.getpid())
        wanted = [c for c in ("memory", "pids", "cpu") if c in offered]
        _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
    except (OSError, ValueError):
        return None
    return Controller("v2", base, tuple(wanted))


def _v1(own: str) -> Controller | None:
    mount = CGROUP_ROOT / "memory"
    parent = mount / own.lstrip("/")
    if not (parent / "memory.limit_in_bytes").exists() or not os.access(parent, os.W_OK):
        return None
    base = parent / f"labs-grade-{os.getpid()}"
    try:
        base.mkdir()
    except OSError:
        return None
    return Controller("v1", base, ("memory",))


def _write(path: Path, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _write_if_there(path: Path, value) -> None:
    if path.exists():
        _write(path, value)


def _rmdir(path: Path) -> None:
    """Remove an empty cgroup; its last processes may take a moment to leave it."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
