"""A cloud mod of one's own (runtime/mods, `--plugin edge_seconds:EdgeSeconds`): how long each
edge took to close the round's training phase and how many of its devices reported, from their
`done` records, in the round's record. It lives only in the tests."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from splitedge.protocol.done import dones
from splitedge.runtime.mods import Mod


class EdgeSeconds(Mod):
    tiers = ("cloud",)

    def __init__(self, cloud: Any) -> None:
        self.cloud, self.seen = cloud, {}

    def opened(self, plan: Any) -> list:
        if plan.phase == "train":
            self.seen = {}
        return []

    def phase_reports(self, plan: Any, reports: Sequence[Any]) -> None:
        if plan.phase == "train":
            self.seen = {e: [i.seconds, i.devices.reported if i.devices else 0] for e, i in dones(reports).items()}

    def record(self, plan: Any, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"edge_seconds": dict(self.seen)}
