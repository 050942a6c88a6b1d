"""The self-supervised method entries: SimSiam, align-uniform and SSD (METHODS.md).

Torch-free at import; loss terms import torch when a training tier asks for them. All three
share the device and cloud parts (methods/ssl) and FedAvg's edge (a sample-weighted average of
the "model" part); they differ in their loss terms, and SSD in the scales the cloud sends.
"""

from __future__ import annotations

from typing import Any

from splitedge.methods.ssl.config import SSDConfig, SSLConfig
from splitedge.methods.contract import Method

MODEL = "model"

_PARTS = {
    "device:torch": "splitedge.methods.ssl.device:SSLDevice",
    "edge": "splitedge.methods.fedavg.edge:FedAvgEdge",
    "cloud": "splitedge.methods.ssl.cloud:SSLCloud",
}


class SimSiam(Method):
    name = "simsiam"
    Config = SSLConfig
    parts = _PARTS
    predictor = True
    exportable = False  # its checkpoint is the encoder with projector and predictor, not a SplitModel

    def objective(self, role: str) -> list[Any]:
        from splitedge.methods.ssl.losses import simsiam_loss
        from splitedge.methods.training import LossTerm

        return [LossTerm("simsiam", lambda out, b: simsiam_loss(out["p1"], out["p2"], out["z1"], out["z2"]),
                         needs=("p1", "p2", "z1", "z2"))]


class AlignUniform(Method):
    """The SSD paper's base: L = align(z1, z2) + beta * (unif(z1) + unif(z2)) / 2."""

    name = "align-uniform"
    Config = SSLConfig
    parts = _PARTS
    predictor = False
    exportable = False  # its checkpoint is the encoder with projector, not a SplitModel

    def objective(self, role: str) -> list[Any]:
        from splitedge.methods.ssl.losses import align_loss, uniformity_loss
        from splitedge.methods.training import LossTerm

        return [LossTerm("align", lambda out, b: align_loss(out["z1"], out["z2"]), needs=("z1", "z2")),
                LossTerm("uniformity", lambda out, b: (uniformity_loss(out["z1"]) + uniformity_loss(out["z2"])) / 2,
                         self.config.beta, needs=("z1", "z2"))]


class SSD(AlignUniform):
    """align-uniform + gamma * DSR (the cloud's Q and this device's scales d_k) + delta * PD."""

    name = "ssd"
    Config = SSDConfig
    parts = {**_PARTS, "cloud": "splitedge.methods.ssl.cloud:SSDCloud"}

    def objective(self, role: str) -> list[Any]:
        from splitedge.methods.ssl.losses import dsr_loss, dsr_paper_loss, pd_loss, pd_paper_loss
        from splitedge.methods.training import LossTerm

        cfg, terms = self.config, super().objective(role)
        paper = cfg.form == "paper"
        if cfg.dsr:  # on the normalised projections zh, with the cloud's Q and this device's d_k
            def one_dsr(x: Any, q: Any, d: Any) -> Any:
                return dsr_paper_loss(x, d) if paper else dsr_loss(x, q, d)

            def dsr(out: Any, b: Any) -> Any:
                if "q" not in b.extra or "d" not in b.extra:  # joined after the cloud drew the scales
                    return out["zh1"].sum() * 0.0
                q, d = b.extra["q"], b.extra["d"]
                return (one_dsr(out["zh1"], q, d) + one_dsr(out["zh2"], q, d)) / 2

            terms.append(LossTerm("dsr", dsr, cfg.gamma, needs=("zh1", "zh2")))
        if cfg.pd:
            def one_pd(h: Any, z: Any) -> Any:
                return pd_paper_loss(h, z) if paper else pd_loss(h, z, tau=cfg.pd_tau)

            def pd(out: Any, b: Any) -> Any:
                return (one_pd(out["h1"], out["z1"]) + one_pd(out["h2"], out["z2"])) / 2

            terms.append(LossTerm("pd", pd, cfg.delta, needs=("h1", "h2", "z1", "z2")))
        return terms
