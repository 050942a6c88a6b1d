"""Helpers for tests that drive a method's parts directly (no runtime, no broker)."""

from __future__ import annotations

from typing import Any

import numpy as np

from splitedge.methods.config import ModelSpec
from splitedge.methods.registry import create_method, default_config
from splitedge.methods.contract import CloudContext, DeviceContext, EdgeContext, RoundPlan
from splitedge.protocol.codec import Envelope, decode, encode
from splitedge.methods.contract import RoundReport

SPEC = ModelSpec()  # cnn, 10 classes, 8x8x1 (digits)


def method_for(name: str, spec: ModelSpec = SPEC, **settings: Any) -> Any:
    """A Method instance with its defaults and `settings`, as a runtime builds it from a round."""
    return create_method(name, default_config(name, spec, **settings))


def device_ctx(name: str, node: str = "d0", *, spec: ModelSpec = SPEC, seed: int = 0, **settings: Any) -> DeviceContext:
    """A device's context for method `name`, unplaced, with the method's defaults and `settings`."""
    return DeviceContext(node_id=node, method=method_for(name, spec, **settings), rng=np.random.default_rng(seed))


def edge_ctx(name: str, node: str = "e0", *, spec: ModelSpec = SPEC, seed: int = 0, **settings: Any) -> EdgeContext:
    return EdgeContext(node_id=node, method=method_for(name, spec, **settings), rng=np.random.default_rng(seed))


def cloud_ctx(name: str, node: str = "cloud", *, spec: ModelSpec = SPEC, seed: int = 0, test: Any = None,
              rounds: int | None = None, **settings: Any) -> CloudContext:
    """The cloud's context for method `name`: an empty federation view, the test split and run length given."""
    return CloudContext(node_id=node, method=method_for(name, spec, **settings), rng=np.random.default_rng(seed),
                        test=test, rounds=rounds)


def plan_for(round_: int = 1, method: str = "x", *, versions: dict | None = None,
             directives: dict | None = None, phase: str = "train") -> RoundPlan:
    return RoundPlan(round=round_, method=method, deadline_s=10.0, config={}, versions=dict(versions or {}),
                     directives=dict(directives or {}), phase=phase)


def env(kind: str, body: dict, sender: str = "d0", round_: int = 1) -> Envelope:
    return Envelope(kind=kind, run="r", round=round_, sender=sender, body=body)


def wire(kind: str, body: dict, sender: str, round_: int = 1) -> Envelope:
    """Through the real codec, as a message would travel."""
    return decode(encode(env(kind, body, sender, round_)))


def report(sender: str, *envs: Envelope) -> RoundReport:
    r = RoundReport(sender)
    for e in envs:
        r.messages.setdefault(e.kind, []).append(e)
    return r


def shipped_methods() -> list[str]:
    """Registered methods, without those test modules register for themselves (named *-test)."""
    from splitedge.methods.registry import list_methods

    return [m for m in list_methods() if not m.endswith("-test")]
