"""`python -m labs.run`: the summary contract, the stub message, and the torchrun worker mode."""

import pytest

from labs.experiments.common import SUMMARY_KEYS
from tests.helpers import TORCHRUN, json_lines, run_cli, run_json


def test_json_summary_has_every_required_key():
    summary = run_json(
        "-m",
        "labs.run",
        "collectives",
        "--nproc",
        "2",
        "--json",
        "--impl",
        "solutions",
        "--vs-torch",
    )
    assert set(SUMMARY_KEYS) <= set(summary)
    assert (
        summary["lab"] == "collectives" and summary["nproc"] == 2 and summary["impl"] == "solutions"
    )
    assert summary["backend"] == "gloo"
    assert summary["exact_int"] and summary["bytes_match_theory"]
    assert summary["torch_step_time_s"] > 0


def test_unfilled_stub_gives_one_line_naming_the_function():
    proc = run_cli("-m", "labs.run", "collectives", "--nproc", "2", "--impl", "labs")
    assert proc.returncode == 3
    lines = [line for line in proc.stderr.splitlines() if "it/s" not in line and line.strip()]
    assert lines[-1].startswith("exercise ring_all_reduce is not written yet"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "invalid choice"),
        (["collectives", "--nproc", "0"], "nprocs must be an integer >= 1"),
        (["collectives", "--bogus"], "unrecognized arguments"),
        (["collectives", "--numel", "0"], "numel must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = run_cli("-m", "labs.run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_under_torchrun_each_rank_is_a_worker():
    proc = run_cli(
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "labs.run",
        "collectives",
        "--json",
        "--impl",
        "solutions",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = json_lines(proc.stdout)
    assert len(summaries) == 1, "only rank 0 prints the summary"
    summary = summaries[0]
    assert summary["nproc"] == 2 and summary["bytes_match_theory"] and summary["exact_int"]
