"""How a device works a phase of a round: its part's items through the mods (each message sent,
the round guard checking every item), its `done` once the part says so, and a `done` that says
the phase failed (with the releases it made) when it did not get that far. One status line.
"""

from __future__ import annotations

import time
from typing import Any

from splitedge.methods.contract import DONE, RoundPlan
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.guard import OverBudget
from splitedge.runtime.mods.budgets import phase_name
from splitedge.runtime.node import status
from splitedge.runtime.phases import device_info
from splitedge.runtime.rounds import done_phase


class Working:
    """A device's phases (`device`: its agent: part, mods, transport, host)."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def run(self, plan: RoundPlan) -> None:
        d = self.device
        d.round, d.last = plan.round, plan.key
        part = d.part  # what its statistics withhold and the DP releases it makes are counted afresh
        part.losses, part.pending_release, part.dp_releases, part.withheld = {}, None, 0, {}
        d.publish_all(d.mods.opened(plan))
        phase, sent_done, started, failed = done_phase(plan.phase), False, time.monotonic(), DoneInfo(failed=True)
        try:
            for item in d.mods.work(plan, part.run_round):
                if item is not DONE:
                    d.mods.send(item, d.publish)
                elif not sent_done:
                    d.send(d.transport, "up", "done", {"phase": phase, "info": self.done_info(plan).to_info()})
                    sent_done = True
                    d.completed += plan.phase == "train"
        except OverBudget as exc:  # over its memory ceiling or time budget: the edge counts why
            failed = failed.but(reason=exc.reason)
            raise
        finally:  # even a failed round tells the edge not to wait for us
            if not sent_done:  # what it released before failing counts too
                failed = failed.but(dp_releases=int(d.part.dp_releases or 0))
                d.send(d.transport, "up", "done", {"phase": phase, "info": failed.to_info()})
            d.mods.closed(plan)
            status.info("device %s: %s %s; %s", d.node_id, phase_name(plan),
                        f"done in {time.monotonic() - started:.1f} s" if sent_done else "failed (see the log)",
                        d.uplink.summary())
            d.host.end_round()

    def done_info(self, plan: RoundPlan) -> DoneInfo:
        """The phase's info: the part's own (runtime/phases.py), what it refused (before decoding
        too: its part's refusals and its transport's, by schema, kind and size) and the samples it
        holds; then its mods' entries (what the phase cost it, runtime/mods/costs.py), and with
        private reports only what they let through (runtime/mods/private.py, docs/privacy.md)."""
        d = self.device
        info = device_info(d.part, plan).but(samples=int(len(d.data[1])), refused=d.rejections([d.transport]))
        return d.mods.done(plan, info)
