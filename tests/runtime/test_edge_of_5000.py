"""An edge of 5,000 live devices (issue 30, item 8), end to end over the loopback bus: its hello
lists them all, the cloud's handler takes it and counts 5,000 live devices, and a round that
draws all of them reaches the edges. Before, both messages were refused by every receiver
(`frame.invalid`: a msgpack array holds at most 1,024 items here); now they travel paged.

No 5,000 clients: 4,999 members are put in the edge's roster directly (runtime/membership.py),
and the last one joins through the edge's handler with a hello and a status, as a device does.
"""

from __future__ import annotations

import numpy as np

from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
from splitedge.cloud.options import build_run_config
from splitedge.edge.aggregator import EdgeAggregator
from splitedge.methods.contract import RoundPlan
from splitedge.methods.data.datasets import load_dataset
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import pattern, topic
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

RUN, DEVICES = "big-edge", 5000


def device_ids() -> list[str]:
    return [f"d{i:04d}" for i in range(DEVICES)]


def join(bus: LoopbackBus, edge: EdgeAggregator, dev: str) -> None:
    """A device's addressed hello and its status (both retained, as a device sends them), then
    the edge handles what reached its inbox until it has nothing left to do."""
    device = LoopbackTransport(bus, role="device", client_id=dev)
    hello = Envelope(kind="hello", run=RUN, round=0, sender=dev, body={
        "role": "device", "parent": edge.node_id, "samples": 10, "backend": "torch",
        "classes": np.arange(3, dtype=np.int64)})
    device.publish(topic(RUN, "device", dev, "up", "hello", to=edge.node_id), hello, retain=True)
    online = Envelope(kind="status", run=RUN, round=0, sender=dev, body={"state": "online", "role": "device"})
    device.publish(topic(RUN, "device", dev, "up", "status"), online, retain=True)
    while (event := edge.next_event(0.2)) is not None:
        edge.dispatch(event)


def test_an_edge_of_5000_devices_is_heard_by_the_cloud() -> None:
    # Prepare: a cloud that waits for 5,000 devices, an edge with 4,999 already in its roster
    _, test, info = load_dataset("digits", max_train=50, max_test=50)
    bus = LoopbackBus()
    settings = CloudSettings(method="fedavg", rounds=1, config=build_run_config("fedavg", info, None, 0, {}),
                             min_devices=DEVICES, join_timeout_s=10.0)
    cloud = CloudCoordinator(LoopbackTransport(bus, role="cloud", client_id="cloud"), settings, run=RUN, test=test)
    edge = EdgeAggregator(LoopbackTransport(bus, role="edge", client_id="e0"), run=RUN, node_id="e0")
    cloud.start()
    edge.start()
    *early, last = device_ids()
    for dev in early:
        edge.roster.samples[dev], edge.roster.addresses[dev] = 10, set()
        edge.roster.presence.update(dev, "online")
    # Execute: the last device joins through the edge's handler; its status makes the edge
    # announce its hello, now listing 5,000 live members
    join(bus, edge, last)
    cloud.edges.wait_for_edges(RUN, None)  # TimeoutError unless the cloud took the hello
    # Assert: the cloud took the whole list, and nobody refused a frame
    assert cloud.view.members["e0"] == device_ids()
    assert cloud.edges.live_devices() == DEVICES and cloud.online_devices() == set(device_ids())
    assert cloud.transport.rejected == {} and edge.down.rejected == {} and edge.errors == 0 and cloud.errors == 0

    # Execute: a round that draws every device, as client sampling of 5,000 would
    rounds: list[Envelope] = []
    probe = LoopbackTransport(bus, role="edge", client_id="probe")
    probe.subscribe(pattern(RUN, "cloud", "cloud", "down", "round"), lambda t, env: rounds.append(env))
    cloud.send(cloud.transport, "down", "round", cloud.plan(1, tuple(device_ids())).to_body(), round_=1, retain=True)
    # Assert: it arrives whole
    assert len(rounds) == 1 and RoundPlan.from_body(1, rounds[0].body).participants == tuple(device_ids())
    assert probe.rejected == {}
