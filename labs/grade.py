"""Grade students from their labs and their executed notebooks: one command, one scorecard.

    python -m labs.grade SUBMISSIONS_DIR --out REPORT_DIR
    python -m labs.grade subs --out report --labs collectives ddp --cell-timeout 60
    --notebook-timeout 300

SUBMISSIONS_DIR holds one folder per student, each a copy of the student release
(``python -m labs.release``) with their work in it. For every student and every lab:

1. **tests**: the lab's tests marked ``exercise`` (public and hidden, always the instructor's
   copies) run with pytest against the student's ``labs/``, per-test timeout (pytest-timeout), a
   time budget for the lab, and after ``--max-timeouts`` timed-out tests the rest of the lab fails
   unrun;
2. **notebook**: the student's copy of the lab's notebook runs headless (nbclient) with a per-cell
   and a per-notebook timeout; "executed" means every cell ran (``raises-exception`` cells may
   fail).

What a lab is, found at run time from what the course has:

==============  ============================================================================
lab             an exercise of ``labs.runtime.impl.EXERCISES`` that has ``solutions/<lab>.py``
module          ``labs/<lab>.py``, the student's
notebook        the one the solution module names (``NOTEBOOK = "NN_x.ipynb"``)
public tests    ``tests/test_<lab>.py`` and ``tests/test_<lab>_*.py`` as the release ships them;
                another released test file that calls ``exercise("<lab>")`` counts too (one that
                calls several exercises counts for the latest of them in course order)
hidden tests    ``hidden_tests/test_<lab>.py``, ``hidden_tests/test_<lab>_*.py`` (``--hidden-tests``)
score           tests passed / tests collected, marked ``exercise``, public + hidden
==============  ============================================================================

A released notebook that no exercise names is graded as a row of its own (notebook only, no tests).

Isolation. Each item (a lab's tests, a notebook) runs in a fresh temporary copy of the
instructor's release plus the hidden tests, into which only the student's exercise modules
(``labs/<exercise>.py``) and, for a notebook, that notebook are copied: every other file (tests,
``labs/runtime``, conftest, pytest config, scripts) is the instructor's, and any other file the
student changed is listed in the feedback as ignored. ``import solutions`` fails there. Each item
runs in its own process group with ``LABS_IMPL=labs``, ``PYTHONPATH`` and cwd the copy; afterwards
the group and every process it left behind are killed (the grader is a Linux child subreaper, so
even daemonised processes come back to it). A submission that hangs, exits, raises on import,
deletes files or leaves processes costs that item only. Nothing is written to the course
repository or to the submissions: only to REPORT_DIR and temporary folders. This is isolation
against accidents and simple tricks, not a security sandbox: grade untrusted code in a container.

REPORT_DIR gets ``scores.csv`` (student x lab), ``summary.md``, ``scores.json``, and per student
``feedback.md`` (each failed check with its message), the executed notebooks and the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from labs.grading.processes import become_subreaper, kill_leftovers, run_item
from labs.grading.report import Result, feedback_page, write_reports
from labs.release import ROOT, build_release, exercise_names, exercise_notebook, lab_of_test_file

GRADING = Path(__file__).resolve().parent / "grading"
SOLUTIONS_SHIM = 'raise ImportError("the reference solutions are not available while grading")\n'
SKIP_PARTS = {".git", "__pycache__", ".ipynb_checkpoints", ".venv", "venv", ".pytest_cache", "out"}


@dataclass(frozen=True)
class Lab:
    name: str  # the exercise, or the notebook's stem for a notebook-only row
    notebook: str | None  # file name in notebooks/
    test_files: tuple[str, ...]  # relative to the graded copy: tests/..., hidden_tests/...


# ---- the course side: labs, the graded copy, the tests' names
# ----------------------------------------------


def build_template(dst: Path, hidden: Path | None) -> None:
    """The instructor's release, plus the hidden tests, plus a ``solutions`` that cannot be
    imported."""
    build_release(dst)
    if hidden is not None:
        shutil.copytree(
            hidden, dst / "hidden_tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    (dst / "solutions").mkdir()
    (dst / "solutions" / "__init__.py").write_text(SOLUTIONS_SHIM)


def discover_labs(template: Path) -> list[Lab]:
    """The labs of this course (see the module docstring), in course order, then notebook-only
    rows."""
    exercises = exercise_names()
    notebooks = {name: exercise_notebook(name) for name in exercises}
    order = {name: (notebooks[name] or "99", i) for i, name in enumerate(exercises)}
    files: dict[str, list[str]] = {name: [] for name in exercises}
    for folder in ("tests", "hidden_tests"):
        for path in sorted((template / folder).glob("test_*.py")):
            lab = lab_of_test_file(path, exercises)
            if lab is None:
                called = set(
                    re.findall(r"""exercise\(\s*["'](\w+)["']\s*\)""", path.read_text())
                ) & set(exercises)
                lab = max(called, key=order.get) if called else None
            if lab is not None:
                files[lab].append(f"{folder}/{path.name}")
            elif folder == "hidden_tests":
                print(
                    f"warning: hidden_tests/{path.name} belongs to no lab (name it test_<exercise>_*.py)",
                    file=sys.stderr,
                )
    labs = []
    for name in sorted(exercises, key=order.get):
        notebook = notebooks[name]
        if not (template / "notebooks" / str(notebook)).exists():
            notebook = None
        if notebook in {lab.notebook for lab in labs}:
            notebook = None  # two exercise modules of one notebook: it is graded with the first
        labs.append(Lab(name, notebook, tuple(files[name])))
    named = {lab.notebook for lab in labs}
    labs += [
        Lab(p.stem, p.name, ())
        for p in sorted((template / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        if p.name not in named
    ]
    return labs


def _env(work: Path, private: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LABS_", "JPY_"))}
    env.update(
        LABS_IMPL="labs",
        PYTHONPATH=f"{work}{os.pathsep}{private}",
        PYTHONHASHSEED="0",
        PYTHONDONTWRITEBYTECODE="1",
        JUPYTER_RUNTIME_DIR=str(private / "jupyter"),
        IPYTHONDIR=str(private / "ipython"),
        **extra,
    )
    return env


def _pytest_cmd(work: Path, files, test_timeout: float, *more) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-m",
        "exercise",
        "-p",
        "labs_grade_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        f"--rootdir={work}",
        "-c",
        str(work / "pyproject.toml"),
        f"--timeout={test_timeout}",
        "--timeout-method=signal",
        *more,
    ]


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a kill
    return records


def collect_tests(template: Path, private: Path, labs: list[Lab]) -> dict[str, list[str]]:
    """lab -> node ids of its tests marked ``exercise``, collected once on the instructor's copy."""
    files = [f for lab in labs for f in lab.test_files]
    if not files:
        return {lab.name: [] for lab in labs}
    results = private / "collect.jsonl"
    rc, _, _ = run_item(
        _pytest_cmd(template, files, 60, "--collect-only"),
        cwd=template,
        env=_env(template, private, LABS_GRADE_RESULTS=str(results)),
        timeout=600,
        log=private / "collect.log",
    )
    collected = next((r["collected"] for r in _read_records(results) if "collected" in r), None)
    if (
        rc not in (0, 5) or collected is None
    ):  # 5: nothing selected, e.g. a lab with no exercise tests
        raise RuntimeError(
            f"the instructor's tests do not collect (exit {rc}):\n"
            + (private / "collect.log").read_text()[-3000:]
        )
    return {lab.name: [n for n in collected if n.split("::")[0] in lab.test_files] for lab in labs}


# ---- one student
# -----------------------------------------------------------------------------------------


def _graded_copy(template: Path, submission: Path, dst: Path, notebook: str | None = None) -> None:
    """A fresh copy of the template with the student's exercise modules (and ``notebook``) in it."""
    shutil.copytree(template, dst)
    for name in exercise_names():
        mine = submission / "labs" / f"{name}.py"
        if mine.is_file() and not mine.is_symlink():
            shutil.copyfile(mine, dst / "labs" / f"{name}.py")
    if notebook:
        shutil.copyfile(submission / "notebooks" / notebook, dst / "notebooks" / notebook)


def grade_tests(res: Result, lab: Lab, expected: list[str], ctx: dict) -> None:
    work = ctx["private"] / "work"
    results = ctx["private"] / f"{res.student}-{lab.name}.jsonl"
    _graded_copy(ctx["template"], ctx["submission"], work)
    env = _env(
        work,
        ctx["private"],
        LABS_GRADE_RESULTS=str(results),
        MPLBACKEND="Agg",
        LABS_GRADE_MAX_TIMEOUTS=str(ctx["max_timeouts"]),
    )
    rc, res.tests_time_s, left = run_item(
        _pytest_cmd(work, lab.test_files, ctx["test_timeout"]),
        cwd=work,
        env=env,
        timeout=ctx["lab_timeout"],
        log=ctx["logs"] / f"{lab.name}.tests.log",
    )
    shutil.rmtree(work, ignore_errors=True)
    res.leftover_processes += left
    outcome: dict[str, list[dict]] = {}
    for record in _read_records(results):
        if "nodeid" in record:
            outcome.setdefault(record["nodeid"], []).append(record)
    why_unrun = (
        f"not run: the lab's time budget of {ctx['lab_timeout']:g} s ran out"
        if rc is None
        else f"not run: pytest stopped (exit code {rc}) before this test"
    )
    for nodeid in expected:
        reports = outcome.get(nodeid, [])
        bad = [r for r in reports if r["outcome"] != "passed"]
        passed = reports and not bad and any(r["when"] == "call" for r in reports)
        hidden = nodeid.startswith("hidden_tests/")
        res.tests_total += 1
        res.hidden_total += hidden
        if passed:
            res.tests_passed += 1
            res.hidden_passed += hidden
        else:
            message = (
                why_unrun
                if not bad
                else (
                    ("" if bad[0]["when"] == "call" else f"in {bad[0]['when']}: ")
                    + (bad[0]["outcome"] + ": " if bad[0]["outcome"] == "skipped" else "")
                    + bad[0]["message"]
                )
            )
            res.failures.append([nodeid, message.replace(f"{work}/", "")])


def _changed_cells(mine: Path, released: Path) -> int:
    """Code cells of the released notebook that the student's copy no longer has verbatim."""
    try:
        have = {
            c.source.strip()
            for c in nbformat.read(mine, as_version=4).cells
            if c.cell_type == "code"
        }
    except Exception:  # noqa: BLE001 - an unreadable notebook: every cell counts as changed
        have = set()
    ref = [
        c.source.strip()
        for c in nbformat.read(released, as_version=4).cells
        if c.cell_type == "code"
    ]
    return sum(src not in have for src in ref)


def grade_notebook(res: Result, lab: Lab, ctx: dict) -> None:
    mine = ctx["submission"] / "notebooks" / lab.notebook
    if not mine.is_file() or mine.is_symlink():
        res.notebook_executed = "no"
        res.notebook_detail = f"missing: the submission has no notebooks/{lab.notebook}"
        return
    work = ctx["private"] / "work"
    result = ctx["private"] / "notebook.json"
    result.unlink(missing_ok=True)
    _graded_copy(ctx["template"], ctx["submission"], work, lab.notebook)
    res.cells_changed = _changed_cells(mine, ctx["template"] / "notebooks" / lab.notebook)
    (ctx["out"] / "notebooks").mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        str(GRADING / "run_notebook.py"),
        str(work / "notebooks" / lab.notebook),
        str(ctx["out"] / "notebooks" / lab.notebook),
        str(result),
        str(ctx["cell_timeout"]),
    ]
    env = _env(work, ctx["private"], MPLBACKEND="module://matplotlib_inline.backend_inline")
    rc, res.notebook_time_s, left = run_item(
        cmd,
        cwd=work / "notebooks",
        env=env,
        timeout=ctx["notebook_timeout"],
        log=ctx["logs"] / f"{lab.name}.notebook.log",
    )
    shutil.rmtree(work, ignore_errors=True)
    res.leftover_processes += left
    info = (
        json.loads(result.read_text())
        if result.exists()
        else {"status": "did not start", "cell": None}
    )
    res.notebook_executed = "yes" if info["status"] == "ok" and rc == 0 else "no"
    where = _cell_text(mine, info.get("cell"))
    if rc is None:
        res.notebook_detail = (
            f"timeout: over {ctx['notebook_timeout']:g} s in all; it was running {where}"
        )
    elif info["status"] == "ok":
        res.notebook_detail = "ok"
    elif info["status"] in ("running", "starting", "did not start"):
        res.notebook_detail = f"stopped: the notebook runner exited with code {rc} in {where}"
    else:
        evalue = (info.get("evalue") or "").strip().replace(f"{work}/", "")
        res.notebook_detail = f"{info['status']} in {where}: {info.get('ename', '')}: {evalue}"[
            :3000
        ]


def _cell_text(notebook: Path, index: int | None) -> str:
    """ "cell 7 (`first line of its code`)", as a reader finds it in JupyterLab."""
    if index is None:
        return "no cell (the kernel did not start)"
    try:
        first = next(
            (
                line
                for line in nbformat.read(notebook, as_version=4).cells[index].source.splitlines()
                if line.strip() and not line.startswith("#")
            ),
            "",
        )
    except Exception:  # noqa: BLE001 - only a nicer message is lost
        first = ""
    return f"cell {index + 1}" + (f" (`{first[:80]}`)" if first else "")


def ignored_changes(submission: Path, template: Path) -> list[str]:
    """Files of the submission, other than exercise modules and notebooks, that differ from the
    release."""
    graded = {f"labs/{name}.py" for name in exercise_names()}
    ignored = []
    for folder, dirs, names in os.walk(submission):  # symlinked folders are not followed
        dirs[:] = sorted(d for d in dirs if d not in SKIP_PARTS)
        for name in sorted(names):
            path = Path(folder) / name
            key = path.relative_to(submission).as_posix()
            if (
                name.endswith(".pyc")
                or key in graded
                or key == ".release.json"
                or (key.startswith("notebooks/") and key.endswith(".ipynb"))
            ):
                continue
            ref = template / key
            if (
                path.is_symlink()
                or not path.is_file()
                or not ref.is_file()
                or ref.read_bytes() != path.read_bytes()
            ):
                ignored.append(key)
    return ignored


def _release_notes(submission: Path, commit: str | None) -> list[str]:
    try:
        theirs = json.loads((submission / ".release.json").read_text()).get("commit")
    except (OSError, ValueError, AttributeError):
        return [
            "Your submission has no readable `.release.json`: was it made from the course release?"
        ]
    if commit and theirs and theirs != commit:
        return [
            f"Your copy of the course came from commit {theirs[:12]}; it was graded with {commit[:12]}."
        ]
    return []


def grade_student(
    student: str, submission: Path, labs: list[Lab], expected: dict, ctx: dict
) -> list[Result]:
    ctx = dict(ctx, submission=submission, out=ctx["report"] / student)
    ctx["logs"] = ctx["out"] / "logs"
    ctx["logs"].mkdir(parents=True, exist_ok=True)
    results = []
    for lab in labs:
        res = Result(student, lab.name, lab.notebook)
        if expected[lab.name]:
            grade_tests(res, lab, expected[lab.name], ctx)
        if lab.notebook and ctx["notebooks"]:
            grade_notebook(res, lab, ctx)
        print(
            f"{student} · {lab.name}: {res.tests_passed}/{res.tests_total} tests, notebook ran: "
            f"{res.notebook_executed}, {res.tests_time_s + res.notebook_time_s:.1f} s",
            flush=True,
        )
        results.append(res)
    return results


# ---- command line
# ----------------------------------------------------------------------------------------


def _check_paths(parser, submissions: Path, report: Path, hidden: Path | None) -> None:
    if not submissions.is_dir():
        parser.error(f"SUBMISSIONS_DIR={submissions} is not a folder")
    if hidden is not None and not hidden.is_dir():
        parser.error(f"--hidden-tests {hidden} is not a folder")
    if report.is_relative_to(submissions) or submissions.is_relative_to(report):
        parser.error(
            f"--out {report} and SUBMISSIONS_DIR={submissions} must not contain each other"
        )
    if report.is_relative_to(ROOT) and not report.is_relative_to(ROOT / "out"):
        parser.error(
            f"--out {report} is inside the course repository; use a folder outside it or under out/"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labs.grade", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "submissions", type=Path, metavar="SUBMISSIONS_DIR", help="one folder per student"
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="REPORT_DIR", help="where the scorecard goes"
    )
    parser.add_argument(
        "--hidden-tests",
        type=Path,
        default=None,
        metavar="DIR",
        help="extra tests, never released (default: hidden_tests/ when it exists)",
    )
    parser.add_argument("--no-hidden", action="store_true", help="grade with the public tests only")
    parser.add_argument(
        "--labs", nargs="+", metavar="LAB", help="grade only these labs (default: all)"
    )
    parser.add_argument("--students", nargs="+", metavar="NAME", help="grade only these students")
    parser.add_argument(
        "--cell-timeout", type=float, default=120, metavar="S", help="per notebook cell"
    )
    parser.add_argument(
        "--notebook-timeout", type=float, default=600, metavar="S", help="per notebook, in all"
    )
    parser.add_argument("--test-timeout", type=float, default=120, metavar="S", help="per test")
    parser.add_argument(
        "--lab-timeout", type=float, default=900, metavar="S", help="per lab's tests, in all"
    )
    parser.add_argument(
        "--max-timeouts",
        type=int,
        default=2,
        metavar="N",
        help="after N timed-out tests the lab's other tests fail unrun (0: never)",
    )
    parser.add_argument("--no-notebooks", action="store_true", help="run the tests only")
    parser.add_argument(
        "--conceal-hidden", action="store_true", help="feedback hides hidden tests' names"
    )
    args = parser.parse_args(argv)
    submissions = args.submissions.resolve()
    report = args.out.resolve()
    default_hidden = ROOT / "hidden_tests" if (ROOT / "hidden_tests").is_dir() else None
    hidden = None if args.no_hidden else (args.hidden_tests or default_hidden)
    hidden = hidden.resolve() if hidden else None
    _check_paths(parser, submissions, report, hidden)
    for name in ("cell_timeout", "notebook_timeout", "test_timeout", "lab_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    students = sorted(
        p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith(".")
    )
    if args.students:
        unknown = sorted(set(args.students) - set(students))
        if unknown:
            parser.error(f"--students: no submission for {unknown}; choose from {students}")
        students = [s for s in students if s in args.students]
    if not students:
        parser.error(f"SUBMISSIONS_DIR={submissions} has no student folders")
    run_notebooks = not args.no_notebooks
    become_subreaper()
    report.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="labs-grade-") as tmp:
        private = Path(tmp)
        shutil.copyfile(GRADING / "pytest_plugin.py", private / "labs_grade_plugin.py")
        template = private / "template"
        try:
            build_template(template, hidden)
            labs = discover_labs(template)
        except ValueError as exc:  # a solution module that does not parse: no release, no grading
            parser.exit(1, f"error: {exc}\n")
        if args.labs:
            valid = [lab.name for lab in labs]
            unknown = sorted(set(args.labs) - set(valid))
            if unknown:
                parser.error(f"--labs: unknown {unknown}; choose from {valid}")
            labs = [lab for lab in labs if lab.name in args.labs]
        try:
            expected = collect_tests(template, private, labs)
        except RuntimeError as exc:
            parser.exit(1, f"error: {exc}\n")
        idle = [
            lab.name
            for lab in labs
            if not expected[lab.name] and not (lab.notebook and run_notebooks)
        ]
        if idle:
            why = "no notebook" if run_notebooks else "--no-notebooks"
            print(
                f"nothing to grade in {', '.join(idle)}: no tests marked exercise, {why}",
                file=sys.stderr,
            )
        labs = [lab for lab in labs if lab.name not in idle]
        meta = {
            "graded_at": time.strftime("%Y-%m-%d %H:%M"),
            "commit": json.loads((template / ".release.json").read_text())["commit"],
            "labs": [asdict(lab) for lab in labs],
            "hidden_tests": str(hidden) if hidden else None,
        }
        ctx = {
            "template": template,
            "private": private,
            "report": report,
            "notebooks": run_notebooks,
            **{
                k: getattr(args, k)
                for k in (
                    "cell_timeout",
                    "notebook_timeout",
                    "test_timeout",
                    "lab_timeout",
                    "max_timeouts",
                )
            },
        }
        results = []
        try:
            for student in students:
                t0 = time.perf_counter()
                mine = grade_student(student, submissions / student, labs, expected, ctx)
                ignored = ignored_changes(submissions / student, template)
                page = feedback_page(
                    student,
                    mine,
                    ignored,
                    meta,
                    args.conceal_hidden,
                    notes=_release_notes(submissions / student, meta["commit"]),
                )
                (report / student / "feedback.md").write_text(page)
                print(f"{student}: done in {time.perf_counter() - t0:.1f} s", flush=True)
                results += mine
        finally:
            kill_leftovers()
            write_reports(report, results, meta)
    print(f"wrote {report / 'scores.csv'}, {report / 'summary.md'} and a feedback.md per student")
    return 0


if __name__ == "__main__":
    sys.exit(main())
