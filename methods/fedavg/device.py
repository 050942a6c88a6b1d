"""FedAvg device: adopt the announced global model, train it with cross-entropy, send it back."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.strategy import DONE, DevicePart, Message, NodeContext, RoundPlan
from splitedge.methods.torch_utils import build_split, local_tensors, sgd, train_epoch
from splitedge.models import load_numpy_state, state_to_numpy


def ce_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


class FedAvgDevice(DevicePart):
    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(FedAvgConfig, ctx.config)
        self.model = build_split(self.spec).eval()
        self.x, self.y = local_tensors(data, self.spec)
        self.version = -1  # no global model yet: the announced one must arrive first

    def ready(self, plan: RoundPlan) -> bool:
        """The plan's wc_version carries the global model version this round trains from."""
        return self.version >= plan.wc_version and self.version >= 0

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == "model" and body["version"] > self.version:
            load_numpy_state(self.model, body["weights"])
            self.version = int(body["version"])

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        # A fresh optimiser each round: momentum from the last local model does not fit the new global one.
        opt = sgd(self.model.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        for _ in range(self.cfg.local_epochs):
            train_epoch(self.model, opt, self.x, self.y, batch=self.cfg.device_batch, gen=gen, loss_fn=ce_loss)
        body = {"part": "model", "version": self.version, "samples": int(len(self.y)),
                "weights": state_to_numpy(self.model)}
        yield Message("weights", body)
        yield DONE
