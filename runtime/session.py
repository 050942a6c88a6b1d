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
from splitedge.protocol.topics import check_node_id, topic
from splitedge.protocol.transport import Transport, kind_of

log = logging.getLogger(__name__)


def connect(url: str, *, run: str, tier: str, node_id: str, **kwargs: Any) -> "Transport":
    """An MQTT transport for a node, with its last will (`status` offline, retained) set; a clean
    `close()` publishes that offline status itself (`close(offline=False)` does not)."""
    from splitedge.protocol.mqtt import MqttTransport

    check_node_id(node_id)
    will_env = Envelope(kind="status", run=run, round=0, sender=node_id, body={"state": "offline", "role": tier})
    will = (topic(run, tier, node_id, "up", "status"), will_env)
    transport = MqttTransport(url, client_id=f"{run}-{tier}-{node_id}", role=tier, will=will, **kwargs)
    # A clean disconnect makes the broker drop the will, so a node that simply closed would stay
    # `online` (retained) for ever: its close says `offline` itself unless told otherwise.
    transport.close = functools.partial(transport.close, offline=True)  # type: ignore[method-assign]
    return transport


def check_identity_free(url: str, *, run: str, tier: str, node_id: str, settle_s: float = 1.0,
                        echo_s: float = 15.0, **kwargs: Any) -> None:
    """Refuse to start a second live process with this run, tier and id, and a login that is not
    this node's: one line each, before the node connects.

    The node's retained `status` says "online" while a process holds the id (its last will, or a
    clean exit, turns it "offline"). The check reads it without the node's own login: under
    `use_username_as_clientid` (the generated broker.conf) every connection of a login has the
    login as client id, so a check with it would take the running node's connection, and the two
    would then evict each other for ever. It connects with the node's probe login
    (`<login>.probe`, acl.probe_login, same password; `data split --acl` writes it), which may read
    only that status and write only its echo topic (acl.probe_topic): a nonce published there
    comes back only when the login is this node's (Mosquitto 2.0 grants a denied subscription and
    then delivers nothing, so a subscription alone cannot tell). A broker without the probe login
    skips the check with a warning; an anonymous one is read with a client id of the check's own,
    and without the echo (there is no login to verify). The echo may take `echo_s`: a loaded node
    or broker must not be taken for a wrong login.
    ValueError naming the way out; ConnectionError when the broker is not there."""
    from splitedge.protocol.mqtt import parse_url

    check_node_id(node_id)
    user = kwargs.get("username") or parse_url(url)[3]
    probe = _probe(url, run=run, tier=tier, node_id=node_id, user=user, **kwargs)
    if probe is None:
        return
    echoed, seen = _read_status(probe, run=run, tier=tier, node_id=node_id, anonymous=user is None,
                                settle_s=settle_s, echo_s=echo_s)
    if not echoed.is_set():
        who = f"login {user!r}" if user is not None else "an anonymous client"
        raise ValueError(f"the broker at {redact_url(url)} does not let {who} read {tier} {node_id}'s status in run "
                         f"{run!r}: it is the login of another node or run; start {tier} {node_id} with its own "
                         f"login (mqtt://{node_id}@host and --password-file logins/{node_id}.password), or give "
                         f"--id and --run of this login")
    if seen and seen[-1] == "online":
        raise ValueError(f"another {tier} with id {node_id!r} is online in run {run!r} on {redact_url(url)}; stop it, "
                         f"or give this one another --id or --run (a process killed without a clean exit counts as "
                         f"online until the broker's keepalive notices, about a minute; --takeover skips this check)")


def _probe(url: str, *, run: str, tier: str, node_id: str, user: str | None, **kwargs: Any) -> Any:
    """A connection with the node's probe login (None: the broker has none; skipped, said once)."""
    from splitedge.protocol.acl import probe_login
    from splitedge.protocol.mqtt import MqttTransport

    client_id = f"{run}-{tier}-{node_id}-probe-{os.getpid()}"  # never a node's own; a login's under the binding
    options = dict(kwargs)
    if user is not None:
        options["username"] = probe_login(user)
    try:
        return MqttTransport(url, client_id=client_id, role="probe", **options)
    except ConnectionError as exc:
        if user is None or "authentication failed" not in str(exc):
            raise
        log.warning("%s %s: the broker at %s refused the probe login %r (no such login, or a wrong password), so the "
                    "check for a second process with this id is skipped; `splitedge data split --acl` writes one per "
                    "node (its own password, reading only %s)", tier, node_id, redact_url(url), probe_login(user),
                    topic(run, tier, node_id, "up", "status"))
        return None


def _read_status(probe: Any, *, run: str, tier: str, node_id: str, anonymous: bool, settle_s: float,
                 echo_s: float) -> tuple[threading.Event, list[str]]:
    """(whether the nonce came back on the echo topic, the node's statuses read), then closed."""
    from splitedge.protocol.acl import probe_topic

    seen: list[str] = []
    nonce = os.urandom(16)
    echoed = threading.Event()
    try:
        echo = probe_topic(run, tier, node_id)
        probe.on_raw(echo, lambda payload: echoed.set() if payload == nonce else None)
        probe.subscribe(echo, lambda t, env: None)
        probe.subscribe(topic(run, tier, node_id, "up", "status"), lambda t, env: seen.append(env.body["state"]))
        if anonymous:
            echoed.set()  # anonymous: no login whose topics to verify
        else:
            probe.publish_raw(echo, nonce, qos=1)
        start = time.monotonic()
        while time.monotonic() - start < max(settle_s, echo_s) and not (
                echoed.is_set() and (seen or time.monotonic() - start >= settle_s)):
            time.sleep(0.05)
    finally:
        probe.close()
    return echoed, seen


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
