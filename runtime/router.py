"""From a part's address (`To`) to a transport, a direction and a topic address.

Parts say where a message goes (up, to every child, to one device, to a group, to a peer);
each tier has one table that says how that address is reached from there: which transport
(an edge bridging two brokers has two), which direction of its own topics and which address
segment. A part never chooses a topic, so the same part runs under any layout of brokers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitedge.methods.contract import To
from splitedge.protocol.topics import ALL_DEVICES, Topic
from splitedge.protocol.transport import Transport

NAMED = frozenset({"device", "edge", "peer", "group"})
"""Address roles that name a node or group: `To.node` is required."""


@dataclass(frozen=True)
class Route:
    transport: Transport
    direction: str
    to: str | None = None


Table = Mapping[str, Callable[[str | None], Route]]


class Router:
    """One tier's routes; `route` raises ValueError for an address the tier cannot reach."""

    def __init__(self, tier: str, table: Table) -> None:
        self.tier, self.table = tier, table

    def route(self, to: To) -> Route:
        if to.role not in self.table or (to.role in NAMED and not to.node):
            raise ValueError(f"a {self.tier} cannot send to {to}")
        return self.table[to.role](to.node)


def device_router(t: Transport) -> Router:
    """A device sends up to its edge, or to its peers (all, or one)."""
    return Router("device", {"up": lambda _: Route(t, "up"), "peers": lambda _: Route(t, "peer"),
                             "peer": lambda node: Route(t, "peer", node)})


def edge_router(down: Transport, up: Transport) -> Router:
    """An edge sends up to the cloud, or down to all, one or a group of its devices."""
    return Router("edge", {"up": lambda _: Route(up, "up"), "children": lambda _: Route(down, "down"),
                           "devices": lambda _: Route(down, "down"),
                           "device": lambda node: Route(down, "down", node),
                           "group": lambda node: Route(down, "down", f"@{node}")})


def cloud_router(t: Transport) -> Router:
    """The cloud publishes on its downlink: edges read it, devices get it through their edge."""
    return Router("cloud", {"children": lambda _: Route(t, "down"), "devices": lambda _: Route(t, "down", ALL_DEVICES),
                            "edge": lambda node: Route(t, "down", node),
                            "device": lambda node: Route(t, "down", node),
                            "group": lambda node: Route(t, "down", f"@{node}")})


RETAINED_KINDS = frozenset({"round", "assign"})  # runtime-owned state a late joiner must find


def relay_route(where: Topic, down: Transport, members: Mapping[str, object]) -> Route | None:
    """Where an edge passes on the cloud's message for devices (`where.to`: `@all`, a device,
    `@<group>`): its own downlink under the same address; None for a device that is
    not (or no longer) its member."""
    to = None if where.to == ALL_DEVICES else where.to
    if to is not None and not to.startswith("@") and to not in members:
        return None
    return Route(down, "down", to)


def relayed_retained(kind_segment: str) -> bool:
    """A relayed message stays retained when it was: a slot's latest value or runtime state."""
    return "-" in kind_segment or kind_segment in RETAINED_KINDS
