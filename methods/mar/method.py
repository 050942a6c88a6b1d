"""The FedMAR and DecMAR method entries (METHODS.md). Torch-free at import."""

from __future__ import annotations

from typing import Any

from splitedge.methods.mar.config import DecMARConfig, MARConfig
from splitedge.methods.contract import Method

MODEL = "model"
LATENT, LATENTS, ZBAR = "latent", "latents", "zbar"  # `arrays` records: a device's mean latent, an edge's, the reference
UPLOAD = "upload"  # DecMAR directive: devices send their model up so the cloud can evaluate the consensus


class FedMAR(Method):
    """MAE + gamma_k * A-MMD(z, z_bar) on each device; FedAvg of the whole autoencoder through
    edges and the cloud; z_bar is last round's unweighted mean of the devices' mean latents.
    `--set mar=false` is plain federated MAE."""

    name = "fedmar"
    Config = MARConfig
    exportable = False  # its checkpoint is the masked autoencoder, not a SplitModel
    parts = {
        "device:torch": "splitedge.methods.mar.device:MARDevice",
        "edge": "splitedge.methods.mar.edge:MAREdge",
        "cloud": "splitedge.methods.mar.cloud:MARCloud",
    }

    def objective(self, role: str) -> list[Any]:
        from splitedge.methods.mar.losses import AMMD_FORMS
        from splitedge.methods.training import LossTerm

        ammd_loss = AMMD_FORMS[self.config.ammd]

        terms = [LossTerm("mae", lambda out, b: out["mae"], needs=("mae",))]
        if self.config.mar:
            def mar(out: Any, b: Any) -> Any:  # gamma_k depends on this device's participations: in extra
                if b.extra.get("zbar") is None:
                    return out["latent"].sum() * 0.0  # no reference yet (round 1)
                return b.extra["gamma"] * ammd_loss(out["latent"], b.extra["zbar"])

            terms.append(LossTerm("mar", mar, needs=("latent",)))
        return terms


class DecMAR(FedMAR):
    """No aggregator: each device averages itself with its graph neighbours every round, over
    device-to-device topics. A cloud, if present, announces rounds and evaluates, nothing
    more; without one the devices clock their rounds from a shared plan (`splitedge peers`)."""

    name = "decmar"
    Config = DecMARConfig
    serverless = True
    head_calibration = False
    parts = {
        "device:torch": "splitedge.methods.mar.device:DecMARDevice",
        "edge": "splitedge.methods.mar.edge:DecMAREdge",
        "cloud": "splitedge.methods.mar.cloud:DecMARCloud",
    }
