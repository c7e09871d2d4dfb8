"""Processes that end without the interpreter's teardown (``labs.runtime.exit``): the command
lines, the grader's pytest and its notebook kernels. What must hold: the exit status is the one
``sys.exit`` would give, the output is all there, the ``atexit`` handlers ran (the warm worker
pool's shutdown is one), and the teardown did not (it costs a second of CPU with torch loaded)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from labs.grade import PYTEST_THEN_EXIT
from tests.helpers import ROOT

# A module-level object whose finaliser runs only in the interpreter's teardown, and an atexit
# handler: each prints a line when it runs.
WITNESSES = """
import atexit

class Witness:
    def __del__(self):
        print("teardown ran", flush=True)

witness = Witness()
atexit.register(print, "atexit ran")
"""


def run_python(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("code", "status", "stderr"),
    [("3", 3, ""), ("None", 0, ""), ("'no such lab'", 1, "no such lab")],
)
def test_exit_without_teardown_keeps_status_output_and_atexit_and_skips_the_teardown(
    code, status, stderr
):
    script = WITNESSES + textwrap.dedent(f"""
        from labs.runtime.exit import exit_without_teardown
        print("output", end="")  # no newline, into a pipe: it waits in the buffer
        exit_without_teardown({code})
    """)
    proc = run_python("-c", script)
    assert proc.returncode == status
    assert proc.stdout.startswith("output")
    assert "atexit ran" in proc.stdout
    assert "teardown ran" not in proc.stdout
    assert proc.stderr.strip() == stderr
    # and the witness works: with sys.exit the teardown runs it
    plain = run_python(
        "-c",
        script.replace("exit_without_teardown(", "sys.exit(").replace(
            "from labs.runtime.exit import exit_without_teardown", "import sys"
        ),
    )
    assert plain.returncode == status and "teardown ran" in plain.stdout


def test_the_graders_pytest_keeps_pytests_status_and_summary_and_skips_the_teardown(tmp_path):
    (tmp_path / "conftest.py").write_text(WITNESSES)
    (tmp_path / "test_one.py").write_text(
        "def test_a():\n    pass\n\ndef test_b():\n    assert 0\n"
    )
    pytest_args = ("-c", PYTEST_THEN_EXIT, "-q", "-p", "no:cacheprovider", ".")
    proc = run_python(*pytest_args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # pytest's "tests failed"
    assert "1 failed, 1 passed" in proc.stdout
    assert "atexit ran" in proc.stdout and "teardown ran" not in proc.stdout
    (tmp_path / "test_one.py").write_text("def test_a():\n    pass\n")
    proc = run_python(*pytest_args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_graders_notebook_kernel_runs_atexit_and_skips_the_teardown(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    from labs.grade.run_notebook import KERNEL_EXITS_WITHOUT_TEARDOWN

    log = tmp_path / "log"
    cell = textwrap.dedent(f"""
        class Witness:
            def __del__(self):
                open({str(log)!r}, "a").write("teardown ran\\n")
        witness = Witness()
        __import__("atexit").register(lambda: open({str(log)!r}, "a").write("atexit ran\\n"))
        sorted(dir())
    """)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    client = NotebookClient(
        nb, timeout=60, kernel_name="python3", extra_arguments=[KERNEL_EXITS_WITHOUT_TEARDOWN]
    )
    client.execute()  # and a graceful shutdown, as the grader's
    names = nb.cells[0].outputs[0]["data"]["text/plain"]
    assert nb.cells[0].execution_count == 1  # the option's line is not counted
    assert "'atexit'" not in names and "'os'" not in names  # nor left in the namespace
    assert log.read_text() == "atexit ran\n"
