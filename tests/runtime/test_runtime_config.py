"""Runtimes take the method's typed config from each round: parsed once, changed settings reach
the part (not silently ignored), a changed model rebuilds it, a config that does not parse is
refused and counted without stopping the node."""

from __future__ import annotations

import numpy as np

from parts import SPEC, env
from splitedge.device.agent import DeviceAgent
from splitedge.methods.config import RunConfig
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.contract import RoundPlan
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

TOPIC = "splitedge/r/edge/e0/down/round"


def announce(agent: DeviceAgent, round_: int, config: dict) -> None:
    plan = RoundPlan(round=round_, method="fedproto", deadline_s=10.0, config=config, versions={"protos": 99})
    agent.handle(TOPIC, env("round", plan.to_body(), "e0", round_))


def test_device_reconfigures_rebuilds_and_refuses_by_config() -> None:
    # Prepare: a FedProto device (its part waits for prototype v99, so no round runs here)
    x, y = np.zeros((10, 8, 8, 1), np.uint8), np.arange(10) % 3
    agent = DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                        edge="e0", data=(x, y))
    base = RunConfig(SPEC, FedProtoConfig())
    # Execute / Assert: round 1 builds the part with the announced settings
    announce(agent, 1, base.to_wire())
    part = agent.part
    assert part.cfg == FedProtoConfig() and part.opt.lr == 0.05
    # round 2 changes a setting: the same part takes it, down to its optimiser
    announce(agent, 2, RunConfig(SPEC, FedProtoConfig(device_lr=0.01)).to_wire())
    assert agent.part is part and part.cfg.device_lr == 0.01 and part.opt.lr == 0.01
    # round 3 announces another model: a new part
    other = RunConfig(SPEC.__class__(num_classes=5), FedProtoConfig(device_lr=0.01)).to_wire()
    announce(agent, 3, other)
    assert agent.part is not part and agent.part.spec.num_classes == 5
    # round 4's config does not parse: refused, counted, the node keeps its part
    kept = agent.part
    bad = {**other, "method": {**other["method"], "device_lr": "fast"}}
    announce(agent, 4, bad)
    assert agent.part is kept and agent.refused["config.invalid"] == 1 and agent.pending.round == 3
