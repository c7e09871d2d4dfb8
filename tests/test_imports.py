"""The import graph of ``labs`` and ``solutions``, read statically: no cycle, and the layers point
one way.

Every module is parsed (nothing is imported), and every ``import`` statement counts, at module
level and inside functions: a function-level import is still a dependency, only a later one.
Relative imports are resolved, and ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module, else to ``pkg`` itself. Imports under ``if TYPE_CHECKING:`` run only under a type
checker: they count for the layering rules and for cycles (a module that needs another's types
still depends on it, so two modules that import each other only for type hints are still a circle,
issue 27), but not for "imports torch".

The layers (COURSE.md section 2, issue 18):

* complete code (``labs.runtime``, ``labs.measure``, ``labs.theory``, ``labs.models``,
  ``labs.data``, ``labs.train``) never imports an exercise module or ``solutions``; it reaches the
  exercises only through ``labs.runtime.impl.exercise(name)``, a dynamic lookup;
* ``labs.models`` never imports ``labs.train`` or ``labs.experiments``;
* ``labs.theory`` never imports torch, directly or through another module;
* an exercise module never imports another exercise module.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from labs.runtime.impl import EXERCISES
from tests.helpers import ROOT

PACKAGES = ("labs", "solutions")
COMPLETE = (
    "labs.runtime",
    "labs.measure",
    "labs.theory",
    "labs.models",
    "labs.data",
    "labs.train",
)
EXERCISE_MODULES = {f"{package}.{name}" for package in PACKAGES for name in EXERCISES}


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # a module of labs or solutions, or an outside top-level package ("torch")
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.source} (line {self.line}) imports {self.target}"


def module_paths() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes: list[ast.AST], typing_only: bool = False):
    """(import statement, whether it is under TYPE_CHECKING) for every import in ``nodes`` and
    everything nested in them (function bodies, try blocks, ...)."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, typing_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.body, True)
            yield from _imports(node.orelse, typing_only)
        else:
            yield from _imports(list(ast.iter_child_nodes(node)), typing_only)


def _target(name: str, modules: dict[str, Path]) -> str:
    """A dotted name as an edge target: itself if it is one of our modules, its nearest enclosing
    module of ours otherwise (an attribute of a module), or the outside top-level package."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return parts[0]
    while ".".join(parts) not in modules and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def edges_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    tree = ast.parse(path.read_text(), str(path))
    for node, typing_only in _imports(tree.body):
        if isinstance(node, ast.Import):
            targets = [_target(alias.name, modules) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # from . import x, from ..pkg import y
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else _target(base, modules))
        for target in targets:
            if target != module:
                edges.append(Edge(module, target, node.lineno, typing_only))
    return edges


def import_graph() -> list[Edge]:
    modules = module_paths()
    return [edge for name, path in modules.items() for edge in edges_of(name, path, modules)]


def runtime_graph(edges: list[Edge]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it runs."""
    return dependency_graph([edge for edge in edges if not edge.typing_only])


def dependency_graph(edges: list[Edge]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, for running or for type checking."""
    graph = defaultdict(set)
    for edge in edges:
        if edge.target.split(".")[0] in PACKAGES:
            graph[edge.source].add(edge.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) through each strongly connected group of modules, found by
    Tarjan's algorithm."""
    index = {}
    low = {}
    stack = []
    on_stack = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = len(index)
        low[node] = index[node]
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(min(group), group, graph) for group in groups]


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path start -> ... -> start inside ``group`` (breadth first)."""
    came_from = {}  # module -> the module it was reached from
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def in_layer(module: str, layers: tuple[str, ...]) -> bool:
    return any(module == layer or module.startswith(f"{layer}.") for layer in layers)


def test_the_graph_is_read():
    """The parser sees the imports we know of, so an empty graph cannot pass the tests below."""
    edges = {(edge.source, edge.target) for edge in import_graph()}
    assert ("labs.train.reference", "labs.models.transformer") in edges
    assert ("labs.train.reference", "torch") in edges
    assert ("labs.runtime.impl", "importlib") in edges
    assert ("solutions.ddp", "labs.theory.overlap") in edges
    assert ("labs.theory.exports", "yaml") in edges  # a function-level import


def test_imports_are_resolved(tmp_path):
    """Relative imports, ``from pkg import submodule``, attributes of a module, function-level
    and type-checking-only imports, on a made-up module ``labs.pkg.mod``."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .sibling import helper\n"
        "from .. import top\n"
        "from labs.theory import zero\n"
        "import labs.theory.memory as memory\n"
        "if TYPE_CHECKING:\n"
        "    import torch.distributed as dist\n"
        "def later():\n"
        "    from labs.runtime.impl import exercise\n"
    )
    names = ("labs", "labs.top", "labs.pkg", "labs.pkg.sibling", "labs.theory")
    names += ("labs.theory.zero", "labs.theory.memory", "labs.runtime.impl")
    modules = {name: path for name in names}
    edges = {(edge.target, edge.typing_only) for edge in edges_of("labs.pkg.mod", path, modules)}
    assert edges == {
        ("typing", False),
        ("labs.pkg.sibling", False),
        ("labs.top", False),
        ("labs.theory.zero", False),
        ("labs.theory.memory", False),
        ("torch", True),
        ("labs.runtime.impl", False),
    }


def test_cycles_are_found():
    """The cycle finder on a made-up graph: a -> b -> c -> a is found, d -> a is not a cycle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_type_checking_imports_is_a_cycle():
    """activations.py and memory.py once imported each other, one of them only for the ModelSpec
    type: the runtime graph has no cycle there, the dependency graph does."""
    edges = [
        Edge("labs.theory.memory", "labs.theory.activations", 1, False),
        Edge("labs.theory.activations", "labs.theory.memory", 2, True),
    ]
    assert cycles(runtime_graph(edges)) == []
    assert cycles(dependency_graph(edges)) == [
        ["labs.theory.activations", "labs.theory.memory", "labs.theory.activations"]
    ]


def test_no_import_cycles():
    """No circle of imports, counting those made only for type checking."""
    found = cycles(dependency_graph(import_graph()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_complete_code_never_imports_exercises_or_solutions():
    bad = [
        edge.where()
        for edge in import_graph()
        if in_layer(edge.source, COMPLETE)
        and (edge.target in EXERCISE_MODULES or in_layer(edge.target, ("solutions",)))
    ]
    assert not bad, (
        "complete code reaches the exercises only through labs.runtime.impl.exercise():\n"
        + "\n".join(bad)
    )


def test_models_never_import_training_or_experiments():
    bad = [
        edge.where()
        for edge in import_graph()
        if in_layer(edge.source, ("labs.models",))
        and in_layer(edge.target, ("labs.train", "labs.experiments"))
    ]
    assert not bad, "labs.models is below the training code:\n" + "\n".join(bad)


def test_theory_never_imports_torch():
    edges = [edge for edge in import_graph() if not edge.typing_only]
    uses_torch = {edge.source for edge in edges if edge.target == "torch"}
    graph = runtime_graph(edges)
    bad = []
    for module in sorted(m for m in module_paths() if in_layer(m, ("labs.theory",))):
        seen = {module}
        frontier = [(module, [module])]
        while frontier:
            node, path = frontier.pop()
            if node in uses_torch:
                bad.append(" -> ".join([*path, "torch"]))
            for nxt in sorted(graph[node] - seen):
                seen.add(nxt)
                frontier.append((nxt, [*path, nxt]))
    assert not bad, "labs.theory must run without torch:\n" + "\n".join(bad)


def test_theory_holds_formulas_and_one_command_line():
    """``labs.theory`` is formulas; its command line is one module, ``labs.theory.cli`` (issue 27):
    nothing else there parses arguments, and no formula module imports the command line."""
    edges = import_graph()
    parsers = sorted(
        {e.source for e in edges if in_layer(e.source, ("labs.theory",)) and e.target == "argparse"}
    )
    assert parsers == ["labs.theory.cli"], parsers
    users = sorted({e.source for e in edges if e.target == "labs.theory.cli"})
    assert users == ["labs.theory.__main__"], users


def test_exercises_never_import_each_other():
    """Helpers shared between exercises live in labs.runtime. An exercise that uses another's code
    (tensor_parallel's layers, the communication operators of tensor_parallel_comm) reaches it
    through ``exercise(name)``, so the per-exercise switch (LABS_REFERENCE) can put the reference
    in its place."""
    bad = sorted(
        {
            edge.where()
            for edge in import_graph()
            if edge.source in EXERCISE_MODULES
            and edge.target in EXERCISE_MODULES
            and edge.target.rpartition(".")[2] != edge.source.rpartition(".")[2]
        }
    )
    assert not bad, (
        "an exercise module borrows helpers from labs.runtime, not from another exercise:\n"
        + "\n".join(bad)
    )


def test_the_learners_folder_holds_only_exercise_modules():
    """``labs/`` directly holds the exercise modules a learner edits and nothing else: the course's
    own code (launcher, grader, release, CLIs, reference) lives in its subpackages."""
    labs = Path(__file__).resolve().parents[1] / "labs"
    files = sorted(p.stem for p in labs.glob("*.py") if p.name != "__init__.py")
    assert files == sorted(EXERCISES)


# --- reference code never reaches the learner's code ----------------------------------------------
# What counts as reference code (COURSE.md section 4, "Independent references"; issue 31): what a
# lab's run is compared with, and everything that computes it:
#
# * every function and class of ``labs.train`` and ``labs.models`` (the single-process reference
#   and the models it trains: ``train_reference``, ``ReferenceMoELayer``, ...);
# * each lab's declared reference functions (``Lab(reference=...)`` in
#   ``labs/experiments/<lab>.py``: a name in that module, or "<part>.<name>" in its part module
#   ``labs.experiments.<lab>_<part>``);
# * every function or class of ``labs`` those call or name, followed through the static call graph
#   (a call or mention of a name bound to one of our functions, classes or modules; a class counts
#   with all its methods).
#
# The rules: reference code never calls ``labs.runtime.impl.exercise`` and never imports an
# exercise module or ``solutions`` (inside a function, or in the module of a function it reaches);
# and no call of a reference entry point (a lab's declared functions, ``labs.train.reference``'s
# functions) anywhere in ``labs`` is handed an argument computed by exercise code: an argument
# that calls or names a function that reaches ``exercise`` (or an exercise module), or a name the
# calling function bound to such a value (``ref_model = build(layer=exercise(...).MoELayer)``,
# then ``train_reference(model=ref_model)``). What the graph cannot see (a method called on an
# object whose class it cannot tell) is covered by the class rule: every class reference code
# reaches is checked whole.
IMPL = ("labs.runtime.impl", "exercise")
REFERENCE_LAYERS = ("labs.train", "labs.models")
Def = tuple[str, str]  # (module, "name" or "Class.method")


class CodeIndex:
    """Every module of ``labs`` and ``solutions``, parsed: its top-level functions, classes and
    methods, and what each name it imports is bound to."""

    def __init__(self, modules: dict[str, Path], sources: dict[str, str] | None = None):
        self.modules = modules
        self.trees = {
            m: ast.parse((sources or {}).get(m) or p.read_text(), str(p))
            for m, p in modules.items()
        }
        self.defs: dict[Def, ast.AST] = {}
        self.classes: dict[Def, list[Def]] = {}  # class -> its methods
        self.bindings: dict[str, dict[str, tuple[str, object]]] = {}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    self.defs[(module, node.name)] = node
                if isinstance(node, ast.ClassDef):
                    methods = []
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            self.defs[(module, f"{node.name}.{item.name}")] = item
                            methods.append((module, f"{node.name}.{item.name}"))
                    self.classes[(module, node.name)] = methods
            self.bindings[module] = self._bindings(module, tree)
        self._mentions: dict[Def, list] = {}
        self._import_lines: dict[str, dict[int, list[str]]] = {}

    def _bindings(self, module: str, tree: ast.Module) -> dict[str, tuple[str, object]]:
        """Local name -> ("module", name) or ("symbol", (module, name)), for every import in the
        module (at any depth: a function-level import binds a name too)."""
        path = self.modules[module]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out = {}
        for node, _ in _imports(tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        out[alias.asname] = ("module", alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        out[top] = ("module", top)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                bound = ("module", sub) if sub in self.modules else ("symbol", (base, alias.name))
                out[alias.asname or alias.name] = bound
        return out

    def symbol(self, module: str, name: str, depth: int = 0):
        """What ``module.name`` is: ("def", Def), ("module", name), or None (outside, unknown)."""
        if (module, name) in self.defs:
            return ("def", (module, name))
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}")
        if name == "exercise" and module in ("labs", "labs.runtime"):
            return ("def", IMPL)  # re-exported (lazily, by labs/__init__.py)
        bound = self.bindings.get(module, {}).get(name)
        if bound is None or depth > 10:
            return None
        kind, target = bound
        if kind == "module":
            return ("module", target)
        return self.symbol(*target, depth + 1)

    def resolve(self, module: str, expr: ast.AST, cls: str | None = None):
        """What a name or attribute chain in ``module`` (inside class ``cls``) refers to."""
        if isinstance(expr, ast.Name):
            return self.symbol(module, expr.id)
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls") and cls:
                method = (module, f"{cls}.{expr.attr}")
                return ("def", method) if method in self.defs else None
            base = self.resolve(module, expr.value, cls)
            if base is None:
                return None
            kind, target = base
            if kind == "module":
                return self.symbol(target, expr.attr)
            if target in self.classes:
                method = (target[0], f"{target[1]}.{expr.attr}")
                return ("def", method) if method in self.defs else None
        return None

    def mentions(self, d: Def) -> list[tuple[str, object, int]]:
        """(kind, target, line) of every name of ours the definition ``d`` calls or names (and
        every import in it); a class's methods come with it."""
        if d in self._mentions:
            return self._mentions[d]
        module, name = d
        cls = name.split(".")[0] if "." in name or d in self.classes else None
        out = []
        for node in ast.walk(self.defs[d]):
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                found = self.resolve(module, node, cls)
                if found is not None:
                    out.append((*found, node.lineno))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for target in self.import_lines(module).get(node.lineno, []):
                    out.append(("module", target, node.lineno))
        for method in self.classes.get(d, []):
            out.append(("def", method, self.defs[method].lineno))
        self._mentions[d] = out
        return out

    def import_lines(self, module: str) -> dict[int, list[str]]:
        """Line -> the modules the import statement there imports (``edges_of``), per module."""
        if module not in self._import_lines:
            lines = defaultdict(list)
            for edge in edges_of(module, self.modules[module], self.modules):
                lines[edge.line].append(edge.target)
            self._import_lines[module] = lines
        return self._import_lines[module]


def is_exercise_code(kind: str, target) -> bool:
    """A mention of the learner's code: ``exercise`` itself, an exercise module or ``solutions``,
    or a definition in one."""
    module = target if kind == "module" else target[0]
    if kind == "def" and target == IMPL:
        return True
    return module in EXERCISE_MODULES or in_layer(module, ("solutions",))


def exercise_reaching(index: CodeIndex) -> dict[Def, list[str]]:
    """Every definition of ``labs`` that reaches the learner's code, with one path to it
    ("module:name (line n)" steps, the last one the mention of exercise code)."""
    reach: dict[Def, list[str]] = {}
    for d in index.defs:
        if d[0] in EXERCISE_MODULES or in_layer(d[0], ("solutions",)) or d == IMPL:
            continue
        for kind, target, line in index.mentions(d):
            if is_exercise_code(kind, target):
                what = "exercise()" if target == IMPL else str(target)
                reach[d] = [f"{d[0]}:{d[1]} (line {line}) -> {what}"]
                break
    changed = True
    while changed:
        changed = False
        for d in index.defs:
            if d in reach or d[0] in EXERCISE_MODULES or in_layer(d[0], ("solutions",)):
                continue
            for kind, target, line in index.mentions(d):
                if kind == "def" and target in reach:
                    reach[d] = [f"{d[0]}:{d[1]} (line {line})", *reach[target]]
                    changed = True
                    break
    return reach


def declared_references(index: CodeIndex) -> list[Def]:
    """Every lab's ``Lab(reference=...)`` as definitions; a name that is none fails here."""
    from labs.experiments.spec import listings

    out = []
    for lab in listings():
        for entry in lab.reference:
            part, _, name = entry.rpartition(".")
            module = f"labs.experiments.{lab.name}" + (f"_{part}" if part else "")
            assert (module, name) in index.defs, f"lab {lab.name}: reference {entry!r} is not a def"
            out.append((module, name))
    return out


def reference_entries(index: CodeIndex) -> list[Def]:
    """The functions whose calls are checked for the learner's values: the labs' declared
    references and ``labs.train.reference``'s trainers (``train_reference``,
    ``train_multimodal_reference`` and their parts; not its helpers ``make_optimizer`` and
    ``data_for``, which the learner's runs use as well)."""
    train = [
        d
        for d in index.defs
        if d[0] == "labs.train.reference" and "." not in d[1] and d[1].endswith("_reference")
    ]
    return declared_references(index) + train


def reference_violations(index: CodeIndex, roots: list[Def]) -> list[str]:
    """Paths from reference code (``roots`` and everything they reach) to the learner's code."""
    reach = exercise_reaching(index)
    bad = []
    for root in roots:
        if root in reach:
            bad.append(" -> ".join(reach[root]))
    return sorted(set(bad))


def _assigned_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def tainted_calls(index: CodeIndex, entries: list[Def]) -> list[str]:
    """Calls of a reference entry handed a value computed by the learner's code (see above)."""
    reach = exercise_reaching(index)
    entries = set(entries)
    bad = []

    def from_learner(module: str, expr: ast.AST, cls: str | None, tainted: set[str]) -> bool:
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and node.id in tainted:
                return True
            if isinstance(node, ast.Name | ast.Attribute):
                found = index.resolve(module, node, cls)
                if found is not None and (
                    is_exercise_code(*found) or (found[0] == "def" and found[1] in reach)
                ):
                    return True
        return False

    for d, node in index.defs.items():
        module, name = d
        if module in EXERCISE_MODULES or in_layer(module, ("solutions",)):
            continue
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        cls = name.split(".")[0] if "." in name else None
        tainted: set[str] = set()
        changed = True
        while changed:  # names bound to the learner's values, to a fixed point
            changed = False
            for sub in ast.walk(node):
                pairs = []
                if isinstance(sub, ast.Assign):
                    pairs = [(t, sub.value) for t in sub.targets]
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and sub.value:
                    pairs = [(sub.target, sub.value)]
                elif isinstance(sub, ast.For | ast.comprehension):
                    pairs = [(sub.target, sub.iter)]
                elif isinstance(sub, ast.withitem) and sub.optional_vars is not None:
                    pairs = [(sub.optional_vars, sub.context_expr)]
                for target, value in pairs:
                    names = set(_assigned_names(target)) - tainted
                    if names and from_learner(module, value, cls, tainted):
                        tainted |= names
                        changed = True
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Call):
                continue
            callee = index.resolve(module, sub.func, cls)
            if callee is None or callee[0] != "def" or callee[1] not in entries:
                continue
            for arg in [*sub.args, *(k.value for k in sub.keywords)]:
                if from_learner(module, arg, cls, tainted):
                    bad.append(
                        f"{module}:{name} (line {sub.lineno}) hands {callee[1][0]}:{callee[1][1]}"
                        f" a value of the learner's code: {ast.unparse(arg)}"
                    )
    return sorted(bad)


@functools.cache
def code_index() -> CodeIndex:
    return CodeIndex(module_paths())


def test_reference_code_never_reaches_an_exercise():
    """No reference code (labs.train, labs.models, each lab's declared reference functions, and
    everything they call) reaches an exercise module, statically: a learner's mistake cannot move
    the reference with it (issue 31). Paths are printed from the reference to the learner."""
    index = code_index()
    roots = [d for d in index.defs if in_layer(d[0], REFERENCE_LAYERS)]
    roots += declared_references(index)
    bad = reference_violations(index, roots)
    assert not bad, "reference code reaches the learner's code:\n" + "\n".join(bad)


def test_no_reference_is_handed_the_learners_values():
    """No call of a reference (a lab's declared functions, labs.train.reference's) is given a
    model, layer or value that exercise code computed."""
    index = code_index()
    bad = tainted_calls(index, reference_entries(index))
    assert not bad, "\n".join(bad)


def test_every_lab_with_a_run_declares_its_reference_or_uses_train_reference():
    """Each lab with a command names what its runs are compared with: its declared reference
    functions, or ``train_reference`` called from its module."""
    from labs.experiments.spec import listings

    index = code_index()
    for lab in listings():
        if not lab.command or lab.reference:
            continue
        source = index.modules[f"labs.experiments.{lab.name}"].read_text()
        assert "train_reference(" in source, f"lab {lab.name} declares no reference"


# The analysis on made-up modules: it must find what it is meant to find.
_MADE_UP = {
    "labs.experiments.fake": (
        "from labs.runtime.impl import exercise\n"
        "from labs.train import train_reference\n"
        "from labs.experiments import fake_setup as setup\n"
        "def helper(cfg):\n"
        "    return exercise('expert_parallel').MoELayer\n"
        "def reference_run(cfg):\n"
        "    return setup.build(cfg)\n"
        "def run(cfg):\n"
        "    layer = helper(cfg)\n"
        "    model = make(layer)\n"
        "    clean = make(None)\n"
        "    train_reference(cfg, model=model)\n"
        "    train_reference(cfg, model=clean)\n"
        "def make(layer):\n"
        "    return layer\n"
    ),
    "labs.experiments.fake_setup": (
        "from labs.models.fake import Layer\ndef build(cfg):\n    return Layer(cfg)\n"
    ),
    "labs.models.fake": (
        "class Layer:\n"
        "    def forward(self, x):\n"
        "        from labs import expert_parallel\n"
        "        return expert_parallel.route(x)\n"
    ),
}


def _made_up_index(tmp_path) -> CodeIndex:
    modules = dict(module_paths())
    sources = {}
    for name, source in _MADE_UP.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        modules[name] = path
        sources[name] = source
    return CodeIndex(modules, sources)


def test_the_reference_analysis_finds_a_path_and_a_tainted_argument(tmp_path):
    index = _made_up_index(tmp_path)
    # a declared reference -> a part module's function -> a model class whose method imports an
    # exercise module
    [path] = reference_violations(index, [("labs.experiments.fake", "reference_run")])
    assert path.startswith("labs.experiments.fake:reference_run (line 7)")
    assert "labs.models.fake:Layer (line" in path and path.endswith("labs.expert_parallel")
    # the made-up model layer is caught as reference code too
    assert reference_violations(index, [("labs.models.fake", "Layer")])
    # a model built from an exercise's layer, handed to train_reference; the clean one is not
    bad = tainted_calls(index, [("labs.train.reference", "train_reference")])
    assert bad == [
        "labs.experiments.fake:run (line 12) hands labs.train.reference:train_reference a value"
        " of the learner's code: model"
    ]
