"""`splitedge cloud`: the coordinator process (round schedule, head training, evaluation)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitedge.cloud.options import add_run_arguments
from splitedge.protocol import credentials
from splitedge.runtime import guard, metrics_http

if TYPE_CHECKING:
    from splitedge.cloud.settings import CloudSettings

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker URL the edges report to")
    credentials.add_arguments(p)
    p.add_argument("--id", default="cloud", help="this coordinator's id (edges name it with --cloud)")
    p.add_argument("--run", default="default", help="run id (topic namespace); the same on every node of a run")
    p.add_argument("--edges", type=int, default=1, help="wait for this many edges before round 1")
    p.add_argument("--devices", type=int, default=1, help="... and this many devices behind them (at least 1)")
    p.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for them before giving up")
    p.add_argument("--rejoin-timeout", type=float, default=120.0,
                   help="before a round, seconds to wait for edges that went offline (a broker restart) before going "
                        "on without them, or stopping when none is back")
    p.add_argument("--rejoin-grace", type=float, default=30.0,
                   help="before a round, while other edges are online, seconds to wait for an edge that went offline "
                        "(a restarted edge: systemd's RestartSec plus its start) before going on without it")
    p.add_argument("--out", type=Path, default=None,
                   help="metrics.jsonl, resume.state, model.safetensors, spectrum.png and, at exit, "
                        "counters-<id>.json go here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a previous run in --out (without it, a run that stopped early is resumed)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--takeover", action="store_true",
                   help="start even if the broker says a cloud with this run and id is online")
    guard.add_arguments(p, "the cloud's evaluation of a round's model on the test split (an evaluation over it is "
                           "skipped, the round goes on)", untimed=True)
    metrics_http.add_arguments(p)
    add_run_arguments(p)


def check_arguments(args: argparse.Namespace) -> None:
    """Every value, before any data is loaded or anything connects."""
    from splitedge.cloud.options import check_run_arguments, check_shared_noise, run_compute, sampling_of
    from splitedge.methods.flags import method_overrides

    overrides = method_overrides(args)
    check_run_arguments(args.method, args.rounds, args.dataset, args.data, args.deadline, args.seed, args.max_train,
                        args.max_test, overrides)
    sampling = sampling_of(args)
    if args.edges < 1 or args.devices < 1:
        raise ValueError(f"--edges must be >= 1 and --devices >= 1 (rounds wait for that many devices), got "
                         f"{args.edges} and {args.devices}")
    if args.edges > args.devices:
        raise ValueError(f"--edges {args.edges} with --devices {args.devices}: {args.edges - args.devices} edge(s) "
                         f"would have no device and carry nothing; lower --edges or raise --devices")
    check_shared_noise(overrides, args.devices, args.edges, sampling)
    if not args.join_timeout > 0:
        raise ValueError(f"--join-timeout must be > 0 seconds, got {args.join_timeout}")
    if not args.rejoin_timeout > 0:
        raise ValueError(f"--rejoin-timeout must be > 0 seconds, got {args.rejoin_timeout}")
    if not args.rejoin_grace >= 0:
        raise ValueError(f"--rejoin-grace must be >= 0 seconds, got {args.rejoin_grace}")
    run_compute(args.method, args.device)  # a GPU torch cannot see, or one the method cannot use


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from splitedge.runtime.outputs import RunFolder, dumps, ending, json_safe, served, why_unevaluated

    with metrics_http.serve(args, "cloud") as metrics, \
            RunFolder(args.out, overwrite=args.overwrite, resumable=True) if args.out else contextlib.nullcontext() as folder:
        history = _run(args, metrics, resuming=bool(folder and folder.resuming))
    final = json_safe(history[-1].get("accuracy")) if history else None
    calibrated = [h["accuracy_calibrated"] for h in history if h.get("accuracy_calibrated") is not None]
    head, served_accuracy = served(history)
    print(dumps({"final_accuracy": final, "final_accuracy_head": "own",
                 **({"final_accuracy_calibrated": calibrated[-1]} if calibrated else {}),
                 "served_head": head, "served_accuracy": served_accuracy}))
    if json_safe(served_accuracy) is not None:  # the last line: the model this cloud serves and exports
        where = f" ({args.out / 'model.safetensors'})" if args.out is not None else ""
        print(f"splitedge cloud: the served model{where} has the {head} head: accuracy {served_accuracy:.4f}"
              + (f" (its own head: {final:.4f})" if head != "own" and final is not None else ""), flush=True)
    status, why = ending(history)
    if status != "complete":
        print(f"splitedge cloud: the run did not train: {why}", file=sys.stderr)
        return 1
    if not any(json_safe(h.get("accuracy")) is not None for h in history):
        print(f"splitedge cloud: no round produced an evaluation: {why_unevaluated(history)}; run with -v for "
              f"the nodes' logs", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace, metrics: metrics_http.Endpoint, resuming: bool = False) -> list[dict]:
    import torch

    from splitedge.cloud.coordinator import CloudCoordinator
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.flags import method_overrides
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.runtime.session import check_identity_free, connect
    from splitedge.runtime.outputs import write_counters

    options = credentials.connect_options(args, args.broker)
    evaluations = guard.RoundGuard.from_args(args, "cloud", untimed=True)
    torch.set_num_threads(args.threads)
    if not args.takeover:
        check_identity_free(args.broker, run=args.run, tier="cloud", node_id=args.id, **options)
    _, test, info = load_dataset(args.dataset, args.data, max_test=args.max_test, seed=args.seed)
    config = build_run_config(args.method, info, args.model, args.seed, method_overrides(args))
    saved = _resume_state(args, config) if resuming else None
    settings = _settings(args, config)
    transport = connect(args.broker, run=args.run, tier="cloud", node_id=args.id, **options)
    try:
        evaluations.limit_process()  # after torch and the test split are in: the ceiling as RLIMIT_DATA
        log.info("cloud: evaluations with %s", evaluations.describe())
        if credentials.unsigned(args):
            log.warning("cloud: %s", credentials.UNSIGNED)
        cloud = CloudCoordinator(transport, settings, run=args.run, test=test, node_id=args.id, resume_from=saved,
                                 guard=evaluations)
        metrics.attach(cloud, [transport])
        history = cloud.run()
    finally:
        transport.close(offline=True)
        write_counters(args.out, args.id, [transport])
    if args.out is not None:
        from splitedge.runtime.outputs import plot_spectra_per_round

        plot_spectra_per_round(history, args.out / "spectrum.png", title=f"{args.method} on {args.dataset}")
    return history


def _settings(args: argparse.Namespace, config) -> CloudSettings:
    """The coordinator's settings from the flags."""
    from splitedge.cloud.options import run_compute, sampling_of
    from splitedge.cloud.settings import CloudSettings

    return CloudSettings(method=args.method, rounds=args.rounds, config=config, deadline_s=args.deadline,
                         min_edges=args.edges, min_devices=args.devices, join_timeout_s=args.join_timeout,
                         rejoin_timeout_s=args.rejoin_timeout, rejoin_grace_s=args.rejoin_grace,
                         out_dir=args.out, seed=args.seed, sampling=sampling_of(args),
                         until_plateau=args.until_plateau, dataset=args.dataset,
                         compute=run_compute(args.method, args.device), on_round=_round_printer(args.rounds))


def _resume_state(args: argparse.Namespace, config) -> "object":
    """The state of the run in --out that this cloud carries on: same run, method, settings."""
    from splitedge.cloud import resume

    saved = resume.load(args.out)
    resume.check_same_run(saved, out=args.out, run=args.run, method=args.method, config=config.to_wire(),
                          seed=args.seed, rounds=args.rounds)
    return saved


def _round_printer(total: int):
    def show(record: dict) -> None:
        print(f"round {record['round']:3d}/{total}  accuracy {record.get('accuracy', float('nan')):.4f}  "
              f"{record['round_seconds']:.1f}s  edges {record['edges']}", flush=True)
    return show
