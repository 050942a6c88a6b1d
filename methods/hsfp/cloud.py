"""H-SFP cloud part: schedule the slow scale, train W_g on merged edge moments, serve a consistent triple.

Served model rule (METHODS.md): after W_c or W_e is averaged, the previous triple keeps being
evaluated and exported until W_g has trained on moments computed with the new versions.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from splitedge.methods.averaging import average_states, weight_updates
from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.hsfp.torch_ops import train_on_samples
from splitedge.methods.moments import ClassMoments, merge_moments, moments_from_body
from splitedge.methods.preprocess import batches, to_input
from splitedge.methods.sampling import sample_features
from splitedge.methods.strategy import CloudPart, Message, NodeContext, Report, RoundPlan
from splitedge.models import create_split, load_numpy_state, state_to_numpy

log = logging.getLogger(__name__)


class HSFPCloud(CloudPart):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(HSFPConfig, ctx.config)
        torch.manual_seed(self.spec.seed)
        self.model = create_split(self.spec.model, num_classes=self.spec.num_classes,
                                  in_channels=self.spec.channels, image_size=self.spec.image_size).eval()
        self.served = copy.deepcopy(self.model)
        self.served_versions: tuple[int, int] | None = None
        self.wc_version, self.we_version = 0, 0
        self.opt = torch.optim.Adam(self.model.wg.parameters(), lr=self.cfg.cloud_lr)
        self.cache: dict[str, tuple[int, int, ClassMoments]] = {}  # edge -> (wc_v, we_v, moments)
        self.cached_ids: dict[str, str] = {}  # edge -> msg_id of its cached moments

    def initial_messages(self) -> list[Message]:
        return [self._weights_message("wc", 0, self.model.wc), self._weights_message("we", 0, self.model.we),
                *self._onnx_message()]

    def _onnx_message(self) -> list[Message]:
        """W_c as an ONNX graph for thin devices (later averages reach them as weight maps)."""
        try:
            from splitedge.exporters.onnx_export import export_wc_bytes  # needs onnx; only the cloud exports

            data = export_wc_bytes(self.model)
        except (ImportError, ValueError) as exc:
            log.warning("cloud: no onnx_model for thin devices (%s)", exc)
            return []
        body = {"part": "wc", "version": self.wc_version, "model": data, "sha256": hashlib.sha256(data).hexdigest()}
        return [Message("onnx_model", body, retain=True, topic_kind="onnx_model-wc")]

    def _weights_message(self, part: str, version: int, module: torch.nn.Module, samples: int = 0) -> Message:
        body = {"part": part, "version": version, "samples": samples, "weights": state_to_numpy(module)}
        return Message("weights", body, retain=True, topic_kind=f"weights-{part}")

    def plan(self, round_: int) -> RoundPlan:
        slow = self.cfg.slow_averaging
        config = dict(self.ctx.config)
        return RoundPlan(round=round_, method="hsfp", slow_wc=slow and round_ % self.cfg.ic == 0,
                         slow_we=slow and round_ % self.cfg.ie == 0,
                         deadline_s=float(config.get("deadline_s", 120.0)),
                         wc_version=self.wc_version, we_version=self.we_version, config=config)

    def on_edge_message(self, env: Any) -> None:
        """Edge moments are state: kept whenever they arrive, even after their round closed."""
        if env.kind == "moments" and self.cached_ids.get(env.sender) != env.msg_id:  # not twice
            b = env.body
            self.cache[env.sender] = (int(b["wc_version"]), int(b["we_version"]), moments_from_body(b))
            self.cached_ids[env.sender] = env.msg_id

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, float]]:
        for report in reports:
            for env in report.all("moments"):
                self.on_edge_message(env)
        metrics: dict[str, float] = {}
        current = [m for wc, we, m in self.cache.values() if (wc, we) == (self.wc_version, self.we_version)]
        if current:
            metrics["head_loss"] = self._train_head(merge_moments(current))
            self.served.load_state_dict(self.model.state_dict())
            self.served_versions = (self.wc_version, self.we_version)
        metrics["accuracy"] = self.evaluate() if self.served_versions else float("nan")
        metrics["wc_version"], metrics["we_version"] = self.wc_version, self.we_version
        out = []
        if plan.slow_wc:
            out += self._average("wc", self.model.wc, reports)
        if plan.slow_we:
            out += self._average("we", self.model.we, reports)
        return out, metrics

    def _train_head(self, merged: ClassMoments) -> float:
        x, y = sample_features(merged, self.cfg.cloud_samples, self.ctx.rng, eps=self.cfg.eps,
                               floor=self.cfg.sample_floor, mean_only=self.cfg.mean_only)
        return train_on_samples(self.model.wg, self.opt, x, y, self.model.we_shape, F.cross_entropy,
                                epochs=self.cfg.cloud_epochs, batch=self.cfg.cloud_batch,
                                seed=int(self.ctx.rng.integers(2**31)))

    def _average(self, part: str, module: torch.nn.Module, reports: Sequence[Report]) -> list[Message]:
        parts = weight_updates(reports, part, self.wc_version if part == "wc" else self.we_version)
        if not parts:
            log.warning("cloud: slow round without any %s weights from edges", part)
            return []
        load_numpy_state(module, average_states(parts))
        version = (self.wc_version if part == "wc" else self.we_version) + 1
        if part == "wc":
            self.wc_version = version
        else:
            self.we_version = version
        return [self._weights_message(part, version, module, sum(n for _, n in parts))]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy of the served triple on the real test split."""
        x, y = self.ctx.extra["test"]
        self.served.eval()
        correct = 0
        for sl in batches(len(y), 512):
            logits = self.served(torch.from_numpy(to_input(x[sl], self.spec.mean, self.spec.std)))
            correct += int((logits.argmax(1).numpy() == y[sl]).sum())
        return correct / max(1, len(y))

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        return state_to_numpy(self.served)
