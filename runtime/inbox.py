"""A node's inbox: what its transports' handlers hand the runtime thread, and the one warning of
an edge or device that hears nothing at all.

Transport handlers run on the network thread and must stay short, so they only put; the
runtime's own thread takes events off and does the work (training may take minutes).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from splitedge.protocol.codec import Envelope

log = logging.getLogger(__name__)

QUIET_WARN_S = 8.0
"""How long an edge or device may hear nothing at all before it says, once, what it waits for:
under a broker ACL a wrong --run is silence, not an error (the broker drops what it may not see)."""
WAITING_FOR = {"edge": "its devices' hellos and its cloud's round", "device": "its edge's round or its peers"}

IDLE_WAKE_S = 30.0
"""The longest a loop with nothing timed to do blocks on an empty inbox (idle_wait): a safety
net only, since a stop wakes it."""

WAKE: Any = ("", None)
"""What a stop puts in the inbox to wake a blocked loop; `get` hands back None for it."""


class Inbox:
    """Events (topic, envelope) in arrival order, for one node (`tier`, `node_id`, `run_id`)."""

    def __init__(self, tier: str, node_id: str, run_id: str, quiet_warn_s: float | None = QUIET_WARN_S) -> None:
        self.tier, self.node_id, self.run_id = tier, node_id, run_id
        self.queue: "queue.Queue[tuple[str, Envelope]]" = queue.Queue()
        self.quiet_since: float | None = 0.0  # 0 before the first wait, then its start; None once heard (or warned)
        self.quiet_warn_s = quiet_warn_s  # None: no such warning (a sim's own broker has no ACL)

    def put(self, topic: str, env: Envelope) -> None:
        self.queue.put((topic, env))

    def wake(self) -> None:
        """From any thread: a blocked `get` returns at once."""
        self.queue.put(WAKE)

    def empty(self) -> bool:
        return self.queue.empty()

    def get(self, timeout: float) -> tuple[str, Envelope] | None:
        """The next event, or None after `timeout` seconds (or when woken)."""
        try:
            event = self.queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            self._check_quiet()
            return None
        if event is WAKE:
            return None
        self.quiet_since = None
        return event

    def idle_wait(self, poll: float) -> float:
        """How long a loop with nothing timed to do may block: `poll` while the quiet warning may
        still come due, else IDLE_WAKE_S (a stop wakes it at once). Thousands of devices in one
        process each waking every `poll` seconds kept its cores busy switching threads: 10,000
        devices did not all start."""
        return poll if self.quiet_since is not None and self.quiet_warn_s is not None else IDLE_WAKE_S

    def _check_quiet(self) -> None:
        """One warning when an edge or device has received nothing QUIET_WARN_S after it started
        waiting, naming the run it uses: the usual cause is a --run that the broker's ACL does not
        grant (it defaults to "default"), which otherwise looks like waiting for ever."""
        if self.quiet_since is None or self.quiet_warn_s is None or self.tier not in WAITING_FOR:
            return
        now = time.monotonic()
        if not self.quiet_since:
            self.quiet_since = now
        elif now - self.quiet_since >= self.quiet_warn_s:
            self.quiet_since = None
            log.warning("%s %s: nothing received %.0f s after connecting; still waiting for %s (as expected while "
                        "they start). If it lasts: under a broker ACL (splitedge data split --acl) a login may use "
                        "only its run's topics: this %s uses run %r, and its --run must match the cloud's",
                        self.tier, self.node_id, self.quiet_warn_s, WAITING_FOR[self.tier], self.tier, self.run_id)
