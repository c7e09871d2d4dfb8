"""The first process of a grading sandbox: lay out the working copy, run the item, watch it, say how
it ended.

    python -I -S inside.py SPEC_JSON

``labs.grade`` starts this as PID 1 of the sandbox's PID namespace (``bwrap --as-pid-1``), from the
standard library only (``-I -S``: no site-packages, no ``PYTHONPATH``, nothing a submission could
have put on the path). SPEC (written by ``labs.grade.sandbox.Sandbox.command``) says what to
do:

1. ``copy``: [source, destination] folders, copied in order (the course release, then the files of
   this item over it: the student's exercise modules, a notebook) into the sandbox's ``/tmp``, a
   tmpfs the size of the disk limit (a test run's course is bound read-only instead, and its
   ``copy`` is empty); ``mkdir``: folders to create;
2. this process makes itself non-dumpable, so the item's code cannot ptrace it, read its memory or
   open its file descriptors; as the PID namespace's init it also gets no signal from the item's
   processes (the kernel drops those it has no handler for);
3. ``argv``, from ``cwd``, runs in a child with the limits of ``limits`` (``setrlimit``: address
   space, open files and CPU time per process, processes and threads, file size; no core files);
   the child closes the status channel (``status_fd``) before it starts the item, so only this
   process holds it;
4. every ``poll_s`` seconds this process looks at every process in the sandbox: threads, open
   files and CPU time (used and reaped) in all, and, when ``watch_memory`` (no memory cgroup does
   it in the kernel), the memory: proportional set size (resident size for a process it may not
   read), plus what the sandbox's ``/tmp`` and ``/dev/shm`` hold. Over a limit, it kills them all
   and says which limit was hit;
5. when the item's first process exits, this process writes one JSON line to ``status_fd``:
   ``{"exit": code or null, "signal": number or null, "leftover": processes still running,
   "limit": null or "memory", "processes", "open files", "cpu time", "cpu_s": CPU seconds}`` and
   exits. The kernel then kills every process left in the namespace, daemons included. ``cpu_s``
   is the item's CPU time, user + sys: this process's and that of every process it reaped (as
   PID 1 it reaps the orphans too; each process's own reaped children count in it), so all of
   the item but what is still running at its end.

Outside a sandbox (``labs.grade --unsafe-no-sandbox``: not PID 1), step 2 and the watching of step
4 are skipped and ``leftover`` is 0: the grader itself kills what is left.
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import time

PR_SET_DUMPABLE = 4
TMPFS = ("/tmp", "/dev/shm")


def lay_out(spec: dict) -> None:
    """Copy the course and the item's files into place; create the empty folders."""
    for source, destination in spec["copy"]:
        shutil.copytree(source, destination, symlinks=True, dirs_exist_ok=True)
    for folder in spec["mkdir"]:
        os.makedirs(folder, exist_ok=True)


def start_item(spec: dict) -> int:
    """Fork the item's first process: limits set, status channel closed, then ``exec``."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.close(spec["status_fd"])
        if spec.get("results_fd") is not None:
            os.set_inheritable(spec["results_fd"], True)
        # as a fresh process has them (this Python ignores SIGPIPE and SIGXFSZ, and, as init, more)
        for signum in (
            signal.SIGINT,
            signal.SIGTERM,
            signal.SIGHUP,
            signal.SIGPIPE,
            signal.SIGXFSZ,
        ):
            signal.signal(signum, signal.SIG_DFL)
        limits = spec["limits"]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (limits["address_space_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"],) * 2)
        if spec["sandboxed"]:  # outside, it would count every process of the grader's user
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
        os.chdir(spec["cwd"])
        os.execve(spec["argv"][0], spec["argv"], dict(os.environ))
    except BaseException as exc:  # noqa: BLE001 - the child must never return into the watcher
        os.write(2, f"grading sandbox: cannot start the item: {exc!r}\n".encode())
    os._exit(127)


def sandbox_processes() -> list[str]:
    """The pids of every process in this PID namespace but this one (its /proc shows only them)."""
    return [name for name in os.listdir("/proc") if name.isdigit() and name != "1"]


def _stat(pid: str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)" (readable for every process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # it ended while we looked
        return None


def usage(pids: list[str]) -> dict:
    """What these processes use now: resident bytes (an upper bound: shared pages count once per
    process), threads, open files, and CPU seconds (theirs, and their reaped children's)."""
    page = os.sysconf("SC_PAGE_SIZE")
    ticks = os.sysconf("SC_CLK_TCK")
    found = {"resident": {}, "threads": 0, "files": 0, "cpu": 0.0}
    for pid in pids:
        fields = _stat(pid)
        if fields is None:
            continue
        # num_threads, rss, utime + stime + cutime + cstime: fields 20, 24, 14-17 of stat
        found["threads"] += int(fields[17])
        found["resident"][pid] = int(fields[21]) * page
        found["cpu"] += sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks
        found["files"] += open_files(pid)
    return found


def open_files(pid: str) -> int:
    """How many files ``pid`` has open: its descriptors, or, for a process this one may not read
    (not dumpable), the size of its descriptor table (an upper bound)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def proportional_memory(resident: dict[str, int]) -> int:
    """The memory these processes use, each shared page split between its sharers (PSS, from
    /proc/<pid>/smaps_rollup: exact, and costlier to read than the resident size), or the
    resident size of a process this one may not read."""
    total = 0
    for pid, rss in resident.items():
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(x.split()[1]) * 1024 for x in f if x.startswith("Pss:"))
        except (OSError, ValueError, StopIteration):
            total += rss
    return total


def tmpfs_bytes() -> int:
    """What the files in the sandbox's tmpfs (/tmp, /dev/shm) hold: memory too."""
    total = 0
    for folder in TMPFS:
        try:
            fs = os.statvfs(folder)
            total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        except OSError:
            pass
    return total


def over_limit(limits: dict, watch_memory: bool) -> str | None:
    """Which limit the sandbox's processes are over now, or None."""
    used = usage(sandbox_processes())
    children = os.times()
    used["cpu"] += children.children_user + children.children_system
    if used["threads"] > limits["processes"]:
        return "processes"
    if used["files"] > limits["open_files_in_all"]:
        return "open files"
    if used["cpu"] > limits["cpu_seconds_in_all"]:
        return "cpu time"
    if watch_memory:
        files = tmpfs_bytes()
        cap = limits["memory_bytes"]
        if sum(used["resident"].values()) + files > cap:  # cheap to read; then the exact figure
            if proportional_memory(used["resident"]) + files > cap:
                return "memory"
    return None


def cpu_seconds() -> float:
    """User + sys CPU seconds of this process and of every process it reaped."""
    t = os.times()
    return round(t.user + t.system + t.children_user + t.children_system, 3)


def watch(spec: dict, child: int) -> dict:
    """Reap processes until ``child`` exits; as PID 1 of a sandbox, stop everything over a limit."""
    as_init = spec["sandboxed"]
    limits = spec["limits"]
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
        if pid == child:
            break
        if pid:
            continue  # an orphan reaped: look again at once
        if as_init:
            hit = over_limit(limits, spec["watch_memory"])
            if hit:
                os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
                os.waitpid(child, 0)
                return {
                    "exit": None,
                    "signal": signal.SIGKILL,
                    "leftover": 0,
                    "limit": hit,
                    "cpu_s": cpu_seconds(),
                }
        time.sleep(spec["poll_s"])
    leftover = len(sandbox_processes()) if as_init else 0
    return {
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "leftover": leftover,
        "limit": None,
        "cpu_s": cpu_seconds(),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["sandboxed"]:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
    lay_out(spec)
    child = start_item(spec)
    report = watch(spec, child)
    os.write(spec["status_fd"], (json.dumps(report) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
