"""H-SFP device part without torch: moments of the current global W_c, resent on change.

The extractor is whatever runs W_c here (onnxruntime on a thin device). The torch device in
`device_torch.py` extends this part with local SupCon training of its own W_c copy.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Protocol

import numpy as np

from splitedge.methods.hsfp.method import WC
from splitedge.methods.moments import ClassMoments, MomentAccumulator, moments_to_body
from splitedge.methods.preprocess import batches, to_input
from splitedge.methods.strategy import DONE, DevicePart, Message, NodeContext, RoundPlan

log = logging.getLogger(__name__)

MOMENT_BATCH = 256
WC_IN_USE = "moments now use global W_c v"
"""Logged (info) whenever a new global W_c is in place; the RAM bench counts these lines."""


class Extractor(Protocol):
    def features(self, x: np.ndarray) -> np.ndarray:
        """Normalised float32 images [N, C, H, W] -> W_c output [N, ...] as numpy."""

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Swap in a new global W_c (atomically: on error the old one stays)."""


class HSFPDevice(DevicePart):
    """Publishes per-class moments of the global W_c; sends nothing when they have not changed."""

    moment_batch = MOMENT_BATCH  # images per extractor call while computing moments

    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.extractor: Extractor = backend
        self.wc_version = -1
        self.sent_version = -1

    @property
    def num_samples(self) -> int:
        return int(len(self.data[1]))

    def ready(self, plan: RoundPlan) -> bool:
        return self.wc_version >= plan.version(WC) and self.wc_version >= 0

    def check(self, env: Any, source: str) -> None:
        """Global W_c maps must fit the extractor; nothing else comes down to an H-SFP device."""
        if env.kind == "weights" and env.body["part"] == WC:
            self.check_global(env.body["weights"])

    def check_global(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overridden by backends that know their W_c's parameters."""

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "request" and body["what"] == "moments":
            self.sent_version = -1  # the edge lost them: send again next round
        if env.kind == "weights" and body["part"] == WC and body["version"] > self.wc_version:
            self.load_global(body["weights"])
            self.wc_version = int(body["version"])
            log.info("device %s: %s%d", self.ctx.node_id, WC_IN_USE, self.wc_version)

    def load_global(self, weights: Mapping[str, np.ndarray]) -> None:
        self.extractor.load_weights(weights)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        if self.cfg.resend_moments == "every-round" or self.sent_version != self.wc_version:
            body = moments_to_body(self.compute_moments(), dtype=self.cfg.feature_dtype, space=WC,
                                   versions={WC: self.wc_version})
            yield Message("moments", body)
            self.sent_version = self.wc_version
        yield from self.train_round(plan)
        yield DONE

    def train_round(self, plan: RoundPlan) -> Iterator[Message]:
        """A thin device cannot train; the torch device overrides this."""
        return iter(())

    def compute_moments(self) -> ClassMoments:
        """Per-class moments of the flattened global-W_c features, accumulated in float64."""
        x, y = self.data
        acc: MomentAccumulator | None = None
        for sl in batches(len(y), self.moment_batch):
            feats = self.extractor.features(to_input(x[sl], self.spec.mean, self.spec.std))
            feats = feats.reshape(len(feats), -1)
            acc = acc or MomentAccumulator(feats.shape[1])
            acc.add(feats, y[sl])
        if acc is None:
            raise ValueError("device has no local data")
        return acc.result()
