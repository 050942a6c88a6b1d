"""The cloud's committer: what it has committed and what it holds until it does, and what it
writes into its `--out` folder: each round's record (metrics.jsonl), the served model's
checkpoint and the resume state, in that order, the last being the round's commit point
(cloud/resume.py: a restarted cloud carries on after the last round it finds committed).

The round driver (cloud/driver.py) decides when; Committer holds the state and puts it
together, RunWriter only writes it and turns a write that fails into one error naming the folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from splitedge.cloud import resume
from splitedge.exporters.checkpoint import model_metadata
from splitedge.methods import snapshot
from splitedge.methods.contract import Message, RoundPlan, To
from splitedge.protocol.done import dones
from splitedge.runtime.node import status
from splitedge.runtime.outputs import dumps, save_checkpoint
from splitedge.runtime.records import round_rejections


class RunWriter:
    """The run folder of a cloud, or nothing at all when it has none (`out_dir` None)."""

    def __init__(self, out_dir: Path | None, step: Callable[[str, int], None] = lambda point, round_: None) -> None:
        self.out_dir = out_dir
        self.step = step  # the cloud's named steps (its mods: crash points)

    def round(self, record: Mapping[str, Any], model: Callable[[], Mapping[str, np.ndarray]],
              metadata: Callable[[], dict[str, str]], state: Callable[[], resume.CloudState]) -> None:
        """Append the round's record, write the served model with its metadata, then commit the
        state; each of `model`, `metadata` and `state` is asked for only when there is a folder."""
        out = self.out_dir
        if out is None:
            return
        try:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "a") as fh:
                fh.write(dumps(record) + "\n")
            self.step("metrics", record["round"])
            save_checkpoint(out / "model.safetensors", model(), metadata())
            self.step("checkpoint", record["round"])
            resume.save(out, state())
        except OSError as exc:  # "[Errno 28] No space left on device" named no file
            raise OSError(exc.errno, f"cannot write round {record['round']} into {out}: {exc.strerror or exc}") from exc

    def commit(self, state: Callable[[], resume.CloudState]) -> None:
        """Commit the state alone (a merged round's outbox before it is published; the run's end)."""
        if self.out_dir is not None:
            resume.save(self.out_dir, state())


class Committer:
    """A cloud's rounds as committed: their records (`history`), the round merged but not yet
    written (`pending`) with what it published since its merge (`outbox`), and the resume state
    a restarted cloud carries on from (cloud/resume.py). `cloud` is the coordinator, whose state
    (session, round, part, randomness, edges, downlink) a commit saves and a restore sets."""

    def __init__(self, cloud: Any) -> None:
        self.cloud = cloud
        self.writer = RunWriter(cloud.settings.out_dir, cloud.mods.step)  # what the run folder gets
        self.history: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # the round merged but not yet written (resume.CloudState)
        self.outbox: list[Message] = []  # what that round published since its merge, committed first

    def hold(self, plan: RoundPlan, metrics: dict[str, Any], reports: list[Any], losses: dict[str, Any]) -> None:
        """Round `plan` merged: what its record takes from the merge, until it is written."""
        self.pending = {"round": plan.round, "plan": plan.to_body(), "metrics": metrics, "edges": len(reports),
                        "devices": devices_reported(reports), "losses": losses}
        self.outbox = []

    def commit(self, messages: list[Message]) -> None:
        """Before `messages` of the merged round leave: into its outbox, saved with the part's
        state, so that a restarted cloud publishes them again (none is forgotten)."""
        if messages and self.pending is not None and self.cloud.settings.out_dir is not None:
            self.outbox.extend(messages)
            self.save(last_round=self.pending["round"] - 1)
            self.cloud.mods.step("committed", self.pending["round"])

    def record(self, plan: RoundPlan, reports: list[Any], metrics: dict[str, Any], started: float,
               counts: Mapping[str, int]) -> dict[str, Any]:
        """The merged round's record (metrics.jsonl): its metrics (its mods' entries among them:
        costs, failures, privacy spent), and what it carried and refused (`counts`: its phases'
        messages by fate)."""
        c, pending = self.cloud, self.pending
        taking_part = len(plan.participants) if plan.participants else len(c.edges.online_devices())
        if pending.get("devices") is not None:  # the devices whose training phase reached the cloud
            metrics["devices_reported"] = pending["devices"]
        metrics["served_head"] = self.served_head()  # what the checkpoint of this round carries
        return {"round": plan.round, **metrics, "edges": pending["edges"], "participants": taking_part,
                "round_seconds": time.monotonic() - started, "versions": dict(plan.versions),
                "directives": dict(plan.directives), "loss": pending["losses"], "rounds": dict(counts),
                "rejected": round_rejections(c.rejections([c.transport]), reports),
                "bytes": c.transport.counters.snapshot()}

    def write(self, record: dict[str, Any]) -> None:
        """The round's end: its record, the served model and the state written (the commit point)."""
        self.pending, self.outbox = None, []
        self.writer.round(record, self.cloud.part.state_for_checkpoint, lambda: self.metadata(record), self.state)
        self.history.append(record)

    def save(self, finished: bool = False, last_round: int | None = None) -> None:
        """Commit the run as it stands; with a merged round pending, `last_round` is the one
        before it and its outbox is saved too."""
        self.writer.commit(lambda: self.state(finished, last_round))

    def metadata(self, record: dict[str, Any]) -> dict[str, str]:
        """The round and method, and what `splitedge export` rebuilds and feeds the network from,
        so it needs nothing but the file (exporters/checkpoint.py reads it back)."""
        c = self.cloud
        spec = c.method.spec
        return {"round": str(record["round"]), "method": c.settings.method,
                **model_metadata(model=spec.model, dataset=c.settings.dataset, channels=spec.channels,
                                 image_size=spec.image_size, num_classes=spec.num_classes, mean=spec.mean,
                                 std=spec.std),
                **c.part.served_metadata()}

    def served_head(self) -> str:
        """Which head the served (checkpointed, exported) model carries: "calibrated" when the
        last calibration's head held every class (methods/calibration/serving.py), else "own"."""
        return "calibrated" if getattr(self.cloud.part, "calibrated", None) is not None else "own"

    def last_finished_round(self) -> int:
        """The last round whose record was written (0 before round 1 finished)."""
        return int(self.history[-1]["round"]) if self.history else 0

    def state(self, finished: bool = False, last_round: int | None = None) -> resume.CloudState:
        """What a restarted cloud carries on from (cloud/resume.py)."""
        c, s = self.cloud, self.cloud.settings
        pending = None if self.pending is None else snapshot.to_plain({
            **self.pending, "outbox": [{"kind": m.kind, "body": m.body, "to": [m.to.role, m.to.node], "slot": m.slot}
                                       for m in self.outbox]})
        return resume.CloudState(
            run=c.run_id, method=s.method, config=c.method.run_config.to_wire(), seed=s.seed,
            session=c.session, round=c.round if last_round is None else last_round, attempt=c.attempt,
            enough_edges=c.edges.enough, placements=snapshot.to_plain(dict(c.view.placements)),
            rng=snapshot.to_plain(c.rng), part=c.part.resume_state(), finished=finished, pending=pending,
            calibration=None if c.calibration.last is None else snapshot.to_plain(list(c.calibration.last)),
            downlink=snapshot.to_plain(c.downlink.state_dict()) if c.downlink.slots else None)

    def restore(self, saved: resume.CloudState) -> None:
        """Carry on the run of `saved` (its session, round, part and randomness)."""
        c = self.cloud
        c.session, c.round, c.attempt = saved.session, saved.round, saved.attempt + 1
        c.edges.enough = saved.enough_edges
        c.view.placements = snapshot.from_plain(saved.placements)
        c.part.restore_state(saved.part)
        c.rng.bit_generator.state = snapshot.from_plain(saved.rng).bit_generator.state
        if c.settings.out_dir is not None:
            self.history = resume.committed_history(c.settings.out_dir, saved.round)
        self.pending = snapshot.from_plain(saved.pending) if saved.pending else None
        if saved.calibration:
            inputs, metrics = snapshot.from_plain(saved.calibration)
            c.calibration.last = (inputs, metrics)
        if saved.downlink:
            c.downlink.load_state_dict(snapshot.from_plain(saved.downlink))
        if self.pending is not None:
            self.outbox = [Message(m["kind"], m["body"], To(*m["to"]), m["slot"]) for m in self.pending["outbox"]]
        status.info("cloud: resuming run %s (session %s) after round %d%s", c.run_id, c.session, saved.round,
                    f" (round {saved.round + 1} merged: finishing it)" if self.pending else "")


def devices_reported(reports: list[Any]) -> int:
    """The devices whose training phase reached the cloud through their edges' `done` (the
    devices each edge heard from, less those that left the run: runtime/records.py)."""
    of = [info.devices for info in dones(reports).values() if info.devices is not None]
    return sum(max(0, d.reported - len(d.left)) for d in of)
