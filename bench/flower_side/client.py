"""One Flower client for `bench flower`: device d<N>'s shard of the plan's split, trained with
splitedge's FedAvg device steps (common.LocalTrainer) behind Flower's NumPyClient, over gRPC.

Flower 1.42's `flwr.client.start_client` (deprecated since 1.13 in favour of the SuperNode, and
still shipped): one process per client, no subprocess of its own, so its CPU and RSS are the
client's alone.

    python -m splitedge.bench.flower_side.client --plan plan.json --server 127.0.0.1:9092 --device 0
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import numpy as np
from flwr.client import NumPyClient, start_client

from splitedge.bench.flower_side.common import LocalTrainer, Plan, load, shards, state


class FedAvgClient(NumPyClient):
    def __init__(self, trainer: LocalTrainer) -> None:
        self.trainer = trainer
        self.names = list(state(trainer.model))

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return list(state(self.trainer.model).values())

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        trained = self.trainer.train(dict(zip(self.names, parameters)))
        return list(trained.values()), self.trainer.samples, {}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--device", type=int, required=True)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as a `splitedge sim` device (--threads 1)
    plan = Plan.read(a.plan)
    train, _ = load(plan)
    idx = shards(plan, train[1])[a.device]
    trainer = LocalTrainer(plan, a.device, (train[0][idx], train[1][idx]))
    del train
    start_client(server_address=a.server, client=FedAvgClient(trainer).to_client(), insecure=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
