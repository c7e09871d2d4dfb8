"""`python -m labs.check EXERCISE`: the learner's loop runs that exercise's tests on their code and
prints one verdict per test, the reason, and a hint when the failure carries one."""

from __future__ import annotations

import pytest

from labs import check
from labs.runtime.impl import EXERCISES
from tests.helpers import ROOT, run_cli

# A stand-in for an exercise's test file: one test passes, one fails with a hint, one reaches an
# exercise that is not written yet (the message a generated stub raises), one is not an exercise.
FAKE_TESTS = """
import pytest

pytestmark = pytest.mark.exercise


def test_passes():
    assert 1 + 1 == 2


def test_fails_with_a_hint():
    assert False, (
        "gradients differ from the reference by 4x at step 1\\n"
        "hint: did you divide by the world size?"
    )


def test_unwritten():
    raise NotImplementedError(
        "exercise ring_all_reduce is not written yet: see its docstring and notebooks/00_x.ipynb"
    )


@pytest.mark.skip(reason="not an exercise")
def test_other():
    pass
"""
FAKE_CONFTEST = (
    "def pytest_configure(config):\n"
    '    config.addinivalue_line("markers", "exercise: runs learner code")\n'
)


def _fake_tests(tmp_path, text: str):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(FAKE_CONFTEST)
    (tests / "test_collectives.py").write_text(text)
    (tests / "test_ddp.py").write_text("def test_not_collectives():\n    assert False\n")
    return tests


def test_every_exercise_has_test_files_and_the_rule_is_the_graders():
    from labs import release

    for name in EXERCISES:
        files = check.exercise_test_files(name)
        assert files, f"no tests/test_{name}*.py"
        assert all(release.lab_of_test_file(f, list(EXERCISES)) == name for f in files)
    assert check.lab_of_test_file(ROOT / "tests/test_tensor_parallel_comm.py", list(EXERCISES)) == (
        "tensor_parallel_comm"
    )
    assert [f.name for f in check.exercise_test_files("zero")] == [
        "test_zero.py",
        "test_zero_api.py",
        "test_zero_checkpoint.py",
    ]


@pytest.mark.parametrize(
    "outcome, message, expected",
    [
        ("passed", "", check.Verdict("test_x.py::t", "PASS")),
        (
            "failed",
            "AssertionError: losses differ at step 3\nassert False",
            check.Verdict("test_x.py::t", "FAIL", "losses differ at step 3"),
        ),
        (
            "failed",
            "labs.runtime.errors.RankError: rank 1 raised AssertionError: bytes 12 != 16\n"
            "  hint: did you send the chunk you just received?\n--- traceback of rank 1 ---",
            check.Verdict(
                "test_x.py::t",
                "FAIL",
                "labs.runtime.errors.RankError: rank 1 raised AssertionError: bytes 12 != 16",
                hint="did you send the chunk you just received?",
            ),
        ),
        (
            "failed",
            "RankError: rank 0 raised NotImplementedError: exercise ZeRO3.gather is not written "
            "yet: see its docstring and notebooks/03_zero_and_fsdp.ipynb",
            check.Verdict(
                "test_x.py::t", "FAIL", "not written yet: ZeRO3.gather", unwritten="ZeRO3.gather"
            ),
        ),
        ("skipped", "Skipped: needs 2 GPUs", check.Verdict("test_x.py::t", "SKIP", "needs 2 GPUs")),
    ],
)
def test_verdict_of_a_test(outcome, message, expected):
    assert check.verdict_of("tests/test_x.py::t", outcome, message) == expected


def test_exit_status_ranks_a_wrong_answer_above_unwritten_code():
    passed = check.Verdict("a", "PASS")
    wrong = check.Verdict("b", "FAIL", "losses differ")
    unwritten = check.Verdict("c", "FAIL", "not written yet: f", unwritten="f")
    assert check.exit_status([passed]) == 0
    assert check.exit_status([passed, unwritten]) == 3
    assert check.exit_status([wrong, unwritten]) == 1


def test_cli_prints_a_verdict_per_test_with_the_hint_and_exits_1(tmp_path):
    tests = _fake_tests(tmp_path, FAKE_TESTS)
    proc = run_cli("-m", "labs.check", "collectives", "--tests", str(tests), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "PASS  test_collectives.py::test_passes" in lines
    assert (
        "FAIL  test_collectives.py::test_fails_with_a_hint: "
        "gradients differ from the reference by 4x at step 1"
    ) in lines
    assert "      hint: did you divide by the world size?" in lines
    assert "FAIL  test_collectives.py::test_unwritten: not written yet: ring_all_reduce" in lines
    assert "SKIP  test_collectives.py::test_other: not an exercise" in lines
    assert "test_not_collectives" not in proc.stdout  # another exercise's file
    assert "collectives: 1 passed, 1 failed, 1 waiting for code not written yet" in proc.stdout


def test_cli_exits_3_when_only_unwritten_code_fails_and_2_for_bad_names(tmp_path):
    tests = _fake_tests(tmp_path, FAKE_TESTS)
    proc = run_cli(
        "-m", "labs.check", "collectives", "--tests", str(tests), "-k", "not hint", timeout=120
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Not written yet in labs/collectives.py: ring_all_reduce" in proc.stdout
    bad = run_cli("-m", "labs.check", "colectives", timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'colectives'" in bad.stderr
    assert "collectives" in bad.stderr.split("choose from")[1]
    none = run_cli("-m", "labs.check", "collectives", "--tests", str(tests), "-k", "zzz")
    assert none.returncode == 2 and "matches -k 'zzz'" in none.stderr


@pytest.mark.slow
def test_on_the_stubs_every_test_is_not_written_yet_and_on_the_solutions_all_pass():
    """The real thing, on notebook 00's exercise: the learner's stub, then the reference."""
    selected = ("-k", "test_integer_all_reduce_is_exact or test_non_contiguous_tensor")
    stubs = run_cli("-m", "labs.check", "collectives", *selected, env={"LABS_IMPL": "solutions"})
    assert stubs.returncode == 3, stubs.stdout + stubs.stderr  # --impl labs whatever the env says
    verdicts = [line for line in stubs.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 5
    assert all(line.endswith(": not written yet: ring_all_reduce") for line in verdicts)
    assert "tests run on labs/collectives.py" in stubs.stdout
    reference = run_cli("-m", "labs.check", "collectives", "--impl", "solutions", *selected)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert reference.stdout.count("PASS  test_collectives.py::") == 5
    assert "PASS: every check of this exercise passes." in reference.stdout


FAKE_PARTS = """
import pytest

pytestmark = pytest.mark.exercise


def test_core_passes():
    assert True


@pytest.mark.part("buckets")
def test_buckets_unwritten():
    raise NotImplementedError(
        "exercise BucketedDDP.__init__ is not written yet: see its docstring and notebooks/02_x"
    )


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.part("mixed-precision"))])
def test_mixed(n):
    assert n == 1
"""


def test_part_runs_one_part_and_the_summary_says_how_each_part_stands(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(FAKE_CONFTEST)
    (tests / "test_ddp.py").write_text(FAKE_PARTS)
    core = run_cli("-m", "labs.check", "ddp", "--tests", str(tests), "--part", "core", timeout=120)
    assert core.returncode == 0, core.stdout + core.stderr
    assert "checking ddp, part core:" in core.stdout
    assert [line for line in core.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))] == [
        "PASS  test_ddp.py::test_core_passes",
        "PASS  test_ddp.py::test_mixed[1]",
    ]
    assert "PASS: every check of part core passes." in core.stdout
    everything = run_cli("-m", "labs.check", "ddp", "--tests", str(tests), timeout=120)
    assert everything.returncode == 1, everything.stdout
    assert "  core: PASS (2 tests, about 60 min)" in everything.stdout
    assert "  buckets (extension): not written yet (1 tests, about 25 min)" in everything.stdout
    assert "  mixed-precision (extension): FAIL (1 tests, about 25 min)" in everything.stdout
    assert "The core passes: the next notebooks can run on your code." in everything.stdout
    listed = run_cli("-m", "labs.check", "ddp", "--tests", str(tests), "--list", timeout=120)
    assert listed.returncode == 0 and "buckets (extension), about 25 min: 1 tests" in listed.stdout
    bad = run_cli("-m", "labs.check", "ddp", "--tests", str(tests), "--part", "bucket", timeout=60)
    assert bad.returncode == 2 and "has no part 'bucket'; its parts: core, buckets" in bad.stderr
