"""`--metrics-port`: a role's figures in the Prometheus text format, over HTTP (GET /metrics).

The figures are read off the live node when Prometheus scrapes (a custom collector), so the
roles keep no bookkeeping for the endpoint: the round and rounds completed are the node's own,
bytes are its transports' counters (protocol/accounting.py), refusals its `rejections`, memory
and CPU the process's (runtime/cost.py). Every sample carries `role`, `node` and `run`.

prometheus_client is imported only when a port is given, so a thin device without it (and
without torch) runs as before; with the flag and without the package the role stops with one
line naming the extra (splitedge/cli.py `explain`).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psutil

from splitedge.runtime.cost import cpu_seconds, peak_rss_bytes

status = logging.getLogger("splitedge.status")

LABELS = ("role", "node", "run")
DEFAULT_ADDR = "127.0.0.1"  # a scrape from another host is a choice: --metrics-addr 0.0.0.0
SCRAPE_TRIES = 3  # the runtime thread may change a dict while a scrape reads it: read again


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The role's --metrics-port and --metrics-addr."""
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve this node's figures for Prometheus on http://ADDR:PORT/metrics (0: any free port); "
                        "needs pip install 'splitedge[metrics]'")
    p.add_argument("--metrics-addr", default=DEFAULT_ADDR, metavar="ADDR",
                   help="address the metrics endpoint listens on (0.0.0.0: every interface)")


class Family:
    """Builds one metric family with the node's labels (and at most one more, e.g. `rule`)."""

    def __init__(self, base: list[str]) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.base = base
        self.kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

    def __call__(self, kind: str, name: str, doc: str, value: float | None = None, *,
                 label: str | None = None, samples: Iterable[tuple[str, float]] = ()) -> Any:
        """A family with one sample (`value`, none when it is None or NaN), or with `label` one
        sample per (label value, value) in `samples`."""
        family = self.kinds[kind](name, doc, labels=[*LABELS, *([label] if label else [])])
        if value is not None and math.isfinite(value):
            family.add_metric(self.base, float(value))
        for value_of_label, v in samples:
            family.add_metric([*self.base, value_of_label], float(v))
        return family


class NodeCollector:
    """Reads the node at scrape time. Before `attach` (the role still loads data or connects)
    it says only `splitedge_up 0`; once the node stopped, `splitedge_up` is 0 again."""

    def __init__(self, role: str, node_id: str, run: str) -> None:
        self.base = [role, node_id, run]
        self.node: Any = None
        self.transports: list[Any] = []
        self.process = psutil.Process()

    def attach(self, node: Any, transports: Iterable[Any]) -> None:
        """Read `node` from now on; its own tier, id and run label the samples (a peer device's
        run comes from its plan, not --run)."""
        self.transports = list({id(t): t for t in transports}.values())  # an edge's one broker is one connection
        self.base = [node.tier, node.node_id, node.run_id]
        self.node = node

    def describe(self) -> list[Any]:
        return []  # names are not fixed up front; registering must not scrape a node still starting

    def collect(self) -> Iterator[Any]:
        for _ in range(SCRAPE_TRIES - 1):
            try:
                return iter(list(self.families(Family(self.base))))
            except RuntimeError:  # "dictionary changed size during iteration": a round moved on
                pass
        return iter(list(self.families(Family(self.base))))

    def families(self, family: Family) -> Iterator[Any]:
        node = self.node
        running = node is not None and not node.stopped.is_set()
        yield family("gauge", "splitedge_up", "1 while the node runs (0: starting, or stopped)", int(running))
        if node is None:
            return
        yield from self.common(family, node)
        yield from ROLE_FIGURES.get(node.tier, lambda f, n: iter(()))(family, node)

    def common(self, family: Family, node: Any) -> Iterator[Any]:
        """What every role has: round, rounds completed, bytes, refusals, errors, memory, CPU."""
        yield family("gauge", "splitedge_round", "the round the node works on (or last worked on)", node.round)
        yield family("counter", "splitedge_rounds_completed", "rounds finished: the cloud's run (a resumed one's "
                     "too), an edge's or device's training phases in this process", rounds_completed(node))
        for name, direction, what in (("sent", "out", "sent"), ("received", "in", "received")):
            yield family("counter", f"splitedge_{name}_bytes", f"MQTT bytes {what} on the node's own connection(s): "
                         "packets and control, as the broker counts them", self._total(direction, "wire"))
            yield family("counter", f"splitedge_{name}_messages", f"PUBLISH packets {what} on the node's "
                         "connection(s)", self._total(direction, "messages"))
        refused = node.rejections(self.transports)
        yield family("counter", "splitedge_refused_messages", "messages dropped by rule: malformed on the wire, "
                     "or refused before they reached the method's part", label="rule",
                     samples=sorted(refused.items()))
        yield family("counter", "splitedge_errors", "events whose handling raised (logged; the node went on)",
                     node.errors)
        yield family("gauge", "splitedge_process_peak_rss_bytes", "the process's peak resident memory",
                     peak_rss_bytes())
        yield family("gauge", "splitedge_process_rss_bytes", "the process's resident memory now",
                     self.process.memory_info().rss)
        yield family("counter", "splitedge_process_cpu_seconds", "user + system CPU seconds of the process",
                     cpu_seconds(self.process))

    def _total(self, direction: str, field: str) -> int:
        return sum(t.counters.total(direction, field) for t in self.transports)


def rounds_completed(node: Any) -> int:
    """The cloud's are its history (the rounds it committed); an edge or device counts its own."""
    return len(node.history) if node.tier == "cloud" else node.completed


def cloud_figures(family: Family, cloud: Any) -> Iterator[Any]:
    """The last evaluated round's accuracy (and calibrated accuracy), and who joined."""
    evaluated = [h for h in list(cloud.history) if _finite(h.get("accuracy"))]
    last = evaluated[-1] if evaluated else {}
    yield family("gauge", "splitedge_accuracy", "test accuracy of the last evaluated round", last.get("accuracy"))
    yield family("gauge", "splitedge_evaluated_round", "the round splitedge_accuracy belongs to", last.get("round"))
    calibrated = [h for h in list(cloud.history) if _finite(h.get("accuracy_calibrated"))]
    yield family("gauge", "splitedge_accuracy_calibrated", "accuracy of the last calibrated round's head",
                 calibrated[-1]["accuracy_calibrated"] if calibrated else None)
    members = dict(cloud.view.members)
    yield family("gauge", "splitedge_edges_joined", "edges that said hello to this cloud", len(members))
    yield family("gauge", "splitedge_edges_online", "of those, edges whose last status is online", len(cloud.live))
    yield family("gauge", "splitedge_devices_joined", "devices any edge lists", len({d for ds in members.values()
                                                                                   for d in ds}))
    yield family("gauge", "splitedge_devices_online", "devices the online edges list (those a round may draw)",
                 len(cloud.online_devices()))


def edge_figures(family: Family, edge: Any) -> Iterator[Any]:
    """Its devices (joined: said hello; online: last status online) and its last round's close."""
    yield family("gauge", "splitedge_devices_joined", "devices that joined this edge", len(dict(edge.members)))
    yield family("gauge", "splitedge_devices_online", "of those, devices whose last status is online",
                 len(edge.roster.live))
    yield family("gauge", "splitedge_round_devices", "devices whose done the edge's last closed round had",
                 edge.closed_with)


def _finite(value: Any) -> bool:
    """A number to show (a round that was not evaluated has None or NaN; numpy scalars count)."""
    try:
        return not isinstance(value, bool) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


ROLE_FIGURES: dict[str, Callable[[Family, Any], Iterator[Any]]] = {"cloud": cloud_figures, "edge": edge_figures}
"""A role's own figures beside the common ones (a device has none of its own)."""


class MetricsServer:
    """The endpoint of one node: bound before the role loads its data (a port in use stops it
    at once), fed the node once it exists (`attach`), shut down when the role ends (a context
    manager)."""

    def __init__(self, args: argparse.Namespace, role: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = NodeCollector(role, args.id, args.run)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        try:
            self.server, self.thread = start_http_server(args.metrics_port, args.metrics_addr, registry=registry)
        except OSError as exc:
            raise ValueError(f"--metrics-port {args.metrics_port} on {args.metrics_addr}: {exc.strerror or exc}") \
                from exc
        self.port = int(self.server.server_port)
        status.info("%s %s: metrics on http://%s:%d/metrics", role, args.id, args.metrics_addr, self.port)

    def attach(self, node: Any, transports: Iterable[Any]) -> None:
        self.collector.attach(node, transports)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoMetrics:
    """No --metrics-port: the role calls the same methods, nothing is served or imported."""

    def attach(self, node: Any, transports: Iterable[Any]) -> None:
        pass

    def __enter__(self) -> "NoMetrics":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


Endpoint = MetricsServer | NoMetrics
"""What a role's CLI holds while it runs: `attach` its node, whether or not a port was given."""


def serve(args: argparse.Namespace, role: str) -> Endpoint:
    """The node's endpoint when --metrics-port is given; else NoMetrics (prometheus_client unread)."""
    if getattr(args, "metrics_port", None) is None:
        return NoMetrics()
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    return MetricsServer(args, role)
