"""What an edge takes from its cloud and hands on: its subscriptions to the cloud's downlink (as
far as its devices, their groups and its part need it), the cloud's messages for devices passed
on under the same address and slot, and the round announcements republished on its own downlink.
"""

from __future__ import annotations

from typing import Any

from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import Topic
from splitedge.runtime.filters import edge_cloud_filters
from splitedge.runtime.router import relay_route, relayed_retained
from splitedge.runtime.subscriptions import Subscriptions


class Relaying:
    """An edge's side of its cloud (`edge`: its aggregator: transports, members, part)."""

    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.subs = Subscriptions(edge.up, edge.enqueue)  # the cloud's downlink, as far as we need it

    def sync(self, fresh: bool = False) -> None:
        """Subscribe to what its members, their groups and its part (once loaded) need of the cloud."""
        e = self.edge
        self.subs.sync(edge_cloud_filters(e.run_id, e.node_id, e.cloud, e.members, e.roster.group_addresses(),
                                          loaded=e.part is not None), fresh=fresh)

    def round_down(self, env: Envelope, *, retain: bool = True) -> None:
        """The cloud's round announcement (or stop), republished on this edge's downlink."""
        self.edge.send(self.edge.down, "down", "round", env.body, round_=env.round, retain=retain)

    def relay(self, where: Topic, env: Envelope) -> None:
        """Pass the cloud's message for devices on to ours, under the same address and slot."""
        e = self.edge
        route = relay_route(where, e.down, e.members)
        if route is not None:
            e.send(route.transport, route.direction, env.kind, env.body, round_=env.round,
                   retain=relayed_retained(where.kind), topic_kind=where.kind, to=route.to)
