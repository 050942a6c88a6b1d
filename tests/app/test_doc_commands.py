"""The commands README.md, deploy/README.md and docs/privacy.md tell a user to type stay true to the program:
every `splitedge ...` line of their shell blocks parses with the real parser (a renamed or
removed flag fails here, not on a user's device), the ones that run offline in seconds run as
written, every `splitedge sim` line runs at a small size, a federation a doc runs on one machine
(a block of node commands started with `&` and ended by `wait`, after the block with its
`data split` and `mosquitto -c`) runs as written on a Mosquitto of its own on a free port, the
node commands a doc gives after a `data split` are the ones that split prints, and each other
command says why it is only parsed (issue 56, item 7)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitedge.cli import build_parser
from typed_commands import argv_of

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "deploy/README.md", "docs/privacy.md")
RUN_AS_WRITTEN = ("splitedge keys generate", "splitedge peers ", "splitedge data split --dataset digits")
"""Offline and quick: run exactly as the docs give them, in a scratch folder."""
RUN_SMALL = ("splitedge sim",)
"""Offline, and quick at a small size: run as written with one round on a few hundred images
(SMALL is appended; argparse keeps the last value of a repeated flag)."""
SMALL = ("--rounds", "1", "--max-train", "300", "--max-test", "100")
NOT_RUN = {
    "needs a broker and other nodes at a deployment's addresses (a doc's one-machine federation runs below)":
        ("splitedge cloud", "splitedge edge", "splitedge device", "splitedge watch"),
    "needs the CIFAR-10 archive or a shard at a deployment's path": ("splitedge data split --dataset cifar10",
                                                                     "splitedge data check"),
    "a bench of minutes; its --quick form runs in its own test": ("splitedge bench",),
    "needs the folder of a split; tests/app/test_provision.py provisions one and runs two federations from it":
        ("splitedge provision",),
}
"""Why the other documented commands are only parsed here (each run in tests of its own)."""


def shell_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash / ```sh block, continuation lines joined, comments cut."""
    blocks = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        lines = [" ".join(line.split(" #")[0].split()) for line in block.replace("\\\n", " ").splitlines()]
        blocks.append([line for line in lines if line and not line.startswith("#")])
    return blocks


def shell_lines(text: str) -> list[str]:
    return [line for block in shell_blocks(text) for line in block]


def federations() -> list[tuple[str, list[str], list[str]]]:
    """(doc, the setup block, the nodes' block) of each federation a doc runs on one machine: a
    block whose last command is `wait`, and the block before it."""
    found = []
    for doc in DOCS:
        blocks = shell_blocks((ROOT / doc).read_text())
        found += [(doc, blocks[i - 1], block) for i, block in enumerate(blocks) if i and block[-1:] == ["wait"]]
    return found


FEDERATIONS = federations()
IN_FEDERATIONS = {line.rstrip(" &") for _, setup, nodes in FEDERATIONS for line in setup + nodes}


def splitedge_commands() -> list[tuple[str, str]]:
    """(doc, argv after `splitedge`) for every documented call; `...` placeholders left out."""
    found = []
    for doc in DOCS:
        for line in shell_lines((ROOT / doc).read_text()):
            for part in re.split(r"&&|\|\||;|\|", re.sub(r"\s&$", "", line)):  # `cmd &`: in the background
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
    assert [d for d, _, _ in FEDERATIONS] == ["deploy/README.md"]  # the guide's main path, signed


def split_lines(block: list[str]) -> list[tuple[int, str]]:
    """(index, line) of each `splitedge data split --dataset digits` in a block (quick and offline)."""
    return [(i, line) for i, line in enumerate(block) if line.startswith("splitedge data split --dataset digits")]


@pytest.mark.parametrize("doc", DOCS)
def test_the_node_commands_after_a_split_are_the_ones_it_prints(doc: str, tmp_path: Path) -> None:
    """A doc's cloud, edge and device lines that use a split's files are what that split prints
    (a doc line may add flags after them, e.g. --rounds); a renamed file or flag fails here."""
    blocks = shell_blocks((ROOT / doc).read_text())
    for b, block in enumerate(blocks):
        for i, split in split_lines(block):
            out = shlex.split(split)[shlex.split(split).index("--out") + 1]
            following = block[i + 1:] + [line for later in blocks[b + 1:b + 2] for line in later]
            nodes = [line.rstrip(" &") for line in following
                     if line.startswith(("splitedge cloud", "splitedge edge", "splitedge device"))
                     and f" {out}/" in line + " " or f"--manifest {out}" in line]
            if not nodes:
                continue
            done = subprocess.run([sys.executable, "-m", "splitedge", *shlex.split(split)[1:]], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            printed = [line.strip() for line in done.stdout.splitlines() if line.startswith("  splitedge ")]
            for node in nodes:
                assert any(node == p or node.startswith(p + " ") for p in printed), \
                    f"{doc}: `{node}` is not what `{split}` prints:\n" + "\n".join(printed)
            shutil.rmtree(tmp_path / out)


@pytest.mark.slow
@pytest.mark.parametrize("doc, setup, nodes", FEDERATIONS, ids=[d for d, _, _ in FEDERATIONS])
def test_a_federation_a_doc_runs_on_one_machine_runs_as_written(doc: str, setup: list[str], nodes: list[str]) -> None:
    """Every line as written but for the broker's port (a free one, never the doc's) and `sudo`
    (run only as root, where the broker reads the password file as its own user; otherwise it runs
    as us and needs no chown). Any other kind of line fails the test until it is taught here."""
    from brokers import require_mosquitto
    from generated_broker import BROKER_USER, Broker, broker_user_exists
    from splitedge.protocol.broker import free_port
    from typed_commands import Processes, remove, scratch

    require_mosquitto()
    ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", " ".join(setup + nodes))}
    assert len(ports) == 1, f"{doc}: one broker port in its federation, got {ports}"
    port, theirs = free_port(), ports.pop()
    local = [line.replace(f"127.0.0.1:{theirs}", f"127.0.0.1:{port}") for line in setup + nodes]
    folder, broker = scratch(), None
    try:
        with Processes(folder) as run:
            for line in local:
                words = shlex.split(line)
                if line.startswith("splitedge ") and not line.endswith("&"):
                    run.run(line)
                elif words[:2] == ["sudo", "chown"]:
                    assert words[2] == f"{BROKER_USER}:", line
                    if os.geteuid() == 0 and broker_user_exists():
                        subprocess.run(argv_of(line.removeprefix("sudo "), folder), check=True)
                elif words[0] == "mosquitto":
                    assert words[1] == "-c" and len(words) == 3, line
                    broker = Broker(folder / words[2], port).start()
                elif line.startswith("splitedge ") and line.endswith("&"):
                    run.start(line.rstrip(" &"))
                elif line == "wait":
                    exits = run.wait(600)
                    assert set(exits.values()) == {0}, f"{exits}\n{run.logs()}"
                else:
                    pytest.fail(f"{doc}: this test does not know how to run `{line}`")
            cloud = next(shlex.split(line) for line in local if line.startswith("splitedge cloud"))
            metrics = folder / cloud[cloud.index("--out") + 1] / "metrics.jsonl"
            rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
            devices = int(cloud[cloud.index("--devices") + 1])
            assert rounds and all(r["accuracy"] is not None and r["devices_reported"] == devices for r in rounds), rounds
            for name in run.procs:  # the main path is signed, logged in and admits only the split's devices
                assert "unsigned" not in run.log(name) and "no --manifest" not in run.log(name), run.log(name)
    finally:
        if broker is not None:
            broker.stop()
        remove(folder)


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
