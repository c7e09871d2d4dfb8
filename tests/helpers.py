"""Small helpers for tests: is a process alive, running the CLIs, finding a widget."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from labs.runtime.proc import parents

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the venv's, beside its python
# labs.theory's options for the tiny preset's model, spelled out (a CLI run without --preset)
TINY_MODEL_ARGS = "--layers 2 --hidden 64 --heads 8 --kv-heads 4 --ffn 128 --vocab 256".split()


def alive(pid: int) -> bool:
    return pid in parents()


def run_cli(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repository root, LABS_IMPL from ``env`` or this process."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_child(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a child process forked from this one; its return value.

    How a test runs exercise code that needs no process group of its own. Grading runs the tests
    in a pytest process that must never run a student's code itself (``labs.grade``'s guard
    refuses it), so the code runs in a child (``labs.launch``: one gloo rank, one intra-op thread
    as every rank has: OpenMP's pool does not survive a fork) and only plain data comes back
    (numbers, detached tensors, containers); the test asserts on that data here."""
    from labs.runtime.launcher import launch

    return _from_plain(launch(_call, 1, fn, args, kwargs, backend="gloo", timeout=600)[0])


# A lab's verdict (RunSummary, Check) is not plain data: it travels home as its fields, tagged.
_TAG = "__course_dataclass__"


def _call(fn, args, kwargs):
    import torch.distributed as dist

    # fn may launch ranks of its own: they must not inherit a group, nor see a rank's variables
    dist.destroy_process_group()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    return _to_plain(fn(*args, **kwargs))


def _verdict_classes() -> dict:
    from labs.experiments.checks import Check
    from labs.experiments.common import RunSummary

    return {"Check": Check, "RunSummary": RunSummary}


def _to_plain(x):
    """``x`` with every RunSummary and Check in it replaced by a tagged dict of its fields."""
    if type(x) in _verdict_classes().values():
        fields = {f.name: _to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {_TAG: type(x).__name__, **fields}
    if type(x) is dict:
        return {k: _to_plain(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_to_plain(v) for v in x)
    return x


def _from_plain(x):
    """``_to_plain``'s inverse, in the parent."""
    if type(x) is dict:
        fields = {k: _from_plain(v) for k, v in x.items() if k != _TAG}
        return _verdict_classes()[x[_TAG]](**fields) if _TAG in x else fields
    if type(x) in (list, tuple):
        return type(x)(_from_plain(v) for v in x)
    return x


def junit_outcomes(path) -> dict[str, str]:
    """classname::name -> "passed", "failure", "error" or "skipped".

    Read from a pytest ``--junitxml`` report."""
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = tags[0] if tags else "passed"
    return outcomes


def json_lines(stdout: str) -> list[dict]:
    """The JSON objects a run printed, one per line (under torchrun, rank 0's summary only)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_json(*args, **kw) -> dict:
    proc = run_cli(*args, **kw)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_lab_main(*argv: str) -> tuple[int, str, str]:
    """``python -m labs.run <argv>`` as ``labs.run``'s ``main`` runs it, in a child forked from this
    process (``in_child``: the pytest process never runs a learner's code): its exit status, stdout
    and stderr. Forked, the run costs no fresh interpreter (``import torch`` alone is ~3
    CPU-seconds on 2 cores, paid again by the stub check); ``tests/test_run_cli.py`` runs the
    command itself (``python -m labs.run``, torchrun)."""
    return in_child(_main_captured, list(argv))


def _main_captured(argv: list[str]) -> tuple[int, str, str]:
    from labs.run import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def lab_json(*argv: str) -> dict:
    """The summary ``python -m labs.run <argv> --json`` prints (``run_lab_main``); fails unless the
    run exits 0."""
    code, out, err = run_lab_main(*argv)
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def check(summary, name: str) -> dict:
    """The check named ``name`` (the first of that name) of a lab's summary, a ``RunSummary`` or
    the dict ``--json`` printed: its name, ok, measured, expected, tolerance, where, hint."""
    checks = summary["checks"] if isinstance(summary, dict) else summary.to_dict()["checks"]
    found = [c for c in checks if c["name"] == name]
    assert found, f"no check named {name!r}; the checks: {[c['name'] for c in checks]}"
    return found[0]


def checks_ok(summary, *names: str) -> bool:
    """Whether the checks ``names`` of a lab's summary (``check``) all passed."""
    return all(check(summary, name)["ok"] for name in names)


def find_widget(root, css_class: str):
    """The widget under ``root`` (an ipywidgets container) that carries ``css_class``.

    Fails the test if there is none."""
    stack = [root]
    while stack:
        widget = stack.pop()
        if css_class in widget._dom_classes:
            return widget
        stack += list(getattr(widget, "children", ()))
    raise AssertionError(f"no widget with class {css_class}")


def assert_torch_free(code: str, timeout: float = 120) -> None:
    """Run ``code`` in a fresh interpreter (matplotlib's Agg backend); fail unless it ran to the end
    without importing torch (the theory and its widgets must work where torch is not installed)."""
    proc = run_cli(
        "-c",
        f"import sys\n{code}\nassert 'torch' not in sys.modules, 'torch imported'",
        env={"MPLBACKEND": "Agg"},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr


def require_bubblewrap() -> None:
    """Skip a grading test without bubblewrap, the grader's sandbox; fail under CI, which installs
    it (.ci/run)."""
    import shutil

    import pytest

    if shutil.which("bwrap") is None:
        if os.environ.get("CI"):
            pytest.fail("bubblewrap is not installed: .ci/run installs it")
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")


def NudgingNotebookClient(nb, **kw):  # noqa: N802 (a class, made on first use)
    """nbclient's ``NotebookClient`` that nudges a kernel which seems to have missed a request.

    After a cell with widgets, the kernel now and then leaves the next execute request unread
    until the cell timeout interrupts it (nbclient issue 312): a kernel_info request sent while the
    client waits gives the kernel's socket a new event, and it reads both. The grader's notebook
    runner (labs/grade/run_notebook.py, which may import nothing of the course) does the same."""
    import time
    from queue import Empty

    from nbclient import NotebookClient

    class Client(NotebookClient):
        async def async_start_new_kernel_client(self):
            client = await super().async_start_new_kernel_client()
            get_msg = client.shell_channel.get_msg

            async def get_msg_nudging(timeout=None):
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    left = 5.0 if deadline is None else max(deadline - time.monotonic(), 0)
                    try:
                        return await get_msg(timeout=min(5.0, left))
                    except Empty:
                        if deadline is not None and time.monotonic() >= deadline:
                            raise
                        client.kernel_info()

            client.shell_channel.get_msg = get_msg_nudging
            return client

    return Client(nb, **kw)
