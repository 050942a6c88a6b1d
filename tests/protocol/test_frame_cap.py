"""The per-frame size cap (--max-frame-bytes, SPLITEDGE_MAX_FRAME_BYTES): a receiver refuses and
counts a frame over its cap before parsing it, over a real broker; and the deploy/ brokers'
max_packet_size carries every frame the default cap accepts (Mosquitto 2.1 would otherwise
drop model messages above its own 2,000,000-byte default)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitedge.protocol import credentials
from splitedge.protocol.broker import MosquittoBroker
from splitedge.protocol.codec import DEFAULT_MAX_BYTES, Envelope, encode
from splitedge.runtime.session import connect
from splitedge.protocol.signing import TRAILER_LEN

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
RUN = "cap"
TOPIC = f"splitedge/{RUN}/device/d0/up/arrays"


def options(*argv: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--id", default="e0")
    credentials.add_arguments(p)
    return credentials.connect_options(p.parse_args(list(argv)), "mqtt://127.0.0.1:1883")


def record(n: int) -> Envelope:
    return Envelope(kind="arrays", run=RUN, round=1, sender="d0",
                    body={"name": "x", "version": 0, "arrays": {"x": np.zeros(n, dtype=np.uint8)}})


def frame_of(size: int) -> bytes:
    """A valid frame of exactly `size` bytes (an arrays record padded to fit), over the default
    cap too (the encoder refuses those unless told the receiver's cap is larger)."""
    payload = encode(record(size), max_bytes=2 * size)
    payload = encode(record(2 * size - len(payload)), max_bytes=size)
    assert len(payload) == size
    return payload


def test_the_cap_comes_from_the_flag_then_the_environment_then_the_default(monkeypatch) -> None:
    assert options()["max_bytes"] == DEFAULT_MAX_BYTES
    monkeypatch.setenv("SPLITEDGE_MAX_FRAME_BYTES", "5000")
    assert options()["max_bytes"] == 5000
    assert options("--max-frame-bytes", "6000")["max_bytes"] == 6000
    with pytest.raises(ValueError, match="at least 1024"):
        options("--max-frame-bytes", "100")
    monkeypatch.setenv("SPLITEDGE_MAX_FRAME_BYTES", "64MB")
    with pytest.raises(ValueError, match="SPLITEDGE_MAX_FRAME_BYTES='64MB': not an integer"):
        options()


def test_a_frame_over_the_receivers_cap_is_refused_and_counted_over_a_real_broker(mosquitto) -> None:
    # Prepare: an edge that accepts 8 KiB frames (as `--max-frame-bytes 8192` gives it)
    got: list[int] = []
    edge = connect(mosquitto.url, run=RUN, tier="edge", node_id="e0", **options("--max-frame-bytes", "8192"))
    device = connect(mosquitto.url, run=RUN, tier="device", node_id="d0")
    try:
        edge.subscribe(f"splitedge/{RUN}/device/+/up/#", lambda t, e: got.append(e.body["arrays"]["x"].size))
        # Execute: a frame of exactly the cap, one a byte over it, then a small one
        device.publish_raw(TOPIC, frame_of(8192), wait=5)
        device.publish_raw(TOPIC, frame_of(8193), wait=5)
        device.publish(TOPIC, record(10), wait=5)
        # Assert: the one over the cap never reached the handler, and is counted by its rule
        assert edge.wait_for(lambda: 10 in got, 10), got
        assert len(got) == 2 and got[-1] == 10
        assert edge.rejected == {"frame.too_large": 1}
        assert edge.counters.snapshot()["in"]["arrays"]["payload"] == 8192 + 8193 + len(encode(record(10)))
    finally:
        device.close()
        edge.close()


def max_packet_size(conf: Path) -> int:
    sizes = re.findall(r"^max_packet_size\s+(\d+)\s*$", conf.read_text(), flags=re.M)
    assert len(sizes) == 1, f"{conf.name}: one max_packet_size line expected, found {sizes}"
    return int(sizes[0])


@pytest.mark.parametrize("conf", ["cloud.conf", "edge-site.conf"])
def test_deploy_brokers_carry_every_frame_the_default_cap_accepts(conf: str) -> None:
    size = max_packet_size(DEPLOY / conf)
    # a PUBLISH: fixed header (<= 5 bytes), topic (2 + <= 1 KiB here), packet id 2, signed frame
    needed = 5 + 2 + 1024 + 2 + DEFAULT_MAX_BYTES + TRAILER_LEN
    assert needed <= size <= DEFAULT_MAX_BYTES + 2 * 1024 * 1024, (conf, size, needed)


def test_a_frame_of_the_default_cap_crosses_a_broker_configured_like_deploy(mosquitto_binary) -> None:
    size = max_packet_size(DEPLOY / "edge-site.conf")
    got: list[int] = []
    with MosquittoBroker(extra_conf=f"max_packet_size {size}\n") as broker:
        edge = connect(broker.url, run=RUN, tier="edge", node_id="e0")
        device = connect(broker.url, run=RUN, tier="device", node_id="d0")
        try:
            edge.subscribe(f"splitedge/{RUN}/device/+/up/#", lambda t, e: got.append(e.body["arrays"]["x"].size))
            device.publish_raw(TOPIC, frame_of(DEFAULT_MAX_BYTES), wait=30)
            device.publish_raw(TOPIC, frame_of(DEFAULT_MAX_BYTES + 1), wait=30)  # the broker passes it ...
            device.publish(TOPIC, record(10), wait=5)
            assert edge.wait_for(lambda: 10 in got, 30), got
        finally:
            device.close()
            edge.close()
    assert len(got) == 2 and got[0] > DEFAULT_MAX_BYTES - 200  # ... and the receiver's cap refuses it
    assert edge.rejected == {"frame.too_large": 1}
