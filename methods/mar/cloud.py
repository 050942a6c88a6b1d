"""FedMAR / DecMAR clouds.

FedMAR: FedAvg of the whole autoencoder (SSLCloud's pattern, so the same representation
report, measured on the encoder's latent with every patch visible), and after each round
z_bar, the unweighted mean of the devices' mean latents, sent to every device.

DecMAR: no aggregation. Before round 1 the cloud draws the peer graph from the run's seed
(Erdos-Renyi resampled until connected, or a ring), writes graph.json, graph.png and a
Mosquitto ACL (peers.acl) into the run folder, and gives each device its neighbours. On report
rounds it asks devices to upload their models and evaluates their average (the consensus).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence, TypeVar

import numpy as np
import torch

from splitedge.methods.averaging import weight_updates
from splitedge.methods.checks import check_vector
from splitedge.methods.mar.device import build_mae
from splitedge.methods.mar.method import LATENTS, MODEL, UPLOAD, ZBAR
from splitedge.methods.ssl.cloud import SSLCloud
from splitedge.methods.contract import DEVICES, Kept, Message, Placement, Report, RoundPlan, RoundSpec
from splitedge.methods.mar.config import DecMARConfig, MARConfig
from splitedge.models import load_numpy_state
from splitedge.protocol.done import dones

log = logging.getLogger(__name__)


ConfigT = TypeVar("ConfigT", bound=MARConfig)


class MARCloud(SSLCloud[ConfigT]):
    zbar_version: Kept[int] = 0

    def build_model(self) -> Any:
        return build_mae(self.spec, self.cfg)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encode(x)

    def plan(self, round_: int) -> RoundSpec:
        """Devices train from the announced model and the z_bar of the previous round."""
        return RoundSpec(versions={MODEL: self.version, ZBAR: self.zbar_version})

    def check(self, env: Any, source: str) -> None:
        super().check(env, source)
        if env.kind == "arrays" and env.body["name"] == LATENTS:
            for dev, z in env.body["arrays"].items():
                check_vector(z, self.model.dim, f"the latent of {dev}")

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, Any]]:
        out, metrics = super().aggregate(plan, reports)
        latents = [np.asarray(z, dtype=np.float64) for r in reports for e in r.all("arrays")
                   if e.body["name"] == LATENTS for z in e.body["arrays"].values()]
        if latents and self.cfg.mar:
            self.zbar_version = plan.round
            stacked = np.stack(latents)  # the paper's reference is the participants' latents, ours their mean
            zbar = (stacked if self.cfg.ammd == "paper" else stacked.mean(axis=0)).astype(np.float32)
            out.append(Message("arrays", {"name": ZBAR, "version": plan.round, "arrays": {"z": zbar}},
                               to=DEVICES, slot=ZBAR))
        return out, {**metrics, "latents": len(latents)}


class DecMARCloud(MARCloud[DecMARConfig]):
    """Announces rounds and observes: places devices on the peer graph, evaluates the consensus."""

    graph: Kept[dict[str, tuple[str, ...]] | None] = None

    def placement(self, round_: int) -> dict[str, Placement] | None:
        if self.graph is not None:
            return None
        from splitedge.methods import topology

        devices = sorted(self.ctx.view.devices)
        if self.cfg.graph == "ring" or len(devices) < 3:
            self.graph = topology.ring(devices)
        else:
            self.graph = topology.erdos_renyi(devices, min(self.cfg.degree, len(devices) - 1), self.ctx.rng)
        log.info("cloud: DecMAR %s graph on %d devices, mean degree %.2f", self.cfg.graph, len(devices),
                 topology.mean_degree(self.graph))
        self.write_topology()
        return {d: Placement(self.ctx.view.devices[d], peers=self.graph[d]) for d in devices}

    def write_topology(self) -> None:
        """graph.json, graph.png and peers.acl (each device reads only its neighbours' peer
        topics) in the run folder."""
        from splitedge.methods import topology
        from splitedge.protocol import acl

        out = self.ctx.out_dir
        if out is None or self.graph is None:
            return
        topology.write_graph(Path(out), self.graph, title=f"DecMAR peers, mean degree {topology.mean_degree(self.graph):.2f}")
        edges = {d: self.ctx.view.devices[d] for d in self.graph}
        acl.write_acl(Path(out) / "peers.acl", acl.peer_acl(self.ctx.run or "run", self.graph, edges=edges))

    def plan(self, round_: int) -> RoundSpec:
        report = self.report_due(round_)
        return RoundSpec(versions={MODEL: 0}, directives={UPLOAD: True} if report else {})

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, Any]]:
        heard = {d: n for i in dones(reports).values() for d, n in (i.method.get("neighbours_heard") or {}).items()}
        metrics: dict[str, Any] = {"neighbours_heard": heard}
        if self.graph is not None:
            metrics["mean_degree"] = sum(len(p) for p in self.graph.values()) / max(1, len(self.graph))
        parts = weight_updates(reports, MODEL, plan.round)
        if not parts:
            return [], metrics
        load_numpy_state(self.model, self.method.merge_weights(parts))
        self.version, self.samples = plan.round, sum(n for _, n in parts)
        return [], {**metrics, **self.report(), "model_version": self.version, "samples": self.samples}
