"""Device cost of a FedAvg device (the heaviest device role: it trains the whole network):
seconds per local epoch and the process's peak RSS, one fresh process per model.

Run from the repo root:
  .venv/bin/python bench/scripts/fedcnn_device_cost.py --write-shard /tmp/shard5000.npz --images 5000
  .venv/bin/python bench/scripts/fedcnn_device_cost.py --shard /tmp/shard5000.npz --model fedcnn
The first writes N random CIFAR-10 training images (seeded) as a device shard (.npz, the
format `splitedge device --data` reads); the second, in a fresh process that never holds the
whole data set, builds the real FedAvg device part (methods/fedavg/device.py) on it, runs `--epochs` rounds of one local epoch each (torch, 1 thread) and prints
one JSON line: per-epoch seconds and VmHWM (peak RSS) from /proc/self/status, plus the RSS
right after the model and data were built.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", default=None)
    p.add_argument("--write-shard", default=None)
    p.add_argument("--model", default="fedcnn")
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--data", default="../shared/data/cifar10-jpeg.tar.gz")
    p.add_argument("--lr", type=float, default=0.01)
    a = p.parse_args()
    import torch

    from splitedge.cloud.options import build_run_config
    from splitedge.methods.registry import create_method
    from splitedge.methods.contract import DONE, DeviceContext, RoundPlan

    torch.set_num_threads(1)
    if a.write_shard:
        from splitedge.methods.data.datasets import load_dataset, save_shard

        (x, y), _, _ = load_dataset("cifar10", a.data)
        pick = np.sort(np.random.default_rng(0).permutation(len(y))[:a.images])
        save_shard(a.write_shard, x[pick], y[pick])
        return
    from splitedge.methods.data.datasets import DatasetInfo, channel_stats, load_shard

    x, y = load_shard(a.shard)
    mean, std = channel_stats(x)
    info = DatasetInfo("cifar10", 10, x.shape[3], x.shape[1], mean, std, tuple(str(i) for i in range(10)))
    method = create_method("fedavg", build_run_config("fedavg", info, a.model, 0, {"device_lr": a.lr}))
    dev = method.device_part(DeviceContext("d0", method, np.random.default_rng(0)), (x, y), "torch")
    dev.version = 0
    built = rss_mb("VmRSS")
    plan = RoundPlan(round=1, method="fedavg", deadline_s=0.0, config={}, versions={"model": 0})
    seconds = []
    for _ in range(a.epochs):
        t = time.perf_counter()
        for msg in dev.run_round(plan):
            if msg is DONE:
                break
        seconds.append(time.perf_counter() - t)
    params = sum(p.numel() for p in dev.model.parameters())
    print(json.dumps({"model": a.model, "parameters": params, "images": len(y), "threads": 1,
                      "seconds_per_epoch": [round(s, 2) for s in seconds], "rss_after_build_mb": round(built, 1),
                      "peak_rss_mb": round(rss_mb("VmHWM"), 1), "final_loss": dev.losses.get("ce")}))


if __name__ == "__main__":
    main()
