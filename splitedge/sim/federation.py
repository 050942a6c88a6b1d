"""`splitedge sim`: one command that runs a whole federation through a real MQTT broker.

An embedded broker (or `--broker`), one cloud, the edges and the devices, each with its own
MQTT connection, run as threads in this process: every message crosses the broker, so the
byte counters are the same as in a deployment. The connections share one epoll loop
(protocol/mqtt_loop.py): one descriptor and no network thread per node. Devices get disjoint shards of the data set
(IID or Dirichlet(alpha)); the cloud keeps the test split.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from splitedge.runtime.outputs import RunFolder, dumps
from splitedge.sim.resume import SIM_STATE, Snapshots, carry_on, cloud_state, put_back
from splitedge.sim.resume import load as load_sim_state

log = logging.getLogger(__name__)
status_log = logging.getLogger("splitedge.status")


JOIN_BASE_S, JOIN_PER_DEVICE_S = 60.0, 0.1


@dataclass
class SimSettings:
    rounds: int = 10
    devices: int = 4
    edges: int = 2
    method: str = "hsfp"
    dataset: str = "digits"
    data: str | None = None
    model: str | None = None
    alpha: float | None = None  # None: IID
    seed: int = 0
    deadline_s: float = 300.0
    broker: str | None = None
    out: Path | None = None  # None: a new folder runs/<method>-<date>-<time>
    overwrite: bool = False
    run: str = ""
    threads: int = 1
    device: str = "auto"  # the torch device of the cloud, edges and torch devices (methods/compute.py)
    plugins: tuple[str, ...] = ()  # --plugin import paths: registered here and in every worker process
    max_train: int | None = None
    max_test: int | None = None
    backends: tuple[str, ...] = ("torch",)
    overrides: dict[str, Any] = field(default_factory=dict)
    groups: int = 0  # planted device groups (clustered methods): 0 none
    group_skew: str = "rotate"  # group g's images turned by g quarter turns, or "labels": permuted per group
    virtual: int = 0  # > 0: devices hold their model only while training, this many at a time (and edges train N at a time)
    park_dtype: str = "f4"  # how a virtual device keeps its model between rounds: f4, or f2 (half the bytes)
    workers: int = 0  # > 0: the devices run in this many worker processes (this one: broker, cloud, edges)
    worker: str | None = None  # "I/N": this process is worker I of N, running devices d with d % N == I only
    spawn_workers: bool = True  # with workers: start them here (False: they run elsewhere, with --worker I/N)
    broker_tree: bool = False  # one Mosquitto per edge site bridged to a cloud Mosquitto (splitedge.sim.broker_tree)
    site_brokers: dict[str, str] = field(default_factory=dict)  # a worker of a tree sim: edge -> its site broker
    split: str = "niid"  # with alpha: "niid" (NIID-Bench, per class) or "per-device" (Hsu et al.; many devices)
    join_timeout_s: float | None = None  # None: JOIN_BASE_S + JOIN_PER_DEVICE_S per device (join_timeout)
    sample_fraction: float = 1.0  # client sampling (runtime/sampling.py): a fraction of the online devices,
    sample_count: int = 0  # or a count, per round
    sample_min: int = 1
    until_plateau: bool = False  # stop before `rounds` once the accuracy has plateaued
    listed_only: bool = False  # edges admit only these devices, each bounded by its shard (edge --manifest)
    sign: bool = False  # every node signs and verifies (keys derived from the run id: splitedge/sim/keys.py)
    resumable: bool = False  # every node's state in out/sim.state after each round; a rerun carries on (sim/resume.py)
    round_memory_mb: float | None = None  # each device's round fails over it: the process's resident memory (runtime/guard.py)
    round_budget_s: float | None = None  # each device's round fails over it (None: the round's deadline)

    @property
    def sampling(self) -> Any:
        from splitedge.runtime.sampling import Sampling

        return Sampling(fraction=self.sample_fraction, count=self.sample_count, minimum=self.sample_min, seed=self.seed)

    @property
    def compute(self) -> Any:
        """`device` resolved on this machine (methods/compute.py)."""
        from splitedge.methods.compute import resolve

        return resolve(self.device)

    @property
    def join_timeout(self) -> float:
        """Seconds the cloud waits for every edge and device to join before it gives up: given,
        or a minute plus 0.1 s per device (workers load the data and start thousands of
        sessions first; 3,000 devices did not all join within 60 s)."""
        return self.join_timeout_s if self.join_timeout_s is not None else JOIN_BASE_S + JOIN_PER_DEVICE_S * self.devices

    def __post_init__(self) -> None:
        if self.devices < 1 or self.edges < 1:
            raise ValueError(f"need at least one device and one edge, got {self.devices} and {self.edges}")
        if self.plugins:  # before the checks: a thin model of one's own makes its model a thin one
            from splitedge.runtime.plugin_args import use_plugins

            use_plugins(self.plugins)
        check_run_settings(self)
        check_scale_settings(self)
        nodes = nodes_in_process(self)
        if nodes > MAX_SIM_NODES:
            share = f"--workers {-(-self.devices // (MAX_SIM_NODES - 1))} or more"
            raise ValueError(f"this process would run {nodes} nodes (their MQTT sessions, threads, models and data), "
                             f"more than the {MAX_SIM_NODES} one process is measured to hold: give the devices "
                             f"worker processes ({share}; each holds its share)"
                             + (" and fewer edges" if self.edges + 1 > MAX_SIM_NODES else ""))
        if self.out is None:
            self.out = Path("runs") / f"{self.method}-{time.strftime('%Y%m%d-%H%M%S')}"


BACKENDS = ("torch", "onnx")


def check_run_settings(s: Any) -> None:
    """Every value the command line gives, checked before any data is loaded or node started:
    each mistake is one ValueError naming the flag and what to do."""
    from splitedge.cloud.options import check_run_arguments, check_shared_noise, run_compute

    check_run_arguments(s.method, s.rounds, s.dataset, s.data, s.deadline_s, s.seed, s.max_train, s.max_test,
                        s.overrides)
    run_compute(s.method, s.device)  # a GPU torch cannot see, or one the method cannot use
    if s.alpha is not None and not s.alpha > 0:
        raise ValueError(f"--alpha must be > 0 (a Dirichlet concentration), got {s.alpha}; omit it for IID")
    unknown = [b for b in s.backends if b not in BACKENDS]
    if unknown or not s.backends:
        raise ValueError(f"--backends takes a comma list of {', '.join(BACKENDS)}, got {','.join(s.backends) or '(empty)'}")
    check_backends(s.method, s.backends)
    if "onnx" in s.backends and s.model:
        from splitedge.methods.thin.graphs import thin_models

        if s.model not in thin_models():
            raise ValueError(f"--model {s.model}: a thin (onnx) device builds only the networks of its install, "
                             f"{', '.join(thin_models())}; drop onnx from --backends, or give thin devices the model's "
                             f"numpy layers with --plugin package.module:THIN_MODEL (docs/plugins.md)")
    if s.join_timeout_s is not None and not s.join_timeout_s > 0:
        raise ValueError(f"--join-timeout must be > 0 seconds, got {s.join_timeout_s}")
    if s.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {s.threads}")
    if not 0 <= s.groups <= s.devices or s.group_skew not in ("rotate", "labels"):
        raise ValueError(f"--groups must be in 0..--devices and --group-skew rotate or labels, got {s.groups} and "
                         f"{s.group_skew!r}")
    check_shared_noise(s.overrides, s.devices, s.edges, s.sampling)  # also: a sampling that makes no sense


def check_backends(method: str, backends: tuple[str, ...]) -> None:
    """A method with no device part for a requested backend: every such device would leave at
    round 1 (device/agent.py), so the sim refuses in one line before it loads anything."""
    from splitedge.methods.registry import get_method, list_methods

    runs_on = get_method(method).device_backends()  # None: a generic part, any backend
    missing = [b for b in dict.fromkeys(backends) if runs_on is not None and b not in runs_on]
    if not missing:
        return
    others = [m for m in list_methods() if all(b in (get_method(m).device_backends() or backends) for b in missing)]
    raise ValueError(f"{method} has no device part for backend {', '.join(missing)} (it runs on {', '.join(runs_on)}): "
                     f"its {'/'.join(missing)} devices would leave at round 1; drop {', '.join(missing)} from "
                     f"--backends" + (f", or choose a method that runs on it ({', '.join(others[:6])})" if others else ""))


def check_scale_settings(s: SimSettings) -> None:
    """The sim-only options of larger runs: virtual devices, workers, broker tree, split."""
    if s.virtual < 0 or s.park_dtype not in ("f4", "f2"):
        raise ValueError(f"--virtual must be >= 0 (training slots; 0: every device keeps its model) and "
                         f"--park-dtype f4 or f2, got {s.virtual} and {s.park_dtype!r}")
    if s.split not in ("niid", "per-device"):
        raise ValueError(f"--split must be niid or per-device, got {s.split!r}")
    if s.broker_tree:
        moves = s.method == "cflhkd" or str(s.overrides.get("assign", "random")) != "random"
        if s.broker or s.worker or not s.spawn_workers or moves:
            raise ValueError("--broker-tree starts its own brokers on this machine, each device on its edge's site "
                             "broker: drop --broker and --remote-workers, and methods that move devices between "
                             "edges (cflhkd, hsfp --set assign=...)")
    if s.resumable and (s.workers or s.worker or s.broker_tree):
        raise ValueError("--resumable keeps every node's state from this process: drop --workers, --worker and "
                         "--broker-tree (their devices or brokers live elsewhere)")
    if s.workers < 0 or s.workers > s.devices:
        raise ValueError(f"--workers must be in 0..--devices ({s.devices}), got {s.workers}")
    if s.worker is None:
        return
    index, _, count = s.worker.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"--worker takes I/N with 0 <= I < N (this process runs devices d with d % N == I), "
                         f"got {s.worker!r}")
    if not s.broker or not s.run:
        raise ValueError("a --worker joins a sim that runs elsewhere: give the same --broker URL and --run id as the "
                         "process with --workers")


def worker_devices(s: SimSettings) -> list[int]:
    """The devices this process runs: all; none (its workers run them); or worker I of N's share."""
    if s.worker is not None:
        index, count = (int(v) for v in s.worker.split("/"))
        return [d for d in range(s.devices) if d % count == index]
    return [] if s.workers else list(range(s.devices))


def nodes_in_process(s: SimSettings) -> int:
    """The nodes this process runs: its devices (all, none, or a worker's share), and the cloud
    and edges unless it is a worker. The node limit is per process: each worker holds only its
    share of the devices' sessions, models and data."""
    return len(worker_devices(s)) + (s.edges + 1 if s.worker is None else 0)


def home_edge(device: int, s: SimSettings) -> str:
    """The edge a device starts at (and, with a broker tree, whose site broker it connects to)."""
    return f"e{device % s.edges}"


def planted_group(device: int, s: SimSettings) -> int:
    """Devices in contiguous blocks: d0.. in group 0, the next block in group 1, ... (edges are
    dealt round-robin, so a clustered method has devices to move)."""
    return device * s.groups // s.devices if s.groups else 0


def plant(data: tuple[np.ndarray, np.ndarray], group: int, s: SimSettings) -> tuple[np.ndarray, np.ndarray]:
    """A planted group's skew: its images turned by `group` quarter turns, or its labels permuted
    (a fixed permutation per group, seeded; group 0 is left as it is)."""
    x, y = data
    if group == 0:
        return x, y
    if s.group_skew == "rotate":
        return np.ascontiguousarray(np.rot90(x, k=group, axes=(1, 2))), y
    perm = np.random.default_rng([s.seed, group]).permutation(int(y.max()) + 1)
    return x, perm[y]


MAX_SIM_NODES = 3100
"""Nodes in one process (nodes_in_process): 3,000 devices, their edges and the cloud. The nodes'
MQTT clients share one ClientLoop (one descriptor each; before it, paho's select() stopped a
process at 320 nodes); 3,000 device sessions were held in one process for 10 minutes
(bench/results/scale-clients). A larger run gives its devices worker processes (`--workers`),
each holding its share."""


def partition(labels: np.ndarray, settings: SimSettings) -> list[np.ndarray]:
    from splitedge.methods.data.partition import dirichlet, dirichlet_per_device, iid

    rng = np.random.default_rng(settings.seed)
    if settings.alpha is None:
        return iid(labels, settings.devices, rng)
    if settings.split == "per-device":
        return dirichlet_per_device(labels, settings.devices, settings.alpha, rng)
    try:
        return dirichlet(labels, settings.devices, settings.alpha, rng)
    except ValueError as exc:
        raise ValueError(f"{exc}; with many devices use --split per-device (each device's class mix ~ "
                         f"Dir(alpha), equal sizes)") from None


@contextlib.contextmanager
def brokers(s: SimSettings, run: str) -> Iterator[tuple[str, Any]]:
    """(the cloud's broker URL, the BrokerTree or None): `--broker`, a broker tree, or an
    embedded broker."""
    if s.broker:
        yield s.broker, None
    elif s.broker_tree:
        from splitedge.sim.broker_tree import BrokerTree

        with BrokerTree(run, [f"e{e}" for e in range(s.edges)]) as tree:
            yield tree.cloud.url, tree
    else:
        from splitedge.protocol.broker import EmbeddedBroker

        with EmbeddedBroker() as broker:
            yield broker.url, None


def run_sim(s: SimSettings, on_round: Callable[[dict], None] | None = None,
            on_resume: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run the federation; writes metrics.jsonl, summary.json and plot.png into s.out. As a
    worker (`s.worker`), run this process's share of the devices instead (run_worker). A
    resumable sim carrying on an earlier one calls `on_resume(run, round)` first."""
    if s.worker is not None:
        return run_worker(s)
    import torch

    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    torch.set_num_threads(s.threads)
    started = time.monotonic()
    if s.broker:  # a wrong URL fails in seconds, not after every node's connect timeout
        from splitedge.protocol.mqtt import check_reachable

        check_reachable(s.broker)
    from splitedge.protocol.mqtt_loop import ensure_fd_limit

    ensure_fd_limit(nodes_in_process(s))  # one socket per node; a limit too low is one RuntimeError now
    # claimed before any work, released at the end; a resumable sim's folder with a sim.state is carried on
    with RunFolder(s.out, overwrite=s.overwrite, resumable=s.resumable, resume_file=SIM_STATE) as folder:
        train, test, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
        config = build_run_config(s.method, info, s.model, s.seed, s.overrides)
        saved = resumed_state(s, config) if folder.resuming else None
        if saved and on_resume:
            on_resume(saved.run, saved.round)
        shards = partition(train[1], s)
        run = saved.run if saved else s.run or f"sim-{uuid.uuid4().hex[:8]}"  # unique: two sims may share a broker
        wall_before = saved.wall_seconds if saved else 0.0
        with brokers(s, run) as (url, tree), Federation(url, run, s, train, shards, tree, saved) as fed, \
                WorkerPool(s, url, run, tree) as workers:
            per_device = fed.per_device_bytes(on_round)
            after_round = per_device.record
            if s.resumable:
                if saved:  # the rounds before, and the counts they end at (carried on by every connection)
                    per_device.rows = [tuple(row) for row in saved.device_bytes_rows]
                    tier = fed.bytes_by_tier()["device"]
                    per_device.last = (tier["out_payload"], tier["in_payload"])
                snapshots = Snapshots(fed, s.out, per_device, started, wall_before)
                after_round = chained(per_device.record, snapshots.after_round)
            settings = CloudSettings(method=s.method, rounds=s.rounds, config=config, deadline_s=s.deadline_s,
                                     min_edges=s.edges, min_devices=s.devices, join_timeout_s=s.join_timeout,
                                     out_dir=s.out, seed=s.seed, sampling=s.sampling,
                                     until_plateau=s.until_plateau, dataset=s.dataset,
                                     compute=fed.compute, on_round=after_round)
            cloud = CloudCoordinator(fed.connect("cloud", "cloud"), settings, run=run, test=test, host=fed.hosts()[0],
                                     resume_from=cloud_state(saved) if saved else None)
            if s.resumable:
                snapshots.cloud = cloud
            if saved:
                fed.resume_cloud(cloud)
            try:
                history = cloud.run()
            except KeyboardInterrupt:  # what finished is kept, and marked as such
                summary = summarise(cloud.history, fed, config, s, wall_before + time.monotonic() - started, info,
                                    "interrupted", left=cloud.left)
                (s.out / "summary.json").write_text(dumps(summary, indent=1))
                raise
            fed.wait_stopped(timeout=30)
            workers.wait(timeout=60)
            summary = summarise(history, fed, config, s, wall_before + time.monotonic() - started, info,
                                workers=workers, left=cloud.left)
            if saved:
                summary["resumed_after_round"] = saved.round
            if tree is not None:
                summary["brokers"] = tree.counters()  # bytes and messages through each broker
            if s.sign:
                summary["signed"] = True  # every frame signed and verified (its bytes include the trailers)
        (s.out / "summary.json").write_text(dumps(summary, indent=1))
        from splitedge.plots import plot_run
        from splitedge.runtime.outputs import plot_spectra_per_round

        plot_run(history, s.out / "plot.png",
                 title=f"{s.method} on {s.dataset}, {s.devices} devices, {s.edges} edges, "
                       f"{'IID' if s.alpha is None else f'Dirichlet({s.alpha:g})'}, {s.rounds} rounds",
                 chance=summary["chance"], personalised=cloud.method.personalised,
                 device_bytes=None if s.workers else per_device.rows)  # workers count their devices at exit only
        plot_spectra_per_round(history, s.out / "spectrum.png", title=f"{s.method} on {s.dataset}")
    return summary


def resumed_state(s: SimSettings, config: Any) -> Any:
    """The saved sim to carry on (sim/resume.py): its run id, method, settings and seed must be
    this command's, and it must not have finished; one ValueError naming what differs."""
    from splitedge.cloud.resume import check_same_run

    saved = load_sim_state(s.out)
    if s.run and s.run != saved.run:
        raise ValueError(f"--out {s.out} holds sim run {saved.run!r} stopped after round {saved.round}; --run {s.run} "
                         f"differs: drop --run (or give {saved.run}) to resume, or pass --overwrite to start afresh")
    check_same_run(cloud_state(saved), out=s.out, run=saved.run, method=s.method, config=config.to_wire(),
                   seed=s.seed, rounds=s.rounds)
    status_log.info("sim: resuming run %s after round %d (%s)", saved.run, saved.round, Path(s.out) / SIM_STATE)
    return saved


def chained(*callbacks: Callable[[dict], None]) -> Callable[[dict], None]:
    def each(record: dict) -> None:
        for callback in callbacks:
            callback(record)
    return each


SIM_CONNECT_TIMEOUT_S = 60.0
"""A margin over a lone device's 10 s: one process holds every node's MQTT client (and a thread
per node on one GIL) while already-started nodes are busy."""

SIM_KEEPALIVE_S = 300
"""The MQTT keepalive of a sim's nodes (a lone node's is 30 s; the broker drops a client it has
not heard from in 1.5 keepalives). 2,500 devices sharing a process and a third of a core take a
round announcement each at once, and the loop thread that sends every client's PINGREQ waits
for the GIL behind them: at 10,000 devices in four workers the broker dropped 11,238 devices and
18 edges as timed out in round 1, firing their wills. A sim's nodes that really go away close
their sockets (the broker sees that at once), so a long keepalive costs nothing here."""


def private_run(s: SimSettings) -> bool:
    """A run with DP (`dp_sigma` > 0): its simulated devices keep their hello and round reports
    private, as `splitedge device --private-reports` does (the classes held, the samples and the
    losses would otherwise go in the clear)."""
    return float(s.overrides.get("dp_sigma", 0) or 0) > 0


class Federation:
    """The edges and devices of a simulated run, each a thread with its own MQTT client; the
    clients (and the cloud's) are driven by one shared ClientLoop."""

    def __init__(self, url: str, run: str, s: SimSettings, train: tuple[np.ndarray, np.ndarray],
                 shards: list[np.ndarray], tree: Any = None, saved: Any = None) -> None:
        self.url, self.run, self.s, self.train, self.shards = url, run, s, train, shards
        self.saved = saved  # a resumed sim's SimState: each node is put back as it was before it starts
        self.tree = tree  # a BrokerTree: each edge and its devices on their site broker
        # tier -> node id -> its transports (two for an edge bridging its site broker and the cloud's)
        self.node_transports: dict[str, dict[str, list[Any]]] = {"device": {}, "edge": {}, "cloud": {}}
        self.nodes: list[Any] = []
        self.threads: list[threading.Thread] = []
        self.loop: Any = None
        self.keys: Any = None
        self.compute = s.compute  # one GPU for every node's torch parts; thin devices compute in numpy
        if s.sign:
            from splitedge.sim.keys import SimKeys

            self.keys = SimKeys(run, s.edges, s.devices)

    def connect(self, tier: str, node_id: str) -> Any:
        from splitedge.runtime.session import connect

        url = self.url
        if tier != "cloud" and (self.tree is not None or self.s.site_brokers):  # each site on its own broker
            site = node_id if tier == "edge" else home_edge(int(node_id[1:]), self.s)
            url = self.tree.site_url(site) if self.tree is not None else self.s.site_brokers[site]
        signing = self.keys.options(node_id) if self.keys is not None else {}
        transport = connect(url, run=self.run, tier=tier, node_id=node_id, connect_timeout=SIM_CONNECT_TIMEOUT_S,
                            keepalive=SIM_KEEPALIVE_S, loop=self.loop, **signing)
        mine = self.node_transports[tier].setdefault(node_id, [])
        if self.saved is not None:  # a resumed sim's counts cover the whole run
            carry_on(self.saved, tier, node_id, len(mine), transport)
        mine.append(transport)
        return transport

    @property
    def transports(self) -> dict[str, list[Any]]:
        """Every transport of each tier."""
        return {tier: [t for ts in nodes.values() for t in ts] for tier, nodes in self.node_transports.items()}

    def __enter__(self) -> "Federation":
        from splitedge.device.agent import DeviceAgent
        from splitedge.edge.aggregator import MEMBERS_QUIET_S, EdgeAggregator
        from splitedge.methods.compute import CPU
        from splitedge.protocol.mqtt_loop import ClientLoop
        from splitedge.runtime.guard import RoundGuard

        self.loop = ClientLoop(name=f"sim-{self.run}")
        _, edge_host, device_host = self.hosts()
        listed = self.manifest() if self.s.listed_only else None

        def edges() -> None:
            for e in range(self.s.edges if self.s.worker is None else 0):  # a worker runs devices only
                edge = EdgeAggregator(self.connect("edge", f"e{e}"), run=self.run, node_id=f"e{e}", seed=self.s.seed,
                                      host=edge_host, shared_process=True, listed=listed, quiet_warn_s=None,
                                      members_quiet_s=MEMBERS_QUIET_S if self.saved is not None else 0.0,
                                      compute=self.compute)
                self._start(edge)

        def devices() -> None:
            for d in worker_devices(self.s):
                idx = self.shards[d]
                backend = self.s.backends[d % len(self.s.backends)]
                data = plant((self.train[0][idx], self.train[1][idx]), planted_group(d, self.s), self.s)
                guard = RoundGuard(memory_mb=self.s.round_memory_mb or None, budget_s=self.s.round_budget_s,
                                   who=f"device d{d}")  # one process: no rlimit, its resident memory per batch
                agent = DeviceAgent(self.connect("device", f"d{d}"), run=self.run, node_id=f"d{d}",
                                    edge=home_edge(d, self.s), data=data, backend=backend, seed=self.s.seed,
                                    host=device_host, shared_process=True, private_reports=private_run(self.s),
                                    guard=guard, quiet_warn_s=None,
                                    compute=self.compute if backend == "torch" else CPU)
                self._start(agent)

        # a resumed sim's edges come back as a restarted edge does: their devices' hellos are
        # there already (retained), and each takes them all before its part hears of a member
        # (one by one, a part would drop the state it holds of the members not yet back)
        for start in ((devices, edges) if self.saved is not None else (edges, devices)):
            start()
        return self

    def manifest(self) -> dict[str, Any]:
        """What `splitedge data split` would write for this sim's devices: each one's samples and
        class counts (of its labels as planted), for edges that admit only listed devices."""
        import numpy as np

        from splitedge.runtime.allowance import listed

        out = {}
        for d in range(self.s.devices):
            idx = self.shards[d]
            y = plant((self.train[0][idx], self.train[1][idx]), planted_group(d, self.s), self.s)[1]
            out[f"d{d}"] = listed(len(y), np.bincount(np.asarray(y, dtype=np.int64)))
        return out

    def hosts(self) -> tuple[Any, Any, Any]:
        """The part hosts of the cloud, edges and devices: with `--virtual N`, devices hold their
        part only while one of N shared training slots is theirs, and N edges aggregate at a time."""
        from splitedge.runtime.parts import PartHost
        from splitedge.sim.virtual import ParkingHost, SlottedHost

        if not self.s.virtual:
            return PartHost, PartHost, PartHost
        edge_slots, device_slots = threading.Semaphore(self.s.virtual), threading.Semaphore(self.s.virtual)
        return (PartHost, functools.partial(SlottedHost, slots=edge_slots),
                functools.partial(ParkingHost, slots=device_slots, park_dtype=self.s.park_dtype))

    def resume_cloud(self, cloud: Any) -> None:
        """No retained downlink of the resumed cloud's earlier incarnation is left on the broker
        (every node is put back from the saved state instead)."""
        from splitedge.protocol.topics import pattern
        from splitedge.runtime.session import clear_retained

        clear_retained(cloud.transport, pattern(self.run, "cloud", cloud.node_id, "down", "#"))

    def _start(self, node: Any) -> None:
        if self.saved is not None:
            put_back(self.saved, node)
        node.start()
        thread = threading.Thread(target=node.run_forever, name=node.node_id, daemon=True)
        thread.start()
        self.nodes.append(node)
        self.threads.append(thread)

    def wait_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()
        self.wait_stopped(timeout=10)
        for transports in self.transports.values():
            for t in transports:
                t.close()
        if self.loop is not None:
            self.loop.close()

    def bytes_by_kind(self, tier: str) -> dict[str, dict[str, dict[str, int]]]:
        """Messages and payload bytes per topic kind, sent (out) and received (in) by a tier's nodes,
        so per-kind traffic (e.g. SplitFed activations / gradients) can be read off a run."""
        out: dict[str, dict[str, dict[str, int]]] = {"out": {}, "in": {}}
        for t in self.transports[tier]:
            add_kind_rows(out, t.counters.snapshot())
        return out

    def per_device_bytes(self, then: Callable[[dict], None] | None = None) -> "PerDeviceBytes":
        """A round callback that records the devices' mean payload up and down per round."""
        return PerDeviceBytes(self, then)

    def messages_by_node(self, tier: str) -> dict[str, dict[str, int]]:
        """Messages each node of a tier sent (out) and received (in), over all its transports: an
        edge's load, whichever broker each side of it talks to."""
        return {node: {d: sum(t.counters.total(d, "messages") for t in ts) for d in ("out", "in")}
                for node, ts in self.node_transports[tier].items()}

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """Payload and packet bytes sent (out) and received (in) by each tier, summed over nodes."""
        out: dict[str, dict[str, int]] = {}
        for tier, transports in self.transports.items():
            row = {}
            for direction in ("out", "in"):
                for fld in ("payload", "packet"):
                    row[f"{direction}_{fld}"] = sum(t.counters.total(direction, fld) for t in transports)
            out[tier] = row
        return out


def add_kind_rows(into: dict[str, dict[str, dict[str, int]]], rows: dict[str, dict[str, dict[str, int]]]) -> None:
    """Add per-kind `messages` and `payload` counts (by direction "out" / "in") into `into`."""
    for direction in ("out", "in"):
        for kind, row in rows.get(direction, {}).items():
            acc = into[direction].setdefault(kind, {"messages": 0, "payload": 0})
            acc["messages"] += row["messages"]
            acc["payload"] += row["payload"]


class PerDeviceBytes:
    """(up, down) payload bytes per device for each round, from the device transports' counters."""

    def __init__(self, fed: Federation, then: Callable[[dict], None] | None) -> None:
        self.fed, self.then = fed, then
        self.rows: list[tuple[int, int]] = []
        self.last = (0, 0)

    def record(self, round_record: dict) -> None:
        tier = self.fed.bytes_by_tier()["device"]
        now = (tier["out_payload"], tier["in_payload"])
        n = max(1, self.fed.s.devices)
        self.rows.append(((now[0] - self.last[0]) // n, (now[1] - self.last[1]) // n))
        self.last = now
        if self.then is not None:
            self.then(round_record)


def closed_on_quorum(history: list[dict]) -> bool:
    """True when no round closed without a child it expected (at a deadline or with a node
    gone): then a run is reproducible, the same seed giving the same accuracy in every round."""
    return not any(h.get("rounds", {}).get("missed") for h in history)


def summed(rounds: Any) -> dict[str, dict[str, Any]]:
    from splitedge.runtime.cost import summed as summed_costs

    return summed_costs(rounds)


def summarise(history: list[dict], fed: Federation, config: Any, s: SimSettings, seconds: float,
              info: Any, status: str = "complete", workers: "WorkerPool | None" = None,
              left: dict[str, str] | None = None) -> dict[str, Any]:
    """The run in one JSON document; `status` "complete", "interrupted" or "no_devices" (no
    device's training reached the cloud, or every device left: `status_reason` says why; `left`
    is the cloud's node -> why it left), `evaluated_rounds` how many rounds produced an accuracy
    (0 means the run learnt nothing that was measured). `final_accuracy` is the model's own head
    (`final_accuracy_head`); `served_accuracy` that of the model the checkpoint holds (`served_head`)."""
    from splitedge.runtime.outputs import ending, served

    reason = None
    if status == "complete":
        status, reason = ending(history, left, s.devices)
    head, served_accuracy = served(history)
    acc = [h.get("accuracy", float("nan")) for h in history]  # a method may report no accuracy
    calibrated = [h.get("accuracy_calibrated") for h in history]  # None: the round was not calibrated
    measured = [a for a in calibrated if a is not None]
    by_tier = fed.bytes_by_tier()
    by_kind = fed.bytes_by_kind("device")
    if workers is not None and s.workers:
        by_tier["device"], by_kind = workers.device_bytes()
    sizes = [len(idx) for idx in fed.shards]
    rounds = max(1, len(history))
    return {
        "status": status,
        **({"status_reason": reason} if reason else {}),
        "rounds_done": len(history),
        "evaluated_rounds": sum(1 for a in acc if a == a),
        "final_accuracy": acc[-1] if acc else None,
        "final_accuracy_head": "own",
        "best_accuracy": max((a for a in acc if a == a), default=None),
        "accuracy_per_round": acc,
        **({"final_accuracy_calibrated": calibrated[-1], "best_accuracy_calibrated": max(measured),
            "accuracy_calibrated_per_round": calibrated} if measured else {}),
        "served_head": head,
        "served_accuracy": served_accuracy,
        "round_seconds": [h["round_seconds"] for h in history],
        "closed_on_quorum": closed_on_quorum(history) and status != "no_devices",
        "stopped_on_plateau": status == "complete" and s.until_plateau and 0 < len(history) < s.rounds,
        "wall_seconds": seconds,
        "bytes": by_tier,
        "edge_messages": fed.messages_by_node("edge"),
        "device_up_bytes_per_device_per_round": by_tier["device"]["out_payload"] / max(1, s.devices) / rounds,
        "device_bytes_by_kind": by_kind,
        "device_costs": summed(h.get("device_costs") or {} for h in history),
        "chance": 1.0 / info.num_classes,
        **({"planted_groups": {f"d{d}": planted_group(d, s) for d in range(s.devices)}} if s.groups else {}),
        "train_images": int(sum(len(idx) for idx in fed.shards)),
        "images_per_device": {"min": int(min(sizes)), "median": float(np.median(sizes)), "max": int(max(sizes))},
        "config": {"method": s.method, "settings": config.to_wire()["method"], "model": config.to_wire()["model"],
                   "devices": s.devices, "edges": s.edges, "rounds": s.rounds, "alpha": s.alpha,
                   "dataset": s.dataset, "run": fed.run, "deadline_s": s.deadline_s},
    }


# -- worker processes ----------------------------------------------------------------------------

WORKERS_DIR = "workers"


class WorkerPool:
    """`--workers N`: the devices in N processes of their own (`python -m splitedge.sim.worker`),
    each computing the same partition from the seed and running devices d with d % N == I
    against this sim's broker; at exit each leaves its devices' byte counters in
    out/workers/worker-I.json. With `spawn_workers` False nothing is started here: the workers
    run on other machines (`splitedge sim ... --broker URL --run RUN --worker I/N`)."""

    def __init__(self, s: SimSettings, url: str, run: str, tree: Any = None) -> None:
        self.s, self.url, self.run = s, url, run
        # with a broker tree, each worker connects a device to its edge's site broker
        self.sites = {} if tree is None else {f"e{e}": tree.site_url(f"e{e}") for e in range(s.edges)}
        self.procs: list[Any] = []
        self.folder = Path(s.out) / WORKERS_DIR

    def __enter__(self) -> "WorkerPool":
        if not self.s.workers or not self.s.spawn_workers:
            return self
        import dataclasses
        import sys

        from splitedge.protocol.children import spawn_tied

        self.folder.mkdir(parents=True, exist_ok=True)
        for i in range(self.s.workers):
            settings = dataclasses.replace(self.s, broker=self.url, run=self.run, workers=0,
                                           worker=f"{i}/{self.s.workers}", broker_tree=False, site_brokers=self.sites)
            spec = self.folder / f"worker-{i}.settings.json"
            spec.write_text(json.dumps(worker_spec(settings)))
            with open(self.folder / f"worker-{i}.log", "w") as log_file:
                self.procs.append(spawn_tied([sys.executable, "-m", "splitedge.sim.worker", str(spec)],
                                             stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        status_log.info("sim: %d worker process(es) started for %d devices", self.s.workers, self.s.devices)
        return self

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a stuck worker is stopped
                log.warning("sim: worker %d did not exit; stopping it (see %s)", i, self.folder / f"worker-{i}.log")
                proc.kill()

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def device_bytes(self) -> tuple[dict[str, int], dict[str, Any]]:
        """The devices' byte counters summed over the workers' reports (zero for a missing one)."""
        tier = {f"{d}_{f}": 0 for d in ("out", "in") for f in ("payload", "packet")}
        kinds: dict[str, dict[str, dict[str, int]]] = {"out": {}, "in": {}}
        for path in sorted(self.folder.glob("worker-*.json")):
            if path.name.endswith(".settings.json"):
                continue
            report = json.loads(path.read_text())
            for key, value in report["tier"].items():
                tier[key] = tier.get(key, 0) + value
            add_kind_rows(kinds, report["by_kind"])
        return tier, kinds


def worker_spec(s: SimSettings) -> dict[str, Any]:
    """SimSettings as JSON for a worker process (paths as strings, tuples as lists)."""
    import dataclasses

    spec = dataclasses.asdict(s)
    spec["out"] = str(s.out)
    spec["backends"] = list(s.backends)
    spec["plugins"] = list(s.plugins)
    return spec


def _use_plugins(s: SimSettings) -> None:
    """Register the method and model plug-ins the sim's settings name (protocol/plugins.py)."""
    from splitedge.methods.registry import use_method

    use_method(s.method)
    if s.model:
        from splitedge.models import use_model

        use_model(s.model)


def run_worker(s: SimSettings) -> dict[str, Any]:
    """Worker I of N: this share of the devices against the sim's broker, until the cloud's
    stop; leaves their byte counters in out/workers/worker-I.json."""
    import torch

    from splitedge.methods.data.datasets import load_dataset
    from splitedge.protocol.credentials import redact_url
    from splitedge.protocol.mqtt import check_reachable
    from splitedge.protocol.mqtt_loop import ensure_fd_limit

    torch.set_num_threads(s.threads)
    check_reachable(s.broker)
    _use_plugins(s)  # the parent's command line named them: its devices here must find them too
    mine = worker_devices(s)
    ensure_fd_limit(len(mine) + 1)
    train, _, _ = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
    shards = partition(train[1], s)
    status_log.info("sim worker %s: %d devices on %s (run %s)", s.worker, len(mine), redact_url(s.broker), s.run)
    with Federation(s.broker, s.run, s, train, shards) as fed:
        fed.wait_stopped(timeout=s.rounds * s.deadline_s + 600)  # until the cloud's stop
        report = {"worker": s.worker, "devices": len(mine), "tier": fed.bytes_by_tier()["device"],
                  "by_kind": fed.bytes_by_kind("device")}
    if s.out is not None:
        folder = Path(s.out) / WORKERS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"worker-{s.worker.split('/')[0]}.json").write_text(json.dumps(report))
    return report
