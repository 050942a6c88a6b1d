"""Joining an edge over a real Mosquitto: a device's hello and status reach its own edge only,
and a device that restarted at another edge is not taken back by its old one."""

from __future__ import annotations

import time

from splitedge.methods.data.datasets import load_dataset
from splitedge.device.agent import DeviceAgent
from splitedge.edge.aggregator import EdgeAggregator
from splitedge.protocol.transport import wait_for

from live_nodes import LiveNodes


def device_messages_in(edge: EdgeAggregator, kind: str) -> int:
    return edge.down.counters.snapshot()["in"].get(kind, {}).get("messages", 0)


def test_a_device_talks_to_its_own_edge_only_and_a_restart_elsewhere_moves_it_for_good(mosquitto) -> None:
    run = "membership"
    (x, y), _, _ = load_dataset("digits")
    data = (x[:40], y[:40])
    with LiveNodes(lambda _id: mosquitto.url, run) as live:
        # Prepare: two edges, one device at e0
        e0 = live.start(EdgeAggregator(live.transport("edge", "e0"), run=run, node_id="e0"))
        e1 = live.start(EdgeAggregator(live.transport("edge", "e1"), run=run, node_id="e1"))
        first = DeviceAgent(live.transport("device", "d0"), run=run, node_id="d0", edge="e0", data=data)
        live.start(first)
        assert wait_for(lambda: e0.roster.live == {"d0"}, 10), e0.members
        # Assert: e1 received neither its hello nor its status (no wildcard reaches every edge)
        time.sleep(0.5)
        assert device_messages_in(e1, "hello") == 0 and device_messages_in(e1, "status") == 0
        assert e1.members == {}

        # Execute: the device stops and is started again at e1 (same id, another --edge)
        first.stop()
        first.transport.close()  # a clean exit: status offline; its hello to e0 stays retained
        second = DeviceAgent(live.transport("device", "d0"), run=run, node_id="d0", edge="e1", data=data)
        live.start(second)
        # Assert: e1 has it, e0 let it go
        assert wait_for(lambda: e1.roster.live == {"d0"} and "d0" not in e0.members, 10), (e0.members, e1.members)

        # Execute: e0 restarts; d0's old hello to e0 is still retained on the broker
        e0.stop()
        e0.down.close()
        again = live.start(EdgeAggregator(live.transport("edge", "e0"), run=run, node_id="e0"))
        # Assert: the restarted e0 reads the old hello, then d0's newer one to e1, and stays
        # without it (no rejoin loop on the retained hello), while e1 keeps it
        assert wait_for(lambda: device_messages_in(again, "hello") >= 2, 10), again.down.counters.snapshot()
        time.sleep(1.0)
        assert again.members == {} and e1.roster.live == {"d0"}, (again.members, e1.members)
        joins = device_messages_in(again, "hello")
        time.sleep(1.0)
        assert device_messages_in(again, "hello") == joins  # settled: nothing keeps resubscribing
