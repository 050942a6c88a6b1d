"""The thin device wheel (deploy/thin/) in an env of its own: no torch, only the base dependencies.

Both wheels are built from a copy of the checkout as deploy/README.md builds them; the thin one
goes into a plain venv (no system site-packages) whose only other packages are numpy, msgpack,
paho-mqtt, psutil and pillow, taken from this venv through a .pth file (offline). There it must
hold no torch module, import whole, run a real device through a round of a real federation, and
answer a role it lacks in one line. The two wheels are one distribution: either replaces the other.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = ("numpy", "msgpack", "paho", "psutil", "PIL")
TORCH_ONLY = ("cloud", "edge", "bench", "exporters", "models", "sim", "provision")
"""Folders (and app subpackages) of the full wheel the thin one must not hold."""


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src, out = tmp_path_factory.mktemp("src") / "splitedge", tmp_path_factory.mktemp("wheels")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "runs",
                                                             "__pycache__", "results", "tests"))
    for folder in (src, src / "deploy" / "thin"):  # the two documented builds, offline
        _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(folder))
    return {"thin": next(out.glob("splitedge-*+thin-*.whl")), "full": next(out.glob("splitedge-*[0-9]-py3-*.whl"))}


def _venv(root: Path, wheel: Path) -> Path:
    """A plain venv holding `wheel` and, through a .pth file, the base dependencies (with their
    dist-info, so pip check sees them) from this venv; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    _pip("--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel))
    deps, site = root / "base-deps", Path(importlib.util.find_spec("numpy").origin).parents[1]
    deps.mkdir()
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() in {"numpy", "msgpack", "paho", "psutil", "pil", "pillow",
                                                                "paho_mqtt"}:
            (deps / entry.name).symlink_to(entry)
    site_of_venv = next((root / "lib").glob("python3*/site-packages"))
    (site_of_venv / "base-deps.pth").write_text(f"{deps}\n")
    return python


@pytest.fixture(scope="module")
def thin_python(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("thin-env") / "venv", wheels["thin"])


def _run(python: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout must not be reachable
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_thin_wheel_holds_the_device_and_nothing_that_needs_torch(wheels: dict[str, Path]) -> None:
    names = zipfile.ZipFile(wheels["thin"]).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert {n.split("/")[0] for n in names} == {"splitedge", "splitedge-0.1.0+thin.dist-info"}
    assert not [n for n in modules if n.split("/")[1] in TORCH_ONLY], "a torch-only folder in the thin wheel"
    for needed in ("splitedge/cli.py", "splitedge/device/cli.py", "splitedge/device/agent.py",
                   "splitedge/keys_cli.py", "splitedge/methods/thin/graphs.py", "splitedge/methods/hsfp/device_thin.py",
                   "splitedge/methods/fedprox/method.py"):  # a torch-only method refuses a thin device by name
        assert needed in names, needed
    with zipfile.ZipFile(wheels["thin"]) as z:  # no module of it imports torch at load time
        loads_torch = [n for n in modules if any(
            isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0] in ("torch", "torchvision")
                for a in node.names) for node in ast.parse(z.read(n)).body)]
    assert not loads_torch, loads_torch
    full = zipfile.ZipFile(wheels["full"]).namelist()
    assert set(modules) < set(full) and "splitedge/cloud/cli.py" in full  # a subset of the full wheel's files
    assert len(modules) < 0.7 * len([n for n in full if n.endswith(".py")])


def test_thin_metadata_is_the_full_wheels_less_torch() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    full, thin = (tomllib.loads((REPO / p).read_text())["project"]
                  for p in ("pyproject.toml", "deploy/thin/pyproject.toml"))
    assert thin["name"] == full["name"] and thin["version"] == full["version"] + "+thin"
    assert thin["dependencies"] == full["dependencies"] and thin["scripts"] == full["scripts"]
    assert thin["optional-dependencies"] == {k: full["optional-dependencies"][k] for k in ("sign", "metrics")}


_IMPORT_ALL = """
import importlib, importlib.util, json, pkgutil, sys
import splitedge
assert importlib.util.find_spec("torch") is None
failed = {}
for m in pkgutil.walk_packages(splitedge.__path__, "splitedge."):
    if m.name == "splitedge.__main__":  # runs the CLI
        continue
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as exc:
        failed[m.name] = exc.name
print(json.dumps({"file": splitedge.__file__, "failed": failed,
                  "heavy": [m for m in ("torch", "torchvision", "onnx", "onnxruntime") if m in sys.modules]}))
"""

_DEVICE_ONLY = """
import sys
import splitedge.device.cli, splitedge.device.agent, splitedge.methods.hsfp.device_thin, splitedge.methods.registry
print(sorted(m for m in ("torch", "cryptography", "prometheus_client") if m in sys.modules))
"""


def test_thin_install_imports_whole_without_torch(thin_python: Path, tmp_path: Path) -> None:
    import json

    # Execute: every module of the install, then the device's path alone in a fresh interpreter
    every = _run(thin_python, "-c", _IMPORT_ALL, cwd=tmp_path)
    device = _run(thin_python, "-c", _DEVICE_ONLY, cwd=tmp_path)
    # Assert
    assert every.returncode == 0, every.stderr
    report = json.loads(every.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(thin_python.parents[1])), report["file"]  # the wheel, not the checkout
    assert report["heavy"] == []
    # only the modules of the [sign] extra may miss theirs (cryptography is not a base dependency)
    assert set(report["failed"].values()) <= {"cryptography"}, report["failed"]
    assert device.returncode == 0 and device.stdout.strip() == "[]", device.stderr  # nor [sign], nor [metrics]
    _pip("--python", str(thin_python), "check")  # the base dependencies satisfy the wheel's requirements


def test_a_role_the_thin_install_lacks_answers_in_one_line(thin_python: Path, tmp_path: Path) -> None:
    splitedge = str(thin_python.parent / "splitedge")
    for role in ("cloud", "edge", "sim", "bench", "export"):
        proc = _run(Path(splitedge), role, "--rounds", "1", cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert f"splitedge {role}: not in this install: this is the thin install (splitedge 0.1.0+thin" in proc.stderr
        assert "pip install 'splitedge-0.1.0-py3-none-any.whl[all]'" in proc.stderr
    helps = [_run(Path(splitedge), *argv, cwd=tmp_path) for argv in (["--help"], ["device", "--help"])]
    assert [h.returncode for h in helps] == [0, 0], [h.stderr for h in helps]
    assert "--backend" in helps[1].stdout


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_device_of_the_thin_install_trains_a_round_of_a_real_federation(thin_python: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import federation
    from splitedge.protocol.broker import MosquittoBroker

    spawn = federation._spawn

    def thin_device(args: list[str], log: Path, env_extra=None) -> subprocess.Popen:
        if args[0] != "device":  # cloud and edge run from this checkout (torch)
            return spawn(args, log, env_extra)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.Popen([str(thin_python.parent / "splitedge"), *args], stdout=open(log, "a"),
                                stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"}, cwd=log.parent)

    monkeypatch.setattr(federation, "_spawn", thin_device)
    with MosquittoBroker() as broker:
        fed = federation.Federation(tmp_path, broker.url, edges=1, devices=1, rounds=1,
                                    extra=["--method", "hsfp", "--deadline", "60", "--join-timeout", "30"],
                                    node_extra={"d0": ["--backend", "onnx"]})
        try:
            assert fed.procs["cloud"].wait(120) == 0, fed.logs()
            fed.wait(30)
        finally:
            fed.close()
    assert [p.returncode for p in fed.procs.values()] == [0, 0, 0], fed.logs()
    assert len(fed.metrics()) == 1 and fed.metrics()[0]["accuracy"] > 0.2, fed.metrics()
    assert "backend onnx" in fed.log("d0") and "Traceback" not in fed.log("d0"), fed.log("d0")


def test_the_full_wheel_replaces_the_thin_one_and_back(wheels: dict[str, Path], tmp_path: Path) -> None:
    # Prepare: a thin install
    python = _venv(tmp_path / "venv", wheels["thin"])
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))

    def installed() -> tuple[list[str], bool]:
        return sorted(p.name for p in site.glob("splitedge-*.dist-info")), (site / "splitedge" / "cloud").exists()

    # Execute, Assert: pip holds one `splitedge`, so each install uninstalls the other first
    _pip("--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheels["full"]))
    assert installed() == (["splitedge-0.1.0.dist-info"], True)
    _pip("--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheels["thin"]))
    assert installed() == (["splitedge-0.1.0+thin.dist-info"], False)  # the full wheel's files went with it
