"""Least privilege at the broker: `splitedge data split --acl RUN` writes a Mosquitto ACL in
which each device, edge and the cloud logs in as itself and reads and writes only what its role
needs. A federation runs under it, and a device login can neither read another device's
messages nor publish as another node or as its edge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from brokers import require_mosquitto
from live_nodes import LiveNodes
from splitedge.cli import main
from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
from splitedge.cloud.options import build_run_config
from splitedge.device.agent import DeviceAgent
from splitedge.edge.aggregator import EdgeAggregator
from splitedge.methods.data.datasets import load_dataset
from splitedge.protocol.acl import federation_acl
from splitedge.protocol.broker import MosquittoBroker
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport

PASSWORD = "pw"


def test_federation_acl_confines_each_login_to_its_role() -> None:
    text = federation_acl("r", {"d0": "e0", "d1": "e1"}, users={"e1": "site1"})
    blocks = {b.split("\n")[0]: b for b in ("user " + part for part in text.split("\nuser ")[1:])}
    assert "topic readwrite splitedge/r/device/d0/#" in blocks["user d0"]
    assert "topic read splitedge/r/edge/e0/down/+/d0" in blocks["user d0"]
    assert "e1" not in blocks["user d0"] and "device/d1" not in blocks["user d0"]
    assert "topic read splitedge/r/device/+/up/#" in blocks["user site1"]  # an edge's login may be renamed
    assert "topic read splitedge/r/edge/+/up/#" in blocks["user cloud"] and "device" not in blocks["user cloud"]
    with pytest.raises(ValueError, match="own login"):
        federation_acl("r", {"d0": "e0"}, users={"e0": "d0"})


def test_a_federation_runs_under_the_generated_acl_and_a_device_cannot_spy_or_forge(tmp_path: Path,
                                                                                       capsys) -> None:
    from splitedge.protocol.logins import hash_password

    require_mosquitto("mosquitto")
    torch.set_num_threads(1)
    run, devices = "acl-run", ["d0", "d1"]
    # Prepare: shards and the ACL from the CLI; one login per node, plus a trusted observer
    assert main(["data", "split", "--dataset", "digits", "--devices", "2", "--max-train", "400", "--out",
                 str(tmp_path / "shards"), "--acl", run]) == 0
    said = capsys.readouterr().out
    assert f"sudo chown mosquitto: {tmp_path / 'shards' / 'broker.passwd'}" in said and "for run acl-run" in said
    acl, passwd = tmp_path / "shards" / "broker.acl", tmp_path / "shards" / "broker.passwd"
    acl.write_text(acl.read_text() + f"\nuser observer\ntopic read splitedge/{run}/#\n")
    passwd.write_text(passwd.read_text() + f"observer:{hash_password(PASSWORD)}\n")
    logins = tmp_path / "shards" / "logins"
    password = {u: (logins / f"{u}.password").read_text().strip() for u in [*devices, "e0", "cloud"]}
    assert len(set(password.values())) == 3 + 1 and all(len(p) >= 20 for p in password.values())
    assert all((logins / f"{u}.password").stat().st_mode & 0o077 == 0 for u in password)
    password["observer"] = PASSWORD
    train, test, info = load_dataset("digits", max_train=400)
    config = build_run_config("fedavg", info, None, 0, {})

    with MosquittoBroker(extra_conf=f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\n") as broker:
        url = lambda user: f"mqtt://{user}:{password[user]}@127.0.0.1:{broker.port}"  # noqa: E731
        with pytest.raises(ConnectionError):  # a node's login with another node's password
            MqttTransport(f"mqtt://d0:{password['d1']}@127.0.0.1:{broker.port}", client_id="wrong", role="device")
        heard: dict[str, list[Any]] = {"spy": [], "observer": []}
        spy = MqttTransport(url("d1"), client_id="d1-spy", role="observer")
        spy.subscribe(f"splitedge/{run}/device/d0/#", lambda t, e: heard["spy"].append(e.kind))
        observer = MqttTransport(url("observer"), client_id="observer", role="observer")
        observer.subscribe(f"splitedge/{run}/device/d0/up/hello/e0",
                           lambda t, e: heard["observer"].append(e.body["samples"]))
        with LiveNodes(url, run) as live:
            live.adopt(spy)
            live.adopt(observer)
            live.start(EdgeAggregator(live.transport("edge", "e0"), run=run, node_id="e0"))
            for i, d in enumerate(devices):
                shard = np.load(tmp_path / "shards" / f"shard-d{i}.npz")
                live.start(DeviceAgent(live.transport("device", d), run=run, node_id=d, edge="e0",
                                       data=(shard["x"], shard["y"])))
            # Execute: d1's login forges d0's hello (a ghost sample count), then the run goes on
            forger = live.adopt(MqttTransport(url("d1"), client_id="d1-forger", role="device"))
            raw: list[bytes] = []  # everything the broker delivers in the run, as bytes
            watcher = live.adopt(MqttTransport(url("observer"), client_id="observer-raw", role="observer"))
            watcher._client.on_message = lambda c, u, m: raw.append(bytes(m.payload))  # noqa: SLF001
            watcher._client.subscribe(f"splitedge/{run}/#", qos=1)  # noqa: SLF001
            forged = {f"splitedge/{run}/{t}": f"forged {t}".encode() for t in (
                "device/d0/up/status", "device/d0/up/moments", "device/d0/up/weights", "device/d0/up/done",
                "edge/e0/down/round", "edge/e0/up/hello", "cloud/cloud/down/round", "cloud/cloud/down/weights-model")}
            for topic_, payload in forged.items():
                forger.publish_raw(topic_, payload, retain=True)
            forger.publish(f"splitedge/{run}/device/d0/up/hello/e0",
                           Envelope(kind="hello", run=run, round=0, sender="d0",
                                    body={"role": "device", "parent": "e0", "samples": 12345, "backend": "torch",
                                          "classes": np.arange(3, dtype=np.int64)}), wait=5)
            settings = CloudSettings(method="fedavg", rounds=2, config=config, deadline_s=60.0, min_edges=1,
                                     min_devices=2)
            history = CloudCoordinator(live.transport("cloud", "cloud"), settings, run=run, test=test).run()
    # Assert: every round ran (the cloud waited for both devices behind e0) ...
    assert [r["round"] for r in history] == [1, 2] and history[-1]["accuracy"] > 0.3
    # ... d1's login read nothing of d0's, and its forged hello never reached anyone
    assert heard["spy"] == []
    assert heard["observer"] and 12345 not in heard["observer"], heard["observer"]
    # ... nor did anything it published as d0, as its edge or as the cloud (status, moments,
    # weights, done, round, hello), while the broker delivered the run's real traffic
    assert len(raw) > 20 and not set(forged.values()) & set(raw)


def test_generated_password_hashes_are_mosquittos_own_format(tmp_path: Path) -> None:
    import base64
    import hashlib

    from splitedge.protocol.logins import hash_password, write_logins

    # the $7$ hash mosquitto_passwd wrote for "secret" verifies the same way ours is made
    salt = base64.b64decode("ptINcnZ5wOfDqndf")
    assert hash_password("secret", salt=salt) == (
        "$7$101$ptINcnZ5wOfDqndf$QAyPR+7aJYh6VqEC80XcSallgnyKuZd1ma5bo4iWramYvksRiFzsLaaMLz9nmoBmZ54Ol33BkVuz9RKXwpvDZQ==")
    assert hashlib.pbkdf2_hmac("sha512", b"secret", salt, 101)  # the scheme named in the hash
    # re-running keeps each node's password (nodes already provisioned are not locked out)
    first = {u: p.read_text() for u, p in write_logins(tmp_path, ["d0", "e0"]).items()}
    again = {u: p.read_text() for u, p in write_logins(tmp_path, ["d0", "e0", "cloud"]).items()}
    assert again["d0"] == first["d0"] and again["e0"] == first["e0"] and again["cloud"] != first["d0"]
    assert len((tmp_path / "broker.passwd").read_text().splitlines()) == 3


def test_a_login_cannot_take_another_nodes_connection_with_its_client_id(tmp_path: Path) -> None:
    # the broker.conf `data split --acl` writes binds each login to its client id: d0's login
    # connecting five times with edge e0's client id does not disconnect e0 (without that line
    # the broker hands e0's session to the intruder each time, and e0 has to reconnect)
    import time

    require_mosquitto("mosquitto")
    from splitedge.protocol.broker import free_port

    run, port = "bind-run", free_port()
    assert main(["data", "split", "--dataset", "digits", "--devices", "2", "--max-train", "100", "--out",
                 str(tmp_path / "shards"), "--acl", run, "--listener", f"127.0.0.1:{port}"]) == 0
    conf = (tmp_path / "shards" / "broker.conf").read_text()
    assert "use_username_as_clientid true" in conf and f"acl_file {tmp_path / 'shards' / 'broker.acl'}" in conf
    password = {u: (tmp_path / "shards" / "logins" / f"{u}.password").read_text().strip() for u in ("d0", "e0")}

    def edge_reconnects(config: str) -> int:
        # the fixture's own listener first, then broker.conf's (with its binding): the nodes use the latter
        with MosquittoBroker(extra_conf=config):
            url = lambda user: f"mqtt://{user}:{password[user]}@127.0.0.1:{port}"  # noqa: E731
            edge = MqttTransport(url("e0"), client_id=f"{run}-edge-e0", role="edge")
            try:
                for _ in range(5):
                    MqttTransport(url("d0"), client_id=f"{run}-edge-e0", role="device").close()
                    time.sleep(0.2)
                time.sleep(1.5)  # a dropped edge is back within its reconnect delay
                return edge.reconnects
            finally:
                edge.close()

    assert edge_reconnects(conf) == 0
    assert edge_reconnects(conf.replace("use_username_as_clientid true", "")) >= 1
