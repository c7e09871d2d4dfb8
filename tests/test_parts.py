"""A core path per lab: every function a learner writes names its part (``PARTS`` of its module,
``Part:`` in its docstring), every test checks a part that exists, every part has tests, and the
core passes before a line of the extensions is written (``labs.check.parts``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from labs import stubs
from labs.check.parts import CORE, PART_LINE, module_parts
from labs.runtime.impl import EXERCISES
from tests.helpers import ROOT, run_cli

SOLUTIONS = ROOT / "solutions"
WITH_EXTENSIONS = [
    name for name in EXERCISES if len(module_parts((SOLUTIONS / f"{name}.py").read_text())) > 1
]


@pytest.mark.parametrize("name", EXERCISES)
def test_every_function_a_learner_writes_names_a_part_of_its_lab(name):
    source = (SOLUTIONS / f"{name}.py").read_text()
    parts = module_parts(source)
    assert "\nPARTS = " in source, f"solutions/{name}.py declares no PARTS"
    assert next(iter(parts)) == CORE and all(m > 0 for m in parts.values()), parts
    named = stubs.block_parts(source)
    unnamed = [function for function, part in named.items() if part is None]
    assert not unnamed, f"solutions/{name}.py: no 'Part:' line in the docstring of {unnamed}"
    for function, part in named.items():
        assert part in parts, f"{name}.{function} names part {part!r}, not one of {list(parts)}"
    for line in PART_LINE.finditer(source):  # a reader tells the core from an extension at once
        part = line.group(1)
        said = f"Part: {part} (an extension)" if part != CORE else "Part: core"
        assert line.group(0).strip().startswith(said), line.group(0)
    # a part's code is its functions, or lines added to an earlier part's functions (their Part:
    # lines say which), or the module says it asks for none
    for part in parts:
        assert (
            part in named.values()
            or f"with {part}" in source
            or f'"{part}" part asks for no code' in source
        ), f"{name}: part {part!r} has no function, no lines and no word on why"


def test_every_test_checks_a_part_of_its_lab_and_every_part_has_tests():
    code = (
        "import json, sys\n"
        "from labs.check import test_parts\n"
        "from labs.runtime.impl import EXERCISES\n"
        "json.dump({name: test_parts(name) for name in EXERCISES}, sys.stdout)\n"
    )
    proc = run_cli("-c", code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, tests in listed.items():
        parts = module_parts((SOLUTIONS / f"{name}.py").read_text())
        unknown = {test: part for test, part in tests.items() if part not in parts}
        assert not unknown, f"{name}: tests of parts it does not have: {unknown}"
        assert set(tests.values()) == set(parts), (name, sorted(set(tests.values())), list(parts))


def test_a_copy_with_only_the_core_written_keeps_the_extensions_unwritten():
    """``make_stub(keep={"core"})``: the core's functions keep their solution, every other
    function raises NotImplementedError, as a learner's module does before the extensions."""
    source = (SOLUTIONS / "ddp.py").read_text()
    core = stubs.make_stub(source, "ddp.py", keep={CORE})
    assert core.count("is not written yet") == 5  # BucketedDDP x3, MixedPrecisionOptimizer x2
    for cut in ("BucketedDDP.__init__", "MixedPrecisionOptimizer.step"):
        assert f"exercise {cut} is not written yet" in core
    assert "self.pending.append((param.grad, reduced, work))" in core  # OverlappedDDP's hook
    every_part = stubs.make_stub(source, "ddp.py", keep=module_parts(source))
    assert "is not written yet" not in every_part and "### BEGIN SOLUTION" not in every_part


def _notebook_exercises(name: str) -> list[str]:
    """The exercises of ``name``'s notebook (04 has two: its modules import each other)."""
    notebook = stubs.notebook_name((SOLUTIONS / f"{name}.py").read_text())
    return [
        n for n in EXERCISES if stubs.notebook_name((SOLUTIONS / f"{n}.py").read_text()) == notebook
    ]


def _core_only_course(tmp_path, name: str):
    """A copy of the course where the exercise modules of ``name``'s notebook have only their
    core written."""
    course = tmp_path / "course"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for folder in ("labs", "solutions", "tests"):
        shutil.copytree(ROOT / folder, course / folder, ignore=ignore)
    for file in ("conftest.py", "pyproject.toml"):
        shutil.copy(ROOT / file, course / file)
    for sibling in _notebook_exercises(name):
        source = (SOLUTIONS / f"{sibling}.py").read_text()
        core = stubs.make_stub(source, f"{sibling}.py", {CORE})
        (course / "labs" / f"{sibling}.py").write_text(core)
    return course


def _check(course, name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m labs.check name args`` in the copy: its labs/ is found before the installed
    course's (``python -m`` puts the working directory first); the exercises of other notebooks
    run their reference, as if the learner had finished them. Its pytest keeps its temporary
    files in the copy."""
    mine = _notebook_exercises(name)
    others = ",".join(n for n in EXERCISES if n not in mine)
    env = {k: v for k, v in os.environ.items() if k not in ("LABS_IMPL", "LABS_REFERENCE")}
    env["PYTEST_ADDOPTS"] = f"--basetemp={course / 'pytest'}"
    return subprocess.run(
        [sys.executable, "-m", "labs.check", name, "--reference", others, *args],
        cwd=course,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_EXTENSIONS)
def test_the_core_passes_before_a_line_of_the_extensions_is_written(tmp_path, name):
    course = _core_only_course(tmp_path, name)
    proc = _check(course, name, "--part", CORE)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert proc.returncode == 0 and verdicts, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert all(line.startswith("PASS") for line in verdicts)
    assert f"tests run on labs/{name}.py" in proc.stdout


@pytest.mark.slow
def test_an_extension_of_the_core_only_copy_waits_for_its_code(tmp_path):
    """The copy really lacks the extensions: their tests stop at the unwritten function."""
    course = _core_only_course(tmp_path, "ddp")
    proc = _check(course, "ddp", "--part", "buckets", "-k", "backward_order")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "not written yet: BucketedDDP.__init__" in proc.stdout


def _markdown(notebook: str) -> list[str]:
    import nbformat

    cells = nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
    return [c.source for c in cells if c.cell_type == "markdown"]


@pytest.mark.parametrize("name", EXERCISES)
def test_the_notebook_states_each_part_its_time_and_marks_the_extensions(name):
    """Its Time paragraph gives the core's minutes (and a Parts table row per part, PARTS'
    minutes), its objectives name every extension, each extension's section opens with
    "**Extension: NAME**", and the final Checks come after every part."""
    source = (SOLUTIONS / f"{name}.py").read_text()
    parts = module_parts(source)
    notebook = stubs.notebook_name(source)
    cells = _markdown(notebook)
    intro = next(c for c in cells if "**Time**" in c)
    assert "In this notebook you will" in intro, (
        f"{notebook}: the Time line is not in the objectives"
    )
    if len(parts) == 1:
        assert f"about {parts[CORE]} minutes" in intro and "one part" in intro, intro
        return
    assert f"about {parts[CORE]} minutes on the core path" in intro, intro
    for part, minutes in parts.items():
        kind = "" if part == CORE else " (extension)"
        row = next(
            (line for line in intro.splitlines() if line.startswith(f"| **{part}**{kind} |")), ""
        )
        assert row.endswith(f"| {minutes} min |"), f"{notebook}: no Parts row for {part}: {row!r}"
        if part != CORE:
            objectives = intro.split("**Before you start**")[0]
            assert f"extension **{part}**" in objectives or (
                f"extension **{part.replace('-', ' ')}**" in objectives
            ), f"{notebook}: the objectives do not name the extension {part}"
            assert any(f"**Extension: {part}**" in c for c in cells), (
                f"{notebook}: no section opens with **Extension: {part}**"
            )
    checks = next(i for i, c in enumerate(cells) if re.search(r"^## Checks", c, re.M))
    assert not any(re.search(r"^## \d+\.", c, re.M) for c in cells[checks + 1 :]), (
        f"{notebook}: a numbered section comes after the final Checks"
    )
    assert not any("**Extension: " in c for c in cells[checks + 1 :])
