"""SCAFFOLD cloud: x <- x + lr_g (mean(y) - x) with FedAvg's merge, and c <- c + (|S| / N)
mean(dc) over the |S| devices that reported of the N the federation has; c goes to every device
with the model, versioned alike."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitedge.methods.averaging import average_states, weight_updates
from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.contract import DEVICES, CloudContext, Kept, Message, Report, RoundPlan, RoundSpec
from splitedge.methods.fedavg.cloud import FedAvgCloud
from splitedge.methods.fedavg.method import MODEL
from splitedge.methods.scaffold.device import parameter_map
from splitedge.methods.scaffold.method import C, DC, ScaffoldConfig
from splitedge.models import state_to_numpy


class ScaffoldCloud(FedAvgCloud[ScaffoldConfig]):
    c_global: Kept[dict[str, np.ndarray]]

    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        self.c_global = {n: np.zeros_like(a) for n, a in parameter_map(self.model).items()}
        self.c_specs = weight_specs(self.c_global)

    def _control_message(self) -> Message:
        body = {"part": C, "version": self.version, "samples": 0, "weights": dict(self.c_global)}
        return Message("weights", body, to=DEVICES, slot=C)

    def initial_messages(self) -> list[Message]:
        return [*super().initial_messages(), self._control_message()]

    def plan(self, round_: int) -> RoundSpec:
        return RoundSpec(versions={MODEL: self.version, C: self.version})

    def check(self, env: Any, source: str) -> None:
        if env.kind == "weights" and env.body["part"] == DC:
            check_weights(env.body, self.c_specs)
        else:
            super().check(env, source)

    def server_update(self, merged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """x + lr_g (mean(y) - x) on the trainable parameters; buffers as merged."""
        lr, current = self.cfg.server_lr, state_to_numpy(self.model)
        return {n: (current[n] + lr * (merged[n].astype(np.float64) - current[n])).astype(merged[n].dtype)
                if n in self.c_global else merged[n] for n in merged}

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, Any]]:
        version = self.version
        out, metrics = super().aggregate(plan, reports)
        changes = weight_updates(reports, DC, plan.version(MODEL))
        reported = sum(n for _, n in changes)
        if changes:
            share = reported / max(len(self.ctx.view.devices), reported)  # |S| / N
            mean = average_states(changes)  # each edge's mean weighted by its devices: the mean over devices
            self.c_global = {n: (c + share * mean[n].astype(np.float64)).astype(np.float32)
                             for n, c in self.c_global.items()}
        if self.version != version or changes:
            out.append(self._control_message())
        return out, {**metrics, "control_devices": reported}
