"""H-SFP settings with METHODS.md defaults (they travel, typed, in the round announcement)."""

from __future__ import annotations

from dataclasses import dataclass

from splitedge.methods.config import MethodConfig, flag


@dataclass(frozen=True)
class HSFPConfig(MethodConfig):
    # device: SupCon on two augmented views through a device-only projection head
    local_epochs: int = flag(1, "local epochs per round on a device")
    tau: float = 0.5
    device_lr: float = 0.05
    device_batch: int = 64
    proj_dim: int = 64
    proj_head: bool = True  # False: SupCon on the pooled W_c features themselves, as the paper (no device-only head)
    # slow time scale: W_c averaged every ic rounds, W_e every ie rounds; ie = 0 keeps W_e as
    # initialised (a fixed random layer): never averaged, and edges do not train it
    ic: int = flag(5, "rounds between W_c averages")
    ie: int = flag(10, "rounds between W_e averages (0: W_e stays as initialised)")
    slow_averaging: bool = flag(True, "ablation: never average W_c / W_e")
    # what a device takes moments of: "global" (ours, the consistency rule: the last averaged
    # W_c, sent when it changes) or "local" (the paper's device: its own W_c after this round's
    # local training, sent every round); docs/methods.md says which is measured better
    moments_of: str = flag("global", "device moments of the global W_c or of its locally trained copy",
                           choices=("global", "local"))
    # wire
    feature_dtype: str = flag("f4", "moments on the wire", choices=("f2", "f4"))
    resend_moments: str = flag("on-change", "send device moments only when W_c changed (on-change), or every round",
                               choices=("on-change", "every-round"))
    # edge: SupCon on synthetic W_c features
    edge_samples: int = 2048
    edge_epochs: int = 1
    edge_lr: float = 0.05
    edge_batch: int = 128
    # cloud: cross-entropy on synthetic W_e features
    cloud_samples: int = 4096
    cloud_epochs: int = 5
    cloud_lr: float = 0.01
    cloud_batch: int = 128
    # what the cloud trains on synthetic W_e features: W_g whole ("train", the paper), or only its
    # classifier ("frozen": the trunk stays as initialised; issue 54 measured one round of training
    # on synthetic features leaving 86 % of fedcnn's fc1 ReLUs dead on real images)
    cloud_trunk: str = flag("train", "what the cloud trains on synthetic features: W_g whole (train) or only its "
                                     "classifier (frozen: the trunk stays as initialised)", choices=("train", "frozen"))
    # Gaussian sampling
    mean_only: bool = flag(False, "ablation: prototypes without variance")
    sample_floor: int = 8
    eps: float = 1e-5
    # share of each sample's noise drawn once per channel and shared by all positions of a
    # feature map (methods/hsfp/sampling.py); 0 draws positions independently (the paper's
    # sampler), 1 moves a channel's positions together so pooling keeps their variance
    spatial_rho: float = 0.0
    # what the synthetic features are drawn from (methods/hsfp/sampling.py; the moments on the wire do
    # not change): class_balanced draws as many samples of every class as of any other (the
    # paper: in proportion to the counts); mixture draws each class from its sources' Gaussians
    # (an edge's devices, the cloud's edges) by count, each variance shrunk toward the merged
    # one by mixture_shrink, instead of from one merged Gaussian
    class_balanced: bool = False
    mixture: bool = False
    mixture_shrink: float = 0.5
    # where an edge draws the W_c features it trains W_e on: "own" its devices' merged moments;
    # "global" the federation's (edges send their W_c merge up, the cloud merges them and sends
    # the merge to every edge: one round late, so the first round of each W_c version uses its
    # own). An edge's moments of W_e outputs always describe its own devices
    edge_features: str = "own"
    # pre_relu: moments of W_c's and W_e's outputs are taken before their final ReLU (closer to
    # Gaussian than the rectified features, half of which sit at 0) and every tier applies the
    # ReLU to what it samples; needs parts ending in a ReLU (cnn, fedcnn; not resnet18)
    pre_relu: bool = False
    # moments of W_e outputs with the global W_e (consistency rule extended to the edge tier)
    we_moments: str = "global"  # or "local"
    # device-to-edge assignment after round 1: as the devices were started ("random"); "clusters":
    # devices with similar label histograms share an edge (CFLHKD's clustering, one cluster per
    # edge); "balanced": each edge gets devices whose labels together match the federation's mix
    assign: str = "random"
    # head calibration (calibrate="lda", methods/calibration): devices also need W_e and W_g's
    # trunk to reach the classifier's input; the cloud sends them before a calibration phase
    # when they changed
    # what devices train W_c towards: "supcon" (the paper: SupCon through a private projection
    # head) or "etf" (cross-entropy against a fixed simplex ETF every device shares, cosine
    # logits / etf_tau; methods/hsfp/etf.py)
    device_target: str = "supcon"
    etf_tau: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_dtype not in ("f2", "f4"):
            raise ValueError(f"feature_dtype must be f2 or f4, got {self.feature_dtype!r}")
        if self.moments_of not in ("global", "local"):
            raise ValueError(f"moments_of must be global or local, got {self.moments_of!r}")
        if self.resend_moments not in ("on-change", "every-round"):
            raise ValueError(f"resend_moments must be on-change or every-round, got {self.resend_moments!r}")
        if self.assign not in ("random", "clusters", "balanced"):
            raise ValueError(f"assign must be random, clusters or balanced, got {self.assign!r}")
        if self.we_moments not in ("global", "local"):
            raise ValueError(f"we_moments must be global or local, got {self.we_moments!r}")
        if self.edge_features not in ("own", "global") or not 0.0 <= self.mixture_shrink <= 1.0:
            raise ValueError(f"edge_features must be own or global and mixture_shrink in [0, 1], got "
                             f"{self.edge_features!r} and {self.mixture_shrink}")
        if self.cloud_trunk not in ("train", "frozen"):
            raise ValueError(f"cloud_trunk must be train or frozen, got {self.cloud_trunk!r}")
        if not 0.0 <= self.spatial_rho <= 1.0:
            raise ValueError(f"spatial_rho must be in [0, 1], got {self.spatial_rho}")
        if self.device_target not in ("supcon", "etf") or not self.etf_tau > 0:
            raise ValueError(f"device_target must be 'supcon' or 'etf' and etf_tau > 0, got {self.device_target!r} "
                             f"and {self.etf_tau}")
        if self.ic < 1 or self.ie < 0 or self.local_epochs < 0:
            raise ValueError("ic must be >= 1, ie >= 0 (0: W_e stays as initialised) and local_epochs >= 0")
        if self.dp_sigma > 0 and self.moments_of == "local" and self.dp_unit == "device":
            raise ValueError("dp_unit=device refuses moments_of=local: the local copy of W_c is trained on the same "
                             "images without DP-SGD, so removing one image moves every feature and the moments by "
                             "more than dp_clip; use dp_unit=sample (DP-SGD) or moments_of=global, the W_c every "
                             "device received")
        if self.dp_sigma > 0 and self.dp_unit == "sample":
            self._check_sample_unit()

    def _check_sample_unit(self) -> None:
        """DP-SGD's refusals for H-SFP's devices (methods/privacy/dpsgd.py): each in one line."""
        if self.device_target == "supcon" and self.local_epochs > 0:
            raise ValueError("dp_unit=sample refuses device_target=supcon: SupCon compares the images of a batch, so "
                             "one image moves every other image's gradient; set device_target=etf (a per-image loss) "
                             "or local_epochs=0")


@dataclass(frozen=True)
class HSFPCalConfig(HSFPConfig):
    """`hsfp-cal`: H-SFP with the head calibrated on real statistics every round and W_e kept as
    initialised (ie = 0): the best H-SFP measured (bench/results/hsfp-cal-cifar10-10dev/README.md,
    both regimes, two seeds); the W_e edges train on synthetic features serves worse once averaged."""

    calibrate: str = "lda"
    ie: int = 0
