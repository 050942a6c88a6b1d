"""A node's topic filters on one transport, kept equal to what it currently needs.

Which filters a node reads changes with its state (a method loaded, a member joined, a move
to another edge); `sync` subscribes what is newly wanted and unsubscribes what no longer is.
`fresh` drops and retakes every filter, so the broker delivers the retained messages again
(a new edge's state, a new method's models with its kinds now registered).
"""

from __future__ import annotations

from collections.abc import Set

from splitedge.protocol.transport import Handler, Transport


class Subscriptions:
    def __init__(self, transport: Transport, handler: Handler) -> None:
        self.transport, self.handler = transport, handler
        self.current: set[str] = set()

    def sync(self, wanted: Set[str], *, fresh: bool = False) -> None:
        for f in sorted(self.current if fresh else self.current - wanted):
            self.transport.unsubscribe(f)
        for f in sorted(wanted if fresh else wanted - self.current):
            self.transport.subscribe(f, self.handler)
        self.current = set(wanted)
