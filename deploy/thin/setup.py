"""The thin device wheel, `splitedge-<version>+thin`: what a device without torch runs.

Built from the same checkout as the full wheel (../../setup.py), with `python -m build --wheel
deploy/thin` (README.md here). It holds
- the layers a device reaches, `protocol`, `runtime`, `device` and `methods`, less every module
  that cannot be imported without torch and the rest of [all]: a module goes in when all it
  imports at load time is the standard library, the base dependencies (numpy, msgpack,
  paho-mqtt, psutil, pillow), the thin extras' cryptography and prometheus_client, and
  modules that go in themselves. So the torch parts of the methods (a torch device,
  a cloud, W_e's losses) stay out, whatever a method package adds later, and no list here goes
  stale;
- of the application layer, the commands a device runs: `splitedge device`, `keys`, `data`.
Not `cloud/`, `edge/`, `bench/`, `exporters/` nor `models/` (torch networks; a thin device builds
its numpy ones, methods/thin/). The other commands answer in one line (splitedge/install.py).

Same distribution name as the full wheel, on purpose: pip keeps one `splitedge` per env, so
installing the full wheel replaces this one (the upgrade path) instead of writing over its files.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("protocol", "runtime", "device", "methods")
APP = ("__init__", "__main__", "cli", "cli_defaults", "install", "malloc", "keys_cli", "data_cli")
"""Modules of the application layer (splitedge/) it holds: the CLI and the device's commands."""
BASE = frozenset({"numpy", "msgpack", "paho", "psutil", "PIL"})
"""pyproject.toml's dependencies, by import name."""
EXTRAS = frozenset({"cryptography", "prometheus_client"})
"""The thin wheel's extras [sign] and [metrics], by import name: the modules that need them go in."""


def full_folders() -> tuple[str, ...]:
    """../../setup.py's FOLDERS, read rather than repeated."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "FOLDERS")


def every_module() -> dict[str, Path]:
    """Import name -> file of every module of the full wheel (the app layer and every folder)."""
    found = {}
    for folder in ("splitedge", *full_folders()):
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            parts = parts[: -1 if parts[-1] == "__init__" else None]
            found[".".join(parts if folder == "splitedge" else ("splitedge", *parts))] = path
    return found


def candidates(every: dict[str, Path]) -> dict[str, Path]:
    """The modules the thin wheel may hold: APP, and FOLDERS whole."""
    app = {"splitedge" if m == "__init__" else f"splitedge.{m}" for m in APP}
    return {n: p for n, p in every.items() if n in app or n.count(".") and n.split(".")[1] in FOLDERS}


def load_time_imports(name: str, path: Path) -> set[str]:
    """What importing the module imports: module-level and class-body imports, not those inside
    functions, under `if TYPE_CHECKING`, or in a `try` that catches ImportError."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                up = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                base = ".".join([*up, *([node.module] if node.module else [])])
                found.update([base, *(f"{base}.{a.name}" for a in node.names)])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type is not None)
                if "ImportError" not in caught and "ModuleNotFoundError" not in caught:
                    visit(node.body)  # an import that may fail is optional
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.ClassDef, ast.With)):
                visit(node.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def loadable(every: dict[str, Path]) -> set[str]:
    """The candidates that import without [all]: the largest set closed under "all its load-time
    imports are stdlib, BASE, EXTRAS or in the set" (import cycles stay in)."""
    mods = candidates(every)
    imports = {n: load_time_imports(n, p) for n, p in mods.items()}
    keep = set(mods)

    def ok(name: str) -> bool:
        for target in imports[name]:
            top = target.split(".")[0]
            if top != "splitedge":
                if top not in sys.stdlib_module_names and top not in BASE | EXTRAS:
                    return False
                continue
            prefixes = (".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 2))
            if any(p in every and p not in keep for p in prefixes):  # not in `every`: a name imported from a module
                return False
        return True

    while drop := {n for n in keep if not ok(n)}:
        keep -= drop
    return keep


EVERY = every_module()
KEEP = loadable(EVERY)
PACKAGES = sorted(n for n, p in EVERY.items() if p.name == "__init__.py" and n in KEEP)


class ThinBuildPy(build_py):
    """Copies only the modules in KEEP, into an emptied build folder (a module left out now must
    not ride along from an earlier build)."""

    def run(self) -> None:
        shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        return [(pkg, mod, f) for pkg, mod, f in super().find_package_modules(package, package_dir)
                if (pkg if mod == "__init__" else f"{pkg}.{mod}") in KEEP]


setup(
    package_dir={p: str(Path("..", "..", *(p.split(".")[1:] or ["splitedge"]))) for p in PACKAGES},
    packages=PACKAGES,
    cmdclass={"build_py": ThinBuildPy},
)
