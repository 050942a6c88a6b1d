"""H-SFP edge part: merge device moments exactly, sample, train W_e with SupCon, report moments up."""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import torch

from splitedge.methods.averaging import averaged_body, weight_updates
from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.hsfp.torch_ops import output_moments, train_on_samples, with_counts
from splitedge.methods.losses import supcon_loss
from splitedge.methods.moments import ClassMoments, merge_moments, moments_from_body, moments_to_body
from splitedge.methods.sampling import sample_features
from splitedge.methods.strategy import EdgePart, Message, NodeContext, Report, RoundPlan
from splitedge.models import create_split, load_numpy_state, pool, state_to_numpy

log = logging.getLogger(__name__)


class HSFPEdge(EdgePart):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(HSFPConfig, ctx.config)
        split = create_split(self.spec.model, num_classes=self.spec.num_classes,
                             in_channels=self.spec.channels, image_size=self.spec.image_size)
        self.wc_shape, self.we_shape = split.wc_shape, split.we_shape
        self.we_global = split.we.eval()
        self.we_local = copy.deepcopy(split.we)
        self.we_version = -1
        self.opt = self._new_optimizer()
        self.cache: dict[str, tuple[int, ClassMoments]] = {}  # device -> (wc_version, moments)
        self.cached_ids: dict[str, str] = {}  # device -> msg_id of its cached moments
        self.last_wc_version: int | None = None

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.we_local.parameters(), lr=self.cfg.edge_lr, momentum=0.9, weight_decay=5e-4)

    def ready(self, plan: RoundPlan) -> bool:
        return self.we_version >= plan.we_version and self.we_version >= 0

    def on_message(self, env: Any) -> list[Message]:
        """Global W_c (weights or ONNX graph) goes down to the devices; global W_e replaces both our copies."""
        if env.kind == "onnx_model":
            return [Message("onnx_model", dict(env.body), retain=True, topic_kind=f"onnx_model-{env.body['part']}")]
        if env.kind != "weights":
            return []
        part, version = env.body["part"], int(env.body["version"])
        if part == "wc":
            return [Message("weights", dict(env.body), retain=True, topic_kind="weights-wc")]
        if part == "we" and version > self.we_version:
            load_numpy_state(self.we_global, env.body["weights"])
            load_numpy_state(self.we_local, env.body["weights"])
            self.opt = self._new_optimizer()
            self.we_version = version
        return []

    def on_device_message(self, env: Any) -> list[Message]:
        """Moments are state, kept whenever they arrive: a device sends them only when they change."""
        if env.kind == "moments":
            self._remember(env)
        return []

    def _remember(self, env: Any) -> None:
        """Cache a device's moments; the same message seen again (in the round's reports) is not decoded twice."""
        if self.cached_ids.get(env.sender) == env.msg_id:
            return
        self.cache[env.sender] = (int(env.body["wc_version"]), moments_from_body(env.body))
        self.cached_ids[env.sender] = env.msg_id

    def on_round_open(self, plan: RoundPlan, members: set[str]) -> list[Message]:
        """Ask devices for moments this edge lacks (e.g. it restarted), unless a new W_c version
        just started, when every device sends them anyway."""
        steady = self.last_wc_version == plan.wc_version
        self.last_wc_version = plan.wc_version
        if not steady:
            return []
        missing = sorted(d for d in members if self.cache.get(d, (-1,))[0] != plan.wc_version)
        return [Message("request", {"what": "moments"}, target=d) for d in missing]

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        for report in reports:
            for env in report.all("moments"):
                self._remember(env)
        current = [m for v, m in self.cache.values() if v == plan.wc_version]
        out: list[Message] = []
        if current:
            out.append(self._train_and_report(plan, merge_moments(current)))
        if plan.slow_wc:
            out.extend(self._average_wc(plan, reports))
        if plan.slow_we:
            total = sum(int(m.counts.sum()) for _, m in self.cache.values())
            out.append(Message("weights", {"part": "we", "version": self.we_version, "samples": total,
                                           "weights": state_to_numpy(self.we_local)}))
        return out

    def _train_and_report(self, plan: RoundPlan, merged: ClassMoments) -> Message:
        seed = int(self.ctx.rng.integers(2**31))
        x, y = self._sample(merged, self.cfg.edge_samples)
        loss_fn = lambda out, labels: supcon_loss(pool(out), labels, tau=self.cfg.tau)  # noqa: E731
        train_on_samples(self.we_local, self.opt, x, y, self.wc_shape, loss_fn,
                         epochs=self.cfg.edge_epochs, batch=self.cfg.edge_batch, seed=seed)
        module = self.we_global if self.cfg.we_moments == "global" else self.we_local
        x2, y2 = self._sample(merged, self.cfg.edge_samples)
        moments = with_counts(output_moments(module, x2, y2, self.wc_shape), merged)
        body = moments_to_body(moments, dtype=self.cfg.feature_dtype, wc_version=plan.wc_version,
                               we_version=self.we_version, space="we")
        return Message("moments", body)

    def _sample(self, merged: ClassMoments, total: int):
        return sample_features(merged, total, self.ctx.rng, eps=self.cfg.eps, floor=self.cfg.sample_floor,
                               mean_only=self.cfg.mean_only)

    def _average_wc(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = weight_updates(reports, "wc", plan.wc_version)
        if not parts:
            log.warning("edge %s: slow round %d without any W_c from devices", self.ctx.node_id, plan.round)
            return []
        return [Message("weights", averaged_body(parts, "wc", plan.wc_version))]
