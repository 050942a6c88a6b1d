"""ONE contract for every Transport: loopback, MqttTransport+Mosquitto (its own paho thread, or
driven by a shared ClientLoop), MqttTransport+amqtt.

Each test is Prepare / Execute / Assert against real brokers over TCP (no mocks). A new
transport passes by being added to ``IMPLS``.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from splitedge.protocol.accounting import publish_packet_bytes
from splitedge.protocol.codec import Envelope
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport, Transport, wait_for
from splitedge.protocol.topics import pattern, topic

IMPLS = ["loopback", "mosquitto", "mosquitto-loop", "amqtt"]
RUN = "contract"
REPO = Path(__file__).resolve().parents[2]
_ids = itertools.count()


def weights_env(weights: dict[str, np.ndarray], sender: str = "d1") -> Envelope:
    return Envelope("weights", RUN, 3, sender, {"part": "wc", "version": 1, "samples": 10, "weights": weights})


def status_env(state: str, sender: str = "d1") -> Envelope:
    return Envelope("status", RUN, 0, sender, {"state": state, "role": "device"})


class Harness:
    """Creates transports of one implementation and closes them all at teardown."""

    def __init__(self, impl: str, request: pytest.FixtureRequest) -> None:
        self.impl = impl
        self.created: list[Transport] = []
        self.bus = LoopbackBus()
        self.broker = None
        self.loop = None
        if impl == "mosquitto-loop":
            from splitedge.protocol.mqtt_loop import ClientLoop

            self.broker = request.getfixturevalue("mosquitto")
            self.loop = ClientLoop(name="contract-loop")
        elif impl == "mosquitto":
            self.broker = request.getfixturevalue("mosquitto")
        elif impl == "amqtt":
            self.broker = request.getfixturevalue("embedded_broker")

    @property
    def url(self) -> str:
        assert self.broker is not None
        return self.broker.url

    def make(self, role: str = "device", *, will: tuple[str, Envelope] | None = None, **kw) -> Transport:
        client_id = f"{self.impl}-{role}-{next(_ids)}-{os.getpid()}"
        if self.impl == "loopback":
            t: Transport = LoopbackTransport(self.bus, role=role, client_id=client_id, will=will, **kw)
        else:
            from splitedge.protocol.mqtt import MqttTransport

            t = MqttTransport(self.url, client_id=client_id, role=role, will=will, keepalive=5,
                              connect_timeout=5, loop=self.loop, **kw)
        self.created.append(t)
        return t

    def close_all(self) -> None:
        for t in self.created:
            t.close()
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=IMPLS)
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    harness = Harness(request.param, request)
    yield harness
    harness.close_all()


def collector() -> tuple[list[tuple[str, Envelope]], Callable[[str, Envelope], None]]:
    got: list[tuple[str, Envelope]] = []
    return got, lambda t, e: got.append((t, e))


ALL_DTYPES = ["f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "bool"]


def test_round_trip_every_dtype_scalar_empty_and_weight_map(h: Harness) -> None:
    rng = np.random.default_rng(0)
    weights = {f"w_{dt}": (rng.standard_normal((3, 4)) * 50).astype(dt) for dt in ALL_DTYPES}
    weights |= {"scalar_f4": np.array(1.5, dtype="f4"), "scalar_i8": np.array(-7, dtype="i8"),
                "empty_f4": np.zeros((0, 5), dtype="f4"), "empty_u1": np.zeros((0,), dtype="u1"),
                "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype("f4")}
    pub, sub = h.make("device"), h.make("edge")
    got, handler = collector()
    sub.subscribe(pattern(RUN, tier="device"), handler)
    t = topic(RUN, "device", "d1", "up", "weights")

    pub.publish(t, weights_env(weights))

    assert wait_for(lambda: got, 5)
    recv_topic, env = got[0]
    assert recv_topic == t and env.kind == "weights" and env.round == 3
    out = env.body["weights"]
    assert list(out) == list(weights)  # insertion order kept
    for name, arr in weights.items():
        assert out[name].dtype == arr.dtype.newbyteorder("<") and out[name].shape == arr.shape, name
        np.testing.assert_array_equal(out[name], arr)
        assert not out[name].flags.writeable


def test_large_payload_over_8_mib(h: Harness) -> None:
    big = np.random.default_rng(1).standard_normal(9 * 1024 * 1024 // 4).astype("f4")
    pub, sub = h.make("device"), h.make("edge")
    got, handler = collector()
    sub.subscribe(pattern(RUN, kind="weights"), handler)

    pub.publish(topic(RUN, "device", "d1", "up", "weights"), weights_env({"x": big}))

    assert wait_for(lambda: got, 20)
    np.testing.assert_array_equal(got[0][1].body["weights"]["x"], big)


def test_wildcards_route_and_unsubscribe_stops(h: Harness) -> None:
    pub, sub = h.make("cloud"), h.make("device")
    down, on_down = collector()
    everything, on_all = collector()
    sub.subscribe(pattern(RUN, tier="cloud", direction="down"), on_down)
    sub.subscribe(f"splitedge/{RUN}/cloud/#", on_all)

    pub.publish(topic(RUN, "cloud", "c", "down", "status"), status_env("online", "c"))
    pub.publish(topic(RUN, "cloud", "c", "up", "status"), status_env("online", "c"))
    pub.publish(topic(RUN, "edge", "e", "down", "status"), status_env("online", "e"))  # matches neither
    assert wait_for(lambda: len(everything) == 2 and len(down) == 1, 5)

    sub.unsubscribe(f"splitedge/{RUN}/cloud/#")
    pub.publish(topic(RUN, "cloud", "c", "down", "status"), status_env("offline", "c"), wait=5)
    assert wait_for(lambda: len(down) == 2, 5)
    assert len(everything) == 2


def test_retained_message_reaches_late_subscriber_and_can_be_cleared(h: Harness) -> None:
    pub = h.make("cloud")
    cloud = f"c{next(_ids)}"
    t = topic(RUN, "cloud", cloud, "down", "status")
    pub.publish(t, status_env("online", cloud), retain=True, wait=5)

    late = h.make("device")
    got, handler = collector()
    late.subscribe(t, handler)
    assert wait_for(lambda: got, 5)
    assert got[0][1].body["state"] == "online"

    pub.publish_raw(t, b"", retain=True, wait=5)  # an empty retained payload clears it
    # a live subscriber may see the clearing notice (Mosquitto forwards it; amqtt not always):
    # as bytes in, never as a rejected message or a handler call
    wait_for(lambda: late.counters.snapshot()["in"]["status"]["messages"] == 2, 2)
    assert not late.rejected and len(got) == 1
    later = h.make("device")
    got2, handler2 = collector()
    later.subscribe(t, handler2)
    assert not wait_for(lambda: got2, 0.3)


def test_malformed_payload_rejected_counted_and_transport_survives(h: Harness) -> None:
    pub, sub = h.make("device"), h.make("edge")
    got, handler = collector()
    sub.subscribe(pattern(RUN, kind="status"), handler)
    t = topic(RUN, "device", "d1", "up", "status")

    pub.publish_raw(t, b"\xc1garbage not msgpack")
    pub.publish_raw(t, b"\x81\xa1v\x01")  # valid msgpack, not an envelope
    pub.publish(t, status_env("online"))

    assert wait_for(lambda: got and sum(sub.rejected.values()) == 2, 5)
    assert len(got) == 1 and sub.handler_errors == 0
    assert all(rule.split(".")[0] in ("frame", "envelope") for rule in sub.rejected), sub.rejected
    assert sub.counters.snapshot()["in"]["status"]["messages"] == 3  # rejected bytes still arrived


def test_handler_that_raises_is_counted_and_loop_survives(h: Harness) -> None:
    pub, sub = h.make("device"), h.make("edge")
    got: list[int] = []

    def flaky(t: str, env: Envelope) -> None:
        got.append(env.round)
        if env.round == 0:
            raise RuntimeError("boom (expected by the test)")

    sub.subscribe(pattern(RUN, kind="status"), flaky)
    t = topic(RUN, "device", "d1", "up", "status")
    for rnd in range(3):
        pub.publish(t, Envelope("status", RUN, rnd, "d1", {"state": "online", "role": "device"}))

    assert wait_for(lambda: len(got) == 3, 5)
    assert got == [0, 1, 2] and sub.handler_errors == 1 and not sub.rejected


def test_payload_over_max_bytes_rejected(h: Harness) -> None:
    pub, sub = h.make("device"), h.make("edge", max_bytes=10_000)
    got, handler = collector()
    sub.subscribe(pattern(RUN, kind="weights"), handler)
    t = topic(RUN, "device", "d1", "up", "weights")

    pub.publish(t, weights_env({"x": np.zeros(20_000, dtype="u1")}))
    pub.publish(t, weights_env({"x": np.zeros(10, dtype="u1")}))

    assert wait_for(lambda: got and sub.rejected, 5)
    assert sub.rejected == {"frame.too_large": 1} and len(got) == 1


def test_byte_counters_agree_between_publisher_and_subscriber(h: Harness) -> None:
    pub, sub = h.make("device"), h.make("edge")
    got, handler = collector()
    sub.subscribe(pattern(RUN, kind="weights"), handler)
    t = topic(RUN, "device", "d1", "up", "weights")
    sizes = []
    for i in range(5):
        env = weights_env({"x": np.full(100 * (i + 1), i, dtype="f4")})
        pub.publish(t, env)
        sizes.append(len(__import__("splitedge.protocol.codec", fromlist=["encode"]).encode(env)))

    assert wait_for(lambda: len(got) == 5, 5)
    out, inn = pub.counters.snapshot()["out"]["weights"], sub.counters.snapshot()["in"]["weights"]
    assert out == inn
    assert out["payload"] == sum(sizes)
    assert out["packet"] == sum(publish_packet_bytes(t, s, 1) for s in sizes)
    assert pub.counters.role == "device" and sub.counters.role == "edge"
    assert sub.counters.snapshot()["control"]["out"] > 0  # SUBSCRIBE + PUBACKs


def test_close_offline_publishes_status(h: Harness) -> None:
    node_id = f"d{next(_ids)}"
    t = topic(RUN, "device", node_id, "up", "status")
    watcher = h.make("edge")
    got, handler = collector()
    watcher.subscribe(t, handler)
    node = h.make("device", will=(t, status_env("offline", node_id)))
    node.publish(t, status_env("online", node_id), retain=True)

    node.close(offline=True)

    assert wait_for(lambda: [e.body["state"] for _, e in got] == ["online", "offline"], 5)


def _crash_client(h: Harness, will_topic: str, node_id: str) -> Callable[[], None]:
    """Start a node with a last will, return a function that kills it without a DISCONNECT."""
    if h.impl == "loopback":
        node = h.make("device", will=(will_topic, status_env("offline", node_id)))
        return node.abort  # type: ignore[attr-defined]
    loop = "ClientLoop()" if h.loop is not None else "None"
    script = textwrap.dedent(f"""
        import sys, time
        from splitedge.protocol.codec import Envelope
        from splitedge.protocol.mqtt import MqttTransport
        from splitedge.protocol.mqtt_loop import ClientLoop
        env = Envelope("status", {RUN!r}, 0, {node_id!r}, {{"state": "offline", "role": "device"}})
        t = MqttTransport({h.url!r}, client_id="crasher-{next(_ids)}", role="device",
                          will=({will_topic!r}, env), keepalive=5, loop={loop})
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def kill() -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
    return kill


def test_last_will_published_when_client_dies(h: Harness) -> None:
    node_id = f"dead{next(_ids)}"
    will_topic = topic(RUN, "device", node_id, "up", "status")
    watcher = h.make("edge")
    got, handler = collector()
    watcher.subscribe(will_topic, handler)
    kill = _crash_client(h, will_topic, node_id)
    assert not wait_for(lambda: got, 0.1)  # no will while alive

    kill()

    assert wait_for(lambda: got, 5)
    assert got[0][1].body == {"state": "offline", "role": "device"}
    late = h.make("cloud")  # the will is retained: a late subscriber learns the node is down
    got2, handler2 = collector()
    late.subscribe(will_topic, handler2)
    assert wait_for(lambda: got2, 5)
