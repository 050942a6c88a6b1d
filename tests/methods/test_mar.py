"""FedMAR and DecMAR end to end over a real Mosquitto (digits, 2 rounds).

FedMAR: the devices' mean latents reach the cloud, z_bar comes back down and switches the MAR
term on in round 2. DecMAR: four devices on a ring exchange models and latents only with their
neighbours, on a broker that enforces the ACL generated from the graph: a device login that
subscribes to a non-neighbour's peer topic receives nothing, while a neighbour's arrives.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from brokers import require_mosquitto
from live_nodes import LiveNodes
from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
from splitedge.cloud.options import build_run_config
from splitedge.device.agent import DeviceAgent
from splitedge.edge.aggregator import EdgeAggregator
from splitedge.methods import topology
from splitedge.protocol import acl
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.data.partition import iid
from splitedge.protocol.broker import MosquittoBroker
from splitedge.protocol.mqtt import MqttTransport
from splitedge.sim import SimSettings, run_sim

SMALL = {"patch": "2", "vit_dim": "32", "vit_depth": "2", "decoder_dim": "16", "decoder_depth": "1",
         "report_every": "1", "probe_epochs": "20"}
PASSWORD = "mar-secret"


def _fedmar(url: str, run: str, out: Path, devices: int = 4, **settings: str) -> list[dict]:
    """Two rounds of fedmar on digits; the cloud's metrics."""
    torch.set_num_threads(1)
    s = SimSettings(rounds=2, devices=devices, edges=devices // 2, method="fedmar", broker=url, run=run, out=out,
                    deadline_s=120.0, max_train=200 * devices, overrides={**SMALL, **settings})
    run_sim(s)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fedmar_latents_up_zbar_down_over_mosquitto(mosquitto, tmp_path) -> None:
    # Execute
    history = _fedmar(mosquitto.url, "fedmar-e2e", tmp_path)
    # Assert: every device's latent reached the cloud each round; z_bar of round 1 was announced
    # for round 2, and only then did the MAR term weigh anything
    assert [r["latents"] for r in history] == [4, 4]
    assert history[0]["versions"]["zbar"] == 0 and history[1]["versions"]["zbar"] == 1
    loss1, loss2 = history[0]["loss"]["device"], history[1]["loss"]["device"]
    assert loss1["mar"] == 0.0 and loss2["mar"] != 0.0, (loss1, loss2)  # A-MMD to one vector may be < 0
    assert loss2["mae"] < loss1["mae"]  # the autoencoder learns
    assert all(r["rejected"] == {"cloud": {}} for r in history)
    assert history[-1]["model_version"] == 2 and len(history[-1]["spectrum"]) == 32


def test_fedmar_paper_form_sends_the_participants_latents_as_the_reference(mosquitto, tmp_path) -> None:
    history = _fedmar(mosquitto.url, "fedmar-paper", tmp_path, ammd="paper")
    assert [r["latents"] for r in history] == [4, 4] and history[1]["versions"]["zbar"] == 1
    mar = history[1]["loss"]["device"]["mar"]
    assert mar > 0.0, history[1]["loss"]  # two sets matched (a batch, 4 latents): not a pull to one point
    assert all(r["rejected"] == {"cloud": {}} for r in history)


def test_fedmar_without_mar_is_plain_mae(mosquitto, tmp_path) -> None:
    history = _fedmar(mosquitto.url, "mae-e2e", tmp_path, devices=2, mar="false")
    assert set(history[1]["loss"]["device"]) == {"mae", "total"}
    assert history[1]["versions"]["zbar"] == 0  # no reference is sent, and none is waited for


def test_fedmar_without_local_training_sends_the_random_encoder_s_latents(mosquitto, tmp_path) -> None:
    """local_epochs=0 is the random-encoder bound of a probe comparison (bench matrix
    mar-paper-forms): the devices train nothing, yet each round's latents still go up (their
    mean over one pass of the data) and the model stays the initial one."""
    history = _fedmar(mosquitto.url, "fedmar-random", tmp_path, devices=2, local_epochs="0")
    assert [r["latents"] for r in history] == [2, 2], history
    assert all(r["rejected"] == {"cloud": {}} for r in history)
    assert np.isfinite(history[-1]["accuracy"])


# -- DecMAR on a broker that enforces the peer graph ------------------------------------------
def _passwords(path: Path, users: list[str]) -> Path:
    for i, user in enumerate(users):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(path), user, PASSWORD],
                       check=True, capture_output=True)
    return path


def _login(broker: MosquittoBroker, user: str) -> str:
    return f"mqtt://{user}:{PASSWORD}@{broker.host}:{broker.port}"


def test_decmar_ring_of_four_under_the_generated_acl(tmp_path) -> None:
    require_mosquitto("mosquitto", "mosquitto_passwd")
    torch.set_num_threads(1)
    # Prepare: the ring DecMAR's cloud will draw (sorted device ids), its ACL, and logins for all
    run, devices, rounds = "decmar-acl", ["d0", "d1", "d2", "d3"], 2
    homes = {d: f"e{i % 2}" for i, d in enumerate(devices)}
    graph = topology.ring(devices)
    device_acl = acl.peer_acl(run, graph, edges=homes)
    trusted = "".join(f"\nuser {u}\ntopic readwrite splitedge/{run}/#\n" for u in ("cloud", "e0", "e1", "observer"))
    acl_path = acl.write_acl(tmp_path / "broker.acl", device_acl + trusted)
    passwd = _passwords(tmp_path / "passwd", [*devices, "cloud", "e0", "e1", "observer"])
    train, test, info = load_dataset("digits", max_train=800)
    shards = iid(train[1], len(devices), np.random.default_rng(0))
    config = build_run_config("decmar", info, None, 0, {**SMALL, "graph": "ring"})

    conf = f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl_path}\n"
    with MosquittoBroker(extra_conf=conf) as broker:
        heard: dict[str, list[str]] = {"neighbour": [], "stranger": [], "observer": []}
        lock = threading.Lock()

        def keep(where: str):
            def on(topic: str, env: Any) -> None:
                with lock:
                    heard[where].append(env.sender)
            return on

        # d0's login tries to read its neighbour d1's and its non-neighbour d2's peer topics
        spy = MqttTransport(_login(broker, "d0"), client_id="d0-spy", role="observer")
        spy.subscribe(f"splitedge/{run}/device/d1/peer/#", keep("neighbour"))
        spy.subscribe(f"splitedge/{run}/device/d2/peer/#", keep("stranger"))
        observer = MqttTransport(_login(broker, "observer"), client_id="observer", role="observer")
        observer.subscribe(f"splitedge/{run}/device/d2/peer/#", keep("observer"))
        with LiveNodes(lambda node: _login(broker, node), run) as live:
            live.adopt(spy)
            live.adopt(observer)
            for e in ("e0", "e1"):
                live.start(EdgeAggregator(live.transport("edge", e), run=run, node_id=e))
            for d, idx in zip(devices, shards):
                live.start(DeviceAgent(live.transport("device", d), run=run, node_id=d, edge=homes[d],
                                       data=(train[0][idx], train[1][idx])))
            settings = CloudSettings(method="decmar", rounds=rounds, config=config, deadline_s=120.0, min_edges=2,
                                     min_devices=4, out_dir=tmp_path / "run")
            (tmp_path / "run").mkdir()
            history = CloudCoordinator(live.transport("cloud", "cloud"), settings, run=run, test=test).run()

    # Assert: the rounds ran, each device averaging with both ring neighbours
    assert [r["round"] for r in history] == [1, 2]
    assert all(r["neighbours_heard"] == {d: 2 for d in devices} for r in history), history
    assert history[-1]["model_version"] == 2 and history[-1]["samples"] == 800
    assert history[-1]["mean_degree"] == 2.0
    # the cloud wrote the graph and exactly the device ACL the broker enforced
    assert (tmp_path / "run" / "peers.acl").read_text() == device_acl
    assert json.loads((tmp_path / "run" / "graph.json").read_text())
    # d2 did publish peer messages (the observer saw them), d1's reached d0, d2's never did
    assert heard["observer"] and set(heard["observer"]) == {"d2"}
    assert heard["neighbour"] and set(heard["neighbour"]) == {"d1"}
    assert heard["stranger"] == []


@pytest.mark.parametrize("graph,degree", [("ring", 4.0), ("er", 2.0)])
def test_decmar_config(graph: str, degree: float) -> None:
    from splitedge.methods.mar.config import DecMARConfig

    assert DecMARConfig(graph=graph, degree=degree).degree == degree
    with pytest.raises(ValueError):
        DecMARConfig(graph="star")


# -- hostile input, part by part (no broker) ---------------------------------------------------
def test_mar_parts_refuse_what_does_not_fit_the_federation() -> None:
    from parts import cloud_ctx, device_ctx, edge_ctx, env, wire

    from splitedge.methods.checks import weight_specs
    from splitedge.methods.mar.cloud import MARCloud
    from splitedge.methods.mar.device import DecMARDevice
    from splitedge.methods.mar.edge import MAREdge
    from splitedge.models import state_to_numpy
    from splitedge.protocol.codec import decode, encode
    from splitedge.protocol.errors import ProtocolError

    settings = {k: v for k, v in SMALL.items() if k not in ("report_every", "probe_epochs")}
    data = (np.zeros((8, 8, 8, 1), np.uint8), np.arange(8) % 10)
    device = DecMARDevice(device_ctx("decmar", "d0", **settings), data, "torch")
    good = state_to_numpy(device.model)
    dim = device.model.dim
    bad_shape = {**good, next(iter(good)): np.zeros((3, 3), np.float32)}
    missing = dict(list(good.items())[1:])
    for weights in (bad_shape, missing):
        with pytest.raises(ProtocolError):
            device.check(wire("weights", {"part": "model", "version": 1, "samples": 8, "weights": weights}, "d1"), "peer")
    for z in (np.zeros(dim + 1, np.float32), np.zeros((2, 3), np.float32)):
        with pytest.raises(ProtocolError):
            device.check(wire("arrays", {"name": "latent", "version": 1, "arrays": {"z": z}}, "d1"), "peer")
    device.check(wire("weights", {"part": "model", "version": 1, "samples": 8, "weights": good}, "d1"), "peer")
    # non-finite values never reach a part: the codec refuses them
    nan = env("arrays", {"name": "latent", "version": 1, "arrays": {"z": np.full(dim, np.nan, np.float32)}})
    with pytest.raises(ProtocolError):
        decode(encode(nan, validate=False))

    edge = MAREdge(edge_ctx("fedmar", "e0", **settings))
    edge.check(wire("arrays", {"name": "latent", "version": 1, "arrays": {"z": np.zeros(dim, np.float32)}}, "d0"), "child")
    with pytest.raises(ProtocolError):  # a second device with another width
        edge.check(wire("arrays", {"name": "latent", "version": 1, "arrays": {"z": np.zeros(dim + 4, np.float32)}}, "d1"),
                   "child")
    cloud = MARCloud(cloud_ctx("fedmar", "cloud", rounds=2, **settings))
    assert weight_specs(state_to_numpy(cloud.model)) == device.specs
    with pytest.raises(ProtocolError):
        cloud.check(wire("arrays", {"name": "latents", "version": 1,
                                    "arrays": {"d0": np.zeros(dim + 1, np.float32)}}, "e0"), "child")


def test_decmar_releases_privately_and_averages_its_own_release(mosquitto, tmp_path, monkeypatch) -> None:
    # under DP each device releases its model update and its mean latent (two releases a round)
    # and averages its neighbours' releases with its own release (the very map it sent), never
    # with the model it trained: what it starts the next round from is a function of releases
    from collections import defaultdict

    from splitedge.methods.mar import device as mar_device
    from splitedge.methods.registry import get_method

    sent: dict[int, list] = defaultdict(list)
    first_merged: dict[int, list] = defaultdict(list)
    run_round, merge = mar_device.DecMARDevice.run_round, get_method("decmar").merge_weights

    def spy_round(self, plan):
        for item in run_round(self, plan):
            if getattr(item, "kind", "") == "weights" and item.slot == "model":
                sent[threading.get_ident()].append(item.body["weights"])
            yield item

    def spy_merge(self, parts, reference=None):
        if threading.get_ident() in sent:  # a device's own averaging (edges and the cloud merge too)
            first_merged[threading.get_ident()].append(parts[0][0])
        return merge(self, parts, reference)

    monkeypatch.setattr(mar_device.DecMARDevice, "run_round", spy_round)
    monkeypatch.setattr(get_method("decmar"), "merge_weights", spy_merge)
    torch.set_num_threads(1)
    out = tmp_path / "decmar-dp"
    private = {"dp_sigma": "1e-6", "dp_update_clip": "1000", "dp_clip": "1000", "graph": "ring"}
    run_sim(SimSettings(rounds=2, devices=4, edges=2, method="decmar", broker=mosquitto.url, run="decmar-dp", out=out,
                        deadline_s=120.0, max_train=800, overrides={**SMALL, **private}))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp_releases_total"] for r in records] == [2, 4], records
    assert all(r["dp_epsilon"] > 0 for r in records), records
    assert not any(v for r in records for v in r["rejected"].values()), [r["rejected"] for r in records]
    assert sum(len(v) for v in sent.values()) == 8 and set(sent) == set(first_merged)
    assert all(a is b for t in sent for a, b in zip(sent[t], first_merged[t], strict=True)), "averaged the trained model"
