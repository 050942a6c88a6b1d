"""Run options shared by `splitedge cloud` and `splitedge sim`, turned into the typed run config.

The result travels in every round announcement (as a nested map), so devices and edges
started with only a broker URL build the same model and method settings as the cloud.
"""

from __future__ import annotations

import argparse
from typing import Any

from splitedge.methods.config import ModelSpec, RunConfig
from splitedge.methods.registry import create_method, default_config, list_methods

DEFAULT_MODEL = {"digits": "cnn", "cifar10": "cnn"}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="hsfp", choices=list_methods(), help="the learning method (docs/methods.md)")
    p.add_argument("--rounds", type=int, default=10, help="rounds to run")
    p.add_argument("--dataset", default="digits", choices=("digits", "cifar10"),
                   help="digits (bundled with scikit-learn) or cifar10 (needs --data)")
    p.add_argument("--data", default=None, help="CIFAR-10: the .tar.gz, an ImageFolder tree or cifar-10-batches-py")
    p.add_argument("--model", default=None, help="network split (cnn | fedcnn | resnet18); default by data set")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds before a round closes without stragglers")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, the models' initial weights and sampling")
    p.add_argument("--max-train", type=int, default=None, help="use at most this many training images")
    p.add_argument("--max-test", type=int, default=None, help="evaluate on at most this many test images")
    g = p.add_argument_group("H-SFP")
    g.add_argument("--mean-only", action="store_true", help="ablation: prototypes without variance")
    g.add_argument("--no-slow-averaging", action="store_true", help="ablation: never average W_c / W_e")
    g.add_argument("--resend-moments", choices=("on-change", "every-round"), default=None,
                   help="send device moments only when W_c changed (on-change), or every round")
    g.add_argument("--feature-dtype", choices=("f2", "f4"), default=None, help="moments on the wire")
    g.add_argument("--ic", type=int, default=None, help="rounds between W_c averages")
    g.add_argument("--ie", type=int, default=None, help="rounds between W_e averages (0: W_e stays as initialised)")
    g.add_argument("--local-epochs", type=int, default=None, help="local epochs per round on a device")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any method setting by name (repeatable), e.g. --set edge_samples=4096")


def method_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Method settings given on the command line, checked against the method's config class."""
    out: dict[str, Any] = {}
    if args.mean_only:
        out["mean_only"] = True
    if args.no_slow_averaging:
        out["slow_averaging"] = False
    for flag, key in (("resend_moments", "resend_moments"), ("feature_dtype", "feature_dtype"),
                      ("ic", "ic"), ("ie", "ie"), ("local_epochs", "local_epochs")):
        if getattr(args, flag) is not None:
            out[key] = getattr(args, flag)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def check_run_arguments(method: str, rounds: int, dataset: str, data: str | None, deadline_s: float, seed: int,
                        max_train: int | None, max_test: int | None, overrides: dict[str, Any]) -> None:
    """The run's command-line values, checked before any data is loaded: one ValueError naming
    the flag and what to do. The method's settings are checked by its typed config."""
    from pathlib import Path

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if dataset not in DEFAULT_MODEL:
        raise ValueError(f"--dataset must be one of {sorted(DEFAULT_MODEL)}, got {dataset!r}")
    if data is not None:
        if dataset != "cifar10":
            raise ValueError(f"--data is read only with --dataset cifar10 (digits come with scikit-learn); "
                             f"add --dataset cifar10 or drop --data")
        if not Path(data).exists():
            raise ValueError(f"--data {data}: no such file or folder (the CIFAR-10 .tar.gz, an ImageFolder tree "
                             f"or cifar-10-batches-py)")
    if not deadline_s > 0:
        raise ValueError(f"--deadline must be > 0 seconds, got {deadline_s}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    for flag, value in (("--max-train", max_train), ("--max-test", max_test)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    try:
        default_config(method, ModelSpec(), **overrides)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{method} settings: {exc}") from None


def build_run_config(method: str, info: Any, model: str | None, seed: int, overrides: dict[str, Any]) -> RunConfig:
    """Model spec + the method's typed config, each setting checked against the method's Config."""
    spec = ModelSpec(model=model or DEFAULT_MODEL.get(info.name, "cnn"), num_classes=info.num_classes,
                     channels=info.channels, image_size=info.image_size, mean=tuple(info.mean),
                     std=tuple(info.std), seed=seed)
    try:
        config = default_config(method, spec, **overrides)
        derived = {k: v for k, v in create_method(method, config).settle().items() if k not in overrides}
        return default_config(method, spec, **overrides, **derived) if derived else config
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{method} settings: {exc}") from None
