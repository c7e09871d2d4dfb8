"""The suite's ``--cpu-profile`` (tests/cpu_profile.py) counts what a test's children burn, not
the time it waits, and reaches the controller from pytest-xdist's workers."""

from __future__ import annotations

import json

from tests.helpers import run_cli

TESTS = """
import subprocess, sys, time

def test_a_child_spins():
    spin = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)

def test_it_sleeps():
    time.sleep(0.6)
"""


def test_cpu_profile_counts_reaped_children_and_not_waiting(tmp_path):
    (tmp_path / "test_two.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out" / "cpu.json"
    proc = run_cli(
        "-m",
        "pytest",
        str(tmp_path / "test_two.py"),
        "-c",
        str(tmp_path / "pytest.ini"),
        "-p",
        "xdist.plugin",
        "-p",
        "tests.cpu_profile",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--cpu-profile",
        str(out),
        env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # nbval, anyio ...: seconds, and not needed
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    spins, sleeps = (
        data["tests"][f"test_two.py::{name}"] for name in ("test_a_child_spins", "test_it_sleeps")
    )
    assert spins["user_s"] + spins["sys_s"] >= 0.5, spins  # the child's 0.6 CPU-s, reaped
    assert sleeps["user_s"] + sleeps["sys_s"] < 0.3 <= 0.6 <= sleeps["wall_s"], sleeps
    [(name, per_file)] = data["files"].items()
    assert name == "test_two.py" and per_file["tests"] == 2
    assert abs(data["user_s"] + data["sys_s"] - per_file["user_s"] - per_file["sys_s"]) < 1e-6
    assert "CPU time per file" in proc.stdout and "test_two.py" in proc.stdout
