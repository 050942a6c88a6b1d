"""`splitedge bench SUITE`: run a suite, write JSON + markdown + plots into --out.

Each suite module exposes ``Settings.from_args(args)``, ``run(settings) -> (config, results)``,
``markdown(results)`` and ``plot(results, out_dir)``; this file only sequences them, so a new
suite is one module and one line in SUITES. A long suite's ``run`` may also take
``progress(config, results)``, called after each finished run: the files are then written
(marked partial) as it goes.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time
from pathlib import Path
from typing import Any

from splitedge.methods.data.datasets import dataset_argument

SUITES = {
    "bandwidth": "splitedge.bench.bandwidth",
    "ram": "splitedge.bench.ram",
    "device-memory": "splitedge.bench.device_memory",
    "throughput": "splitedge.bench.throughput",
    "accuracy": "splitedge.bench.accuracy",
    "ssl": "splitedge.bench.ssl",
    "cluster": "splitedge.bench.cluster",
    "hsfp-diagnose": "splitedge.bench.hsfp_diagnose",
    "soak": "splitedge.bench.soak",
    "scale": "splitedge.bench.scale",
    "compare": "splitedge.bench.compare",
    "matrix": "splitedge.bench.matrix",
    "poison": "splitedge.bench.poison",
    "secagg": "splitedge.bench.secagg_cost",
    "leak": "splitedge.bench.leak",
    "dp": "splitedge.bench.dp",
    "floods": "splitedge.bench.floods",
    "merge": "splitedge.bench.merge",
    "flower": "splitedge.bench.flower",
}
DEFAULT_OUT = Path("runs/bench")
"""Where a suite writes without --out: a new folder per run, never the committed bench/results."""


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", choices=(*SUITES, "all"), help="what to measure (all: every suite)")
    p.add_argument("--quick", action="store_true", help="small settings for a first look (a few minutes at most; bandwidth is the longest)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: a new runs/bench/<suite>-<date>-<time>; with 'all', one subfolder "
                        "per suite); bench/results holds the committed results, write there only on purpose")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib figures")
    p.add_argument("--jobs", type=int, default=None,
                   help="accuracy, ssl, cluster: runs at a time, each in a process of its own (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="accuracy, ssl, cluster, dp: keep the runs --out already holds (same settings) and run the rest")
    p.add_argument("--plan", default=None, help="matrix: which plan of bench/matrix.py to run (e.g. fedcnn-10dev)")
    p.add_argument("--cells", type=_csv, default=(),
                   help="matrix: only these cells of the plan (e.g. dir0.1-s0,iid-s1), so that cells can run in "
                        "processes of their own; default every cell")
    p.add_argument("--ram", type=_csv, default=(),
                   help="compare, matrix: folders of `bench ram --methods ...` runs; each row's device peak RSS (a column, "
                        "and the marker size in the accuracy-against-bytes plot)")
    p.add_argument("--inputs", type=_csv, default=(),
                   help="compare: folders of accuracy benches (seeds, splits) to put in one table")
    p.add_argument("--rerender", action="store_true",
                   help="run nothing: rewrite the markdown (and plots) of the JSON already in --out with this "
                        "checkout's report code")
    g = p.add_argument_group("federation (bandwidth, accuracy, ram)")
    g.add_argument("--methods", type=_csv, default=(), help="comma-separated; default: every registered method (accuracy with --variant: only the variants; ram: hsfp)")
    g.add_argument("--dataset", default="digits", type=dataset_argument, metavar="DATASET",
                   help="data set of the federations (as splitedge sim --dataset)")
    g.add_argument("--data", default=None, help="CIFAR-10 archive / folder (see splitedge sim --help)")
    g.add_argument("--model", default=None, help="cnn | fedcnn | fedcnn2 | resnet18, a plug-in's name or "
                   "package.module:factory (docs/plugins.md); default by data set")
    g.add_argument("--devices", type=int, default=None, help="devices per federation (default: the suite's)")
    g.add_argument("--edges", type=int, default=None, help="edges per federation (default: the suite's)")
    g.add_argument("--rounds", type=int, default=None, help="rounds per federation (default: the suite's)")
    g.add_argument("--until-plateau", action="store_true",
                   help="accuracy, ssl, cluster: each run stops at its plateau (--rounds is the budget)")
    g.add_argument("--alpha", type=float, default=None, help="bandwidth: Dirichlet(alpha) split; IID if omitted")
    g.add_argument("--alphas", default=None, help="accuracy: comma-separated splits, 'iid' or a Dirichlet alpha")
    g.add_argument("--seed", type=int, default=0, help="seed of the split and the models")
    g.add_argument("--deadline", type=float, default=None,
                   help="accuracy: seconds before a round closes without stragglers (default: the sim's)")
    g.add_argument("--max-train", type=int, default=None, help="use at most this many training images")
    g.add_argument("--max-test", type=int, default=None, help="evaluate on at most this many test images")
    g.add_argument("--groups", type=int, default=None,
                   help="planted device groups (cluster suite: default 3; others: none)")
    g.add_argument("--group-skew", choices=("rotate", "labels"), default=None,
                   help="what sets a planted group apart (default rotate): turned images or permuted labels")
    g.add_argument("--variant", action="append", default=[], metavar="NAME=METHOD:KEY=VALUE,...",
                   help="accuracy: also run METHOD with these settings as row NAME (repeatable), "
                        "e.g. hsfp-ic2=hsfp:ic=2,ie=2; sample_fraction, sample_count and sample_min set "
                        "the run's client sampling")
    g.add_argument("--target", type=float, default=None,
                   help="bandwidth: target accuracy when fedavg did not run; compare: the common target (a "
                        "fraction, default 0.9 x the best final accuracy)")
    g = p.add_argument_group("ram")
    g.add_argument("--images", type=int, default=None, help="images on the measured device")
    g.add_argument("--backends", type=_csv, default=("torch", "onnx"), help="device backends to measure")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="ram: H-SFP setting for the measured federation; accuracy, cluster, poison, dp: a method "
                        "setting every row shares (a variant's own win; repeatable), e.g. device_batch=32, "
                        "robust_clip_k=1, signal=layout")
    g.add_argument("--train-chunk", type=int, default=None, metavar="N",
                   help="ram, device-memory: the thin device's --train-chunk (default the device's, 8; 0: whole batches)")
    g.add_argument("--device-mem-cap", type=float, default=None, metavar="MB",
                   help="ram: run the device in a memory cgroup capped at MB (the kernel enforces it; needs root)")
    g.add_argument("--device-python", default=None, metavar="PATH",
                   help="interpreter for the measured device (runs this checkout), e.g. a venv with the "
                        "CPU-only torch wheel; default: this one")
    g = p.add_argument_group("poison")
    g.add_argument("--attack", default=None, help="poison: the hostile device (default scale-weights)")
    g.add_argument("--rules", type=_csv, default=(), help="poison: robust rules to compare (default none,clip,trimmed,median)")
    g.add_argument("--seeds", type=_csv, default=(), help="poison: comma-separated seeds (default --seed and the next)")
    g = p.add_argument_group("leak")
    g.add_argument("--trials", type=int, default=None, help="leak: devices' classes attacked per cell (default 5)")
    g.add_argument("--steps", type=int, default=None, help="leak: the attack's optimiser steps (default 1000)")
    g.add_argument("--wc", type=_csv, default=(), help="leak: W_c states to attack (default random,trained)")
    g = p.add_argument_group("dp")
    g.add_argument("--epsilons", type=_csv, default=(),
                   help="dp: target epsilons at delta 1e-5 over the run (default 8,4,1); --methods, --seeds, --set, "
                        "--rounds and --until-plateau apply too")
    g.add_argument("--units", type=_csv, default=(),
                   help="dp: the privacy unit of the private runs, device (device-level DP-FedAvg, the default) "
                        "and/or sample (sample-level DP-SGD; --set dp_sample_rate=q / dp_grad_clip=C, else "
                        "device_batch over a device's images and 1), e.g. device,sample")
    g = p.add_argument_group("hsfp-diagnose")
    g.add_argument("--no-oracles", action="store_true",
                   help="hsfp-diagnose: measure the H-SFP stack only (a third of the training)")
    g = p.add_argument_group("scale")
    g.add_argument("--edges-per", type=int, default=None, help="scale: one edge per this many devices (default 50)")
    g.add_argument("--split", choices=("niid", "per-device"), default=None,
                   help="scale: how --alpha splits the devices (default per-device; see splitedge sim --help)")
    g.add_argument("--virtual", type=int, default=None, help="scale (default 1), accuracy (default 0: every device keeps its model): virtual devices, "
                        "this many training at a time per process")
    g.add_argument("--workers", type=int, default=None, help="scale: device worker processes (default 2); flower: "
                                                             "the splitedge arm's (default one per device, as "
                                                             "Flower's one process per client)")
    g = p.add_argument_group("throughput")
    g.add_argument("--counts", type=_csv, default=None, help="throughput, merge: devices' worth of messages, e.g. 10,100,1000; leak: images of "
                   "the class on the device (default 1,2,5,10,50)")
    g.add_argument("--dims", type=_csv, default=None, help="moment feature dims, e.g. 512,8192")
    g.add_argument("--grow", type=_csv, default=None, help="device counts for round wall time, e.g. 4,8,16")
    g = p.add_argument_group("merge")
    g.add_argument("--before", nargs="?", const="52b8928", default=None, metavar="COMMIT",
                   help="merge: also measure methods/moments.py as it was at COMMIT (default 52b8928, before issue 58)")
    g = p.add_argument_group("flower")
    g.add_argument("--flower-venv", default=None, metavar="PATH",
                   help="flower: the venv with flwr, torch and splitedge (--no-deps -e) the Flower arm runs in "
                        "(default ~/.cache/splitedge/flower-venv)")
    g.add_argument("--setup", action="store_true", help="flower: make the Flower venv first if it is not there")
    g.add_argument("--arms", type=_csv, default=(), help="flower: which arms to run (default floor,splitedge,flower)")


def run_suite(name: str, args: argparse.Namespace, out_dir: Path, argv: list[str]) -> Path:
    """Run one suite and write its files; returns the JSON path."""
    from splitedge.bench.lib import report

    module = importlib.import_module(SUITES[name])
    if args.rerender and not getattr(module, "RERENDERS_ITSELF", False):
        return rerender(module, out_dir, plots=not args.no_plots, suite=name)
    settings = module.Settings.from_args(args)
    if hasattr(settings, "keep_in"):  # its runs keep their sims under --out until each finishes (--resume)
        settings.keep_in, settings.resume_sims = out_dir, bool(args.resume)
    started = time.monotonic()
    kwargs = {}
    if "previous" in inspect.signature(module.run).parameters and args.resume:
        kwargs["previous"] = previous_results(out_dir, name)
    if "progress" in inspect.signature(module.run).parameters:  # a long suite: keep each finished run
        def progress(config: dict[str, Any], results: dict[str, Any]) -> None:
            doc = report.document(name, argv, config, results, time.monotonic() - started)
            report.write(out_dir, {**doc, "partial": True}, module.markdown(results))
        kwargs["progress"] = progress
    config, results = module.run(settings, **kwargs)
    if _unchanged(kwargs.get("previous"), results):
        # a resume with nothing left to run: its header keeps when and under what load the runs ran
        print(f"bench {name}: every run of {out_dir} was already there; its files are left as they are", flush=True)
        return out_dir / f"{name}.json"
    doc = report.document(name, argv, config, results, time.monotonic() - started)
    json_path, md_path = report.write(out_dir, doc, module.markdown(results))
    plots = [] if args.no_plots else module.plot(results, out_dir)
    print(f"bench {name}: wrote {json_path}, {md_path}" + "".join(f", {p}" for p in plots), flush=True)
    return json_path


def _unchanged(previous: dict[str, Any] | None, results: dict[str, Any]) -> bool:
    """Whether a resumed suite's results are the finished ones it resumed (it ran nothing)."""
    import json

    if not previous or previous.get("partial"):
        return False
    return json.loads(json.dumps(results, default=str)) == previous.get("results")


def previous_results(out_dir: Path, suite: str) -> dict[str, Any] | None:
    """The suite's JSON already in `out_dir` (partial or whole), for --resume; None if none."""
    import json

    path = out_dir / f"{suite}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rerender(module: Any, out_dir: Path, *, plots: bool, suite: str) -> Path:
    """Markdown and plots again from a finished run's JSON (the measurements are not touched;
    a suite's ``refresh(results)``, when it has one, recomputes what is derived from them)."""
    import json

    from splitedge.bench.lib import report

    json_path = out_dir / f"{suite}.json"  # as report.write names it (hsfp-diagnose: not the module's name)
    doc = json.loads(json_path.read_text())
    if hasattr(module, "refresh"):
        takes_config = len(inspect.signature(module.refresh).parameters) > 1
        module.refresh(doc["results"], *([doc["config"]] if takes_config else []))
    report.write(out_dir, doc, module.markdown(doc["results"]))
    if plots:
        module.plot(doc["results"], out_dir)
    print(f"bench {doc['suite']}: re-rendered {out_dir}", flush=True)
    return json_path


ONLY_OPTIONS = {"matrix": ("out", "plan", "cells", "ram", "rerender"), "compare": ("inputs", "target", "ram", "out", "no_plots"),
                "merge": ("quick", "out", "no_plots", "counts", "dims", "seed", "before"),
                "flower": ("quick", "out", "no_plots", "dataset", "data", "model", "devices", "edges", "rounds", "alpha",
                           "seed", "max_train", "max_test", "set", "deadline", "flower_venv", "setup", "arms",
                           "workers")}
"""Suites that read only these options: their record leaves out the other suites' defaults (a
matrix's plan holds its data set; `--dataset digits` in its record misled)."""


def command_line(args: argparse.Namespace) -> list[str]:
    """The options in effect, rendered back as a command line (works for main(argv) from tests
    too, where sys.argv is the test runner's)."""
    out = ["bench", args.suite]
    only = ONLY_OPTIONS.get(args.suite)
    for key, value in vars(args).items():
        if key in ("suite", "command", "module", "verbose") or value is None or value is False or value in ((), []):
            continue
        if only is not None and key not in only:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list):  # action="append": the flag once per value
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out


def run(args: argparse.Namespace) -> int:
    import logging

    if not args.verbose:  # a suite runs whole federations in this process; their nodes' status lines are noise
        logging.getLogger("splitedge.status").setLevel(logging.WARNING)
    argv = command_line(args)  # as typed, for the reports
    if args.data is not None:  # suites start nodes in other folders: a relative path would not resolve there
        data = Path(args.data).expanduser()
        if not data.exists():
            raise ValueError(f"--data {args.data}: no such file or folder")
        args.data = str(data.resolve())
    if args.model is not None:  # a model of a plug-in (package.module:factory) loads here, or one line says why
        from splitedge.models.registry import use_model

        use_model(args.model)
    # compare and matrix read other runs; flower needs a venv of its own
    names = [n for n in SUITES if n not in ("compare", "matrix", "flower")] if args.suite == "all" else [args.suite]
    for name in names:
        if args.out is None:
            out_dir = DEFAULT_OUT / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        else:
            out_dir = args.out / name if args.suite == "all" else args.out
        run_suite(name, args, out_dir, argv)
    return 0
