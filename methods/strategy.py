"""The strategy interface: a learning method is one part per tier; the runtimes own the loop.

A runtime (device, edge, cloud) owns messaging, rounds, deadlines and persistence. Each round it
calls hooks of the active method's part for its tier and publishes whatever the hooks return.
Parts never see MQTT: they receive decoded `Envelope`s and return `Message`s. This module is
torch-free so that a thin device can import it.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from splitedge.protocol.rounds import RoundReport


@dataclass(frozen=True)
class Message:
    """Something a strategy wants sent; the runtime adds envelope, topic and QoS.

    `topic_kind` lets parts of one kind keep separate retained messages (e.g. "weights-wc").
    `target` addresses one child node (a device) instead of all children.
    """

    kind: str
    body: Mapping[str, Any]
    retain: bool = False
    topic_kind: str | None = None
    target: str | None = None


DONE = object()
"""Yielded by a device part when the edge may close the device's round; later work is local."""


@dataclass(frozen=True)
class RoundPlan:
    """What the cloud announces for round r (body of the `round` message)."""

    round: int
    method: str
    slow_wc: bool
    slow_we: bool
    deadline_s: float
    wc_version: int
    we_version: int
    config: Mapping[str, Any]

    def to_body(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body.pop("round")
        body["config"] = dict(self.config)
        return body

    @classmethod
    def from_body(cls, round_: int, body: Mapping[str, Any]) -> "RoundPlan":
        return cls(round=round_, method=body["method"], slow_wc=body["slow_wc"], slow_we=body["slow_we"],
                   deadline_s=body["deadline_s"], wc_version=body["wc_version"],
                   we_version=body["we_version"], config=dict(body["config"]))

    @property
    def stop(self) -> bool:
        return bool(self.config.get("stop", False))


@dataclass
class NodeContext:
    """What a part knows about where it runs."""

    node_id: str
    config: Mapping[str, Any]
    rng: np.random.Generator
    extra: dict[str, Any] = field(default_factory=dict)


Report = RoundReport
"""All messages one child sent for a round, by kind (the last one of each kind wins)."""


class DevicePart(abc.ABC):
    """Device side of a method: local training and the statistics it sends up."""

    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        self.ctx, self.data, self.backend = ctx, data, backend

    def ready(self, plan: RoundPlan) -> bool:
        """True when every model this round needs has arrived (e.g. the initial W_c)."""
        return True

    @abc.abstractmethod
    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        """Do the round's work; yield messages to send up, and DONE once the round may close."""

    def on_message(self, env: Any) -> None:
        """A message from the edge (e.g. averaged weights)."""

    def round_info(self) -> dict[str, Any]:
        """Scalars for the info of this round's `done` (e.g. personalised accuracy); read at DONE."""
        return {}


class EdgePart(abc.ABC):
    """Edge side: merge what devices sent, train, report upward."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    def ready(self, plan: RoundPlan) -> bool:
        return True

    @abc.abstractmethod
    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        """Called when the round closes (quorum or deadline); returns messages for the cloud."""

    def on_message(self, env: Any) -> list[Message]:
        """A message from the cloud; returns messages to relay down to devices."""
        return []

    def on_device_message(self, env: Any) -> list[Message]:
        """A device message the part handles at once (e.g. SplitFed activations); returns replies."""
        return []

    def round_info(self) -> dict[str, Any]:
        """Scalars merged into the edge's `done` info after `aggregate` (e.g. merged device metrics)."""
        return {}

    def on_round_open(self, plan: RoundPlan, members: set[str]) -> list[Message]:
        """Before the round is relayed down: messages for devices (e.g. ask one to resend its state)."""
        return []


class CloudPart(abc.ABC):
    """Cloud side: schedule, merge edge reports, train the head, evaluate, publish models."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    def initial_messages(self) -> list[Message]:
        """Models every node needs before round 1 (published retained)."""
        return []

    def on_edge_message(self, env: Any) -> None:
        """Every message from an edge as it arrives, whatever round it belongs to (state such as
        moments must not be lost because it came after its round closed)."""

    @abc.abstractmethod
    def plan(self, round_: int) -> RoundPlan:
        """The announcement for round `round_`."""

    @abc.abstractmethod
    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        """Close the round: returns (messages down, metrics such as accuracy)."""

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The served global model as a flat name -> array map (saved without pickle)."""
        return {}


class Method:
    """A registered learning method: a typed config and, per tier, where its part lives.

    `parts` maps "device:<backend>" (or "device" for any backend), "edge" and "cloud" to
    "module:Class". A part's module is imported only when that part is built, so looking a
    method up (and running its thin device part) never imports torch.
    """

    name: str = ""
    Config: type = object
    parts: Mapping[str, str] = {}
    personalised: bool = False
    """True when the reported accuracy is each device's own model on its own held-out data
    (FedProto), which is not comparable with a global model's test accuracy."""

    @classmethod
    def _part_class(cls, key: str) -> Any:
        module, attr = cls.parts[key].split(":")
        return getattr(importlib.import_module(module), attr)

    @classmethod
    def device_part(cls, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart:
        key = f"device:{backend}" if f"device:{backend}" in cls.parts else "device"
        if key not in cls.parts:
            backends = sorted(k.split(":", 1)[1] for k in cls.parts if k.startswith("device:"))
            raise ValueError(f"{cls.name} has no device part for backend {backend!r}; it runs on {backends}")
        return cls._part_class(key)(ctx, data, backend)

    @classmethod
    def edge_part(cls, ctx: NodeContext) -> EdgePart:
        return cls._part_class("edge")(ctx)

    @classmethod
    def cloud_part(cls, ctx: NodeContext) -> CloudPart:
        return cls._part_class("cloud")(ctx)
