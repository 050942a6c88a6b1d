"""The floor of `bench flower`: the plan's FedAvg rounds in one process, no framework, no wire.

Every device's local training (common.LocalTrainer, the FedAvg device's steps), the method's
merge and the cloud's evaluation, one after another: the work a round cannot do without. A
framework's round costs this plus what it adds (processes, serialisation, the network).

    python -m splitedge.bench.flower_side.floor --plan plan.json --rounds-file rounds.jsonl
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

from splitedge.bench.flower_side.common import LocalTrainer, Plan, RoundLog, evaluate, load, new_model, shards, state


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--rounds-file", required=True)
    a = p.parse_args(argv)
    import torch

    from splitedge.models import load_numpy_state

    torch.set_num_threads(1)  # as `splitedge sim` (--threads 1) and every Flower process
    plan, log = Plan.read(a.plan), RoundLog(a.rounds_file)
    train, test = load(plan)
    model = new_model(plan)  # the devices' rounds run one at a time: one network serves them all
    trainers = [LocalTrainer(plan, d, (train[0][idx], train[1][idx]), model=model)
                for d, idx in enumerate(shards(plan, train[1]))]
    method = trainers[0].method
    global_ = state(model)
    for round_ in range(1, plan.rounds + 1):
        start = time.time()
        updates = [(t.train(global_), t.samples) for t in trainers]
        load_numpy_state(model, method.merge_weights(updates, reference=global_))
        global_ = state(model)  # as the cloud sends it: the merge as the model holds it
        log.write(round_, start, **evaluate(plan, model, test, round_))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
