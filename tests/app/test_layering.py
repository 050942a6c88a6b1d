"""The import graph keeps its layers: every splitedge module imports only its own layer or the
ones below, roles never import one another, and no module imports itself round a cycle.

Bottom to top: protocol, models, exporters, methods, runtime, the roles (device, edge, cloud),
the app (splitedge/), bench. The check reads every module's source (AST), so imports inside
functions and under TYPE_CHECKING count too: a lazy import against the order is still one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = {"protocol": 0, "models": 1, "exporters": 2, "methods": 3, "runtime": 4, "device": 5, "edge": 5,
          "cloud": 5, "app": 6, "bench": 7}
ROLES = {"device", "edge", "cloud"}
FOLDERS = [f for f in LAYERS if f != "app"] + ["splitedge"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "splitedge" else ["splitedge", *parts])


def modules() -> dict[str, Path]:
    found = {module_name(p): p for f in FOLDERS for p in (REPO / f).rglob("*.py")}
    assert len(found) > 150, "the walk found too few modules: is the repo layout as this test expects?"
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "app"


def imported(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(splitedge module, line) for every import in the file, wherever it is."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule when there is one
            out += [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m.split(".")[0] == "splitedge" and m != "splitedge"]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    found = modules()
    return {m: imported(m, p, set(found)) for m, p in found.items()}


def against_the_order(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for target, line in targets:
            a, b = layer(module), layer(target)
            if LAYERS[b] > LAYERS[a] or (a in ROLES and b in ROLES and a != b):
                bad.append(f"{module}:{line} ({a}) imports {target} ({b})")
    return bad


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each a cycle of imports."""
    edges = defaultdict(set)
    for module, targets in graph.items():
        edges[module].update(t for t, _ in targets if t in graph and t != module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_goes_against_the_layers(graph) -> None:
    assert against_the_order(graph) == []


def test_no_module_imports_itself_round_a_cycle(graph) -> None:
    assert cycles(graph) == []


def test_the_check_sees_a_lazy_import_against_the_order_and_a_cycle() -> None:
    """The checks above could pass by seeing nothing: fed a climbing import inside a function and
    a two-module cycle, they report both."""
    graph = {"splitedge.protocol.codec": [("splitedge.runtime.node", 12)],  # inside a function, say
             "splitedge.device.agent": [("splitedge.cloud.coordinator", 3)],
             "splitedge.methods.a": [("splitedge.methods.b", 1)], "splitedge.methods.b": [("splitedge.methods.a", 1)]}
    assert against_the_order(graph) == [
        "splitedge.device.agent:3 (device) imports splitedge.cloud.coordinator (cloud)",
        "splitedge.protocol.codec:12 (protocol) imports splitedge.runtime.node (runtime)"]
    assert cycles(graph) == [["splitedge.methods.a", "splitedge.methods.b"]]
    found = modules()
    lazy = imported("splitedge.cloud.cli", found["splitedge.cloud.cli"], set(found))
    assert any(m == "splitedge.runtime.session" for m, _ in lazy)  # imported inside cloud/cli.py's _run


# -- inside methods/: the shared core and the method packages --------------------------------------

METHODS = REPO / "methods"


def method_packages() -> dict[str, dict[str, tuple[str, ...]]]:
    """Each method package (a folder of methods/ with a method.py) -> its BUILDS_ON and SHARED,
    read from its __init__.py's source (no import: the declaration is what the file says)."""
    out = {}
    for init in sorted(METHODS.glob("*/__init__.py")):
        if not (init.parent / "method.py").exists():
            continue
        declared: dict[str, tuple[str, ...]] = {}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                declared[node.target.id] = tuple(ast.literal_eval(node.value))
        out[init.parent.name] = {k: declared.get(k) for k in ("BUILDS_ON", "SHARED")}
    assert len(out) >= 10, "the walk found too few method packages"
    return out


def method_of(module: str, packages: set[str]) -> str | None:
    """The method package a module belongs to, or None for the shared core (or outside methods/)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "methods" and parts[2] in packages else None


def undeclared_method_imports(graph: dict[str, list[tuple[str, int]]],
                              declared: dict[str, dict[str, tuple[str, ...]]]) -> list[str]:
    """Imports of a method package from the shared core, or from another method package that does
    not list it in BUILDS_ON or whose target module it does not list in SHARED."""
    bad, packages = [], set(declared)
    for module, targets in sorted(graph.items()):
        if not module.startswith("splitedge.methods."):
            continue
        mine = method_of(module, packages)
        for target, line in targets:
            theirs = method_of(target, packages)
            if theirs is None or theirs == mine:
                continue
            leaf = target.split(".")[3] if len(target.split(".")) > 3 else "__init__"
            if mine is None:
                bad.append(f"{module}:{line} (shared core) imports {target} (method {theirs})")
            elif theirs not in declared[mine]["BUILDS_ON"]:
                bad.append(f"{module}:{line} imports {target}: {mine} does not list {theirs} in BUILDS_ON")
            elif leaf not in declared[theirs]["SHARED"]:
                bad.append(f"{module}:{line} imports {target}: {theirs} does not list {leaf!r} in SHARED")
    return bad


def test_every_method_package_declares_what_it_builds_on_and_shares() -> None:
    declared = method_packages()
    assert [p for p, d in declared.items() if None in d.values()] == []
    for package, d in declared.items():
        assert set(d["BUILDS_ON"]) <= set(declared) - {package}, package
        assert all((METHODS / package / f"{m}.py").exists() for m in d["SHARED"]), package


def test_the_shared_core_imports_no_method_and_a_method_only_what_another_shares(graph) -> None:
    assert undeclared_method_imports(graph, method_packages()) == []


def test_a_method_builds_on_no_package_it_does_not_import(graph) -> None:
    """The declarations stay true: BUILDS_ON names only packages the method does import."""
    declared = method_packages()
    used: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        mine = method_of(module, set(declared))
        used[mine or ""].update(method_of(t, set(declared)) or "" for t, _ in targets)
    stale = {p: sorted(set(d["BUILDS_ON"]) - used[p]) for p, d in declared.items() if set(d["BUILDS_ON"]) - used[p]}
    assert stale == {}


def test_the_method_checks_see_a_core_import_and_an_undeclared_one() -> None:
    declared = {"a": {"BUILDS_ON": (), "SHARED": ("cloud",)}, "b": {"BUILDS_ON": ("a",), "SHARED": ()},
                "c": {"BUILDS_ON": (), "SHARED": ()}}
    graph = {"splitedge.methods.thin.trainer": [("splitedge.methods.a.simplex", 20)],
             "splitedge.methods.b.cloud": [("splitedge.methods.a.cloud", 3), ("splitedge.methods.a.device", 4)],
             "splitedge.methods.c.edge": [("splitedge.methods.a.cloud", 5), ("splitedge.methods.c.config", 6)]}
    assert undeclared_method_imports(graph, declared) == [
        "splitedge.methods.b.cloud:4 imports splitedge.methods.a.device: a does not list 'device' in SHARED",
        "splitedge.methods.c.edge:5 imports splitedge.methods.a.cloud: c does not list a in BUILDS_ON",
        "splitedge.methods.thin.trainer:20 (shared core) imports splitedge.methods.a.simplex (method a)"]


def test_the_registry_s_import_strings_name_each_method_and_parts_where_it_may_reach() -> None:
    """Every built-in method's import string names a Method subclass in its own package, and each
    of its parts a class of its package or of one it builds on (a typo fails here, not on a node)."""
    import importlib

    from splitedge.methods import registry
    from splitedge.methods.contract import Method

    declared = method_packages()
    for name, target in registry._METHODS.items():  # the built-in table; plug-ins are checked as they load
        if not registry.built_in(name):
            continue
        module, _, attr = target.partition(":")
        package = method_of(module, set(declared))
        assert package is not None and module == f"splitedge.methods.{package}.method", (name, target)
        cls = getattr(importlib.import_module(module), attr)
        assert isinstance(cls, type) and issubclass(cls, Method), (name, target)
        for role, part in cls.parts.items():
            part_module, _, part_attr = part.partition(":")
            owner = method_of(part_module, set(declared))
            assert owner == package or owner in declared[package]["BUILDS_ON"], (name, role, part)
            assert isinstance(getattr(importlib.import_module(part_module), part_attr), type), (name, role, part)


def test_no_code_lives_under_bench_results() -> None:
    """bench/results holds results; a script that made one is in bench/scripts (issue 52, item 6)."""
    assert sorted(str(p.relative_to(REPO)) for p in (REPO / "bench" / "results").rglob("*.py")) == []
