"""The first process of a grading sandbox: lay out the working copy, run the item, watch it, say how
it ended.

    python -I -S inside.py SPEC_JSON

``labs.grade`` starts this as PID 1 of the sandbox's PID namespace (``bwrap --as-pid-1``), from the
standard library only (``-I -S``: no site-packages, no ``PYTHONPATH``, nothing a submission could
have put on the path). SPEC (written by ``labs.grade.sandbox.Sandbox.command``) says what to
do:

1. ``copy``: [source, destination] folders, copied in order (the course release, then the files of
   this item over it: the student's exercise modules, a notebook, hidden tests) into the
   sandbox's ``/tmp``, a tmpfs the size of the disk limit; ``mkdir``: folders to create;
2. this process makes itself non-dumpable, so the item's code cannot ptrace it, read its memory or
   open its file descriptors; as the PID namespace's init it also gets no signal from the item's
   processes (the kernel drops those it has no handler for);
3. ``argv``, from ``cwd``, runs in a child with the limits of ``limits`` (``setrlimit``: address
   space per process, processes and threads, file size; no core files); the child closes the status
   channel (``status_fd``) before it starts the item, so only this process holds it;
4. every ``poll_s`` seconds this process adds up the memory (proportional set size, read only
   when the cheaper resident sizes add up to more than the limit) and the threads of every
   process in the sandbox; over ``limits.memory_bytes`` or ``limits.processes`` it kills them all
   and says which limit was hit (the kernel enforces ``RLIMIT_NPROC`` only for a grader that is not
   root, so this check is the one that always holds);
5. when the item's first process exits, this process writes one JSON line to ``status_fd``:
   ``{"exit": code or null, "signal": number or null, "leftover": processes still running,
   "limit": null, "memory" or "processes"}`` and exits. The kernel then kills every process left in
   the namespace, daemons included.

Outside a sandbox (``labs.grade --unsafe-no-sandbox``: not PID 1), steps 2 and 4 are skipped and
``leftover`` is 0: the grader itself kills what is left.
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


def usage(pids: list[str]) -> tuple[int, int]:
    """(resident bytes, threads) of these processes, from /proc/<pid>/stat. Resident sizes count
    the pages forked processes share once per process: an upper bound, cheap to read."""
    page = os.sysconf("SC_PAGE_SIZE")
    resident = 0
    threads = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        threads += int(fields[17])  # num_threads: field 20 of stat, the 18th after "pid (comm)"
        resident += int(fields[21]) * page  # rss in pages: field 24
    return resident, threads


def proportional_memory(pids: list[str]) -> int:
    """The memory these processes use, each shared page split between its sharers (PSS, from
    /proc/<pid>/smaps_rollup): exact, and costlier to read than ``usage``."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


def over_limit(limits: dict) -> str | None:
    """Which limit the sandbox's processes are over now: "memory", "processes" or None."""
    pids = sandbox_processes()
    resident, threads = usage(pids)
    if threads > limits["processes"]:
        return "processes"
    if resident > limits["memory_bytes"] and proportional_memory(pids) > limits["memory_bytes"]:
        return "memory"
    return None


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
            hit = over_limit(limits)
            if hit:
                os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
                os.waitpid(child, 0)
                return {"exit": None, "signal": signal.SIGKILL, "leftover": 0, "limit": hit}
        time.sleep(spec["poll_s"])
    leftover = len(sandbox_processes()) if as_init else 0
    return {
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "leftover": leftover,
        "limit": None,
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
