"""H-SFP device part with torch: trains its own W_c copy with SupCon, sends it on slow rounds.

Consistency rule (METHODS.md): moments always come from the global W_c (the last average);
the local copy keeps training and only reaches the others through the next average.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from splitedge.methods.calibration.upper import check_upper, upper_layers
from splitedge.methods.hsfp.augment import two_views
from splitedge.methods.checks import check_weight_map, weight_specs
from splitedge.methods.hsfp.device import HSFPDevice
from splitedge.methods.hsfp.etf import EtfHead
from splitedge.methods.hsfp.method import AVERAGE, WC
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.contract import DeviceContext, Kept, Message, RoundPlan
from splitedge.methods.privacy.dpsgd_torch import terms_loss, train_dpsgd
from splitedge.methods.privacy.norm_stats import with_statistics
from splitedge.methods.privacy.release import private_weights
from splitedge.methods.torch_utils import PlainSGD, private_norms, retune, sgd
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import ClassifierInput, create_split, load_numpy_state, pool, seeded_init, state_to_numpy


class HSFPTorchDevice(HSFPDevice):
    # Moments in small batches: at 256 the CIFAR W_c activations and the float64 accumulator
    # temporaries peak ~75 MB above the trained model; features are per-sample identical, the
    # float64 moments differ only by rounding (~1e-15 relative).
    moment_batch = 32
    can_calibrate = True
    # Left out: the weight specs (from the spec), the label tensor (from the data) and the
    # pre-ReLU view of wc_global (built when moments are taken, see `features`).
    wc_global: Kept[nn.Module]
    wc_local: Kept[nn.Module]
    head: Kept[nn.Module]
    opt: Kept[PlainSGD]
    calib: Kept[ClassifierInput | None]  # the served W_e and W_g trunk, built at the first calibration
    private, private_clips = True, ("dp_clip", "dp_update_clip")
    dp_sgd = True  # dp_unit=sample: DP-SGD toward the ETF (train_private)
    secure_kinds = ("moments", "weights")

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        with seeded_init(int(ctx.rng.integers(2**31))):
            split = create_split(self.spec.model, num_classes=self.spec.num_classes,
                                 in_channels=self.spec.channels, image_size=self.spec.image_size)
            width = split.wc_shape[0]
            # the projection head is ours; the paper's SupCon works on the pooled W_c features (proj_head=false)
            self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, self.cfg.proj_dim)) \
                if getattr(self.cfg, "proj_head", True) else nn.Identity()
        if self.cfg.device_target == "etf":  # the same fixed target on every device: from the run's seed
            self.head = EtfHead(width, self.spec.num_classes, seed=self.spec.seed, tau=self.cfg.etf_tau)
        self.wc_global = split.wc.eval()
        self.wc_local = copy.deepcopy(split.wc)
        self.specs = weight_specs(state_to_numpy(self.wc_global))
        self.extractor = self
        self._labels = torch.from_numpy(np.asarray(self.data[1], dtype=np.int64))
        self.opt = self._new_optimizer()
        self.calib = None

    def restore_state(self, state: dict[str, Any]) -> None:
        """A parked (virtual) device that had calibrated keeps the calibration models it was
        sent: built only at the first calibration, they are built here before their weights
        are loaded back in place."""
        if state.get("calib") is not None:
            self._calib_module()
        super().restore_state(state)

    def _calib_module(self) -> ClassifierInput:
        if self.calib is None:
            self.calib = upper_layers(self.spec)
        return self.calib

    def check_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        check_upper(self._calib_module(), weights)

    def load_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        load_numpy_state(self._calib_module(), weights)

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        return self.stage_outputs(x)["classifier"]

    layered_calibration = True

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The global W_c's output (after its ReLU, as served), then the calibration W_e and trunk."""
        with torch.inference_mode():
            h = self.wc_global(torch.from_numpy(x))
            e, f = self._calib_module().stages(h)
            return {"wc": h.numpy(), "we": e.numpy(), "classifier": f.numpy()}

    def _new_optimizer(self) -> PlainSGD:
        # torch.optim.SGD's arithmetic, minus the torch._dynamo import it drags in (~80 MB RSS)
        params = list(self.wc_local.parameters()) + list(self.head.parameters())
        return sgd(params, self.cfg.device_lr, momentum=0.9, weight_decay=5e-4)

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        retune(self.opt, lr=self.cfg.device_lr)

    def check_global(self, weights: Mapping[str, np.ndarray]) -> None:
        check_weight_map(weights, self.specs, bounded=False)  # the cloud's model: not an update

    def features(self, x: np.ndarray) -> np.ndarray:
        """What moments are taken of: global W_c outputs (before its final ReLU with pre_relu).
        The view is built here, not kept: as an attribute it would be parked and checkpointed
        a second time beside wc_global, whose weights it shares."""
        with torch.inference_mode():
            return self.method.moment_module(self.wc_global)(torch.from_numpy(x)).numpy()

    def local_features(self, x: np.ndarray) -> np.ndarray:
        """The locally trained copy's outputs (before its final ReLU with pre_relu), in eval mode."""
        with torch.inference_mode():
            return self.method.moment_module(self.wc_local.eval())(torch.from_numpy(x)).numpy()

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        load_numpy_state(self.wc_global, weights)
        load_numpy_state(self.wc_local, weights)
        self.opt = self._new_optimizer()

    def train_round(self, plan: RoundPlan) -> Iterator[Message]:
        sample_dp = self.cfg.dp_sigma > 0 and self.cfg.dp_unit == "sample"
        if sample_dp and self.cfg.local_epochs > 0:
            self.train_private()
        else:
            for _ in range(self.cfg.local_epochs):
                self.train_epoch()
        if WC in plan.directives.get(AVERAGE, ()):
            weights = state_to_numpy(self.wc_local)
            if self.cfg.dp_sigma > 0:  # of the global W_c, which training left alone
                norms = private_norms(self, self.wc_global, self.images)
                # DP-SGD: the copy is sent as trained; DP-FedAvg: the update clipped and noised (methods/privacy)
                weights = with_statistics(weights, norms) if sample_dp else \
                    private_weights(self, weights, state_to_numpy(self.wc_global), norms)
            body = {"part": WC, "version": self.wc_version, "samples": self.num_samples, "weights": weights}
            yield Message("weights", body)

    def forward(self, batch: Batch) -> Outputs:
        """Two augmented views through the local W_c and the device-only projection head."""
        views = two_views(batch.x, generator=batch.extra["gen"])
        features = pool(self.wc_local(views))
        return {"features": features, "z": self.head(features), "labels": torch.cat([batch.y, batch.y])}

    def images(self, size: int = 256) -> Iterator[torch.Tensor]:
        """The local images, normalised a batch at a time, in order."""
        for i in range(0, len(self._labels), size):
            yield torch.from_numpy(to_input(self.data[0][i:i + size], self.spec.mean, self.spec.std))

    def train_private(self) -> None:
        """One round of DP-SGD toward the ETF (methods/privacy/dpsgd_torch.py): an image's two
        augmented views are one sample; BatchNorm frozen at the global W_c's statistics."""
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))  # augmentation only

        def load(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(to_input(self.data[0][idx], self.spec.mean, self.spec.std))  # idx sorted
            views = two_views(x, generator=gen)
            return views.reshape(2, len(x), *x.shape[1:]).transpose(0, 1), self._labels[torch.from_numpy(idx)]

        def loss_of(pair: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            views = pair[0]
            features = pool(self.wc_local(views))
            out = {"features": features, "z": self.head(features), "labels": torch.cat([y, y])}
            return terms_loss(self.method.loss_terms("device"), out, Batch(views, y))

        self.losses = train_dpsgd(self, self.wc_local, loss_of, load, len(self._labels), self.opt, [self.head])

    def train_epoch(self) -> float:
        """One epoch of the device's loss terms (SupCon, plus any regulariser); returns the mean loss."""
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))

        def batches() -> Iterator[Batch]:
            order = torch.randperm(len(self._labels), generator=gen)
            for start in range(0, len(order), self.cfg.device_batch):
                idx = order[start:start + self.cfg.device_batch]
                if len(idx) < 2:
                    continue
                # normalised per batch: a float32 copy of all local images would cost 4x their uint8 size
                x = torch.from_numpy(to_input(self.data[0][idx.numpy()], self.spec.mean, self.spec.std))
                yield Batch(x, self._labels[idx], {"gen": gen})

        self.losses = train_epochs(self.forward, self.method.loss_terms("device"), batches, self.opt, [self.wc_local])
        return self.losses.get("total", 0.0)
