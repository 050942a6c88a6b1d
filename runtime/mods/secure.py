"""Secure aggregation as mods (runtime/secure_sum.py holds the protocol): on a device, every
message its part declares summable goes only inside a secure sum; on an edge, the phase's secure
sums take the `secagg` exchanges, tick, hold the phase open while they collect, and hand their
summed statistics to the part as one report of the pseudo device `<edge>~sum`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from splitedge.methods.contract import Message, Method, RoundPlan
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo
from splitedge.protocol.errors import ProtocolError
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.mods import Mod
from splitedge.runtime.secure_sum import KIND, SecureSums, identity_of, secure_send, secured, unavailable

log = logging.getLogger(__name__)


def _on(method_or_cfg: Any) -> bool:
    cfg = getattr(method_or_cfg, "config", method_or_cfg)
    return getattr(cfg, "secagg", "off") != "off"


class DeviceSecureSum(Mod):
    """A device's summable messages (`DevicePart.secure_kinds`, head statistics) go through the
    secure sum's exchanges with its edge instead of being published; the raw DP release a
    statistics message was made from goes in its place when the devices share the noise."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.plan: RoundPlan | None = None

    def vet(self, method: Method) -> str | None:
        return unavailable() if _on(method) else None

    def opened(self, plan: RoundPlan) -> list[Message]:
        self.plan = plan  # its membership and session name each sum of the phase
        return []

    def send(self, msg: Message, call_next: Callable[[Message], None]) -> None:
        dev, part = self.device, self.device.part
        if not secured(part, msg):
            call_next(msg)
            return
        release = None if msg.kind == "weights" else part.pending_release  # distributed DP
        if release is not None:
            part.pending_release = None
        secure_send(msg, cfg=part.cfg, run=dev.run_id, session=dev.session, plan=self.plan, node_id=dev.node_id,
                    edge=dev.edge, num_classes=part.spec.num_classes, request=dev.exchange.request,
                    publish=dev.publish, moments_per=part.moments_per, release=release,
                    identity=identity_of(dev.transport))


class EdgeSecureSums(Mod):
    """An edge's secure sums of the open phase (with the run's secagg on)."""

    writes = ("secagg",)

    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.sums: SecureSums | None = None

    def opened(self, plan: RoundPlan) -> list[Message]:
        edge, cfg = self.edge, self.edge.part.cfg
        self.sums = None
        if not _on(cfg):
            return []
        missing = unavailable()
        if missing:  # its devices will say so too, each round
            log.error("edge %s: %s; this edge cannot sum securely", edge.node_id, missing)
            return []
        self.sums = SecureSums(edge.node_id, plan, cfg, edge.run_id, edge.session,
                               set(edge.roster.awaited_in(plan)), settled=lambda: set(edge.rounds.done),
                               announced=self._announced, identity=identity_of(edge.down))
        return []

    def receive(self, env: Envelope, call_next: Callable[[Envelope], None]) -> None:
        """One exchange of the phase's secure sum: refused and counted by rule when it does not
        fit (no sum open, another round, a malformed stage)."""
        if env.kind != KIND:
            call_next(env)
            return
        edge = self.edge
        if self.sums is None or env.round != edge.round:
            edge.refused["secagg.closed"] += 1
            return
        try:
            edge.publish_all(self.sums.on_message(env))
        except ProtocolError as exc:
            edge.refused[exc.rule] += 1
            log.warning("edge %s: refused secagg from %s [%s]: %s", edge.node_id, env.sender, exc.rule, exc)

    def ticking(self) -> bool:
        return self.sums is not None

    def tick(self) -> list[Message]:
        return self.sums.tick() if self.sums is not None else []

    def holds(self) -> bool:
        return self.sums is not None and self.sums.busy  # still collecting its last shares

    def reports(self, plan: RoundPlan) -> list[Any]:
        """The phase's secure sums as one report of the pseudo device `<edge>~sum`, each summed
        message after the checks a device's message gets, against its contributors' announced
        samples."""
        edge, merged = self.edge, None
        for report, contributors in (self.sums.reports(edge.run_id) if self.sums is not None else []):
            env = next(iter(report.messages.values()))[0]
            samples = self._announced(contributors)
            if not edge.accepts(edge.part, env, "child", announced=None if samples is None else Allowance(samples)):
                continue
            edge.part.on_device_message(env)
            merged = merged or report
            if merged is not report:
                merged.messages.setdefault(env.kind, []).append(env)
        return [merged] if merged is not None else []

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        return info.but(secagg=self.sums.info()) if self.sums is not None else info

    def closed(self, plan: RoundPlan) -> None:
        self.sums = None

    def _announced(self, devices: tuple[str, ...]) -> int | None:
        """The samples `devices` announced in their hellos, summed (None when one is unknown)."""
        held = [self.edge.roster.allowances.get(d) for d in devices]
        return sum(a.samples for a in held) if all(held) else None
