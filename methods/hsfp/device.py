"""H-SFP device part without torch: moments of the current global W_c, resent on change.

The extractor is whatever runs W_c here (numpy layers of its install on a thin device). The torch device in
`device_torch.py` and the thin device in `device_thin.py` extend this part with local SupCon
training of their own W_c copy (torch, or the numpy trainer of methods/thin).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Protocol

import numpy as np

from splitedge.methods.hsfp.method import CALIB, WC
from splitedge.methods.moments import ClassMoments, MomentAccumulator, moments_to_body
from splitedge.methods.privacy.release import private_accumulator, private_moments
from splitedge.methods.data.preprocess import accumulate
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.hsfp.config import HSFPConfig

log = logging.getLogger(__name__)

MOMENT_BATCH = 256
WC_IN_USE = "moments now use global W_c v"
"""Logged (info) whenever a new global W_c is in place; the RAM bench counts these lines."""


class Extractor(Protocol):
    def features(self, x: np.ndarray) -> np.ndarray:
        """Normalised float32 images [N, C, H, W] -> W_c output [N, ...] as numpy."""

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Swap in a new global W_c (atomically: on error the old one stays)."""


class HSFPDevice(DevicePart[HSFPConfig]):
    """Publishes per-class moments of the global W_c; sends nothing when they have not changed."""

    moment_batch = MOMENT_BATCH  # images per extractor call while computing moments
    wc_version: Kept[int]  # the extractor is the runtime's backend, not kept
    sent_version: Kept[int]
    calib_version: Kept[int]
    private, private_clips = True, ("dp_clip",)  # it sends moments (and head statistics) only
    dp_sgd = True  # trains nothing here: moments of the global W_c, or of a copy its subclasses train with DP-SGD
    secure_kinds = ("moments",)

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.extractor: Extractor = backend
        self.wc_version = -1
        self.sent_version = -1
        self.calib_version = -1

    @property
    def num_samples(self) -> int:
        """What its W_c weights count for in the edge's average (reported_samples)."""
        return self.reported_samples(len(self.data[1]))

    def calibrating(self, plan: RoundPlan) -> bool:
        """A calibration phase this backend takes part in: it runs W_e and W_g's trunk too."""
        return plan.calibrating and self.can_calibrate

    def ready(self, plan: RoundPlan) -> bool:
        calib_ok = not self.calibrating(plan) or self.calib_version >= plan.version(CALIB)
        return self.wc_version >= plan.version(WC) and self.wc_version >= 0 and calib_ok

    def check(self, env: Any, source: str) -> None:
        """Global W_c maps must fit the extractor, calibration models the backend's W_e and head."""
        if env.kind == "weights" and env.body["part"] == WC:
            self.check_global(env.body["weights"])
        elif env.kind == "weights" and env.body["part"] == CALIB and self.can_calibrate:
            self.check_calib(env.body["weights"])

    def check_global(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overridden by backends that know their W_c's parameters."""

    def check_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overridden by backends that can calibrate."""

    def load_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        """Take the served W_e and W_g ("we.*", "wg.*") used for the next head statistics."""
        raise NotImplementedError

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """The classifier's input [N, D] for normalised images, through the global W_c and the
        calibration W_e and head trunk."""
        raise NotImplementedError

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "request" and body["what"] == "moments":
            self.sent_version = -1  # the edge lost them: send again next round
        if env.kind == "weights" and body["part"] == WC and body["version"] > self.wc_version:
            self.load_global(body["weights"])
            self.wc_version = int(body["version"])
            log.info("device %s: %s%d", self.ctx.node_id, WC_IN_USE, self.wc_version)
        if env.kind == "weights" and body["part"] == CALIB and self.can_calibrate and body["version"] > self.calib_version:
            self.load_calib(body["weights"])
            self.calib_version = int(body["version"])

    def load_global(self, weights: Mapping[str, np.ndarray]) -> None:
        self.extractor.load_weights(weights)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        if self.cfg.moments_of == "local":  # the paper's device: train, then moments of its own W_c
            yield from self.train_round(plan)
            body = moments_to_body(self.compute_moments(self.local_features), dtype=self.cfg.feature_dtype, space=WC,
                                   versions={WC: self.wc_version})
            yield Message("moments", body)
            self.sent_version = self.wc_version
            yield DONE
            return
        if self.cfg.resend_moments == "every-round" or self.sent_version != self.wc_version:
            body = moments_to_body(self.compute_moments(), dtype=self.cfg.feature_dtype, space=WC,
                                   versions={WC: self.wc_version})
            yield Message("moments", body)
            self.sent_version = self.wc_version
        yield from self.train_round(plan)
        yield DONE

    def train_round(self, plan: RoundPlan) -> Iterator[Message]:
        """No local copy here: the torch device and the thin trainer (device_thin.py) override this."""
        return iter(())

    def compute_moments(self, features: Any = None) -> ClassMoments:
        """Per-class moments of the flattened global-W_c features (or of `features`, normalised
        images -> features), accumulated in float64, over the classes above the run's minimum count."""
        features = features or self.extractor.features
        if self.cfg.dp_sigma > 0:  # one noisy release of every class; the floor applies to its noisy counts
            private = private_accumulator(self, self.cfg.dp_clip, "class", private_moments(self, self.data[1]))
            return accumulate(features, self.data, self.spec.mean, self.spec.std, private, self.moment_batch)
        return accumulate(features, self.data, self.spec.mean, self.spec.std,
                          MomentAccumulator, self.moment_batch, self.stats_floor(self.data[1]).keep)

    def local_features(self, x: np.ndarray) -> np.ndarray:
        """Features of the device's own W_c copy (`moments_of="local"`); a device that trains no
        copy has only the global W_c."""
        return self.extractor.features(x)
