"""`splitedge provision`: a bundle per node and a broker that serves every run of them.

From a `splitedge data split` folder (the shards and their manifest), it writes OUT/broker (the
broker's config, an ACL by node for every run id, the password file), OUT/<id> for the cloud,
each edge and each device (bundles.py) and OUT/operator (every node's key pair and password:
what provisioning again reuses, so no node is locked out). Every node signs, verifies, logs in
with its own login and every edge admits only the manifest's devices: the safe settings, with
nothing to add.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

from splitedge.provision.bundles import BROKER, KEY, KEYS, LOGIN, MANIFEST, OPERATOR, RESERVED, SHARD, Node, \
    copy_private, private_folder, write_bundle
from splitedge.provision.units import CONFIG

HOME = "/etc/splitedge"
DEFAULT_WATCHERS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", required=True, type=Path, metavar="DIR",
                   help="the folder `splitedge data split` wrote: its shards.json names the devices, their shards "
                        "and the data set")
    p.add_argument("--broker", required=True, metavar="URL",
                   help="the broker as the nodes reach it, e.g. mqtt://broker.lan:1883 (each node's login is added)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="write the bundles here")
    p.add_argument("--edges", type=int, default=1, metavar="E", help="device i reports to edge e(i mod E)")
    p.add_argument("--cloud-id", default="cloud", metavar="ID", help="the coordinator's id")
    p.add_argument("--backend", choices=("onnx", "torch", "auto"), default="onnx",
                   help="the devices' backend: onnx is the thin install (no torch), torch trains on a Pi 5 or Jetson")
    p.add_argument("--device-data", default=None, metavar="PATH",
                   help="each device's data is already at PATH on the device (an .npz or image folder): its bundle "
                        "names it instead of carrying its shard")
    p.add_argument("--home", default=HOME, metavar="PATH",
                   help="where a bundle is installed on its node: the units start `splitedge --config PATH/"
                        f"{CONFIG}`")
    p.add_argument("--listener", default=None, metavar="[ADDR:]PORT",
                   help="the listener the broker's config opens (default: the port of --broker, every interface)")
    p.add_argument("--watchers", type=int, default=DEFAULT_WATCHERS, metavar="N",
                   help="read-only logins for `splitedge watch` (watcher, watcher-2, ...), one per watch at a time")
    p.add_argument("--overwrite", action="store_true",
                   help="rewrite the bundles already in DIR (the keys and passwords in DIR/operator are kept)")


def run(args: argparse.Namespace) -> int:
    from splitedge.data_cli import ACL, BROKER_CONF, listener_of, login_url, write_keys
    from splitedge.protocol.acl import ANY_RUN, broker_conf, federation_acl, watcher_logins, write_acl
    from splitedge.protocol.credentials import check_scheme
    from splitedge.protocol.logins import LOGINS, PASSWD, write_logins
    from splitedge.protocol.signing import INSTALL_HINT

    check_scheme(args.broker)
    manifest, doc = read_manifest(args.shards, need_shards=args.device_data is None)
    nodes = fleet(doc, manifest.parent, args)
    listen = listener_of(args.listener, args.broker)
    watchers = watcher_logins(args.watchers)
    homes = {n.id: n.settings["edge"] for n in nodes if n.role == "device"}
    acl = federation_acl(ANY_RUN, homes, cloud=args.cloud_id, watcher=watchers)  # every id checked here
    if importlib.util.find_spec("cryptography") is None:
        raise ValueError(f"provisioned nodes sign their messages, which needs the cryptography package: {INSTALL_HINT}")
    taken = [p.name for p in (args.out / n.id for n in nodes) if p.exists()] if args.out.is_dir() else []
    if taken and not args.overwrite:
        raise ValueError(f"{args.out} already holds bundles ({', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}); "
                         "pass --overwrite to rewrite them (keys and passwords are kept)")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")

    operator = private_folder(args.out / OPERATOR)
    keys = operator / KEYS
    write_keys(keys, {n.id: n.role for n in nodes})
    write_logins(operator, [*(n.id for n in nodes), *watchers], probes=[n.id for n in nodes])
    broker = args.out / BROKER  # open: the broker reads it as its own user; its password file is 600
    broker.mkdir(parents=True, exist_ok=True)
    copy_private(operator / PASSWD, broker / PASSWD)
    write_acl(broker / ACL, acl)
    (broker / BROKER_CONF).write_text(broker_conf(ANY_RUN, broker / ACL, broker / PASSWD,
                                                    port=listen[1], address=listen[0]))
    for node in nodes:
        common = {"broker": login_url(args.broker, node.id), "password-file": LOGIN, "sign-key": KEY,
                  "verify-keys": KEYS}
        write_bundle(args.out, node, common, keys, operator / LOGINS, args.home, manifest)
    report(args, nodes, watchers)
    return 0


def read_manifest(shards: Path, need_shards: bool) -> tuple[Path, dict]:
    """The manifest of a `data split` folder (its path and contents); one line if it is not one."""
    from splitedge.runtime.allowance import manifest_allowances, manifest_file

    path = manifest_file(shards)
    try:
        manifest_allowances(path)  # the edge's own reading of it, so an edge will take it
    except ValueError as exc:
        raise ValueError(str(exc).replace("--manifest", "--shards", 1)) from None
    doc = json.loads(path.read_text())
    devices = doc["devices"]
    if not devices:
        raise ValueError(f"--shards {shards}: its manifest lists no device")
    if need_shards:
        missing = [d["id"] for d in devices if not (path.parent / str(d.get("file", ""))).is_file()]
        if missing:
            raise ValueError(f"--shards {shards}: no shard file for {', '.join(missing[:3])} beside {path.name} "
                             "(give the folder `data split` wrote, or --device-data where devices hold their data)")
    return path, doc


def fleet(manifest: dict, folder: Path, args: argparse.Namespace) -> list[Node]:
    """The cloud, the edges and the devices of a manifest (in `folder`), each with its role's settings."""
    from splitedge.protocol.topics import check_node_id

    devices = manifest["devices"]
    if args.edges < 1:
        raise ValueError(f"--edges must be >= 1, got {args.edges}")
    edges = min(args.edges, len(devices))
    ids = [args.cloud_id, *(f"e{e}" for e in range(edges)), *(str(d["id"]) for d in devices)]
    for node_id in ids:
        check_node_id(node_id)
    clash = sorted({i for i in ids if ids.count(i) > 1} | (set(ids) & set(RESERVED)))
    if clash:
        raise ValueError(f"node ids must be unique and not {' or '.join(RESERVED)}: {', '.join(clash)}")
    cloud = {"id": args.cloud_id, "edges": edges, "devices": len(devices), "dataset": manifest["dataset"]}
    if manifest.get("data"):
        cloud["data"] = str(Path(manifest["data"]).resolve())  # the cloud's test split: a path of this machine
    nodes = [Node(args.cloud_id, "cloud", cloud)]
    nodes += [Node(f"e{e}", "edge", {"id": f"e{e}", "cloud": args.cloud_id, "manifest": MANIFEST})
              for e in range(edges)]
    for i, d in enumerate(devices):
        settings = {"id": str(d["id"]), "edge": f"e{i % edges}", "data": args.device_data or SHARD,
                    "backend": args.backend}
        nodes.append(Node(str(d["id"]), "device", settings,
                          None if args.device_data else folder / str(d["file"])))
    return nodes


def report(args: argparse.Namespace, nodes: list[Node], watchers: list[str]) -> None:
    from splitedge.data_cli import login_url

    out = args.out
    roles = {r: [n.id for n in nodes if n.role == r] for r in ("cloud", "edge", "device")}
    print(f"splitedge provision: {len(roles['device'])} devices on {len(roles['edge'])} edges and a cloud -> {out}")
    print(f"  {out / BROKER}: broker.conf, broker.acl, broker.passwd. One ACL serves every run of these nodes "
          f"(each login confined to its own node's topics): run `mosquitto -c {out / BROKER / 'broker.conf'}`, "
          "or install it as its comments say; new run ids need no change to it")
    print(f"  {out}/<id>: a bundle per node ({', '.join(n.id for n in nodes[:4])}{', ...' if len(nodes) > 4 else ''}): "
          f"{CONFIG}, {LOGIN}, {KEY}, {KEYS}/, the shard (devices) or {MANIFEST} (edges) and its unit "
          f"splitedge-<role>@.service. Copy each to its node only, to {args.home} (mode 700, owner splitedge), "
          f"its unit to /etc/systemd/system, and start a run with: systemctl enable --now splitedge-<role>@RUN")
    print(f"  {out / OPERATOR}: every node's key pair and password and the watch logins ({', '.join(watchers) or 'none'}); "
          "keep it to provision again without locking a node out, and never copy it to a node")
    print("Run RUN here (any number of runs, one after another, without touching the broker):")
    print(f"  splitedge cloud --config {out / args.cloud_id / CONFIG} --run RUN --out runs/RUN")
    for n in nodes[1:]:
        print(f"  splitedge {n.role} --config {out / n.id / CONFIG} --run RUN")
    if watchers:
        print(f"Watch it: splitedge watch --broker {login_url(args.broker, watchers[0])} --run RUN "
              f"--password-file {out / OPERATOR / 'logins' / (watchers[0] + '.password')}")
    if not shutil.which("mosquitto"):
        print("(no mosquitto on this machine's PATH: the broker's files are for the machine that runs it)")
