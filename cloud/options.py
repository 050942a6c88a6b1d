"""Run options shared by `splitedge cloud` and `splitedge sim`, turned into the typed run config.

The method's own settings come from its config fields (methods/flags.py: a flag per flagged
setting, `--set` for any); this module holds no method's flags.

The result travels in every round announcement (as a nested map), so devices and edges
started with only a broker URL build the same model and method settings as the cloud.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any, Mapping

from splitedge.methods import compute
from splitedge.methods.config import MethodConfig, ModelSpec, RunConfig, from_wire, parse_settings
from splitedge.methods.data.datasets import BUILT_IN, DATASET_HELP, OWN_IMAGES, check_dataset_name, dataset_argument
from splitedge.methods.flags import add_method_flags
from splitedge.methods.registry import create_method, get_method, list_methods, settled, use_method
from splitedge.runtime.plugin_args import add_plugin_argument

log = logging.getLogger(__name__)

EXACT_MERGE = ("robust=none: edges and the cloud merge exactly, so one device scaling what it sends moves every merge "
               "without bound (docs/methods.md, 'Robust merging'); the default (auto) clips each source")
"""What a run says once when its merges are exact by choice (not because secure aggregation hides
each device's values)."""

DEFAULT_MODEL = {"digits": "cnn", "cifar10": "cnn"}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="hsfp", type=_registered(use_method), metavar="METHOD",
                   help=f"the learning method: {', '.join(list_methods())} (docs/methods.md), or a plug-in's "
                        f"package.module:Class (docs/plugins.md)")
    p.add_argument("--rounds", type=int, default=10, help="rounds to run (with --until-plateau: at most)")
    p.add_argument("--until-plateau", action="store_true",
                   help="stop once the accuracy (and the calibrated one) has plateaued: the best of the last 10 "
                        "rounds beats the best before by less than 0.5 points, from round 20 on")
    p.add_argument("--dataset", default="digits", type=dataset_argument, metavar="DATASET", help=DATASET_HELP)
    p.add_argument("--data", default=None, help="CIFAR-10: the .tar.gz, an ImageFolder tree or cifar-10-batches-py; "
                   "images: the .npz or folder; a loader of one's own: what it is called with")
    p.add_argument("--model", default=None, help="network split (cnn | fedcnn | fedcnn2 | resnet18, an installed "
                   "plug-in's name, or one's own package.module:factory, docs/plugins.md); default by data set")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds before a round closes without stragglers")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, the models' initial weights and sampling")
    p.add_argument("--max-train", type=int, default=None, help="use at most this many training images")
    p.add_argument("--max-test", type=int, default=None, help="evaluate on at most this many test images")
    compute.add_argument(p)
    g = p.add_argument_group("client sampling", "which online devices train each round (seeded by --seed)")
    g.add_argument("--sample-fraction", type=float, default=1.0, metavar="F",
                   help="draw int(F x online devices) each round (default 1: all)")
    g.add_argument("--sample-count", type=int, default=0, metavar="N", help="draw N devices each round instead")
    g.add_argument("--sample-min", type=int, default=1, metavar="M", help="draw at least M devices (default 1)")
    add_plugin_argument(p)
    p.add_argument("--metric", action="append", default=[], metavar="PACKAGE.MODULE:FUNCTION",
                   help="an evaluation metric of one's own beside accuracy, f(y_true, y_pred) -> float of the test "
                        "split (e.g. sklearn.metrics:balanced_accuracy_score), in every evaluated round's record as "
                        "metric_<function> (repeatable; docs/plugins.md)")
    add_method_flags(p)


def _registered(use: Any) -> Any:
    """An argparse type that registers a plug-in the command line names (its message on error)."""
    def parse(value: str) -> str:
        try:
            return use(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def sampling_of(args: argparse.Namespace) -> Any:
    """The command line's client sampling (ValueError naming the flag when it makes no sense)."""
    from splitedge.runtime.sampling import Sampling

    return Sampling(fraction=args.sample_fraction, count=args.sample_count, minimum=args.sample_min, seed=args.seed)


def check_shared_noise(overrides: dict[str, Any], devices: int, edges: int, sampling: Any) -> None:
    """Distributed DP (`dp_devices` t > 1) needs every edge to sum at least t devices each round,
    and any secure sum (`secagg`) at least `secagg_min_devices`: one ValueError naming the flag
    when the topology or client sampling cannot give that."""
    share = int(overrides.get("dp_devices", 1) or 1)
    if share <= 1:
        _check_secure_sums(overrides, devices, edges)
        return
    smallest = devices // edges  # the smallest edge holds at most the average
    if share > smallest:
        raise ValueError(f"--dp-devices {share}: an edge unmasks no sum of fewer devices, but {devices} devices on "
                         f"{edges} edges leave at most {smallest} on the smallest; lower --dp-devices to at most "
                         f"{smallest} or use fewer edges")
    if sampling.active:
        raise ValueError(f"--dp-devices {share} with client sampling: a round's draw may leave an edge fewer than "
                         f"{share} devices, whose sums are then never unmasked; drop --sample-fraction / "
                         f"--sample-count or leave --dp-devices at 1")
    _check_secure_sums(overrides, devices, edges)


def _check_secure_sums(overrides: dict[str, Any], devices: int, edges: int) -> None:
    """With `secagg` on, each device refuses a sum of fewer than `secagg_min_devices` (default 3):
    an edge that cannot hold that many would have every sum refused (methods/privacy/roster.py)."""
    mode = str(overrides.get("secagg", "off") or "off")
    if mode == "off":
        return
    from splitedge.methods.privacy.roster import MIN_DEVICES

    need = int(overrides.get("secagg_min_devices", MIN_DEVICES) or MIN_DEVICES)
    smallest = devices // edges
    if need > smallest:
        raise ValueError(f"--secagg {mode}: a device takes part in no secure sum of fewer than {need} devices "
                         f"(--secagg-min-devices), but {devices} devices on {edges} edges leave at most {smallest} on "
                         f"the smallest; use fewer edges, more devices, or a lower --secagg-min-devices (at least 2)")


def run_compute(method: str, device: str) -> compute.Compute:
    """The device the cloud (and a sim's nodes) compute `method` on: `--device` resolved on this
    machine, a GPU that torch cannot see or one named for a method not ported to it refused in one
    line before any work (methods/compute.py)."""
    return compute.resolve_for(device, method, get_method(use_method(method)).runs_on_cuda)


def check_run_arguments(method: str, rounds: int, dataset: str, data: str | None, deadline_s: float, seed: int,
                        max_train: int | None, max_test: int | None, overrides: dict[str, Any]) -> None:
    """The run's command-line values, checked before any data is loaded: one ValueError naming
    the flag and what to do. The method's settings are checked by its typed config."""
    from pathlib import Path

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    check_dataset_name(dataset)
    if dataset == OWN_IMAGES and data is None:
        raise ValueError("--dataset images reads --data: an .npz (x_train, y_train, x_test, y_test[, classes]) or a "
                         "folder of train/<class>/* and test/<class>/*")
    if data is not None and dataset in BUILT_IN:
        if dataset != "cifar10":
            raise ValueError("--data is read only with --dataset cifar10, images or a loader of one's own (digits "
                             "come with scikit-learn); add --dataset or drop --data")
        if not Path(data).exists():
            raise ValueError(f"--data {data}: no such file or folder (the CIFAR-10 .tar.gz, an ImageFolder tree "
                             f"or cifar-10-batches-py)")
    if dataset == OWN_IMAGES and not Path(data).exists():
        raise ValueError(f"--data {data}: no such file or folder (the .npz or the folder of train/ and test/)")
    if not deadline_s > 0:
        raise ValueError(f"--deadline must be > 0 seconds, got {deadline_s}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    for flag, value in (("--max-train", max_train), ("--max-test", max_test)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    method_config(use_method(method), overrides)


def method_config(method: str, overrides: Mapping[str, Any]) -> MethodConfig:
    """The method's typed settings: its defaults with `overrides` (typed values or command-line
    text), each parsed and checked by the method's Config. One ValueError naming the setting."""
    cls = get_method(method).Config
    try:
        return from_wire(cls, parse_settings(cls, overrides))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{method} settings: {exc}") from None


def build_run_config(method: str, info: Any, model: str | None, seed: int, overrides: Mapping[str, Any]) -> RunConfig:
    """The run's config, built once: the model spec from the data set, the method's settings,
    and what the method derives from the model before round 1 (`Method.settle`) for the
    settings the command line left open."""
    if model is not None:  # a plug-in the owner named (models/registry.py); torch: only a named model imports it
        from splitedge.models import use_model

        use_model(model)
    spec = ModelSpec(model=model or DEFAULT_MODEL.get(info.name, "cnn"), num_classes=info.num_classes,
                     channels=info.channels, image_size=info.image_size, mean=tuple(info.mean),
                     std=tuple(info.std), seed=seed)
    config = RunConfig(spec, method_config(method, overrides))
    if config.method.robust == "none" and config.method.secagg == "off":
        log.warning(EXACT_MERGE)
    try:
        derived = {k: v for k, v in settled(create_method(method, config)).items() if k not in overrides}
        return RunConfig(spec, dataclasses.replace(config.method, **derived)) if derived else config
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{method} settings: {exc}") from None
