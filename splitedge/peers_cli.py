"""`splitedge peers`: plan a run with no cloud (DecMAR peer to peer).

Draws the peer graph from a seed (Erdos-Renyi resampled until connected, or a ring), fixes the
method's settings and the model spec from the data set, and writes into DIR:

* plan.json: what every device reads with `splitedge device --peers DIR/plan.json`;
* graph.json and graph.png: the graph as data and as a picture;
* peers.acl: a Mosquitto acl_file letting each device login write only its own topics and
  read only its neighbours' peer topics (use it with a password_file of those logins).

It prints each device's command. The devices clock their own rounds (device/peer_agent.py).
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

from splitedge.methods.data.datasets import dataset_argument

PLAN = "plan.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from splitedge.methods.registry import get_method, list_methods

    serverless = [m for m in list_methods() if getattr(get_method(m), "serverless", False)]
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help=f"write {PLAN}, graph.json/png, peers.acl here")
    p.add_argument("--devices", required=True, type=int, metavar="N", help="devices d0 .. d<N-1>")
    p.add_argument("--degree", type=float, default=4.0, help="mean degree of the Erdos-Renyi graph")
    p.add_argument("--graph", choices=("er", "ring"), default="er", help="Erdos-Renyi (connected) or a ring")
    p.add_argument("--method", default=serverless[0] if serverless else None, choices=serverless,
                   help="a method whose devices run without a cloud")
    p.add_argument("--rounds", type=int, default=10, help="rounds every device runs")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds a round may take; a device waits at most half of it for a neighbour")
    p.add_argument("--dataset", default="digits", type=dataset_argument, metavar="DATASET",
                   help="the data set the devices' shards come from (fixes the model's input and normalisation)")
    p.add_argument("--data", default=None, help="CIFAR-10: the .tar.gz, an ImageFolder tree or cifar-10-batches-py")
    p.add_argument("--model", default=None, help="network split (cnn | fedcnn | fedcnn2 | resnet18) for methods that use one; default by data set")
    p.add_argument("--seed", type=int, default=0, help="seed of the graph and of the models' initial weights")
    p.add_argument("--run", default=None, help="run id (topic namespace); default: peers-<random>")
    p.add_argument("--broker", default="mqtt://BROKER-HOST:1883", metavar="URL", help="for the printed commands only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any method setting by name (repeatable), e.g. --set local_epochs=2")
    p.add_argument("--overwrite", action="store_true", help=f"replace a {PLAN} already in DIR")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from splitedge.cloud.options import build_run_config, check_run_arguments
    from splitedge.device.peer_agent import PeerPlan
    from splitedge.methods import topology
    from splitedge.protocol import acl
    from splitedge.methods.data.datasets import load_dataset

    if args.method is None:
        raise ValueError("no installed method runs without a cloud")
    if args.devices < 2:
        raise ValueError(f"--devices must be >= 2 (peers need neighbours), got {args.devices}")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = value
    check_run_arguments(args.method, args.rounds, args.dataset, args.data, args.deadline, args.seed, None, None,
                        overrides)
    plan_path = args.out / PLAN
    if plan_path.exists() and not args.overwrite:
        raise ValueError(f"{plan_path} exists; pass --overwrite to replace it or choose another --out")
    devices = [f"d{i}" for i in range(args.devices)]
    if args.graph == "ring" or args.devices < 3:
        graph = topology.ring(devices)
    else:
        graph = topology.erdos_renyi(devices, min(args.degree, args.devices - 1), np.random.default_rng(args.seed))

    _, _, info = load_dataset(args.dataset, args.data, max_test=1, seed=args.seed)
    graph_settings = {"graph": args.graph, "degree": str(args.degree)}
    config = build_run_config(args.method, info, args.model, args.seed, {**graph_settings, **overrides})
    run_id = args.run or f"peers-{uuid.uuid4().hex[:8]}"
    plan = PeerPlan(run=run_id, method=args.method, config=config.to_wire(), rounds=args.rounds,
                    deadline_s=args.deadline, graph=graph)
    args.out.mkdir(parents=True, exist_ok=True)
    topology.write_graph(args.out, graph, title=f"{args.method} peers, mean degree {topology.mean_degree(graph):.2f}")
    acl.write_acl(args.out / "peers.acl", acl.peer_acl(run_id, graph))
    plan_path.write_text(plan.to_json() + "\n")
    print(f"splitedge peers: {args.method}, {args.devices} devices, mean degree {topology.mean_degree(graph):.2f}, "
          f"{args.rounds} rounds, run {run_id}; wrote {plan_path}, graph.json, graph.png, peers.acl")
    print("on each device (its own shard, e.g. from `splitedge data split`):")
    for d in devices:
        print(f"  splitedge device --broker {args.broker} --id {d} --peers {plan_path} --data shard-{d}.npz "
              f"--out {d}-out")
    return 0
