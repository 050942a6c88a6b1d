"""Without the mosquitto binary the broker tests are skipped locally but fail on CI.

A throwaway pytest run in a temp dir uses the fixtures of brokers.py (as conftest.py does)
with every PATH entry holding `mosquitto` removed, once with CI set and once without.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from brokers import INSTALL_HINT

TESTS = Path(__file__).resolve().parents[1]
THROWAWAY = '''
import pytest

def test_shared_broker(mosquitto):
    pass

@pytest.mark.usefixtures("mosquitto_binary")
def test_own_broker():
    pass
'''


def run_without_mosquitto(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # no ini of this repo (addopts, timeout)
    (tmp_path / "conftest.py").write_text("from brokers import mosquitto, mosquitto_binary  # noqa: F401\n")
    (tmp_path / "test_throwaway.py").write_text(THROWAWAY)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.access(os.path.join(d, "mosquitto"), os.X_OK))
    assert shutil.which("mosquitto", path=path) is None
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update(PATH=path, PYTHONPATH=os.pathsep.join(filter(None, (str(TESTS), env.get("PYTHONPATH")))))
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_missing_mosquitto_fails_on_ci(tmp_path: Path, ci: str) -> None:
    out = run_without_mosquitto(tmp_path, ci)
    assert out.returncode == 1 and "2 errors" in out.stdout and INSTALL_HINT in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("ci", [None, "false"])
def test_missing_mosquitto_skips_elsewhere(tmp_path: Path, ci: str | None) -> None:
    out = run_without_mosquitto(tmp_path, ci)
    assert out.returncode == 0 and "2 skipped" in out.stdout, out.stdout + out.stderr
