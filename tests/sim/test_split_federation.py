"""The safe path is the default one (issue 57, item 4): `splitedge data split --keys` writes a key
pair per node and prints each node's command; run as printed on a real broker, the federation
signs and verifies every message and completes its round, and its edge, started with the split's
folder as printed (`--manifest shards`), admits only the devices of the manifest: a stranger
with a valid key of its own (an insider who added one to the key folder) is refused at its hello.
An edge without a manifest says once that it is open, unless told to be (--admit-any-device).
On 52b8928 `data split` had no --keys and printed no cloud or edge command, `--manifest` took only
a file (README named it manifest.json), and an open edge said nothing."""

from __future__ import annotations

import json
import shutil
import time

from brokers import wait_until
from typed_commands import Processes, remove, scratch

SMALL_CLOUD = " --rounds 1 --max-test 200 --deadline 90 --join-timeout 120"
"""One round (argparse keeps the last value of a flag given twice)."""


def printed_commands(stdout: str) -> dict[str, str]:
    """node -> the command `data split` printed for it."""
    lines = [line.strip() for line in stdout.splitlines() if line.startswith("  splitedge ")]
    return {("cloud" if " cloud " in f" {line} " and "--id" not in line else line.split("--id ")[1].split()[0]): line
            for line in lines}


def test_the_split_s_keys_sign_a_federation_and_its_edge_admits_only_the_manifest(mosquitto) -> None:
    folder = scratch()
    try:
        with Processes(folder) as nodes:
            split = nodes.run(f"splitedge data split --dataset digits --devices 2 --edges 1 --max-train 300 "
                              f"--broker {mosquitto.url} --keys --out shards")
            commands = printed_commands(split.stdout)
            assert sorted(commands) == ["cloud", "d0", "d1", "e0"], split.stdout
            assert all("--sign-key shards/keys/" in c and "--verify-keys shards/keys" in c for c in commands.values())
            assert "--manifest shards" in commands["e0"]
            assert sorted(p.name for p in (folder / "shards" / "keys").iterdir()) == sorted(
                f"{n}{ext}" for n in ("cloud", "e0", "d0", "d1") for ext in (".key", ".pub", ".role"))
            # a stranger with a key the edge trusts: only the manifest keeps it out
            nodes.run("splitedge keys generate --out shards/keys --role device d9")
            shutil.copy(folder / "shards" / "shard-d0.npz", folder / "stranger.npz")
            stranger = (commands["d0"].replace("--id d0", "--id d9").replace("keys/d0.key", "keys/d9.key")
                        .replace("shards/shard-d0.npz", "stranger.npz"))

            nodes.start(commands["cloud"] + SMALL_CLOUD)
            nodes.start(commands["e0"])
            assert wait_until(lambda: "admits only the 2 devices" in nodes.log("e0"), 60), nodes.logs()
            nodes.start(stranger)
            for device in ("d0", "d1"):
                nodes.start(commands[device])
            exits = nodes.wait(300, ["cloud", "e0", "d0", "d1"])
            assert exits == {"cloud": 0, "e0": 0, "d0": 0, "d1": 0}, nodes.logs()

            rounds = [json.loads(line) for line in (folder / "runs" / "cloud" / "metrics.jsonl").read_text().splitlines()]
            assert len(rounds) == 1 and rounds[0]["accuracy"] is not None and rounds[0]["devices_reported"] == 2, rounds
            assert "refused device d9: not in this edge's manifest" in nodes.log("e0"), nodes.log("e0")
            for name in ("cloud", "e0", "d0", "d1"):
                assert "unsigned" not in nodes.log(name) and "no --manifest" not in nodes.log(name), nodes.log(name)
    finally:
        remove(folder)


def test_an_edge_without_a_manifest_says_once_that_it_admits_any_device(mosquitto) -> None:
    folder = scratch()
    try:
        with Processes(folder) as nodes:
            base = f"splitedge edge --broker {mosquitto.url} --run open-edge"
            nodes.start(f"{base} --id e0")
            nodes.start(f"{base} --id e1 --admit-any-device")
            assert wait_until(lambda: all("waiting for devices" in nodes.log(e) for e in ("e0", "e1")), 60), nodes.logs()
            time.sleep(1)
            assert nodes.log("e0").count("no --manifest: this edge admits any device id") == 1, nodes.log("e0")
            assert "--admit-any-device to run open on purpose" in nodes.log("e0")
            assert "no --manifest" not in nodes.log("e1"), nodes.log("e1")
    finally:
        remove(folder)


def test_an_edge_finds_the_manifest_in_the_split_s_folder_and_a_new_split_keeps_the_keys(tmp_path, capsys) -> None:
    import pytest

    from splitedge.cli import main
    from splitedge.runtime.allowance import manifest_allowances

    out = tmp_path / "shards"
    split = ["data", "split", "--dataset", "digits", "--devices", "2", "--max-train", "100", "--keys", "--out", str(out)]
    assert main(split) == 0
    assert manifest_allowances(out) == manifest_allowances(out / "shards.json") and sorted(manifest_allowances(out)) == [
        "d0", "d1"]
    with pytest.raises(ValueError, match=r"--manifest .*: no shards.json in this folder \(give the shards.json"):
        manifest_allowances(tmp_path)
    key = (out / "keys" / "d0.key").read_bytes()
    capsys.readouterr()
    assert main([*split, "--overwrite"]) == 0  # a node keeps its key: a new one would lock it out
    assert (out / "keys" / "d0.key").read_bytes() == key
    assert "kept the pairs already there: cloud, e0, d0, d1" in capsys.readouterr().out
    (out / "keys" / "d1.pub").unlink()
    assert main([*split, "--overwrite"]) == 2  # half a pair is refused before the split, never mended
    assert "d1.key exists without d1.pub" in capsys.readouterr().err
