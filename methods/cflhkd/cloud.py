"""CFLHKD cloud: FedAvg during warm-up; then it clusters the devices by their signals, moves each
cluster to its own edge, and from then on the global model is the sample-weighted merge of the
cluster models the edges send. Every round it sends every device the teacher tables: each
cluster's class-wise mean logits and counts (the global teacher and the peer teachers derive
from them on the device). Re-clusters every `recluster_every` rounds or when a device drifts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from splitedge.methods.cflhkd.distill import merge_tables
from splitedge.methods.robust import robust_rule
from splitedge.methods.cflhkd.edge import global_scores
from splitedge.methods.cflhkd.method import CLUSTERED, GLOBAL, MODEL, SIGNALS, TEACHERS, WARMUP
from splitedge.methods.fedavg.cloud import FedAvgCloud
from splitedge.methods.fedproto.protos import weighted_accuracy
from splitedge.methods.calibration.layers import CLASSIFIER
from splitedge.methods.calibration.lda import lda_classifier
from splitedge.methods.calibration.records import head_message, merge
from splitedge.methods.checks import check_weights
from splitedge.methods.cflhkd.config import CFLHKDConfig
from splitedge.methods.contract import (DEVICES, CloudContext, Kept, Message, Placement, Report, RoundPlan, RoundSpec,
                                        device)
from splitedge.methods.averaging import weight_updates
from splitedge.models import load_numpy_state, state_to_numpy
from splitedge.protocol.done import dones

log = logging.getLogger(__name__)


class CFLHKDCloud(FedAvgCloud[CFLHKDConfig]):
    phase: Kept[str]
    assignment: Kept[dict[str, int]]  # device -> cluster
    cluster_edges: Kept[dict[int, str]]  # cluster -> its edge
    signals: Kept[dict[str, np.ndarray]]
    clustered_at: Kept[int]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.phase = WARMUP
        self.assignment, self.cluster_edges, self.signals = {}, {}, {}
        self.clustered_at = 0

    def plan(self, round_: int) -> RoundSpec:
        """Devices train from the model of the previous round (global, or their cluster's); in the
        two-way hierarchy, once clustered, they also hold the global model of the last merge."""
        versions = {MODEL: round_ - 1}
        if self._two_way():
            versions[GLOBAL] = self.version
        return RoundSpec(versions=versions, directives={"phase": self.phase})

    def _two_way(self) -> bool:
        return self.phase == CLUSTERED and self.cfg.two_way

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and env.body.get("part") == GLOBAL and self.cfg.two_way:
            trained_from = self.current() if int(env.body["version"]) == self.version else None
            check_weights(env.body, self.specs, part=GLOBAL, trained_from=trained_from)
        else:
            super().check(env, source)

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, Any]]:
        out: list[Message] = []
        distilled = GLOBAL in plan.versions and self.cfg.distill_global
        if distilled:  # the paper's upward flow: the devices' distillations of the global model, merged
            parts = weight_updates(reports, GLOBAL, plan.version(GLOBAL))
            merged = self.method.merge_weights(parts, reference=self.current()) if parts else None
        else:  # warm-up: the devices' merge (through edges); clustered: the merge of the cluster models
            parts = weight_updates(reports, MODEL, plan.round)  # edges version their merge by the round
            merged = self.method.merge_weights(parts) if parts else None
        if merged is not None:
            load_numpy_state(self.model, merged)
            self.version, self.samples = plan.round, sum(n for _, n in parts)
            if self.phase == WARMUP:
                out.append(self._model_message())
        for r in reports:
            for env in r.all("arrays"):
                if env.body["name"] == SIGNALS:
                    self.signals.update({d: np.asarray(v) for d, v in env.body["arrays"].items()})
        if self._clustering_due(plan.round):
            self._cluster(plan.round)
        if self._two_way():  # every device gets the global model (a teacher, or the model it distils into)
            body = {"part": GLOBAL, "version": self.version, "samples": self.samples, "weights": self.current()}
            out.append(Message("weights", body, to=DEVICES, slot=GLOBAL))
        if self.cfg.kd:
            out.extend(self._teachers(reports))
        return out, {**self.evaluate(plan), **self._cluster_metrics(plan, reports), "model_version": self.version,
                     "samples": self.samples}

    # -- clustering --------------------------------------------------------------------------
    def _clustering_due(self, round_: int) -> bool:
        cfg = self.cfg
        if not cfg.clustering or len(self.signals) < 2:
            return False
        if self.phase == WARMUP:
            return round_ >= cfg.warmup_rounds
        if cfg.recluster_every and round_ - self.clustered_at >= cfg.recluster_every:
            return True
        if cfg.drift_threshold > 0:
            from splitedge.methods.clustering import drifted

            known = {d: v for d, v in self.signals.items() if d in self.assignment}
            moved = drifted(known, self.assignment, cfg.drift_threshold) if len(known) > 1 else []
            if moved:
                log.info("cloud: devices %s drifted from their clusters; re-clustering", moved[:5])
                return True
        return False

    def _cluster(self, round_: int) -> None:
        from splitedge.methods.clustering import cluster_devices, write_clusters

        edges = sorted(self.ctx.view.members)
        live = {d: v for d, v in self.signals.items() if d in self.ctx.view.devices}
        kw = {"n_clusters": min(self.cfg.clusters, len(live))} if self.cfg.clusters else \
            {"distance_threshold": self.cfg.distance_threshold}
        assignment = cluster_devices(live, max_clusters=len(edges), center=self.cfg.signal != "labels", **kw)
        if len(set(assignment.values())) < 2 and self.phase == WARMUP:  # no structure (yet): one global model
            log.info("cloud: the %d devices form one cluster after round %d; staying with the global model",
                     len(assignment), round_)
            return  # devices stay on their edges; clustering is tried again next round
        self.assignment = assignment
        self.cluster_edges = {k: edges[k] for k in sorted(set(self.assignment.values()))}
        self.moves = {d: Placement(edge=self.cluster_edges[k], groups=(f"c{k}",),
                                   peers=self.ctx.view.placement(d).peers) for d, k in self.assignment.items()}
        self.phase, self.clustered_at = CLUSTERED, round_
        log.info("cloud: %d devices in %d clusters after round %d", len(self.assignment), len(self.cluster_edges), round_)
        out_dir = self.ctx.out_dir
        if out_dir is not None:
            write_clusters(Path(out_dir), self.assignment, live, edges=self.cluster_edges, round_=round_)

    # -- distillation ------------------------------------------------------------------------
    def _teachers(self, reports: Sequence[Report]) -> list[Message]:
        """Each cluster's table: its edge's merged logits (before clustering: one table, everyone)."""
        c = self.spec.num_classes
        by_cluster: dict[int, list[tuple]] = {}
        edge_cluster = {e: k for k, e in self.cluster_edges.items()}
        for r in reports:
            for env in r.all("logits"):
                k = edge_cluster.get(r.sender, 0) if self.phase == CLUSTERED else 0
                by_cluster.setdefault(k, []).append((env.body["classes"], env.body["counts"], env.body["logits"]))
        if not by_cluster:
            return []
        ks = sorted(by_cluster)
        tables = [merge_tables(by_cluster[k], c, **robust_rule(self.cfg)) for k in ks]
        arrays = {"clusters": np.array(ks, dtype=np.int64), "counts": np.stack([t[0] for t in tables]),
                  "logits": np.stack([t[1] for t in tables]).astype(np.float32)}
        return [Message("arrays", {"name": TEACHERS, "version": 1, "arrays": arrays}, to=DEVICES, slot=TEACHERS)]

    def _cluster_metrics(self, plan: RoundPlan, reports: Sequence[Report]) -> dict[str, Any]:
        """Each cluster model on its own devices' held-out data (edges report it), and overall."""
        infos = {edge: i.method for edge, i in dones(reports).items()}
        per_edge = {e: i["accuracy"] for e, i in infos.items() if "accuracy" in i}
        acc, _ = weighted_accuracy(list(infos.values()))
        out: dict[str, Any] = {"phase": plan.directives.get("phase"), "clusters": len(self.cluster_edges) or 1,
                               "cluster_accuracy": per_edge, "personalised_accuracy": acc}
        global_acc, n = weighted_accuracy(global_scores(list(infos.values()), samples="global_eval_samples"))
        if n:  # the global model on every group's held-out data, each with its own labels (two-way only)
            out["global_personal_accuracy"] = global_acc
        if self.assignment:
            out["assignment"] = dict(self.assignment)
        return out

    # -- calibration: a head per cluster (one edge each), scored by its devices on held-out data
    def calibrate(self, plan: RoundPlan, sources: Mapping[str, Any]) -> dict[str, Any]:
        """Before clustering every device holds the global model: one head for all. Afterwards
        each edge holds one cluster and its devices that cluster's model: a head per edge, from
        its devices' statistics, sent to each device it holds now (a placement decided this
        round applies from the next one, so the devices are still where their statistics say)."""
        sources = sources[CLASSIFIER]  # its devices hold their own models: the head sits at their classifier
        if self.phase != CLUSTERED or not self.cluster_edges:
            stats = merge(sources, self.cfg)
            self.heads = [head_message(self._head(stats), plan.round, DEVICES)]
            return {"calibrated": stats.total, "calibrated_heads": 1}
        heads = {e: self._head(merge({e: stats}, self.cfg)) for e, stats in sources.items()}
        self.heads = [head_message(heads[e], plan.round, device(d)) for d, e in self.ctx.view.devices.items()
                      if e in heads]
        return {"calibrated": sum(p.total for p in sources.values()), "calibrated_heads": len(heads)}

    def _head(self, stats: Any) -> Any:
        return lda_classifier(stats, self.spec.num_classes, shrink=self.cfg.calib_shrink)

    def head_messages(self) -> list[Message]:
        heads, self.heads = getattr(self, "heads", []), []
        return heads

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        return state_to_numpy(self.model)
