"""FedProto device: a personal model trained with CE + lambda * prototype distance; only class
means of its representation go up, and it reports its own held-out accuracy.

The model is never averaged, so no global model exists: each round the device evaluates its
model on a fixed held-out share of its own data (`holdout`, default 20 %) and puts accuracy
and sample count in its `done` info (personalised accuracy).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.fedproto.loss import fedproto_loss, representation
from splitedge.methods.fedproto.protos import merge_protos, protos_body
from splitedge.methods.moments import MomentAccumulator
from splitedge.methods.preprocess import batches
from splitedge.methods.strategy import DONE, DevicePart, Message, NodeContext, RoundPlan
from splitedge.methods.torch_utils import accuracy, build_split, local_tensors, sgd, train_epoch


def holdout_split(n: int, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) index arrays; at least one sample on each side when n >= 2."""
    order = rng.permutation(n)
    n_eval = min(max(1, int(round(share * n))), n - 1) if n >= 2 else 0
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


class FedProtoDevice(DevicePart):
    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(FedProtoConfig, ctx.config)
        self.model = build_split(self.spec).eval()
        x, y = local_tensors(data, self.spec)
        train, held = holdout_split(len(y), self.cfg.holdout, ctx.rng)
        self.x, self.y = x[train], y[train]
        self.x_eval, self.y_eval = x[held], y[held]
        self.opt = sgd(self.model.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        self.protos = torch.zeros(self.spec.num_classes, 0)
        self.has_proto = torch.zeros(self.spec.num_classes, dtype=torch.bool)
        self.proto_version = 0  # 0: no global prototypes yet (round 1 trains with CE only)
        self.last_accuracy = float("nan")

    def ready(self, plan: RoundPlan) -> bool:
        """The plan's wc_version is the version of the global prototypes this round uses."""
        return self.proto_version >= plan.wc_version

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind != "moments" or body["wc_version"] <= self.proto_version:
            return
        classes = np.array(body["classes"], dtype=np.int64)  # writable copies for torch
        mean = torch.from_numpy(np.array(body["mean"], dtype=np.float32))
        self.protos = torch.zeros(self.spec.num_classes, mean.shape[1])
        self.has_proto = torch.zeros(self.spec.num_classes, dtype=torch.bool)
        self.protos[torch.from_numpy(classes)] = mean
        self.has_proto[torch.from_numpy(classes)] = True
        self.proto_version = int(body["wc_version"])

    def _loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features, logits = representation(model, x)
        protos = self.protos if self.protos.shape[1] else torch.zeros(self.spec.num_classes, features.shape[1])
        return fedproto_loss(logits, features, y, protos, self.has_proto, self.cfg.proto_lambda,
                             self.cfg.proto_distance)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        for _ in range(self.cfg.local_epochs):
            train_epoch(self.model, self.opt, self.x, self.y, batch=self.cfg.device_batch, gen=gen,
                        loss_fn=self._loss)
        self.last_accuracy = accuracy(self.model, self.x_eval, self.y_eval)
        classes, counts, means = self.local_protos()
        yield Message("moments", protos_body(classes, counts, means, self.cfg.proto_dtype, self.proto_version))
        yield DONE

    @torch.no_grad()
    def local_protos(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-class means (float64) of f(x) over the training share, eval mode, no augmentation;
        counts are the device's samples per class."""
        self.model.eval()
        acc: MomentAccumulator | None = None
        for sl in batches(len(self.y), 256):
            features = representation(self.model, self.x[sl])[0].numpy()
            acc = acc or MomentAccumulator(features.shape[1])
            acc.add(features, self.y[sl].numpy())
        assert acc is not None, "device has no training data"
        m = acc.result()
        return merge_protos([(m.classes, m.counts, m.mean)])

    def round_info(self) -> dict[str, Any]:
        return {"accuracy": self.last_accuracy, "eval_samples": int(len(self.y_eval))}
