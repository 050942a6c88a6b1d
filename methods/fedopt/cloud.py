"""FedOpt cloud: FedAvg's, with the merged model taken as a pseudo-gradient step of the server
optimiser instead of as the new model."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from splitedge.methods.contract import CloudContext, Kept
from splitedge.methods.fedavg.cloud import FedAvgCloud
from splitedge.methods.fedopt.config import FedOptConfig
from splitedge.methods.fedopt.server import ServerOptimiser
from splitedge.models import state_to_numpy


class FedOptCloud(FedAvgCloud[FedOptConfig]):
    def __init__(self, ctx: CloudContext) -> None:
        super().__init__(ctx)
        cfg = self.cfg
        self.server = ServerOptimiser(cfg.server_opt, lr=cfg.server_lr, beta1=cfg.beta1, beta2=cfg.beta2, tau=cfg.tau,
                                      params=tuple(name for name, _ in self.model.named_parameters()))

    # the optimiser's moments are the part's state: Kept properties over the server optimiser's
    @property
    def server_m(self) -> Kept[dict[str, np.ndarray]]:
        return self.server.m

    @server_m.setter
    def server_m(self, value: dict[str, np.ndarray]) -> None:
        self.server.m = dict(value)

    @property
    def server_v(self) -> Kept[dict[str, np.ndarray]]:
        return self.server.v

    @server_v.setter
    def server_v(self, value: dict[str, np.ndarray]) -> None:
        self.server.v = dict(value)

    def server_update(self, merged: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return self.server.step(state_to_numpy(self.model), merged)
