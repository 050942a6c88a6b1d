"""H-SFP thin device: moments of the global W_c computed with numpy layers of its own install.

No torch and no graph from the wire: the device builds W_c (and, for head calibration, W_e and
W_g's trunk) of the model its round plan names from methods/thin/graphs.py, and binds the weight
maps it receives only after checking them against that network (`check` refuses one that does
not fit before it touches state; the runtime logs and counts it). Until the first global W_c is
bound the device is not ready.

It also trains, as a torch device does: a numpy copy of W_c (methods/thin/trainer.py) starts from
each new global W_c, takes `local_epochs` of SupCon per round and goes up on the rounds W_c is
averaged, while the moments stay those of the global W_c (the consistency rule).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

import numpy as np

from splitedge.methods.contract import DeviceContext, Kept, Message, RoundPlan, Unsupported
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.hsfp.device import HSFPDevice
from splitedge.methods.hsfp.method import AVERAGE, WC
from splitedge.methods.privacy.release import private_weights

log = logging.getLogger(__name__)


class HSFPThinDevice(HSFPDevice):
    """HSFPDevice whose extractor and calibration trunk are local numpy graphs (methods/thin/graphs.py)."""

    # Small batches bound peak RSS (the im2col buffers and the float64 moment temporaries scale
    # with the batch); 4 images a call keeps the moments pass of the CIFAR cnn a few MB.
    moment_batch = 4
    stats_batch = moment_batch  # head statistics run W_e and the trunk: the same bound
    extractor: Kept[Any]  # W_c's numpy graph (methods/thin/graphs.py)
    calib_extractor: Kept[Any]  # W_e and the trunk's
    trainer: Kept[Any]  # the SupCon trainer, None when there is none for this W_c
    trained_version: Kept[int]
    dp_start: Kept[dict[str, np.ndarray]]
    private, private_clips = True, ("dp_clip", "dp_update_clip")
    dp_sgd = True  # dp_unit=sample: numpy DP-SGD toward the ETF (SupConTrainer.train_dpsgd)
    secure_kinds = ("moments", "weights")
    can_calibrate = True  # the trunk is built here, from the same install

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        from splitedge.methods.thin.graphs import calib_graph, wc_graph

        spec = self.spec
        try:
            self.extractor = wc_graph(spec.model, spec.channels, pre_relu=self.cfg.pre_relu)
            self.calib_extractor = calib_graph(spec.model, spec.channels, spec.image_size, spec.num_classes)
        except ValueError as exc:
            raise Unsupported(str(exc)) from None
        self.trainer = self._new_trainer()
        self.trained_version = -1  # the global W_c version the trainer's local copy started from
        self.dp_start = {}  # with DP on: the weights it started from (the update's origin)

    def _new_trainer(self) -> Any:
        """The numpy SupCon trainer of this run's W_c, or None when there is none for it (said once)."""
        from splitedge.methods.thin.trainer import SupConTrainer

        cfg, spec = self.cfg, self.spec
        if not getattr(cfg, "proj_head", True) and cfg.device_target == "supcon":
            if cfg.local_epochs > 0:
                log.warning("device %s: sends statistics of the global W_c but trains none: the thin trainer trains "
                            "through its projection head only (proj_head=false needs a torch device)", self.ctx.node_id)
            return None
        try:
            return SupConTrainer(spec.model, spec.channels, proj_dim=cfg.proj_dim, lr=cfg.device_lr, tau=cfg.tau,
                                 seed=int(self.ctx.rng.integers(2**31)), target=cfg.device_target,
                                 classes=spec.num_classes, etf_seed=spec.seed, etf_tau=cfg.etf_tau,
                                 feddecorr_beta=cfg.feddecorr_beta, chunk=self.ctx.train_chunk)
        except ValueError as exc:  # a W_c it runs but has no backward for (resnet18's)
            if cfg.local_epochs > 0:
                log.warning("device %s: sends statistics of the global W_c but trains none: %s", self.ctx.node_id, exc)
            return None

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        self.extractor.pre_relu = bool(self.cfg.pre_relu)  # type: ignore[attr-defined]
        if self.trainer is not None:
            self.trainer.retune(self.cfg.device_lr)

    def train_round(self, plan: RoundPlan) -> Iterator[Message]:
        """`local_epochs` of SupCon on the local W_c copy; the copy goes up when W_c is averaged.
        With local_epochs=0 the device is a statistics reporter: nothing trains, so nothing goes
        up but moments (a torch device sends its untouched copy; this one spares its uplink)."""
        if self.trainer is None or self.cfg.local_epochs == 0:
            return
        self._sync_trainer()
        sample_dp = self.cfg.dp_sigma > 0 and self.cfg.dp_unit == "sample"
        if sample_dp:  # DP-SGD toward the ETF (methods/privacy/dpsgd.py); the rng only augments
            rng = np.random.default_rng(int(self.ctx.rng.integers(2**31)))
            self.losses = self.trainer.train_dpsgd(self.data[0], self.data[1], self.spec.mean, self.spec.std,
                                                   self.cfg, rng)
        for _ in range(0 if sample_dp else self.cfg.local_epochs):
            rng = np.random.default_rng(int(self.ctx.rng.integers(2**31)))
            self.losses = self.trainer.train_epoch(self.data[0], self.data[1], self.spec.mean, self.spec.std,
                                                   self.cfg.device_batch, rng)
        if WC in plan.directives.get(AVERAGE, ()):
            weights = self.trainer.weights()
            if self.cfg.dp_sigma > 0:
                from splitedge.methods.privacy.norm_stats import with_statistics
                from splitedge.methods.thin.norms import private_norms

                norms = private_norms(self, self.trainer.wc, self.dp_start, self.images)  # of the global W_c
                # DP-SGD: the copy goes as trained; DP-FedAvg: the update clipped and noised (methods/privacy)
                weights = with_statistics(weights, norms) if sample_dp else \
                    private_weights(self, weights, self.dp_start, norms)
            yield Message("weights", {"part": WC, "version": self.wc_version, "samples": self.num_samples,
                                      "weights": weights})

    def images(self, size: int = 256) -> Iterator[np.ndarray]:
        """The local images, normalised a batch at a time, in order."""
        for i in range(0, len(self.data[1]), size):
            yield to_input(np.asarray(self.data[0][i:i + size]), self.spec.mean, self.spec.std)

    def local_features(self, x: np.ndarray) -> np.ndarray:
        """The trained local copy's outputs (eval mode), before its final ReLU with pre_relu; the
        global W_c's while there is no copy that started from it."""
        if self.trainer is None or self.trained_version != self.wc_version:
            return super().local_features(x)
        return self.trainer.features(x, pre_relu=self.cfg.pre_relu)

    def _sync_trainer(self) -> None:
        """A new global W_c in use: the local copy starts again from it, with fresh momentum (both
        are this install's W_c, so the global weights always fit the copy)."""
        if self.trained_version == self.wc_version:
            return
        self.trainer.load(self.extractor.weights())  # type: ignore[attr-defined]
        self.trained_version = self.wc_version
        if self.cfg.dp_sigma > 0:
            self.dp_start = {k: np.array(v, copy=True) for k, v in self.trainer.weights().items()}

    def check_global(self, weights: Mapping[str, np.ndarray]) -> None:
        self.extractor.check_weights(weights)  # type: ignore[attr-defined]

    def check_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        self.calib_extractor.check_weights(weights)

    def load_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        self.calib_extractor.load_weights(weights)

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        return self.stage_outputs(x)["classifier"]

    layered_calibration = True

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The global W_c's output (after its ReLU, as served), W_e's and the trunk's, in numpy."""
        h = self.extractor.features(x)
        if self.cfg.pre_relu:  # W_c's moments are taken before its final ReLU; the trunk takes it after
            np.maximum(h, 0, out=h)
        e, f = self.calib_extractor.stages(h)
        return {"wc": h, "we": e, "classifier": f}
