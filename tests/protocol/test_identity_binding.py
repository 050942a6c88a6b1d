"""Identity under the client-id binding (issue 56, item 2), on a Mosquitto started from the files
`splitedge data split --acl` writes (`use_username_as_clientid true`), as deploy/README.md says.

With the binding every connection of a login gets the login as its client id, so a start-up check
that connects with the node's own login takes the running node's connection (its will says
offline) and the two processes then evict each other. The check reads the node's retained status
with its probe login (`<login>.probe`, same password, reads only that status) instead: a second
process with a live id is refused and the first is never disconnected. A login used for another
node's id is refused in one line before the node connects, and every `splitedge watch` running
at a time has a login of its own."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from brokers import require_mosquitto, wait_until
from generated_broker import Shards, generated_shards, standalone
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import topic
from splitedge.runtime.node import Node
from splitedge.runtime.session import check_identity_free, connect

RUN = "ident"


@pytest.fixture(scope="module")
def shards() -> Iterator[Shards]:
    require_mosquitto()
    with generated_shards(RUN) as generated:
        generated.make_readable()
        with standalone(generated):
            yield generated


class Running:
    """A node holding its id (its own login, its will armed, status online), and a watcher that
    counts every status of that id: an `offline` means the node was evicted (its will fired)."""

    def __init__(self, shards: Shards, tier: str, node_id: str, watcher: str = "watcher-3") -> None:
        self.url = f"mqtt://{node_id}@127.0.0.1:{shards.port}"
        self.password = shards.password(node_id)
        self.transport = connect(self.url, run=RUN, tier=tier, node_id=node_id, password=self.password,
                                 reconnect_min=0.1, reconnect_max=0.5)
        Node(run=RUN, tier=tier, node_id=node_id).announce_online(self.transport)
        self.states: list[str] = []
        self.watch = MqttTransport(shards.url(watcher), client_id="counts", role="watcher")
        self.watch.subscribe(topic(RUN, tier, node_id, "up", "status"), lambda t, e: self.states.append(e.body["state"]))
        assert wait_until(lambda: self.states == ["online"], 5), self.states

    def assert_never_evicted(self) -> None:
        time.sleep(1.5)  # an evicted node would have reconnected (and said online again) by now
        assert self.transport.reconnects == 0 and self.transport.connected
        assert self.states == ["online"], self.states

    def close(self) -> None:
        self.watch.close()
        self.transport.close(offline=True)


@pytest.mark.parametrize(("tier", "node_id"), [("device", "d0"), ("edge", "e0"), ("cloud", "cloud")])
def test_a_second_process_with_a_live_id_is_refused_and_the_first_is_not_evicted(shards: Shards, tier: str,
                                                                               node_id: str) -> None:
    running = Running(shards, tier, node_id)
    try:
        # Execute: the start-up check of a second process with the same login (password from its file)
        with pytest.raises(ValueError, match=f"another {tier} with id '{node_id}' is online"):
            check_identity_free(running.url, run=RUN, tier=tier, node_id=node_id, password=running.password)
        # Assert: the running node kept its connection; its will never fired
        running.assert_never_evicted()
    finally:
        running.close()
    # and once it stopped cleanly, the id is free again (the check passes, and takes nothing)
    check_identity_free(running.url, run=RUN, tier=tier, node_id=node_id, password=running.password)


def _device(shards: Shards, login: str, node_id: str) -> subprocess.CompletedProcess:
    """`splitedge device` as deploy/README.md starts one: its login in the URL, its password file."""
    return subprocess.run(
        [sys.executable, "-m", "splitedge", "device", "--broker", f"mqtt://{login}@127.0.0.1:{shards.port}",
         "--password-file", str(shards.folder / "logins" / f"{login}.password"), "--run", RUN, "--id", node_id,
         "--edge", "e0", "--data", str(shards.folder / f"shard-{node_id}.npz"), "--backend", "onnx"],
        capture_output=True, text=True, timeout=120)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error" in line.lower() or "warning" in line.lower()]


def test_a_device_started_beside_a_live_one_exits_in_one_line_and_the_live_one_stays(shards: Shards) -> None:
    running = Running(shards, "device", "d1")
    try:
        proc = _device(shards, "d1", "d1")
        assert proc.returncode == 2, proc.stderr
        assert _error_lines(proc) == [f"splitedge device: error: another device with id 'd1' is online in run "
                                      f"'{RUN}' on mqtt://d1@127.0.0.1:{shards.port}; stop it, or give this one "
                                      f"another --id or --run (a process killed without a clean exit counts as "
                                      f"online until the broker's keepalive notices, about a minute; --takeover "
                                      f"skips this check)"], proc.stderr
        running.assert_never_evicted()
    finally:
        running.close()


def test_a_login_used_for_another_nodes_id_is_refused_in_one_line_at_start(shards: Shards) -> None:
    # d1's login (and password) with --id d0: the broker would deny every topic of d0 to it, and
    # the device would wait for ever; it is refused before it connects
    started = time.monotonic()
    proc = _device(shards, "d1", "d0")
    assert proc.returncode == 2, proc.stderr
    lines = _error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("splitedge device: error: "), proc.stderr
    assert "does not let login 'd1' read device d0's status" in lines[0] and "its own login" in lines[0], lines
    assert time.monotonic() - started < 60


def test_watchers_run_side_by_side_each_with_its_login(shards: Shards) -> None:
    from splitedge.watch_cli import Watcher

    # Prepare: as deploy/README.md shows, one watch per watcher login, at the same time
    watchers = [Watcher(shards.url(login), RUN) for login in ("watcher", "watcher-2")]
    try:
        time.sleep(0.5)
        node = connect(shards.url("d0"), run=RUN, tier="device", node_id="d0")
        Node(run=RUN, tier="device", node_id="d0").announce_online(node)
        # Assert: both see the device come online, and neither took the other's connection
        assert wait_until(lambda: all(any("d0" in line for _, line in list(w.lines.queue)) for w in watchers), 10), \
            [list(w.lines.queue) for w in watchers]
        time.sleep(2.0)
        assert [w.transport.reconnects for w in watchers] == [0, 0]
        assert all(w.transport.connected for w in watchers) and all(w.link_news() is None for w in watchers)
        node.close(offline=True)
    finally:
        for w in watchers:
            w.close()


def test_two_watches_with_one_login_say_so_instead_of_losing_events_silently(shards: Shards) -> None:
    from splitedge.watch_cli import Watcher

    first, second = Watcher(shards.url("watcher-3"), RUN), Watcher(shards.url("watcher-3"), RUN)
    try:
        # the binding hands the login's one client id to each in turn; the watch names why
        with pytest.raises(ValueError, match="another connection uses the login 'watcher-3'.*its own login"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for w in (first, second):
                    w.link_news()
                time.sleep(0.2)
    finally:
        first.close()
        second.close()
