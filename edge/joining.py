"""How an edge's devices join it, and how the cloud hears who is live: a device's hellos (its
id checked against the operator's manifest) and statuses, taken at start before the cloud's
downlink, and the edge's own hello to the cloud each time who is live changes."""

from __future__ import annotations

import logging
import time
from typing import Any

from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import Topic

log = logging.getLogger(__name__)

MEMBERS_QUIET_S, MEMBERS_SETTLE_S = 0.3, 3.0
"""At start, the devices' retained hellos and statuses are taken until none arrives for the
first, for at most the second (a broker sends retained messages right after each SUBACK)."""


class Joining:
    def __init__(self, edge: Any, quiet_s: float = MEMBERS_QUIET_S) -> None:
        self.edge = edge
        self.quiet_s = quiet_s  # 0: take none at start (a sim starts its edges before any device)
        self.unlisted: set[str] = set()  # ids refused at their hello (a manifest lists the devices), logged once
        self.settling = False  # start() is taking the members' retained hellos and statuses
        self.online = False  # its online status published (each transport republishes it after a reconnect)

    def settle(self, most_s: float = MEMBERS_SETTLE_S) -> None:
        """Take the devices' retained hellos, and the statuses they open, before the cloud's
        downlink: an edge restarted into an open round must know who is live when it opens the
        round, or it would wait for nobody and close it at once. Until nothing arrives for
        `quiet_s`, at most `most_s`; then the edge subscribes and announces."""
        edge = self.edge
        if self.quiet_s > 0:
            self.settling = True
            try:
                deadline = time.monotonic() + most_s
                while time.monotonic() < deadline:
                    event = edge.next_event(min(self.quiet_s, deadline - time.monotonic()))
                    if event is None:
                        break
                    edge.dispatch(event)
            finally:
                self.settling = False
        self.changed()  # the cloud's downlink (and what it addresses to members), and its hello

    def hello(self, where: Topic, env: Envelope) -> None:
        edge = self.edge
        if not edge.roster.admits(env.sender):
            self._refuse_unlisted(env.sender)
        elif edge.roster.hello(env, addressed=where.to is not None):
            self.changed()

    def status(self, env: Envelope) -> None:
        if self.edge.roster.status(env) and not self.settling:
            self.announce()  # the cloud waits for live devices before round 1

    def changed(self) -> None:
        """Who the members are changed: the subscriptions, the hello and the part follow."""
        edge = self.edge
        if self.settling:  # settle() subscribes and announces once they are in
            return
        edge.relaying.sync()
        self.announce()
        if edge.part is not None:
            edge.part.members_changed(set(edge.members))

    def announce(self) -> None:
        """The hello (who is live) every time it changes; the online status once, since each
        transport republishes it after a reconnect. Announced again with every member's status,
        it went to every member: an edge of m devices sent m^2/2 of them while they joined."""
        edge = self.edge
        edge.send(edge.up, "up", "hello", edge.roster.hello_body(edge.cloud), round_=0, retain=True)
        if self.online:
            return
        for transport in {id(edge.up): edge.up, id(edge.down): edge.down}.values():
            edge.announce_online(transport)  # the cloud reads it upstream, the devices on the site broker
        self.online = True

    def _refuse_unlisted(self, device: str) -> None:
        """A hello from an id the operator's manifest does not list: counted, logged once per id."""
        self.edge.refused["hello.unlisted"] += 1
        if device not in self.unlisted:
            self.unlisted.add(device)
            log.warning("edge %s: refused device %s: not in this edge's manifest (--manifest)", self.edge.node_id,
                        device)
