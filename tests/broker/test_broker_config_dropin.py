"""The broker config `splitedge data split --acl` writes (issue 56, item 3) works as deploy/README.md
says to use it: on its own (`mosquitto -c shards/broker.conf`) and copied into the include_dir of a
main config that has a listener of its own. Mosquitto 2.0 applies a per-listener option of an
included file to its default listener unless the file's own `listener` line comes first, and then
opens a second listener on 1883 (or does not start when 1883 is taken); broker.conf opens its own
listener and keeps `use_username_as_clientid` right after it. Started as root, Mosquitto reads the
password file as its own user: the chown line broker.conf gives makes it readable."""

from __future__ import annotations

import time

import pytest

from brokers import require_mosquitto, wait_until
from generated_broker import as_root, broker_user_exists, generated_shards, included, standalone
from splitedge.protocol.broker import free_port
from splitedge.protocol.mqtt import MqttTransport

RUN = "dropin"


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    require_mosquitto()


def test_standalone_broker_conf_opens_its_listener_only_and_its_chown_line_lets_the_broker_read_the_logins() -> None:
    with generated_shards(RUN) as shards:
        conf = (shards.folder / "broker.conf").read_text()
        lines = [line for line in conf.splitlines() if line and not line.startswith("#")]
        # per-listener options right after their own listener line, in the same file
        assert lines[0] == f"listener {shards.port} 127.0.0.1" and lines[1] == "use_username_as_clientid true"
        if as_root() and broker_user_exists():
            # as written (mode 600, ours) the broker, once it is its own user, cannot read the logins
            with pytest.raises(RuntimeError, match="pwfile"):
                standalone(shards).start()
        shards.make_readable()
        with standalone(shards) as broker:
            assert broker.ports() == {shards.port}, broker.log_text()
            client = MqttTransport(shards.url("e0"), client_id="anything", role="edge")
            client.close()
            with pytest.raises(ConnectionError, match="authentication failed"):
                MqttTransport(f"mqtt://127.0.0.1:{shards.port}", client_id="anonymous", role="edge",
                              connect_timeout=3)


def test_included_after_a_listener_line_it_opens_no_listener_on_1883_and_binds_each_login_to_its_client_id() -> None:
    admin = free_port()
    with generated_shards(RUN) as shards:
        shards.make_readable()
        with included(shards, admin) as broker:
            # Assert: the main config's listener and broker.conf's, nothing on 1883 or anywhere else
            assert broker.ports() == {admin, shards.port}, broker.log_text()
            # The binding holds on the nodes' listener: d0's login connecting five times with edge
            # e0's client id does not take e0's connection (its client id is its login, d0) ...
            edge = MqttTransport(shards.url("e0"), client_id=f"{RUN}-edge-e0", role="edge", reconnect_min=0.1)
            try:
                for _ in range(5):
                    MqttTransport(shards.url("d0"), client_id=f"{RUN}-edge-e0", role="device").close()
                    time.sleep(0.2)
                time.sleep(1.5)  # a dropped edge would be back within its reconnect delay
                assert edge.reconnects == 0 and edge.connected
                # ... because a login can only be its own client id: a second connection of e0's
                # login, whatever client id it asks for, replaces the first
                second = MqttTransport(shards.url("e0"), client_id="another-id", role="edge")
                try:
                    assert wait_until(lambda: edge.reconnects >= 1 or not edge.connected, 5)
                finally:
                    second.close()
            finally:
                edge.close()


def test_the_listener_is_the_port_of_broker_unless_given() -> None:
    from splitedge.data_cli import listener_of

    assert listener_of(None, "mqtt://edge-site.local:1884") == (None, 1884)
    assert listener_of(None, "mqtts://edge-site.local") == (None, 8883)
    assert listener_of("10.0.0.5:1883", "mqtt://x:1") == ("10.0.0.5", 1883)
    assert listener_of("1883", "mqtt://x:1") == (None, 1883)
    for bad in ("", "host:", "1883x", "a:70000"):
        with pytest.raises(ValueError, match="--listener"):
            listener_of(bad, "mqtt://x:1")
