"""An edge's ledger of its devices' differentially private releases (methods/privacy/floor.py):
each `done` adds what its device released, late ones included, and the edge's own `done` says
how much the most of one device grew (`devices.dp_releases`), what the cloud's accountant counts
(`Accounting`, the cloud's side)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from splitedge.methods.contract import RoundPlan
from splitedge.methods.privacy.accountant import privacy_spent
from splitedge.methods.privacy.floor import ReleaseLedger
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo, done_info
from splitedge.runtime.mods import Mod
from splitedge.runtime.records import phase_privacy

log = logging.getLogger(__name__)


class Releases(Mod):
    name = "dp_releases"  # its key in the edge's state file
    writes = ("devices.dp_releases",)

    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.ledger = ReleaseLedger()

    def receive(self, env: Envelope, call_next: Callable[[Envelope], None]) -> None:
        """A `done` that came after its phase closed (the round collector counts it stale): the
        releases it reports still count, in this edge's next `done`."""
        stale = self.edge.rounds.counts["stale"]
        call_next(env)
        if env.kind == "done" and self.edge.rounds.counts["stale"] > stale:
            before = self.ledger.made.get(env.sender, 0)
            self.ledger.add(env.sender, done_info(env.body.get("info")).dp_releases)
            made = self.ledger.made.get(env.sender, 0) - before
            if made:
                log.info("edge %s: device %s's done of round %d came after its phase closed; its %d DP release(s) "
                         "count in this edge's next done", self.edge.node_id, env.sender, env.round, made)

    def done(self, plan: RoundPlan, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        for dev, child in children.items():
            self.ledger.add(dev, child.dp_releases)
        grew = self.ledger.take()
        if not grew or info.devices is None:
            return info
        return info.but_devices(dp_releases=grew)

    def state(self) -> Any:
        return self.ledger.state()

    def restore(self, state: Any) -> None:
        self.ledger.restore(state)


class Accounting(Mod):
    """The cloud's side of the ledger: what a merged round's edges say of their devices' privacy
    (classes withheld, the most releases one device made, the secure sums: held with the round
    through a crash), and the record's epsilon composed over every release so far
    (accountant.privacy_spent)."""

    def __init__(self, cloud: Any) -> None:
        self.cloud = cloud

    def held(self, plan: RoundPlan, reports: Sequence[Any]) -> dict[str, Any]:
        return phase_privacy(reports)

    def record(self, plan: RoundPlan, metrics: Mapping[str, Any]) -> dict[str, Any]:
        history = self.cloud.committer.history
        return privacy_spent(self.cloud.method.config, history[-1] if history else {}, metrics)
