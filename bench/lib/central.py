"""The upper bound of a federated row: the same network trained centrally on the same images.

`--variant upper=central[:KEY=VALUE,...]` in `splitedge bench accuracy`: the run's training
images (every device's, pooled), the network and initial weights the run's model spec gives,
FedAvg's device optimiser and batch (its settings, changed by the variant's), for as many
epochs as the federated rows have rounds (times `local_epochs`; with --until-plateau, until
its own plateau), evaluated on the same test split after each epoch. No broker and no bytes: it bounds what the devices' data can teach
this network, not a method.
"""

from __future__ import annotations

import time
from typing import Any

CENTRAL = "central"
"""The pseudo-method name a bench variant gives for this arm."""


def central_run(s: Any, label: str, overrides: dict[str, str], alpha: float | None, split: str) -> dict[str, Any]:
    """One centrally trained row of `splitedge bench accuracy` (its fields as a federated row's;
    `split` names the row's split, whose federated rows it bounds: central training pools it)."""
    import torch

    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.metrics.evaluate import evaluate
    from splitedge.methods.metrics.plateau import plateau_round
    from splitedge.methods.torch_utils import build_split, local_tensors, sgd, tensor_batches
    from splitedge.methods.training import cross_entropy_term, train_epochs
    from splitedge.models import SplitModel

    started = time.monotonic()
    torch.set_num_threads(1)
    train, test, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
    config = build_run_config("fedavg", info, s.model, s.seed, overrides)
    cfg, spec = config.method, config.model
    model: SplitModel = build_split(spec).train()
    x, y = local_tensors(train, spec)
    opt = sgd(model.parameters(), cfg.device_lr, cfg.momentum, cfg.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)
    curve, per_round = [], []

    def forward(batch: Any) -> dict[str, Any]:
        features, logits = model.features_and_logits(batch.x)
        return {"features": features, "logits": logits}

    for epoch in range(1, s.rounds * max(1, cfg.local_epochs) + 1):
        losses = train_epochs(forward, [cross_entropy_term()], tensor_batches(x, y, cfg.device_batch, gen), opt, [model])
        acc = evaluate(model, test, spec)["accuracy"]
        curve.append(acc)
        per_round.append({"round": epoch, "accuracy": acc, "loss": losses, "bytes": {}})
        if getattr(s, "until_plateau", False) and plateau_round(curve) is not None:
            break  # as the federated rows of an --until-plateau bench stop
    return {"method": label, "base_method": CENTRAL, "overrides": overrides, "split": split, "alpha": alpha,
            "final_accuracy": curve[-1], "best_accuracy": max(curve), "accuracy_per_round": curve,
            "accuracy_calibrated_per_round": None, "device_up_per_device_per_round": 0,
            "device_down_per_device_per_round": 0, "device_payload_per_device_per_round": 0,
            "total_device_payload_bytes": 0, "all_tiers_out_payload_bytes": 0, "train_images": int(len(y)),
            "images_per_device": None, "per_round": per_round, "round_seconds": [], "central": True,
            "wall_seconds": time.monotonic() - started, "effective_rank": None,
            "note": f"central training, {len(curve)} epochs over all {len(y)} training images ({info.name})"}
