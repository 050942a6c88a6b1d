"""The CFLHKD method entry (METHODS.md): clustered FL whose clusters sit on edges, with
multi-teacher distillation from class-wise mean logits. Torch-free at import."""

from __future__ import annotations

from typing import Any

from splitedge.methods.cflhkd.config import CFLHKDConfig
from splitedge.methods.contract import Method

MODEL = "model"
GLOBAL = "global"  # the cloud's global model on every device, in the two-way hierarchy (after clustering)
TEACHERS = "teachers"  # the `arrays` record with every cluster's logits table
SIGNAL = "signal"  # a device's clustering signal, as an `arrays` record
SIGNALS = "signals"  # an edge's devices' signals, forwarded to the cloud
WARMUP, CLUSTERED = "warmup", "clustered"  # `phase` directive


class CFLHKD(Method):
    name = "cflhkd"
    Config = CFLHKDConfig
    parts = {
        "device:torch": "splitedge.methods.cflhkd.device:CFLHKDDevice",
        "edge": "splitedge.methods.cflhkd.edge:CFLHKDEdge",
        "cloud": "splitedge.methods.cflhkd.cloud:CFLHKDCloud",
    }

    def objective(self, role: str) -> list[Any]:
        """CE + lambda_g KL(global teacher) + lambda_p KL(weighted peer teachers), at T (x T^2,
        Hinton's scaling, so the distillation gradients keep their size as T grows)."""
        from splitedge.methods.cflhkd.distill import kd_model_term, kd_term
        from splitedge.methods.training import cross_entropy_term

        cfg = self.config
        terms = [cross_entropy_term()]
        if cfg.kd:
            global_term = kd_model_term if cfg.global_teacher == "model" else kd_term
            terms += [global_term("kd_global", "teacher_global", cfg.temperature, cfg.lambda_g),
                      kd_term("kd_peers", "teacher_peers", cfg.temperature, cfg.lambda_p)]
        return terms

    def upward_terms(self) -> list[Any]:
        """What a device's copy of the global model minimises with distill_global: the paper's
        cluster-to-global flow, KL to its freshly trained cluster model at T (x T^2), beside the
        cross-entropy on the device's labels (weight `global_ce`; 0: distillation alone), so the
        global model is trained as FedAvg trains it and taught by the clusters on top."""
        from splitedge.methods.cflhkd.distill import kd_model_term
        from splitedge.methods.training import cross_entropy_term

        cfg = self.config
        terms = [kd_model_term("kd_up", "teacher_cluster", cfg.temperature, cfg.lambda_up)]
        return terms + ([cross_entropy_term("ce_up", cfg.global_ce)] if cfg.global_ce > 0 else [])
