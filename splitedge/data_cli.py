"""`splitedge data`: cut a data set into per-device shards, and check a shard as a device sees it.

`data split` loads a data set (methods/data/datasets.py), splits its training set across devices
(methods/data/partition.py: IID or Dirichlet label skew, optionally a per-device feature skew) and
writes one uncompressed `shard-dN.npz` per device with `save_shard` (the format a thin device
reads in place) plus `shards.json`, the manifest an edge admits devices by (`splitedge edge
--manifest DIR`). With the same --seed, --alpha and --max-train the label split is the one
`splitedge sim` gives its devices. `--acl RUN` adds the broker's files and a login per node,
`--keys` a signing key pair per node (DIR/keys), and the commands it prints for the cloud, each
edge and each device use all of them.

`data check` opens a shard or an image folder with the device's own loader
(methods/data/local.py, streamed as the onnx backend does and in memory as the torch backend
does), which checks what a device needs (device.local_data.check_arrays). It imports
numpy and the device's data modules only, never torch: run it on the device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from splitedge.methods.data.datasets import DATASET_HELP, dataset_argument, file_sha256
from splitedge.runtime.allowance import MANIFEST_NAME as MANIFEST

KEYS = "keys"
ACL = "broker.acl"
BROKER_CONF = "broker.conf"
MANIFEST_FORMAT = 1
DEFAULT_BROKER = "mqtt://EDGE-HOST:1883"
DEFAULT_MAX_SHIFT = 0.2  # feature_skew's default
DEFAULT_WATCHERS = 3  # --acl: read-only logins for `splitedge watch`, one per watch running at a time


def shard_name(device: int) -> str:
    return f"shard-d{device}.npz"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None/False (their help says what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="split or check")
    s = sub.add_parser("split", formatter_class=_Help, allow_abbrev=False,
                       help="cut a data set's training split into one shard per device",
                       description="Cut a data set's training split into one .npz shard per device, "
                                   "check each as a device opens it, and print each device's command.")
    s.add_argument("--dataset", required=True, type=dataset_argument, metavar="DATASET",
                   help="data set to split: " + DATASET_HELP)
    s.add_argument("--data", default=None, metavar="PATH",
                   help="CIFAR-10: the .tar.gz, an ImageFolder tree (train/, test/) or cifar-10-batches-py "
                        "(default: ../shared/data/cifar10-jpeg.tar.gz next to the checkout); digits ships "
                        "with scikit-learn")
    s.add_argument("--devices", required=True, type=int, metavar="N", help="number of shards, one per device")
    s.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help=f"write DIR/shard-d0.npz ... and DIR/{MANIFEST} here")
    how = s.add_mutually_exclusive_group()
    how.add_argument("--alpha", type=float, default=None, metavar="A",
                     help="Dirichlet(A) label skew (NIID-Bench); smaller A, fewer classes per device")
    how.add_argument("--iid", action="store_true", help="IID split, near-equal sizes (the default without --alpha)")
    s.add_argument("--min-samples", type=int, default=10, metavar="M",
                   help="with --alpha: redraw until every device holds at least M images")
    skew = s.add_argument_group("feature skew (methods/data/partition.py feature_skew)")
    skew.add_argument("--feature-skew", action="store_true",
                      help="give each device a fixed rotation (quarter turns, balanced over devices) and a "
                           "per-channel colour shift, applied to its images")
    skew.add_argument("--max-shift", type=float, default=None, metavar="F",
                      help="with --feature-skew: colour shifts uniform in [-F, F] * 255 per channel "
                           f"(default: {DEFAULT_MAX_SHIFT})")
    skew.add_argument("--no-rotate", action="store_true", help="with --feature-skew: colour shift only")
    s.add_argument("--seed", type=int, default=0, help="seeds the subsample, the split and the skew")
    s.add_argument("--max-train", type=int, default=None, metavar="N",
                   help="split a seeded subset of N training images (default: all of them)")
    s.add_argument("--edges", type=int, default=1, metavar="E",
                   help="for the printed commands only: device i reports to edge e(i mod E)")
    s.add_argument("--broker", default=DEFAULT_BROKER, metavar="URL", help="for the printed commands only")
    s.add_argument("--overwrite", action="store_true",
                   help="replace the shards and manifest already in DIR (default: refuse)")
    s.add_argument("--acl", default=None, metavar="RUN",
                   help="also write DIR/broker.acl, a Mosquitto acl_file for run RUN: each device, edge and the "
                        "cloud (login = its id) reads and writes only what its role needs, with broker.passwd, "
                        "logins/<id>.password and broker.conf (the broker's settings for them, with a listener of "
                        "its own: on its own or in an include_dir)")
    s.add_argument("--listener", default=None, metavar="[ADDR:]PORT",
                   help="with --acl: the listener broker.conf opens for the nodes (default: the port of --broker, "
                        "every interface)")
    s.add_argument("--watchers", type=int, default=None, metavar="N",
                   help=f"with --acl: N read-only logins for `splitedge watch` (watcher, watcher-2, ...), one per "
                        f"watch running at a time (default: {DEFAULT_WATCHERS})")
    s.add_argument("--keys", action="store_true",
                   help=f"also write DIR/{KEYS}/<id>.key, .pub and .role, an Ed25519 key pair for the cloud, every edge "
                        "and every device (as `splitedge keys generate --role` does; a pair already there is kept: a "
                        "node keeps its key), and print commands that sign and verify with them (needs "
                        "splitedge[sign])")

    c = sub.add_parser("check", formatter_class=_Help, allow_abbrev=False,
                       help="open a shard or image folder as a device would and summarise it",
                       description="Open a shard (.npz) or an image folder <class>/<image> as a device would "
                                   "(streamed and in memory) and print what it holds, or what is wrong "
                                   "(exit 2). Needs no torch.")
    c.add_argument("path", type=Path, metavar="PATH", help="a shard .npz or an image folder")


def run(args: argparse.Namespace) -> int:
    return split(args) if args.action == "split" else check(args.path)


# -- split -------------------------------------------------------------------------------------

def split(args: argparse.Namespace) -> int:
    from splitedge.methods.data.datasets import load_dataset, save_shard
    from splitedge.methods.data.partition import apply_feature_skew, dirichlet, feature_skew, iid

    if args.devices < 1 or args.edges < 1:
        raise ValueError(f"need --devices >= 1 and --edges >= 1, got {args.devices} and {args.edges}")
    if args.max_train is not None and args.max_train < 1:
        raise ValueError(f"--max-train must be >= 1, got {args.max_train}")
    if not args.feature_skew and (args.no_rotate or args.max_shift is not None):
        raise ValueError("--max-shift and --no-rotate only apply with --feature-skew")
    max_shift = DEFAULT_MAX_SHIFT if args.max_shift is None else args.max_shift
    out: Path = args.out
    stale = _existing_shards(out, args.overwrite)  # refuse before the slow part
    if args.acl is None and (args.listener is not None or args.watchers is not None):
        raise ValueError("--listener and --watchers go with --acl RUN (they are for the broker's files)")
    if args.watchers is None:
        args.watchers = DEFAULT_WATCHERS
    if args.keys:  # before the slow part
        from splitedge.protocol.signing import INSTALL_HINT
        import importlib.util

        if importlib.util.find_spec("cryptography") is None:
            raise ValueError(f"--keys needs the cryptography package: {INSTALL_HINT}")
        check_keys(out / KEYS, node_roles(args.devices, args.edges))
    if args.acl is not None:  # a run id that cannot go into topics or the ACL fails here, not after the split
        from splitedge.protocol.acl import federation_acl, watcher_logins

        listen = listener_of(args.listener, args.broker)
        federation_acl(args.acl, {f"d{i}": f"e{i % args.edges}" for i in range(args.devices)},
                       watcher=watcher_logins(args.watchers))

    (x, y), _, info = load_dataset(args.dataset, args.data, max_train=args.max_train, seed=args.seed)
    if args.devices > len(y):
        raise ValueError(f"--devices {args.devices} is more than the {len(y)} training images")
    rng = np.random.default_rng(args.seed)  # as `splitedge sim` draws its split
    if args.alpha is None:
        parts = iid(y, args.devices, rng)
    else:
        parts = dirichlet(y, args.devices, args.alpha, rng, min_size=args.min_samples)
    skews = feature_skew(args.devices, rng, max_shift=max_shift, rotate=not args.no_rotate) \
        if args.feature_skew else [None] * args.devices

    for p in stale:  # --overwrite: a smaller split must not leave stale shard-dN.npz behind
        p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    devices = []
    for d, (idx, skew) in enumerate(zip(parts, skews)):
        xd = x[idx] if skew is None else apply_feature_skew(x[idx], skew)
        path = out / shard_name(d)
        save_shard(path, xd, y[idx], device=d, seed=args.seed)
        entry: dict[str, Any] = {"id": f"d{d}", "file": path.name, "samples": int(len(idx)),
                                 "class_counts": np.bincount(y[idx], minlength=info.num_classes).tolist(),
                                 "sha256": file_sha256(path)}
        if skew is not None:
            entry["skew"] = {"rotation_k": skew.rotation_k, "colour_shift": list(skew.colour_shift)}
        devices.append(entry)
    image_shape = tuple(int(v) for v in x.shape[1:])
    for entry in devices:
        verify_shard(out / entry["file"], entry["class_counts"], image_shape, info.num_classes)

    manifest = {
        "format": MANIFEST_FORMAT, "dataset": args.dataset, "data": args.data,
        "split": "iid" if args.alpha is None else "dirichlet", "alpha": args.alpha,
        "min_samples": args.min_samples if args.alpha is not None else None,
        "seed": args.seed, "max_train": args.max_train, "train_samples": int(len(y)),
        "feature_skew": {"max_shift": max_shift, "rotate": not args.no_rotate} if args.feature_skew else None,
        "num_classes": info.num_classes, "classes": list(info.classes), "image_shape": list(image_shape),
        "devices": devices,
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(_manifest_text(manifest))
    os.replace(tmp, out / MANIFEST)
    if args.acl is not None:
        from splitedge.protocol.acl import broker_conf, write_acl
        from splitedge.protocol.logins import PASSWD, write_logins

        homes = {d["id"]: f"e{i % args.edges}" for i, d in enumerate(devices)}
        watchers = watcher_logins(args.watchers)
        write_acl(out / ACL, federation_acl(args.acl, homes, watcher=watchers))
        nodes = [*homes, *sorted(set(homes.values())), "cloud"]
        write_logins(out, [*nodes, *watchers], probes=nodes)
        (out / BROKER_CONF).write_text(broker_conf(args.acl, out / ACL, out / PASSWD, port=listen[1],
                                                   address=listen[0]))
    kept = write_keys(out / KEYS, node_roles(args.devices, args.edges)) if args.keys else []

    _print_split(args, manifest, kept)
    return 0


def node_roles(devices: int, edges: int) -> dict[str, str]:
    """Every node id of the split and its role: the cloud, e0.., d0.. (device i reports to e(i mod E))."""
    return {"cloud": "cloud", **{f"e{e}": "edge" for e in range(min(edges, devices))},
            **{f"d{d}": "device" for d in range(devices)}}


def write_keys(folder: Path, roles: dict[str, str]) -> list[str]:
    """A key pair per node that has none in `folder` (keys_cli's files); the ids whose pair was kept."""
    from splitedge.keys_cli import write_key_pair

    kept = check_keys(folder, roles)
    folder.mkdir(parents=True, exist_ok=True)
    for node, role in roles.items():
        if node not in kept:
            write_key_pair(folder, node, role)
        elif not (folder / f"{node}.role").exists():
            (folder / f"{node}.role").write_text(role + "\n")
    return kept


def check_keys(folder: Path, roles: dict[str, str]) -> list[str]:
    """The nodes whose pair `folder` already holds (kept); ValueError for half a pair or a pair of
    another role, which a new key would not mend."""
    kept = []
    for node, role in roles.items():
        key, pub, role_file = (folder / f"{node}{ext}" for ext in (".key", ".pub", ".role"))
        if key.exists() != pub.exists():
            have, missing = (key, pub) if key.exists() else (pub, key)
            raise ValueError(f"{have} exists without {missing.name}: keys are never replaced; move it away, or "
                             f"give {node} both files")
        if role_file.exists() and role_file.read_text().strip() != role:
            raise ValueError(f"{role_file} says {role_file.read_text().strip()!r}, but {node} is a {role} of this split")
        if key.exists():
            kept.append(node)
    return kept


def listener_of(listener: str | None, broker: str) -> tuple[str | None, int]:
    """(address or None for every interface, port) of --listener [ADDR:]PORT, by default the
    port of --broker; ValueError in one line."""
    from splitedge.protocol.credentials import PORTS, check_scheme

    if listener is None:
        from urllib.parse import urlsplit

        scheme = check_scheme(broker)
        try:
            return None, urlsplit(broker).port or PORTS[scheme]
        except ValueError:
            raise ValueError(f"--broker {broker!r}: the port is not a number") from None
    address, _, port = listener.rpartition(":")
    address = address.strip("[]") or None
    if not port.isdigit() or not 0 < int(port) < 65536 or (address is not None and any(c.isspace() for c in address)):
        raise ValueError(f"--listener {listener!r}: give [ADDR:]PORT, e.g. 1883 or 10.0.0.5:1883")
    return address, int(port)


def _manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per setting and per device (diffable, readable with less)."""
    top = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in manifest.items() if k != "devices"]
    devices = ",\n".join(f"  {json.dumps(d)}" for d in manifest["devices"])
    return "{\n" + ",\n".join(top) + ',\n "devices": [\n' + devices + "\n ]\n}\n"


def _existing_shards(out: Path, overwrite: bool) -> list[Path]:
    """The shards and manifest already in DIR (to remove); refused unless --overwrite."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if not out.is_dir():
        return []
    old = sorted(out.glob("shard-d*.npz")) + ([out / MANIFEST] if (out / MANIFEST).exists() else [])
    if old and not overwrite:
        names = ", ".join(p.name for p in old[:3]) + (", ..." if len(old) > 3 else "")
        raise ValueError(f"{out} already holds shards ({names}); pass --overwrite to replace them")
    return old


def verify_shard(path: Path, class_counts: list[int], image_shape: tuple[int, ...], num_classes: int) -> None:
    """Open `path` as both device backends do; it must hold what was written."""
    from splitedge.methods.data.local import check_arrays

    for stream in (True, False):
        x, y = open_as_device(path, stream=stream)
        try:
            check_arrays(path, x, y, num_classes)
            if tuple(x.shape[1:]) != image_shape:
                raise ValueError(f"{path}: images are {tuple(x.shape[1:])}, expected {image_shape}")
            if np.bincount(y, minlength=num_classes).tolist() != class_counts:
                raise ValueError(f"{path}: labels read back differ from those written")
        finally:
            _close(x)


def _print_split(args: argparse.Namespace, manifest: dict[str, Any], kept: list[str]) -> None:
    split = "IID" if args.alpha is None else f"Dirichlet({args.alpha})"
    skew = ", feature skew" if args.feature_skew else ""
    n_cls = manifest["num_classes"]
    print(f"splitedge data split: {manifest['dataset']}, {manifest['train_samples']} training images "
          f"-> {args.devices} devices, {split}{skew}, seed {args.seed}")
    print(f"{'device':<8}{'edge':<7}{'samples':>8}  classes present")
    for i, d in enumerate(manifest["devices"]):
        present = sum(1 for c in d["class_counts"] if c)
        print(f"{d['id']:<8}{'e' + str(i % args.edges):<7}{d['samples']:>8}  {present}/{n_cls}")
    print(f"wrote {args.out / MANIFEST} and {args.devices} shards; each opened as a device would (onnx and torch)")
    if args.acl is not None:
        from splitedge.protocol.acl import BROKER_USER

        passwd = (args.out / "broker.passwd").resolve()
        print(f"wrote {args.out / ACL}, {args.out / 'broker.passwd'}, {args.out / BROKER_CONF} and "
              f"{args.out / 'logins'}/<id>.password for run {args.acl}. {BROKER_CONF} opens its own listener and "
              f"names the first two: run `mosquitto -c {args.out / BROKER_CONF}`, or copy it into the broker's "
              f"include_dir (/etc/mosquitto/conf.d/) with no other listener on its port; the broker reads "
              f"broker.passwd as its own user: sudo chown {BROKER_USER}: {passwd}")
    if args.keys:
        again = f" (kept the pairs already there: {', '.join(kept)})" if kept else ""
        print(f"wrote {args.out / KEYS}/<id>.key, .pub and .role for every node{again}")
    copies = ["each device its shard", f"each edge {MANIFEST}"] + (
        ["each node its own logins/<id>.password"] if args.acl else []) + (
        [f"each node its own {KEYS}/<id>.key and every .pub and .role"] if args.keys else [])
    print(f"Start the cloud, each edge and each device (on one machine as printed; deployed, copy "
          f"{', '.join(copies[:-1])} and {copies[-1]}, and change the paths; a device with torch may take "
          f"--backend torch instead of the thin onnx one):")
    for line in node_commands(args, manifest):
        print(f"  {line}")
    if args.acl is not None and args.watchers:
        from splitedge.protocol.acl import watcher_logins

        watchers = watcher_logins(args.watchers)
        print(f"{len(watchers)} read-only login(s) for `splitedge watch`, one per watch at a time "
              f"({', '.join(watchers)}): splitedge watch --broker {login_url(args.broker, watchers[0])} --run {args.acl} "
              f"--password-file {args.out / 'logins'}/{watchers[0]}.password")
    if args.acl is None or not args.keys:
        missing = [flag for flag, on in (("--acl RUN", args.acl), ("--keys", args.keys)) if not on]
        print(f"Without {' and '.join(missing)} anyone who can reach the broker can "
              + ("log in and " if args.acl is None else "") + "speak as any node (deploy/README.md)")


def node_commands(args: argparse.Namespace, manifest: dict[str, Any]) -> list[str]:
    """The command of the cloud, each edge and each device, with the split's files: its shard,
    its login (--acl) and its keys (--keys); edges admit only the devices of the manifest."""
    out, edges = args.out, min(args.edges, args.devices)

    def common(node: str) -> str:
        flags = f"--broker {login_url(args.broker, node) if args.acl else args.broker}"
        if args.acl is not None:
            flags += f" --run {args.acl} --password-file {out / 'logins' / (node + '.password')}"
        if args.keys:
            flags += f" --sign-key {out / KEYS / (node + '.key')} --verify-keys {out / KEYS}"
        return flags

    data = f" --data {args.data}" if args.data else ""
    lines = [f"splitedge cloud {common('cloud')} --edges {edges} --devices {args.devices} "
             f"--dataset {manifest['dataset']}{data} --out runs/cloud"]
    lines += [f"splitedge edge {common(f'e{e}')} --id e{e} --manifest {out}" for e in range(edges)]
    lines += [f"splitedge device {common(d['id'])} --id {d['id']} --edge e{i % args.edges} --data {out / d['file']} "
              f"--backend onnx" for i, d in enumerate(manifest["devices"])]
    return lines


def login_url(broker: str, login: str) -> str:
    """`broker` with `login` as its user (and no password: each node reads its own from --password-file)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(broker)
    return urlunsplit(parts._replace(netloc=f"{login}@{parts.netloc.rsplit('@', 1)[-1]}"))


# -- check -------------------------------------------------------------------------------------

def check(path: Path) -> int:
    """Print what a device would load from `path`; ValueError (one line, exit 2) if it cannot."""
    from splitedge.methods.data.local import NpzImages

    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if path.is_file() and not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz (a zip of x.npy and y.npy; a truncated copy is not one either) "
                         "nor an image folder")
    xs, ys = open_as_device(path, stream=True)
    try:
        streamed = isinstance(xs, NpzImages) or path.is_dir()
    finally:
        _close(xs)
    x, y = open_as_device(path, stream=False)  # the torch backend, and every image decoded once
    if not np.array_equal(ys, y) or tuple(xs.shape) != tuple(x.shape):
        raise ValueError(f"{path}: streamed and in-memory reads differ")

    names = _class_names(path, int(y.max()) + 1)
    counts = np.bincount(y, minlength=len(names))
    present = [i for i, c in enumerate(counts) if c]
    print(f"{path}: {'image folder' if path.is_dir() else 'npz shard'}")
    print(f"images:  {len(x)}")
    print(f"shape:   {list(x.shape)} (N, H, W, C)")
    print(f"dtype:   {x.dtype}; labels {y.dtype}")
    print(f"classes: {len(present)} present, labels {int(y.min())}..{int(y.max())}")
    print("counts:  " + " ".join(f"{names[i]}:{counts[i]}" for i in present))
    if path.is_file():
        from splitedge.methods.data.datasets import load_shard_meta

        meta = load_shard_meta(path)
        if meta:
            print("meta:    " + " ".join(f"{k}={v}" for k, v in meta.items()))
        _against_manifest(path)
    print("streams: " + ("yes, a thin (onnx) device reads images a batch at a time" if streamed else
                         "no (compressed .npz): a thin device loads every image into memory"))
    return 0


def _class_names(path: Path, n_labels: int) -> list[str]:
    if path.is_dir():
        from splitedge.methods.data.datasets import list_image_folder

        return list_image_folder(path)[2]
    return [str(i) for i in range(n_labels)]


def _against_manifest(path: Path) -> None:
    """When the shard still sits next to the shards.json that `data split` wrote, compare the sha256."""
    manifest = path.parent / MANIFEST
    if not manifest.is_file():
        return
    try:
        entries = {d["file"]: d for d in json.loads(manifest.read_text())["devices"]}
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{manifest}: not a manifest written by `splitedge data split`") from None
    entry = entries.get(path.name)
    if entry is None:
        return
    if file_sha256(path) != entry["sha256"]:
        raise ValueError(f"{path}: sha256 differs from {manifest} (changed or partly copied)")
    print(f"sha256:  matches {manifest}")


# -- shared: the device's loader plus the checks it leaves out -----------------------------------

def open_as_device(path: Path, *, stream: bool) -> tuple[Any, np.ndarray]:
    """device.local_data.open_local_data (which checks the arrays), without its "compressed,
    loading into memory" warning: `check` reports that itself."""
    from splitedge.methods.data.local import log, open_local_data

    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return open_local_data(path, stream=stream)
    finally:
        log.setLevel(level)


def _close(x: Any) -> None:
    close = getattr(x, "close", None)
    if callable(close):
        close()
