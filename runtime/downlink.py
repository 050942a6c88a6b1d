"""Compressed models on the downlink: a slot's model as a delta against a base every node holds.

Every round the cloud sends each device the whole global model (FedAvg's 2.5 MB of `fedcnn`
down, against 0.06 MB up with top-k updates: bench/results/thin-fedavg-fedcnn-10dev). With
`downlink_codec` int8 or topk, a model the cloud sends to every device in a slot travels as:

- a **base**, the dense model, retained in the slot `<slot>_base`, every `downlink_base_every`
  versions (and first); its body names itself as the base (`base` = its version);
- each version, in the slot itself (retained), the model's distance from that base
  compressed with methods/update_codec.py's int8 or top-k (`codec`, `base`); at a base version
  the distance is nothing (`codec` "base": the model is the base).

So a node that joins late, or restarts, finds the base and the latest delta retained and
decodes the current model from them; it never needs a delta it missed. The cloud keeps what the
codec left out (error feedback, as a device does on its uplink): the next version's distance
includes it, and the next base carries the model whole. What nodes hold is the base plus the
decoded distance; the cloud part's own model is the merge of what devices trained from it.

Receiving nodes decode in their inbound chain (runtime/inbound.py, `unpack_update`): a base is
kept (one per part), a delta is decoded against the base it names before the part sees it, so
parts only ever see dense models. Retained messages of two topics come in either order: a delta
that comes before its base waits, and the base brings it along (the part sees the newer model);
a delta older than the base held is dropped. Arrays that do not fit the base are refused by rule
and counted.
Deterministic (int8's rounding draws from a generator seeded by the run and the version), so a
restarted cloud that publishes its committed outbox again sends the same bytes.
numpy only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import numpy as np

from splitedge.methods.contract import Message
from splitedge.methods.update_codec import CODECS, UpdateEncoder, decode_update
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

BASE_SLOT = "{slot}_base"
"""The slot a base is retained in, beside the slot of the model itself."""
BASE_CODEC = "base"
"""A version that is its base: no arrays, the model is the base the node holds."""


def base_slot(slot: str) -> str:
    return BASE_SLOT.format(slot=slot)


def _dense(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in weights.items()}


class SlotCoder:
    """One slot's side at the cloud: its base (version and dense model) and the encoder whose
    residual is what the codec has not sent yet."""

    def __init__(self, codec: str, share: float) -> None:
        self.encoder = UpdateEncoder(codec, share)
        self.base_version = -1
        self.base: dict[str, np.ndarray] = {}
        self.fields: dict[str, Any] = {}  # the base message's other fields (part, samples, ...)

    def fits(self, weights: Mapping[str, np.ndarray]) -> bool:
        return set(weights) == set(self.base) and all(np.shape(weights[k]) == self.base[k].shape for k in weights)


class DownlinkEncoder:
    """The cloud's downlink codec: `encode(message)` gives what to publish instead. Only a
    `weights` message to every device in a slot is coded; anything else passes as it is."""

    def __init__(self, codec: str = "none", share: float = 0.01, base_every: int = 10, seed: int = 0) -> None:
        if codec not in CODECS or not 0 < share <= 1 or base_every < 1:
            raise ValueError(f"downlink_codec must be one of {', '.join(CODECS)}, downlink_topk in (0, 1] and "
                             f"downlink_base_every >= 1, got {codec!r}, {share} and {base_every}")
        self.codec, self.share, self.base_every, self.seed = codec, float(share), int(base_every), int(seed)
        self.slots: dict[str, SlotCoder] = {}
        self.sent: dict[str, dict[str, np.ndarray]] = {}  # slot -> the model nodes decode from the last message

    @classmethod
    def of(cls, cfg: Any, seed: int = 0) -> "DownlinkEncoder":
        return cls(getattr(cfg, "downlink_codec", "none"), getattr(cfg, "downlink_topk", 0.01),
                   getattr(cfg, "downlink_base_every", 10), seed)

    def codes(self, msg: Any) -> bool:
        return self.codec != "none" and msg.kind == "weights" and msg.to.role == "devices" and msg.slot is not None \
            and (msg.body.get("codec") or "dense") == "dense"

    def encode(self, msg: Any) -> list[Any]:
        """The messages that stand for `msg`: its base (when due) and its coded form."""
        if not self.codes(msg):
            return [msg]
        body, slot = msg.body, msg.slot
        coder = self.slots.setdefault(slot, SlotCoder(self.codec, self.share))
        version, weights = int(body["version"]), body["weights"]
        fresh = coder.base_version < 0 or version - coder.base_version >= self.base_every or not coder.fits(weights) \
            or version < coder.base_version
        if fresh:  # the model whole, with what the codec had left out: nodes hold it exactly
            target = {k: (np.asarray(v, np.float32) + coder.encoder.residual[k]).astype(np.asarray(v).dtype)
                      if k in coder.encoder.residual else np.array(v, copy=True) for k, v in weights.items()}
            coder.base_version, coder.base, coder.encoder.residual = version, _dense(target), {}
            coder.fields = {k: v for k, v in body.items() if k not in ("weights", "session")}
            base = {**body, "weights": target, "base": version}
            pointer = {k: v for k, v in body.items() if k != "weights"}
            pointer.update(weights={}, codec=BASE_CODEC, base=version)
            self.sent[slot] = coder.base  # read only, as the base itself
            return [dataclasses.replace(msg, body=base, slot=base_slot(slot)), dataclasses.replace(msg, body=pointer)]
        rng = np.random.default_rng([self.seed, version, sum(map(ord, slot))])
        coded = coder.encoder.encode(weights, coder.base, rng)  # distance from the base, with the residual
        out = {**{k: v for k, v in body.items() if k != "weights"}, **coded, "base": coder.base_version}
        if self.codec == "int8":
            out.pop("indices", None)
        else:
            out.pop("scales", None)
        self.sent[slot] = decode_update(out, coder.base)
        return [dataclasses.replace(msg, body=out)]

    def held(self, slot: str) -> dict[str, np.ndarray] | None:
        """The model nodes hold after the last message of `slot` (the base plus the decoded
        distance), for a cloud part to adopt (CloudPart.adopt_sent): its evaluation, calibration
        and checkpoint are then of what devices train from and take head statistics of."""
        return self.sent.get(slot)

    def bases(self, to: Any) -> list[Message]:
        """Every slot's base as its message again (addressed `to`), for a cloud that restarted: a
        broker that restarted with it (an embedded one, or one without persistence) has lost
        the retained bases, and nodes that restarted too hold none."""
        return [Message("weights", {**c.fields, "weights": _dense(c.base), "base": c.base_version}, to=to,
                        slot=base_slot(slot)) for slot, c in sorted(self.slots.items()) if c.base_version >= 0]

    def state_dict(self) -> dict[str, Any]:
        return {slot: {"base_version": c.base_version, "base": _dense(c.base), "fields": dict(c.fields),
                       "residual": c.encoder.state_dict()["residual"]} for slot, c in self.slots.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.slots = {}
        for slot, s in dict(state).items():
            coder = SlotCoder(self.codec, self.share)
            coder.base_version, coder.base = int(s["base_version"]), _dense(s["base"])
            coder.fields = dict(s.get("fields") or {})
            coder.encoder.load_state_dict({"residual": s["residual"]})
            self.slots[slot] = coder


class DownlinkBases:
    """A receiving node's bases: the last base of each model part it was sent (part -> (version,
    weights)), which a delta from its parent decodes against, and the newest delta that came
    before its base (retained messages of two topics arrive in either order): the base then
    brings it along."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, dict[str, np.ndarray]]] = {}
        self.waiting: dict[str, dict[str, Any]] = {}

    def note(self, body: dict[str, Any]) -> None:
        """Keep a dense model that names itself as a base (its `base` is its version). When a
        delta of that base came first, `body` becomes that delta's model, decoded (the newer of
        the two) in place."""
        part, version = str(body.get("part")), int(body["version"])
        held = self.held.get(part)
        if held is not None and version < held[0]:
            return
        self.held[part] = (version, _dense(body["weights"]))
        early = self.waiting.pop(part, None)
        if early is None or int(early["base"]) != version or int(early["version"]) < version:
            return
        try:
            weights = self._decoded(early, self.held[part][1])
        except ProtocolError as exc:  # the base stands; only the early model is dropped
            log.warning("a %s model of %s v%s that came before its base does not fit it, dropped [%s]: %s",
                        early.get("codec"), part, early.get("version"), exc.rule, exc)
            return
        body.update(weights=weights, version=int(early["version"]), samples=early.get("samples", body.get("samples")))

    def decode(self, body: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """The dense model a delta stands for, or None when it cannot be yet (its base has not
        come: kept, the base brings it) or any more (the node holds a newer base: it is older
        than that base). ProtocolError naming the rule when its arrays do not fit the base."""
        part, base = str(body.get("part")), body.get("base")
        if base is None:  # a compressed model from a parent is a downlink model: it names its base
            raise ProtocolError("state.codec", f"a {body.get('codec')} model of {part} from a parent names no base")
        held = self.held.get(part)
        if held is None or held[0] < int(base):
            waiting = self.waiting.get(part)
            if waiting is None or int(body["version"]) >= int(waiting["version"]):
                self.waiting[part] = dict(body)
            log.info("a %s model of %s v%s came before its base v%s: kept until the base comes", body.get("codec"),
                     part, body.get("version"), base)
            return None
        if held[0] > int(base):
            return None  # older than the base held (a retained delta the new base overtook)
        return self._decoded(body, held[1])

    @staticmethod
    def _decoded(body: Mapping[str, Any], base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if body.get("codec") == BASE_CODEC:
            if body.get("weights"):
                raise ProtocolError("state.weights", "a model that is its base carries no arrays")
            return _dense(base)
        return decode_update(body, base)


__all__ = ["DownlinkBases", "DownlinkEncoder", "base_slot"]
