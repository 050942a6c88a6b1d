"""What idle nodes cost when thousands share a process: an idle device blocks on its inbox
instead of waking every half second, and stop() still ends it at once; an edge says it is
online once, not again to every member each time one joins."""

from __future__ import annotations

import threading
import time

import numpy as np

from splitedge.runtime.node import IDLE_WAKE_S


def _device(quiet_warn_s):
    from splitedge.device.agent import DeviceAgent
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    return DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                       edge="e0", data=(np.zeros((2, 8, 8, 1), np.uint8), np.zeros(2, np.int64)),
                       quiet_warn_s=quiet_warn_s)


def test_an_idle_device_blocks_until_stopped_and_stop_wakes_it() -> None:
    agent = _device(quiet_warn_s=None)  # a sim's device: no quiet warning to time
    assert agent.idle_wait(0.5) == IDLE_WAKE_S
    waits: list[float] = []
    inner = agent.next_event
    agent.next_event = lambda timeout: (waits.append(timeout), inner(timeout))[1]  # type: ignore[method-assign]
    loop = threading.Thread(target=agent.run_forever, daemon=True)
    loop.start()
    time.sleep(0.3)
    stopping = time.monotonic()
    agent.stop()
    loop.join(IDLE_WAKE_S / 2)
    assert not loop.is_alive() and time.monotonic() - stopping < IDLE_WAKE_S / 2  # woken, not timed out
    assert waits and set(waits) == {IDLE_WAKE_S}
    assert agent.idle  # the wake-up left behind (if any) does not count as work


def test_a_device_polls_only_while_its_quiet_warning_can_come_due() -> None:
    agent = _device(quiet_warn_s=8.0)
    assert agent.idle_wait(0.5) == 0.5  # not heard from anyone yet: the warning is timed
    agent.enqueue("t", object())  # anything heard ends the warning's watch
    agent.next_event(0.0)
    assert agent.idle_wait(0.5) == IDLE_WAKE_S


def test_an_edge_says_online_once_while_its_devices_join() -> None:
    """Each member's status makes the edge announce its hello (who is live) to the cloud, but
    its own online status only once: sent again each time, every member of an edge of m
    devices received m^2/2 of them while they joined (10,000 devices did not all start)."""
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.protocol.codec import Envelope
    from splitedge.protocol.topics import pattern, topic
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    run, bus = "r", LoopbackBus()
    seen: dict[str, int] = {"status": 0, "hello": 0}
    watcher = LoopbackTransport(bus, role="cloud", client_id="watch")
    watcher.subscribe(pattern(run, "edge", "e0", "up", "#"), lambda t, e: seen.__setitem__(e.kind, seen[e.kind] + 1))
    edge = EdgeAggregator(LoopbackTransport(bus, role="edge", client_id="e0"), run=run, node_id="e0")
    edge.start()
    for i in range(20):
        dev, device = f"d{i}", LoopbackTransport(bus, role="device", client_id=f"d{i}")
        hello = Envelope(kind="hello", run=run, round=0, sender=dev, body={
            "role": "device", "parent": "e0", "samples": 10, "backend": "torch", "classes": np.arange(3)})
        device.publish(topic(run, "device", dev, "up", "hello", to="e0"), hello, retain=True)
        device.publish(topic(run, "device", dev, "up", "status"), Envelope(
            kind="status", run=run, round=0, sender=dev, body={"state": "online", "role": "device"}), retain=True)
        while (event := edge.next_event(0.05)) is not None:
            edge.dispatch(event)
    assert len(edge.roster.live) == 20
    assert seen["hello"] >= 20  # the cloud hears every change of who is live
    assert seen["status"] == 1
