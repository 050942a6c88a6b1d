"""DecMAR with no cloud and no edge: `splitedge peers` plans the run, devices clock their own
rounds from the plan and average with their neighbours over a real Mosquitto."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from splitedge.cli import main
from splitedge.device.peer_agent import PeerAgent, PeerPlan
from splitedge.methods import topology
from splitedge.protocol.acl import peer_acl
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.data.partition import iid
from splitedge.runtime.session import connect

SMALL = ["--set", "patch=2", "--set", "vit_dim=32", "--set", "vit_depth=2", "--set", "decoder_dim=16",
         "--set", "decoder_depth=1"]


def _plan(tmp_path: Path, *extra: str) -> PeerPlan:
    assert main(["peers", "--out", str(tmp_path / "plan"), "--rounds", "2", "--run", "p2p", *SMALL, *extra]) == 0
    return PeerPlan.load(tmp_path / "plan" / "plan.json")


def test_peers_writes_the_plan_graph_and_acl(tmp_path) -> None:
    plan = _plan(tmp_path, "--devices", "6", "--degree", "3", "--seed", "4")
    out = tmp_path / "plan"
    # the graph is the seed's connected Erdos-Renyi graph, saved as data, picture and ACL
    want = topology.erdos_renyi([f"d{i}" for i in range(6)], 3.0, np.random.default_rng(4))
    assert plan.graph == want and topology.is_connected(plan.graph)
    assert json.loads((out / "graph.json").read_text())["edges"] == topology.edge_list(want)
    assert (out / "graph.png").stat().st_size > 0
    assert (out / "peers.acl").read_text() == peer_acl("p2p", want)
    assert plan.method == "decmar" and plan.config["method"]["vit_dim"] == 32 and plan.rounds == 2


@pytest.mark.parametrize("argv,says", [
    (["--devices", "1"], "--devices must be >= 2"),
    (["--devices", "4", "--set", "graph=star"], "decmar settings"),
    (["--devices", "4", "--set", "nonsense=1"], "decmar settings"),
])
def test_peers_refuses_bad_settings_in_one_line(argv, says, tmp_path, capsys) -> None:
    assert main(["peers", "--out", str(tmp_path / "p"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and not (tmp_path / "p" / "plan.json").exists()


def test_device_refuses_a_bad_plan_before_connecting(tmp_path, capsys) -> None:
    plan = _plan(tmp_path, "--devices", "3")
    shard = tmp_path / "x.npz"
    np.savez(shard, x=np.zeros((4, 8, 8, 1), np.uint8), y=np.arange(4))
    broker = "mqtt://127.0.0.1:1"  # nothing listens: each case must fail before connecting
    cases = [
        (["--peers", str(tmp_path / "none.json"), "--id", "d0"], "does not exist"),
        (["--peers", str(tmp_path / "plan" / "plan.json"), "--id", "d7"], "not in"),
        (["--peers", str(tmp_path / "plan" / "plan.json"), "--edge", "e0", "--id", "d0"], "not both"),
        (["--id", "d0"], "not neither"),
    ]
    (tmp_path / "broken.json").write_text("{")
    cases.append((["--peers", str(tmp_path / "broken.json"), "--id", "d0"], "not a JSON file"))
    for argv, says in cases:
        assert main(["device", "--broker", broker, "--data", str(shard), *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, (argv, err)
    assert plan.graph["d0"]


def test_decmar_devices_without_cloud_average_with_their_neighbours(mosquitto, tmp_path) -> None:
    # Prepare: three devices on a ring (every device sees both others), 2 rounds, no cloud, no edge
    torch.set_num_threads(1)
    plan = _plan(tmp_path, "--devices", "3", "--graph", "ring")
    train, _, _ = load_dataset("digits", max_train=450)
    shards = iid(train[1], 3, np.random.default_rng(0))
    agents = [PeerAgent(connect(mosquitto.url, run=plan.run, tier="device", node_id=d), plan=plan, node_id=d,
                        data=(train[0][idx], train[1][idx])) for d, idx in zip(sorted(plan.graph), shards)]
    errors: list[BaseException] = []

    def go(agent: PeerAgent) -> None:
        try:
            agent.run_rounds()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    # Execute
    threads = [threading.Thread(target=go, args=(a,)) for a in agents]
    try:
        for a in agents:
            a.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        for a in agents:
            a.stop()
            a.transport.close()
    # Assert: each round every device heard both neighbours, trained, and (a complete graph) all
    # three end the run holding the same averaged model
    assert not errors and all(len(a.records) == 2 for a in agents), errors
    assert all(r["method"]["neighbours_heard"] == 2 for a in agents for r in a.records)
    assert all(a.records[1]["loss"]["mar"] != 0.0 for a in agents)  # z_bar from the neighbours' latents
    states = [a.part.local_state() for a in agents]
    for name in states[0]:
        assert np.allclose(states[0][name], states[1][name], atol=1e-5)
        assert np.allclose(states[0][name], states[2][name], atol=1e-5)
    paths = agents[0].save(tmp_path / "out")
    assert [p.name for p in paths] == ["d0-rounds.jsonl", "d0-model.safetensors"]
