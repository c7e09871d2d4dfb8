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
