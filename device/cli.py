"""`splitedge device`: run one device agent against a broker (works in the thin base install)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from splitedge.methods import compute
from splitedge.methods.contract import TRAIN_CHUNK
from splitedge.protocol import credentials
from splitedge.runtime import guard, metrics_http, uplink
from splitedge.runtime.plugin_args import add_plugin_argument

log = logging.getLogger(__name__)


def _add_privacy_arguments(p: argparse.ArgumentParser) -> None:
    """What the device's statistics and reports leave out (docs/privacy.md)."""
    p.add_argument("--min-class-count", type=int, default=1, metavar="K",
                   help="send no statistic of a class this device holds fewer than K images of (privacy: a class "
                        "mean over one image is that image's features); the run's own floor applies when higher")
    p.add_argument("--hide-classes", action="store_true",
                   help="the hello names no class (by default it lists the classes this device holds, in the clear); "
                        "for runs with DP (--dp-sigma), whose releases then keep every class the noise lets through")
    p.add_argument("--private-reports", action="store_true",
                   help="for runs with DP: the hello names no class and announces only the power of two at or above "
                        "this device's samples, and its round reports carry neither its samples, losses, held-out "
                        "scores nor CPU time, only its bytes, releases, refusals and withheld classes (by default all "
                        "of them go in the clear; docs/privacy.md, 'What stays in the clear')")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker URL, e.g. mqtt://edge-site:1883 or mqtts://...")
    add_plugin_argument(p)
    p.add_argument("--id", required=True, help="this device's id (unique in the run)")
    p.add_argument("--edge", default=None, help="id of the edge aggregator this device reports to")
    p.add_argument("--peers", type=Path, default=None, metavar="PLAN",
                   help="instead of --edge: run with no cloud and no edge, peer to peer, from the plan.json that "
                        "`splitedge peers` wrote (the same file on every device); --run comes from the plan")
    p.add_argument("--data", required=True, type=Path,
                   help="local data: an .npz shard (x uint8 [N,H,W,C], y) or an image folder <class>/*.jpg; "
                        "the onnx backend reads images from it a batch at a time")
    p.add_argument("--backend", choices=("auto", "torch", "onnx"), default="auto",
                   help="torch: the torch device (every method); onnx: the thin device, no torch and no graph "
                        "engine in the process: it builds W_c from its install's numpy layers and trains it (hsfp, "
                        "hsfp-cal, splitfed); auto: torch when it is installed, else onnx")
    p.add_argument("--run", default="default", help="run id (topic namespace); the same on every node of a run")
    p.add_argument("--seed", type=int, default=0, help="seed of this device's randomness (shuffles, augmentations)")
    p.add_argument("--out", type=Path, default=None,
                   help="write this node's byte counters here at exit (with --peers also its rounds and model)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (torch backend)")
    compute.add_argument(p)
    _add_privacy_arguments(p)
    p.add_argument("--train-chunk", type=int, default=TRAIN_CHUNK, metavar="N",
                   help="a thin device (--backend onnx) trains W_c N samples at a time, with the result of whole "
                        "batches: memory flat in the batch size at the whole batch's speed (0: whole batches, "
                        "whose activations take ~60 MB at the default batch)")
    p.add_argument("--takeover", action="store_true",
                   help="start even if the broker says a device with this id is online")
    guard.add_arguments(p, "a round's compute on this device (training, statistics, calibration, evaluation)")
    uplink.add_arguments(p)
    credentials.add_arguments(p)
    metrics_http.add_arguments(p)


def load_local_data(path: Path, backend: str = "torch"):
    """The device's own data, with numpy/PIL only. The thin (onnx) device streams its images
    from storage a batch at a time (methods/data/local.py); the torch device trains on random
    batches and holds them in memory."""
    from splitedge.methods.data.local import open_local_data

    return open_local_data(path, stream=backend == "onnx")


def resolve_backend(name: str) -> str:
    """`auto` is torch where torch is installed (it can train), else the thin onnx backend."""
    if name != "auto":
        return name
    import importlib.util

    return "torch" if importlib.util.find_spec("torch") is not None else "onnx"


def backend_compute(request: str, backend: str) -> compute.Compute:
    """The device a backend trains on: torch's `--device` resolved; a thin device computes in
    numpy on the CPU (torch is not imported for `auto`, and a named GPU is refused)."""
    if backend == "torch":
        return compute.resolve(request)
    if compute.check_request(request).startswith("cuda"):
        raise ValueError(f"--device {request}: a thin device (--backend {backend}) computes in numpy on the CPU; "
                         f"use --backend torch for the GPU, or --device cpu or auto")
    return compute.CPU


def run(args: argparse.Namespace) -> int:
    if (args.edge is None) == (args.peers is None):
        raise ValueError("give --edge ID (a device of a federated run) or --peers PLAN (a run with no cloud), not "
                         + ("both" if args.edge else "neither"))
    options = credentials.connect_options(args, args.broker)  # refused before the data is read
    with metrics_http.serve(args, "device") as metrics:
        return run_peer(args, options, metrics) if args.peers is not None else run_federated(args, options, metrics)


def run_federated(args: argparse.Namespace, options: dict[str, Any], metrics: metrics_http.Endpoint) -> int:
    """A device of a run with a cloud: its data is checked before connecting."""
    from splitedge.device.agent import DeviceAgent
    from splitedge.runtime.node import status
    from splitedge.runtime.outputs import write_counters

    if args.min_class_count < 1:
        raise ValueError(f"--min-class-count must be >= 1 (1: every class is sent), got {args.min_class_count}")
    if args.train_chunk < 0:
        raise ValueError(f"--train-chunk must be >= 0 (0: whole batches), got {args.train_chunk}")
    rounds = guard.RoundGuard.from_args(args, f"device {args.id}")
    sends = uplink.UplinkBudget.from_args(args, f"device {args.id}")
    backend = resolve_backend(args.backend)
    device = backend_compute(args.device, backend)
    data = load_local_data(args.data, backend)  # a shard that cannot work is refused before connecting
    transport = _connect(args, args.run, backend, options)
    agent = DeviceAgent(transport, run=args.run, node_id=args.id, edge=args.edge, data=data,
                        backend=backend, seed=args.seed, min_class_count=args.min_class_count,
                        train_chunk=args.train_chunk, hide_classes=args.hide_classes,
                        private_reports=args.private_reports, guard=rounds, uplink=sends, compute=device)
    agent.logs_fatal = False  # said once, below, as the command's error line
    metrics.attach(agent, [transport])
    try:
        rounds.limit_process()  # after torch and the data are in: the round's ceiling as RLIMIT_DATA
        status.info("device %s: backend %s on %s, broker %s; %s; %s", args.id, backend, device.device,
                    getattr(transport, "url", args.broker), rounds.describe(), sends.describe())
        if credentials.unsigned(args):
            status.warning("device %s: %s", args.id, credentials.UNSIGNED)
        agent.start()
        agent.run_forever()
    finally:
        transport.close(offline=True)
        write_counters(args.out, args.id, [transport])
    if agent.fatal:
        raise ValueError(agent.fatal)
    if agent.stops.interrupted is not None and agent.stopped.is_set():  # the cloud was interrupted: not over
        from splitedge.runtime.stopping import EXIT_INTERRUPTED

        return EXIT_INTERRUPTED
    return 0


def _connect(args: argparse.Namespace, run_id: str, backend: str, options: dict[str, Any]):
    """Torch's threads for a training device, the identity check, then the MQTT connection
    (`options`: the checked credentials, credentials.connect_options)."""
    from splitedge.runtime.session import check_identity_free, connect

    if backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    if not args.takeover:
        check_identity_free(args.broker, run=run_id, tier="device", node_id=args.id, **options)
    return connect(args.broker, run=run_id, tier="device", node_id=args.id, **options)


def run_peer(args: argparse.Namespace, options: dict[str, Any], metrics: metrics_http.Endpoint) -> int:
    """A device of a cloud-less run: the plan and the data are checked before connecting."""
    from splitedge.methods.data.local import fits_model
    from splitedge.device.peer_agent import PeerAgent, PeerPlan
    from splitedge.methods.registry import create_method
    from splitedge.runtime.node import status
    from splitedge.runtime.outputs import write_counters

    plan = PeerPlan.load(args.peers)
    if args.id not in plan.graph:
        raise ValueError(f"--id {args.id} is not in {args.peers} (its devices: {', '.join(sorted(plan.graph))})")
    backend = resolve_backend(args.backend)
    if backend != "torch":
        raise ValueError(f"{plan.method} trains on the device: it needs the torch backend (pip install torch)")
    method = create_method(plan.method, plan.config)
    device = compute.resolve_for(args.device, method.name, method.runs_on_cuda)
    data = load_local_data(args.data, backend)
    misfit = fits_model(data[0], data[1], method.spec)
    if misfit:
        raise ValueError(f"--data {args.data}: {misfit}")
    transport = _connect(args, plan.run, backend, options)
    agent = PeerAgent(transport, plan=plan, node_id=args.id, data=data, backend=backend, seed=args.seed,
                      compute=device)
    metrics.attach(agent, [transport])
    status.info("device %s: broker %s, no cloud", args.id, transport.url)
    try:
        agent.start()
        agent.run_rounds()
    finally:
        transport.close(offline=True)
        write_counters(args.out, args.id, [transport])
        if args.out is not None and agent.records:
            for path in agent.save(args.out):
                status.info("device %s: wrote %s", args.id, path)
    return 0
