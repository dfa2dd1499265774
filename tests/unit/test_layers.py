"""The layers of the code and its import graph (issue #17): no import cycle, and no arrow up a layer.

    bench/                              benchmarks and experiments (top)
    processors/frontend, processors/api the front end: the CLI and the HTTP API
    processors/<component>, processors/*.py   the control plane's components
    streams/, infra/                    the log, the broker and Redis, configuration (bottom)

Every module of bench/, infra/, processors/ and streams/ is parsed with ``ast``; every ``import`` and
``from ... import`` counts, wherever it is (at the top, inside a function, under ``if TYPE_CHECKING``), relative ones
resolved against the module's package. ``from a.b import c`` is an arrow to module ``a.b.c`` when that is a module,
else to ``a.b``. An arrow is from a module to a module (a package is its ``__init__``); imports of anything else
(the standard library, dependencies) are not arrows. What a module starts as a program (``python -m bench.cli``)
is not an import. Tests may import anything: they are not in the graph.
"""
from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "infra", "processors", "streams")
FRONT_END = ("processors.frontend", "processors.api")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path, packages=PACKAGES) -> dict[str, Path]:
    return {module_name(p, root): p for top in packages for p in sorted((root / top).rglob("*.py"))}


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int  # of the import in the importer's file

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def _resolve(name: str, modules) -> str | None:
    """The module ``name`` is, or is in (the longest prefix that is one); None: not one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def arrows_of(module: str, source: str, modules, is_package: bool = False) -> set[Arrow]:
    """Every import of ``module`` (its ``source``) that names a module of ``modules``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, modules) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per dot after the first
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _resolve(base, modules)
                       for a in node.names]
        out |= {Arrow(module, t, node.lineno) for t in targets if t is not None and t != module}
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[Arrow]]:
    modules = modules_under(root, packages)
    return {m: arrows_of(m, p.read_text(), modules, p.name == "__init__.py") for m, p in modules.items()}


def cycles(graph: dict[str, set[Arrow]]) -> list[list[Arrow]]:  # noqa: C901
    """One cycle (its arrows, in order) per strongly connected component of more than one module (Tarjan's
    algorithm, iterative), each a shortest cycle through the component's first module by name."""
    succ = {m: sorted({a.imported for a in arrows}) for m, arrows in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return [_shortest_cycle(graph, comp) for comp in sorted(components)]


def _shortest_cycle(graph: dict[str, set[Arrow]], component: list[str]) -> list[Arrow]:
    inside, first = set(component), component[0]
    came: dict[str, Arrow] = {}
    queue = deque([first])
    while queue:
        v = queue.popleft()
        for a in sorted(graph[v], key=lambda a: (a.imported, a.line)):
            if a.imported not in inside:
                continue
            if a.imported == first:
                path = [a]
                while path[0].importer != first:
                    path.insert(0, came[path[0].importer])
                return path
            if a.imported not in came:
                came[a.imported] = a
                queue.append(a.imported)
    raise AssertionError(f"no cycle through {first} in its component {component}")


def knot(graph: dict[str, set[Arrow]], cycle: list[Arrow]) -> list[str]:
    """Every module on some cycle with ``cycle``'s (its strongly connected component)."""
    def reach(start: str, succ) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in succ(todo.pop()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    pred: dict[str, set[str]] = {}
    for m, arrows in graph.items():
        for a in arrows:
            pred.setdefault(a.imported, set()).add(m)
    first = cycle[0].importer
    ahead = reach(first, lambda v: {a.imported for a in graph.get(v, ())})
    return sorted(ahead & reach(first, lambda v: pred.get(v, ())))


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def is_component(module: str) -> bool:
    return _in(module, ("processors",)) and not _in(module, FRONT_END)


@dataclass(frozen=True)
class Rule:
    says: str
    importer: object  # module name -> whether the rule applies to its imports
    forbidden: tuple[str, ...]  # packages it may not import


RULES = (
    Rule("streams/ and infra/ import nothing of processors/ or bench/", lambda m: _in(m, ("streams", "infra")),
         ("processors", "bench")),
    Rule("nothing outside bench/ imports bench/", lambda m: not _in(m, ("bench",)), ("bench",)),
    Rule("no component imports the front end (processors.frontend, processors.api)", is_component, FRONT_END),
)


def violations(graph: dict[str, set[Arrow]], rule: Rule) -> list[Arrow]:
    return sorted((a for m, arrows in graph.items() if rule.importer(m) for a in arrows
                   if _in(a.imported, rule.forbidden)), key=lambda a: (a.importer, a.imported, a.line))


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_is_the_code(graph):
    """The walk found the code and its imports (a walk that finds nothing would pass every rule)."""
    assert len(graph) > 100
    assert {"bench.cli", "processors.frontend.cli", "streams.clients", "infra.config"} <= set(graph)
    shard = {a.imported for a in graph["processors.scheduler.shard"]}
    assert {"processors.scheduler.decide", "infra.config"} <= shard
    assert "bench.env" in {a.imported for a in graph["bench.killstorm"]}  # a lazy import, in a function


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.says)
def test_no_arrow_up_a_layer(graph, rule):
    bad = violations(graph, rule)
    assert not bad, f"{rule.says}; these arrows break it:\n" + "\n".join(f"  {a}" for a in bad)


def test_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles (one cycle of each knot, then every module in the knot):\n" + "\n".join(
        "  " + " ; ".join(map(str, c)) + f"\n    knot: {', '.join(knot(graph, c))}" for c in found)


# -- the walker itself, on small made-up packages -------------------------------------------------------------
MODULES = frozenset({"p", "p.a", "p.b", "p.sub", "p.sub.c", "q", "q.d"})
CASES = [
    # (module, is a package, source, arrows to)
    ("p.a", False, "import p.b", {"p.b"}),
    ("p.a", False, "import os, p.b.x", {"p.b"}),  # a name in a module: the module
    ("p.a", False, "from p import b", {"p.b"}),  # a module of a package
    ("p.a", False, "from p.b import name", {"p.b"}),  # a name of a module
    ("p.a", False, "from p import name", {"p"}),  # a name of a package: its __init__
    ("p.a", False, "from . import b", {"p.b"}),
    ("p.a", False, "from .b import name", {"p.b"}),
    ("p.sub.c", False, "from .. import a", {"p.a"}),
    ("p.sub.c", False, "from ..b import x", {"p.b"}),
    ("p.sub", True, "from . import c", {"p.sub.c"}),  # a package's __init__: relative to itself
    ("p.sub", True, "from .c import x", {"p.sub.c"}),
    ("p.a", False, "def f():\n    from q.d import x\n    return x", {"q.d"}),  # lazy
    ("p.a", False, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import q.d", {"q.d"}),
    ("p.a", False, "import json\nfrom collections import deque", set()),  # not ours
    ("p.a", False, "from p import a", set()),  # itself
]


@pytest.mark.parametrize("module,package,source,expected", CASES, ids=[c[2].replace("\n", "; ") for c in CASES])
def test_arrows_of(module, package, source, expected):
    assert {a.imported for a in arrows_of(module, source, MODULES, package)} == expected


def test_rules_and_cycles_catch_what_they_should(tmp_path):
    """A made-up tree that breaks every rule once, and has a cycle: each is named."""
    files = {
        "streams/__init__.py": "", "streams/log.py": "from processors.x import y\n",
        "infra/__init__.py": "", "infra/conf.py": "def f():\n    import bench.run\n",
        "processors/__init__.py": "", "processors/x.py": "from .frontend import cli\n",
        "processors/frontend/__init__.py": "", "processors/frontend/cli.py": "import bench.run\n",
        "processors/api/__init__.py": "", "processors/api/app.py": "from processors.frontend import cli\n",
        "bench/__init__.py": "", "bench/run.py": "from processors.frontend import cli\nimport streams.a\n",
        "streams/a.py": "from streams import b\n", "streams/b.py": "from . import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    g = import_graph(tmp_path)
    found = {rule.says: [(a.importer, a.imported) for a in violations(g, rule)] for rule in RULES}
    assert list(found.values()) == [
        [("infra.conf", "bench.run"), ("streams.log", "processors.x")],
        [("infra.conf", "bench.run"), ("processors.frontend.cli", "bench.run")],
        [("processors.x", "processors.frontend.cli")],
    ]
    assert [[(a.importer, a.imported) for a in c] for c in cycles(g)] == [
        [("bench.run", "processors.frontend.cli"), ("processors.frontend.cli", "bench.run")],
        [("streams.a", "streams.b"), ("streams.b", "streams.a")]]
