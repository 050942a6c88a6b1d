"""Which topics each role reads, as a function of what it currently is (PROTOCOL.md's routes).

A node reads control topics (round announcements, its placement, its parent's status) from
the start, and data topics only once a method is loaded, so that the method's own kinds are
registered before its retained messages arrive and decode. The filters follow from a node's
state alone; runtime/subscriptions.py keeps a transport's subscriptions equal to them.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitedge.methods.contract import Placement
from splitedge.protocol.topics import ALL_DEVICES, pattern


def device_filters(run: str, me: str, where: Placement, *, loaded: bool) -> set[str]:
    """A device: its edge's downlink (rounds, its own placement, then everything for all
    devices, for it and its groups) and its peers' peer topics."""
    down = lambda **kw: pattern(run, "edge", where.edge, "down", **kw)  # noqa: E731
    out = {down(kind="round"), down(kind="assign", to=me), pattern(run, "edge", where.edge, "up", "status")}
    if loaded:
        out |= {down(), down(to=me), *(down(to=f"@{g}") for g in where.groups)}
        for p in where.peers:
            out |= {pattern(run, "device", p, "peer"), pattern(run, "device", p, "peer", to=me)}
    return out


def edge_cloud_filters(run: str, me: str, cloud: str, members: Iterable[str], groups: Iterable[str], *,
                       loaded: bool) -> set[str]:
    """An edge, on the cloud's broker: round announcements, each member's placement and the
    cloud's status; once loaded, what the cloud sends to all edges, to this edge, to all devices,
    to each member and to each group address a member reads."""
    members = list(members)
    down = lambda **kw: pattern(run, "cloud", cloud, "down", **kw)  # noqa: E731
    out = {down(kind="round"), *(down(kind="assign", to=d) for d in members), pattern(run, "cloud", cloud, "up", "status")}
    if loaded:
        out |= {down(), *(down(to=to) for to in {me, ALL_DEVICES, *members, *groups})}
    return out
