"""Offline setup: ``bash scripts/setup.sh --wheelhouse DIR`` builds a folder of wheels, and
``WHEELHOUSE=DIR bash scripts/setup.sh`` (what ``course.sh`` and ``test.sh`` run first) installs
from it into a fresh virtual environment with no index and no network.

Kept small: a copy of the course whose requirements.txt pins one package (tqdm) stands for the full
one, so the wheelhouse holds that package, pip, setuptools and wheel (what the editable install of
the course needs to build), about 4 MB. Building it needs the package index pip is configured with,
as an instructor's does; the install then runs with the index off (``PIP_NO_INDEX``, no pip
configuration, no find-links) and, where the kernel allows a network namespace, with no network at
all (``unshare``), else through a proxy that does not exist. The full wheelhouse (144 wheels,
374 MB) was measured by hand: see docs/instructors.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

PIN = "tqdm==4.70.1"
COURSE = ("pyproject.toml", "README.md", "scripts/setup.sh", "scripts/pip_for_platform.py")


def _course_copy(dst):
    """The files setup.sh and the editable install read, with a one-package requirements.txt."""
    for rel in COURSE:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
    for package in ("labs", "solutions"):
        shutil.copytree(
            ROOT / package, dst / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    (dst / "requirements.txt").write_text(f"{PIN}\n")
    return dst


def _offline() -> tuple[list[str], dict[str, str]]:
    """(a command prefix, environment overrides) that cut the network: a network namespace of its
    own when ``unshare`` can make one, else a proxy on a port nobody listens on."""
    unshare = ["unshare", "--net", "--map-root-user"]
    if shutil.which("unshare") and subprocess.run([*unshare, "true"]).returncode == 0:
        return unshare, {}
    dead = "http://127.0.0.1:9"
    return [], {"http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead}


def _setup(course, *args, env=None, prefix=(), timeout=600):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    full.update({"PYTHON": sys.executable, **(env or {})})
    return subprocess.run(
        [*prefix, "bash", "scripts/setup.sh", *args],
        cwd=course,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_wheelhouse_installs_the_course_with_no_index_and_no_network(tmp_path):
    course = _course_copy(tmp_path / "course")
    wheelhouse = tmp_path / "wheelhouse"
    # built as an instructor builds it: from the package index pip is configured with
    built = subprocess.run(
        ["bash", "scripts/setup.sh", "--wheelhouse", str(wheelhouse)],
        cwd=course,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, f"the wheelhouse was not built (is an index reachable?):\n{built}"
    names = sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl"))
    assert {"pip", "setuptools", "tqdm", "wheel"} <= set(names), names
    assert "torch" not in names  # the reduced requirements do not ask for it

    prefix, proxy = _offline()
    env = {
        "WHEELHOUSE": str(wheelhouse),
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,  # no configured index or find-links: the wheelhouse only
        **proxy,
    }
    installed = _setup(course, env=env, prefix=prefix)
    assert installed.returncode == 0, f"offline install failed:\n{installed}"
    assert f"from {wheelhouse}" in installed.stdout
    venv_python = course / ".venv" / "bin" / "python"
    probe = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import importlib.metadata as m, importlib.util as u; print(m.version('tqdm'),"
            " m.version('llm-parallelism-labs'), u.find_spec('labs').origin)",
        ],
        cwd=tmp_path,  # not the repository, whose labs/ the current directory would shadow
        capture_output=True,
        text=True,
        check=True,
    )
    tqdm_version, course_version, labs_origin = probe.stdout.split()
    assert tqdm_version == PIN.split("==")[1] and course_version == "0.1.0"
    assert labs_origin == str(course / "labs" / "__init__.py"), "the course is installed editable"
    assert list((course / ".venv").glob(".stamp-*")), "setup.sh records what it installed"


def test_a_missing_wheelhouse_is_a_clear_error(tmp_path):
    course = _course_copy(tmp_path / "course")
    proc = _setup(course, env={"WHEELHOUSE": str(tmp_path / "nowhere")}, timeout=120)
    assert proc.returncode == 1
    assert "is not a folder" in proc.stderr and "--wheelhouse" in proc.stderr
    assert not (course / ".venv").exists(), "nothing is installed from a folder that is not there"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--python", "3.12"], "go with --wheelhouse DIR"),
        (["--wheelhouse", "w", "--python", "3.10"], "the course runs on Python 3.11, 3.12 or 3.13"),
        (["--wheelhouse"], "--wheelhouse needs a folder"),
        (["--bogus"], "unknown option --bogus"),
    ],
)
def test_bad_wheelhouse_options_say_what_to_change(tmp_path, args, message):
    course = _course_copy(tmp_path / "course")
    proc = _setup(course, *args, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
