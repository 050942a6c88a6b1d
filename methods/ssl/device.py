"""Self-supervised device: train the global encoder + projector on two augmented views of its
unlabelled images with the method's loss terms, send the model back (FedAvg pattern).

Labels never enter training: the device keeps them only for its `hello` (class list, used to
partition and evaluate). SSD devices also hold the cloud's orthonormal Q and their own
scales d_k, which arrive addressed to them before round 1.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.ssl.method import MODEL
from splitedge.methods.ssl.model import build_net, normalise, to_unit
from splitedge.methods.ssl.augment import ssl_views
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.ssl.config import SSLConfig
from splitedge.methods.privacy.release import private_weights
from splitedge.methods.torch_utils import device_optimizer, private_norms, shuffled_batches
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import load_numpy_state, state_to_numpy
from splitedge.protocol.errors import ProtocolError

SCALE_RECORDS = ("ssd_q", "ssd_d")


class SSLDevice(DevicePart[SSLConfig]):
    # the optimiser is made afresh each round
    net: Kept[torch.nn.Module]
    version: Kept[int]
    scales: Kept[dict[str, torch.Tensor]]  # "q" [D, D], "d" [D] (SSD)
    # its model is all it sends: under DP the update clipped and noised as FedAvg's (and its
    # encoder's BatchNorm statistics released with dp_bn_clip), summed like FedAvg's under secagg
    private, private_clips = True, ("dp_update_clip",)
    secure_kinds = ("weights",)

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.net = build_net(self.spec, self.cfg.proj_hidden, self.method.predictor, self.cfg)
        self.specs = weight_specs(state_to_numpy(self.net))
        self.version = -1
        self.scales = {}

    def ready(self, plan: RoundPlan) -> bool:
        """The announced global model is here. SSD's scales come before round 1 on the same path
        (so in order); a device that joins later trains without DSR rather than wait for ever."""
        return self.version >= max(plan.version(MODEL), 0)

    def check(self, env: Any, source: str) -> None:
        body = env.body
        if env.kind == "weights":
            check_weights(body, self.specs, part=MODEL, source=source)
        elif env.kind == "arrays" and body["name"] in SCALE_RECORDS:
            key = "q" if body["name"] == "ssd_q" else "d"
            want = (self.net.dim, self.net.dim) if key == "q" else (self.net.dim,)
            got = body["arrays"].get(key)
            if got is None or tuple(got.shape) != want:
                raise ProtocolError("state.shape", f"{body['name']} needs {key} of shape {want}")

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["version"] > self.version:
            load_numpy_state(self.net, body["weights"])
            self.version = int(body["version"])
        elif env.kind == "arrays" and body["name"] in SCALE_RECORDS:
            key = "q" if body["name"] == "ssd_q" else "d"
            self.scales[key] = torch.from_numpy(np.array(body["arrays"][key], dtype=np.float32))

    can_calibrate = True

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """The global encoder's output, what the federated probe classifies (labels are used
        here only, to measure the representation; training never sees them)."""
        self.net.eval()
        with torch.inference_mode():
            return self.net.encoder(torch.from_numpy(x)).numpy()

    def forward(self, batch: Batch) -> Outputs:
        """Both views through encoder and projector (and predictor) as one batch of 2B."""
        v1, v2 = ssl_views(batch.x, batch.extra["gen"], scale=(self.cfg.crop_scale_min, 1.0))
        h = self.net.encoder(normalise(torch.cat([v1, v2]), self.spec))
        z = self.net.projector(h)
        half = len(batch.x)
        out = {"features": h, "h1": h[:half], "h2": h[half:], "z1": z[:half], "z2": z[half:]}
        zh = F.normalize(z, dim=1)
        out["zh1"], out["zh2"] = zh[:half], zh[half:]
        if self.net.predictor is not None:
            p = self.net.predictor(z)
            out["p1"], out["p2"] = p[:half], p[half:]
        return out

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        # A fresh optimiser each round: momentum from the last local model does not fit the new global one.
        opt = device_optimizer(self.net.parameters(), self.cfg)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        x = self.data[0]

        def epoch() -> Iterator[Batch]:
            for idx in shuffled_batches(len(x), self.cfg.device_batch, gen):
                yield Batch(to_unit(x[idx.numpy()]), None, {"gen": gen, **self.scales})

        start = state_to_numpy(self.net) if self.cfg.dp_sigma > 0 else None
        images = lambda: (normalise(to_unit(x[i:i + 256]), self.spec) for i in range(0, len(x), 256))  # noqa: E731
        norms = private_norms(self, self.net, images)  # of the model received, before training
        self.losses = train_epochs(self.forward, self.method.loss_terms("device"), epoch, opt, [self.net],
                                   epochs=self.cfg.local_epochs)
        weights = state_to_numpy(self.net)
        if start is not None:  # differential privacy: the update clipped and noised (methods/privacy)
            weights = private_weights(self, weights, start, norms)
        body = {"part": MODEL, "version": self.version, "samples": self.reported_samples(len(x)), "weights": weights}
        yield Message("weights", body)
        yield DONE
