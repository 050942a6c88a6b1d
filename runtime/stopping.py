"""What a node does with the run's stop announcement: the run finished (it stops), a retained stop
found before any round (it waits for a new run under the same id), or its cloud was interrupted
(it leaves to be restarted, or waits for the cloud to resume)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)
status = logging.getLogger("splitedge.status")

INTERRUPTED = "interrupted"
"""The stop directive of a cloud that was interrupted (Ctrl-C, SIGTERM): the last round it
finished. Nodes do not log the run as finished (`Stops.interrupted_after`)."""

EXIT_INTERRUPTED = 75
"""A node's exit status when its cloud was interrupted (EX_TEMPFAIL): not 0, so a unit with
Restart=on-failure starts it again to wait for the resumed cloud."""


class Stops:
    """A node's reading of stop announcements. `held`: what a node that found a stop before any
    round waits for ("new run", "resume"; None: nothing); `interrupted`: the round after which its
    cloud was interrupted (None: it was not)."""

    def __init__(self, node: Any) -> None:
        self.node = node  # its tier, id, run and `stopped` event
        self.held: str | None = None
        self.interrupted: int | None = None

    def hold(self, session: str) -> None:
        """A retained stop of a finished run before this node saw any round. A node cannot tell
        whether it came too late for that run or early for a new run under the same id (run ids
        are reused: the broker's ACL names them), so it waits for the new run: its cloud clears
        the old stop and announces its first round, which this node then takes part in, in
        whichever order the nodes started. Leaving instead (exit 0) left a systemd unit stopped
        for good and the new cloud waiting for nodes that had gone."""
        node = self.node
        if self.held != "new run":
            self.held = "new run"
            status.info("%s %s: run %s finished earlier (its stop, session %s, is retained); waiting for a new run "
                        "with this id: its cloud clears the stop and announces round 1 (Ctrl-C leaves)", node.tier,
                        node.node_id, node.run_id, session)

    def on_stop(self, plan: Any, *, started: bool, done: str) -> str | None:
        """A round announcement that is the run's stop: "finished" (the node stops), "held" (a
        retained stop found before any round: the node waits, see `hold`), "interrupted" (the
        cloud was interrupted: `interrupted_after`) or None (a round: any held stop is dropped).
        `done` ends the finished line (e.g. " after round 4")."""
        if not plan.stop:
            self.held = self.interrupted = None
            return None
        reason = plan.directives.get("reason")
        if INTERRUPTED in plan.directives:  # Ctrl-C or SIGTERM on the cloud: the run did not finish
            return self.interrupted_after(int(plan.directives[INTERRUPTED] or 0), started=started)
        if not started and not reason:
            self.hold(plan.session)  # the run is over, or a new one with this id is starting
            return "held"
        status.info("%s %s: run finished%s", self.node.tier, self.node.node_id, f": {reason}" if reason else done)
        self.node.stopped.set()
        return "finished"

    def interrupted_after(self, after: int, *, started: bool) -> str:
        """The cloud's stop after an interrupt (PROTOCOL.md, "The stop announcement"): a node
        that took part leaves with EXIT_INTERRUPTED (a unit with Restart=on-failure starts it
        again); one that finds it before any round (restarted, or started late) waits for the
        cloud to resume, which announces its next round on the same topic."""
        node, self.interrupted = self.node, after
        if not started:
            if self.held != "resume":
                self.held = "resume"  # the resumed cloud's round clears it
                status.info("%s %s: the cloud was interrupted after round %d; waiting for it to resume", node.tier,
                            node.node_id, after)
            return "held"
        status.info("%s %s: the cloud was interrupted after round %d (the run is not over); leaving with exit "
                    "status %d: restart this %s to take part when the cloud resumes (a unit with "
                    "Restart=on-failure does)", node.tier, node.node_id, after, EXIT_INTERRUPTED, node.tier)
        node.stopped.set()
        return "interrupted"
