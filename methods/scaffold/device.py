"""SCAFFOLD device: FedAvg's local training with each step corrected by c - c_i, then its new
control variate (option II) and the change of it, sent up beside the model.

Option II: c_i+ = c_i - c + (x - y) / (K lr) after K steps from x to y. The device optimiser
is the project's SGD with momentum b (FedAvg's settings, so every baseline trains alike); K
steps of momentum SGD move about 1/(1 - b) times as far as plain SGD's, so lr here is the
effective lr / (1 - b) (b = 0: the paper's formula exactly).

With DP (dp_sigma > 0) the model update is clipped and noised as FedAvg's, and the control
variate is computed from the model that was sent, y the noised one: dc = -c - (y - x) / (K lr)
is then post-processing of a release, costing no privacy of its own. K is counted from the
samples the device reports (with private reports the power of two above what it holds), so
dc's scale says no more about its data than its hello does.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch

from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.contract import DONE, DeviceContext, Kept, Message, RoundPlan
from splitedge.methods.fedavg.device import FedAvgDevice
from splitedge.methods.scaffold.method import C, DC, ScaffoldConfig
from splitedge.methods.training import Batch, Outputs


def parameter_map(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The trainable parameters as name -> float32 array (control variates have their shapes)."""
    return {n: p.detach().cpu().numpy().astype(np.float32, copy=True) for n, p in model.named_parameters()}


class ScaffoldDevice(FedAvgDevice[ScaffoldConfig]):
    encodes_updates = False  # it sends its control variate beside the model, and reads the model it sent
    c_local: Kept[dict[str, np.ndarray]]
    c_global: Kept[dict[str, np.ndarray]]
    c_version: Kept[int]
    private, private_clips = True, ("dp_update_clip",)  # the model; dc follows from what was sent
    dp_sgd = False  # its corrected steps have no DP-SGD form here: dp_unit=sample refuses it
    secure_kinds = ()  # no secure sum tested with its control variates

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        zeros = {n: np.zeros_like(a) for n, a in parameter_map(self.model).items()}
        self.c_specs = weight_specs(zeros)
        self.c_local = {n: a.copy() for n, a in zeros.items()}  # c_i: 0 before the first round
        self.c_global, self.c_version = zeros, -1
        self.correction: list[torch.Tensor] | None = None
        self.steps = 0

    def ready(self, plan: RoundPlan) -> bool:
        return super().ready(plan) and self.c_version >= plan.version(C)

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and env.body["part"] == C:
            check_weights(env.body, self.c_specs, part=C, source=source)
        else:
            super().check(env, source)

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == C:
            if body["version"] > self.c_version:
                self.c_global = {n: np.array(a, dtype=np.float32) for n, a in body["weights"].items()}
                self.c_version = int(body["version"])
        else:
            super().on_message(env)

    def forward(self, batch: Batch) -> Outputs:
        out = dict(super().forward(batch))
        out["correction"] = sum((p * c).sum() for p, c in zip(self.model.parameters(), self.correction))
        self.steps += 1
        return out

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        start = parameter_map(self.model)
        self.correction = [torch.from_numpy(self.c_global[n] - self.c_local[n]).to(self.device) for n in start]
        self.steps = 0
        sent: dict[str, np.ndarray] = {}
        try:
            for item in super().run_round(plan):
                if isinstance(item, Message) and item.kind == "weights":
                    sent = item.body["weights"]  # y: under DP the clipped, noised model
                if item is DONE and self.steps:
                    yield self._control_update(start, {n: np.asarray(sent[n], np.float32) for n in start})
                yield item
        finally:
            self.correction = None

    def _steps(self) -> int:
        """K: the steps taken, or under DP the steps the reported samples make (never fewer)."""
        if not self.cfg.dp_sigma > 0:
            return self.steps
        batches = math.ceil(self.reported_samples(len(self.y)) / self.cfg.device_batch)
        return max(self.steps, self.cfg.local_epochs * batches)

    def _control_update(self, start: dict[str, np.ndarray], end: dict[str, np.ndarray]) -> Message:
        """c_i+ = c_i - c + (x - y) / (K lr_eff), y the model sent; sends dc = c_i+ - c_i (counted as one device)."""
        lr = self.cfg.device_lr / (1.0 - self.cfg.momentum)
        steps = self._steps()
        dc = {}
        for n, x in start.items():
            new = self.c_local[n] - self.c_global[n] + (x - end[n]) / (steps * lr)
            dc[n] = (new - self.c_local[n]).astype(np.float32)
            self.c_local[n] = new.astype(np.float32)
        return Message("weights", {"part": DC, "version": self.version, "samples": 1, "weights": dc})
