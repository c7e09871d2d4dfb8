"""`python -m labs.release`: the student release holds the stubs, cleared notebooks and the public
tests, defaults to the learner's code, and its tests fail on the stubs and pass once the exercises
are written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import nbformat
import pytest

from labs import release
from labs.release import build_release, check_release
from tests.helpers import ROOT, junit_outcomes, run_cli


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "course"
    manifest = build_release(out)
    return out, manifest


def test_release_follows_every_rule(released):
    out, _ = released
    assert check_release(out) == []


def test_no_solutions_hidden_tests_or_instructor_tools(released):
    out, manifest = released
    for path in (
        "solutions",
        "hidden_tests",
        ".ci",
        "labs/grade",
        "labs/release",
        "labs/stubs",
        *release.INSTRUCTOR_TOOLS,
        *release.INSTRUCTOR_TESTS,
    ):
        assert not (out / path).exists(), path
    assert not list(out.rglob("__pycache__")) and not (out / ".venv").exists()
    assert manifest["public_tests"] and "tests/test_collectives.py" in manifest["public_tests"]
    assert (
        json.loads((out / ".release.json").read_text())["exercises"]["collectives"]
        == "00_setup_and_collectives.ipynb"
    )


def test_exercise_modules_are_the_generated_stubs(released):
    out, manifest = released
    for name in manifest["exercises"]:
        text = (out / "labs" / f"{name}.py").read_text()
        assert text == release.generated_stub(name)
        assert "NotImplementedError" in text and "### BEGIN SOLUTION" not in text


def test_notebooks_have_no_outputs_and_no_widget_state(released):
    out, manifest = released
    assert manifest["notebooks"], "the release has no notebooks"
    for rel in manifest["notebooks"]:
        nb = nbformat.read(out / rel, as_version=4)
        assert "widgets" not in nb.metadata
        source = nbformat.read(ROOT / rel, as_version=4)
        assert [c.source for c in nb.cells] == [c.source for c in source.cells], (
            f"{rel}: cells changed"
        )
        for cell in nb.cells:
            assert cell.cell_type != "code" or (
                cell.outputs == [] and cell.execution_count is None
            ), rel


def test_the_switch_defaults_to_the_learners_code(released):
    out, _ = released
    assert 'setdefault("LABS_IMPL", "labs")' in (out / "conftest.py").read_text()
    script = (out / "scripts" / "test.sh").read_text()
    assert 'LABS_IMPL="${LABS_IMPL:-labs}"' in script and "LABS_IMPL=solutions" not in script
    assert "LABS_IMPL=solutions" not in (out / "scripts" / "course.sh").read_text()
    assert "Student release" in (out / "README.md").read_text().split("\n\n")[1]


def test_the_readme_tells_the_learner_the_loop_and_that_tests_run_on_their_code(released):
    out, _ = released
    readme = (out / "README.md").read_text()
    assert "against the reference solutions" in (ROOT / "README.md").read_text().replace("\n", " ")
    assert not release.README_ON_SOLUTIONS.search(readme)
    banner = readme.split("\n\n")[1]
    for step in ("labs/<exercise>.py", "python -m labs.check <exercise>", "hint", "your code"):
        assert step in banner, step


def test_folders_named_by_the_grader_are_left_out(monkeypatch):
    """labs.grade passes its submissions and report folders when they are inside the repository:
    they are never part of a graded copy (a classmate's work, the scores)."""
    files = release.source_files() + ["submissions/ann/notes.txt", "report/summary.txt"]
    monkeypatch.setattr(release, "source_files", lambda: files)
    assert {"submissions/ann/notes.txt", "report/summary.txt"} <= set(release.release_plan())
    plan = release.release_plan(exclude=("submissions", "report"))
    assert not [rel for rel in plan if rel.startswith(("submissions/", "report/"))]
    assert "labs/collectives.py" in plan


def test_learner_test_script_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="no longer sets LABS_IMPL=solutions"):
        release.learner_test_script("exec pytest\n")


def test_cli_writes_a_folder_and_an_archive_and_refuses_a_full_folder(tmp_path):
    proc = run_cli("-m", "labs.release", str(tmp_path / "course"), "--archive", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "course" / "labs" / "collectives.py").exists()
    with zipfile.ZipFile(tmp_path / "course.zip") as archive:
        names = archive.namelist()
    assert "course/labs/collectives.py" in names and not any(
        n.startswith("course/solutions/") for n in names
    )
    again = run_cli("-m", "labs.release", str(tmp_path / "course"), timeout=300)
    assert again.returncode == 2 and "is not empty" in again.stderr
    inside = run_cli("-m", "labs.release", str(ROOT.parent), timeout=300)
    assert inside.returncode == 2 and "would contain the course itself" in inside.stderr


def _pytest_in(folder, *args, timeout=1800):
    """pytest inside the released folder as a student runs it: its conftest and pyproject, LABS_IMPL
    unset."""
    report = folder / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "LABS_IMPL" and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(folder)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={report}",
            f"--rootdir={folder}",
            "-c",
            str(folder / "pyproject.toml"),
            *args,
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, (junit_outcomes(report) if report.exists() else {})


@pytest.mark.slow
def test_public_tests_fail_on_the_stubs(released, tmp_path):
    """With LABS_IMPL left to the release's default, a lab's public tests run the released stubs and
    fail. (One lab shows the default; tests/test_stubs.py proves every exercise test fails on every
    stub.)"""
    out = tmp_path / "course"
    shutil.copytree(released[0], out)
    proc, outcomes = _pytest_in(
        out, "-m", "exercise", "--timeout", "120", "tests/test_collectives.py"
    )
    assert outcomes, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = [name for name, outcome in outcomes.items() if outcome in ("passed", "skipped")]
    assert not passed, f"these public tests pass or skip on the stubs: {passed}"


@pytest.mark.slow
def test_public_tests_pass_once_the_exercises_are_written(released, tmp_path):
    """The solutions copied into labs/ (what a student who finished hands in): the released runtime
    tests and the collectives lab's tests pass; every public test file still collects without
    solutions/."""
    out = tmp_path / "course"
    shutil.copytree(released[0], out)
    for path in (ROOT / "solutions").glob("*.py"):
        if path.name != "__init__.py":
            shutil.copy(path, out / "labs" / path.name)
    collected, outcomes = _pytest_in(out, "--collect-only", "tests")
    assert collected.returncode == 0, collected.stdout[-3000:]
    runtime = [
        t
        for t in released[1]["public_tests"]
        if release.lab_of_test_file(out / t, release.exercise_names()) in (None, "collectives")
    ]
    proc, outcomes = _pytest_in(out, "-m", "not slow", "--timeout", "300", *runtime)
    failed = [name for name, outcome in outcomes.items() if outcome in ("failure", "error")]
    assert outcomes and not failed, f"{failed}\n{proc.stdout[-3000:]}"
