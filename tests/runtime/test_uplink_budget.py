"""What leaves a device is its owner's to bound (issue 57): `splitedge device --max-up-bytes`
charges every message a round sends up before it leaves; one that would pass the budget is not
sent and the round fails in one line, the edge counting it; every round logs what it sent up."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import numpy as np
import pytest

from splitedge.runtime import uplink
from splitedge.runtime.guard import OverBudget
from splitedge.runtime.uplink import UplinkBudget, payload_bytes

from federation import Federation


def test_a_message_past_the_budget_is_refused_before_it_leaves():
    budget = UplinkBudget(max_bytes=10_000, who="device d0")
    budget.start("device d0 round 2")
    small = {"part": "wc", "weights": {"w": np.zeros(1000, np.float32)}}  # about 4 KB
    budget.charge("weights", small)
    budget.charge("done", {"phase": "round", "info": {"x": np.zeros(10_000)}})  # the runtime's own word: free
    with pytest.raises(OverBudget) as refused:
        budget.charge("moments", {"mean": np.zeros((2, 1000), np.float32)})  # 8 KB more
    text = str(refused.value)
    assert refused.value.reason == "uplink" and "\n" not in text
    assert "round 2: a moments message of" in text and "over its budget of 10,000" in text and uplink.FLAG in text
    assert budget.spent == payload_bytes(small) and budget.summary().startswith("sent up 4,")
    budget.start("device d0 round 3")
    assert budget.spent == 0 and budget.summary() == "sent up nothing but its done"


def test_the_charge_follows_the_bytes_on_the_wire():
    from splitedge.protocol.codec import Envelope, encode

    body = {"part": "wc", "version": 3, "samples": 120,
            "weights": {f"layer{i}.weight": np.ones((32, 16, 3, 3), np.float32) for i in range(4)}}
    wire = len(encode(Envelope(kind="weights", run="r", round=1, sender="d0", body=body)))
    assert abs(payload_bytes(body) - wire) < 0.02 * wire


def test_flags():
    p = argparse.ArgumentParser()
    uplink.add_arguments(p)
    assert UplinkBudget.from_args(p.parse_args([]), "device d0").max_bytes is None
    assert UplinkBudget.from_args(p.parse_args(["--max-up-bytes", "5000"]), "device d0").max_bytes == 5000
    with pytest.raises(ValueError, match="--max-up-bytes must be > 0"):
        UplinkBudget.from_args(p.parse_args(["--max-up-bytes", "0"]), "device d0")


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_device_over_its_uplink_budget_sends_nothing_past_it_and_its_edge_counts_it(tmp_path: Path):
    """Processes on Mosquitto, FedAvg on digits: d1's budget is below one model update, so each
    of its rounds fails in one line before the update leaves; no weights of d1 reach the broker,
    the edge counts it (`uplink`), d0's rounds go on."""
    from splitedge.protocol.broker import MosquittoBroker
    from splitedge.protocol.mqtt import MqttTransport
    from splitedge.protocol.topics import pattern

    seen: list[str] = []
    lock = threading.Lock()

    def record(topic, env):
        with lock:
            seen.append(env.sender)

    with MosquittoBroker() as broker:
        observer = MqttTransport(broker.url, client_id="uplink-observer", role="observer")
        observer.subscribe(pattern("itest", "device", "+", "up", "weights"), record)
        fed = Federation(tmp_path, broker.url, edges=1, devices=2, rounds=2, extra=["--method", "fedavg"],
                         node_extra={"d1": ["--max-up-bytes", "20000"]})
        try:
            fed.wait(timeout=600)
            metrics, logs = fed.metrics(), {n: (tmp_path / f"{n}.log").read_text() for n in ("d0", "d1", "e0")}
        finally:
            fed.close()
            observer.close()
    assert [r["round"] for r in metrics] == [1, 2], fed.logs()
    assert all(r.get("failures") == {"uplink": 1} for r in metrics), metrics
    with lock:
        assert "d1" not in seen and seen.count("d0") == 2, seen
    refusals = [line for line in logs["d1"].splitlines() if "over its budget of 20,000" in line]
    assert len(refusals) == 2 and all(uplink.FLAG in line for line in refusals), logs["d1"]
    assert "round 2 done in" in logs["d0"] and "sent up" in logs["d0"]
    assert "uplink budget 20,000 bytes a round" in logs["d1"]
