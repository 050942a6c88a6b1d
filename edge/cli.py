"""`splitedge edge`: run one edge aggregator (optionally bridging a site broker to the cloud's)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from splitedge.methods import compute
from splitedge.protocol import credentials
from splitedge.runtime import guard, metrics_http
from splitedge.runtime.plugin_args import add_plugin_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker the devices use, e.g. mqtt://127.0.0.1:1883")
    add_plugin_argument(p)
    p.add_argument("--id", required=True, help="this edge's id")
    p.add_argument("--upstream", default=None, help="the cloud's broker URL, when it differs from --broker")
    p.add_argument("--cloud", default="cloud", help="id of the cloud coordinator")
    p.add_argument("--run", default="default", help="run id (topic namespace)")
    p.add_argument("--seed", type=int, default=0, help="seed of this edge's randomness (feature sampling)")
    p.add_argument("--out", type=Path, default=None, help="write this node's byte counters here at exit")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    compute.add_argument(p)
    p.add_argument("--state-dir", type=Path, default=None,
                   help="save this edge's state here after every round and resume from it when restarted")
    p.add_argument("--takeover", action="store_true",
                   help="start even if the broker says an edge with this id is online")
    admit = p.add_mutually_exclusive_group()
    admit.add_argument("--manifest", type=Path, default=None, metavar="SHARDS",
                       help="the shards.json of `splitedge data split`, or the folder it wrote (its --out): admit "
                            "only the devices it lists, each counting at most its samples and class counts there")
    admit.add_argument("--admit-any-device", action="store_true",
                       help="run open on purpose: admit any device id, each bounded only by its own hello (without "
                            "--manifest an edge does so too, and says once at start-up that it is unsafe)")
    guard.add_arguments(p, "this edge's merge of a round (its devices' statistics or models, its own training)")
    credentials.add_arguments(p)
    metrics_http.add_arguments(p)


OPEN = ("no --manifest: this edge admits any device id that says hello, each weighing in its merges with the "
        "samples it claims, so anyone who can publish on its broker can join as many devices as it likes; give "
        "--manifest SHARDS (the folder or shards.json of `splitedge data split`), or --admit-any-device to run "
        "open on purpose")
"""What an edge without a manifest says once at start-up (the safe path admits only the split's devices)."""


def run(args: argparse.Namespace) -> int:
    with metrics_http.serve(args, "edge") as metrics:
        return _run(args, metrics)


def _torch_threads(threads: int) -> None:
    """Torch's threads, when torch is there (numpy-only methods' edges run without it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(threads)


def _say_who_is_admitted(args: argparse.Namespace, listed: Any) -> None:
    """An unsigned federation and an edge open to any device each say so once."""
    from splitedge.runtime.allowance import manifest_file
    from splitedge.runtime.node import status

    if credentials.unsigned(args):
        status.warning("edge %s: %s", args.id, credentials.UNSIGNED)
    if listed is not None:
        status.info("edge %s: admits only the %d devices of %s", args.id, len(listed), manifest_file(args.manifest))
    elif not args.admit_any_device:
        status.warning("edge %s: %s", args.id, OPEN)


def _run(args: argparse.Namespace, metrics: metrics_http.Endpoint) -> int:
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.runtime.node import status
    from splitedge.runtime.session import check_identity_free, connect
    from splitedge.runtime.allowance import manifest_allowances
    from splitedge.runtime.outputs import write_counters

    if args.state_dir is not None and args.state_dir.exists() and not args.state_dir.is_dir():
        raise ValueError(f"--state-dir {args.state_dir} is a file; give a folder")
    listed = None if args.manifest is None else manifest_allowances(args.manifest)
    merges = guard.RoundGuard.from_args(args, f"edge {args.id}")
    options = credentials.connect_options(args, args.broker, args.upstream)
    device = compute.resolve(args.device)  # a method not ported to it is refused when the cloud names it
    _torch_threads(args.threads)
    if not args.takeover:
        check_identity_free(args.upstream or args.broker, run=args.run, tier="edge", node_id=args.id, **options)
    down = connect(args.broker, run=args.run, tier="edge", node_id=args.id, **options)
    up = connect(args.upstream, run=args.run, tier="edge", node_id=args.id, **options) if args.upstream else down
    edge = EdgeAggregator(down, up, run=args.run, node_id=args.id, cloud=args.cloud, seed=args.seed,
                          state_dir=args.state_dir, listed=listed, guard=merges, compute=device)
    edge.logs_fatal = False  # said once, below, as the command's error line
    metrics.attach(edge, [down, up])
    try:
        merges.limit_process()  # after torch is in: the merge's ceiling as RLIMIT_DATA
        status.info("edge %s: merges with %s, trains on %s", args.id, merges.describe(), device.device)
        _say_who_is_admitted(args, listed)
        edge.start()
        edge.run_forever()
    finally:
        transports = list({id(down): down, id(up): up}.values())
        for t in transports:
            t.close(offline=True)
        write_counters(args.out, args.id, transports)
    if edge.fatal:
        raise ValueError(edge.fatal)
    if edge.stops.interrupted is not None and edge.stopped.is_set():  # the cloud was interrupted: not over
        from splitedge.runtime.stopping import EXIT_INTERRUPTED

        return EXIT_INTERRUPTED
    return 0
