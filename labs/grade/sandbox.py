"""Where a graded item runs: a bubblewrap (``bwrap``) sandbox of its own, or, only when the
instructor says ``--unsafe-no-sandbox``, a plain child process.

Each item (a lab's public tests, its hidden tests, a notebook) gets a fresh sandbox:

==================  ===========================================================================
namespaces          its own user, PID, network (loopback only), IPC, UTS and cgroup namespaces;
                    no new user namespace inside (``--disable-userns``, bubblewrap 0.8 and later;
                    the grader needs 0.7 or later)
user                uid 1000 inside, no capabilities. Outside it is the grader's uid: for a root
                    grader, root without any capability, which the read-only whitelist below
                    leaves nothing to use
filesystem          a whitelist, read-only: the system (``/usr`` and its links), a few files of
                    ``/etc`` (no ``passwd``, ``shadow`` or keys of the machine: a passwd and a
                    hosts of its own), the Python installation the grader runs (its prefix and its
                    base prefix), and the grader's files for this item under ``/grading``:
                    ``tools`` (this package's ``inside.py``, ``run_notebook.py`` and the pytest
                    plugin), ``release`` (the course as released) and ``item`` (the student's
                    exercise modules and notebook; for a hidden run, that lab's hidden tests;
                    for a lab that builds on earlier exercises, their references as
                    ``solutions/``, which ``LABS_REFERENCE`` selects).
                    Writable: only ``/tmp`` and ``/dev/shm``, tmpfs of
                    ``Limits.disk_mib`` each, gone when the sandbox ends. The course is
                    ``/tmp/course``: for a test run, the release bound read-only with the item's
                    files bound over it (nothing the student's code runs can change what the
                    pytest process imports later); for a notebook, a writable copy. ``$HOME`` is
                    ``/tmp/home``. ``/proc`` is the sandbox's own, read-only
not there           the instructor's repository (``solutions/``, ``hidden_tests/``; the editable
                    install's mapping points into it), other students' folders, the report
                    folder, the grader's ``$HOME`` and temporary folders, the network, a tmux or
                    D-Bus socket. A ``solutions`` package in the Python installation (a
                    non-editable install) is covered by an empty folder
environment         rebuilt from nothing: ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``,
                    ``PYTHONPATH=/tmp/course``, ``LABS_IMPL=labs``, Jupyter and matplotlib
                    folders under ``$HOME``; nothing of the grader's (``TMUX``, ``SSH_AUTH_SOCK``,
                    ``DISPLAY``, tokens ...) except ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
processes           the item's first process runs under ``inside.py``, the namespace's init; when
                    it ends, the kernel kills every process of the namespace; when the grader
                    dies, bubblewrap's ``--die-with-parent`` ends the sandbox
system calls        a seccomp filter (``seccomp_filter``): ``sched_setaffinity`` fails (the item
                    stays on the cores the grader gave its student), and so do ``memfd_create``
                    and ``shmget`` where no memory cgroup counts their memory; another
                    architecture's system calls fail (x86-64 and arm64 are known; elsewhere no
                    filter, and the README says what that leaves)
limits              ``Limits``: memory of all its processes together, processes and threads, open
                    files, CPU time, size of one file, of ``/tmp`` and ``/dev/shm``, of a
                    notebook's output; the cores it runs on (``labs.grade.cgroups`` and
                    ``labs.grade.processes``)
==================  ===========================================================================

Without bubblewrap (macOS; Linux with user namespaces disabled) the grader refuses to run unless
told ``--unsafe-no-sandbox``; then the item runs as the grader's user with the whole machine in
reach, and only the time, file-size and address-space limits hold.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from labs.grade.processes import run_item

BWRAP_AT_LEAST = (0, 7)  # --size for a tmpfs
DISABLE_USERNS_SINCE = (0, 8)  # older: a user namespace may be nested inside the sandbox
SANDBOX_UID = 1000
HOSTNAME = "grading"
TOOLS = "/grading/tools"
RELEASE = "/grading/release"
ITEM = "/grading/item"
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "nsswitch.conf",
    "host.conf",
    "localtime",
    "mime.types",
    "fonts",
)
# folders of the release an item replaces whole when it brings its own (``_course_binds``)
REPLACED_WHOLE = ("solutions",)
PASS_THROUGH_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
MIB = 1 << 20
GIB = 1 << 30
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap) on Linux with unprivileged user namespaces enabled, or pass "
    "--unsafe-no-sandbox to grade without any isolation (only for code you trust)"
)


@dataclass(frozen=True)
class Limits:
    """What one sandboxed item may use; each is a ``labs.grade`` option of the same name."""

    memory_gib: float = 6.0  # all its memory together (a memory cgroup, else watched by its init)
    processes: int = 1024  # processes and threads together
    open_files: int = 4096  # open files of all its processes together (and of each one)
    cpu_seconds: float = 1800.0  # CPU time of all its processes together
    file_mib: float = 512.0  # the largest file it may write (RLIMIT_FSIZE)
    disk_mib: float = 1024.0  # size of its /tmp, and of its /dev/shm (tmpfs, in memory)
    notebook_output_mib: float = 2.0  # outputs kept in an executed notebook, in all

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0")

    def rlimits(self) -> dict:
        """What ``inside.py`` sets and watches (bytes and counts)."""
        memory = int(self.memory_gib * GIB)
        return {
            "memory_bytes": memory,
            # address space per process: generous (torch and Jupyter reserve far more than they
            # touch), so that one huge allocation fails at once; the total is what is limited
            "address_space_bytes": max(4 * memory, 16 * GIB),
            "processes": self.processes,
            "open_files": self.open_files,  # RLIMIT_NOFILE of each process
            "open_files_in_all": self.open_files,
            "cpu_seconds": int(self.cpu_seconds) + 1,  # RLIMIT_CPU of each process
            "cpu_seconds_in_all": self.cpu_seconds,
            "file_bytes": int(self.file_mib * MIB),
        }


@dataclass(frozen=True)
class Layout:
    """Where the item's folders are, as the item sees them."""

    tools: str
    release: str
    item: str
    tmp: str

    @property
    def course(self) -> str:
        return f"{self.tmp}/course"

    @property
    def home(self) -> str:
        return f"{self.tmp}/home"


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    """bubblewrap's version, e.g. (0, 8, 0); () when it cannot say."""
    try:
        out = subprocess.run([bwrap_path() or "bwrap", "--version"], capture_output=True, text=True)
        return tuple(int(n) for n in out.stdout.split()[-1].split("."))
    except (OSError, ValueError, IndexError):
        return ()


class Sandbox:
    """Builds the command of one item: ``inside.py`` under bubblewrap, or bare when not isolated.

    ``private`` is the grader's own temporary folder (``tools/``, ``release/``, ``etc/`` in it);
    ``hide`` are folders that must not be visible even when a folder the sandbox shows holds them
    (the course repository, submissions, report)."""

    def __init__(self, private: Path, limits: Limits, isolated: bool, hide: list[Path]) -> None:
        self.private = private
        self.limits = limits
        self.isolated = isolated
        self.hide = [p.resolve() for p in hide]
        self.tools = private / "tools"
        self.release = private / "release"
        if isolated:
            self._write_etc()

    def layout(self, item_dir: Path) -> Layout:
        if self.isolated:
            return Layout(tools=TOOLS, release=RELEASE, item=ITEM, tmp="/tmp")
        return Layout(
            tools=str(self.tools),
            release=str(self.release),
            item=str(item_dir / "course"),
            tmp=str(item_dir / "tmp"),
        )

    def env(self, layout: Layout, **extra: str) -> dict[str, str]:
        """The item's whole environment: nothing is inherited but ``PASS_THROUGH_ENV``."""
        home = layout.home
        env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
            "HOME": home,
            "TMPDIR": layout.tmp,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONPATH": layout.course,
            "PYTHONNOUSERSITE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "LABS_IMPL": "labs",
            "MPLCONFIGDIR": f"{home}/.config/matplotlib",
            "JUPYTER_RUNTIME_DIR": f"{home}/.local/share/jupyter/runtime",
            "IPYTHONDIR": f"{home}/.ipython",
        }
        env.update({k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ})
        env.update(extra)
        return env

    def command(
        self,
        item_dir: Path,
        argv: list[str],
        *,
        cwd: str,
        results_fd: int | None,
        status_fd: int,
        info_fd: int | None,
        seccomp_fd: int | None = None,
        read_only_course: bool = False,
        watch_memory: bool = True,
    ) -> list[str]:
        """The command that runs ``argv`` as one item whose own files are in ``item_dir/course``,
        laid over the release: bound read-only (``read_only_course``, sandboxed only) or copied.
        ``seccomp_fd``: a pipe holding ``seccomp_filter``'s program; ``watch_memory``: the
        sandbox's init adds up its memory (no memory cgroup does it)."""
        layout = self.layout(item_dir)
        course = layout.course
        bound = read_only_course and self.isolated
        spec = {
            "sandboxed": self.isolated,
            "copy": [] if bound else [[layout.release, course], [layout.item, course]],
            "mkdir": [layout.home, f"{layout.home}/.local/share/jupyter/runtime"],
            "cwd": cwd,
            "argv": argv,
            "limits": self.limits.rlimits(),
            "watch_memory": watch_memory,
            "poll_s": 0.1,
            "status_fd": status_fd,
            "results_fd": results_fd,
        }
        inside = [sys.executable, "-I", "-S", f"{layout.tools}/inside.py", json.dumps(spec)]
        if not self.isolated:
            Path(layout.tmp).mkdir(parents=True, exist_ok=True)
            return inside
        argv = self._bwrap(item_dir, info_fd)
        if bound:
            argv += self._course_binds(item_dir, course)
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        return [*argv, "--", *inside]

    # ---- bubblewrap's arguments

    def _course_binds(self, item_dir: Path, course: str) -> list[str]:
        """The release read-only at ``course``, each of the item's files bound over its place:
        a file over the release's (an exercise module over its stub), a folder the release has
        empty (``hidden_tests/``) or that the item replaces (``REPLACED_WHOLE``: the references
        standing in for earlier exercises, over the release's ``solutions`` that cannot be
        imported) whole."""
        argv = ["--ro-bind", str(self.release), course]
        folders = [item_dir / "course"]
        while folders:
            folder = folders.pop()
            for path in sorted(folder.iterdir()):
                rel = path.relative_to(item_dir / "course").as_posix()
                there = self.release / rel
                whole = rel in REPLACED_WHOLE or (there.is_dir() and not any(there.iterdir()))
                if path.is_dir() and there.is_dir() and whole:
                    argv += ["--ro-bind", str(path), f"{course}/{rel}"]
                elif path.is_dir():
                    folders.append(path)
                elif there.is_file():
                    argv += ["--ro-bind", str(path), f"{course}/{rel}"]
                else:
                    raise ValueError(f"{rel} is not in the release: it cannot be bound over it")
        return argv

    def _bwrap(self, item_dir: Path, info_fd: int | None) -> list[str]:
        disk = str(int(self.limits.disk_mib * MIB))
        argv = [bwrap_path() or "bwrap", "--unshare-all", "--unshare-user"]
        if bwrap_version() >= DISABLE_USERNS_SINCE:
            argv.append("--disable-userns")
        argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", HOSTNAME]
        argv += ["--die-with-parent", "--new-session", "--as-pid-1"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        shown = []
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
                shown.append(Path(path))
        for name in ETC_FILES:
            path = Path("/etc") / name
            if path.exists() and _world_readable(path):
                argv += ["--ro-bind", str(path), str(path)]
        for name in ("passwd", "group", "hosts", "hostname"):
            argv += ["--ro-bind", str(self.private / "etc" / name), f"/etc/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--perms", "1777", "--size", disk, "--tmpfs", "/tmp"]
        argv += ["--perms", "1777", "--size", disk, "--tmpfs", "/dev/shm"]
        # after the private /tmp: a virtual environment may live under /tmp (a clone there)
        for prefix in python_prefixes():
            argv += ["--ro-bind", str(prefix), str(prefix)]
            shown.append(prefix)
        for path in self._covered(shown):
            argv += ["--tmpfs", str(path)]
        argv += ["--ro-bind", str(self.tools), TOOLS, "--ro-bind", str(self.release), RELEASE]
        argv += ["--ro-bind", str(item_dir / "course"), ITEM]
        argv += ["--remount-ro", "/proc", "--remount-ro", "/", "--chdir", "/tmp"]
        return argv

    def _covered(self, shown: list[Path]) -> list[Path]:
        """Folders inside a shown folder that must not be seen: the ones in ``hide``, and a
        ``solutions`` package installed into site-packages."""
        covered = [p for p in self.hide if any(p != s and p.is_relative_to(s) for s in shown)]
        for prefix in python_prefixes():
            covered += sorted(prefix.glob("lib/python3*/site-packages/solutions"))
        return [p for p in covered if p.is_dir()]

    def _write_etc(self) -> None:
        etc = self.private / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        uid = SANDBOX_UID
        (etc / "passwd").write_text(f"student:x:{uid}:{uid}:student:/tmp/home:/bin/sh\n")
        (etc / "group").write_text(f"student:x:{uid}:\n")
        (etc / "hosts").write_text(f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n")
        (etc / "hostname").write_text(f"{HOSTNAME}\n")


# ---- the seccomp filter
# A classic BPF program over struct seccomp_data {int nr; u32 arch; ...} (linux/seccomp.h), in the
# form bubblewrap's --seccomp reads: an array of struct sock_filter {u16 code; u8 jt, jf; u32 k}.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {  # the numbers of the calls the filter refuses, per architecture
    "x86_64": {"sched_setaffinity": 203, "memfd_create": 319, "shmget": 29},
    "aarch64": {"sched_setaffinity": 122, "memfd_create": 279, "shmget": 194},
}
X32_BIT = 0x40000000  # x86-64's x32 calls: never needed here, refused
BPF_LD_ABS_W, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO_EPERM = 0x00050000 | 1


def seccomp_filter(refuse: tuple[str, ...], machine: str | None = None) -> bytes | None:
    """The program that makes the calls ``refuse`` (and any other architecture's calls) fail with
    EPERM; None on an architecture this module does not know."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    numbers = [SYSCALLS[machine][name] for name in refuse]
    deny = 4 + len(numbers) + 1  # the index of the last instruction
    program = [
        (BPF_LD_ABS_W, 0, 0, 4),  # A = arch
        (BPF_JEQ_K, 0, deny - 2, AUDIT_ARCH[machine]),  # another architecture: deny
        (BPF_LD_ABS_W, 0, 0, 0),  # A = nr
        (BPF_JGE_K, deny - 4, 0, X32_BIT),
    ]
    for i, number in enumerate(numbers):
        program.append((BPF_JEQ_K, deny - (5 + i), 0, number))
    program += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO_EPERM)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def python_prefixes() -> list[Path]:
    """The folders the running Python needs: its prefix (the virtual environment) and base prefix
    (the installation it was made from), and where its executable really lives."""
    found: list[Path] = []
    real_bin = Path(os.path.realpath(sys.executable)).parent.parent
    for path in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, real_bin):
        path = Path(path).resolve()
        if str(path) in ("/", "/usr") or any(path.is_relative_to(p) for p in found):
            continue
        found = [p for p in found if not p.is_relative_to(path)] + [path]
    return found


def _world_readable(path: Path) -> bool:
    mode = path.stat().st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def check(sandbox: Sandbox, private: Path, seccomp: bytes | None = None) -> str | None:
    """None when an item can run in ``sandbox`` (under the seccomp program ``seccomp``); else
    what went wrong, and how to fix it."""
    if not sandbox.isolated:
        return None
    if bwrap_path() is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    version = bwrap_version()
    if version < BWRAP_AT_LEAST:
        found = ".".join(map(str, version)) or "of unknown version"
        need = ".".join(map(str, BWRAP_AT_LEAST))
        return f"bubblewrap {found} is too old: the grader needs {need} or later; {INSTALL_HINT}"
    item = private / "probe"
    (item / "course").mkdir(parents=True, exist_ok=True)
    pipes = {"results": os.pipe(), "status": os.pipe()}
    inputs = ()
    if seccomp is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, seccomp)
        os.close(write_end)
        inputs = (read_end,)
    argv = sandbox.command(
        item,
        [sys.executable, "-c", f"import os; assert os.getuid() == {SANDBOX_UID}"],
        cwd="/tmp",
        results_fd=pipes["results"][1],
        status_fd=pipes["status"][1],
        info_fd=None,
        seccomp_fd=inputs[0] if inputs else None,
    )
    log = private / "probe.log"
    done = run_item(
        argv,
        env=sandbox.env(sandbox.layout(item)),
        timeout=120,
        log=log,
        results_limit=0,
        sandboxed=True,
        pipes=pipes,
        inputs=inputs,
    )
    if done.exit_code != 0:
        why = log.read_text(errors="replace").strip()[-2000:] or f"exit code {done.exit_code}"
        return f"bubblewrap cannot start a sandbox here ({why}): {INSTALL_HINT}"
    return None
