"""`splitedge watch`: a read-only view of a run from its broker.

The model (splitedge/watch_state.py) is pure, so most of it is checked by feeding it envelopes
made with the codec; then a real sim on Mosquitto is watched by the CLI (--plain in a process,
--once in this one) and by the model subscribed directly, and a device killed with SIGKILL
shows as left. The generated ACL gives the watcher login read access and nothing else.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitedge.protocol.acl import federation_acl
from splitedge.protocol.codec import Envelope, decode, encode
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import wait_for
from splitedge.runtime.records import wire_metrics
from splitedge.watch_cli import Watcher, filters, render_rich, render_text
from splitedge.watch_state import WatchState, headline, tables

RUN = "w"


# -- helpers ---------------------------------------------------------------------------------

def feed(state: WatchState, tier: str, node: str, direction: str, kind: str, body: dict[str, Any], *,
         round_: int = 0, now: float = 1000.0, to: str | None = None) -> list[str]:
    """Encode and decode an envelope as the wire would, then hand it to the model."""
    env = decode(encode(Envelope(kind=kind, run=RUN, round=round_, sender=node, body=body)))
    return state.apply(topic(RUN, tier, node, direction, kind, to), env, now)


def status(state: WatchState, tier: str, node: str, online: bool, now: float = 1000.0) -> list[str]:
    return feed(state, tier, node, "up", "status", {"state": "online" if online else "offline", "role": tier}, now=now)


def hello(state: WatchState, tier: str, node: str, parent: str, members: list[str] | None = None) -> list[str]:
    body = {"role": tier, "parent": parent, "samples": 100, "backend": "torch",
            "classes": np.arange(3, dtype=np.int64), "members": members or []}
    return feed(state, tier, node, "up", "hello", body)


def announce(state: WatchState, tier: str, node: str, r: int, *, phase: str = "train", stop: bool = False,
             participants: list[str] | None = None, session: str = "ab") -> list[str]:
    body = {"method": "fedavg", "session": session, "deadline_s": 60.0, "versions": {}, "config": {},
            "phase": phase, "stop": stop, "participants": participants or []}
    return feed(state, tier, node, "down", "round", body, round_=r)


def done(state: WatchState, tier: str, node: str, r: int, info: dict[str, Any], phase: str = "round") -> list[str]:
    return feed(state, tier, node, "up", "done", {"phase": phase, "info": info}, round_=r)


def cost(up: float, down: float, rss: float = 100.0) -> dict[str, float]:
    return {"cpu_s": 0.5, "bytes_up": float(up), "bytes_down": float(down), "rss_peak_mb": rss}


def federation() -> WatchState:
    """A cloud, edges e0 (d0, d1) and e1 (d2), everyone online, round 1 open at both edges."""
    state = WatchState(RUN)
    for tier, node in (("cloud", "cloud"), ("edge", "e0"), ("edge", "e1"), ("device", "d0"), ("device", "d1"),
                       ("device", "d2")):
        status(state, tier, node, True)
    hello(state, "edge", "e0", "cloud", ["d0", "d1"])
    hello(state, "edge", "e1", "cloud", ["d2"])
    for d, e in (("d0", "e0"), ("d1", "e0"), ("d2", "e1")):
        hello(state, "device", d, e)
    announce(state, "cloud", "cloud", 1)
    announce(state, "edge", "e0", 1)
    announce(state, "edge", "e1", 1)
    return state


def rows(state: WatchState, title: str) -> list[tuple[str, ...]]:
    return next(t.rows for t in tables(state) if t.title.startswith(title))


# -- the model -------------------------------------------------------------------------------

def test_online_offline_and_who_left_when() -> None:
    state = federation()
    # a retained offline found at start has no time; a status seen changing has one
    status(state, "device", "d9", False)
    lines = status(state, "device", "d1", False, now=1234.0)
    assert lines == ["device d1 left"]
    assert state.left == [(None, "device", "d9"), (1234.0, "device", "d1")]
    assert state.node("device", "d1").state == "offline" and state.node("device", "d1").since == 1234.0
    left = dict((node, when) for when, node in rows(state, "Left"))
    assert left["device d9"] == "before the watch" and left["device d1"] == time.strftime(
        "%H:%M:%S", time.localtime(1234.0))
    assert status(state, "device", "d1", True) == ["device d1 back online"]
    assert status(state, "device", "d1", True) == []  # the same word again is no event


def test_hello_lines_say_what_changed_for_people() -> None:
    state = WatchState(RUN)
    assert hello(state, "edge", "e0", "cloud", []) == ["edge e0: 0 device(s) live ()"]
    assert hello(state, "edge", "e0", "cloud", ["d0"]) == ["edge e0: 1 device(s) live (d0)"]
    body = {"role": "edge", "parent": "cloud", "samples": 150, "backend": "torch",
            "classes": np.arange(3, dtype=np.int64), "members": ["d0"]}
    assert feed(state, "edge", "e0", "up", "hello", body) == []  # its samples changed, its devices did not
    assert hello(state, "device", "d0", "e0") == ["device d0 reports to e0 (100 samples, torch)"]
    assert hello(state, "device", "d0", "e0") == [] and state.edge_of(state.node("device", "d0")) == "e0"


def test_round_progress_is_devices_done_of_those_awaited_at_each_edge() -> None:
    state = federation()
    assert state.progress(state.node("edge", "e0")) == (0, 2)
    lines = done(state, "device", "d0", 1, {"samples": 100, "cost": cost(2000, 5000)})
    assert lines == ["device d0 done round 1 (up 2.0 kB, down 5.0 kB)"]
    assert state.progress(state.node("edge", "e0")) == (1, 2)
    done(state, "device", "d1", 1, {"cost": cost(1, 1)})
    assert state.progress(state.node("edge", "e0")) == (2, 2)
    edges = {r[0]: r for r in rows(state, "Edges")}
    assert edges["e0"][1:5] == ("online", "2/2", "1", "2/2 done") and edges["e1"][4] == "0/1 done"
    lines = done(state, "edge", "e0", 1, {"devices": {"reported": 2}, "seconds": 0.4})
    assert lines == ["edge e0 closed round 1 with 2 device(s) in 0.4 s"]
    assert {r[0]: r[4] for r in rows(state, "Edges")}["e0"] == "closed"
    assert state.rounds[1].edges_done == {"round": {"e0"}}
    # a round that draws devices awaits only those; a calibration phase is its own unit of work
    announce(state, "cloud", "cloud", 2, participants=["d1"])
    announce(state, "edge", "e0", 2, participants=["d1"])
    assert state.progress(state.node("edge", "e0")) == (0, 1)
    assert announce(state, "cloud", "cloud", 2, phase="calibrate") == ["round 2 calibrate opened (fedavg, every "
                                                                       "online device)"]
    announce(state, "edge", "e0", 2, phase="calibrate")
    done(state, "device", "d0", 2, {}, phase="calibrate")
    assert state.progress(state.node("edge", "e0")) == (1, 2)
    assert state.current.number == 2 and state.current.phases == ["train", "calibrate"]
    assert announce(state, "cloud", "cloud", 2, phase="calibrate") == []  # retained again after a reconnect


def test_costs_add_up_per_device_from_its_own_done_and_from_its_edge_s() -> None:
    state = federation()
    done(state, "device", "d0", 1, {"cost": cost(1000, 3000, rss=120)})
    # d0's cost again in its edge's done (same round: not counted twice), and d2's only there
    # (a device whose topics stay on its edge site's broker)
    done(state, "edge", "e0", 1, {"devices": {"reported": 1, "cost": {"d0": cost(1000, 3000, rss=120)}}})
    done(state, "edge", "e1", 1, {"devices": {"reported": 1, "cost": {"d2": cost(700, 900)}}})
    done(state, "device", "d0", 2, {"cost": cost(500, 100, rss=150)})
    d0 = state.node("device", "d0").cost_total()
    assert d0 == {"cpu_s": 1.0, "bytes_up": 1500.0, "bytes_down": 3100.0, "rss_peak_mb": 150.0}
    assert state.node("device", "d2").cost_total()["bytes_up"] == 700.0
    devices = {r[0]: r for r in rows(state, "Devices")}
    assert devices["d0"][1:] == ("e0", "online", "2", "1.5 kB", "3.1 kB", "1.0", "150")
    assert devices["d2"][4] == "700 B" and devices["d1"][4] == "-"


def test_accuracy_per_round_from_the_cloud_s_metrics_and_the_stop() -> None:
    state = federation()
    body = wire_metrics({"round": 1, "accuracy": np.float64(0.8125), "edges": 2, "participants": 3,
                         "round_seconds": 1.5, "loss": {"device": {"total": 1.0}}, "calibrated": True,
                         "effective_rank": float("nan")})
    assert body == {"accuracy": 0.8125, "edges": 2, "participants": 3, "round_seconds": 1.5}
    lines = feed(state, "cloud", "cloud", "up", "metrics", body, round_=1)
    assert lines == ["round 1 closed: accuracy 0.8125"] and state.rounds[1].accuracy == 0.8125
    assert rows(state, "Rounds") == [("1", "train", "-", "0.8125", "1.5", "all")]
    assert "accuracy 0.8125 (round 1)" in headline(state) and "round 1 train" in headline(state)
    assert announce(state, "cloud", "cloud", 2, stop=True) == ["run stopped after round 1"]
    assert "stopped" in headline(state)


def test_refusals_by_rule_from_the_done_infos_and_the_watcher_s_own() -> None:
    state = federation()
    done(state, "device", "d0", 1, {"refused": {"session.foreign": 2}})
    done(state, "edge", "e0", 1, {"refused": {"session.foreign": 1, "schema.type": 4}, "devices": {"refused": {
        "session.foreign": 2}}})  # its devices' sum: d0 said it already
    state.undecodable = {"frame.invalid": 3}
    assert state.refusals() == {"schema.type": (4, ["e0"]), "session.foreign": (3, ["d0", "e0"])}
    assert rows(state, "Refusals") == [("schema.type", "4", "e0"), ("session.foreign", "3", "d0, e0"),
                                       ("frame.invalid (this watcher)", "3", "not decoded here")]


def test_a_new_session_starts_the_round_figures_again() -> None:
    state = federation()
    done(state, "device", "d0", 1, {"cost": cost(10, 10)})
    lines = announce(state, "cloud", "cloud", 1, session="cd")
    assert lines[0].startswith("new session cd (was ab)") and lines[1].startswith("round 1 train opened")
    assert state.node("device", "d0").costs == {} and list(state.rounds) == [1]


def test_other_runs_and_foreign_topics_are_ignored() -> None:
    state = WatchState(RUN)
    env = Envelope(kind="status", run="other", round=0, sender="d0", body={"state": "online", "role": "device"})
    assert state.apply(topic("other", "device", "d0", "up", "status"), env, 1.0) == []
    assert state.apply("elsewhere/x", env, 1.0) == [] and state.ignored == {"run": 1, "topic": 1} and not state.nodes


def test_both_renderers_draw_every_table() -> None:
    from rich.console import Console

    state = federation()
    done(state, "device", "d0", 1, {"cost": cost(1000, 3000)})
    status(state, "device", "d1", False, now=1234.0)
    text = render_text(headline(state), tables(state))
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(render_rich(headline(state), tables(state)))
    drawn = console.export_text()
    for out in (text, drawn):
        assert "run w" in out and all(t in out for t in ("Edges", "Devices", "Rounds", "Refusals", "Left"))
        assert "d0" in out and "1.0 kB" in out


def test_the_watcher_subscribes_to_what_it_reads_or_to_everything() -> None:
    assert filters("r") == ["splitedge/r/+/+/up/status", "splitedge/r/+/+/up/hello", "splitedge/r/+/+/down/round",
                            "splitedge/r/+/+/up/done", "splitedge/r/cloud/+/up/metrics"]
    assert filters("r", everything=True) == ["splitedge/r/#"]


def test_the_generated_acl_lets_the_watcher_read_the_run_and_write_nothing() -> None:
    text = federation_acl("r", {"d0": "e0"})
    block = text.split("\nuser watcher\n", 1)[1].strip().splitlines()
    assert block == ["topic read splitedge/r/#"]
    assert "user watcher" not in federation_acl("r", {"d0": "e0"}, watcher=None)
    with pytest.raises(ValueError, match="own login"):
        federation_acl("r", {"watcher": "e0"})


# -- on a broker -----------------------------------------------------------------------------

def test_a_sim_watched_live_shows_its_edges_devices_rounds_costs_and_accuracy(mosquitto, tmp_path: Path,
                                                                               capsys) -> None:
    import torch

    from splitedge.cli import main
    from splitedge.sim import SimSettings, run_sim

    # Arrange: the CLI with --plain in a process of its own, and the model subscribed here
    torch.set_num_threads(1)
    run = "watch-e2e"
    plain = subprocess.Popen([sys.executable, "-m", "splitedge", "watch", "--broker", mosquitto.url, "--run", run,
                              "--plain"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    watcher = Watcher(mosquitto.url, run)
    try:
        time.sleep(1.5)  # the subprocess subscribes before the run starts
        # Act
        summary = run_sim(SimSettings(rounds=3, devices=4, edges=2, method="fedavg", broker=mosquitto.url, run=run,
                                      out=tmp_path / "run", max_train=300, max_test=100, deadline_s=60.0))
        assert wait_for(lambda: watcher.state.stopped is not None and 3 in watcher.state.rounds
                        and watcher.state.rounds[3].accuracy is not None, 10)
        head, tabs = watcher.snapshot()
    finally:
        watcher.close()
        plain.send_signal(signal.SIGTERM)
        out, err = plain.communicate(timeout=20)
    # Assert: the model saw both edges, every device, rounds 1..3 closing with their accuracy
    state = watcher.state
    assert [e.node_id for e in state.tier("edge")] == ["e0", "e1"]
    assert [d.node_id for d in state.tier("device")] == ["d0", "d1", "d2", "d3"]
    for r in (1, 2, 3):
        assert state.rounds[r].edges_done["round"] == {"e0", "e1"}
        assert state.rounds[r].accuracy == pytest.approx(summary["accuracy_per_round"][r - 1])
    for d in state.tier("device"):
        total = d.cost_total()
        assert total["bytes_up"] > 0 and total["bytes_down"] > 0 and total["rss_peak_mb"] > 0, d.node_id
        assert d.done >= {(1, "round"), (2, "round"), (3, "round")}
    assert f"accuracy {summary['final_accuracy']:.4f} (round 3)" in head and "stopped" in head
    assert not state.undecodable
    # ... the plain log said it line by line, each with its time, and ended quietly on SIGTERM
    assert plain.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(f"watching run {run} on {mosquitto.url}")
    for said in ("edge e0 online", "device d3 reports to e1", "round 1 train opened (fedavg, every online device)",
                 "device d2 done round 2 (up ", "edge e1 closed round 3 with 2 device(s)", "round 3 closed: accuracy ",
                 "run stopped after round 3", "device d0 left"):
        assert any(said in line for line in lines), (said, out[-3000:])
    assert all(line[:4].isdigit() and line[10] == " " for line in lines)
    # ... and --once, after the run, prints what the broker keeps: every node left, the last accuracy
    assert main(["watch", "--broker", mosquitto.url, "--run", run, "--once", "1"]) == 0
    snapshot = capsys.readouterr().out
    print(snapshot)
    assert f"accuracy {summary['final_accuracy']:.4f} (round 3)" in snapshot
    assert all(node in snapshot for node in ("e0", "e1", "d0", "d3")) and "Left" in snapshot


_DEVICE = textwrap.dedent("""
    import sys, time
    import numpy as np
    from splitedge.protocol.codec import Envelope
    from splitedge.protocol.topics import topic
    from splitedge.runtime.session import connect
    url, run = sys.argv[1], sys.argv[2]
    t = connect(url, run=run, tier="device", node_id="d9")
    t.publish_birth(topic(run, "device", "d9", "up", "status"),
                    Envelope("status", run, 0, "d9", {"state": "online", "role": "device"}))
    t.publish(topic(run, "device", "d9", "up", "hello"),
              Envelope("hello", run, 0, "d9", {"role": "device", "parent": "e0", "samples": 5, "backend": "onnx",
                                               "classes": np.arange(2, dtype=np.int64)}), retain=True, wait=5)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_killed_device_shows_as_left_when_its_will_fires(mosquitto) -> None:
    run = "watch-kill"
    device = subprocess.Popen([sys.executable, "-c", _DEVICE, mosquitto.url, run], stdout=subprocess.PIPE, text=True)
    watcher = Watcher(mosquitto.url, run)
    try:
        assert device.stdout.readline().strip() == "ready"
        assert wait_for(lambda: watcher.state.node("device", "d9").state == "online", 10)
        killed = time.time()
        device.send_signal(signal.SIGKILL)  # no clean exit: the broker publishes its will
        device.wait(10)
        assert wait_for(lambda: watcher.state.node("device", "d9").state == "offline", 10)
        head, tabs = watcher.snapshot()
    finally:
        watcher.close()
        if device.poll() is None:
            device.kill()
    d9 = watcher.state.node("device", "d9")
    assert d9.since is not None and killed <= d9.since <= time.time() and d9.parent == "e0"
    assert watcher.state.left == [(d9.since, "device", "d9")]
    left = next(t for t in tabs if t.title == "Left")
    assert left.rows == [(time.strftime("%H:%M:%S", time.localtime(d9.since)), "device d9")]
    devices = next(t for t in tabs if t.title.startswith("Devices"))
    assert devices.rows[0][:3] == ("d9", "e0", f"left {left.rows[0][0]}")


def test_the_watcher_stays_thin() -> None:
    """A watcher runs where an operator is (a laptop, a thin site box): no torch, no methods."""
    code = ("import sys, splitedge.watch_cli, splitedge.watch_state; "
            "print([m for m in ('torch', 'splitedge.methods', 'splitedge.runtime') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
