"""Write the student release of the course: the same course, without the answers.

    python -m labs.release OUT_DIR             # a folder students clone or unpack
    python -m labs.release OUT_DIR --archive   # ... and OUT_DIR.zip next to it
    python -m labs.release OUT_DIR --reveal collectives,ddp
                                               # ... with the reference of these exercises
                                               # (after their deadline), and no other

What the release holds, and how it differs from this (the instructor's) repository:

===========================  ================================================================
``labs/<exercise>.py``      the learner stubs, generated from ``solutions/`` (``labs.stubs``),
                            whatever ``labs/`` holds here
``notebooks/NN_*.ipynb``    outputs, execution counts and widget state cleared
``tests/``                  the public tests: each lab's tests (``tests/test_<exercise>*.py``)
                            and the runtime tests; not the instructor-only files below
``conftest.py``             defaults ``LABS_IMPL`` to ``labs`` (here it defaults to solutions)
``scripts/test.sh``         runs the suite on the learner's code (here: on the solutions)
``README.md``               a first paragraph saying this is the student release and how
                            its loop goes (edit, ``python -m labs.check``, hint); the
                            tests run on the learner's code, not the solutions
``.release.json``           the course commit it came from, its exercises, notebooks and tests
``solutions/<exercise>.py`` only for the exercises ``--reveal`` names (``LABS_REFERENCE=EX``
                            then runs that reference in place of the learner's code)
not shipped                 the other ``solutions/``, ``hidden_tests/``, ``.ci/``; the
                            instructor tools ``labs/release/``, ``labs/grade/``,
                            ``labs/stubs/``, ``scripts/execute_notebooks.py``,
                            ``scripts/nbbuild.py``, ``scripts/instructors_guide.py`` and any
                            other script that selects the
                            solutions (e.g. GPU validation); the instructor-only tests
                            (``INSTRUCTOR_TESTS`` and any other test file that uses the
                            ``solutions`` package)
===========================  ================================================================

Everything else (runtime, models, data, measurement, theory, widgets, experiments) ships as is.
Files are taken as git sees them (tracked plus untracked, minus ``.gitignore``), so build outputs,
``.venv`` and authoring scripts never leak. ``check_release`` states the rules as checks;
``python -m labs.grade`` grades submissions made from this release.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

# First, so that nbformat's validator skips a grammar it never uses: 2 CPU-s of every command.
import labs.runtime.pytest_early  # noqa: F401

# isort: split
import nbformat

from labs import stubs
from labs.check import lab_of_test_file  # the rule labs.check and labs.grade use too
from labs.runtime.impl import EXERCISES, parse_exercises

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ".release.json"
NOT_SHIPPED_DIRS = (
    "solutions",
    "hidden_tests",
    ".ci",
    "notebooks/src",
    "out",
    # the instructor tools
    "labs/release",
    "labs/grade",
    "labs/stubs",
)
INSTRUCTOR_TOOLS = (
    "scripts/execute_notebooks.py",
    "scripts/nbbuild.py",
    "scripts/instructors_guide.py",  # reads the instructor-only catalogue of classic mistakes
)
# Tests that check the course itself rather than the learner's work, or need solutions/.
INSTRUCTOR_TESTS = (
    "tests/test_stubs.py",
    "tests/test_release.py",
    "tests/test_grade.py",
    "tests/grading_harness.py",  # test_grade's synthetic students: the attacks, the grading run
    "tests/test_grade_concealed.py",  # its second half: the attacks on --conceal-hidden
    "tests/test_grade_class.py",  # grades a synthetic class with the reference solutions
    "tests/test_browser.py",
    "tests/test_run_cli.py",
    "tests/torchrun_labs.py",  # test_run_cli's driver: several labs in one torchrun job
    "tests/test_readme_figures.py",  # reads the notebooks' outputs, which the release clears
    "tests/classic_bugs.py",  # the catalog of classic mistakes: it quotes solution lines
    "tests/test_classic_bugs.py",
    "tests/test_instructors_guide.py",  # reads that catalogue
    "tests/test_wheelhouse.py",  # checks the course's offline setup, and needs a package index
    "tests/cpu_profile.py",  # the suite's --cpu-profile, which only the instructor's conftest loads
    "tests/test_cpu_profile.py",
)
REWRITTEN = (
    "conftest.py",
    "tests/conftest.py",
    "scripts/test.sh",
    "scripts/course.sh",
    "README.md",
)
USES_SOLUTIONS = re.compile(
    r"(^|\W)(import|from)\s+solutions\b|[\"']solutions[\"']|LABS_IMPL\W{0,4}solutions", re.M
)
RELEASE_CONFTEST = '''"""Test settings of the student release: your code in labs/ runs
(LABS_IMPL defaults to labs)."""

import os

os.environ.setdefault("LABS_IMPL", "labs")
'''
README_BANNER = (
    "> **Student release.** The reference solutions are not included: every exercise module in "
    "`labs/` is yours to write, and the tests and notebooks run **your** code (`LABS_IMPL=labs`, "
    "the default).\n>\n"
    "> **The loop.** `bash scripts/course.sh` opens JupyterLab on the whole course: open "
    "`labs/<exercise>.py` from its file browser (each notebook says which), write the function "
    "it asks for, then re-run the notebook's lab and check cells, or run "
    "`python -m labs.check <exercise>` in a terminal: one PASS or FAIL line per test of that "
    "exercise, run on your code, with the reason and, when the check has one, a hint. Read it, "
    "edit, re-run, until every line says PASS. `bash scripts/test.sh` runs all the public tests "
    "on your code.\n\n"
)


def revealed_note(reveal: tuple[str, ...]) -> str:
    """The README's line about the references this release holds."""
    names = ", ".join(f"`{name}`" for name in reveal)
    first = reveal[0]
    return (
        f"> **Revealed references**: {names} (in `solutions/`). To run the reference for one of"
        f" them in place of your code, while your other exercises still run yours:"
        f" `LABS_REFERENCE={first} bash scripts/course.sh`, `python -m labs.run ... --reference"
        f" {first}`, `python -m labs.check EX --reference {first}`.\n\n"
    )


# The instructor's README describes the suite running on the solutions; in the release it runs
# on the learner's code.
README_ON_SOLUTIONS = re.compile(r"against\s+the\s+reference\s+solutions")


def exercise_names() -> list[str]:
    """The exercises this course has: a solution module ``solutions/<name>.py`` for a name in
    ``EXERCISES``."""
    return [name for name in EXERCISES if (ROOT / "solutions" / f"{name}.py").exists()]


def exercise_notebook(name: str) -> str | None:
    """The notebook file the solution module of ``name`` names in ``NOTEBOOK = "..."``."""
    return stubs.notebook_name((ROOT / "solutions" / f"{name}.py").read_text())


def source_files() -> list[str]:
    """Repository files as git sees them (tracked and untracked, .gitignore applied), relative
    paths."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        names = [n for n in out.split("\0") if n]
    except (
        OSError,
        subprocess.CalledProcessError,
    ):  # not a git checkout: walk, skipping the usual build outputs
        skip = {".git", ".venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", "build"}
        names = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file()
            and not skip & set(p.relative_to(ROOT).parts)
            and not p.name.endswith(".pyc")
        ]
    return sorted(n for n in set(names) if (ROOT / n).is_file() and not (ROOT / n).is_symlink())


def is_public_test(rel: str, text: str, exercises: list[str]) -> bool:
    """A test file ships when it is a lab's test file, or a runtime test that does not need
    solutions/."""
    if rel in INSTRUCTOR_TESTS:
        return False
    name = Path(rel).name
    if not name.startswith("test_") or lab_of_test_file(Path(rel), exercises):
        return True
    return not USES_SOLUTIONS.search(text)


def clear_notebook(text: str) -> str:
    """A notebook as a learner should first see it: no outputs, no execution counts, no widget
    state."""
    nb = nbformat.reads(text, as_version=4)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nbformat.writes(nb) + "\n"


def learner_test_script(text: str) -> str:
    """scripts/test.sh for the release: the learner's code by default, never the (absent)
    solutions."""
    new = text.replace("LABS_IMPL=solutions", 'LABS_IMPL="${LABS_IMPL:-labs}"')
    new = re.sub(r"against the reference\s+solutions", "against your code in labs/", new)
    if new == text:
        raise ValueError(
            "scripts/test.sh no longer sets LABS_IMPL=solutions; "
            "update labs.release.learner_test_script"
        )
    return new


def _transform(rel: str, text: str, reveal: tuple[str, ...] = ()) -> str:
    if rel.startswith("notebooks/") and rel.endswith(".ipynb"):
        return clear_notebook(text)
    if rel == "conftest.py":
        return RELEASE_CONFTEST
    if rel == "tests/conftest.py":  # its docstring describes the instructor's root conftest
        return text.replace(
            "../conftest.py selects solutions", "../conftest.py selects your code in labs/"
        )
    if rel == "scripts/test.sh":
        return learner_test_script(text)
    if (
        rel == "scripts/course.sh"
    ):  # its hint about running the solutions does not apply without them
        return "".join(
            line for line in text.splitlines(keepends=True) if "LABS_IMPL=solutions" not in line
        )
    if rel == "README.md":
        text = README_ON_SOLUTIONS.sub("against your code in `labs/`", text)
        lines = text.split("\n", 2)  # keep the title first
        banner = README_BANNER
        if reveal:  # the first sentence says none is included
            banner = banner.replace(
                "The reference solutions are not included:",
                "Only the reference solutions your instructor revealed (below) are included:",
            )
            banner += revealed_note(reveal)
        return "\n".join(lines[:2]) + "\n" + banner + (lines[2] if len(lines) > 2 else "")
    return text


def release_plan(
    exclude: tuple[str, ...] = (), reveal: tuple[str, ...] = ()
) -> dict[str, str | Path]:
    """Release path -> its text (a transformed or generated file) or the source Path to copy as
    is. ``exclude``: more folders (relative to the repository) to leave out, such as the
    submissions and the report of ``labs.grade`` when they are inside the repository;
    ``reveal``: the exercises whose reference ships (``solutions/<name>.py``)."""
    exercises = exercise_names()
    stub_names = {f"labs/{name}.py" for name in EXERCISES}
    plan: dict[str, str | Path] = {}
    for rel in source_files():
        not_shipped = any(rel.startswith(d + "/") for d in (*NOT_SHIPPED_DIRS, *exclude))
        if not_shipped or rel in INSTRUCTOR_TOOLS or rel in stub_names:
            continue
        path = ROOT / rel
        if not rel.endswith((".py", ".sh", ".md", ".ipynb")):
            plan[rel] = path  # copied as is
            continue
        text = path.read_text()
        if (
            rel.startswith("tests/")
            and rel.endswith(".py")
            and not is_public_test(rel, text, exercises)
        ):
            continue
        if rel.startswith("scripts/") and rel not in REWRITTEN and USES_SOLUTIONS.search(text):
            continue  # an instructor's script (it selects the solutions)
        plan[rel] = _transform(rel, text, reveal)
    if reveal:
        plan["solutions/__init__.py"] = ROOT / "solutions" / "__init__.py"
    for name in reveal:
        plan[f"solutions/{name}.py"] = ROOT / "solutions" / f"{name}.py"
    for name in exercises:  # the stubs, generated from solutions/ whatever labs/ holds now
        plan[f"labs/{name}.py"] = generated_stub(name)
    return plan


def generated_stub(name: str) -> str:
    """The learner module for exercise ``name``, generated from ``solutions/<name>.py``."""
    try:
        return stubs.make_stub((ROOT / "solutions" / f"{name}.py").read_text(), f"{name}.py")
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"solutions/{name}.py: cannot generate its stub: {exc}") from None


def _commit(root: Path) -> dict:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain")),
        }
    except OSError:
        return {"commit": None, "dirty": None}


def build_release(
    out: Path,
    force: bool = False,
    exclude: tuple[str, ...] = (),
    reveal: tuple[str, ...] | str = (),
) -> dict:
    """Write the student release into the empty or missing folder ``out`` (``force``: replace what
    is there; ``exclude``: see ``release_plan``; ``reveal``: exercises whose reference ships);
    returns its manifest."""
    out = Path(out).resolve()
    reveal = parse_exercises(reveal, what="--reveal")
    missing = [name for name in reveal if name not in exercise_names()]
    if missing:
        raise ValueError(f"--reveal: no solutions/{missing[0]}.py in this course to reveal")
    if ROOT.is_relative_to(out):
        raise ValueError(
            f"OUT_DIR={out} would contain the course itself; choose a folder outside {ROOT}"
        )
    if force and out.exists():
        shutil.rmtree(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT_DIR={out} is not empty; remove it or pass --force")
    plan = release_plan(exclude, reveal)
    for rel, content in plan.items():
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy2(content, target)
        else:
            target.write_text(content)
    exercises = exercise_names()
    manifest = {
        "course": "LLM Parallelism Labs (student release)",
        **_commit(ROOT),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "exercises": {name: exercise_notebook(name) for name in exercises},
        "revealed": list(reveal),
        "notebooks": sorted(r for r in plan if r.startswith("notebooks/") and r.endswith(".ipynb")),
        "public_tests": sorted(r for r in plan if r.startswith("tests/test_")),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def revealed_in(path: Path) -> list[str]:
    """The exercises whose reference the release at ``path`` holds, as its manifest says."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        return []
    return list(json.loads(manifest.read_text()).get("revealed", []))


def check_release(path: Path) -> list[str]:
    """Problems with the release at ``path`` (empty when it follows every rule in the module
    docstring)."""
    path, problems = Path(path), []
    revealed = revealed_in(path)
    for d in NOT_SHIPPED_DIRS:
        if d == "solutions" and (path / d).exists():
            allowed = {"__init__.py", *(f"{name}.py" for name in revealed)}
            problems += [
                f"solutions/{f.name} is in the release but not revealed"
                for f in sorted((path / d).rglob("*"))
                if f.is_file() and f.relative_to(path / d).as_posix() not in allowed
            ]
        elif (path / d).exists():
            problems.append(f"{d}/ is in the release")
    for rel in (*INSTRUCTOR_TOOLS, *INSTRUCTOR_TESTS):
        if (path / rel).exists():
            problems.append(f"instructor-only {rel} is in the release")
    for name in exercise_names():
        stub = generated_stub(name)
        shipped = path / "labs" / f"{name}.py"
        if not shipped.exists() or shipped.read_text() != stub:
            problems.append(f"labs/{name}.py is not the generated stub")
    for nb_path in sorted((path / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        if "widgets" in nb.metadata or any(
            c.get("outputs") or c.get("execution_count") for c in nb.cells
        ):
            problems.append(f"notebooks/{nb_path.name} has outputs or widget state")
    readme = path / "README.md"
    if readme.exists() and README_ON_SOLUTIONS.search(readme.read_text()):
        problems.append("README.md says the tests run against the reference solutions")
    for f in [path / "conftest.py", *sorted((path / "scripts").glob("*"))]:
        if f.is_file() and USES_SOLUTIONS.search(f.read_text()):
            problems.append(f"{f.relative_to(path)} selects the solutions")
    for f in sorted((path / "tests").glob("test_*.py")):
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            if USES_SOLUTIONS.search(line):
                problems.append(
                    f"tests/{f.name}:{lineno} uses the solutions, absent from the release"
                )
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labs.release", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "out", type=Path, metavar="OUT_DIR", help="folder to write (must be empty or missing)"
    )
    parser.add_argument("--archive", action="store_true", help="also write OUT_DIR.zip")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument(
        "--reveal",
        metavar="EX[,EX...]",
        default="",
        help="ship the reference of these exercises (e.g. after their deadline), no other",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    try:
        manifest = build_release(out, force=args.force, reveal=args.reveal)
    except ValueError as exc:
        parser.error(str(exc))
    problems = check_release(out)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    exercises, notebooks, tests = (
        len(manifest[key]) for key in ("exercises", "notebooks", "public_tests")
    )
    print(
        f"wrote {out}: {exercises} exercise stubs, {notebooks} notebooks, {tests} public test files"
        + (f", the reference of {', '.join(manifest['revealed'])}" if manifest["revealed"] else "")
    )
    if args.archive:
        archive = shutil.make_archive(str(out), "zip", root_dir=out.parent, base_dir=out.name)
        print(f"wrote {archive}")
    return 1 if problems else 0
