"""Small helpers for tests: process bookkeeping and running the CLIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_pids(pid: int | None = None) -> set[int]:
    """PIDs of the live (non-zombie) children of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def run_cli(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repository root with LABS_IMPL from ``env`` or this process."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def run_json(*args, **kw) -> dict:
    proc = run_cli(*args, **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def find_widget(root, css_class: str):
    """The widget under ``root`` (an ipywidgets container) that carries ``css_class``; fails the test if none."""
    stack = [root]
    while stack:
        widget = stack.pop()
        if css_class in widget._dom_classes:
            return widget
        stack += list(getattr(widget, "children", ()))
    raise AssertionError(f"no widget with class {css_class}")
