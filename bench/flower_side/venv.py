"""The Flower venv: an optional bench dependency, kept out of splitedge's own venv and tests.

It holds Flower, the torch splitedge's venv has, what splitedge's model and data code imports,
and splitedge itself (`--no-deps -e`, so the Flower processes run this checkout's code).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path("~/.cache/splitedge/flower-venv").expanduser()
FLOWER_PACKAGES = ("flwr==1.42.0", "torch==2.14.1", "numpy", "msgpack", "paho-mqtt", "psutil", "pillow",
                   "scikit-learn")
REPO = Path(__file__).resolve().parents[2]


class FlowerMissing(ValueError):
    """The Flower venv is not there (or cannot import flwr): one line with the command that makes it."""


def setup_line(venv: str | Path, python: str = "python3") -> str:
    v = Path(venv)
    return (f"{python} -m venv {v} && {v}/bin/pip install {' '.join(FLOWER_PACKAGES)} && "
            f"{v}/bin/pip install --no-deps -e {REPO}")


def flower_python(venv: str | Path) -> Path:
    """The Flower venv's interpreter; FlowerMissing if the venv is not there or cannot import
    flwr and splitedge."""
    python = Path(venv) / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import flwr, splitedge.bench.flower_side.common"],
                                          capture_output=True).returncode == 0:
        return python
    raise FlowerMissing(f"no Flower venv at {venv} (flwr and splitedge importable); make it with: {setup_line(venv)} "
                        f"(or run the bench with --setup)")


def make_venv(venv: str | Path) -> Path:
    """Make (or complete) the Flower venv with this interpreter's Python; its interpreter."""
    line = setup_line(venv, sys.executable)
    print(f"bench flower: making the Flower venv: {line}", flush=True)
    subprocess.run(line, shell=True, check=True)  # noqa: S602 - our own line, printed above
    return flower_python(venv)


def flower_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import flwr; print(flwr.__version__)"], capture_output=True,
                          text=True).stdout.strip()
