"""`--metrics-port`: each role serves its figures for Prometheus (GET /metrics).

A live federation of processes (tests/federation.py: one cloud, one edge, two devices on a
private Mosquitto) runs with the endpoint on the cloud, the edge and one device; their scrapes
are parsed with prometheus_client's own parser and checked against what the run did. The
Grafana dashboard and the Prometheus config in deploy/ are checked against those scrapes, so a
renamed metric breaks a test, not a dashboard nobody looks at.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from federation import Federation

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "splitedge-dashboard.json"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ROLES = ("cloud", "e0", "d0")  # the nodes started with --metrics-port
JUNK_TOPIC = "splitedge/itest/device/intruder/up/hello/e0"  # a hello addressed to e0 that is no envelope


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, Any]:
    """family name -> family, parsed from the node's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float | None:
    """The value of the one sample named `sample` whose labels include `labels`, else None."""
    family = families.get(sample.removesuffix("_total"))
    found = [s.value for s in (family.samples if family else []) if s.name == sample
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (sample, found)
    return found[0] if found else None


def exposed_names(families: dict[str, Any]) -> set[str]:
    """Every name a query may use: families, their samples, and a counter's `_total` even with no sample yet."""
    names = {s.name for f in families.values() for s in f.samples} | set(families)
    return names | {f"{n}_total" for n, f in families.items() if f.type == "counter"}


def publish_junk(url: str) -> None:
    """One frame that is no splitedge envelope, to the edge (not retained: nothing lingers)."""
    import paho.mqtt.client as mqtt

    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="metrics-test-junk")
    client.connect(host, int(port))
    client.loop_start()
    try:
        client.publish(JUNK_TOPIC, b"not msgpack at all", qos=1).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


def scrape_until(port: int, ready: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Scrape until `ready(families)` (the node's round moves on between scrapes)."""
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(port)
        if ready(families) or time.monotonic() > deadline:
            return families
        time.sleep(0.3)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, mosquitto: Any) -> dict[str, Any]:
    """Scrapes of the cloud, edge e0 and device d0 after round 1 of a live run, and how the
    processes ended once the cloud was stopped (SIGTERM: it tells everyone it was interrupted)."""
    tmp = tmp_path_factory.mktemp("metrics")
    ports = {name: free_port() for name in ROLES}
    fed = Federation(tmp, mosquitto.url, edges=1, devices=2, rounds=30,
                     extra=["--ic", "2", "--ie", "2", "--deadline", "60"],
                     node_extra={name: ["--metrics-port", str(port)] for name, port in ports.items()})
    try:
        fed.wait_for_round(1, timeout=180)
        publish_junk(mosquitto.url)
        scrapes = {
            "cloud": scrape_until(ports["cloud"], lambda f: value(f, "splitedge_accuracy") is not None),
            "e0": scrape_until(ports["e0"], lambda f: any(f["splitedge_refused_messages"].samples)),
            "d0": scrape_until(ports["d0"], lambda f: (value(f, "splitedge_rounds_completed_total") or 0) >= 1),
        }
        fed.procs["cloud"].send_signal(signal.SIGTERM)
        fed.wait(timeout=90)
        codes = {name: proc.returncode for name, proc in fed.procs.items()}
        logs = {name: fed.log(name) for name in fed.procs}
    finally:
        fed.close()
    return {"scrapes": scrapes, "ports": ports, "codes": codes, "logs": logs}


def test_every_role_serves_its_figures(live: dict[str, Any]) -> None:
    for name, role in (("cloud", "cloud"), ("e0", "edge"), ("d0", "device")):
        families = live["scrapes"][name]
        labels = {"role": role, "node": name, "run": "itest"}
        assert value(families, "splitedge_up", **labels) == 1, (name, live["logs"][name])
        assert value(families, "splitedge_round", **labels) >= 1
        assert value(families, "splitedge_rounds_completed_total", **labels) >= 1
        assert value(families, "splitedge_sent_bytes_total", **labels) > 0
        assert value(families, "splitedge_received_bytes_total", **labels) > 0
        assert value(families, "splitedge_sent_messages_total", **labels) > 0
        assert families["splitedge_refused_messages"].type == "counter"  # present, with or without a refusal
        assert value(families, "splitedge_process_peak_rss_bytes", **labels) >= \
            value(families, "splitedge_process_rss_bytes", **labels) > 10 * 2**20
        assert value(families, "splitedge_process_cpu_seconds_total", **labels) > 0
        assert value(families, "splitedge_errors_total", **labels) == 0


def test_the_cloud_reports_accuracy_and_who_joined(live: dict[str, Any]) -> None:
    cloud = live["scrapes"]["cloud"]
    assert 0.0 <= value(cloud, "splitedge_accuracy") <= 1.0
    assert 1 <= value(cloud, "splitedge_evaluated_round") <= value(cloud, "splitedge_round")
    assert value(cloud, "splitedge_edges_joined") == value(cloud, "splitedge_edges_online") == 1
    assert value(cloud, "splitedge_devices_joined") == value(cloud, "splitedge_devices_online") == 2


def test_the_edge_reports_its_devices_and_refusals_by_rule(live: dict[str, Any]) -> None:
    edge = live["scrapes"]["e0"]
    assert value(edge, "splitedge_devices_online", role="edge") == 2  # the devices started
    assert value(edge, "splitedge_devices_joined", role="edge") == 2
    assert value(edge, "splitedge_round_devices") == 2  # its last round closed with both
    refused = {s.labels["rule"]: s.value for s in edge["splitedge_refused_messages"].samples}
    assert sum(refused.values()) >= 1 and all(s.labels["node"] == "e0" for s in
                                              edge["splitedge_refused_messages"].samples), refused


def test_nodes_stop_cleanly_and_so_does_their_endpoint(live: dict[str, Any]) -> None:
    codes = live["codes"]
    assert codes["cloud"] == 130, live["logs"]["cloud"]  # SIGTERM unwinds like Ctrl-C
    # told that the cloud was interrupted (not that the run finished), they leave with EXIT_INTERRUPTED
    assert all(codes[n] == 75 for n in ("e0", "d0", "d1")), (codes, live["logs"])
    assert all("the cloud was interrupted after round" in live["logs"][n] for n in ("e0", "d0", "d1")), live["logs"]
    for name, port in live["ports"].items():
        with pytest.raises(urllib.error.URLError):
            scrape(port)
        assert f"metrics on http://127.0.0.1:{port}/metrics" in live["logs"][name]


def test_dashboard_queries_only_metrics_the_nodes_expose(live: dict[str, Any]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"\bsplitedge_[a-z_]+\b", e)}
    exposed = set().union(*(exposed_names(f) for f in live["scrapes"].values()))
    assert used and not used - exposed, sorted(used - exposed)
    titles = " ".join(p["title"].lower() for p in panels)
    for wanted in ("accuracy per round", "round progress", "bytes per device", "rss per device", "refusals by rule",
                   "devices online per edge"):
        assert wanted in titles, wanted


def test_prometheus_config_scrapes_each_role() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"splitedge-cloud", "splitedge-edge", "splitedge-device"}
    for job in jobs.values():
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        assert targets and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets), targets


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Prometheus) is not installed; the config's shape is checked above")
    proc = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


THIN_ENDPOINT = """
import json, sys, urllib.request
from types import SimpleNamespace
import numpy as np
import splitedge.device.cli
from splitedge.device.agent import DeviceAgent
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport
from splitedge.runtime import metrics_http
off = metrics_http.serve(SimpleNamespace(metrics_port=None), "device")
assert isinstance(off, metrics_http.NoMetrics) and "prometheus_client" not in sys.modules
t = LoopbackTransport(LoopbackBus(), role="device", client_id="d0")
x, y = np.zeros((4, 8, 8, 1), np.uint8), np.arange(4) % 2
agent = DeviceAgent(t, run="r", node_id="d0", edge="e0", data=(x, y), backend="onnx")
args = SimpleNamespace(metrics_port=0, metrics_addr="127.0.0.1", id="d0", run="r")
with metrics_http.serve(args, "device") as server:
    server.attach(agent, [t])
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
from prometheus_client.parser import text_string_to_metric_families
up = {f.name: f for f in text_string_to_metric_families(text)}["splitedge_up"].samples
assert [(s.labels, s.value) for s in up] == [({"role": "device", "node": "d0", "run": "r"}, 1.0)], up
print(json.dumps([m for m in ("torch", "torchvision") if m in sys.modules]))
"""


def test_the_endpoint_stays_off_the_thin_path() -> None:
    """Without the flag prometheus_client is never imported; with it, a thin device's endpoint pulls in no torch."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(THIN_ENDPOINT)], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_missing_prometheus_client_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from splitedge.cli import main

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as in an install without [metrics]
    code = main(["device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0", "--data", "none.npz",
                 "--metrics-port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("splitedge device needs prometheus_client: pip install 'splitedge[metrics]' "
                                 "(for --metrics-port)"), err


def test_a_port_in_use_is_refused_before_anything_starts(capsys: Any) -> None:
    from splitedge.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["edge", "--broker", "mqtt://127.0.0.1:1", "--id", "e0", "--metrics-port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"splitedge edge: error: --metrics-port {port} on 127.0.0.1:"), err
