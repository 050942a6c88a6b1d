"""What a device part may wait for in the middle of a round: an edge's reply, its peers' messages.

`request(message, reply_kind, timeout)` publishes and blocks until the edge's reply for this
round (and the same `batch` and `sum`, when the body has them) arrives (SplitFed: activations up,
gradients back). `gather(kind, senders, timeout)` collects this round's messages from peers
(DecMAR). Both read the node's inbox meanwhile; events that are not what they wait for are
deferred and handled, in order, after the round. Peer messages are kept per round, since a
fast peer may already be a round ahead.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from splitedge.methods.contract import Message
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import parse

log = logging.getLogger(__name__)

REQUEST_POLL_S = 0.5  # how often a waiting `request` or `gather` checks whether the node was stopped


class Exchange:
    def __init__(self, node: Any, next_event: Callable[[float], Any]) -> None:
        """`node`: the device (its stop flag, round, placement, part, publish and inbound chain);
        `next_event`: its inbox itself, not the deferred events."""
        self.node, self.next_event = node, next_event
        self.deferred: collections.deque[tuple[str, Envelope]] = collections.deque()
        self.peer_box: dict[tuple[int, str], dict[str, Envelope]] = {}  # (round, kind) -> sender -> message
        self.stale_replies = 0

    def _wait(self, what: str, timeout: float, take: Callable[[str, Envelope], bool]) -> bool:
        """Read the inbox until `take(topic, env)` says it is done (True), or `timeout`."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self.node.stopped.is_set():
                raise TimeoutError(f"device {self.node.node_id}: stopped while waiting for {what}")
            event = self.next_event(min(remaining, REQUEST_POLL_S))
            if event is not None and take(*event):
                return True
        return False

    def request(self, msg: Message, reply_kind: str, timeout: float) -> Envelope:
        """Publish `msg` and wait for its reply; TimeoutError otherwise, which fails the round."""
        node = self.node
        node.publish(msg)
        batch, name = msg.body.get("batch"), msg.body.get("sum")
        found: list[Envelope] = []

        def take(topic: str, env: Envelope) -> bool:
            if env.kind != reply_kind:
                self.deferred.append((topic, env))
            elif env.round != node.round or env.body.get("batch") != batch or env.body.get("sum") != name:
                self.stale_replies += 1
            elif node.accepts(node.part, env, "parent"):
                found.append(env)
                return True
            return False

        if not self._wait(reply_kind, timeout, take):
            raise TimeoutError(f"device {node.node_id}: no {reply_kind} for round {node.round} batch {batch} "
                               f"within {timeout:.1f} s")
        return found[0]

    def gather(self, kind: str, senders: Iterable[str] | None = None, timeout: float = 60.0) -> dict[str, Envelope]:
        """This round's `kind` messages from `senders` (default: every peer), waiting until all
        arrived or `timeout`; a missing peer is left out, never waited for past the timeout."""
        node = self.node
        want = set(node.placement.peers if senders is None else senders)
        box = self.peer_box.setdefault((node.round, kind), {})

        def take(topic: str, env: Envelope) -> bool:
            if parse(topic).direction == "peer":
                self.on_peer(env)
            else:
                self.deferred.append((topic, env))
            return want <= set(box)

        if not want <= set(box):
            self._wait(f"{kind} from peers", timeout, take)
        missing = sorted(want - set(box))
        if missing:
            log.info("device %s: round %d without %s from %s", node.node_id, node.round, kind, missing)
        return {s: box[s] for s in sorted(want & set(box))}

    def on_peer(self, env: Envelope) -> None:
        """Keep a peer's message for the round it belongs to."""
        node = self.node
        if env.sender not in node.placement.peers or env.round < node.round or not node.current(env):
            return
        if node.part is not None and not node.accepts(node.part, env, "peer"):
            return
        self.peer_box.setdefault((env.round, env.kind), {})[env.sender] = env
        for key in [k for k in self.peer_box if k[0] < node.round]:
            del self.peer_box[key]
