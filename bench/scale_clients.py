"""Hold N device MQTT sessions in ONE process on a ClientLoop, with statistics replay (issue 13).

``python -m splitedge.bench.scale_clients --clients 3000 --minutes 10 --out DIR`` starts a
private Mosquitto (or uses ``--broker``), connects ``--edges`` edge-like subscribers and N
device-like clients on one :class:`~splitedge.protocol.mqtt_loop.ClientLoop`, and for
``--minutes`` has every device publish a small QoS 1 ``moments`` message (per-class count, mean
and variance: no training) every ``--period`` seconds, spread evenly over the period, to its
own uplink, which its edge subscribes to device by device as the edge runtime does. Each edge
publishes a QoS 1 heartbeat to its downlink every period, which its devices subscribe to.
Devices carry a last will and a retained birth, like deployed nodes.

Reported (JSON + README.md in --out): sessions held (devices connected at the end that never
reconnected, and the broker's own $SYS count over the hold), messages sent / acknowledged /
received / lost up and down, peak RSS of this process and of the broker (kernel VmHWM),
descriptors, threads, CPU seconds of both, connect time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from splitedge.bench.lib.procmem import vm_hwm_bytes
from splitedge.bench.lib.report import machine
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.mqtt_loop import ClientLoop, ensure_fd_limit
from splitedge.protocol.topics import pattern, topic
from splitedge.protocol.transport import wait_for

log = logging.getLogger(__name__)
RUN = "scale"
BROKER_CONF = "max_connections -1\nmax_queued_messages 10000\n"
"""Unlimited connections (the 2.0 default, stated); a deeper per-client queue than the default
1000 so a slow edge would show as latency, not as messages Mosquitto silently drops."""


@dataclass
class Settings:
    clients: int = 3000
    minutes: float = 10.0
    period: float = 10.0
    edges: int = 20
    classes: int = 10
    dim: int = 16
    out: Path = Path("runs/bench/scale-clients")
    broker: str | None = None


def stats_bodies(s: Settings, count: int = 16) -> list[dict[str, Any]]:
    """Distinct `moments` bodies cycled over the devices (a replay of computed statistics)."""
    rng = np.random.default_rng(0)
    k = s.classes
    return [{"classes": np.arange(k, dtype="<i8"), "counts": rng.integers(5, 60, k).astype("<i8"),
             "mean": rng.standard_normal((k, s.dim)).astype("<f2"), "var": rng.random((k, s.dim)).astype("<f2"),
             "space": "wc", "versions": {"wc": 1}, "session": ""} for _ in range(count)]


class Tally:
    """Rounds received per sender (or per receiver), filled by handlers on the loop thread, which
    only record, as the runtimes' handlers only enqueue."""

    def __init__(self) -> None:
        self.rounds: dict[str, set[int]] = {}
        self.lock = threading.Lock()

    def handler(self, kind: str, receiver: str | None = None):
        def record(topic_: str, env: Envelope) -> None:
            if env.kind == kind:
                with self.lock:
                    self.rounds.setdefault(receiver or env.sender, set()).add(env.round)
        return record

    def total(self) -> int:
        with self.lock:
            return sum(len(r) for r in self.rounds.values())

    def missing(self, sent: dict[str, int]) -> int:
        """Messages 1..sent[x] from each sender x that never arrived."""
        with self.lock:
            return sum(n - len(self.rounds.get(x, set()) & set(range(1, n + 1))) for x, n in sent.items())


class Sampler:
    """RSS, descriptors and connected sessions of this process and the broker, every `every` s."""

    def __init__(self, broker_pid: int | None, devices: list[MqttTransport], every: float = 5.0) -> None:
        self.me = psutil.Process()
        self.broker = psutil.Process(broker_pid) if broker_pid else None
        self.devices, self.every = devices, every
        self.rows: list[dict[str, Any]] = []
        self.peak = {"fds": 0, "broker_fds": 0, "threads": 0}
        self.min_connected: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.start_t = time.monotonic()

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def sample(self) -> dict[str, Any]:
        row = {"t": round(time.monotonic() - self.start_t, 1), "rss": self.me.memory_info().rss,
               "fds": self.me.num_fds(), "threads": self.me.num_threads(),
               "connected": sum(1 for d in self.devices if d.connected)}
        if self.broker is not None:
            row |= {"broker_rss": self.broker.memory_info().rss, "broker_fds": self.broker.num_fds()}
        self.peak["fds"] = max(self.peak["fds"], row["fds"])
        self.peak["broker_fds"] = max(self.peak["broker_fds"], row.get("broker_fds", 0))
        self.peak["threads"] = max(self.peak["threads"], row["threads"])
        self.min_connected = row["connected"] if self.min_connected is None else min(self.min_connected,
                                                                                     row["connected"])
        self.rows.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            row = self.sample()
            log.info("t=%5.0fs rss=%4.0f MB fds=%d connected=%d broker rss=%s MB", row["t"], row["rss"] / 2**20,
                     row["fds"], row["connected"], round(row.get("broker_rss", 0) / 2**20))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def peak_mb(pid: int, sampled: list[int]) -> float:
    """MiB: the larger of the kernel's VmHWM and the highest sampled RSS (as bench/lib/procmem.py)."""
    return round(max([vm_hwm_bytes(pid) or 0, *sampled]) / 2**20, 1)


def cpu_seconds(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    t = proc.cpu_times()
    return round(t.user + t.system, 2)


class Fleet:
    """The edges and devices on one loop, and what they sent and received."""

    def __init__(self, url: str, s: Settings, loop: ClientLoop) -> None:
        self.s, self.url, self.loop = s, url, loop
        self.up, self.down = Tally(), Tally()
        self.edges: list[MqttTransport] = []
        self.devices: list[MqttTransport] = []
        self.sent_up: dict[str, int] = {}
        self.sent_down: dict[str, int] = {}
        self.bodies = stats_bodies(s)

    def edge_of(self, d: int) -> str:
        return f"e{d % self.s.edges}"

    def connect_edges(self) -> None:
        for e in range(self.s.edges):
            self.edges.append(MqttTransport(self.url, client_id=f"{RUN}-edge-e{e}", role="edge", loop=self.loop,
                                            connect_timeout=60))

        def subscribe_members(e: int) -> None:  # as an edge does for each member device
            for d in range(e, self.s.clients, self.s.edges):
                self.edges[e].subscribe(pattern(RUN, "device", f"d{d}", "up"), self.up.handler("moments"))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(subscribe_members, range(self.s.edges)))

    def connect_device(self, d: int) -> MqttTransport:
        me = f"d{d}"
        will = Envelope("status", RUN, 0, me, {"state": "offline", "role": "device"})
        t = MqttTransport(self.url, client_id=f"{RUN}-device-{me}", role="device", loop=self.loop,
                          connect_timeout=120, will=(topic(RUN, "device", me, "up", "status"), will))
        t.subscribe(pattern(RUN, "edge", self.edge_of(d), "down"), self.down.handler("status", receiver=me))
        t.publish_birth(topic(RUN, "device", me, "up", "status"),
                        Envelope("status", RUN, 0, me, {"state": "online", "role": "device"}))
        return t

    def connect_devices(self) -> None:
        with ThreadPoolExecutor(16) as pool:
            self.devices = list(pool.map(self.connect_device, range(self.s.clients)))

    def replay(self, seconds: float) -> None:
        """Each device publishes every period at its own offset; edges send a heartbeat down."""
        n, period, start = self.s.clients, self.s.period, time.monotonic()
        tick = 0
        while True:
            period_start = start + tick * period
            if period_start - start >= seconds:
                return
            for e, edge in enumerate(self.edges):
                self.sent_down[f"e{e}"] = tick + 1
                edge.publish(topic(RUN, "edge", f"e{e}", "down", "status"),
                             Envelope("status", RUN, tick + 1, f"e{e}", {"state": "online", "role": "edge"}))
            for d, device in enumerate(self.devices):
                delay = period_start + d * period / n - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                me = f"d{d}"
                device.publish(topic(RUN, "device", me, "up", "moments"),
                               Envelope("moments", RUN, tick + 1, me, self.bodies[d % len(self.bodies)]))
                self.sent_up[me] = tick + 1
            tick += 1

    def expected_down(self) -> dict[str, int]:
        """Heartbeats each device should have heard: as many as its edge sent."""
        return {f"d{d}": self.sent_down.get(self.edge_of(d), 0) for d in range(self.s.clients)}

    def close(self) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda t: t.close(timeout=10), self.devices + self.edges))


def run(s: Settings) -> dict[str, Any]:
    limit = ensure_fd_limit(s.clients + s.edges + 16)  # before the broker starts: it inherits the limit
    broker = None
    if s.broker is None:
        from splitedge.protocol.broker import MosquittoBroker

        broker = MosquittoBroker(extra_conf=BROKER_CONF, sys_interval=5).start()
    url = s.broker or broker.url
    bproc = psutil.Process(broker.pid) if broker else None
    me = psutil.Process()
    try:
        return _measure(s, url, bproc, me, limit)
    finally:
        if broker is not None:
            broker.stop()


def _measure(s: Settings, url: str, bproc: psutil.Process | None, me: psutil.Process, limit: int) -> dict:
    from splitedge.bench.lib.sysbytes import SysMonitor

    rss_before, cpu0, bcpu0 = me.memory_info().rss, cpu_seconds(me), cpu_seconds(bproc)
    witness = SysMonitor(url, "$SYS/broker/clients/connected")
    with ClientLoop(name="scale-loop") as loop:
        fleet = Fleet(url, s, loop)
        t0 = time.monotonic()
        fleet.connect_edges()
        fleet.connect_devices()
        connect_s = time.monotonic() - t0
        sampler = Sampler(bproc.pid if bproc else None, fleet.devices).start()
        after_connect = sampler.sample()
        log.info("%d devices and %d edges connected in %.1f s", s.clients, s.edges, connect_s)
        cpu1, bcpu1, hold_start = cpu_seconds(me), cpu_seconds(bproc), time.monotonic()
        fleet.replay(s.minutes * 60)
        hold_s = time.monotonic() - hold_start
        sent = sum(fleet.sent_up.values())
        acked = wait_for(lambda: all(d.flush(0) for d in fleet.devices), 60)
        down_expected = fleet.expected_down()
        drained = wait_for(lambda: fleet.up.total() >= sent and fleet.down.total() >= sum(down_expected.values()),
                           60)
        sampler.stop()
        end = sampler.sample()
        cpu2, bcpu2 = cpu_seconds(me), cpu_seconds(bproc)
        broker_connected = [v for ts, v in witness.values if hold_start <= ts <= hold_start + hold_s]
        figures = {
            "clients": s.clients, "edges": s.edges, "hold_seconds": round(hold_s, 1),
            "connect_seconds": round(connect_s, 1),
            "sessions_held": sum(1 for d in fleet.devices if d.connected and d.reconnects == 0),
            "device_reconnects": sum(d.reconnects for d in fleet.devices),
            "min_devices_connected_sampled": sampler.min_connected,
            "broker_clients_connected_min_max": [min(broker_connected, default=None),
                                                 max(broker_connected, default=None)],
            "up": {"sent": sent, "all_acked": acked, "received": fleet.up.total(),
                   "lost": fleet.up.missing(fleet.sent_up)},
            "down": {"sent": sum(fleet.sent_down.values()), "deliveries_expected": sum(down_expected.values()),
                     "received": fleet.down.total(), "lost": fleet.down.missing(down_expected)},
            "drained": drained,
            "rejected": sum(sum(t.rejected.values()) for t in fleet.devices + fleet.edges),
            "duplicates": sum(t.duplicates for t in fleet.devices + fleet.edges),
            "process": {"peak_rss_mb": peak_mb(me.pid, [r["rss"] for r in sampler.rows]),
                        "vm_hwm_mb": round((vm_hwm_bytes(me.pid) or 0) / 2**20, 1),
                        "rss_per_client_kb": round((after_connect["rss"] - rss_before) / (s.clients + s.edges)
                                                   / 1024, 1),
                        "peak_fds": sampler.peak["fds"], "peak_threads": sampler.peak["threads"],
                        "fd_limit": limit, "cpu_s_connect": round(cpu1 - cpu0, 1),
                        "cpu_s_hold": round(cpu2 - cpu1, 1)},
            "broker": None if bproc is None else {
                "peak_rss_mb": peak_mb(bproc.pid, [r["broker_rss"] for r in sampler.rows]),
                "vm_hwm_mb": round((vm_hwm_bytes(bproc.pid) or 0) / 2**20, 1), "peak_fds": sampler.peak["broker_fds"],
                "cpu_s_connect": round(bcpu1 - bcpu0, 1), "cpu_s_hold": round(bcpu2 - bcpu1, 1)},
            "end_sample": end,
        }
        fleet.close()
        witness.close()
        return {"settings": {**asdict(s), "out": str(s.out)}, "figures": figures, "timeline": sampler.rows}


def markdown(result: dict[str, Any], command: str) -> str:
    """The README of a results folder: the command, then the figures in one table."""
    f, s = result["figures"], result["settings"]
    p, b = f["process"], f["broker"] or {}
    rows = [
        ("devices (+ edges) on one ClientLoop, one process", f"{f['clients']} (+ {f['edges']})"),
        ("hold (statistics replay)", f"{f['hold_seconds']:.0f} s, one `moments` message per device every "
                                     f"{s['period']:g} s, QoS 1"),
        ("connect (all clients, incl. SUBACKs and births)", f"{f['connect_seconds']} s"),
        ("sessions held (connected at the end, never reconnected)", f"{f['sessions_held']} / {f['clients']}"),
        ("device reconnects", f["device_reconnects"]),
        ("broker's $SYS clients/connected during the hold (min, max)", f["broker_clients_connected_min_max"]),
        ("up: sent / received / lost", f"{f['up']['sent']} / {f['up']['received']} / {f['up']['lost']}"),
        ("down (edge heartbeats): deliveries expected / received / lost",
         f"{f['down']['deliveries_expected']} / {f['down']['received']} / {f['down']['lost']}"),
        ("rejected / duplicate messages", f"{f['rejected']} / {f['duplicates']}"),
        ("process peak RSS (max of VmHWM and sampled RSS)",
         f"{p['peak_rss_mb']} MiB; {p['rss_per_client_kb']} KiB per client once connected"),
        ("process peak descriptors / threads", f"{p['peak_fds']} / {p['peak_threads']} (soft limit {p['fd_limit']})"),
        ("process CPU: connect / hold", f"{p['cpu_s_connect']} s / {p['cpu_s_hold']} s"),
        ("broker peak RSS (max of VmHWM and sampled RSS)", f"{b.get('peak_rss_mb')} MiB"),
        ("broker peak descriptors", b.get("peak_fds")),
        ("broker CPU: connect / hold", f"{b.get('cpu_s_connect')} s / {b.get('cpu_s_hold')} s"),
    ]
    rows.append(("machine (measured at run time)", machine_line(result.get("machine"))))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# Scale: {f['clients']} device MQTT sessions in one process\n\n"
            f"Command: `{command}`\n\n| what | measured |\n|---|---|\n{table}\n\n{NOTES}")


def machine_facts(load_at_start: list[float]) -> dict[str, Any]:
    """CPU count, RAM and the load average at the start and the end of the run, measured: the
    README states the machine a run had, not a sentence written by hand for one box."""
    m = machine()
    return {"cpu_count": m["cpu_count"], "ram_total_bytes": m["ram_total_bytes"],
            "loadavg_at_start": load_at_start, "loadavg_at_end": m["loadavg_at_end"]}


def machine_line(m: dict[str, Any] | None) -> str:
    """The machine row of the README; a run saved before it was measured says so."""
    if not m:
        return "not recorded by this run"
    ram = f"{m['ram_total_bytes'] / 2**30:.1f} GiB RAM" if m.get("ram_total_bytes") else "RAM unknown"
    load = " / ".join("?" if not v else f"{v[0]:.1f}" for v in (m.get("loadavg_at_start"), m.get("loadavg_at_end")))
    return f"{m['cpu_count']} CPUs, {ram}; load average (1 min) {load} at the start / end"


NOTES = """How to read it:

- Every device is a full `MqttTransport` (last will, retained birth, one subscription to its
  edge's downlink, QoS 1, byte counters, schema checks on receipt) on one `ClientLoop`: one
  socket each and one loop thread for all (the other threads: the publisher, this bench's
  sampler, the $SYS witness). The edges are 20 more transports on the same loop, each
  subscribed to its devices one by one as `splitedge edge` does.
- Up: each device publishes a `moments` message (10 classes, 16 features, fp16 mean and
  variance: a statistics replay, no training) every period, spread evenly over the period;
  lost = messages 1..n of a device its edge never handed to a handler. Down: each edge
  publishes a heartbeat every period; lost = heartbeats a device of that edge never got.
- Sessions held: devices connected at the end with zero reconnects; the broker's own
  `$SYS/broker/clients/connected` (devices + edges + the witness) is the outside check.
- Peak RSS is the larger of the kernel's VmHWM (updated lazily) and RSS sampled every 5 s.
  RSS after connecting (first row of `timeline`) is the cost of the sessions; it then grows
  during the hold (90 to 201 MiB here), slower and slower. tracemalloc on a 300-client run at
  the same message rate (1 s period, 2 minutes: 28 MiB of growth) puts 77% of it in the transports'
  de-duplication caches (`Transport._seen`: topic and msg_id of the last 4,096 messages, per
  transport) and 17% in this bench's own tallies; the rest (6%) is spread thin (imports, paho's
  queues, counters), none of it growing with time in the loop. An
  edge fills its cache within minutes; a device hearing one message per period would take
  hours to fill its own, so a long run with thousands of devices should keep that cache
  smaller (up to ~1 MiB per transport when full).
- CPU: the process's own user + system seconds. Other work on the machine (the load average
  in the table, measured at the start and the end) is not in them but may add latency.
- Broker: a private Mosquitto with `max_connections -1` and `max_queued_messages 10000`; it
  inherits this process's open-file limit, raised first (`ensure_fd_limit`).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--clients", type=int, default=Settings.clients, help="device clients in this process")
    p.add_argument("--minutes", type=float, default=Settings.minutes, help="how long to hold them")
    p.add_argument("--period", type=float, default=Settings.period, help="seconds between a device's messages")
    p.add_argument("--edges", type=int, default=Settings.edges, help="edge-like subscribers")
    p.add_argument("--classes", type=int, default=Settings.classes)
    p.add_argument("--dim", type=int, default=Settings.dim, help="feature dimension of the statistics")
    p.add_argument("--broker", default=None, help="use this broker instead of a private Mosquitto")
    p.add_argument("--out", type=Path, default=Settings.out)
    p.add_argument("--rerender", action="store_true", help="run nothing: rewrite README.md from the JSON in --out")
    args = p.parse_args(argv)
    if args.rerender:
        saved = json.loads((args.out / "scale_clients.json").read_text())
        (args.out / "README.md").write_text(markdown(saved, saved["command"]))
        return 0
    if args.clients < 1 or args.edges < 1 or args.period <= 0 or args.minutes <= 0:
        p.error("--clients and --edges must be >= 1, --period and --minutes > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("splitedge.protocol.mqtt").setLevel(logging.WARNING)  # one line per client otherwise
    s = Settings(**{k: v for k, v in vars(args).items() if k != "rerender"})
    load_at_start = list(os.getloadavg())
    result = run(s)
    result["machine"] = machine_facts(load_at_start)
    command = "python -m splitedge.bench.scale_clients " + " ".join(argv if argv is not None else sys.argv[1:])
    result["command"] = command
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / "scale_clients.json").write_text(json.dumps(result, indent=1))
    (s.out / "README.md").write_text(markdown(result, command))
    sys.stdout.write(markdown(result, command))
    return 0 if result["figures"]["up"]["lost"] == 0 and result["figures"]["down"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
