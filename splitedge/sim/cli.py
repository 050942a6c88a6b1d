"""Arguments and progress display of `splitedge sim`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from splitedge.cloud.options import add_run_arguments
from splitedge.runtime import guard


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=4, help="device agents (threads, each with its own MQTT client)")
    p.add_argument("--edges", type=int, default=2, help="edge aggregators; device i reports to edge i mod edges")
    p.add_argument("--alpha", type=float, default=None, help="Dirichlet(alpha) label split; IID when omitted")
    p.add_argument("--broker", default=None, help="use this broker (e.g. mqtt://127.0.0.1:1883) instead of an embedded one")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for metrics.jsonl, summary.json, model.safetensors, plots (default: a new "
                        "runs/<method>-<date>-<time>)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.add_argument("--resumable", action="store_true",
                   help="after every round, keep every node's state in --out (sim.state); the same command run "
                        "again on that --out after a kill carries the run on from its last finished round")
    p.add_argument("--listed-only", action="store_true",
                   help="edges admit only this sim's own devices, each bounded by its shard's samples and class "
                        "counts (what `splitedge edge --manifest` does with a `data split` manifest)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the whole process")
    p.add_argument("--virtual", type=int, default=0, metavar="N",
                   help="virtual devices: each holds its model only while it trains, N at a time (memory grows with "
                        "N, not with --devices); 0 (default): every device keeps its model")
    p.add_argument("--park-dtype", choices=("f4", "f2"), default="f4",
                   help="how a virtual device keeps its model between rounds (f2: half the bytes, float16)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="run the devices in N worker processes of their own (this one keeps the broker, cloud and "
                        "edges); 0 (default): every node in this process")
    p.add_argument("--worker", default=None, metavar="I/N",
                   help="be worker I of N of a sim started elsewhere with --workers N --remote-workers (give its "
                        "--broker and --run): run only the devices d with d %% N == I")
    p.add_argument("--remote-workers", action="store_true",
                   help="with --workers: start no worker here; they run on other machines with --worker I/N")
    p.add_argument("--split", choices=("niid", "per-device"), default="niid",
                   help="with --alpha: niid (NIID-Bench: each class spread over devices by Dir(alpha)) or per-device "
                        "(each device's class mix ~ Dir(alpha), equal sizes: splits any number of devices)")
    p.add_argument("--run", default="", help="run id (topic namespace; default: a fresh sim-XXXXXXXX)")
    p.add_argument("--join-timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for every edge and device to join (default: 60 plus 0.1 per device)")
    p.add_argument("--broker-tree", action="store_true",
                   help="start a Mosquitto per edge site bridged to a cloud Mosquitto (deploy/'s topology) and "
                        "count the bytes through each broker (with --workers, devices connect to their site's)")
    p.add_argument("--backends", default="torch",
                   help="comma-separated device backends (torch, onnx), assigned to devices round-robin")
    p.add_argument("--groups", type=int, default=0,
                   help="planted device groups for clustered methods (contiguous blocks of devices); 0: none")
    p.add_argument("--sign", action="store_true",
                   help="every node signs and verifies its messages, as with `splitedge keys generate` (keys derived "
                        "from the run id: this measures signing and runs secure sums in their signed form, it protects "
                        "nothing)")
    p.add_argument("--group-skew", choices=("rotate", "labels"), default="rotate",
                   help="what sets a planted group apart: its images turned by g quarter turns, or permuted labels")
    guard.add_arguments(p, "each device's round (training, statistics, calibration, evaluation)", process=False)
    add_run_arguments(p)
    p.set_defaults(rounds=10)


def run(args: argparse.Namespace) -> int:
    from splitedge.methods.flags import method_overrides
    from splitedge.sim import SimSettings, run_sim

    guard.RoundGuard.from_args(args, "sim", process=False)  # a bound that cannot work: one line, before any work
    s = SimSettings(rounds=args.rounds, devices=args.devices, edges=args.edges, method=args.method,
                    dataset=args.dataset, data=args.data, model=args.model, alpha=args.alpha, seed=args.seed,
                    deadline_s=args.deadline, broker=args.broker, out=args.out, overwrite=args.overwrite,
                    threads=args.threads, device=args.device, max_train=args.max_train, max_test=args.max_test,
                    plugins=tuple(args.plugin or ()),
                    backends=tuple(b.strip() for b in args.backends.split(",") if b.strip()),
                    overrides=method_overrides(args), groups=args.groups, group_skew=args.group_skew,
                    virtual=args.virtual, park_dtype=args.park_dtype, workers=args.workers, worker=args.worker,
                    spawn_workers=not args.remote_workers, run=args.run, broker_tree=args.broker_tree,
                    split=args.split, join_timeout_s=args.join_timeout, sample_fraction=args.sample_fraction,
                    sample_count=args.sample_count, sample_min=args.sample_min, until_plateau=args.until_plateau,
                    listed_only=args.listed_only, sign=args.sign,
                    resumable=args.resumable, round_memory_mb=args.max_round_memory_mb,
                    round_budget_s=args.round_budget_s)
    if s.worker is not None:
        from splitedge.sim import run_worker

        report = run_worker(s)
        print(json.dumps({"worker": s.worker, "devices": report["devices"]}))
        return 0
    if not args.verbose:  # the progress line says it all; the nodes' own status lines would drown it
        logging.getLogger("splitedge.status").setLevel(logging.WARNING)
    print(f"splitedge sim: {s.method} on {s.dataset}, {s.devices} devices, {s.edges} edges, "
          f"{s.rounds} rounds, {'IID' if s.alpha is None else f'Dirichlet({s.alpha})'}, into {s.out}", flush=True)
    summary = run_sim(s, on_round=_progress(s.rounds), on_resume=lambda run, r: print(
        f"splitedge sim: resuming run {run} after round {r} ({s.out}/sim.state)", flush=True))
    print(json.dumps({k: summary[k] for k in ("status", "final_accuracy", "final_accuracy_head",
                                              "final_accuracy_calibrated", "served_head", "served_accuracy",
                                              "wall_seconds", "device_up_bytes_per_device_per_round")
                      if k in summary}))
    print(f"wrote {s.out}/{', '.join(written(s.out))}")
    if summary.get("status") == "no_devices":
        print(f"splitedge sim: the run did not train: {summary.get('status_reason')}", file=sys.stderr)
        return 1
    if not summary["evaluated_rounds"]:
        from splitedge.runtime.outputs import why_unevaluated

        history = [json.loads(line) for line in (s.out / "metrics.jsonl").read_text().splitlines() if line.strip()] \
            if (s.out / "metrics.jsonl").is_file() else []
        print(f"splitedge sim: no round produced an evaluation: {why_unevaluated(history)}; run with -v for the "
              f"nodes' logs", file=sys.stderr)
        return 1
    return 0


def written(out: Path) -> list[str]:
    """What the run left in `out` (files, then folders with a slash), not its lock."""
    from splitedge.runtime.outputs import LOCK

    entries = sorted(Path(out).iterdir(), key=lambda e: (e.is_dir(), e.name))
    return [e.name + ("/" if e.is_dir() else "") for e in entries if e.name != LOCK]


def _progress(total: int):
    def show(record: dict) -> None:
        up = sum(v["payload"] for v in record["bytes"]["in"].values())
        bar = "#" * int(20 * record["round"] / total)
        acc = record.get("accuracy")
        acc_text = "  -  " if acc is None else f"{acc:.3f}"  # not measured this round (report_every)
        if record.get("accuracy_calibrated") is not None:
            acc_text += f" (calibrated {record['accuracy_calibrated']:.3f})"
        sys.stdout.write(f"[{bar:<20}] round {record['round']}/{total}  accuracy {acc_text}  "
                         f"{record['round_seconds']:.1f}s  cloud in {up / 1e6:.2f} MB\n")
        sys.stdout.flush()
    return show
