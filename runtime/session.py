"""A node's MQTT session: connecting with its last will, refusing a second process with a live
identity, and clearing the retained messages an earlier incarnation of the run left behind."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from splitedge.protocol.codec import Envelope
from splitedge.protocol.credentials import redact_url
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import Transport, kind_of

log = logging.getLogger(__name__)


def connect(url: str, *, run: str, tier: str, node_id: str, **kwargs: Any) -> "Transport":
    """An MQTT transport for a node, with its last will (`status` offline, retained) set; a clean
    `close()` publishes that offline status itself (`close(offline=False)` does not)."""
    from splitedge.protocol.mqtt import MqttTransport

    will_env = Envelope(kind="status", run=run, round=0, sender=node_id, body={"state": "offline", "role": tier})
    will = (topic(run, tier, node_id, "up", "status"), will_env)
    transport = MqttTransport(url, client_id=f"{run}-{tier}-{node_id}", role=tier, will=will, **kwargs)
    # A clean disconnect makes the broker drop the will, so a node that simply closed would stay
    # `online` (retained) for ever: its close says `offline` itself unless told otherwise.
    transport.close = functools.partial(transport.close, offline=True)  # type: ignore[method-assign]
    return transport


def check_identity_free(url: str, *, run: str, tier: str, node_id: str, settle_s: float = 1.0, **kwargs: Any) -> None:
    """Refuse to start a second live process with this run, tier and id: with the same MQTT
    client id the two would take the session from each other for ever. The node's retained
    `status` says "online" while a process holds the id (its last will, or a clean exit, turns
    it "offline"). ValueError naming the way out; ConnectionError when the broker is not there."""
    from splitedge.protocol.mqtt import MqttTransport

    seen: list[str] = []
    probe = MqttTransport(url, client_id=f"{run}-{tier}-{node_id}-probe-{os.getpid()}", role="probe", **kwargs)
    try:
        probe.subscribe(topic(run, tier, node_id, "up", "status"), lambda t, env: seen.append(env.body["state"]))
        wait = time.monotonic() + settle_s
        while not seen and time.monotonic() < wait:
            time.sleep(0.05)
    finally:
        probe.close()
    if seen and seen[-1] == "online":
        raise ValueError(f"another {tier} with id {node_id!r} is online in run {run!r} on {redact_url(url)}; stop it, "
                         f"or give this one another --id or --run (a process killed without a clean exit counts as "
                         f"online until the broker's keepalive notices, about a minute; --takeover skips this check)")


def clear_retained(transport: "Transport", filter_: str, settle_s: float = 0.5) -> int:
    """Remove every retained message under `filter_` (a node's own downlink) left by an earlier
    incarnation of the run, so nobody mistakes an old model version or stop for a current one.
    Returns how many were cleared."""
    seen: set[str] = set()
    lock = threading.Lock()

    def collect(topic_: str, env: Envelope) -> None:
        with lock:
            seen.add(topic_)

    transport.subscribe(filter_, collect)
    time.sleep(settle_s)  # retained messages arrive right after SUBACK; nothing to wait on but time
    transport.unsubscribe(filter_)
    with lock:
        topics = sorted(seen)
    for t in topics:
        transport.publish_raw(t, b"", retain=True)
        log.info("cleared retained %s (%s)", t, kind_of(t))
    return len(topics)
