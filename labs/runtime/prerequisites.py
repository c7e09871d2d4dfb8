"""The earlier exercises a lab runs: whether you have written each, whether its reference can
stand in, and the one line that makes it stand in (issue 28: every learner reaches the end).

    import labs
    labs.prerequisites("mesh")          # notebook 08: your zero, tensor_parallel,
                                        # pipeline_parallel and context_parallel, one line each
    labs.exercise_status("ddp", "zero") # notebook 12: these exercises themselves
    labs.use_reference("pipeline_parallel")  # its reference, your code for the rest, in this
                                        # kernel and every rank it launches (LABS_REFERENCE)
    labs.use_own("pipeline_parallel")   # back to your labs/pipeline_parallel.py

"Written" is read from your file, not run: a function whose body still raises the stub's
``NotImplementedError("exercise ... is not written yet")`` is not written. Whether it is right is
``python -m labs.check <exercise>``'s to say. The reference is available where ``solutions/`` holds
it: always in the course's repository, in a student release only for the exercises the instructor
revealed (``python -m labs.release OUT --reveal EX``).

``stuck_advice`` is what a failed run adds to its error when the exercise that failed is an earlier
one (``labs.runtime.errors.RankError``, ``python -m labs.run``).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from labs.runtime import impl

UNWRITTEN = re.compile(r"exercise (\S+) is not written yet")


def _learner_file(name: str) -> Path:
    """``labs/<name>.py`` of the copy of the course this process runs (not imported)."""
    import labs

    return Path(labs.__file__).resolve().parent / f"{name}.py"


def unwritten(name: str) -> list[str]:
    """The functions of your ``labs/<name>.py`` that still raise the stub's NotImplementedError,
    in file order (empty: none left), read from the source without running it. A file that does
    not parse gives ``["(does not parse: line N)"]``."""
    impl.parse_exercises([name], what="exercise")
    path = _learner_file(name)
    return unwritten_in(path.read_text(), str(path))


def unwritten_in(source: str, filename: str = "<stub>") -> list[str]:
    """``unwritten`` of a module's ``source``."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return [f"(does not parse: line {e.lineno})"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            for arg in node.exc.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    match = UNWRITTEN.search(arg.value)
                    if match:
                        found.append((node.lineno, match.group(1)))
    return [function for _, function in sorted(found)]


def reference_available(name: str) -> bool:
    """Whether this copy of the course holds the reference of exercise ``name``."""
    try:
        return importlib.util.find_spec(f"solutions.{name}") is not None
    except ModuleNotFoundError:  # no solutions/ at all
        return False


def unavailable_message(name: str) -> str:
    """What to do when the reference of ``name`` is not in this copy of the course."""
    return (
        f"the reference for exercise {name!r} is not in this copy of the course: a student release"
        " holds only the solutions its instructor revealed. Write"
        f" labs/{name}.py (python -m labs.check {name} tells you what is missing), or ask your"
        f" instructor to reveal it (python -m labs.release OUT --reveal {name})."
    )


@dataclass(frozen=True)
class ExerciseState:
    """One exercise as this process sees it."""

    name: str
    notebook: str  # "05_pipeline_parallel"
    unwritten: tuple[str, ...]  # functions still raising the stub's NotImplementedError
    reference_available: bool
    runs: str  # "labs" (yours) or "solutions" (the reference), as exercise() would pick now

    @property
    def written(self) -> bool:
        return not self.unwritten

    def cells(self) -> list[str]:
        if self.written:
            yours = "written"
        else:
            yours = f"{len(self.unwritten)} to write, first {self.unwritten[0]}"
        runs = "the reference" if self.runs == "solutions" else "yours"
        if self.runs == "labs" and not self.written:
            runs = "yours: will stop"
        return [
            self.name,
            self.notebook[:2],
            yours,
            "available" if self.reference_available else "not here",
            runs,
        ]


def state_of(name: str) -> ExerciseState:
    from labs.experiments.spec import teacher

    return ExerciseState(
        name=name,
        notebook=teacher(name).notebook,
        unwritten=tuple(unwritten(name)),
        reference_available=reference_available(name),
        runs=impl.source_of(name),
    )


class Status:
    """A table of exercises (``prerequisites``, ``exercise_status``): printed, or shown as a
    notebook cell's output; ``states`` holds the figures."""

    HEADER = ["exercise", "nb", "your labs/<exercise>.py", "reference", "runs now"]

    def __init__(self, title: str, states: list[ExerciseState]):
        self.title = title
        self.states = states

    def __getitem__(self, name: str) -> ExerciseState:
        return next(s for s in self.states if s.name == name)

    def lines(self) -> list[str]:
        if not self.states:
            return [self.title]
        rows = [self.HEADER] + [s.cells() for s in self.states]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER))]
        out = [self.title]
        out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        stuck = [s for s in self.states if s.runs == "labs" and not s.written]
        chosen = [s.name for s in self.states if s.name in impl.reference_exercises()]
        if chosen and not stuck:
            out.append(
                f"The reference runs for {', '.join(chosen)} (LABS_REFERENCE), your code for the"
                f' rest; labs.use_own("{chosen[0]}") goes back to yours.'
            )
        else:
            example = (stuck or self.states)[0].name
            out.append(
                f'Stuck on one? labs.use_reference("{example}") runs its reference, and your code'
                " for the rest,\nin this kernel and every rank it launches (LABS_REFERENCE);"
                f' labs.use_own("{example}") goes back to yours.'
            )
        out += [unavailable_message(s.name) for s in stuck if not s.reference_available]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the table, not an object
        p.text(str(self))


def exercise_status(*names: str) -> Status:
    """These exercises' states (see the module docstring), e.g. ``exercise_status("ddp", "zero")``
    in notebook 12, which profiles them."""
    chosen = impl.parse_exercises(names, what="exercise_status")
    title = f"{len(chosen)} exercise{'s' * (len(chosen) != 1)}:"
    return Status(title, [state_of(n) for n in chosen])


def prerequisites(name: str) -> Status:
    """The earlier exercises lab or exercise ``name`` runs (its declaration's ``builds_on``):
    ``prerequisites("mesh")`` in notebook 08, ``"infer"`` (or ``"inference"``) in 09,
    ``"multimodal"`` in 11."""
    from labs.experiments.spec import listings

    lab = next((x for x in listings() if x.name == name), None)
    if lab is not None:
        earlier = tuple(dict.fromkeys(lab.builds_on))
        where = f"notebook {lab.notebook[:2]} ({lab.name})"
    else:
        earlier = impl.builds_on(name)  # ValueError naming the exercises for an unknown name
        where = f"exercise {name}"
    title = (
        f"{where} runs {len(earlier)} earlier exercise{'s' * (len(earlier) != 1)}:"
        if earlier
        else f"{where} runs no earlier exercise"
    )
    return Status(title, [state_of(n) for n in earlier])


def use_reference(*names: str) -> Status:
    """Run the reference of ``names`` from now on, in this process (a notebook's kernel) and every
    rank it launches, your own code for every other exercise (adds them to ``LABS_REFERENCE``).
    A reference this copy of the course does not hold is refused with what to ask for."""
    chosen = impl.parse_exercises(names, what="use_reference")
    for name in chosen:
        if not reference_available(name):
            raise impl.ReferenceUnavailable(unavailable_message(name))
    impl.set_reference([*impl.reference_exercises(), *chosen])
    return exercise_status(*chosen)


def use_own(*names: str) -> Status:
    """Back to your own code for ``names`` (all of them when none is named)."""
    chosen = impl.parse_exercises(names, what="use_own") if names else impl.reference_exercises()
    impl.set_reference([n for n in impl.reference_exercises() if n not in chosen])
    return exercise_status(*chosen) if chosen else exercise_status()


# --- what a failed run says -----------------------------------------------------------------------
_LAB_FRAME = re.compile(r'File "[^"]*[/\\]labs[/\\]experiments[/\\](\w+)\.py"')
_EXERCISE_FRAME = re.compile(r'File "[^"]*[/\\]labs[/\\](\w+)\.py"')


def earlier_exercise(location: str, traceback_text: str) -> str | None:
    """The earlier exercise a failure happened in, or None: ``location`` ("labs/<exercise>.py:N",
    where it raised) names one of your exercise modules, and it is one the running lab builds on
    (the lab of the outermost ``labs/experiments`` frame of ``traceback_text``), or one the
    outermost exercise on the stack builds on."""
    from labs.experiments.spec import builds_on, listings

    match = re.fullmatch(r"labs/(\w+)\.py:\d+", location or "")
    if match is None or match.group(1) not in impl.EXERCISES:
        return None
    name = match.group(1)
    labs_ = {x.name: x for x in listings()}
    frames = _LAB_FRAME.findall(traceback_text)
    if frames:
        lab = labs_.get(frames[0].split("_")[0])
        if lab is not None:
            return name if name in lab.builds_on and name not in lab.exercises else None
    outer = [f for f in _EXERCISE_FRAME.findall(traceback_text) if f in impl.EXERCISES]
    if outer and outer[0] != name and name in builds_on(outer[0]):
        return name
    return None


def stuck_advice(name: str) -> str:
    """What to do when earlier exercise ``name`` stops a lab: which it is, and how to run its
    reference (or, in a copy without it, what to ask the instructor for)."""
    from labs.experiments.spec import teacher

    missing = unwritten(name)
    state = f" (not written yet: {', '.join(missing)})" if missing else ""
    head = (
        f"labs/{name}.py is exercise {name} of notebook {teacher(name).notebook}, an earlier"
        f" exercise this lab runs{state}."
    )
    if not reference_available(name):
        return (
            f"{head} Its reference is not in this copy of the course (a student release holds"
            f" only the solutions its instructor revealed): finish labs/{name}.py (python -m"
            f" labs.check {name} tells you what is missing), or ask your instructor to reveal it"
            f" (python -m labs.release OUT --reveal {name})."
        )
    return (
        f"{head} To go on with its reference and your own code for the rest:"
        f' labs.use_reference("{name}") in the notebook (after import labs), or'
        f" --reference {name} with python -m labs.run / labs.check, or LABS_REFERENCE={name} for"
        " any command."
    )
