"""FedAvg thin device: the announced global model trained in numpy, sent back whole.

No torch and no graph from the wire: the device builds the whole network of the model its round
plan names from its own install (methods/thin/classifier.py) and binds a global model only after
checking it against that network. Each round it trains `local_epochs` of cross-entropy with SGD
(`device_lr`, `momentum`, `weight_decay`, a fresh optimiser each round) and sends the weights,
as the torch device does; with DP at the device unit the update is clipped and noised the same
way. What it does not do it refuses in one line before it takes part: DP-SGD (dp_unit=sample)
and FedDecorr need a torch device.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from splitedge.methods.checks import check_weights
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan, Unsupported
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.data.preprocess import to_input
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.privacy.release import private_weights
from splitedge.methods.update_codec import UpdateEncoder


class FedAvgThinDevice(DevicePart[FedAvgConfig]):
    trainer: Kept[Any]  # a thin ClassifierTrainer (methods/thin/classifier.py), imported when built
    version: Kept[int]
    encoder: Kept[UpdateEncoder]
    encodes_updates = True
    # A thin device trains with DP-FedAvg (an update clipped and noised per round); under
    # dp_unit=sample it refuses to take part (Unsupported, below), so nothing leaves it unprotected.
    private, private_clips = True, ("dp_update_clip",)
    dp_sgd = True
    secure_kinds = ("weights",)
    stats_batch = 16  # head statistics: a thin device's memory bound

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        from splitedge.methods.thin.classifier import ClassifierTrainer

        cfg, spec = self.cfg, self.spec
        if cfg.dp_sigma > 0 and cfg.dp_unit == "sample":
            raise Unsupported("a thin FedAvg device has no DP-SGD (dp_unit=sample): run it with --backend torch")
        if cfg.feddecorr_beta > 0:
            raise Unsupported("a thin FedAvg device has no FedDecorr: run it with --backend torch")
        try:
            self.trainer = ClassifierTrainer(spec.model, spec.channels, spec.image_size, spec.num_classes)
        except ValueError as exc:
            raise Unsupported(str(exc)) from None
        self.version = -1  # no global model yet: the announced one must arrive first
        self.train_set = self.training_data()  # less the images held back to choose the head's layer
        self.encoder = UpdateEncoder(cfg.update_codec, cfg.update_topk)  # the uplink's residual

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.version(MODEL) and self.version >= 0

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights":
            check_weights(env.body, self.trainer.specs, part=MODEL, source=source)

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["version"] > self.version:
            self.trainer.load(body["weights"])
            self.version = int(body["version"])

    can_calibrate = layered_calibration = True

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        return self.trainer.stage_outputs(x)["classifier"]

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return self.trainer.stage_outputs(x)

    def images(self, size: int = 256) -> Iterator[np.ndarray]:
        """The local images, normalised a batch at a time, in order."""
        for i in range(0, len(self.train_set[1]), size):
            yield to_input(np.asarray(self.train_set[0][i:i + size]), self.spec.mean, self.spec.std)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        cfg = self.cfg
        private = cfg.dp_sigma > 0 and cfg.local_epochs > 0  # as the torch device: no training, no release
        coded = cfg.update_codec != "none"
        start = self.trainer.weights() if private or coded else None
        norms: dict[str, np.ndarray] = {}
        if private:
            from splitedge.methods.thin.norms import private_norms

            norms = private_norms(self, self.trainer.net, start, self.images)  # of the model received
        opt = self.trainer.optimizer(cfg.device_lr, cfg.momentum, cfg.weight_decay)
        losses = []
        for _ in range(cfg.local_epochs):
            rng = np.random.default_rng(int(self.ctx.rng.integers(2**31)))
            losses.append(self.trainer.train_epoch(self.train_set[0], self.train_set[1], self.spec.mean, self.spec.std,
                                                   cfg.device_batch, opt, rng))
        if losses:
            self.losses = {"ce": float(np.mean(losses)), "total": float(np.mean(losses))}
        weights = self.trainer.weights()
        if private:  # DP-FedAvg: the update clipped and noised (methods/privacy)
            weights = private_weights(self, weights, start, norms)
        body = {"part": MODEL, "version": self.version, "samples": self.reported_samples(len(self.train_set[1])),
                "weights": weights}
        if coded:  # the update compressed against the model it was trained from (methods/update_codec.py)
            body.update(self.encoder.encode(weights, start, np.random.default_rng(int(self.ctx.rng.integers(2**31)))))
        yield Message("weights", body)
        yield DONE
