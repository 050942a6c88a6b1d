"""The wheel installs one top-level package, `splitedge`; the repo's folders are its subpackages.

Generic names such as `protocol` or `models` exist on PyPI, and pip overwrites clashing files
silently, so nothing of ours may sit at the top of site-packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("protocol", "device", "edge", "cloud", "models", "methods", "bench", "exporters")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src, out = tmp_path_factory.mktemp("src") / "splitedge", tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "runs",
                                                             "__pycache__", "results", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    return next(out.glob("splitedge-*.whl"))


def test_wheel_top_level_is_only_splitedge(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"splitedge", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for folder in FOLDERS:  # every folder, with its subpackages (one per method)
        assert f"splitedge/{folder}/__init__.py" in names
    assert "splitedge/methods/hsfp/method.py" in names
    assert "splitedge/provision/cli.py" in names  # subpackages of the app folder too (setup.py)


def test_installed_wheel_imports_namespaced_and_refuses_bare_names(wheel: Path, tmp_path: Path) -> None:
    # Prepare: the wheel unpacked into its own site dir, run from a folder that is not the repo
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import importlib.util, sys\nimport splitedge.protocol, splitedge.methods.hsfp.method\n"
            "print(splitedge.protocol.__file__)\n"
            "print([m for m in ('protocol', 'methods', 'models', 'device') if importlib.util.find_spec(m)])")
    # Execute
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(site)})
    # Assert
    assert proc.returncode == 0, proc.stderr
    where, bare = proc.stdout.strip().splitlines()
    assert where.startswith(str(site))
    assert bare == "[]"
