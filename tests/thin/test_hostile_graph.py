"""A hostile edge (or a stranger on an open broker) sends thin devices a graph: it is refused at
the device, counted, and the device's rounds go on. The wire carries weights, never graphs.

On Mosquitto, unsigned, H-SFP on digits with two thin devices: at every round an impostor
publishes on the edge's own downlink, under the edge's id, (1) a W_c `weights` message whose
values are the bytes of an ONNX graph, (2) the `onnx_model` kind of earlier releases, and (3) a
weight map with W_c's names but an inflated shape. Each is refused by the thin devices before it
touches their state (schema, unknown kind, state.weights), counted in the run's `rejected`, and
every round closes on quorum with the accuracy of an undisturbed run.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import paho.mqtt.client as mqtt
import pytest
import torch

from splitedge.models import create_split, state_to_numpy
from splitedge.protocol.codec import Envelope, decode, encode
from splitedge.protocol.topics import pattern, topic
from splitedge.sim import SimSettings, run_sim

RUN = "hostile-graph"


class Impostor:
    """Publishes as edge e0 on its downlink whenever e0 opens a round (not the stop)."""

    def __init__(self, url: str, graph: bytes, wc: dict) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.graph, self.wc, self.sent, self.lock = graph, wc, 0, threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="impostor")
        self.client.on_message = self._on_round
        self.client.connect(host, int(port))
        self.client.subscribe(pattern(RUN, "edge", "e0", "down", "round"), qos=1)
        self.client.loop_start()

    def _say(self, kind: str, slot: str, body: dict, round_: int) -> None:
        env = Envelope(kind=kind, run=RUN, round=round_, sender="e0", body=body)
        self.client.publish(topic(RUN, "edge", "e0", "down", f"{kind}-{slot}"), encode(env, validate=False), qos=1)

    def _on_round(self, client, userdata, msg) -> None:
        env = decode(msg.payload)
        if env.body.get("stop") or env.body.get("phase", "train") != "train":
            return
        r, version = env.round, 1000 + env.round
        self._say("weights", "wc", {"part": "wc", "version": version, "samples": 0,
                                    "weights": {"block1.conv.weight": self.graph}}, r)
        self._say("onnx_model", "wc", {"part": "wc", "version": version, "model": self.graph, "sha256": "0" * 64}, r)
        inflated = {k: (np.zeros((v.shape[0] * 64, *v.shape[1:]), v.dtype) if k.endswith("conv.weight") else v)
                    for k, v in self.wc.items()}
        self._say("weights", "wc", {"part": "wc", "version": version, "samples": 0, "weights": inflated}, r)
        with self.lock:
            self.sent += 3

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_a_graph_from_a_hostile_edge_is_refused_and_the_rounds_go_on(mosquitto, tmp_path):
    from splitedge.exporters.onnx_export import export_module

    split = create_split("cnn", num_classes=10, in_channels=1, image_size=8)
    graph = export_module(split.wc, (1, 8, 8), part="wc").SerializeToString()
    settings = dict(rounds=3, devices=2, edges=1, broker=mosquitto.url, backends=("onnx",), max_train=400,
                    max_test=300, overrides={"ic": 2})
    clean = run_sim(SimSettings(run=RUN + "-clean", out=tmp_path / "clean", **settings))
    impostor = Impostor(mosquitto.url, graph, state_to_numpy(split.wc))
    try:
        hit = run_sim(SimSettings(run=RUN, out=tmp_path / "hit", **settings))
    finally:
        impostor.close()
    assert impostor.sent >= 3 * 3
    assert hit["closed_on_quorum"] and len(hit["accuracy_per_round"]) == 3
    assert hit["accuracy_per_round"] == clean["accuracy_per_round"]  # nothing reached the devices' state
    rounds = [json.loads(line) for line in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines()]
    refused = rounds[-1]["rejected"]["devices"]  # summed over the devices, each counting since it started
    # both devices, in at least the first two rounds (the third's may come after their last `done`):
    # frames that fail to decode are counted on arrival, on the network thread
    assert refused.get("envelope.kind_unknown", 0) >= 2 * 2, rounds[-1]["rejected"]
    assert refused.get("schema.type", 0) >= 2 * 2, refused
    # a decoded map that does not fit is refused on the device's own thread, after the round it
    # arrived in, so the last `done` may count fewer rounds of it: at least one round's worth
    assert refused.get("state.weights", 0) >= 2, refused
