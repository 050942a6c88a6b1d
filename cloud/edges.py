"""The cloud's view of its federation: which edges joined (with the devices each lists), who is
online, who left saying why, where devices are placed, and the waits a run makes on them
(before round 1, before each round, after moving devices).

The round driver (cloud/driver.py) drives rounds; this holds the federation it drives them
over. Its waits take `pump(done, timeout)`, the coordinator's own event loop, so messages keep
being handled while they wait.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from splitedge.methods.contract import FederationView, Placement
from splitedge.protocol.codec import Envelope
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.node import status
from splitedge.runtime.stopping import EXIT_INTERRUPTED
from splitedge.runtime.presence import Presence

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 30.0  # how long a round waits for moved devices to show up at their new edge
Pump = Callable[[Callable[[], bool], float], None]
"""Handle messages until `done()` holds or `timeout` seconds pass."""
Assign = Callable[[str, dict[str, Any]], None]
"""Send device `d` its placement `body` (an `assign`, retained, through its current edge)."""


class CloudEdges:
    """Edges that said hello to this cloud (with the devices each lists), their presence, those
    that left the run saying why (not waited for until they come online again), and where each
    device is placed (`view`, the FederationView the cloud's part reads)."""

    def __init__(self, view: FederationView, settings: Any, pump: Pump, assign: Assign) -> None:
        self.view, self.settings, self.pump, self.assign = view, settings, pump, assign
        self.presence = Presence()  # which edges are online, and who went offline a moment ago
        self.left: dict[str, str] = {}  # node -> why it left the run (its `done`, or its edge's)
        self.enough = settings.min_edges  # lowered when edges stay away past the rejoin timeout

    # -- what edges say --------------------------------------------------------------------------
    def heard(self, env: Envelope, cloud: str) -> bool:
        """Take an edge's hello to `cloud` (its members) or its status; False for any other message."""
        if env.kind == "hello" and env.body["parent"] == cloud:
            self.hello(env.sender, env.body["members"])
        elif env.kind == "status":
            self.status(env.sender, env.body["state"])
        else:
            return False
        return True

    def hello(self, edge: str, members: list[str]) -> None:
        self.view.members[edge] = list(members)

    def status(self, edge: str, state: str) -> None:
        if self.presence.update(edge, state) and state == "online":
            self.left.pop(edge, None)  # back (restarted, its install fixed): waited for again

    def note_left(self, edge: str, info: DoneInfo) -> None:
        """An edge that left the run (its `done` says why), or the devices its `done` says left."""
        why = {edge: info.left} if info.left else {}
        why.update({f"{d} (edge {edge})": w for d, w in (info.devices.left if info.devices else {}).items()})
        for node, reason in why.items():
            if self.left.get(node) != reason:
                log.warning("cloud: %s left the run: %s", node, reason)
        self.left.update(why)

    def left_note(self) -> str:
        """`; <node> left: <why>` for the nodes that said why they left, for a stopping run's line."""
        return "".join(f"; {node} left: {why}" for node, why in sorted(self.left.items())[:3])

    # -- who is there ----------------------------------------------------------------------------
    @property
    def live(self) -> set[str]:
        """Edges that said hello to this cloud and whose last status is online, but for those
        that left the run saying why (until they come online again)."""
        return self.presence.live(self.view.members) - self.left.keys()

    @property
    def awaited(self) -> set[str]:
        """Edges a round waits for: online, or gone so recently they may be back (Presence); not
        one that left the run saying why."""
        return self.presence.awaited(self.view.members) - self.left.keys()

    def live_devices(self) -> int:
        return sum(len(self.view.members[e]) for e in self.live)

    def online_devices(self) -> set[str]:
        """The devices the live edges list as live: those a round may draw."""
        return {d for e in self.live for d in self.view.members[e]}

    # -- waits -----------------------------------------------------------------------------------
    def wait_for_edges(self, run: str, resumed_after: int | None) -> None:
        """Block until enough edges (and devices behind them, at least one: a round with nobody
        trains nothing) joined, or the join timeout."""
        s = self.settings
        devices = max(1, s.min_devices)
        deadline, shown = time.monotonic() + s.join_timeout_s, None
        status.info("cloud: %s, %d rounds (run %s); waiting for %d edge(s) and %d device(s)", s.method, s.rounds,
                    run, s.min_edges, devices)
        while time.monotonic() < deadline:
            joined = (len(self.live), self.live_devices())
            if joined != shown:
                status.info("cloud: %d/%d edge(s), %d/%d device(s) joined", *joined[:1], s.min_edges, joined[1], devices)
                shown = joined
            if joined[0] >= s.min_edges and joined[1] >= devices:
                return
            self.pump(lambda: (len(self.live), self.live_devices()) != joined, min(1.0, deadline - time.monotonic()))
        resumed = "" if resumed_after is None else (
            f"; this cloud resumes run {run} after round {resumed_after}: if it was interrupted (Ctrl-C, "
            f"SIGTERM), its stop told the edges and devices of that run so, and those that had taken part left (exit "
            f"status {EXIT_INTERRUPTED}) unless a unit with Restart=on-failure started them again: start them again")
        raise TimeoutError(f"only {len(self.live)} edge(s) with {self.live_devices()} device(s) joined within "
                           f"{s.join_timeout_s:.0f} s (waiting for {s.min_edges} and {devices}); are the edges "
                           f"and devices started with --run {run} and this broker? (if they are only slow to "
                           f"start, raise --join-timeout){resumed}")

    def wait_for_live_edges(self, r: int) -> None:
        """Before round r, with fewer live edges than the run needs, wait for them. With none
        live (a broker restart fires every node's will; the nodes are back within seconds) a
        round opened now would close at once with nobody in it: wait up to `rejoin_timeout_s`
        for one, else stop (TimeoutError). Then give the others `rejoin_grace_s`; an edge still
        missing is not waited for again (it died: rounds go on with the edges that are left)."""
        s = self.settings
        if len(self.live) >= self.enough:
            self.wait_for_a_device(r)
            return
        if not self.live:
            status.info("cloud: no edge online before round %d; waiting up to %.0f s for them to come back", r,
                        s.rejoin_timeout_s)
            self.pump(lambda: bool(self.live), s.rejoin_timeout_s)
            if not self.live:
                raise TimeoutError(f"no edge is online before round {r}, and none came back within "
                                   f"{s.rejoin_timeout_s:g} s (--rejoin-timeout); the run stops here, its rounds "
                                   f"so far are kept{self.left_note()}")
        self.pump(lambda: len(self.live) >= self.enough, s.rejoin_grace_s)
        if len(self.live) < self.enough:
            log.warning("cloud: round %d goes on with %d of %d edge(s)", r, len(self.live), self.enough)
            self.enough = len(self.live)
        self.wait_for_a_device(r)

    def wait_for_a_device(self, r: int) -> None:
        """Before round r, with no device online behind the live edges (each left, saying why in its
        own log: a backend the method cannot run, data of another data set), a round would train
        nothing: wait up to `rejoin_timeout_s` for one, else stop (TimeoutError)."""
        s = self.settings
        if self.live_devices():
            return
        status.info("cloud: no device online before round %d; waiting up to %.0f s for one", r, s.rejoin_timeout_s)
        self.pump(lambda: self.live_devices() > 0, s.rejoin_timeout_s)
        if not self.live_devices():
            raise TimeoutError(f"no device is online before round {r}: every device behind the edges left, and none "
                               f"came back within {s.rejoin_timeout_s:g} s (--rejoin-timeout); the run stops here, its "
                               f"rounds so far are kept{self.left_note()}")

    # -- where devices are -----------------------------------------------------------------------
    def place(self, moves: Mapping[str, Placement]) -> None:
        """Send each moved device its placement (through its current edge) and wait until the new
        edges report them (each listed by its new edge alone), at most PLACEMENT_TIMEOUT_S."""
        for dev, where in moves.items():
            self.view.placements[dev] = where
            self.assign(dev, {"edge": where.edge, "groups": list(where.groups), "peers": list(where.peers)})

        def pending() -> list[str]:
            listed = {d: [e for e, ds in self.view.members.items() if d in ds] for d in moves}
            return [d for d, w in moves.items() if listed[d] != [w.edge]]

        self.pump(lambda: not pending(), PLACEMENT_TIMEOUT_S)
        if pending():
            log.warning("cloud: devices %s not at their assigned edge after %.0f s", pending()[:10], PLACEMENT_TIMEOUT_S)
