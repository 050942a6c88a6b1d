"""The commands README.md, deploy/README.md and docs/privacy.md tell a user to type stay true to the program:
every `splitedge ...` line of their shell blocks parses with the real parser (a renamed or
removed flag fails here, not on a user's device), the ones that run offline in seconds run as
written, every `splitedge sim` line runs at a small size, and each other command says why it is
only parsed."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from splitedge.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "deploy/README.md", "docs/privacy.md")
RUN_AS_WRITTEN = ("splitedge keys generate", "splitedge peers ", "splitedge data split --dataset digits")
"""Offline and quick: run exactly as the docs give them, in a scratch folder."""
RUN_SMALL = ("splitedge sim",)
"""Offline, and quick at a small size: run as written with one round on a few hundred images
(SMALL is appended; argparse keeps the last value of a repeated flag)."""
SMALL = ("--rounds", "1", "--max-train", "300", "--max-test", "100")
NOT_RUN = {
    "needs a broker and other nodes": ("splitedge cloud", "splitedge edge", "splitedge device", "splitedge watch"),
    "needs the CIFAR-10 archive or a shard at a deployment's path": ("splitedge data split --dataset cifar10",
                                                                     "splitedge data check"),
    "a bench of minutes; its --quick form runs in its own test": ("splitedge bench",),
}
"""Why the other documented commands are only parsed here (each run in tests of its own)."""


def shell_lines(text: str) -> list[str]:
    """Each command of the ```bash / ```sh blocks, continuation lines joined, comments cut."""
    out: list[str] = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def splitedge_commands() -> list[tuple[str, str]]:
    """(doc, argv after `splitedge`) for every documented call; `...` placeholders left out."""
    found = []
    for doc in DOCS:
        for line in shell_lines((ROOT / doc).read_text()):
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part.strip())
                at = next((i for i, w in enumerate(words)  # the program, not the user or group `splitedge`
                           if (i == 0 and w == "splitedge") or w.endswith("/bin/splitedge")), None)
                if at is not None and "..." not in words:
                    found.append((doc, " ".join(words[at + 1:])))
    return found


COMMANDS = splitedge_commands()


def test_the_docs_hold_the_commands_a_user_types() -> None:
    assert len(COMMANDS) >= 20 and {c.split()[0] for _, c in COMMANDS} >= {"sim", "cloud", "edge", "device", "data"}


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_every_documented_command_parses(doc: str, command: str, capsys) -> None:
    argv = shlex.split(command)
    parser = build_parser(next((w for w in argv if not w.startswith("-")), None))
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `splitedge {command}` is refused: {capsys.readouterr().err.strip()} (exit {exc.code})")


def test_every_documented_command_is_run_or_said_why_not() -> None:
    kinds = RUN_AS_WRITTEN + RUN_SMALL + tuple(p for prefixes in NOT_RUN.values() for p in prefixes)
    assert [c for _, c in COMMANDS if not ("splitedge " + c).startswith(kinds)] == []


@pytest.mark.parametrize("command", sorted({c for _, c in COMMANDS if ("splitedge " + c).startswith(RUN_SMALL)}))
def test_the_documented_sims_run_at_a_small_size(command: str, tmp_path: Path, monkeypatch) -> None:
    # in this process (no second torch import): the flags each sim line gives, one round
    from splitedge.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*shlex.split(command), *SMALL, "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("command", sorted({c for _, c in COMMANDS if ("splitedge " + c).startswith(RUN_AS_WRITTEN)}))
def test_the_offline_commands_run_as_written(command: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "splitedge", *shlex.split(command)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
