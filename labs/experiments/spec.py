"""What a lab declares about itself, once, and every list of labs built from those declarations.

A lab is the module ``labs.experiments.<name>`` (one word: the name ``python -m labs.run`` takes;
its parts are ``<name>_<part>`` modules). It declares its options as one frozen dataclass and
itself as a :class:`Lab`:

    @dataclass(frozen=True)
    class Options:
        variant: str = option("bucketed", "which DDP to run", choices=("naive", ..., "all"))
        bucket_mb: float = option(0.1, "bucket capacity in MiB")

        def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
            ...  # what these options must satisfy in this run (ValueError naming the fix)

    LAB = Lab(
        name="ddp",                      # python -m labs.run ddp
        notebook="02_data_parallel",
        exercises=("ddp",),              # the exercise modules its notebook teaches, in order
        builds_on=(),                    # the earlier exercises its runs call through exercise()
        reference=("build",),            # its functions that compute what a run is compared with
        options=Options,                 # None: its notebook's lab has no command (notebook 10)
        ranks=4,                         # run()'s world by default; gpu_check: min(GPUs, ranks)
        small_run={"nproc": 2, "steps": 2, "variant": "all"},   # the classic-bug catalogue's
        bench=(Bench(options={"variant": "bucketed"}, torch="DistributedDataParallel"),),
    )

    def run(*, nproc=None, steps=5, backend="auto", vs_torch=False, timeout=300.0, **options):
        o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)   # names, types, check

The fields of ``Options`` give ``labs.run``'s options (``--bucket-mb``, with their types,
defaults, choices and help: ``add_options``) and ``run``'s keywords alike, so the two cannot
disagree. Every registry reads the declarations: ``labs.run``'s labs,
``labs.runtime.impl.EXERCISES`` and ``builds_on`` (their literal fields, read from the source
without importing anything: ``listings``), ``labs.bench``'s configurations,
``labs.experiments.profiling``'s profiled labs, ``scripts/gpu_check.py``'s plan and the
classic-bug catalogue's small runs (the declarations themselves, imported: ``all_labs``,
``command_labs``). This module imports no torch; running one lab imports its module only
(``lab``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import pkgutil
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

PACKAGE = "labs.experiments"


def option(
    default: Any,
    help: str | None = None,
    *,
    choices: tuple | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    negatable: bool = False,
    none_flag: tuple[str, str] | None = None,
    command_line: bool = True,
) -> Any:
    """A field of a lab's ``Options``: its default, its help and what ``labs.run`` needs beyond the
    field's type. ``choices``: the values it may take (each element's, for a tuple); ``parse``:
    turns the command line's text into the value (e.g. ``ints``); a bool defaulting to False is
    ``--name``, one defaulting to True ``--no-name``, a ``negatable`` one both; ``none_flag``:
    (flag, help) of an extra flag that sets the value to None (``--no-capacity``);
    ``command_line=False``: for Python callers only (a ``ModelConfig``)."""
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "choices": choices,
            "metavar": metavar,
            "parse": parse,
            "negatable": negatable,
            "none_flag": none_flag,
            "command_line": command_line,
        },
    )


def ints(text: str) -> tuple[int, ...]:
    """``"0,2,1,1"`` -> ``(0, 2, 1, 1)``: a list of integers on the command line."""
    return tuple(int(x) for x in text.split(","))


def _kind(annotation) -> tuple[type, bool]:
    """(the value's type, whether None is allowed) of an annotation such as ``int | None``."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in args if a is not type(None)]
        return typing.get_origin(kinds[0]) or kinds[0], type(None) in args
    return typing.get_origin(annotation) or annotation, False


def _element(annotation) -> type | None:
    """The element type of ``tuple[X, ...]`` (or ``tuple[X, ...] | None``)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is tuple:
            return typing.get_args(candidate)[0]
    return None


def command_fields(options: type) -> list[dataclasses.Field]:
    """The fields of ``options`` that ``labs.run`` offers on the command line."""
    return [f for f in dataclasses.fields(options) if f.metadata.get("command_line", True)]


def add_options(parser, options: type) -> None:
    """One ``--option`` per command-line field of ``options`` (its type, default, choices, help)."""
    hints = typing.get_type_hints(options)
    for f in command_fields(options):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        kind, _ = _kind(hints[f.name])
        if kind is bool and meta["negatable"]:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"]
            )
        elif kind is bool and f.default:
            parser.add_argument(
                f"--no-{f.name.replace('_', '-')}",
                dest=f.name,
                action="store_false",
                help=meta["help"],
            )
        elif kind is bool:
            parser.add_argument(flag, action="store_true", help=meta["help"])
        elif kind is tuple and meta["parse"] is None:
            parser.add_argument(
                flag, nargs="+", type=_element(hints[f.name]), default=f.default, help=meta["help"]
            )
        else:
            parser.add_argument(
                flag,
                type=meta["parse"] or kind,
                default=f.default,
                choices=meta["choices"],
                metavar=meta["metavar"],
                help=meta["help"],
            )
        if meta["none_flag"]:
            none_flag, none_help = meta["none_flag"]
            parser.add_argument(
                none_flag, dest=f.name, action="store_const", const=None, help=none_help
            )


def _checked(name: str, value: Any, annotation, choices) -> Any:
    """``value`` for the field ``name`` (a list made a tuple); ValueError when its type or a choice
    is wrong."""
    kind, optional = _kind(annotation)
    if value is None and optional:
        return None
    if kind is tuple and isinstance(value, list):
        value = tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    right = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    element = _element(annotation)
    if right and element is not None:
        right = all(isinstance(v, element) for v in value)
    if not right:
        want = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        raise ValueError(f"{name}={value!r} must be {want}")
    for v in value if kind is tuple else (value,):
        if choices is not None and v not in choices:
            raise ValueError(f"{name}={value!r} is not one of {choices}")
    return value


@dataclasses.dataclass(frozen=True)
class Bench:
    """How ``labs.bench`` runs one configuration of a lab (one row of its table), and what its
    ``torch_step_time_s`` times."""

    # the lab's options, or a function nproc -> options
    options: dict | Callable[[int], dict] = dataclasses.field(default_factory=dict)
    torch: str | None = None  # PyTorch's counterpart, or None where there is none
    like_for_like: bool = True  # False: torch's time is not of the same parallel job
    vs_torch: bool = True  # False: this configuration is not comparable with torch's (see its note)
    note: str = ""  # shown under the table whatever the timing
    bubble: bool = True  # False: the lab's bubble figure means nothing in this configuration
    label: str = ""  # how the table names it (default: its options)

    def options_for(self, nproc: int) -> dict:
        return self.options(nproc) if callable(self.options) else dict(self.options)


@dataclasses.dataclass(frozen=True)
class Lab:
    """One lab, as its experiment module declares it (see the module docstring)."""

    name: str  # its module is labs.experiments.<name>; ``python -m labs.run <name>`` runs it
    notebook: str  # "02_data_parallel": notebooks/<notebook>.ipynb
    exercises: tuple[str, ...]  # the exercise modules its notebook teaches, in the order it does
    builds_on: tuple[str, ...] = ()  # earlier exercises its runs call (through ``exercise(...)``)
    # The functions that compute what its runs are compared with, beside ``labs.train``'s
    # ``train_reference`` (which every lab may call): names in its module, "<part>.<name>" in its
    # part module ``labs.experiments.<name>_<part>``. They, and all they call, never reach an
    # exercise module, and no call of them is handed anything computed by one
    # (tests/test_imports.py reads this, statically).
    reference: tuple[str, ...] = ()
    options: type | None = None  # its Options dataclass; None: no ``labs.run`` command
    ranks: int = 4  # the world ``run`` uses by default; gpu_check runs it at min(GPUs, ranks)
    small_run: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # about a second
    bench: tuple[Bench, ...] = (Bench(),)  # labs.bench's configurations, one row each
    profiled: bool = False  # its ranks run StepTimer-timed training steps: ``--profile`` applies

    @property
    def command(self) -> bool:
        """Whether ``python -m labs.run <name>`` runs it."""
        return self.options is not None

    @property
    def module(self) -> types.ModuleType:
        """Its experiment module, ``labs.experiments.<name>``."""
        return importlib.import_module(f"{PACKAGE}.{self.name}")

    @property
    def run(self) -> Callable:
        """Its ``run(*, nproc, steps, backend, vs_torch, timeout, **options)``."""
        return self.module.run

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options)) if self.options else ()

    def parse(self, options: Mapping[str, Any], *, nproc: int, steps: int, vs_torch: bool = False):
        """``options`` (``run``'s keywords, or the command line's) as its ``Options``: unknown
        names, wrong types and values outside their choices are rejected, then ``Options.check``
        (if any) judges them in a run of ``nproc`` ranks, ``steps`` steps and ``vs_torch``.
        Raises ValueError naming the option and the valid choices."""
        if self.options is None:
            raise ValueError(f"lab {self.name!r} takes no options: it has no labs.run command")
        unknown = sorted(set(options) - set(self.option_names()))
        if unknown:
            raise ValueError(
                f"{self.name} has no option(s) {unknown}; its options: {list(self.option_names())}"
            )
        hints = typing.get_type_hints(self.options)
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        values = {
            name: _checked(name, value, hints[name], fields[name].metadata.get("choices"))
            for name, value in options.items()
        }
        parsed = self.options(**values)
        if hasattr(parsed, "check"):
            parsed.check(nproc=nproc, steps=steps, vs_torch=vs_torch)
        return parsed

    def command_line_options(self, namespace: argparse.Namespace) -> dict[str, Any]:
        """Its options as ``labs.run``'s parser read them (``add_options``): ``run``'s keywords."""
        return {f.name: getattr(namespace, f.name) for f in command_fields(self.options)}


# --- the registries -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Listing:
    """A lab as its declaration's literal fields say, read without importing its module."""

    name: str
    notebook: str
    exercises: tuple[str, ...]
    builds_on: tuple[str, ...]
    command: bool  # it declares options: ``python -m labs.run <name>`` runs it
    reference: tuple[str, ...] = ()  # ``Lab.reference``


def _lab_modules() -> list[tuple[str, Path]]:
    """(name, file) of each one-word module of ``labs.experiments`` (a lab's parts are
    ``<name>_<part>`` modules)."""
    package = importlib.import_module(PACKAGE)
    folder = Path(package.__path__[0])
    return [
        (m.name, folder / f"{m.name}.py")
        for m in pkgutil.iter_modules(package.__path__)
        if "_" not in m.name and not m.ispkg
    ]


def _lab_statement(source: str) -> ast.Module:
    """The module's ``LAB = Lab(...)`` statement, parsed alone where it is written as ruff writes
    it (from ``LAB = Lab(`` to a ``)`` at the start of a line), else the whole module: every
    process that reads ``EXERCISES`` lists the labs, and parsing the whole modules cost 0.15 s."""
    start = source.find("\nLAB = Lab(\n")
    end = source.find("\n)\n", start)
    if start >= 0 and end >= 0:
        try:
            return ast.parse(source[start + 1 : end + 2])
        except SyntaxError:
            pass
    return ast.parse(source)


def _listing(path: Path) -> Listing | None:
    """The ``LAB = Lab(...)`` of the module at ``path``, its literal fields read from the source:
    listing the labs must not import them (a lab module imports torch)."""
    for node in _lab_statement(path.read_text()).body:
        if not (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["LAB"]
            and isinstance(node.value, ast.Call)
        ):
            continue
        fields = {k.arg: k.value for k in node.value.keywords}
        try:
            name, notebook, exercises, builds_on, reference = (
                ast.literal_eval(fields[key]) if key in fields else ()
                for key in ("name", "notebook", "exercises", "builds_on", "reference")
            )
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{path}: LAB's name, notebook, exercises, builds_on and reference must be written"
                " out as literals (the lab lists are read from the source)"
            ) from e
        options = fields.get("options")
        command = options is not None and not (
            isinstance(options, ast.Constant) and options.value is None
        )
        return Listing(
            name, notebook, tuple(exercises), tuple(builds_on), command, tuple(reference)
        )
    return None


@functools.cache
def listings() -> tuple[Listing, ...]:
    """Every lab's listing, in notebook order, importing no lab: what ``EXERCISES``,
    ``builds_on`` and ``labs.run``'s list of labs need."""
    found = [_listing(path) for _, path in _lab_modules()]
    return tuple(sorted((x for x in found if x is not None), key=lambda x: x.notebook))


def lab(name: str) -> Lab | None:
    """The lab named ``name`` (importing its module only), or None when there is none."""
    if not name.isidentifier() or "_" in name:
        return None
    try:
        module = importlib.import_module(f"{PACKAGE}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{PACKAGE}.{name}":
            return None
        raise
    found = getattr(module, "LAB", None)
    return found if isinstance(found, Lab) and found.name == name else None


@functools.cache
def all_labs() -> tuple[Lab, ...]:
    """Every lab, in notebook order: the ``LAB`` of each listed module, imported."""
    return tuple(lab(x.name) for x in listings())


def command_labs() -> dict[str, Lab]:
    """The labs ``python -m labs.run`` runs, by name (importing them all)."""
    return {x.name: x for x in all_labs() if x.command}


def command_names() -> list[str]:
    """The names ``python -m labs.run`` takes, importing no lab."""
    return sorted(x.name for x in listings() if x.command)


def exercises() -> tuple[str, ...]:
    """Every exercise module, in the order the notebooks teach them."""
    return tuple(name for x in listings() for name in x.exercises)


def teacher(exercise: str) -> Listing:
    """The lab whose notebook teaches ``exercise``."""
    for x in listings():
        if exercise in x.exercises:
            return x
    raise ValueError(f"unknown exercise {exercise!r}; choose from {exercises()}")


def builds_on(exercise: str) -> tuple[str, ...]:
    """The earlier exercises ``exercise`` needs to run: those its lab's runs call, and those its
    notebook teaches before it (``tensor_parallel`` builds on ``tensor_parallel_comm``). The
    reference can stand in for each of them (issue 28's per-exercise grading)."""
    x = teacher(exercise)
    before = x.exercises[: x.exercises.index(exercise)]
    return tuple(dict.fromkeys([*x.builds_on, *before]))
