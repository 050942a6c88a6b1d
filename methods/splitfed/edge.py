"""SplitFed edge: the server side (W_e + W_g) of SFLv1.

Each device's activations are trained through its own copy of the global W_e+W_g (created from
the global model at its first batch of the round), and the gradient of the activations goes back
to that device at once. At round close the copies are merged by the samples they saw and sent
up with the merge of the devices' W_c; the cloud merges the edges.
`server_model = "shared"` trains one copy per edge instead (SFLv2-like within an edge).

Ordering: the cloud publishes the new global W_e/W_g before announcing the next round, and the
edge handles both in order on one thread before relaying the round, so a round's first
activations always meet that round's global server-side model.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from splitedge.methods.averaging import GlobalModels, averaged_body, weight_updates
from splitedge.methods.calibration.upper import CALIB
from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.losslog import LossLog
from splitedge.methods.splitfed.method import MODEL
from splitedge.methods.contract import EdgeContext, EdgePart, Kept, Message, Report, RoundPlan, device
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.torch_utils import Optimizer, build_split, sgd
from splitedge.methods.training import Batch, Outputs, train_step
from splitedge.models import head_features, load_numpy_state, state_to_numpy
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

SERVER_PARTS = ("we", "wg")


class ServerSide(nn.Module):
    """W_e then W_g, keeping their state-dict names separate so each part averages on its own."""

    def __init__(self, we: nn.Module, wg: nn.Module) -> None:
        super().__init__()
        self.we, self.wg = we, wg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(self.we(x))

    def outputs(self, x: torch.Tensor) -> Outputs:
        features, logits = head_features(self.wg, self.we(x))
        return {"features": features, "logits": logits}


@dataclass
class Copy:
    model: ServerSide
    opt: Optimizer
    samples: int = 0


class SplitFedEdge(EdgePart[SplitFedConfig]):
    # the per-device copies and their loss log live within a round (cleared when it closes)
    server: Kept[ServerSide]
    versions: Kept[dict[str, int]]

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        split = build_split(self.spec)
        self.server = ServerSide(split.we, split.wg).eval()
        self.wc_shape = tuple(split.wc_shape)
        self.specs = {part: weight_specs(state_to_numpy(split.part(part))) for part in ("wc", *SERVER_PARTS)}
        self.versions = {part: -1 for part in SERVER_PARTS}
        self.copies: dict[str, Copy] = {}
        self.models = GlobalModels()  # the global W_c relayed: what the devices' W_c updates train from
        self.log = LossLog()

    @property
    def version(self) -> int:
        return min(self.versions.values())

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.version(MODEL) and self.version >= 0

    def check(self, env: Any, source: str) -> None:
        body = env.body
        if env.kind == "weights" and body["part"] == CALIB:
            return  # W_e and the trunk for the devices' calibration: relayed, checked by them
        if env.kind == "weights":
            if body["part"] not in self.specs:
                raise ProtocolError("state.part", f"no SplitFed part {body['part']!r}")
            check_weights(body, self.specs[body["part"]], source=source, trained_from=self.models.of(body))
        elif env.kind == "activations":
            if tuple(body["x"].shape[1:]) != self.wc_shape:
                raise ProtocolError("state.shape", f"activations of shape {body['x'].shape[1:]}, W_c gives {self.wc_shape}")
            if len(body["y"]) and int(body["y"].max()) >= self.spec.num_classes:
                raise ProtocolError("state.classes", f"label {int(body['y'].max())} outside {self.spec.num_classes} classes")

    def on_message(self, env: Any) -> list[Message]:
        """Global W_e / W_g replace the server side (W_c for devices is relayed by the runtime)."""
        if env.kind != "weights":
            return []
        part, version = env.body["part"], int(env.body["version"])
        if part == "wc":
            self.models.note(part, version, env.body["weights"])  # relayed to devices: their W_c trains from it
        if part in SERVER_PARTS and version > self.versions[part]:
            load_numpy_state(getattr(self.server, part), env.body["weights"])
            self.versions[part] = version
        return []

    def on_device_message(self, env: Any) -> list[Message]:
        if env.kind != "activations":
            return []
        if self.version < 0:
            log.warning("edge %s: activations from %s before the global W_e/W_g arrived", self.ctx.node_id, env.sender)
            return []
        entry = self._copy_for(env.sender)
        x = torch.tensor(np.asarray(env.body["x"], dtype=np.float32), requires_grad=True)
        y = torch.from_numpy(np.array(env.body["y"], dtype=np.int64))  # writable copy
        entry.model.train()
        train_step(lambda b: entry.model.outputs(b.x), self.method.loss_terms("edge"), Batch(x, y), entry.opt, self.log)
        entry.samples += len(y)
        body = {"batch": int(env.body["batch"]), "grad": x.grad.numpy()}
        return [Message("gradients", body, to=device(env.sender))]

    def _copy_for(self, dev: str) -> Copy:
        key = dev if self.cfg.server_model == "per-device" else "shared"
        if key not in self.copies:
            model = copy.deepcopy(self.server)
            opt = sgd(model.parameters(), self.cfg.edge_lr, self.cfg.momentum, self.cfg.weight_decay)
            self.copies[key] = Copy(model, opt)
        return self.copies[key]

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        out: list[Message] = []
        version = plan.version(MODEL)
        wc = weight_updates(reports, "wc", version)
        if wc:
            out.append(Message("weights", averaged_body(wc, "wc", version, self.method.merge_weights,
                                                        self.models.trained_from("wc", version))))
        copies = [self.copies[d] for d in sorted(self.copies) if self.copies[d].samples > 0]  # one order, one sum
        for part in SERVER_PARTS:
            if copies:
                parts = [(state_to_numpy(getattr(c.model, part)), c.samples) for c in copies]
                start = state_to_numpy(getattr(self.server, part))  # every copy starts from the global part
                out.append(Message("weights", averaged_body(parts, part, version, self.method.merge_weights, start)))
        self.copies.clear()
        self.losses, self.log = self.log.means(), LossLog()
        return out

    def round_info(self) -> dict[str, Any]:
        return {"server_loss": self.losses["ce"]} if "ce" in self.losses else {}
