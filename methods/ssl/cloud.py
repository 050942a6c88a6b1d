"""Self-supervised cloud: FedAvg of the encoder + projector, and a representation report.

Every `report_every` rounds and at the last one, the global encoder is measured on the test
split (methods/metrics/report.py): a linear probe and a kNN classifier fitted on one half and scored on
the other, alignment of two augmented views, uniformity, effective rank and the normalised
singular-value spectrum. `accuracy` in the metrics is the linear probe's.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import numpy as np
import torch

from splitedge.methods.fedavg.cloud import FedAvgCloud
from splitedge.methods.data.preprocess import batches
from splitedge.methods.ssl.model import build_net, normalise, to_unit
from splitedge.methods.contract import DEVICES, CloudContext, Kept, Message, RoundPlan, device
from splitedge.methods.ssl.config import SSDConfig, SSLConfig

log = logging.getLogger(__name__)


ConfigT = TypeVar("ConfigT", bound=SSLConfig)


class SSLCloud(FedAvgCloud[ConfigT]):
    """FedAvg's cloud with the self-supervised network and the representation report."""

    def build_model(self) -> Any:
        return build_net(self.spec, self.cfg.proj_hidden, self.method.predictor, self.cfg)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The representation the report measures, of normalised images (the encoder's output)."""
        return self.model.encoder(x)

    @torch.no_grad()
    def features(self, images: np.ndarray) -> np.ndarray:
        """`embed` of uint8 images [N, H, W, C], eval mode, 256 at a time."""
        self.model.eval()
        return np.concatenate([self.embed(normalise(to_unit(images[sl]), self.spec)).numpy()
                               for sl in batches(len(images), 256)])

    # calibration: the federated linear probe (LDA on the devices' statistics of the encoder's output)
    def head_features(self) -> Any:
        def features(x: torch.Tensor) -> torch.Tensor:
            self.model.eval()
            return self.embed(x)

        return features

    def calibration_dim(self) -> int | None:
        return int(self.model.dim)

    def served_with(self, head: Any, layer: Any = None) -> None:
        return None  # the probe measures the encoder; the served model stays the encoder

    def evaluate(self, plan: RoundPlan) -> dict[str, Any]:
        if self.report_due(plan.round):
            return self.report()
        return {}

    def report(self) -> dict[str, Any]:
        """The representation report of the global encoder; `accuracy` is the linear probe's."""
        from splitedge.methods.metrics.report import representation_report
        from splitedge.methods.ssl.augment import ssl_views

        gen = torch.Generator().manual_seed(self.spec.seed)

        @torch.no_grad()
        def views(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Encoder features of two augmented views of each image, 256 images at a time."""
            self.model.eval()
            pairs = []
            for sl in batches(len(images), 256):
                v1, v2 = ssl_views(to_unit(images[sl]), gen, scale=(self.cfg.crop_scale_min, 1.0))
                pairs.append((self.embed(normalise(v1, self.spec)).numpy(),
                              self.embed(normalise(v2, self.spec)).numpy()))
            return np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs])

        rep = representation_report(self.features, self.ctx.test,
                                    num_classes=self.spec.num_classes, views=views, seed=self.spec.seed,
                                    probe_epochs=self.cfg.probe_epochs)
        return {**rep, "accuracy": rep["probe_accuracy"]}


class SSDCloud(SSLCloud[SSDConfig]):
    """Draws Q and each device's disjoint scale directions once, before round 1, and sends Q to
    every device and d_k to device k alone (METHODS.md SSD)."""

    scales_sent: Kept[bool]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.scales_sent = False

    def before_round(self, round_: int) -> list[Message]:
        if self.scales_sent or not self.cfg.dsr:
            return []
        from splitedge.methods.ssl.ssd_scales import dsr_scales

        devices = sorted(self.ctx.view.devices)
        q, scales = dsr_scales(self.model.dim, devices, self.cfg.alpha, self.ctx.rng)
        self.scales_sent = True
        log.info("cloud: SSD scales for %d devices, %d directions each", len(devices), self.model.dim // len(devices))
        record = lambda name, key, value: {"name": name, "version": 1, "arrays": {key: value}}  # noqa: E731
        return [Message("arrays", record("ssd_q", "q", q), to=DEVICES, slot="ssd_q"),
                *(Message("arrays", record("ssd_d", "d", d), to=device(k), slot="ssd_d") for k, d in scales.items())]
