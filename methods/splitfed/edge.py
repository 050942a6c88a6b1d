"""SplitFed edge: the server side (W_e + W_g) of SFLv1.

Each device's activations are trained through its own copy of the global W_e+W_g (created from
the global model at its first batch of the round), and the gradient of the activations goes back
on that device's topic at once. At round close the copies are averaged by the samples they saw
and sent up with the average of the devices' W_c; the cloud averages the edges.
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
import torch.nn.functional as F
from torch import nn

from splitedge.methods.averaging import averaged_body, weight_updates
from splitedge.methods.config import ModelSpec, from_config
from splitedge.methods.splitfed.config import SplitFedConfig
from splitedge.methods.strategy import EdgePart, Message, NodeContext, Report, RoundPlan
from splitedge.methods.torch_utils import Optimizer, build_split, sgd
from splitedge.models import load_numpy_state, state_to_numpy

log = logging.getLogger(__name__)

SERVER_PARTS = ("we", "wg")


class ServerSide(nn.Module):
    """W_e then W_g, keeping their state-dict names separate so each part averages on its own."""

    def __init__(self, we: nn.Module, wg: nn.Module) -> None:
        super().__init__()
        self.we, self.wg = we, wg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(self.we(x))


@dataclass
class Copy:
    model: ServerSide
    opt: Optimizer
    samples: int = 0


class SplitFedEdge(EdgePart):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.spec = from_config(ModelSpec, ctx.config)
        self.cfg = from_config(SplitFedConfig, ctx.config)
        split = build_split(self.spec)
        self.server = ServerSide(split.we, split.wg).eval()
        self.versions = {part: -1 for part in SERVER_PARTS}
        self.copies: dict[str, Copy] = {}
        self.losses: list[float] = []

    @property
    def version(self) -> int:
        return min(self.versions.values())

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= plan.we_version and self.version >= 0

    def on_message(self, env: Any) -> list[Message]:
        """Global W_c goes down to the devices; global W_e / W_g replace the server side."""
        if env.kind != "weights":
            return []
        part, version = env.body["part"], int(env.body["version"])
        if part == "wc":
            return [Message("weights", dict(env.body), retain=True, topic_kind="weights-wc")]
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
        loss = F.cross_entropy(entry.model(x), y)
        entry.opt.zero_grad()
        loss.backward()
        entry.opt.step()
        entry.samples += len(y)
        self.losses.append(float(loss.detach()))
        body = {"batch": int(env.body["batch"]), "grad": x.grad.numpy()}
        return [Message("gradients", body, target=env.sender)]

    def _copy_for(self, device: str) -> Copy:
        key = device if self.cfg.server_model == "per-device" else "shared"
        if key not in self.copies:
            model = copy.deepcopy(self.server)
            opt = sgd(model.parameters(), self.cfg.edge_lr, self.cfg.momentum, self.cfg.weight_decay)
            self.copies[key] = Copy(model, opt)
        return self.copies[key]

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        out: list[Message] = []
        wc = weight_updates(reports, "wc", plan.wc_version)
        if wc:
            out.append(Message("weights", averaged_body(wc, "wc", plan.wc_version)))
        copies = [c for c in self.copies.values() if c.samples > 0]
        for part in SERVER_PARTS:
            if copies:
                parts = [(state_to_numpy(getattr(c.model, part)), c.samples) for c in copies]
                out.append(Message("weights", averaged_body(parts, part, plan.we_version)))
        self.copies.clear()
        return out

    def round_info(self) -> dict[str, Any]:
        info = {"server_loss": float(np.mean(self.losses))} if self.losses else {}
        self.losses = []
        return info
