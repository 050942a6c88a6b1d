"""`splitedge sim --broker-tree`: a Mosquitto per edge site bridged to a cloud Mosquitto, as
deploy/ runs it. The federation learns as on one broker, device traffic stays on its site
(the cloud broker carries only edges' and the cloud's messages) and every broker is counted,
with the devices in this process or in worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitedge.cli import main


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_sim_across_bridged_site_brokers_learns_as_on_one(tmp_path: Path, monkeypatch) -> None:
    from splitedge.sim.broker_tree import BrokerTree
    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.sim import SimSettings, run_sim

    # Prepare: a monitor on the cloud broker, from the moment the tree is up
    topics: set[str] = set()
    monitors = []
    enter = BrokerTree.__enter__

    def watched(self: BrokerTree) -> BrokerTree:
        tree = enter(self)
        monitors.append(MqttTransport(tree.cloud.url, client_id="cloud-monitor", role="observer"))
        monitors[-1]._client.on_message = lambda c, u, m: topics.add(m.topic)  # noqa: SLF001 - raw, every topic
        monitors[-1]._client.subscribe("splitedge/#", qos=1)  # noqa: SLF001
        return tree

    monkeypatch.setattr(BrokerTree, "__enter__", watched)
    # Execute: the same run on one embedded broker and across a tree of three sites
    common = dict(rounds=3, devices=6, edges=3, seed=0)
    flat = run_sim(SimSettings(**common, out=tmp_path / "flat"))
    tree = run_sim(SimSettings(**common, broker_tree=True, out=tmp_path / "tree"))
    spread = run_sim(SimSettings(**common, broker_tree=True, workers=2, out=tmp_path / "tree-workers"))
    for m in monitors:
        m.close()
    # Assert: same learning; each broker counted; the sites carry the device traffic
    assert tree["accuracy_per_round"] == flat["accuracy_per_round"]
    # ... with the devices in two worker processes, each device on its edge's site broker
    assert spread["accuracy_per_round"] == flat["accuracy_per_round"]
    assert all(spread["brokers"][f"site-e{e}"]["bytes_received"] > 0 for e in range(3)), spread["brokers"]
    brokers = tree["brokers"]
    assert set(brokers) == {"cloud", "site-e0", "site-e1", "site-e2"}
    assert all(b["bytes_received"] > 0 and b["messages_sent"] > 0 for b in brokers.values()), brokers
    device_up = tree["bytes"]["device"]["out_payload"]
    sites_in = sum(b["bytes_received"] for n, b in brokers.items() if n != "cloud")
    assert sites_in > device_up  # every device message entered its site broker ...
    assert any("/edge/" in t for t in topics) and not any("/device/" in t for t in topics), sorted(topics)[:20]


def test_broker_tree_refuses_what_it_cannot_run(capsys) -> None:
    assert main(["sim", "--broker-tree", "--method", "cflhkd"]) == 2
    assert "methods that move devices" in capsys.readouterr().err
    assert main(["sim", "--broker-tree", "--broker", "mqtt://127.0.0.1:1"]) == 2
    assert "drop --broker" in capsys.readouterr().err
