"""H-SFP cloud part: schedule the slow scale, train W_g on merged edge moments, serve a consistent triple.

Served model rule (METHODS.md): after W_c or W_e is averaged, the previous triple keeps being
evaluated and exported until W_g has trained on moments computed with the new versions.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import numpy as np
import torch

from splitedge.methods.averaging import weight_updates
from splitedge.methods.checks import check_space, check_stats, check_vector, check_version, check_weights, weight_specs
from splitedge.methods.calibration.serving import CalibratedCloud
from splitedge.methods.calibration.upper import CALIB, sent_copy, upper_update
from splitedge.methods.hsfp.edge import check_wc_moments
from splitedge.methods.hsfp.method import AVERAGE, LABELS, REPORT_LABELS, WC, WE
from splitedge.methods.hsfp.torch_ops import sample_batches
from splitedge.methods.moments import ClassMoments, moments_from_body, moments_to_body
from splitedge.methods.metrics.evaluate import evaluate
from splitedge.methods.torch_utils import retune
from splitedge.methods.contract import (CHILDREN, DEVICES, CloudContext, CloudPart, Kept, Message, Placement, Report,
                                        RoundPlan, RoundSpec)
from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import (ClassifierInput, SplitModel, create_split, head_features, load_numpy_state, seeded_init,
                              state_to_numpy)
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.done import dones

log = logging.getLogger(__name__)


class HSFPCloud(CalibratedCloud, CloudPart[HSFPConfig]):
    # Left out: the weight specs (from the spec).
    model: Kept[SplitModel]
    served: Kept[SplitModel]
    served_versions: Kept[tuple[int, int] | None]
    opt: Kept[torch.optim.Optimizer]
    wc_version: Kept[int]
    we_version: Kept[int]
    cache: Kept[dict[str, tuple[int, int, ClassMoments]]]  # edge -> (wc_v, we_v, moments)
    cached_ids: Kept[dict[str, str]]  # edge -> msg_id of its cached moments
    cached_at: Kept[dict[str, tuple[int, int, int]]]  # edge -> (wc_v, we_v, round) of its cached moments
    reference: Kept[tuple[tuple[int, int], ClassMoments] | None]  # robust="clip": last merge, its versions
    # edge_features="global": each edge's merge of W_c moments (version, msg_id, moments),
    # and which of them the last federation-wide merge sent to the edges held
    wc_sources: Kept[dict[str, tuple[int, str, ClassMoments]]]
    global_sent: Kept[tuple]
    calib_version: Kept[int]  # the calibration models last sent; their copy in calib
    calib: Kept[ClassifierInput]
    calibrated: Kept[dict[str, np.ndarray] | None]
    calibrated_layer: Kept[str]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        with seeded_init(self.spec.seed):
            self.model = create_split(self.spec.model, num_classes=self.spec.num_classes,
                                      in_channels=self.spec.channels, image_size=self.spec.image_size).eval()
        self.specs = {WC: weight_specs(state_to_numpy(self.model.wc)), WE: weight_specs(state_to_numpy(self.model.we))}
        self.served = copy.deepcopy(self.model)
        self.served_versions = None
        self.wc_version, self.we_version = 0, 0
        self.opt = torch.optim.Adam(self._trained().parameters(), lr=self.cfg.cloud_lr)
        self.cache, self.cached_ids, self.cached_at = {}, {}, {}
        self.reference = None
        self.wc_sources, self.global_sent = {}, ()
        self.calib_version = -1
        self.calib = sent_copy(self.model)

    def _trained(self) -> torch.nn.Module:
        """What the cloud trains on synthetic features: W_g, or only its classifier (cloud_trunk
        "frozen": the trunk keeps its initial weights and takes no gradient)."""
        if self.cfg.cloud_trunk != "frozen":
            return self.model.wg
        self.model.wg[:-1].requires_grad_(False)
        return self.model.wg[-1]

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        retune(self.opt, lr=self.cfg.cloud_lr)

    def initial_messages(self) -> list[Message]:
        """W_c to every device (a thin one binds it to the W_c its own install builds), W_e to the edges."""
        return [self._weights_message(WC, 0, self.model.wc), self._weights_message(WE, 0, self.model.we)]

    def _weights_message(self, part: str, version: int, module: torch.nn.Module, samples: int = 0) -> Message:
        """W_c goes to every device (through its edge), W_e to the edges; the newest stays for late joiners."""
        body = {"part": part, "version": version, "samples": samples, "weights": state_to_numpy(module)}
        return Message("weights", body, to=DEVICES if part == WC else CHILDREN, slot=part)

    def before_calibration(self, round_: int) -> list[Message]:
        """Before a calibration phase: the newest W_e and W_g's trunk to every device, unless
        unchanged (W_e changes only at its average, every `ie` rounds, and the cnn's trunk has
        no parameters): the phase names the version they hold."""
        self.calib_version, out = upper_update(self.calib, self.calib_version, self.model)
        return out

    def plan(self, round_: int) -> RoundSpec:
        """Versions in use; W_c averaged every ic rounds and W_e every ie (the slow time scale)."""
        slow = self.cfg.slow_averaging
        average = [part for part, every in ((WC, self.cfg.ic), (WE, self.cfg.ie))
                   if slow and every and round_ % every == 0]  # ie = 0: W_e is never averaged
        directives: dict = {AVERAGE: average}
        if self.cfg.assign != "random" and round_ == 1:
            directives[REPORT_LABELS] = True
        return RoundSpec(versions={WC: self.wc_version, WE: self.we_version}, directives=directives)

    def calibration_versions(self, round_: int) -> dict[str, int]:
        """W_c and W_e as merged, and the W_e and trunk sent for the calibration (CALIB)."""
        return {WC: self.wc_version, WE: self.we_version, CALIB: self.calib_version}

    def _assign(self, reports: Sequence[Report]) -> None:
        """Place devices on edges by their label histograms instead of the order they started in."""
        from splitedge.methods.hsfp.assign import balanced, by_clusters

        hists = {d: np.asarray(v) for r in reports for e in r.all("arrays") if e.body["name"] == LABELS
                 for d, v in e.body["arrays"].items()}
        edges = sorted(self.ctx.view.members)
        if len(hists) < 2 or len(edges) < 2:
            return
        where = (by_clusters if self.cfg.assign == "clusters" else balanced)(hists, edges)
        self.moves = {d: Placement(edge=e) for d, e in where.items()}
        log.info("cloud: devices placed on edges (%s): %s", self.cfg.assign, where)

    def check(self, env: Any, source: str) -> None:
        """Edges send moments of W_e outputs and averaged W_c / W_e of this run's model."""
        body = env.body
        if env.kind == "moments" and body["space"] == WC and self.cfg.edge_features == "global":
            check_wc_moments(body, int(np.prod(self.model.wc_shape)), self.spec.num_classes, self.cfg.feature_dtype,
                             wc=self.wc_version)
        elif env.kind == "moments":
            check_space(body, WE)
            check_stats(body, "mean", dim=int(np.prod(self.model.we_shape)), num_classes=self.spec.num_classes,
                        dtype=self.cfg.feature_dtype)
            for name, current in ((WC, self.wc_version), (WE, self.we_version)):
                check_version(name, int(body["versions"].get(name, 0)), at_most=current)
            self._check_newer(env)
        elif env.kind == "arrays":
            self._check_labels(body)
        elif env.kind == "weights":
            if body["part"] not in self.specs:
                raise ProtocolError("state.part", f"edges send W_c or W_e, not {body['part']!r}")
            wc = body["part"] == WC
            module, current = (self.model.wc, self.wc_version) if wc else (self.model.we, self.we_version)
            trained_from = state_to_numpy(module) if int(body["version"]) == current else None
            check_weights(body, self.specs[body["part"]], trained_from=trained_from)

    def _check_labels(self, body: Any) -> None:
        """The only record edges send: per-device label histograms, one count per class."""
        if body["name"] != LABELS:
            raise ProtocolError("state.name", f"edges send {LABELS!r} records, not {body['name']!r}")
        for dev, hist in body["arrays"].items():
            check_vector(hist, self.spec.num_classes, f"the label histogram of {dev}")

    @staticmethod
    def _stamp(env: Any) -> tuple[int, int, int]:
        versions = env.body["versions"]
        return int(versions.get(WC, 0)), int(versions.get(WE, 0)), int(env.round)

    def _check_newer(self, env: Any) -> None:
        """An edge's cached moments are replaced only by newer ones (versions, then round): older
        ones are refused as `state.stale`, a second one of the same versions and round under a
        fresh id as `state.replay` (as at the edge, HSFPEdge._check_newer)."""
        at, held = self._stamp(env), self.cached_at.get(env.sender)
        if held is None or self.cached_ids.get(env.sender) == env.msg_id or at > held:
            return
        if at < held:
            raise ProtocolError("state.stale", f"moments of (wc, we, round) {at}; {env.sender}'s cached ones are {held}")
        raise ProtocolError("state.replay", f"second moments of (wc, we, round) {at} under a new id")

    def on_edge_message(self, env: Any) -> None:
        """Edge moments are state: kept whenever they arrive, even after their round closed;
        never replaced by older ones, nor by the same message again. Only here: aggregate() does
        not walk the round's reports, which hold the same messages."""
        if env.kind == "moments" and env.body["space"] == WC:
            version = int(env.body["versions"].get(WC, 0))
            held = self.wc_sources.get(env.sender)
            if held is None or (version, env.msg_id) != held[:2] and version >= held[0]:
                self.wc_sources[env.sender] = (version, env.msg_id, moments_from_body(env.body))
        elif env.kind == "moments":
            at = self._stamp(env)
            if at <= self.cached_at.get(env.sender, (-1, -1, -1)):
                return
            self.cache[env.sender] = (at[0], at[1], moments_from_body(env.body))
            self.cached_ids[env.sender], self.cached_at[env.sender] = env.msg_id, at

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        metrics: dict[str, float] = {}  # the edges' moments are in the cache already (on_edge_message)
        versions = (self.wc_version, self.we_version)
        current = [m for wc, we, m in (self.cache[e] for e in sorted(self.cache)) if (wc, we) == versions]  # one order, one sum
        if current:
            reference = self.reference[1] if self.reference is not None and self.reference[0] == versions else None
            merged = self.method.merge_moments(current, reference)
            self.reference = (versions, merged)
            metrics["head_loss"] = self._train_head(merged, current)
            self.served.load_state_dict(self.model.state_dict())
            self.served_versions = (self.wc_version, self.we_version)
        out = self._global_wc_moments() if self.cfg.edge_features == "global" else []
        infos = [i.method for i in dones(reports).values()]
        metrics["merged"] = sum(int(i.get("merged", 0)) for i in infos)  # devices whose moments the edges merged
        if self.cfg.edge_features == "global":
            metrics["edges_global"] = sum(int(i.get("global", 0)) for i in infos)  # edges that trained on it
        if self.served_versions:
            metrics.update(evaluate(self.served, self.ctx.test, self.spec, represent=self.report_due(plan.round)))
        else:
            metrics["accuracy"] = float("nan")
        metrics["wc_version"], metrics["we_version"] = self.wc_version, self.we_version
        for part in plan.directives.get(AVERAGE, ()):
            out += self._average(part, self.model.part(part), reports)
        if plan.directives.get(REPORT_LABELS):
            self._assign(reports)
        return out, metrics

    def _global_wc_moments(self) -> list[Message]:
        """The edges' W_c merges of the version in use, merged (as configured) and sent to every
        edge when one of them changed (edge_features="global"); edges sample W_e's training
        features from it."""
        held = sorted((e, mid) for e, (v, mid, _) in self.wc_sources.items() if v == self.wc_version)
        if not held or tuple(held) == self.global_sent:
            return []
        self.global_sent = tuple(held)
        merged = self.method.merge_moments([self.wc_sources[e][2] for e, _ in held])
        body = moments_to_body(merged, dtype=self.cfg.feature_dtype, space=WC, versions={WC: self.wc_version})
        return [Message("moments", body, to=CHILDREN, slot="wc_global")]

    def forward(self, batch: Batch) -> Outputs:
        features, logits = head_features(self.model.wg, batch.x)
        return {"features": features, "logits": logits}

    def _train_head(self, merged: ClassMoments, parts: list[ClassMoments]) -> float:
        x, y = self.method.sample_features(merged, self.cfg.cloud_samples, self.ctx.rng, parts=parts)
        batches = sample_batches(x, y, self.model.we_shape, batch=self.cfg.cloud_batch,
                                 seed=int(self.ctx.rng.integers(2**31)))
        self.losses = train_epochs(self.forward, self.method.loss_terms("cloud"), batches, self.opt, [self._trained()],
                                   epochs=self.cfg.cloud_epochs)
        return self.losses.get("ce", 0.0)

    def _average(self, part: str, module: torch.nn.Module, reports: Sequence[Report]) -> list[Message]:
        current = self.wc_version if part == WC else self.we_version
        parts = weight_updates(reports, part, current)
        if not parts:
            log.warning("cloud: slow round without any %s weights from edges", part)
            return []
        load_numpy_state(module, self.method.merge_weights(parts, reference=state_to_numpy(module)))
        if part == WC:
            self.wc_version = current + 1
        else:
            self.we_version = current + 1
        return [self._weights_message(part, current + 1, module, sum(n for _, n in parts))]

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The consistent triple served (METHODS.md), or with calibration the last calibrated model."""
        return self.served_state(state_to_numpy(self.served))
