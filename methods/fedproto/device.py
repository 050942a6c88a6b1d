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

from splitedge.methods.calibration.personal import PersonalHead
from splitedge.methods.fedproto.loss import representation
from splitedge.methods.fedproto.protos import PROTOS, check_protos, protos_body
from splitedge.methods.moments import MomentAccumulator
from splitedge.methods.privacy.dpsgd_torch import terms_loss, train_dpsgd
from splitedge.methods.privacy.release import private_means_of
from splitedge.methods.data.preprocess import batches
from splitedge.methods.metrics.representation import effective_rank
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.fedproto.config import FedProtoConfig
from splitedge.methods.metrics.evaluate import accuracy
from splitedge.methods.torch_utils import build_split, local_tensors, retune, sgd, shuffled_batches
from splitedge.methods.training import Batch, Outputs, train_epochs


def holdout_split(n: int, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) index arrays; at least one sample on each side when n >= 2."""
    order = rng.permutation(n)
    n_eval = min(max(1, int(round(share * n))), n - 1) if n >= 2 else 0
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def held_out_tensors(data: tuple[np.ndarray, np.ndarray], spec: Any,
                     rows: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, ...]:
    """(x, y, x_eval, y_eval): the local tensors of the `holdout_split` rows (train, eval)."""
    x, y = local_tensors(data, spec)
    train, held = (torch.from_numpy(np.array(r, dtype=np.int64)) for r in rows)  # saved arrays are read-only
    return x[train], y[train], x[held], y[held]


class FedProtoDevice(PersonalHead, DevicePart[FedProtoConfig]):
    # The held-out split is drawn from the node's rng when the part is built, so a rebuilt part
    # would draw another: its rows are kept, the tensors rebuilt from them. The last accuracy
    # and rank are the round's, read by round_info as it ends. head: a calibrated global head
    # the cloud sent (calibrate=lda), scored on the held-out share in an evaluation phase.
    model: Kept[torch.nn.Module]
    opt: Kept[Any]
    protos: Kept[torch.Tensor]
    has_proto: Kept[torch.Tensor]
    proto_version: Kept[int]
    holdout_rows: Kept[np.ndarray]
    head: Kept[tuple[np.ndarray, np.ndarray] | None]
    head_version: Kept[int]
    can_calibrate = True
    secure_kinds = ("moments",)  # its prototypes: the edge takes their mean over devices (protos.py)
    moments_per = "device"
    private, private_clips = True, ("dp_clip",)  # only prototypes (and head statistics) leave it
    own_model_statistics = "its prototypes and head statistics are computed with the personal model it trains"
    dp_sgd = True  # dp_unit=sample: the personal model trains with DP-SGD, which bounds what is computed with it

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.model = build_split(self.spec).eval()
        self.dim = int(representation(self.model, torch.zeros(2, self.spec.channels, self.spec.image_size,
                                                                self.spec.image_size))[0].shape[1])
        if self.cfg.dim and self.cfg.dim != self.dim:
            raise ValueError(f"the run's prototypes have {self.cfg.dim} dimensions, this device's model {self.dim}")
        self.holdout_rows = holdout_split(len(data[1]), self.cfg.holdout, ctx.rng)
        self.x, self.y, self.x_eval, self.y_eval = held_out_tensors(data, self.spec, self.holdout_rows)
        self.opt = sgd(self.model.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        self.protos = torch.zeros(self.spec.num_classes, 0)
        self.has_proto = torch.zeros(self.spec.num_classes, dtype=torch.bool)
        self.proto_version = 0  # 0: no global prototypes yet (round 1 trains with CE only)
        self.last_accuracy = self.last_rank = float("nan")

    def restore_state(self, state: dict[str, Any]) -> None:
        super().restore_state(state)
        self.x, self.y, self.x_eval, self.y_eval = held_out_tensors(self.data, self.spec, self.holdout_rows)

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        retune(self.opt, lr=self.cfg.device_lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay)

    def ready(self, plan: RoundPlan) -> bool:
        """The global prototypes this round uses have arrived (and, to score it, the head)."""
        return self.proto_version >= plan.version(PROTOS) and self.head_ready(plan)

    def check(self, env: Any, source: str) -> None:
        if env.kind == "moments":
            check_protos(env.body, self.spec.num_classes, self.dim)
        elif self.is_head(env):
            self.check_head(env, self.dim)

    @torch.no_grad()
    def head_features(self, x: torch.Tensor) -> np.ndarray:
        """f(x), the representation the prototypes and a calibrated head work on (eval mode)."""
        self.model.eval()
        return representation(self.model, x)[0].numpy()

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        return self.head_features(torch.from_numpy(x))

    def on_message(self, env: Any) -> None:
        if self.is_head(env):
            self.take_head(env)
            return
        body = env.body
        if env.kind != "moments" or int(body["versions"].get(PROTOS, 0)) <= self.proto_version:
            return
        classes = np.array(body["classes"], dtype=np.int64)  # writable copies for torch
        mean = torch.from_numpy(np.array(body["mean"], dtype=np.float32))
        self.protos = torch.zeros(self.spec.num_classes, mean.shape[1])
        self.has_proto = torch.zeros(self.spec.num_classes, dtype=torch.bool)
        self.protos[torch.from_numpy(classes)] = mean
        self.has_proto[torch.from_numpy(classes)] = True
        self.proto_version = int(body["versions"][PROTOS])

    def forward(self, batch: Batch) -> Outputs:
        features, logits = representation(self.model, batch.x)
        return {"features": features, "logits": logits}

    def sample_loss(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        """One image's loss terms (DP-SGD's per-sample gradient: methods/privacy/dpsgd_torch.py)."""
        batch = Batch(x, y, extra)
        return terms_loss(self.method.loss_terms("device"), self.forward(batch), batch)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        protos = self.protos if self.protos.shape[1] else torch.zeros(self.spec.num_classes, self.dim)
        extra = {"protos": protos, "has_proto": self.has_proto}

        def epoch() -> Iterator[Batch]:
            for idx in shuffled_batches(len(self.y), self.cfg.device_batch, gen):
                yield Batch(self.x[idx], self.y[idx], extra)

        if self.cfg.dp_sigma > 0 and self.cfg.dp_unit == "sample":  # every step a counted release
            self.losses = train_dpsgd(self, self.model, lambda x, y: self.sample_loss(x, y, extra),
                                      lambda i: (self.x[i], self.y[i]), len(self.y), self.opt)
        else:
            self.losses = train_epochs(self.forward, self.method.loss_terms("device"), epoch, self.opt, [self.model],
                                       epochs=self.cfg.local_epochs)
        self.last_accuracy = accuracy(self.model, self.x_eval, self.y_eval)
        self.last_rank = self.held_out_rank()
        classes, counts, means = self.local_protos()
        yield Message("moments", protos_body(classes, counts, means, self.cfg.proto_dtype, self.proto_version))
        yield DONE

    @torch.no_grad()
    def local_protos(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-class means (float64) of f(x) over the training share, eval mode, no augmentation;
        counts are the device's samples per class; only classes above the run's minimum count.
        With DP on, a private release (methods/privacy/release.py), bounded at one image because
        the model trained with DP-SGD (dp_unit=device refuses it: methods/privacy/dpsgd.py)."""
        self.model.eval()
        if self.cfg.dp_sigma > 0:  # one noisy release of every class; the floor applies to its noisy counts
            rows = ((representation(self.model, self.x[sl])[0].numpy(), self.y[sl].numpy())
                    for sl in batches(len(self.y), 256))
            return private_means_of(self, rows, self.data[1], self.dim)
        keep = torch.from_numpy(self.stats_floor(self.y.numpy()).keep)
        x, y = self.x[keep], self.y[keep]
        acc = MomentAccumulator(self.dim)
        for sl in batches(len(y), 256):
            acc.add(representation(self.model, x[sl])[0].numpy(), y[sl].numpy())
        m = acc.result()
        return m.classes, m.counts, m.mean

    @torch.no_grad()
    def held_out_rank(self) -> float:
        """Effective rank of the representation on the held-out share (nan with fewer than 2)."""
        if len(self.y_eval) < 2:
            return float("nan")
        self.model.eval()
        return effective_rank(representation(self.model, self.x_eval)[0].numpy())

    def round_info(self) -> dict[str, Any]:
        return {"accuracy": self.last_accuracy, "effective_rank": self.last_rank, "eval_samples": int(len(self.y_eval))}
