"""CFLHKD settings (they travel, typed, in the round announcement). METHODS.md "CFLHKD"."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.fedavg.config import FedAvgConfig


SIGNALS = ("updates", "stem", "model", "labels", "layout")
"""What the cloud may cluster devices by: model updates (of the classifier, the first layer or the
whole model, each centred over the devices), label histograms, or where the first layer fires in
the device's images (layout.py)."""

@dataclass(frozen=True)
class CFLHKDConfig(FedAvgConfig):
    """FedAvg's device settings, the clustering, and the hierarchical distillation."""

    # clustering at the cloud, after `warmup_rounds` of plain FedAvg
    clustering: bool = True  # False: one global model (FedAvg, with KD from the global table)
    warmup_rounds: int = 1
    clusters: int = 0  # 0: chosen by distance_threshold (and at most the number of edges)
    distance_threshold: float = 0.5  # cosine distance at which clusters stop merging
    signal: str = "updates"  # what devices are clustered by: "updates" (the classifier's update), "stem" (the
    # first layer's update), "model" (the whole model's update), "labels" (label histogram) or "layout"
    recluster_every: int = 0  # re-cluster every R rounds (0: never)
    drift_threshold: float = 0.0  # re-cluster when a device's signal is this far from its cluster (0: off)
    # hierarchical knowledge distillation on class-wise mean logits
    kd: bool = True  # False: plain clustered FL
    temperature: float = 3.0
    lambda_g: float = 0.5  # global teacher
    lambda_p: float = 0.5  # peer clusters' teachers, weighted by their counts per class
    teacher_weights: str = "count"  # or "equal": each cluster holding a class alike (distill.TEACHER_WEIGHTS)
    # the paper's two-way hierarchy (docs/methods.md); its form: global_teacher=model,distill_global=true
    global_teacher: str = "table"  # or "model": the cloud's global model, sent to every device, teaches per sample
    distill_global: bool = False  # devices distil their cluster model into a copy of the global model, averaged
    lambda_up: float = 1.0  # distill_global: weight of the cluster model's soft outputs in the global copy's loss
    global_ce: float = 1.0  # distill_global: weight of the cross-entropy on the device's labels (0: distillation alone)
    # per-cluster evaluation: each device's held-out share
    holdout: float = 0.2

    @property
    def two_way(self) -> bool:
        """Whether devices hold the cloud's global model beside their cluster's (either direction on)."""
        return self.global_teacher == "model" or self.distill_global

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher_weights not in ("count", "equal"):
            raise ValueError(f"teacher_weights must be count or equal, got {self.teacher_weights!r}")
        if self.global_teacher not in ("table", "model"):
            raise ValueError(f"global_teacher must be table or model, got {self.global_teacher!r}")
        if self.two_way and (self.dp_sigma > 0 or self.secagg != "off"):
            raise ValueError("global_teacher=model and distill_global have no private or secure form yet (the global "
                             "model a device distils into is a second update): run them without dp_sigma and secagg")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if self.signal == "layout" and self.dp_sigma > 0:
            raise ValueError("signal=layout is a statistic of the device's images with no DP form: with dp_sigma, "
                             "cluster by updates, stem, model or labels")
        if self.warmup_rounds < 1 or self.clusters < 0 or self.recluster_every < 0:
            raise ValueError("warmup_rounds must be >= 1, clusters and recluster_every >= 0")
        if not 0 < self.distance_threshold <= 2 or self.drift_threshold < 0:
            raise ValueError("distance_threshold must be in (0, 2] and drift_threshold >= 0")
        if self.temperature <= 0 or min(self.lambda_g, self.lambda_p, self.lambda_up, self.global_ce) < 0 \
                or not 0 < self.holdout < 1:
            raise ValueError(f"bad CFLHKD config: {self}")
