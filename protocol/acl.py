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

from splitedge.protocol.topics import ALL_DEVICES, PREFIX, pattern

WATCHER = "watcher"
"""The read-only login federation_acl adds for `splitedge watch`."""


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
             users: Mapping[str, str] | None = None, groups: Mapping[str, Sequence[str]] | None = None) -> str:
    """A Mosquitto ``acl_file`` with one ``user`` block per device of ``graph`` for run ``run``.

    Device D (login ``users.get(D, D)``) may exactly:

    * read and write ``splitedge/<run>/device/<D>/#`` (its up, peer, hello, status and last
      will; reading its own status lets a second process with its id see that it is taken);
    * with ``edges`` (device -> its edge E; then every device needs one) read
      ``splitedge/<run>/edge/<E>/down/+``, ``.../down/+/<D>`` and E's status (a stop found at
      start is obeyed only while the edge is offline), and with ``groups`` (device -> group
      names) ``.../down/+/@<g>`` for each of its groups;
    * for each neighbour P read ``splitedge/<run>/device/<P>/peer/+`` and
      ``splitedge/<run>/device/<P>/peer/+/<D>``.

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
    _check_acl_name("run", run)
    for d in graph:
        pattern(run, "device", _check_acl_name("device id", d))  # and valid topic segments
        if d.startswith("@"):
            raise ValueError(f"device id {d!r} must not start with '@' (that addresses a group)")
    logins = {d: _check_login(d, (users or {}).get(d, d)) for d in graph}
    shared = sorted({u for u in logins.values() if list(logins.values()).count(u) > 1})
    if shared:
        raise ValueError(f"devices must have their own logins; shared: {shared}")

    n_links = sum(map(len, graph.values())) // 2  # undirected: every link appears at both ends
    lines = [
        f"# Mosquitto acl_file for splitedge run {run!r}: {len(graph)} device logins, {n_links} peer links",
        f"# (mean degree {sum(map(len, graph.values())) / len(graph):.2f}). Generated by splitedge.protocol.acl.peer_acl.",
        "# Each device login D may write only its own topics splitedge/<run>/device/<D>/# and read only those,",
        *(["# its edge E's downlink edge/<E>/down/+, edge/<E>/down/+/<D>",
           "# and edge/<E>/down/+/@<its groups>,",
           "# E's status edge/<E>/up/status,"] if edges is not None else []),
        "# its neighbours' peer topics device/<P>/peer/+ and device/<P>/peer/+/<D>; not other devices'",
        "# up topics, not non-neighbours' peer topics, not peer messages addressed to other devices.",
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
    return "\n".join(lines) + "\n"


def federation_acl(run: str, edges: Mapping[str, str], *, cloud: str = "cloud", users: Mapping[str, str] | None = None,
                   groups: Mapping[str, Sequence[str]] | None = None, watcher: str | None = WATCHER) -> str:
    """A Mosquitto ``acl_file`` for a federated run: every device as in :func:`peer_acl` (no
    peers), and one block per edge and for the cloud, each login confined to its own tier:

    * edge E: read and write ``splitedge/<run>/edge/<E>/#``; read every device's up topics
      (``device/+/up/#``: a device it has not met yet joins by its hello), the cloud's downlink
      ``cloud/<C>/down/#`` and the cloud's status;
    * cloud C: read and write ``splitedge/<run>/cloud/<C>/#``; read every edge's up topics;
    * the ``watcher`` login (None: no such login): read ``splitedge/<run>/#``, write nothing
      (``splitedge watch``: an operator sees the run without being able to change it).

    ``edges`` maps each device to its edge; ``users`` maps any node id (device, edge or cloud)
    to its login, by default the id. One file serves a shared broker, and an edge-site broker
    (whose bridge has its own remote login on the cloud broker, deploy/mosquitto/cloud.acl).
    """
    users = dict(users or {})
    device_users = {d: u for d, u in users.items() if d in edges}
    text = peer_acl(run, {d: [] for d in edges}, edges=edges, users=device_users, groups=groups)
    text = f"# Generated by splitedge.protocol.acl.federation_acl: devices, edges and the cloud of {run!r}.\n" + text
    _check_acl_name("cloud id", cloud)
    pattern(run, "cloud", cloud)
    names = sorted(set(edges.values()))
    logins = {n: _check_login(n, users.get(n, n)) for n in [*names, cloud]}
    if watcher is not None:
        logins[f"({watcher})"] = _check_login("watcher", watcher)
    taken = {users.get(d, d) for d in edges}
    clash = sorted(u for u in logins.values() if u in taken)
    if clash or len(set(logins.values())) != len(logins):
        raise ValueError(f"every node needs its own login; shared: {clash or sorted(logins.values())}")
    lines = ["", "# Edges: their own topics, every device's up topics, the cloud's downlink and status."]
    for e in names:
        lines += ["", f"# edge {e}", f"user {logins[e]}", f"topic readwrite {PREFIX}/{run}/edge/{e}/#",
                  f"topic read {PREFIX}/{run}/device/+/up/#", f"topic read {PREFIX}/{run}/cloud/{cloud}/down/#",
                  f"topic read {pattern(run, 'cloud', cloud, 'up', 'status')}"]
    lines += ["", f"# cloud {cloud}: its own topics and every edge's up topics", f"user {logins[cloud]}",
              f"topic readwrite {PREFIX}/{run}/cloud/{cloud}/#", f"topic read {PREFIX}/{run}/edge/+/up/#"]
    if watcher is not None:
        lines += ["", "# watcher: reads the whole run (splitedge watch), writes nothing", f"user {watcher}",
                  f"topic read {PREFIX}/{run}/#"]
    return text + "\n".join(lines) + "\n"


def write_acl(path: Path | str, text: str) -> Path:
    """Write an ACL (e.g. from :func:`peer_acl`) to ``path``, parents created; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text if text.endswith("\n") else text + "\n")
    return out


def broker_conf(run: str, acl_file: Path | str, password_file: Path | str, max_packet_size: int) -> str:
    """The Mosquitto settings that go with a generated ACL and password file: no anonymous
    client, and each login bound to its MQTT client id (`use_username_as_clientid`), so a
    login cannot take another node's connection by connecting with that node's client id
    (the broker would drop the older connection for it). The listener is the operator's."""
    return "\n".join([
        f"# Mosquitto settings for splitedge run {run!r} (written by `splitedge data split --acl`).",
        "# Include this file from mosquitto.conf beside your listener (e.g. /etc/mosquitto/conf.d/);",
        "# if you move broker.acl and broker.passwd, change the two paths.",
        "allow_anonymous false",
        f"password_file {Path(password_file).resolve()}",
        f"acl_file {Path(acl_file).resolve()}",
        "# The client id of every connection is its login: a login cannot disconnect another node by",
        "# reusing its client id. One connection per login (a second one replaces the first).",
        "use_username_as_clientid true",
        "# Model messages: a little above the receivers' frame cap (--max-frame-bytes). Mosquitto 2.1",
        "# defaults to 2,000,000 bytes and would drop them.",
        f"max_packet_size {int(max_packet_size)}",
    ]) + "\n"


__all__ = ["broker_conf", "check_devices", "check_graph", "peer_acl", "federation_acl", "write_acl"]
