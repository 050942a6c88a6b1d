"""Devices driven by hand on a real broker, for what a hostile or broken peer can do (the
poison bench, and tests): each joins edge `parent` like a device (retained hello and online
status) and hands each round its edge opens (not the stop) to `on_round`, which says what the
peer sends. numpy, the wire and the thin device's own graphs only."""

from __future__ import annotations

import numpy as np

from splitedge.methods.checks import MAX_ABS_WEIGHT
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import pattern, topic
from splitedge.runtime.rounds import done_phase
from splitedge.runtime.session import connect


class RogueDevice:
    def __init__(self, url: str, run: str, *, node_id: str = "d9", parent: str = "e0", samples: int = 100,
                 classes: int = 10, backend: str = "torch") -> None:
        self.run, self.node_id, self.parent = run, node_id, parent
        self.t = connect(url, run=run, tier="device", node_id=node_id)
        self.say("hello", {"role": "device", "parent": parent, "samples": samples, "backend": backend,
                           "classes": np.arange(classes, dtype=np.int64)}, 0, retain=True)
        self.say("status", {"state": "online", "role": "device"}, 0, retain=True)
        self.t.subscribe(pattern(run, "edge", parent, "down", "round"), self._round)

    def say(self, kind: str, body: dict, round_: int, retain: bool = False) -> None:
        env = Envelope(kind=kind, run=self.run, round=round_, sender=self.node_id, body=body)
        to = self.parent if kind == "hello" else None  # a device's hello is addressed to its edge
        self.t.publish(topic(self.run, "device", self.node_id, "up", kind, to), env, retain=retain)

    def listen(self, slot: str, handler) -> None:
        """Also take what the edge sends its devices on `slot` (e.g. "weights-model")."""
        self.t.subscribe(pattern(self.run, "edge", self.parent, "down", slot), handler)

    def _round(self, _topic: str, env: Envelope) -> None:
        if not env.body.get("stop"):
            self.on_round(env)

    def on_round(self, env: Envelope) -> None:
        """One round (or calibration phase) opened: send what this peer sends, then its `done`."""

    def close(self) -> None:
        self.t.close()


class ScaledWeights(RogueDevice):
    """Sends, every round, the global model it was sent times `factor` as its update, each value
    clipped to 0.9 of the absolute bound (so no check refuses it at first), for the version the
    round trains from; then `done`. A model-averaging method's device (FedAvg's "model" part)."""

    def __init__(self, url: str, run: str, *, factor: float = 100.0, samples: int = 150, **kw) -> None:
        self.factor, self.samples = factor, samples
        self.model: tuple[int, dict] | None = None
        self.sent = 0
        super().__init__(url, run, samples=samples, **kw)
        self.listen("weights-model", self.on_model)

    def on_model(self, _topic: str, env: Envelope) -> None:
        self.model = (int(env.body["version"]), env.body["weights"])

    def on_round(self, env: Envelope) -> None:
        version = int(env.body["versions"].get("model", -1))
        if self.model is not None and self.model[0] == version:
            bound = 0.9 * MAX_ABS_WEIGHT
            weights = {k: np.clip(v * self.factor, -bound, bound).astype(v.dtype) if v.dtype.kind == "f" else v
                       for k, v in self.model[1].items()}
            self.say("weights", {"part": "model", "version": version, "samples": self.samples, "weights": weights},
                     env.round)
            self.sent += 1
        self.say("done", {"phase": done_phase(env.body.get("phase") or ""), "info": {}}, env.round)


class ScaledMoments(RogueDevice):
    """An H-SFP device whose statistics are scaled: it computes the moments of its own images
    (digits, `samples` of them) through the W_c its edge relays, as an honest thin device does,
    then sends each class mean times `factor` (and the variance times factor^2: a device whose
    features all came out `factor` times larger), for the W_c version the round names; then
    `done`. Every value stays finite and inside the schema, so only a merge rule can hold it."""

    def __init__(self, url: str, run: str, *, factor: float = 100.0, samples: int = 150, **kw) -> None:
        from splitedge.methods.data.datasets import load_dataset

        (x, y), _, _ = load_dataset("digits")
        pick = np.random.default_rng(9).choice(len(y), size=samples, replace=False)
        self.data, self.factor = (x[pick], y[pick]), factor
        self.wc: tuple[int, dict] | None = None
        self.graph = None
        self.sent = 0
        super().__init__(url, run, samples=samples, **kw)
        self.listen("weights-wc", self.on_wc)

    def on_wc(self, _topic: str, env: Envelope) -> None:
        self.wc = (int(env.body["version"]), env.body["weights"])

    def on_round(self, env: Envelope) -> None:
        from splitedge.methods.config import ModelSpec, from_wire
        from splitedge.methods.data.preprocess import accumulate
        from splitedge.methods.moments import MomentAccumulator, moments_to_body
        from splitedge.methods.thin.graphs import wc_graph

        version = int(env.body["versions"].get("wc", -1))
        if self.wc is not None and self.wc[0] == version and env.body.get("phase", "train") == "train":
            spec = from_wire(ModelSpec, env.body["config"]["model"])
            self.graph = self.graph or wc_graph(spec.model, spec.channels)
            self.graph.load_weights(self.wc[1])
            m = accumulate(self.graph.features, self.data, spec.mean, spec.std, MomentAccumulator, 16)
            body = moments_to_body(m, space="wc", versions={"wc": version})
            body["mean"] = (body["mean"] * self.factor).astype(body["mean"].dtype)
            body["var"] = (body["var"] * self.factor ** 2).astype(body["var"].dtype)
            self.say("moments", body, env.round)
            self.sent += 1
        self.say("done", {"phase": done_phase(env.body.get("phase") or ""), "info": {}}, env.round)


ATTACKS = {"scale-weights": ScaledWeights, "scale-moments": ScaledMoments}
"""The poison bench's attacks by name."""
