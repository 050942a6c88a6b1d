"""The H-SFP method entry: config, parts per tier (imported lazily), and the hooks variants override.

Torch-free: a thin device imports this module. Loss terms import torch only when a tier that
trains asks for them.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.calibration import CALIB  # noqa: F401 - W_e and W_g's trunk for calibration; H-SFP parts import it here
from splitedge.methods.hsfp.config import HSFPCalConfig, HSFPConfig
from splitedge.methods.moments import ClassMoments, robust_merge
from splitedge.methods.hsfp.sampling import sample_features
from splitedge.methods.contract import Method

# Model names H-SFP versions in `RoundPlan.versions`, and the directive naming the parts a
# round averages (`{"average": ["wc"]}` every ic rounds, "we" every ie rounds).
WC, WE = "wc", "we"
AVERAGE = "average"
REPORT_LABELS, LABELS = "report_labels", "labels"  # directive, and the edges' `arrays` record of label histograms


class HSFP(Method):
    name = "hsfp"
    Config = HSFPConfig
    parts = {
        "device:torch": "splitedge.methods.hsfp.device_torch:HSFPTorchDevice",
        "device:onnx": "splitedge.methods.hsfp.device_thin:HSFPThinDevice",
        "device": "splitedge.methods.hsfp.device:HSFPDevice",
        "edge": "splitedge.methods.hsfp.edge:HSFPEdge",
        "cloud": "splitedge.methods.hsfp.cloud:HSFPCloud",
    }

    def objective(self, role: str) -> list[Any]:
        """SupCon on projected device features and on pooled W_e outputs; CE for the head."""
        from torch.nn import functional as F

        from splitedge.methods.losses import supcon_loss
        from splitedge.methods.training import LossTerm, cross_entropy_term

        tau = self.config.tau
        if role == "device" and self.config.device_target == "etf":  # z: cosine logits against the shared ETF
            return [LossTerm("etf", lambda out, b: F.cross_entropy(out["z"], out["labels"]), needs=("z", "labels"))]
        if role == "device":
            return [LossTerm("supcon", lambda out, b: supcon_loss(out["z"], out["labels"], tau=tau), needs=("z", "labels"))]
        if role == "edge":
            return [LossTerm("supcon", lambda out, b: supcon_loss(out["features"], b.y, tau=tau), needs=("features",))]
        return [cross_entropy_term()]

    def sample_features(self, merged: ClassMoments, total: int, rng: np.random.Generator,
                        shape: Sequence[int] | None = None,
                        parts: Sequence[ClassMoments] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Synthetic features the edge (W_c space) and cloud (W_e space) train on; `shape` is the
        per-sample feature map [C, H, W], used when `spatial_rho` > 0 correlates its positions;
        `parts` the sources merged into `merged`, the components when `mixture` is set."""
        cfg = self.config
        rho = 0.0
        if cfg.spatial_rho > 0:
            shape = shape or self.feature_shape(merged.dim)
            rho = cfg.spatial_rho if shape is not None and len(shape) == 3 else 0.0
        x, y = sample_features(merged, total, rng, eps=cfg.eps, floor=cfg.sample_floor, mean_only=cfg.mean_only,
                               balance=cfg.class_balanced, parts=parts if cfg.mixture else None,
                               shrink=cfg.mixture_shrink, rho=rho, shape=shape)
        if cfg.pre_relu:  # the moments were taken before the final ReLU: apply it to the samples
            np.maximum(x, 0, out=x)
        return x, y

    def moment_module(self, module: Any) -> Any:
        """What moments of a part's output are taken with: the part itself, or (pre_relu) the
        part without its final ReLU, sharing its weights (models.pre_activation)."""
        if not self.config.pre_relu:
            return module
        from splitedge.models import pre_activation  # torch: only tiers that run the part get here

        return pre_activation(module)

    def settle(self) -> dict[str, Any]:
        """pre_relu needs W_c and W_e that end in a ReLU: refused before round 1 otherwise."""
        if self.config.pre_relu:
            from splitedge.models import create_split, pre_activation

            spec = self.spec
            split = create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                                 image_size=spec.image_size)
            try:
                pre_activation(split.wc), pre_activation(split.we)
            except ValueError:
                raise ValueError(f"pre_relu needs W_c and W_e ending in a ReLU module (cnn and fedcnn do, {spec.model} "
                                 f"does not): drop pre_relu or choose --model cnn") from None
        return super().settle()

    def feature_shape(self, dim: int) -> tuple[int, ...] | None:
        """The per-sample map shape (W_c's or W_e's output) whose size is `dim`, from the run's model
        (built once, so the callers' hook signature stays `(merged, total, rng)`)."""
        if getattr(self, "_shapes", None) is None:
            from splitedge.models import create_split, seeded_init  # torch: only tiers that sample get here

            spec = self.spec
            with seeded_init(spec.seed):
                split = create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                                     image_size=spec.image_size)
            self._shapes = (split.wc_shape, split.we_shape)
        return next((s for s in self._shapes if int(np.prod(s)) == dim), None)

    def merge_moments(self, parts: Sequence[ClassMoments], reference: ClassMoments | None = None) -> ClassMoments:
        """How an edge merges its devices' moments and the cloud its edges': exactly (`robust =
        "none"`, merge_moments bit for bit) or robustly; `reference` is the caller's last merge
        of the same space and model versions (used by "clip")."""
        cfg = self.config
        return robust_merge(parts, cfg.robust, reference=reference, clip_k=cfg.robust_clip_k, trim=cfg.robust_trim)


class HSFPCalibrated(HSFP):
    """H-SFP whose served head is refitted every round on real statistics and whose W_e stays as
    initialised (`hsfp-cal`)."""

    name = "hsfp-cal"
    Config = HSFPCalConfig
