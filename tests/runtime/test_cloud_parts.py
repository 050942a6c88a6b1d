"""The cloud's three parts and their seams (issue 52, item 4): the federation view takes the
edges' hello and status and places devices, the committer's state carries a restarted cloud on
where the first one stood (the merged round and its outbox too), and the coordinator wires them
together behind the surface its callers read. Over the loopback bus: no broker, no round."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from splitedge.cloud import resume
from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
from splitedge.methods.config import RunConfig
from splitedge.methods.contract import DEVICES, Message, Placement
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.protocol.codec import Envelope
from splitedge.protocol.topics import pattern
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

from parts import SPEC

RUN = "parts"


def _cloud(bus: LoopbackBus, out: Path | None = None, saved: resume.CloudState | None = None) -> CloudCoordinator:
    settings = CloudSettings(method="fedavg", rounds=5, config=RunConfig(SPEC, FedAvgConfig()), out_dir=out, seed=3)
    return CloudCoordinator(LoopbackTransport(bus, role="cloud", client_id="cloud"), settings, run=RUN,
                            test=(np.zeros((1, 8, 8, 1), np.uint8), np.zeros(1, np.int64)), resume_from=saved)


def _from(edge: str, kind: str, body: dict) -> Envelope:
    return Envelope(kind=kind, run=RUN, round=0, sender=edge, body=body)


def test_the_federation_view_takes_hello_and_status_and_nothing_else() -> None:
    # Prepare
    edges = _cloud(LoopbackBus()).edges
    # Execute
    heard = [edges.heard(_from("e0", "hello", {"role": "edge", "parent": "cloud", "members": ["d0", "d1"]}), "cloud"),
             edges.heard(_from("e1", "hello", {"role": "edge", "parent": "other", "members": ["d2"]}), "cloud"),
             edges.heard(_from("e0", "status", {"state": "online", "role": "edge"}), "cloud"),
             edges.heard(_from("e0", "done", {"phase": "train", "info": {}}), "cloud")]
    # Assert: a hello to another cloud is not this cloud's membership; a round's message is the driver's
    assert heard == [True, False, True, False]
    assert edges.view.members == {"e0": ["d0", "d1"]} and edges.live == {"e0"}
    assert edges.online_devices() == {"d0", "d1"}


def test_placing_a_device_sends_its_assign_retained_and_records_where_it_is() -> None:
    # Prepare: d1 already listed by e1 alone, so the wait for it ends at once
    bus = LoopbackBus()
    cloud = _cloud(bus)
    cloud.view.members.update({"e0": ["d0"], "e1": ["d1"]})
    # Execute
    cloud.edges.place({"d1": Placement("e1", groups=("g1",), peers=("d0",))})
    got: list[tuple[str, Envelope]] = []
    watcher = LoopbackTransport(bus, role="device", client_id="d1")
    watcher.subscribe(pattern(RUN, "cloud", "cloud", "down", "assign", to="d1"), lambda t, env: got.append((t, env)))
    # Assert: retained (a device that joins later still hears it), in the view the part reads
    assert [env.body for _, env in got] == [{"edge": "e1", "groups": ["g1"], "peers": ["d0"]}]
    assert cloud.view.placements == {"d1": Placement("e1", ("g1",), ("d0",))}


def test_a_restarted_cloud_carries_on_from_the_committed_state(tmp_path: Path) -> None:
    # Prepare: a cloud after round 2, with a placement, its randomness used, round 3 merged and
    # one message of it committed (not yet published)
    first = _cloud(LoopbackBus(), tmp_path)
    first.round, first.edges.enough = 2, 2
    first.view.placements["d0"] = Placement("e1", ("g",))
    first.rng.random(7)
    plan = first.plan(3, ("d0",))
    first.committer.hold(plan, {"accuracy": 0.5}, [], {"device": {}})
    sent = Message("weights", {"model": {"w": np.arange(4, dtype=np.float32)}}, DEVICES, slot="model")
    first.committer.commit([sent])
    # Execute: the same cloud started again on its folder
    second = _cloud(LoopbackBus(), tmp_path, resume.load(tmp_path))
    # Assert: the same session and round, a higher attempt, the merged round and its outbox to finish
    assert (second.session, second.round, second.attempt) == (first.session, 2, 1)
    assert second.edges.enough == 2 and second.view.placements == {"d0": Placement("e1", ("g",))}
    assert second.rng.random() == first.rng.random()
    assert second.committer.pending["round"] == 3 and second.committer.pending["metrics"] == {"accuracy": 0.5}
    assert second.committer.pending["plan"] == plan.to_body()
    [again] = second.committer.outbox
    assert (again.kind, again.to, again.slot) == ("weights", DEVICES, "model")
    assert np.array_equal(again.body["model"]["w"], np.arange(4, dtype=np.float32))
    assert second.history == [] and second.committer.last_finished_round() == 0


def test_without_a_folder_nothing_is_committed_and_the_surface_reads_the_parts() -> None:
    # Prepare
    cloud = _cloud(LoopbackBus())
    # Execute: a merged round's messages with no --out
    cloud.committer.hold(cloud.plan(1), {}, [], {})
    cloud.committer.commit([Message("weights", {"model": {}}, DEVICES, slot="model")])
    # Assert: no outbox to carry (nothing is saved), and the coordinator's attributes are its parts'
    assert cloud.committer.outbox == [] and cloud.committer.pending["round"] == 1
    assert cloud.history is cloud.committer.history
    assert cloud.calibration is cloud.driver.calibration and cloud.left is cloud.edges.left
