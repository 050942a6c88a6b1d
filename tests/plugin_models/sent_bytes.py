"""A mod of one's own (runtime/mods, `--plugin sent_bytes:SentBytes`): what a device sent up in
a phase, by kind (messages, and their bodies' size as the uplink budget counts it), in its
`done` info (under `mods`, as `sent_bytes`). It lives only in the tests."""

from __future__ import annotations

from typing import Any, Mapping

from splitedge.protocol.done import DoneInfo
from splitedge.runtime.mods import Mod
from splitedge.runtime.uplink import payload_bytes


class SentBytes(Mod):
    tiers = ("device",)

    def __init__(self, node: Any) -> None:
        self.node, self.sent = node, {}

    def opened(self, plan: Any) -> list:
        self.sent = {}
        return []

    def leaving(self, direction: str, kind: str, body: Mapping[str, Any]) -> None:
        if direction == "up" and kind not in ("done", "hello"):
            messages, size = self.sent.get(kind, (0, 0))
            self.sent[kind] = (messages + 1, size + payload_bytes(body))

    def done(self, plan: Any, info: DoneInfo, children: Mapping[str, DoneInfo]) -> DoneInfo:
        return info.with_mod("sent_bytes", {kind: list(pair) for kind, pair in self.sent.items()})


class Nowhere(Mod):
    """A mod that names no tier: refused at --plugin."""
