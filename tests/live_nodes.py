"""Role objects (edges, devices) running in threads against a real broker, each node with its
own MQTT connection (and login); one context manager stops and closes them all."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from splitedge.runtime.session import connect


class LiveNodes:
    """`transport(tier, id)` connects a node as `url_for(id)` (its login); `start(node)` runs it;
    `adopt(t)` hands over any other transport to close. Leaving the block stops every node,
    joins its thread and closes every transport."""

    def __init__(self, url_for: Callable[[str], str], run: str) -> None:
        self.url_for, self.run = url_for, run
        self.nodes: list[Any] = []
        self.threads: list[threading.Thread] = []
        self.transports: list[Any] = []

    def transport(self, tier: str, node_id: str) -> Any:
        return self.adopt(connect(self.url_for(node_id), run=self.run, tier=tier, node_id=node_id))

    def adopt(self, transport: Any) -> Any:
        self.transports.append(transport)
        return transport

    def start(self, node: Any) -> Any:
        node.start()
        self.nodes.append(node)
        self.threads.append(threading.Thread(target=node.run_forever, daemon=True))
        self.threads[-1].start()
        return node

    def __enter__(self) -> LiveNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()
        for thread in self.threads:
            thread.join(10)
        for transport in self.transports:
            transport.close()
