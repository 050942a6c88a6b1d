"""What every arm of `bench flower` outside the sim shares with splitedge's FedAvg, read from one
plan file.

The bench writes the plan (bench/flower.py `write_plan`): the data set and its Dirichlet split,
the rounds, and the run's config exactly as splitedge's cloud announces it to its devices
(`RunConfig.to_wire()`: the model spec with its seed and normalisation, FedAvg's settings). The
Flower processes and the floor parse it as a splitedge device parses a round announcement, and
train with the FedAvg device's own steps, so the network, its initial weights, the split, the
optimiser, the batches and their order cannot drift from the sim's: what differs between the
arms is the framework and the wire.
"""

from __future__ import annotations

import json
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

METHOD = "fedavg"
UNSUPPORTED = {"dp_sigma": 0.0, "update_codec": "none", "downlink_codec": "none", "calibrate": "none",
               "secagg": "off", "feddecorr_beta": 0.0}
"""FedAvg settings the arms outside the sim do not implement, at the values they must keep."""


@dataclass(frozen=True)
class Plan:
    dataset: str
    data: str | None
    max_train: int | None
    max_test: int | None
    seed: int
    devices: int
    alpha: float | None
    split: str
    rounds: int
    config: Any  # splitedge.methods.config.RunConfig (model spec and FedAvgConfig)

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "Plan":
        from splitedge.methods.config import RunConfig
        from splitedge.methods.registry import get_method

        raw = dict(raw)
        config = RunConfig.from_wire(get_method(METHOD).Config, raw.pop("config"))
        check_plain(config.method)
        return cls(config=config, **raw)

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        return cls.from_wire(json.loads(Path(path).read_text()))


def check_plain(cfg: Any) -> None:
    """Refuse (ValueError) FedAvg settings that the Flower arm and the floor do not implement."""
    off = {k: getattr(cfg, k) for k, v in UNSUPPORTED.items() if getattr(cfg, k) != v}
    if off:
        raise ValueError(f"bench flower compares plain FedAvg; the Flower arm does not implement {off}")


def load(plan: Plan) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train, test) as `splitedge sim` loads them for the plan's settings."""
    from splitedge.methods.data.datasets import load_dataset

    train, test, _ = load_dataset(plan.dataset, plan.data, max_train=plan.max_train, max_test=plan.max_test,
                                  seed=plan.seed)
    return train, test


def shards(plan: Plan, labels: np.ndarray) -> list[np.ndarray]:
    """Each device's image indices: the sim's own partition, from the same seed and alpha."""
    from splitedge.sim.federation import partition

    return partition(labels, types.SimpleNamespace(seed=plan.seed, alpha=plan.alpha, devices=plan.devices,
                                                   split=plan.split))


def device_rng(seed: int, device: int) -> np.random.Generator:
    """Device d<device>'s generator, as its agent seeds it (runtime/node.py): its batches' order."""
    from splitedge.runtime.node import Node

    return Node.seeded_rng(types.SimpleNamespace(node_id=f"d{device}"), seed)


def new_model(plan: Plan) -> Any:
    """The network with the initial weights splitedge's FedAvg cloud creates (the spec's seed)."""
    from splitedge.methods.torch_utils import build_split

    return build_split(plan.config.model).eval()


def state(model: Any) -> dict[str, np.ndarray]:
    from splitedge.models import state_to_numpy

    return state_to_numpy(model)


class LocalTrainer:
    """One device's FedAvg round as FedAvgDevice.run_round trains it (no DP, no update codec):
    a fresh PlainSGD each round, batches shuffled by a generator drawn from the device's rng,
    the method's device loss terms, `local_epochs` passes."""

    def __init__(self, plan: Plan, device: int, data: tuple[np.ndarray, np.ndarray], model: Any = None) -> None:
        from splitedge.methods.registry import get_method
        from splitedge.methods.torch_utils import local_tensors

        self.cfg = plan.config.method
        self.model = model if model is not None else new_model(plan)
        self.method = get_method(METHOD)(plan.config, name=METHOD)
        self.x, self.y = local_tensors(data, plan.config.model)
        self.rng = device_rng(plan.seed, device)
        self.losses: dict[str, float] = {}

    @property
    def samples(self) -> int:
        return len(self.y)

    def train(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The global model `weights` trained on this device's images; returns the trained weights."""
        from splitedge.methods.fedavg.device import round_optimiser, train_local
        from splitedge.methods.torch_utils import model_outputs
        from splitedge.models import load_numpy_state

        load_numpy_state(self.model, weights)
        opt, gen = round_optimiser(self.model, self.cfg, self.rng)
        self.losses = train_local(self.model, lambda batch: model_outputs(self.model, batch.x),
                                  self.method.loss_terms("device"), self.x, self.y, self.cfg, opt, gen)
        return state(self.model)


def evaluate(plan: Plan, model: Any, test: tuple[np.ndarray, np.ndarray], round_: int) -> dict[str, float]:
    """The global model after round `round_` on the test split, as splitedge's FedAvg cloud
    measures it: the effective rank every `report_every` rounds and after the last."""
    from splitedge.methods.contract import report_due
    from splitedge.methods.metrics.evaluate import evaluate as evaluate_model

    metrics = evaluate_model(model, test, plan.config.model,
                             represent=report_due(round_, plan.config.method.report_every, plan.rounds))
    return {k: float(metrics[k]) for k in ("accuracy", "effective_rank") if k in metrics}


class RoundLog:
    """One JSON line per finished round (its start and end in wall-clock seconds, its metrics),
    flushed at once: the bench reads the file while the arm runs to place the rounds in time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.write_text("")

    def write(self, round_: int, start: float, **fields: Any) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"round": round_, "start": start, "end": time.time(), **fields}) + "\n")
