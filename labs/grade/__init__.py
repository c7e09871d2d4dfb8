"""Grade students from their labs and their executed notebooks: one command, one scorecard, every
submission's code in a sandbox of its own.

    python -m labs.grade SUBMISSIONS_DIR --out REPORT_DIR
    python -m labs.grade subs --out report --labs collectives ddp --jobs 2 --conceal-hidden

SUBMISSIONS_DIR holds one folder per student, each a copy of the student release
(``python -m labs.release``) with their work in it. For every student and every lab, three
items, each in a fresh bubblewrap sandbox (``labs.grade.sandbox``):

1. **public tests**: the lab's released tests marked ``exercise`` (the instructor's copies) run
   with pytest against the student's ``labs/``, per-test timeout (pytest-timeout), a time budget
   for the lab, and after ``--max-timeouts`` timed-out tests the rest of the lab fails unrun;
2. **hidden tests**: the lab's hidden tests, the same way; with ``--conceal-hidden`` in a run of
   their own that only they and the student's modules are in, and only how many passed leaves it;
   without it (their names, messages and log are the student's to read anyway), in the public
   tests' pytest, after them: one interpreter, torch import and collection less per lab;
3. **notebook**: the student's notebook runs headless (nbclient) with a per-cell and a
   per-notebook timeout; "executed" means every code cell of the release, matched by cell id, ran
   in order to the end with the release's tags (``labs.grade.notebooks``).

What a lab is, found at run time from what the course has:

==============  ==========================================================================
lab             an exercise of ``labs.runtime.impl.EXERCISES`` that has ``solutions/<lab>.py``
module          ``labs/<lab>.py``, the student's
notebook        the one the solution module names (``NOTEBOOK = "NN_x.ipynb"``)
public tests    ``tests/test_<lab>.py`` and ``tests/test_<lab>_*.py`` as the release ships
                them; another released test file that calls ``exercise("<lab>")`` counts too
                (one that calls several exercises counts for the latest of them in course
                order)
hidden tests    ``hidden_tests/test_<lab>.py``, ``hidden_tests/test_<lab>_*.py``
                (``--hidden-tests``)
score           tests passed / tests collected, marked ``exercise``, public + hidden
not started     a module that is the release's stub byte for byte (line endings aside), or
                missing: its tests are not run, each fails "not run: ... the course's stub,
                unchanged" (a stub fails every one: ``tests/test_stubs.py``); nor is its
                notebook, unless the student added code cells of their own
stand-ins       the exercises the lab builds on (``labs.runtime.impl.builds_on``): their
                references (the instructor's ``solutions/``) stand in for the student's own,
                selected by ``LABS_REFERENCE``, so that each exercise is graded on its own (a
                broken pipeline_parallel costs the pipeline_parallel lab only, not mesh);
                ``--own-prerequisites`` grades with the student's own instead
==============  ==========================================================================

A released notebook that no exercise names is graded as a row of its own (notebook only, no tests).

What an item sees: the instructor's release, with only the student's exercise modules
(``labs/<exercise>.py``) and, for a notebook, that notebook laid over it; every other file
(tests, ``labs/runtime``, conftest, pytest config) is the instructor's, and any other file the
student changed is listed in the feedback as ignored. ``import solutions`` fails there, but for
the references standing in for the exercises the lab builds on (the feedback names them); the
repository, other students, the report and the network are not there at all. Results come back
on a channel the grader checks against its own list of tests (``labs.grade.results``). The
submission folders are read without following any link (``labs.grade.submission``). Without
bubblewrap the grader refuses to run, unless told ``--unsafe-no-sandbox``.

The grader's parts live beside this module (instructor-only: never shipped in the release):
``sandbox`` (the bubblewrap sandbox, its seccomp filter and its limits), ``cgroups`` (a cgroup per
item, where the machine allows one: the kernel counts its memory), ``inside`` (the sandbox's first
process, which watches the other limits), ``processes`` (one item run to its end or its limit, on
its student's cores), ``pytest_plugin`` (streams each test's outcome to the grader from a pytest
process that never runs the student's code, and guards it), ``results`` (checks that stream
against the grader's own list), ``run_notebook`` and ``notebooks`` (a student's notebook, run and
judged, parsed by a limited child), ``submission`` (a student's folder, read without trusting it)
and ``report`` (the files written, every string a submission controls escaped).

REPORT_DIR gets ``scores.csv`` (student x lab), ``summary.md``, ``scores.json``, rewritten whole
after each student, and per student ``feedback.md`` (each failed check with its message), the
executed notebooks and the logs.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import py_compile
import queue
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labs.grade import cgroups, lms, mistakes, notebooks, sandbox, submission
from labs.grade.processes import (
    LOG_KEEP_BYTES,
    Finished,
    become_subreaper,
    kill_leftovers,
    run_item,
    stop_all,
)
from labs.grade.report import (
    NOT_ISOLATED,
    Result,
    feedback_page,
    md_code,
    printable,
    write_atomic,
    write_reports,
)
from labs.grade.results import read_test_run
from labs.grade.sandbox import Limits, Sandbox
from labs.release import (
    ROOT,
    build_release,
    exercise_names,
    exercise_notebook,
    lab_of_test_file,
    source_files,
)
from labs.runtime.impl import REFERENCE_ENV, builds_on
from labs.runtime.prerequisites import unwritten_in

GRADING = Path(__file__).resolve().parent  # the pieces copied into the sandbox
# ModuleNotFoundError, as in a release without solutions/: the course asks find_spec whether a
# reference is there (labs.runtime.prerequisites), and reads a plain ImportError as a failure
SOLUTIONS_SHIM = (
    'raise ModuleNotFoundError("the reference solutions are not available while grading", '
    'name="solutions")\n'
)
PLOT_EVERY_S = 60.0  # the class plot is redrawn at most this often while students are graded
REPORT_FILES = ("scores.csv", "scores.json", "summary.md", "gradebook.csv", "class_scores.png")
MODULE_LIMIT = 2 << 20  # bytes of one exercise module
NOTEBOOK_LIMIT = submission.MAX_FILE_BYTES
RESULTS_LIMIT = 4 << 20  # bytes a test run may send on its results channel
LISTED_PER_STUDENT = 20  # symlinks, folders not looked at ... listed in one student's feedback
COPIES_PER_STUDENT = 5  # lines about one student's symlinks into classmates' folders, in summary
LIMIT_MARKS = {
    "memory": ("MemoryError", "Cannot allocate memory", "can't allocate memory", "bad_alloc"),
    "processes": ("can't start new thread", "Resource temporarily unavailable"),
    "file size": ("File too large",),
    "disk": ("No space left on device",),
}
LIMIT_NOTES = {
    "memory": "memory: more than {memory_gib:g} GiB in all (`--memory-limit`)",
    "processes": "processes: more than {processes} processes and threads (`--max-processes`)",
    "file size": "file size: a file over {file_mib:g} MiB (`--max-file-size`)",
    "disk": "disk: more than {disk_mib:g} MiB in /tmp or /dev/shm (`--disk-limit`)",
    "open files": "open files: more than {open_files} in all (`--max-open-files`)",
    "cpu time": "CPU time: more than {cpu_seconds:g} s in all (`--cpu-limit`)",
}
# all a concealed hidden run's grading error says (the grader's own output says why)
CONCEALED_ERROR = "the hidden tests could not all be graded"
PUBLIC_DIR, HIDDEN_DIR = "tests/", "hidden_tests/"  # where a lab's node ids start


@dataclass(frozen=True)
class Lab:
    name: str  # the exercise, or the notebook's stem for a notebook-only row
    notebook: str | None  # file name in notebooks/
    test_files: tuple[str, ...]  # relative to the graded copy: tests/..., hidden_tests/...
    stand_ins: tuple[str, ...] = ()  # earlier exercises graded with their reference (builds_on)


@dataclass
class Session:
    """What every student's grading shares."""

    args: argparse.Namespace
    sandbox: Sandbox
    private: Path  # the grader's temporary folder: release/, tools/, hidden/, items/
    report: Path
    submissions: Path
    hidden: Path | None  # the grader's copy of the hidden tests
    references: Path | None = None  # the grader's copy of solutions/ (the stand-ins' source)
    labs: list[Lab] = field(default_factory=list)
    expected: dict[str, list[str]] = field(default_factory=dict)  # lab -> node ids
    token: str = field(default_factory=lambda: "check_" + secrets.token_hex(6))  # the checks' name
    meta: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)  # name -> (Student.fingerprints, .into)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cgroups: cgroups.Controller | None = None  # each item's cgroup, where the machine allows one
    seccomp: bytes | None = None  # the sandbox's seccomp program
    slots: queue.Queue = field(default_factory=queue.Queue)  # the cores of each job, free ones

    @property
    def release(self) -> Path:
        return self.private / "release"


@dataclass
class Student:
    """One submission, as the grader read it."""

    name: str  # the folder's name
    shown: str  # the name as reports write it
    folder: Path
    modules: dict[str, bytes] = field(default_factory=dict)  # exercise -> its module's bytes
    fingerprints: dict[str, tuple] = field(default_factory=dict)  # exercise -> (sha256, dev, ino)
    notes: list[str] = field(default_factory=list)  # Markdown lines for the top of the feedback
    ignored: list[str] = field(default_factory=list)  # files differing from the release
    into: dict[str, list[str]] = field(default_factory=dict)  # classmate -> symlinks into theirs


# ---- the course side: the release, the labs, the tests' names
# ----------------------------------------------


def build_template(dst: Path, exclude: tuple[str, ...] = ()) -> None:
    """The instructor's release, plus a ``solutions`` that cannot be imported and an empty
    ``hidden_tests/`` (where a hidden run's tests are bound), its modules compiled once.

    Every Python process of every item imports the course, and an item cannot write bytecode
    (its course is read-only): compiled here, once, each import reads it. The bytecode is checked
    against its source's hash, so a student's module bound over a stub is compiled from its own
    source, never taken for the stub's."""
    build_release(dst, exclude=exclude)
    (dst / "solutions").mkdir()
    (dst / "solutions" / "__init__.py").write_text(SOLUTIONS_SHIM)
    (dst / "hidden_tests").mkdir(exist_ok=True)
    compileall.compile_dir(
        dst, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
    )


def discover_labs(template: Path, hidden: Path | None = None, stand_ins: bool = True) -> list[Lab]:
    """The labs of this course (see the module docstring), in course order, then notebook-only
    rows. ``hidden``: the hidden tests' folder (default: ``template/hidden_tests``);
    ``stand_ins``: the references of the exercises a lab builds on stand in for the student's."""
    hidden = hidden if hidden is not None else template / "hidden_tests"
    exercises = exercise_names()
    notebooks_of = {name: exercise_notebook(name) for name in exercises}
    order = {name: (notebooks_of[name] or "99", i) for i, name in enumerate(exercises)}
    files: dict[str, list[str]] = {name: [] for name in exercises}
    for folder, where in (("tests", template / "tests"), ("hidden_tests", hidden)):
        for path in sorted(where.glob("test_*.py")):
            lab = lab_of_test_file(path, exercises)
            text = path.read_text()
            if lab is None and "mark.exercise" in text:
                # a file named for no exercise: the lab of the exercises it calls (only a file
                # with tests marked ``exercise`` has anything to grade)
                called = set(re.findall(r"""exercise\(\s*["'](\w+)["']\s*\)""", text))
                called &= set(exercises)
                lab = max(called, key=order.get) if called else None
            if lab is not None:
                files[lab].append(f"{folder}/{path.name}")
            elif folder == "hidden_tests":
                print(
                    f"warning: hidden_tests/{path.name} belongs to no lab "
                    "(name it test_<exercise>_*.py)",
                    file=sys.stderr,
                )
    labs = []
    for name in sorted(exercises, key=order.get):
        notebook = notebooks_of[name]
        if not (template / "notebooks" / str(notebook)).exists():
            notebook = None
        if notebook in {lab.notebook for lab in labs}:
            notebook = None  # two exercise modules of one notebook: it is graded with the first
        earlier = tuple(e for e in builds_on(name) if e in exercises) if stand_ins else ()
        labs.append(Lab(name, notebook, tuple(files[name]), earlier))
    named = {lab.notebook for lab in labs}
    labs += [
        Lab(p.stem, p.name, ())
        for p in sorted((template / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        if p.name not in named
    ]
    return labs


# ``python -m pytest``, the process ended without the interpreter's teardown once pytest has
# returned (``labs.runtime.exit``: a second of CPU a run; the results were streamed before)
PYTEST_THEN_EXIT = (
    "import pytest\n"
    "from labs.runtime.exit import exit_without_teardown\n"
    "exit_without_teardown(pytest.main())"
)


def _pytest_argv(course: str, files, test_timeout: float, *more: str) -> list[str]:
    """pytest on ``files``, tests marked exercise, with the grader's plugin and pytest-timeout
    only (the items run with PYTEST_DISABLE_PLUGIN_AUTOLOAD: nbval, anyio ... cost a second a
    run and grade nothing)."""
    return [
        sys.executable,
        "-c",
        PYTEST_THEN_EXIT,
        *files,
        "-m",
        "exercise",
        "-o",
        "addopts=--strict-markers",
        "-p",
        "pytest_timeout",
        "-p",
        "labs_grade_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        f"--rootdir={course}",
        "-c",
        f"{course}/pyproject.toml",
        f"--timeout={test_timeout}",
        "--timeout-method=signal",
        *more,
    ]


def run_sandboxed(
    session: Session,
    item: Path,
    argv_for,
    *,
    cwd: str,
    timeout: float,
    log: Path,
    results_limit: int,
    cpus: set[int] | None = None,
    read_only_course: bool = False,
    **env: str,
) -> Finished:
    """Run one item whose own files are in ``item/course``; ``argv_for(layout)`` gives its
    command, with the paths the item sees. It runs on the cores ``cpus``, in a cgroup of its own
    where the machine allows one, under the sandbox's seccomp filter; its course is bound
    read-only over the release (``read_only_course``) or copied."""
    box = session.sandbox
    layout = box.layout(item)
    limits = box.limits
    group = None
    if session.cgroups is not None and box.isolated:
        cores = len(cpus) if cpus else len(os.sched_getaffinity(0))
        group = session.cgroups.new_group(
            int(limits.memory_gib * sandbox.GIB), limits.processes, cores
        )
    pipes = {"results": os.pipe(), "status": os.pipe()}
    if box.isolated:
        pipes["info"] = os.pipe()
    inputs = ()
    if box.isolated and session.seccomp is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, session.seccomp)
        os.close(write_end)
        inputs = (read_end,)
    results_fd = pipes["results"][1]
    command = box.command(
        item,
        argv_for(layout),
        cwd=f"{layout.course}/{cwd}",
        results_fd=results_fd,
        status_fd=pipes["status"][1],
        info_fd=pipes["info"][1] if box.isolated else None,
        seccomp_fd=inputs[0] if inputs else None,
        read_only_course=read_only_course,
        watch_memory=group is None,
    )
    return run_item(
        command,
        env=box.env(layout, LABS_GRADE_FD=str(results_fd), **env),
        timeout=timeout,
        log=log,
        results_limit=results_limit,
        sandboxed=box.isolated,
        pipes=pipes,
        inputs=inputs,
        cpus=cpus,
        group=group,
    )


def collect_tests(session: Session) -> dict[str, list[str]]:
    """lab -> node ids of its tests marked ``exercise``, collected once on the instructor's copy
    (no student code in it)."""
    files = [f for lab in session.labs for f in lab.test_files]
    if not files:
        return {lab.name: [] for lab in session.labs}
    item = session.private / "items" / "collect"
    if session.hidden is not None:
        shutil.copytree(session.hidden, item / "course" / "hidden_tests")
    (item / "course").mkdir(parents=True, exist_ok=True)
    log = session.private / "collect.log"
    done = run_sandboxed(
        session,
        item,
        lambda layout: _pytest_argv(layout.course, files, 60, "--collect-only"),
        cwd=".",
        timeout=600,
        log=log,
        results_limit=RESULTS_LIMIT,
        read_only_course=True,
        PYTHONPATH=_pythonpath(session, item),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    first = done.results.split(b"\n", 1)[0]
    try:
        collected = json.loads(first)["collected"]
    except (ValueError, KeyError, TypeError):
        collected = None
    if done.exit_code not in (0, 5) or collected is None:  # 5: nothing selected
        raise RuntimeError(
            f"the instructor's tests do not collect (exit {done.exit_code}):\n"
            + log.read_text(errors="replace")[-3000:]
        )
    return {
        lab.name: [n for n in collected if n.split("::")[0] in lab.test_files]
        for lab in session.labs
    }


def _pythonpath(session: Session, item: Path) -> str:
    layout = session.sandbox.layout(item)
    return f"{layout.course}{os.pathsep}{layout.tools}"


# ---- one student's submission
# ----------------------------------------------------------------------------


def read_student(session: Session, name: str) -> Student:
    """The student's folder read without trusting it (``labs.grade.submission``)."""
    folder = session.submissions / name
    student = Student(name, submission.display(name), folder)
    found = submission.scan(folder)
    student.into = found.into
    student.notes += submission.link_notes(found.links, folder)
    student.notes += [
        f"{md_code(submission.display(p))}: not looked at" for p in found.not_looked_at
    ]
    student.notes += [f"{md_code(submission.display(p))}: not a file or folder" for p in found.odd]
    for kind, what in (("links", "symlinks"), ("not_looked_at", "folders"), ("odd", "files")):
        more = found.counts.get(kind, 0) - len(getattr(found, kind))
        if more > 0:
            student.notes.append(f"... and {more} more {what} like these (not listed)")
    for exercise in exercise_names():
        rel = f"labs/{exercise}.py"
        if rel not in found.files:
            continue
        try:
            data, info = submission.read_file(folder, rel, MODULE_LIMIT)
        except submission.Unreadable as exc:
            student.notes.append(f"{md_code(rel)} was not graded: {md_code(exc, limit=300)}")
            continue
        student.modules[exercise] = data
        student.fingerprints[exercise] = (submission.digest(data), info.st_dev, info.st_ino)
    student.ignored = _ignored_changes(folder, found, session.release)
    student.notes = _release_notes(folder, session.meta.get("commit")) + student.notes
    return student


def _ignored_changes(folder: Path, found: submission.Scan, release: Path) -> list[str]:
    """Files of the submission, other than exercise modules and notebooks, that differ from the
    release (links are listed on their own)."""
    graded = {f"labs/{name}.py" for name in exercise_names()}
    ignored = []
    for rel, info in sorted(found.files.items()):
        if (
            rel.endswith(".pyc")
            or rel in graded
            or rel == ".release.json"
            or (rel.startswith("notebooks/") and rel.endswith(".ipynb"))
        ):
            continue
        ref = release / rel
        same = ref.is_file() and not ref.is_symlink() and ref.stat().st_size == info.st_size
        if same:
            try:
                same = submission.read_file(folder, rel)[0] == ref.read_bytes()
            except submission.Unreadable:
                same = False
        if not same:
            ignored.append(submission.display(rel))
    return ignored


def _release_notes(folder: Path, commit: str | None) -> list[str]:
    try:
        data, _ = submission.read_file(folder, ".release.json", 1 << 20)
        theirs = json.loads(data).get("commit")
    except (submission.Unreadable, ValueError, AttributeError):
        return [
            "Your submission has no readable `.release.json`: was it made from the course release?"
        ]
    if commit and theirs and theirs != commit:
        return [
            f"Your copy of the course came from commit {md_code(str(theirs)[:12])}; it was graded "
            f"with {md_code(commit[:12])}."
        ]
    return []


def _new_item(session: Session, student: Student, kind: str, lab: Lab) -> Path:
    """A fresh item folder holding the student's exercise modules under ``course/labs`` and the
    references standing in for the exercises ``lab`` builds on under ``course/solutions``."""
    item = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=session.private / "items"))
    labs = item / "course" / "labs"
    labs.mkdir(parents=True)
    for name, data in student.modules.items():
        (labs / f"{name}.py").write_bytes(data)
    if lab.stand_ins:
        references = item / "course" / "solutions"
        references.mkdir()
        for name in ("__init__", *lab.stand_ins):
            shutil.copyfile(session.references / f"{name}.py", references / f"{name}.py")
    return item


def _stand_in_env(lab: Lab) -> dict[str, str]:
    """``LABS_REFERENCE`` naming the lab's stand-ins (every rank of the item inherits it)."""
    return {REFERENCE_ENV: ",".join(lab.stand_ins)} if lab.stand_ins else {}


def grade_tests(
    session: Session,
    student: Student,
    lab: Lab,
    res: Result,
    out: Path,
    hidden: bool,
    cpus: set[int] | None = None,
    together: bool = False,
    unstarted: str = "",
) -> Finished | None:
    """Run the lab's public (or hidden) tests in a sandbox and add what they prove to ``res``;
    ``together``: the public tests, then the hidden ones, in one pytest (never concealed);
    ``unstarted``: why the lab is not started (``not_started``), and its tests fail unrun. A
    concealed hidden run adds only how many passed: no message, no count of processes left, no
    note, no time, no detail of why its results could not be used."""
    folders = (HIDDEN_DIR,) if hidden else (PUBLIC_DIR, HIDDEN_DIR) if together else (PUBLIC_DIR,)
    graded = [n for n in session.expected[lab.name] if n.startswith(folders)]
    if not graded:
        return None
    args = session.args
    concealed = hidden and args.conceal_hidden
    if together and args.conceal_hidden:
        raise ValueError("concealed hidden tests run on their own")
    budget = args.lab_timeout - res.tests_time_s
    kind = "hidden" if hidden else "tests"
    hidden_graded = [n for n in graded if n.startswith(HIDDEN_DIR)]
    res.tests_total += len(graded)
    res.hidden_total += len(hidden_graded)
    why = f"not run: {unstarted}" if unstarted else ""
    if not why and budget < 1:
        why = f"not run: the lab's time budget of {args.lab_timeout:g} s ran out"
    if why:
        if not concealed:
            res.failures += [[n, why] for n in graded]
        return None
    item = _new_item(session, student, kind, lab)
    try:
        files = [f for f in lab.test_files if f.startswith(folders)]
        if hidden_graded:
            _copy_hidden(session.hidden, item / "course" / "hidden_tests", files)
        log = out / "logs" / f"{lab.name}.{kind}.log"
        if concealed:
            log = item / "hidden.log"  # kept nowhere the student could read it
        timeouts_so_far = sum("Timeout (>" in message for _, message in res.failures)
        done = run_sandboxed(
            session,
            item,
            lambda layout: _pytest_argv(layout.course, files, args.test_timeout),
            cwd=".",
            timeout=budget,
            log=log,
            results_limit=RESULTS_LIMIT,
            cpus=cpus,
            read_only_course=True,
            PYTHONPATH=_pythonpath(session, item),
            PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
            MPLBACKEND="Agg",
            LABS_GRADE_CHECK=session.token,
            LABS_GRADE_MAX_TIMEOUTS=str(args.max_timeouts),
            LABS_GRADE_TIMEOUTS_SO_FAR=str(timeouts_so_far),
            **_stand_in_env(lab),
        )
    finally:
        shutil.rmtree(item, ignore_errors=True)
    why = _why_unrun(done, args)
    run = read_test_run(done.results, graded, session.token, why, done.results_overflow)
    res.tests_passed += len(run.passed)
    res.hidden_passed += sum(n.startswith(HIDDEN_DIR) for n in run.passed)
    if run.problem or run.guarded:  # the instructor's terminal hears why, whatever is concealed
        why = run.problem or f"the grading guard refused {run.guarded} (a bug in the course)"
        shown = printable(student.shown, newlines=False)
        print(f"warning: {shown} · {lab.name} {kind}: {why}", file=sys.stderr)
    if concealed:
        if run.problem or run.guarded:
            _add_error(res, CONCEALED_ERROR)
        return done
    res.tests_time_s += done.seconds
    res.tests_cpu_s += done.cpu_seconds or 0.0
    res.leftover_processes += done.leftover
    if run.problem:
        _add_error(
            res,
            f"the {'hidden ' if hidden else ''}tests' results were thrown away: {run.problem}",
        )
    for refused in run.guarded:
        _add_error(
            res,
            f"a test of the course ran exercise code, or unpickled more than data, in the test "
            f"process; the grader refused it ({refused}): a bug in the course, not in your code",
        )
    res.failures += [[n, message] for n, message in run.failed.items()]
    _add_notes(res, _limit_notes(session, done, list(run.failed.values())))
    return done


def not_started(session: Session, student: Student, lab: Lab) -> str:
    """How ``lab``'s exercise module shows the lab is not started, or "": it is the course's stub
    byte for byte (line endings aside), or the submission has none (and the stub stands in). Such
    a lab is not tested: a stub fails every test of its lab (tests/test_stubs.py), so it scores 0
    without them (a sandbox, a pytest and a launch per test less, about 10 CPU-s a lab); and its
    notebook is not run unless it holds code of the student's own, which could fill the exercise
    in there."""
    path = session.release / "labs" / f"{lab.name}.py"
    if not path.is_file():  # a notebook-only row
        return ""
    stub = path.read_bytes()
    mine = student.modules.get(lab.name)
    if mine is None:
        what = f"your submission has no labs/{lab.name}.py that could be read, so the stub stood in"
    elif mine.replace(b"\r\n", b"\n") == stub:  # as git on Windows may check it out
        what = f"labs/{lab.name}.py is the course's stub, unchanged"
    else:
        return ""
    functions = ", ".join(unwritten_in(stub.decode()))
    return f"{what}; write {functions} (each raises NotImplementedError until then)"


def _add_error(res: Result, why: str) -> None:
    res.grading_error = (f"{res.grading_error}; " if res.grading_error else "grading error: ") + why


def _add_notes(res: Result, notes: list[str]) -> None:
    res.notes += [note for note in notes if note not in res.notes]


def _copy_hidden(hidden: Path | None, dst: Path, files: list[str]) -> None:
    """The hidden tests this run needs, and the hidden folder's other files (conftest, helpers)."""
    dst.mkdir(parents=True, exist_ok=True)
    wanted = {Path(f).name for f in files if f.startswith("hidden_tests/")}
    for path in sorted(hidden.iterdir()) if hidden else []:
        if path.is_file() and (path.name in wanted or not path.name.startswith("test_")):
            shutil.copyfile(path, dst / path.name)


def _why_unrun(done: Finished, args) -> str:
    if done.timed_out:
        return f"not run: the lab's time budget of {args.lab_timeout:g} s ran out"
    if done.limit:
        return f"not run: the sandbox stopped the run (over its {done.limit} limit)"
    if done.signal:
        return f"not run: pytest was killed by signal {done.signal} before this test"
    return f"not run: pytest stopped (exit code {done.exit_code}) before this test"


def _limit_notes(session: Session, done: Finished, messages: list[str]) -> list[str]:
    """Lines for the feedback: the sandbox limits this item hit, and output cut from its log."""
    hit = [done.limit] if done.limit else []
    for kind, marks in LIMIT_MARKS.items():
        if kind not in hit and any(mark in m for m in messages for mark in marks):
            hit.append(kind)
    limits = asdict(session.sandbox.limits)
    notes = [f"**limit hit**: {LIMIT_NOTES[kind].format(**limits)}" for kind in hit]
    if done.output_bytes > 2 * LOG_KEEP_BYTES:
        notes.append(
            f"your code printed {done.output_bytes / 1e6:.1f} MB; the log keeps its first and "
            "last 100 kB"
        )
    return notes


def grade_notebook(
    session: Session,
    student: Student,
    lab: Lab,
    res: Result,
    out: Path,
    cpus: set[int] | None = None,
    unstarted: str = "",
) -> None:
    """Run the student's notebook in a sandbox; "executed" as ``labs.grade.notebooks`` says. The
    notebook is read, and the runner's report too, by a limited child process
    (``notebooks.prepare_limited``, ``notebooks.save_limited``), never by the grader itself. A lab
    not started (``unstarted``: why, from ``not_started``) whose notebook holds the course's code
    and none of the student's is not run: "no"."""
    args = session.args
    rel = f"notebooks/{lab.notebook}"
    res.notebook_executed = "no"
    try:
        mine, _ = submission.read_file(student.folder, rel, NOTEBOOK_LIMIT)
    except submission.Unreadable as exc:
        res.notebook_detail = f"missing: {exc}"
        return
    limit = int(session.sandbox.limits.notebook_output_mib * sandbox.MIB)
    item = _new_item(session, student, "notebook", lab)
    try:
        (item / "course" / "notebooks").mkdir()
        theirs = item / "submitted.ipynb"
        theirs.write_bytes(mine)
        prepared = notebooks.prepare_limited(
            str(theirs), str(session.release / rel), str(item / "course" / rel)
        )
        theirs.unlink()
        res.cells_changed = prepared.changed
        if not prepared.runnable:
            res.notebook_detail = prepared.problems[0]
            return
        if unstarted and not prepared.own_code and not prepared.problems:
            res.notebook_detail = (
                f"not run, the lab is not started: {unstarted}; the notebook has no code of yours"
            )
            return
        done = run_sandboxed(
            session,
            item,
            lambda layout: [
                sys.executable,
                "-I",
                f"{layout.tools}/run_notebook.py",
                f"{layout.course}/{rel}",
                str(args.cell_timeout),
                str(limit),
            ],
            cwd="notebooks",
            timeout=args.notebook_timeout,
            log=out / "logs" / f"{lab.name}.notebook.log",
            results_limit=limit + 3 * len(mine) + (4 << 20),
            cpus=cpus,
            MPLBACKEND="module://matplotlib_inline.backend_inline",
            **_stand_in_env(lab),
        )
        results = item / "results"
        results.write_bytes(done.results)
        (out / "notebooks").mkdir(exist_ok=True)
        report = notebooks.save_limited(str(results), str(out / "notebooks" / lab.notebook))
    finally:
        shutil.rmtree(item, ignore_errors=True)
    res.notebook_time_s = done.seconds
    res.notebook_cpu_s = done.cpu_seconds or 0.0
    res.leftover_processes += done.leftover
    executed, detail = notebooks.judge(prepared, report)
    if done.timed_out:
        where = notebooks.where(prepared, report["cell"])
        detail = f"timeout: over {args.notebook_timeout:g} s in all; it was running {where}"
        executed = False
    elif done.limit and not executed:
        detail = f"stopped by the sandbox (over its {done.limit} limit): {detail}"
    res.notebook_executed = "yes" if executed else "no"
    res.notebook_detail = detail
    end = report["end"] or {}
    _add_notes(res, _limit_notes(session, done, [] if executed else [detail]))
    if end.get("cut"):
        res.notes.append(
            f"**limit hit**: notebook output: {end['cut'] / 1e6:.1f} MB of outputs were dropped, "
            f"over {session.sandbox.limits.notebook_output_mib:g} MiB (`--max-notebook-output`)"
        )
    if done.results and not report.get("saved") and report["malformed"] is None:
        res.notes.append("the executed notebook could not be saved")


def grade_student(session: Session, name: str) -> list[Result]:
    """Every lab of one student, each item in its own sandbox, on the cores of a free job slot;
    the feedback page. Whatever goes wrong becomes this student's rows ("grading error: ..."),
    and grading goes on."""
    shown = submission.display(name)
    if name in REPORT_FILES:
        why = f"grading error: a folder named {shown} would replace a file of the report; rename it"
        return _error_rows(session, shown, why)
    if (session.submissions / name).is_symlink():
        target = submission.display(os.readlink(session.submissions / name))
        return _error_rows(session, shown, f"grading error: the folder is a symlink to {target}")
    out = session.report / name
    t0 = time.perf_counter()
    try:
        student = read_student(session, name)
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable submission becomes a row
        return _error_rows(session, shown, f"grading error: the submission cannot be read ({exc})")
    cpus = session.slots.get()
    try:
        results = [_grade_lab(session, student, lab, out, cpus) for lab in session.labs]
    finally:
        session.slots.put(cpus)
    try:
        page = feedback_page(
            shown,
            results,
            student.ignored,
            session.meta,
            session.args.conceal_hidden,
            student.notes,
        )
    except Exception as exc:  # noqa: BLE001 - the page is the grader's; a bug of it costs the page
        page = f"# Feedback\n\nThe grader could not write this page ({type(exc).__name__}).\n"
    write_atomic(out / "feedback.md", page)
    write_atomic(out / "results.json", json.dumps(_gradescope(session, shown, results), indent=1))
    with session.lock:
        session.fingerprints[name] = (student.fingerprints, student.into)
    cpu = sum(r.cpu_seconds for r in results)
    _say(
        session,
        f"{printable(shown, newlines=False)}: done in {time.perf_counter() - t0:.1f} s"
        f" ({cpu:.0f} CPU-s in its sandboxes)",
    )
    return results


def _gradescope(session: Session, shown: str, results: list[Result]) -> dict:
    """The student's ``results.json`` in Gradescope's format (``labs.grade.lms``)."""
    passed = sum(r.tests_passed for r in results)
    total = sum(r.tests_total for r in results)
    ran = sum(r.notebook_executed == "yes" for r in results)
    notebooks = sum(r.notebook_executed != "-" for r in results)
    headline = (
        f"{passed}/{total} checks passed, {ran}/{notebooks} notebooks ran to the end; "
        "feedback.md beside this file says what failed and why"
    )
    return lms.gradescope_results(
        results,
        session.expected,
        lab_points=session.args.lab_points,
        conceal=session.args.conceal_hidden,
        headline=headline,
    )


def _grade_lab(session: Session, student: Student, lab: Lab, out: Path, cpus) -> Result:
    res = Result(student.shown, lab.name, lab.notebook, stand_ins=list(lab.stand_ins))
    try:
        unstarted = not_started(session, student, lab)
        if session.expected[lab.name] and session.args.conceal_hidden:
            for hidden in (False, True):
                grade_tests(
                    session, student, lab, res, out, hidden=hidden, cpus=cpus, unstarted=unstarted
                )
        elif session.expected[lab.name]:  # nothing to conceal: one pytest for both
            grade_tests(
                session,
                student,
                lab,
                res,
                out,
                hidden=False,
                cpus=cpus,
                together=True,
                unstarted=unstarted,
            )
        if lab.notebook and not session.args.no_notebooks:
            grade_notebook(session, student, lab, res, out, cpus, unstarted)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - the grader's own failure costs this row only
        _add_error(res, f"{type(exc).__name__}: {exc}"[:500])
    _say(
        session,
        f"{printable(student.shown, newlines=False)} · {lab.name}: {res.tests_passed}/"
        f"{res.tests_total} tests, notebook ran: {res.notebook_executed}, "
        f"{res.seconds:.1f} s, {res.cpu_seconds:.0f} CPU-s",
    )
    return res


def _error_rows(session: Session, shown: str, why: str) -> list[Result]:
    """A student who cannot be graded: every lab's row says why, with no checks passed."""
    _say(session, f"{printable(shown, newlines=False)}: {printable(why, newlines=False)}")
    rows = []
    for lab in session.labs:
        expected = session.expected[lab.name]
        hidden = sum(n.startswith("hidden_tests/") for n in expected)
        rows.append(
            Result(shown, lab.name, lab.notebook, 0, len(expected), 0, hidden, grading_error=why)
        )
    return rows


def _say(session: Session, line: str) -> None:
    with session.lock:
        print(line, flush=True)


def copies(session: Session) -> list[str]:
    """Markdown lines (names escaped) about exercise files that are the same across students:
    identical bytes (other than the release's stub), one file hard-linked into several folders,
    or symlinks into a classmate's folder (at most ``COPIES_PER_STUDENT`` lines per student).
    Identical to the reference solution is said too."""
    seen = session.fingerprints
    lines = []
    for name in exercise_names():
        stub = submission.digest((session.release / "labs" / f"{name}.py").read_bytes())
        solution = submission.digest((ROOT / "solutions" / f"{name}.py").read_bytes())
        by_digest: dict[str, list[str]] = {}
        by_inode: dict[tuple, list[str]] = {}
        for student, (prints, _) in sorted(seen.items()):
            if name not in prints:
                continue
            digest, dev, ino = prints[name]
            shown = md_code(submission.display(student))
            if digest != stub:
                by_digest.setdefault(digest, []).append(shown)
            by_inode.setdefault((dev, ino), []).append(shown)
        for digest, students in by_digest.items():
            reference = " to the reference solution" if digest == solution else ""
            if len(students) > 1 or reference:
                lines.append(f"`labs/{name}.py` is identical{reference} in: {', '.join(students)}")
        for students in by_inode.values():
            if len(students) > 1:
                lines.append(f"`labs/{name}.py` is one file hard-linked in: {', '.join(students)}")
    for student, (_, into) in sorted(seen.items()):
        mine = []
        for other, rels in sorted(into.items()):
            mine += [(rel, other) for rel in rels]
        shown = md_code(submission.display(student))
        for rel, other in mine[:COPIES_PER_STUDENT]:
            lines.append(
                f"{md_code(submission.display(rel))} of {shown} is a symlink into "
                f"{md_code(submission.display(other))}'s folder"
            )
        if len(mine) > COPIES_PER_STUDENT:
            lines.append(f"... and more symlinks of {shown} into classmates' folders")
    return lines


# ---- command line
# ----------------------------------------------------------------------------------------


def _inside_repository(path: Path) -> str | None:
    """Why the report folder ``path`` may not be where it is, or None."""
    if not path.is_relative_to(ROOT):
        return None
    if path == ROOT:
        return "is the course repository itself"
    first = path.relative_to(ROOT).parts[0]
    shipped = {rel.split("/")[0] for rel in source_files() if "/" in rel}
    if first in shipped | {".git", ".venv", "solutions", "hidden_tests", ".ci"}:
        return f"is inside the course repository's {first}/; use a folder of its own (report/)"
    return None


def _check_paths(parser, submissions: Path, report: Path, hidden: Path | None) -> None:
    if not submissions.is_dir():
        parser.error(f"SUBMISSIONS_DIR={submissions} is not a folder")
    if hidden is not None and not hidden.is_dir():
        parser.error(f"--hidden-tests {hidden} is not a folder")
    if report.is_relative_to(submissions) or submissions.is_relative_to(report):
        parser.error(
            f"--out {report} and SUBMISSIONS_DIR={submissions} must not contain each other"
        )
    why = _inside_repository(report)
    if why:
        parser.error(f"--out {report} {why}")
    if report.exists() and not report.is_dir():
        parser.error(f"--out {report} is a file, not a folder")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m labs.grade", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("submissions", type=Path, metavar="SUBMISSIONS_DIR", help="one folder per student")
    add("--out", type=Path, required=True, metavar="REPORT_DIR", help="where the scorecard goes")
    add(
        "--hidden-tests",
        type=Path,
        default=None,
        metavar="DIR",
        help="extra tests, never released (default: hidden_tests/ when it exists)",
    )
    add("--no-hidden", action="store_true", help="grade with the public tests only")
    add("--labs", nargs="+", metavar="LAB", help="grade only these labs (default: all)")
    add("--students", nargs="+", metavar="NAME", help="grade only these students")
    add("--cell-timeout", type=float, default=120, metavar="S", help="per notebook cell")
    add("--notebook-timeout", type=float, default=600, metavar="S", help="per notebook, in all")
    add("--test-timeout", type=float, default=120, metavar="S", help="per test")
    add("--lab-timeout", type=float, default=900, metavar="S", help="per lab's tests, in all")
    add(
        "--max-timeouts",
        type=int,
        default=2,
        metavar="N",
        help="after N timed-out tests the lab's other tests fail unrun (0: never)",
    )
    add("--no-notebooks", action="store_true", help="run the tests only")
    add(
        "--own-prerequisites",
        action="store_true",
        help="grade each lab with the student's own earlier exercises (default: the reference "
        "stands in for each exercise a lab builds on, so each exercise is graded on its own)",
    )
    add(
        "--conceal-hidden",
        action="store_true",
        help="only how many hidden tests passed leaves their run: no names, messages or log",
    )
    add("--jobs", type=int, default=1, metavar="N", help="grade N students at once")
    add(
        "--lab-points",
        type=float,
        default=10.0,
        metavar="P",
        help="points of one lab in gradebook.csv and results.json, shared by its tests",
    )
    defaults = Limits()
    add(
        "--memory-limit",
        type=float,
        default=defaults.memory_gib,
        metavar="GIB",
        help="memory of one item's processes together",
    )
    add(
        "--max-processes",
        type=int,
        default=defaults.processes,
        metavar="N",
        help="processes and threads of one item",
    )
    add(
        "--max-open-files",
        type=int,
        default=defaults.open_files,
        metavar="N",
        help="open files of one item's processes together (and of each one)",
    )
    add(
        "--cpu-limit",
        type=float,
        default=defaults.cpu_seconds,
        metavar="S",
        help="CPU seconds of one item's processes together",
    )
    add(
        "--max-file-size",
        type=float,
        default=defaults.file_mib,
        metavar="MIB",
        help="the largest file an item may write",
    )
    add(
        "--disk-limit",
        type=float,
        default=defaults.disk_mib,
        metavar="MIB",
        help="size of an item's /tmp and of its /dev/shm (each in memory)",
    )
    add(
        "--max-notebook-output",
        type=float,
        default=defaults.notebook_output_mib,
        metavar="MIB",
        help="outputs kept in an executed notebook, in all",
    )
    add(
        "--no-cgroup",
        action="store_true",
        help="do not put items in cgroups of their own even where the machine allows it (the "
        "sandbox's init then watches their memory, and memfd and SysV shared memory are refused)",
    )
    add(
        "--unsafe-no-sandbox",
        action="store_true",
        help="run submissions without bubblewrap, as your own user (only for code you trust)",
    )
    return parser


def _students(parser, args, submissions: Path) -> list[str]:
    names = sorted(
        entry.name
        for entry in os.scandir(submissions)
        if not entry.name.startswith(".")
        and (entry.is_dir(follow_symlinks=False) or entry.is_symlink())
    )
    if args.students:
        unknown = sorted(set(args.students) - set(names))
        if unknown:
            parser.error(f"--students: no submission for {unknown}; choose from {names}")
        names = [s for s in names if s in args.students]
    if not names:
        parser.error(f"SUBMISSIONS_DIR={submissions} has no student folders")
    return names


def _limits(parser, args) -> Limits:
    try:
        return Limits(
            memory_gib=args.memory_limit,
            processes=args.max_processes,
            open_files=args.max_open_files,
            cpu_seconds=args.cpu_limit,
            file_mib=args.max_file_size,
            disk_mib=args.disk_limit,
            notebook_output_mib=args.max_notebook_output,
        )
    except ValueError as exc:
        parser.error(f"a limit must be > 0: {exc}")


def _validate(parser, args) -> None:
    for name in ("cell_timeout", "notebook_timeout", "test_timeout", "lab_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if not args.lab_points > 0:
        parser.error("--lab-points must be > 0")
    if args.unsafe_no_sandbox and args.jobs > 1:
        parser.error(
            "--jobs > 1 needs the sandbox: without it, the processes of students graded at once "
            "cannot be told apart (drop --unsafe-no-sandbox or use --jobs 1)"
        )
    if not args.unsafe_no_sandbox and sandbox.bwrap_path() is None:
        parser.error(f"bubblewrap (bwrap) is not installed: {sandbox.INSTALL_HINT}")


def _prepare(parser, session: Session, hidden_source: Path | None) -> None:
    """Tools, release and hidden tests in the private folder; the labs and their tests."""
    tools = session.sandbox.tools
    tools.mkdir()
    for name in ("inside.py", "run_notebook.py"):
        shutil.copyfile(GRADING / name, tools / name)
    shutil.copyfile(GRADING / "pytest_plugin.py", tools / "labs_grade_plugin.py")
    (session.private / "items").mkdir()
    exclude = tuple(
        p.relative_to(ROOT).as_posix()
        for p in (session.submissions, session.report, hidden_source)
        if p is not None and p.is_relative_to(ROOT) and p != ROOT
    )
    try:
        build_template(session.release, exclude)
    except ValueError as exc:  # a solution module that does not parse: no release, no grading
        parser.exit(1, f"error: {exc}\n")
    if hidden_source is not None:
        session.hidden = session.private / "hidden"
        shutil.copytree(
            hidden_source,
            session.hidden,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    problem = sandbox.check(session.sandbox, session.private, session.seccomp)
    if problem:
        parser.exit(2, f"error: {problem}\n")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    submissions = args.submissions.resolve()
    report = args.out.resolve()
    default_hidden = ROOT / "hidden_tests" if (ROOT / "hidden_tests").is_dir() else None
    hidden = None if args.no_hidden else (args.hidden_tests or default_hidden)
    hidden = hidden.resolve() if hidden else None
    _check_paths(parser, submissions, report, hidden)
    _validate(parser, args)
    limits = _limits(parser, args)
    students = _students(parser, args, submissions)
    if args.unsafe_no_sandbox:
        print(f"warning: {NOT_ISOLATED}", file=sys.stderr)
    become_subreaper()
    report.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="labs-grade-") as tmp:
        private = Path(tmp)
        hide = [p for p in (ROOT, submissions, report, hidden, private) if p is not None]
        box = Sandbox(private, limits, not args.unsafe_no_sandbox, hide)
        session = Session(args, box, private, report, submissions, None)
        _confine(session)
        _prepare(parser, session, hidden)
        session.labs = discover_labs(
            session.release,
            session.hidden or private / "no-hidden",
            stand_ins=not args.own_prerequisites,
        )
        if args.labs:
            valid = [lab.name for lab in session.labs]
            unknown = sorted(set(args.labs) - set(valid))
            if unknown:
                parser.error(f"--labs: unknown {unknown}; choose from {valid}")
            session.labs = [lab for lab in session.labs if lab.name in args.labs]
        try:
            session.expected = collect_tests(session)
        except RuntimeError as exc:
            parser.exit(1, f"error: {exc}\n")
        _drop_idle_labs(session)
        _copy_references(session)
        session.meta = {
            "graded_at": time.strftime("%Y-%m-%d %H:%M"),
            "commit": json.loads((session.release / ".release.json").read_text())["commit"],
            "labs": [asdict(lab) for lab in session.labs],
            "hidden_tests": str(hidden) if hidden else None,
            "isolated": box.isolated,
            "limits": asdict(limits),
            "memory_accounting": _memory_accounting(session),
            "cores_per_job": [sorted(cpus) for cpus in list(session.slots.queue)],
            "lab_points": args.lab_points,
        }
        try:
            _grade_all(session, students)
        finally:
            if session.cgroups is not None:
                session.cgroups.close()
    print(f"wrote {report / 'scores.csv'}, {report / 'summary.md'} and a feedback.md per student")
    return 0


def cpu_slots(jobs: int, cpus: list[int]) -> list[set[int]]:
    """The cores of each of ``jobs`` students graded at once: disjoint sets, as even as they can
    be, when there are enough cores; one core each, shared round the jobs, when there are not."""
    if jobs > len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(jobs)]
    size, extra = divmod(len(cpus), jobs)
    slots = []
    start = 0
    for i in range(jobs):
        count = size + (i < extra)
        slots.append(set(cpus[start : start + count]))
        start += count
    return slots


def _confine(session: Session) -> None:
    """Where each item runs: the cores of its student's job, a cgroup of its own (where the
    machine allows one), the seccomp filter (which also refuses memfd and SysV shared memory,
    whose memory only a cgroup would count)."""
    args = session.args
    cpus = sorted(os.sched_getaffinity(0))
    for slot in cpu_slots(args.jobs, cpus):
        session.slots.put(slot)
    if args.jobs > len(cpus):
        print(
            f"warning: --jobs {args.jobs} on {len(cpus)} cores: students share cores, and one "
            "spinning many processes slows those beside it; use --jobs <= the number of cores",
            file=sys.stderr,
        )
    if not session.sandbox.isolated:
        return
    if not args.no_cgroup:
        session.cgroups = cgroups.detect()
    refuse = ("sched_setaffinity",)
    if session.cgroups is None:
        refuse += ("memfd_create", "shmget")
        print(f"note: {_memory_accounting(session)}", file=sys.stderr)
    session.seccomp = sandbox.seccomp_filter(refuse)
    if session.seccomp is None:
        print(
            "warning: no seccomp filter for this machine's architecture: a submission can move "
            "itself to other cores",
            file=sys.stderr,
        )


def _memory_accounting(session: Session) -> str:
    if not session.sandbox.isolated:
        return "none (--unsafe-no-sandbox)"
    if session.cgroups is not None:
        return f"the kernel's: a cgroup {session.cgroups.kind} per item"
    return (
        "watched by each sandbox's init (no cgroup the grader can write: see the README), "
        "memfd and SysV shared memory refused; pipe and socket buffers are not counted"
    )


def _copy_references(session: Session) -> None:
    """The grader's copy of the references its labs' stand-ins need (``solutions/``)."""
    needed = sorted({name for lab in session.labs for name in lab.stand_ins})
    if not needed:
        return
    session.references = session.private / "references"
    session.references.mkdir()
    for name in ("__init__", *needed):
        shutil.copyfile(ROOT / "solutions" / f"{name}.py", session.references / f"{name}.py")


def _drop_idle_labs(session: Session) -> None:
    run_notebooks = not session.args.no_notebooks
    idle = [
        lab.name
        for lab in session.labs
        if not session.expected[lab.name] and not (lab.notebook and run_notebooks)
    ]
    if idle:
        why = "no notebook" if run_notebooks else "--no-notebooks"
        print(
            f"nothing to grade in {', '.join(idle)}: no tests marked exercise, {why}",
            file=sys.stderr,
        )
    session.labs = [lab for lab in session.labs if lab.name not in idle]


def _grade_all(session: Session, students: list[str]) -> None:
    """Every student, ``--jobs`` at a time; the reports rewritten after each one, the class plot
    (a second or two for a course's worth of labs) at most every ``PLOT_EVERY_S`` and after the
    last."""
    graded: dict[str, list[Result]] = {}
    plot = {"drawn": False, "at": -PLOT_EVERY_S}

    def one(name: str) -> None:
        try:
            results = grade_student(session, name)
        except Exception as exc:  # noqa: BLE001 - nothing one student does stops the others
            why = f"grading error: the grader failed on this submission ({type(exc).__name__})"
            results = _error_rows(session, submission.display(name), why)
        with session.lock:
            graded[name] = results
            ordered = [r for s in students if s in graded for r in graded[s]]
            now = time.monotonic()
            if len(graded) == len(students) or now - plot["at"] >= PLOT_EVERY_S:
                plot["drawn"] = mistakes.plot_scores(ordered, session.report / mistakes.PLOT)
                plot["at"] = now
            class_lines = mistakes.summary_lines(ordered, mistakes.PLOT if plot["drawn"] else None)
            write_reports(session.report, ordered, session.meta, copies(session), class_lines)
            labs = list(dict.fromkeys(r.lab for r in ordered))
            points = session.meta.get("lab_points", 10.0)
            gradebook = lms.gradebook_csv(ordered, labs, lab_points=points)
            write_atomic(session.report / "gradebook.csv", gradebook)

    pool = ThreadPoolExecutor(max_workers=session.args.jobs)
    try:
        for future in [pool.submit(one, name) for name in students]:
            future.result()
    finally:  # on Ctrl-C too: students not started are dropped, running items are killed
        pool.shutdown(wait=False, cancel_futures=True)
        stop_all()
        pool.shutdown(wait=True)
        if not session.sandbox.isolated:
            kill_leftovers()
