"""FedAvg device: adopt the announced global model, train it on its loss terms, send it back."""

from __future__ import annotations

from typing import Any, Iterator, TypeVar

import numpy as np
import torch

from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.torch_utils import (build_split, input_batches, local_tensors, model_outputs, private_norms, sgd,
                                          tensor_batches)
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.methods.privacy.dpsgd_torch import terms_loss, train_dpsgd
from splitedge.methods.privacy.norm_stats import with_statistics
from splitedge.methods.privacy.release import private_weights
from splitedge.methods.update_codec import UpdateEncoder
from splitedge.models import device_of, load_numpy_state, state_to_numpy
from splitedge.models.split import head_features


def round_optimiser(model: torch.nn.Module, cfg: Any, rng: np.random.Generator) -> tuple[Any, torch.Generator]:
    """A fresh optimiser (momentum from the last local model does not fit the new global one) and
    the generator of this round's batch order, drawn from the device's rng (in that order: a run
    reproduces its batches only if every FedAvg-style device draws the same way)."""
    opt = sgd(model.parameters(), cfg.device_lr, cfg.momentum, cfg.weight_decay)
    return opt, torch.Generator().manual_seed(int(rng.integers(2**31)))


def train_local(model: torch.nn.Module, forward: Any, terms: Any, x: torch.Tensor, y: torch.Tensor, cfg: Any,
                opt: Any, gen: torch.Generator) -> dict[str, float]:
    """`local_epochs` passes of the method's device loss terms over (x, y) in batches of
    `device_batch`, each moved to the model's device; the mean loss terms."""
    return train_epochs(forward, terms, tensor_batches(x, y, cfg.device_batch, gen, device_of(model)), opt, [model],
                        epochs=cfg.local_epochs)


ConfigT = TypeVar("ConfigT", bound=FedAvgConfig)


class FedAvgDevice(DevicePart[ConfigT]):
    # the optimiser is made afresh each round; specs and the local tensors come from the spec and data
    model: Kept[torch.nn.Module]
    version: Kept[int]
    encoder: Kept[UpdateEncoder]
    private, private_clips = True, ("dp_update_clip",)
    encodes_updates = True
    dp_sgd = True  # dp_unit=sample: trains with DP-SGD (per-image clipping), sends the model as trained
    secure_kinds = ("weights",)

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.model = build_split(self.spec).to(self.device).eval()
        self.specs = weight_specs(state_to_numpy(self.model))
        self.x, self.y = local_tensors(self.training_data(), self.spec)
        self.version = -1  # no global model yet: the announced one must arrive first
        self.encoder = UpdateEncoder(self.cfg.update_codec, self.cfg.update_topk)  # the uplink's residual

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.version(MODEL) and self.version >= 0

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights":
            check_weights(env.body, self.specs, part=MODEL, source=source)

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["version"] > self.version:
            load_numpy_state(self.model, body["weights"])
            self.version = int(body["version"])

    def forward(self, batch: Batch) -> Outputs:
        return model_outputs(self.model, batch.x)

    def sample_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One image's loss terms (DP-SGD's per-sample gradient: methods/privacy/dpsgd_torch.py)."""
        batch = Batch(x, y)
        return terms_loss(self.method.loss_terms("device"), self.forward(batch), batch)

    def load_samples(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels at `idx`, on the part's device (DP-SGD's draws)."""
        return self.x[idx].to(self.device), self.y[idx].to(self.device)

    can_calibrate = layered_calibration = True

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """The global model's classifier input (in a calibration phase: the model just merged)."""
        return self.stage_outputs(x)["classifier"]

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """W_c's and W_e's outputs and the classifier's input of the global model, in eval mode."""
        was, model = self.model.training, self.model
        model.eval()
        try:
            with torch.inference_mode():
                h = model.wc(torch.from_numpy(x).to(self.device))
                e = model.we(h)
                return {"wc": h.cpu().numpy(), "we": e.cpu().numpy(),
                        "classifier": head_features(model.wg, e)[0].cpu().numpy()}
        finally:
            model.train(was)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        opt, gen = round_optimiser(self.model, self.cfg, self.ctx.rng)
        # differential privacy covers what training took from the data; with local_epochs 0 (a
        # public setting) the weights go back as received, an update of zero that costs no release
        private = self.cfg.dp_sigma > 0 and self.cfg.local_epochs > 0
        coded = self.cfg.update_codec != "none"
        start = state_to_numpy(self.model) if private or coded else None
        norms = private_norms(self, self.model, input_batches(self.x)) if private else {}  # of the model received
        if private and self.cfg.dp_unit == "sample":  # DP-SGD: the model it sends is post-processing
            self.losses = train_dpsgd(self, self.model, self.sample_loss, self.load_samples, len(self.y), opt)
            weights = with_statistics(state_to_numpy(self.model), norms)
        else:
            self.losses = train_local(self.model, self.forward, self.method.loss_terms("device"), self.x, self.y,
                                      self.cfg, opt, gen)
            weights = state_to_numpy(self.model)
        if private and self.cfg.dp_unit == "device":  # DP-FedAvg: the update clipped and noised
            weights = private_weights(self, weights, start, norms)
        body = {"part": MODEL, "version": self.version, "samples": self.reported_samples(len(self.y)),
                "weights": weights}
        if coded:  # the update compressed against the model it was trained from (methods/update_codec.py)
            body.update(self.encoder.encode(weights, start, np.random.default_rng(int(self.ctx.rng.integers(2**31)))))
        yield Message("weights", body)
        yield DONE
