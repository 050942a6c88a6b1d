"""SplitFed device: per batch, W_c forward, activations up, wait for their gradient, W_c backward.

The wait happens inside `run_round` through the agent's `request` (ctx.extra["request"]):
the device cannot take its next optimiser step before the edge has answered. After the local
epochs the device's W_c goes up for the every-round average (SFLv1).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.strategy import DONE, DevicePart, Message, NodeContext, RoundPlan
from splitedge.methods.torch_utils import Optimizer, build_split, local_tensors, sgd, shuffled_batches
from splitedge.models import load_numpy_state, state_to_numpy

WIRE_DTYPES = {"f2": np.float16, "f4": np.float32}

Request = Callable[[Message, str, float], Any]


class SplitFedDevice(DevicePart):
    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(SplitFedConfig, ctx.config)
        self.wc = build_split(self.spec).wc.eval()
        self.x, self.y = local_tensors(data, self.spec)
        self.version = -1
        self.samples_sent = 0

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.wc_version and self.version >= 0

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == "wc" and body["version"] > self.version:
            load_numpy_state(self.wc, body["weights"])
            self.version = int(body["version"])

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        request: Request | None = self.ctx.extra.get("request")
        if request is None:
            raise RuntimeError("splitfed needs a runtime that offers ctx.extra['request'] (device/agent.py)")
        opt = sgd(self.wc.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        self.samples_sent, batch_id = 0, 0
        self.wc.train()
        try:
            for _ in range(self.cfg.local_epochs):
                for idx in shuffled_batches(len(self.y), self.cfg.device_batch, gen):
                    self._step(request, opt, batch_id, idx)
                    batch_id += 1
        finally:
            self.wc.eval()
        body = {"part": "wc", "version": self.version, "samples": int(len(self.y)),
                "weights": state_to_numpy(self.wc)}
        yield Message("weights", body)
        yield DONE

    def _step(self, request: Request, opt: Optimizer, batch_id: int, idx: torch.Tensor) -> None:
        """One split step: the edge computes the loss above the cut and returns dL/d(activations)."""
        act = self.wc(self.x[idx])
        wire = act.detach().numpy().astype(WIRE_DTYPES[self.cfg.feature_dtype])
        body = {"batch": batch_id, "x": wire, "y": self.y[idx].numpy()}
        reply = request(Message("activations", body), "gradients", self.cfg.reply_timeout_s)
        grad = torch.from_numpy(np.array(reply.body["grad"], dtype=np.float32))  # decoded arrays are read-only
        if grad.shape != act.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match activations {tuple(act.shape)}")
        opt.zero_grad()
        act.backward(grad)
        opt.step()
        self.samples_sent += len(idx)

    def round_info(self) -> dict[str, Any]:
        return {"samples_sent": self.samples_sent}
