"""SplitFed device without torch: the same per-batch split step with the numpy W_c (methods/thin).

Per batch: W_c forward, activations up, the edge's gradient back, W_c backward and an SGD step
(device_lr, momentum, weight decay as the torch device), then W_c up for the every-round average.
It does not take part in head calibration: that needs W_e and W_g's trunk on the device, which
only the torch device runs (it sits the calibration phase out, as any device that cannot).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from splitedge.methods.calibration import CALIB
from splitedge.methods.checks import weight_specs
from splitedge.methods.splitfed.device_checks import check_wc_message
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan, Unsupported
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.moments import WIRE_DTYPES
from splitedge.methods.splitfed.method import MODEL
from splitedge.methods.thin.trainer import SplitTrainer


class SplitFedThinDevice(DevicePart[SplitFedConfig]):
    trainer: Kept[SplitTrainer]
    version: Kept[int]

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        try:
            self.trainer = SplitTrainer(self.spec.model, self.spec.channels, chunk=self.ctx.train_chunk)
        except ValueError as exc:  # a W_c the thin trainer has no layers for
            raise Unsupported(str(exc)) from None
        self.specs = weight_specs(self.trainer.weights())
        spec = self.spec
        self.wc_shape = self.trainer.features(np.zeros((1, spec.channels, spec.image_size, spec.image_size))).shape[1:]
        self.version = -1
        self.samples_sent = 0

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.version(MODEL) and self.version >= 0

    def check(self, env: Any, source: str) -> None:
        if not (env.kind == "weights" and env.body["part"] == CALIB):  # calibration models: not run here
            check_wc_message(env, self.specs, self.wc_shape)

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == "wc" and body["version"] > self.version:
            self.trainer.load(body["weights"])
            self.version = int(body["version"])

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        if self.ctx.request is None:
            raise RuntimeError("splitfed needs a runtime that offers ctx.request (device/agent.py)")
        cfg = self.cfg
        opt = self.trainer.optimizer(cfg.device_lr, cfg.momentum, cfg.weight_decay)
        rng = np.random.default_rng(int(self.ctx.rng.integers(2**31)))
        self.samples_sent = 0
        counter = iter(range(1 << 62))

        def ask(act: np.ndarray, y: np.ndarray) -> np.ndarray:
            body = {"batch": next(counter), "x": act.astype(WIRE_DTYPES[cfg.feature_dtype]), "y": y}
            reply = self.ctx.request(Message("activations", body), "gradients", cfg.reply_timeout_s)
            self.samples_sent += len(y)
            return np.array(reply.body["grad"], dtype=np.float32)

        for _ in range(cfg.local_epochs):
            split = self.trainer.train_epoch(self.data[0], self.data[1], self.spec.mean, self.spec.std,
                                             cfg.device_batch, opt, rng, ask)
            self.losses = {"split": split, "total": split}
        yield Message("weights", {"part": "wc", "version": self.version,
                                  "samples": self.reported_samples(len(self.data[1])),
                                  "weights": self.trainer.weights()})
        yield DONE

    def round_info(self) -> dict[str, Any]:
        return {"samples_sent": self.samples_sent}
