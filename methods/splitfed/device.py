"""SplitFed device: per batch, W_c forward, activations up, wait for their gradient, W_c backward.

The wait happens inside `run_round` through the agent's `request` (ctx.request):
the device cannot take its next optimiser step before the edge has answered. After the local
epochs the device's W_c goes up for the every-round average (SFLv1).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

from splitedge.methods.calibration.upper import CALIB, check_upper, upper_layers
from splitedge.methods.checks import weight_specs
from splitedge.methods.splitfed.device_checks import check_wc_message
from splitedge.methods.moments import WIRE_DTYPES
from splitedge.methods.splitfed.method import MODEL
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.torch_utils import build_split, local_tensors, sgd, shuffled_batches
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import load_numpy_state, state_to_numpy

Request = Callable[[Message, str, float], Any]


class SplitFedDevice(DevicePart[SplitFedConfig]):
    # samples_sent is counted afresh each round; the optimiser is made each round. calib: W_e
    # and W_g's trunk for head calibration, built when the cloud first sends them
    wc: Kept[torch.nn.Module]
    version: Kept[int]
    calib: Kept[Any]
    calib_version: Kept[int]

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        split = build_split(self.spec)
        self.wc, self.wc_shape = split.wc.eval(), tuple(split.wc_shape)
        self.specs = weight_specs(state_to_numpy(self.wc))
        self.x, self.y = local_tensors(self.training_data(), self.spec)
        self.version = -1
        self.samples_sent = 0
        self.calib = None
        self.calib_version = -1

    def ready(self, plan: RoundPlan) -> bool:
        calib_ok = not plan.calibrating or self.calib_version >= plan.version(CALIB)
        return self.version >= plan.version(MODEL) and self.version >= 0 and calib_ok

    can_calibrate = True

    def _upper(self) -> Any:
        self.calib = self.calib if self.calib is not None else upper_layers(self.spec)
        return self.calib

    layered_calibration = True

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """W_c as merged, then the served W_e and W_g's trunk the cloud sent (CALIB)."""
        return self.stage_outputs(x)["classifier"]

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            h = self.wc(torch.from_numpy(x))
            e, f = self._upper().stages(h)
            return {"wc": h.numpy(), "we": e.numpy(), "classifier": f.numpy()}

    def restore_state(self, state: dict[str, Any]) -> None:
        if state.get("calib") is not None:  # built before its weights are loaded back in place
            self._upper()
        super().restore_state(state)

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and env.body["part"] == CALIB:
            check_upper(self._upper(), env.body["weights"])
        else:
            check_wc_message(env, self.specs, self.wc_shape)

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == "wc" and body["version"] > self.version:
            load_numpy_state(self.wc, body["weights"])
            self.version = int(body["version"])
        elif env.kind == "weights" and body["part"] == CALIB and body["version"] > self.calib_version:
            load_numpy_state(self._upper(), body["weights"])
            self.calib_version = int(body["version"])

    def forward(self, batch: Batch) -> Outputs:
        """W_c forward, then the edge's gradient for these activations (the wait is the split)."""
        act = self.wc(batch.x)
        wire = act.detach().numpy().astype(WIRE_DTYPES[self.cfg.feature_dtype])
        body = {"batch": batch.extra["batch"], "x": wire, "y": batch.y.numpy()}
        reply = self.ctx.request(Message("activations", body), "gradients", self.cfg.reply_timeout_s)
        grad = torch.from_numpy(np.array(reply.body["grad"], dtype=np.float32))  # decoded arrays are read-only
        if grad.shape != act.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match activations {tuple(act.shape)}")
        self.samples_sent += len(batch)
        return {"activations": act, "grad": grad}

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        if self.ctx.request is None:
            raise RuntimeError("splitfed needs a runtime that offers ctx.request (device/agent.py)")
        opt = sgd(self.wc.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        self.samples_sent = 0
        counter = iter(range(1 << 62))

        def batches() -> Iterator[Batch]:
            for idx in shuffled_batches(len(self.y), self.cfg.device_batch, gen):
                yield Batch(self.x[idx], self.y[idx], {"batch": next(counter)})

        # The loss lives at the edge (its CE, and any regulariser, show in the edge's losses).
        train_epochs(self.forward, self.method.loss_terms("device"), batches, opt, [self.wc],
                     epochs=self.cfg.local_epochs)
        body = {"part": "wc", "version": self.version, "samples": self.reported_samples(len(self.y)),
                "weights": state_to_numpy(self.wc)}
        yield Message("weights", body)
        yield DONE

    def round_info(self) -> dict[str, Any]:
        return {"samples_sent": self.samples_sent}
