"""What idle nodes cost when thousands share a process: an idle device blocks on its inbox
instead of waking every half second, and stop() still ends it at once; an edge says it is
online once, not again to every member each time one joins."""

from __future__ import annotations

import threading
import time

import numpy as np

from splitedge.runtime.inbox import IDLE_WAKE_S


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


def test_an_edge_with_an_open_round_sleeps_until_the_round_can_next_close_on_time_alone() -> None:
    """An edge checked its round every 0.2 s, every member's presence each time: most of a
    10,000-device sim's CPU. Now it blocks until a message, the round's deadline, or the moment
    a just-gone device stops being awaited; it polls only a round due but not closable yet."""
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    now = [1000.0]
    edge = EdgeAggregator(LoopbackTransport(LoopbackBus(), role="edge", client_id="e0"), run="r", node_id="e0",
                          quiet_warn_s=None)
    edge.rounds.clock = edge.roster.presence.clock = lambda: now[0]
    assert edge._wait_s(0.2) == IDLE_WAKE_S  # no round: nothing timed
    edge.rounds.open(1, 120.0, {"d0", "d1"})
    assert edge._wait_s(0.2) == IDLE_WAKE_S  # the deadline is further off than the safety net
    now[0] += 100.0
    assert edge._wait_s(0.2) == 20.0  # the deadline
    presence = edge.roster.presence
    presence.update("d0", "online")
    presence.update("d0", "offline")  # gone: awaited for the grace still
    now[0] += 2.0
    assert edge._wait_s(0.2) == presence.grace_s - 2.0  # then the round may close without it
    now[0] += presence.grace_s
    assert presence.next_change_in() is None
    now[0] += 30.0  # past the deadline, but not closed (say, a model it needs is on its way)
    assert edge.rounds.expired() and edge._wait_s(0.2) == 0.2
