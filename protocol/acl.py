"""Mosquitto ACLs that pin every login to its own topics (PROTOCOL.md, "Topics").

* :func:`peer_acl`: each device login may publish only as itself and read only its edge's
  downlink for it and its graph neighbours' peer topics, so a peer graph is enforced by the
  broker, not only by the devices.
* :func:`federation_acl`: each device, edge and cloud login confined to its role's topics.

Pure text from the topic layout: no numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from splitedge.protocol.limits import BROKER_PACKET_BYTES
from splitedge.protocol.topics import ALL_DEVICES, PREFIX, pattern, topic

WATCHER = "watcher"
"""The read-only login federation_acl adds for `splitedge watch` (the first of :func:`watcher_logins`)."""
PROBE_SUFFIX = ".probe"
"""A node's probe login is its login plus this (:func:`probe_login`)."""
ANY_RUN = "+"
"""The run of an ACL that serves every run of its nodes (`splitedge provision`): each login is
confined to its own node's topics in whichever run it joins, so a new run id needs no change to
the broker. Runs stay apart on the wire (a node subscribes only to its own run's topics); the
ACL no longer keeps a node of one run from writing as that same node into another."""
_ANY = "\x01any-run\x01"
"""Stands for ANY_RUN while lines are built (it passes the topic builders' checks and is never a
real run id: an ACL's run may hold no control character), replaced by ``+`` in the text."""


def _concrete(run: str) -> str:
    """The run the lines are built with: the run itself, checked, or the placeholder of ANY_RUN."""
    return _ANY if run == ANY_RUN else _check_acl_name("run", run)


def _scoped(text: str) -> str:
    """Every placeholder run segment as the single-level wildcard."""
    return text.replace(f"{PREFIX}/{_ANY}/", f"{PREFIX}/+/").replace(f"{PREFIX}-probe/{_ANY}/", f"{PREFIX}-probe/+/")


def _run_label(run: str) -> str:
    return "every splitedge run" if run == ANY_RUN else f"splitedge run {run!r}"


def probe_login(login: str) -> str:
    """The login with which a node, before it connects, reads its own retained status (is a process
    with its id online already?) and nothing else. It cannot be the node's own login: under
    ``use_username_as_clientid`` every connection of a login has that login as its client id, so the
    check would take the running node's connection. ``splitedge data split --acl`` gives it the
    node's password, so the node needs no second file."""
    return login + PROBE_SUFFIX


def probe_topic(run: str, tier: str, node_id: str) -> str:
    """The one topic a node's probe login may write (and read): the check publishes a nonce there
    and waits for its echo, which comes back only when the login is this node's. Outside the run's
    tree (``splitedge-probe/...``), so no node, bridge or watch ever subscribes to it."""
    return f"{PREFIX}-probe/{run}/{tier}/{node_id}"


def watcher_logins(n: int) -> list[str]:
    """`n` read-only logins for `splitedge watch`: ``watcher``, ``watcher-2``, ... One per watch
    running at a time: under ``use_username_as_clientid`` two connections of one login take the
    client id from each other."""
    if n < 0:
        raise ValueError(f"the number of watcher logins must be >= 0, got {n}")
    return [WATCHER, *(f"{WATCHER}-{i}" for i in range(2, n + 1))][:n]


def check_devices(devices: Sequence[str]) -> list[str]:
    ids = list(devices)
    if not ids:
        raise ValueError("a graph needs at least one device")
    bad = [d for d in ids if not isinstance(d, str) or not d]
    if bad:
        raise ValueError(f"device ids must be non-empty strings, got {bad!r}")
    dupes = sorted({d for d in ids if ids.count(d) > 1})
    if dupes:
        raise ValueError(f"duplicate device ids: {dupes}")
    return ids


def check_graph(graph: Mapping[str, Sequence[str]]) -> None:
    """ValueError unless the graph is undirected: neighbours are known devices, listed once,
    never the device itself, and every link appears at both ends."""
    check_devices(list(graph))
    for d, nbrs in graph.items():
        if isinstance(nbrs, str):
            raise ValueError(f"neighbours of {d!r} must be a sequence of ids, not the string {nbrs!r}")
        nbrs = list(nbrs)
        if d in nbrs:
            raise ValueError(f"device {d!r} lists itself as a neighbour")
        if len(set(nbrs)) != len(nbrs):
            raise ValueError(f"device {d!r} lists a neighbour twice: {nbrs}")
        unknown = [p for p in nbrs if p not in graph]
        if unknown:
            raise ValueError(f"device {d!r} has neighbours that are not in the graph: {unknown}")
        one_way = [p for p in nbrs if d not in graph[p]]
        if one_way:
            raise ValueError(f"links {d!r} -> {one_way} have no way back (the graph must be undirected)")


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _check_acl_name(what: str, value: object) -> str:
    """An id written into the ACL: one line, no spaces (on top of the topic segment rules)."""
    if not isinstance(value, str) or _control(value) or any(c.isspace() for c in value):
        raise ValueError(f"{what} must be a string without spaces or control characters, got {value!r}")
    return value


def _check_login(device: str, user: object) -> str:
    if not isinstance(user, str) or not user or user != user.strip() or _control(user):
        raise ValueError(f"login for device {device!r} must be a non-empty one-line string without "
                         f"surrounding spaces, got {user!r}")
    return user


def _check_keys(name: str, mapping: Mapping[str, Any] | None, graph: Mapping[str, Any]) -> None:
    unknown = sorted(set(mapping or ()) - set(graph))
    if unknown:
        raise ValueError(f"{name} names devices that are not in the graph: {unknown}")


def peer_acl(run: str, graph: Mapping[str, Sequence[str]], *, edges: Mapping[str, str] | None = None,
             users: Mapping[str, str] | None = None, groups: Mapping[str, Sequence[str]] | None = None,
             probes: bool = True) -> str:
    """A Mosquitto ``acl_file`` with one ``user`` block per device of ``graph`` for run ``run``
    (:data:`ANY_RUN`: every run).

    Device D (login ``users.get(D, D)``) may exactly:

    * read and write ``splitedge/<run>/device/<D>/#`` (its up, peer, hello, status and last
      will; reading its own status lets a second process with its id see that it is taken);
    * with ``edges`` (device -> its edge E; then every device needs one) read
      ``splitedge/<run>/edge/<E>/down/+``, ``.../down/+/<D>`` and E's status (a stop found at
      start is obeyed only while the edge is offline), and with ``groups`` (device -> group
      names) ``.../down/+/@<g>`` for each of its groups;
    * for each neighbour P read ``splitedge/<run>/device/<P>/peer/+`` and
      ``splitedge/<run>/device/<P>/peer/+/<D>``.

    With ``probes`` each device also has its probe login (:func:`probe_login`, ``<login>.probe``),
    which may read only ``splitedge/<run>/device/<D>/up/status`` and its echo topic
    (:func:`probe_topic`): the start-up check that no other process holds the id, without taking
    that process's connection, and that the login is D's.

    Nothing else: not other devices' up topics, not non-neighbours' peer topics, not peer
    messages addressed to another device, not the cloud's topics. Add the edges' and cloud's
    own logins (deploy/mosquitto/cloud.acl) to the file as needed; a device moved to another
    edge needs a regenerated ACL (Mosquitto rereads it on SIGHUP).
    """
    check_graph(graph)
    for name, mapping in (("edges", edges), ("users", users), ("groups", groups)):
        _check_keys(name, mapping, graph)
    if edges is not None:
        missing = [d for d in graph if d not in edges]
        if missing:
            raise ValueError(f"edges gives no edge for devices {missing}")
    if groups and edges is None:
        raise ValueError("groups need edges: a group's messages come down from the device's edge")
    label, run = _run_label(run), _concrete(run)
    for d in graph:
        pattern(run, "device", _check_acl_name("device id", d))  # and valid topic segments
        if d.startswith("@"):
            raise ValueError(f"device id {d!r} must not start with '@' (that addresses a group)")
    logins = {d: _check_login(d, (users or {}).get(d, d)) for d in graph}
    shared = sorted({u for u in logins.values() if list(logins.values()).count(u) > 1})
    if shared:
        raise ValueError(f"devices must have their own logins; shared: {shared}")
    if probes:
        taken = sorted(set(logins.values()) & {probe_login(u) for u in logins.values()})
        if taken:
            raise ValueError(f"logins {taken} are another device's probe login (<login>{PROBE_SUFFIX}): rename them")

    n_links = sum(map(len, graph.values())) // 2  # undirected: every link appears at both ends
    lines = [
        f"# Mosquitto acl_file for {label}: {len(graph)} device logins, {n_links} peer links",
        f"# (mean degree {sum(map(len, graph.values())) / len(graph):.2f}). Generated by splitedge.protocol.acl.peer_acl.",
        "# Each device login D may write only its own topics splitedge/<run>/device/<D>/# and read only those,",
        *(["# its edge E's downlink edge/<E>/down/+, edge/<E>/down/+/<D>",
           "# and edge/<E>/down/+/@<its groups>,",
           "# E's status edge/<E>/up/status,"] if edges is not None else []),
        "# its neighbours' peer topics device/<P>/peer/+ and device/<P>/peer/+/<D>; not other devices'",
        "# up topics, not non-neighbours' peer topics, not peer messages addressed to other devices.",
        *(["# Each login L also has a probe login L.probe that reads only its node's status and writes only",
           "# splitedge-probe/<run>/<tier>/<id> (the start-up check for a second process with the same id, and",
           "# that L is this node's login; under use_username_as_clientid the check cannot use L itself)."]
          if probes else []),
        "# Use with allow_anonymous false and a password_file holding these logins.",
    ]
    for d, nbrs in graph.items():
        lines += ["", f"# device {d}: neighbours {', '.join(nbrs) if nbrs else '(none)'}", f"user {logins[d]}",
                  f"topic readwrite {PREFIX}/{run}/device/{d}/#"]
        if edges is not None:
            e = _check_acl_name(f"edge of {d!r}", edges[d])
            lines += [f"topic read {pattern(run, 'edge', e, 'down')}",
                      f"topic read {pattern(run, 'edge', e, 'down', to=d)}",
                      f"topic read {pattern(run, 'edge', e, 'up', 'status')}"]
            mine = (groups or {}).get(d, ())
            if isinstance(mine, str):
                raise ValueError(f"groups of {d!r} must be a sequence of names, not the string {mine!r}")
            for g in sorted(set(mine)):
                if _check_acl_name(f"group of {d!r}", g).startswith("@"):
                    raise ValueError(f"group names are strings given without '@', got {g!r} for device {d!r}")
                if f"@{g}" == ALL_DEVICES:
                    raise ValueError(f"group name {g!r} of device {d!r} is reserved ('@{g}' addresses other devices)")
                lines.append(f"topic read {pattern(run, 'edge', e, 'down', to=f'@{g}')}")
        for p in nbrs:
            lines += [f"topic read {pattern(run, 'device', p, 'peer')}",
                      f"topic read {pattern(run, 'device', p, 'peer', to=d)}"]
    if probes:
        lines += ["", "# Probe logins: each reads only its device's status and writes only its echo topic."]
        for d in graph:
            lines += _probe_block(logins[d], run, "device", d)
    return _scoped("\n".join(lines) + "\n")


def _probe_block(login: str, run: str, tier: str, node_id: str) -> list[str]:
    return ["", f"# probe login of {tier} {node_id}: its status, and an echo topic of its own (the start-up check",
            "# for a second process with its id, and that the login is this node's)",
            f"user {probe_login(login)}", f"topic readwrite {probe_topic(run, tier, node_id)}", f"topic read {topic(run, tier, node_id, 'up', 'status')}"]


def federation_acl(run: str, edges: Mapping[str, str], *, cloud: str = "cloud", users: Mapping[str, str] | None = None,
                   groups: Mapping[str, Sequence[str]] | None = None,
                   watcher: str | Sequence[str] | None = WATCHER, probes: bool = True) -> str:
    """A Mosquitto ``acl_file`` for a federated run: every device as in :func:`peer_acl` (no
    peers), and one block per edge and for the cloud, each login confined to its own tier:

    * edge E: read and write ``splitedge/<run>/edge/<E>/#``; read every device's up topics
      (``device/+/up/#``: a device it has not met yet joins by its hello), the cloud's downlink
      ``cloud/<C>/down/#`` and the cloud's status;
    * cloud C: read and write ``splitedge/<run>/cloud/<C>/#``; read every edge's up topics;
    * the ``watcher`` login, or each of a list of them (:func:`watcher_logins`; None: none): read
      ``splitedge/<run>/#``, write nothing (``splitedge watch``: an operator sees the run without
      being able to change it). One login per watch that runs at the same time;
    * with ``probes``, every node's probe login (:func:`probe_login`): its own status, read only.

    ``edges`` maps each device to its edge; ``users`` maps any node id (device, edge or cloud)
    to its login, by default the id. One file serves a shared broker, and an edge-site broker
    (whose bridge has its own remote login on the cloud broker, deploy/mosquitto/cloud.acl).
    """
    users = dict(users or {})
    device_users = {d: u for d, u in users.items() if d in edges}
    text = peer_acl(run, {d: [] for d in edges}, edges=edges, users=device_users, groups=groups, probes=probes)
    text = f"# Generated by splitedge.protocol.acl.federation_acl: devices, edges and the cloud of {_run_label(run)}.\n" + text
    run = _concrete(run)
    _check_acl_name("cloud id", cloud)
    pattern(run, "cloud", cloud)
    names = sorted(set(edges.values()))
    logins = {n: _check_login(n, users.get(n, n)) for n in [*names, cloud]}
    watchers = [] if watcher is None else [watcher] if isinstance(watcher, str) else list(watcher)
    for w in watchers:
        logins[f"({w})"] = _check_login("watcher", w)
    taken = {users.get(d, d) for d in edges}
    if probes:
        taken |= {probe_login(u) for u in taken}
        clash_probe = sorted({probe_login(logins[n]) for n in [*names, cloud]} & set(logins.values()))
        if clash_probe:
            raise ValueError(f"logins {clash_probe} are another node's probe login (<login>{PROBE_SUFFIX}): rename them")
    clash = sorted(u for u in logins.values() if u in taken)
    if clash or len(set(logins.values())) != len(logins):
        raise ValueError(f"every node needs its own login; shared: {clash or sorted(logins.values())}")
    lines = ["", "# Edges: their own topics, every device's up topics, the cloud's downlink and status."]
    for e in names:
        lines += ["", f"# edge {e}", f"user {logins[e]}", f"topic readwrite {PREFIX}/{run}/edge/{e}/#",
                  f"topic read {PREFIX}/{run}/device/+/up/#", f"topic read {PREFIX}/{run}/cloud/{cloud}/down/#",
                  f"topic read {pattern(run, 'cloud', cloud, 'up', 'status')}"]
        if probes:
            lines += _probe_block(logins[e], run, "edge", e)
    lines += ["", f"# cloud {cloud}: its own topics and every edge's up topics", f"user {logins[cloud]}",
              f"topic readwrite {PREFIX}/{run}/cloud/{cloud}/#", f"topic read {PREFIX}/{run}/edge/+/up/#"]
    if probes:
        lines += _probe_block(logins[cloud], run, "cloud", cloud)
    for w in watchers:
        lines += ["", "# watcher: reads the whole run (splitedge watch), writes nothing; one login per watch "
                      "running at a time", f"user {w}", f"topic read {PREFIX}/{run}/#"]
    return text + _scoped("\n".join(lines) + "\n")


def write_acl(path: Path | str, text: str) -> Path:
    """Write an ACL (e.g. from :func:`peer_acl`) to ``path``, parents created; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text if text.endswith("\n") else text + "\n")
    return out


BROKER_USER = "mosquitto"
"""The user Mosquitto runs as once started (its default `user`, and the Debian/Raspberry Pi OS package's)."""


def broker_conf(run: str, acl_file: Path | str, password_file: Path | str, max_packet_size: int | None = None, *,
                port: int = 1883, address: str | None = None) -> str:
    """The Mosquitto settings that go with a generated ACL and password file, as one file that works
    on its own (``mosquitto -c broker.conf``) and dropped into a broker's ``include_dir``.

    It opens its own listener (``port``, on ``address`` or every interface) for the nodes, and
    puts the per-listener option right after it: ``use_username_as_clientid`` binds each login to
    its MQTT client id, so a login cannot take another node's connection by connecting with that
    node's client id (the broker would drop the older connection for it). Mosquitto 2.0 reads
    every included file from its default listener on: a per-listener option above the file's own
    ``listener`` line would open a second listener on 1883 (and, when something holds 1883,
    keep the broker from starting). Then no anonymous client, the two files, and a
    ``max_packet_size`` for model messages (by default protocol/limits.py's BROKER_PACKET_BYTES); a
    comment says how to make the password file readable by the broker's own user."""
    passwd, acl = Path(password_file).resolve(), Path(acl_file).resolve()
    bind = f" {address}" if address else ""
    writer = "splitedge provision" if run == ANY_RUN else "splitedge data split --acl"
    if max_packet_size is None:
        max_packet_size = BROKER_PACKET_BYTES
    return "\n".join([
        f"# Mosquitto settings for {_run_label(run)} (written by `{writer}`).",
        "# Use it on its own (mosquitto -c broker.conf) or copy it into the include_dir of a broker",
        "# (e.g. /etc/mosquitto/conf.d/splitedge.conf). It opens its own listener for the nodes, below: remove",
        f"# any other listener on port {port} from the broker's config (two on one port stop the broker). A",
        "# listener of yours on another port has no login binding: keep it on 127.0.0.1 for administration.",
        "# Per-listener options belong right after their `listener` line, in the same file: placed anywhere",
        "# else, Mosquitto 2.0 opens a default listener on 1883 for them.",
        f"listener {port}{bind}",
        "# The client id of every connection is its login: a login cannot disconnect another node by",
        "# reusing its client id. One connection per login (a second one replaces the first), so every",
        "# node, and every `splitedge watch` running at a time, has a login of its own (watcher,",
        "# watcher-2, ...); a node checks for a second process with its id by its probe login <login>.probe.",
        "use_username_as_clientid true",
        "allow_anonymous false",
        "# The broker reads both files as its own user once started (mosquitto on Debian and Raspberry Pi",
        "# OS); broker.passwd is written mode 600 for whoever ran `data split`. Before starting the broker:",
        f"#   sudo chown {BROKER_USER}: {passwd}",
        "# (every folder above it must let that user in), or install both into /etc/mosquitto and change",
        "# the two paths below:",
        f"#   sudo install -m 600 -o {BROKER_USER} -g {BROKER_USER} {passwd} /etc/mosquitto/splitedge.passwd",
        f"#   sudo install -m 644 {acl} /etc/mosquitto/splitedge.acl",
        f"# Re-running `{writer}` rewrites broker.passwd as its own user: chown or install it again.",
        f"password_file {passwd}",
        f"acl_file {acl}",
        "# Model messages: a little above the receivers' frame cap (--max-frame-bytes). Mosquitto 2.1",
        "# defaults to 2,000,000 bytes and would drop them.",
        f"max_packet_size {int(max_packet_size)}",
    ]) + "\n"


__all__ = ["ANY_RUN", "BROKER_USER", "PROBE_SUFFIX", "WATCHER", "broker_conf", "check_devices", "check_graph", "peer_acl",
           "federation_acl", "probe_login", "probe_topic", "watcher_logins", "write_acl"]
