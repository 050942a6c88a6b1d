"""The systemd units in deploy/: they parse, hold what a field deployment needs, and their
ExecStart lines, expanded the way systemd does with the example env files, are valid
`splitedge` command lines.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitedge.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = {"device": "splitedge-device.service", "edge": "splitedge-edge.service", "cloud": "splitedge-cloud.service"}
REQUIRED = {"Unit": ["Description", "After"],
            "Service": ["Type", "User", "Group", "EnvironmentFile", "ExecStart", "Restart", "MemoryMax",
                        "NoNewPrivileges", "ProtectSystem", "StateDirectory"],
            "Install": ["WantedBy"]}


def read_unit(role: str) -> configparser.ConfigParser:
    # strict: a duplicated key would be a silent override in systemd's eyes too often
    unit = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / UNITS[role]).read_text())
    return unit


def read_env(role: str, **override: str) -> dict[str, str]:
    env = {}
    for line in (DEPLOY / "env" / f"{role}.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return {**env, **override}


def expand(exec_start: str, env: dict[str, str]) -> list[str]:
    """systemd's rules: `${X}` inside a word is replaced in place; a word that is exactly `$X`
    becomes zero or more words (the value split at whitespace). Unknown variables fail here."""
    argv: list[str] = []
    for word in shlex.split(exec_start):
        if re.fullmatch(r"\$[A-Za-z_]\w*", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.mark.parametrize("role", UNITS)
def test_unit_has_required_keys(role: str) -> None:
    unit = read_unit(role)
    for section, keys in REQUIRED.items():
        missing = [k for k in keys if not unit.has_option(section, k)]
        assert not missing, f"{UNITS[role]} [{section}] lacks {missing}"
    service = unit["Service"]
    assert service["User"] not in ("root", "0") and service["NoNewPrivileges"] == "yes"
    assert service["EnvironmentFile"] == f"/etc/splitedge/{role}.env"
    if role != "cloud":  # a restarted cloud would restart the run at round 1 (see the unit)
        # back after any exit (a finished run's node waits for the next run of its id), except
        # a mistake in its settings (exit 2: test_a_settings_mistake_exits_2_and_is_not_restarted)
        assert service["Restart"] == "always" and service["RestartPreventExitStatus"] == "2"


@pytest.mark.parametrize("role,override", [("device", {}), ("device", {"SPLITEDGE_BACKEND": "torch"}),
                                           ("edge", {}), ("edge", {"SPLITEDGE_ARGS": "--upstream mqtt://c:1883"}),
                                           ("cloud", {})])
def test_exec_start_is_a_valid_splitedge_command(role: str, override: dict[str, str]) -> None:
    argv = expand(read_unit(role)["Service"]["ExecStart"], read_env(role, **override))
    assert Path(argv[0]).name == "splitedge"
    args = build_parser().parse_args(argv[1:])  # argparse exits (SystemExit) on a bad line
    assert args.command == role and args.broker.startswith("mqtt")
    if "SPLITEDGE_ARGS" in override:
        assert args.upstream == "mqtt://c:1883"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own parser, which names unknown keys (it exits 0 for them, so read stderr)."""
    splitedge = Path(sys.executable).with_name("splitedge")  # verify needs an existing binary
    if not splitedge.exists():
        pytest.skip("no splitedge console script next to this Python")
    for name in UNITS.values():
        text = (DEPLOY / name).read_text().replace("/opt/splitedge/venv/bin/splitedge", str(splitedge))
        (tmp_path / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", *map(str, sorted(tmp_path.iterdir()))],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0 and "splitedge-" not in result.stderr:  # e.g. a container without systemd
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_a_settings_mistake_exits_2_and_is_not_restarted(tmp_path: Path) -> None:
    """The exit status the units do not restart on is the one a user's mistake gets."""
    import subprocess
    import sys

    for argv in (["device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0", "--run", "r",
                  "--data", str(tmp_path / "missing.npz")],
                 ["edge", "--broker", "mqtt://127.0.0.1:1", "--id", "e0", "--run", "r", "--manifest",
                  str(tmp_path / "missing.json")]):
        done = subprocess.run([sys.executable, "-m", "splitedge", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (argv, done.returncode, done.stderr)
