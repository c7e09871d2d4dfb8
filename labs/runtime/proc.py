"""Which processes live under this one, read from Linux's /proc: how the course checks that a run
left none behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def live_processes() -> dict[int, tuple[int, int]]:
    """Every live (non-zombie) process -> (its parent's pid, its process group), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        state, ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]  # after "pid (comm)"
        if state != "Z":
            found[int(entry.name)] = (int(ppid), int(group))
    return found


def parents() -> dict[int, int]:
    """Every live (non-zombie) process -> its parent's pid."""
    return {pid: ppid for pid, (ppid, _) in live_processes().items()}


def child_pids(pid: int | None = None) -> set[int]:
    """Live children of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {p for p, parent in parents().items() if parent == pid}


def descendants(pid: int | None = None) -> list[int]:
    """Live descendants of ``pid`` (default: this process), generation by generation."""
    parent_of = parents()
    found = []
    frontier = {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier}
        found += sorted(frontier)
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (read from /proc on Linux, from ``ps``
    elsewhere)."""
    if not Path("/proc/self/stat").exists():
        import subprocess

        out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True, text=True)
        rows = [line.split() for line in out.stdout.splitlines()]
        return [int(r[0]) for r in rows if len(r) == 3 and int(r[1]) == pgid and r[2][0] != "Z"]
    return [pid for pid, (_, group) in live_processes().items() if group == pgid]


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (a rank and everything it started), or ``pid``
    alone if it has not made its group yet; nothing if it is gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass
