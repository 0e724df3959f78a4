"""The layering, enforced on the whole import graph of the project's modules.

Tiers, lowest first; a module imports only from its own tier or below:

0. ``policy`` (the model artifact, sampling, losses, the registry) and the ``migrations`` package
   marker;
1. the stages: ``offline_rl``, ``realtime_rl``, ``serving`` (serving takes from the other stages only
   the event schema, the bus and their settings: it emits events and never trains);
2. the settings root and the lifecycle job (``rtrl.config``, ``rtrl.demo``, ...), and the Alembic
   environment and revisions, which Alembic loads as scripts;
3. ``benchmarks``;
4. the command line that assembles every package's commands (``rtrl.cli``, ``rtrl.bench``).

Edges are every ``import`` anywhere in a module (at the top or inside a function) plus the modules
the CLI loads by name (its command modules and the benchmark registry). The graph has no cycle, and
the packages that train never import the web stack.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rtrl import bench, cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policy", "offline_rl", "realtime_rl", "serving", "rtrl", "benchmarks", "migrations")
TIERS: dict[str, int] = {
    "policy": 0, "migrations": 0,
    "offline_rl": 1, "realtime_rl": 1, "serving": 1,
    "rtrl": 2, "migrations.env": 2, "migrations.versions": 2,
    "benchmarks": 3,
    "rtrl.cli": 4, "rtrl.bench": 4, "rtrl.__main__": 4,
}
SERVING_MAY_IMPORT = ("realtime_rl.events", "realtime_rl.bus", "realtime_rl.config")
WEB_STACK = ("fastapi", "uvicorn", "starlette", "serving")
TRAINING_PACKAGES = ("policy", "offline_rl", "realtime_rl")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported_names(name: str, path: Path) -> set[str]:
    """Every module or package a module imports, anywhere in it, as absolute dotted names."""
    names: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import mod` imports the submodule; `from mod import name` the module
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return names


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _loaded_by_name() -> dict[str, set[str]]:
    """The modules the CLI imports from strings: command modules and benchmarks."""
    return {"rtrl.cli": set(cli.COMMAND_MODULES),
            "rtrl.bench": {target.partition(":")[0] for target in bench.BENCHMARKS.values()}}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    dynamic = _loaded_by_name()
    for name, path in MODULES.items():
        edges = {_project_module(n) for n in _imported_names(name, path) | dynamic.get(name, set())}
        graph[name] = {e for e in edges if e is not None and e != name}
    return graph


GRAPH = _graph()


def _tier(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in TIERS:
            return TIERS[".".join(parts[:i])]
    raise AssertionError(f"{module} is in no tier")


def test_the_graph_sees_static_function_level_and_by_name_imports():
    assert "realtime_rl.update" in GRAPH["realtime_rl.cycle"]
    assert "offline_rl.cli" in GRAPH["rtrl.cli"] and "benchmarks.gateway" in GRAPH["rtrl.bench"]
    assert all(m in MODULES for m in cli.COMMAND_MODULES), "a command module the CLI names does not exist"


def test_every_import_points_down_the_tiers():
    offenders = sorted(f"{a} (tier {_tier(a)}) imports {b} (tier {_tier(b)})"
                       for a, edges in GRAPH.items() for b in edges if _tier(b) > _tier(a))
    assert not offenders, offenders


def test_serving_takes_only_events_bus_and_settings_from_the_other_stages():
    offenders = sorted(f"{a} imports {b}" for a, edges in GRAPH.items() if a.startswith("serving")
                       for b in edges if b.startswith(("offline_rl", "realtime_rl"))
                       and not b.startswith(SERVING_MAY_IMPORT))
    assert not offenders, offenders


def test_training_packages_never_import_the_web_stack():
    offenders = []
    for name, path in MODULES.items():
        if name.split(".")[0] in TRAINING_PACKAGES:
            offenders += [f"{name} imports {n}" for n in _imported_names(name, path)
                          if n.split(".")[0] in WEB_STACK]
    assert not offenders, sorted(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    assert not _cycles(GRAPH), _cycles(GRAPH)
