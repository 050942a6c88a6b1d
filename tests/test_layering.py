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

REPO = Path(__file__).resolve().parents[1]
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
