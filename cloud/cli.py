"""`splitedge cloud`: the coordinator process (round schedule, head training, evaluation)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from splitedge.cloud.options import add_run_arguments

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker URL the edges report to")
    p.add_argument("--id", default="cloud")
    p.add_argument("--run", default="default", help="run id (topic namespace)")
    p.add_argument("--edges", type=int, default=1, help="wait for this many edges before round 1")
    p.add_argument("--devices", type=int, default=0, help="... and this many devices behind them")
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=None, help="metrics.jsonl and model.safetensors go here")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_run_arguments(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.cloud.options import build_run_config, method_overrides
    from splitedge.methods.datasets import load_dataset
    from splitedge.protocol.node import connect, write_counters

    torch.set_num_threads(args.threads)
    _, test, info = load_dataset(args.dataset, args.data, max_test=args.max_test, seed=args.seed)
    config = build_run_config(args.method, info, args.model, args.seed, method_overrides(args))
    settings = CloudSettings(method=args.method, rounds=args.rounds, config=config, deadline_s=args.deadline,
                             min_edges=args.edges,
                             min_devices=args.devices, join_timeout_s=args.join_timeout, out_dir=args.out,
                             seed=args.seed, on_round=_print_round)
    transport = connect(args.broker, run=args.run, tier="cloud", node_id=args.id)
    try:
        history = CloudCoordinator(transport, settings, run=args.run, test=test, node_id=args.id).run()
    finally:
        transport.close(offline=True)
        write_counters(args.out, args.id, [transport])
    if args.out is not None:
        from splitedge.plots import plot_spectra_per_round

        plot_spectra_per_round(history, args.out / "spectrum.png", title=f"{args.method} on {args.dataset}")
    print(json.dumps({"final_accuracy": history[-1].get("accuracy") if history else None}))
    return 0


def _print_round(record: dict) -> None:
    print(f"round {record['round']:3d}  accuracy {record.get('accuracy', float('nan')):.4f}  "
          f"{record['round_seconds']:.1f}s  edges {record['edges']}", flush=True)
