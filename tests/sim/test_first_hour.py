"""The mistakes of a first hour get one line that says what to fix, before any work starts, and
a non-zero exit; nothing is overwritten or left half-written (issue "the first hour")."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from parts import SPEC, env
from splitedge.cli import main
from splitedge.runtime.outputs import LOCK, RunFolder, dumps
from splitedge.methods.config import RunConfig
from splitedge.methods.fedavg.config import FedAvgConfig
from splitedge.methods.contract import RoundPlan


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own refusals (an unknown flag) end the process this way
        code = int(exc.code)
    err = capsys.readouterr().err.strip()
    return code, err


def _shard(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, x=x, y=y)
    return path


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--rounds", "-1"], "--rounds must be >= 1, got -1"),
    (["--alpha", "-1"], "--alpha must be > 0"),
    (["--backends", "torch,tpu"], "--backends takes a comma list of torch, onnx"),
    (["--set", "ic=0"], "hsfp settings: ic must be >= 1, ie >= 0"),
    (["--set", "ic=two"], "ic: cannot read 'two' as int"),
    (["--set", "no_such=1"], "unknown setting(s) ['no_such']"),
    (["--data", "x.tar.gz"], "--data is read only with --dataset cifar10"),
    (["--dataset", "cifar10", "--data", "/nonexistent/cifar.tar.gz"], "no such file or folder"),
    (["--devices", "4000"], "more than the 3100 one process is measured to hold: give the devices worker "
                            "processes (--workers 2 or more"),
    (["--virtual", "-1"], "--virtual must be >= 0"),
    (["--split", "per-device", "--workers", "9"], "--workers must be in 0..--devices"),
    (["--deadline", "0"], "--deadline must be > 0"),
    (["--round", "2"], "splitedge sim: error: unrecognized arguments: --round 2; did you mean --rounds? "
                       "(see splitedge sim --help)"),  # no abbreviation taken, and the nearest flag named
    (["--sample-fraction", "0"], "--sample-fraction must be in (0, 1]"),
])
def test_sim_refuses_bad_values_at_once(argv: list[str], message: str, capsys, tmp_path) -> None:
    started = time.monotonic()
    code, err = _run(capsys, "sim", "--out", str(tmp_path / "o"), *argv)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert time.monotonic() - started < 5  # before any data is loaded
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--edge", "1"], "unrecognized arguments: --edge 1; did you mean --edges?"),  # no abbreviation taken
    (["--devices", "0"], "--devices >= 1"),  # a round with nobody trains nothing
    (["--edges", "5", "--devices", "2"], "3 edge(s) would have no device"),
])
def test_cloud_refuses_bad_values_at_once(argv: list[str], message: str, capsys) -> None:
    code, err = _run(capsys, "cloud", "--broker", "mqtt://127.0.0.1:1", *argv)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("make, message", [
    (lambda p: _shard(p, np.zeros((4, 8, 8, 1), np.float32), np.arange(4)), "uint8 images [N,H,W,C], got"),
    (lambda p: _shard(p, np.zeros((4, 8, 8), np.uint8), np.arange(4)), "uint8 images [N,H,W,C], got"),
    (lambda p: _shard(p, np.zeros((0, 8, 8, 1), np.uint8), np.zeros(0, np.int64)), "empty (no images)"),
    (lambda p: _shard(p, np.zeros((4, 8, 8, 1), np.uint8), np.arange(3)), "4 images but labels of shape (3,)"),
    (lambda p: (np.savez(p, x=np.zeros((4, 8, 8, 1), np.uint8)), p)[1], "no array 'y'"),
    (lambda p: (p.write_text("not a zip"), p)[1], "shard.npz: not an .npz shard (not a zip archive"),
    (lambda p: p, "no such file or folder"),
])
def test_device_refuses_unusable_data_before_connecting(make, message: str, capsys, tmp_path) -> None:
    path = make(tmp_path / "shard.npz")
    code, err = _run(capsys, "device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0",
                     "--data", str(path), "--backend", "onnx")
    assert code == 2 and message in err and len(err.splitlines()) == 1, err  # no connect was tried (port 1)


@pytest.mark.parametrize("x, y, message", [
    (np.zeros((4, 16, 16, 1), np.uint8), np.arange(4), "takes 8x8 images with 1 channel(s) but this device has 16x16"),
    (np.zeros((4, 8, 8, 1), np.uint8), np.array([0, 1, 2, 51]), "label 51 is outside the run's 10 classes"),
])
def test_device_whose_data_cannot_fit_the_model_says_why_and_stops(x, y, message: str) -> None:
    from splitedge.device.agent import DeviceAgent
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    agent = DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                        edge="e0", data=(x, y))
    plan = RoundPlan(round=1, method="fedavg", deadline_s=10.0, config=RunConfig(SPEC, FedAvgConfig()).to_wire())
    agent.handle("splitedge/r/edge/e0/down/round", env("round", plan.to_body(), "e0", 1))
    assert agent.stopped.is_set() and agent.part is None and message in agent.fatal


def test_a_thin_device_in_a_torch_only_method_says_why_and_stops() -> None:
    """It used to log "fedprox has no device part for backend 'onnx'" every round, counted as
    joined, while every round waited for it to its deadline."""
    from splitedge.methods.fedprox.method import FedProxConfig
    from splitedge.device.agent import DeviceAgent
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    agent = DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                        edge="e0", data=(np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)), backend="onnx")
    plan = RoundPlan(round=1, method="fedprox", deadline_s=10.0, config=RunConfig(SPEC, FedProxConfig()).to_wire())
    agent.handle("splitedge/r/edge/e0/down/round", env("round", plan.to_body(), "e0", 1))
    assert agent.stopped.is_set() and agent.part is None
    assert "fedprox has no device part for backend 'onnx'" in agent.fatal and "--backend torch" in agent.fatal


def test_an_edge_without_torch_in_a_torch_method_says_why_and_stops(monkeypatch) -> None:
    """A thin-install edge used to print "up", join its devices, then a traceback (`No module named
    'torch'`) every round. What a thin install raises is simulated where the part is built."""
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.methods.fedavg.method import FedAvg
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    def no_torch(self, ctx):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(FedAvg, "edge_part", no_torch)
    edge = EdgeAggregator(LoopbackTransport(LoopbackBus(), role="edge", client_id="e0"), run="r", node_id="e0")
    plan = RoundPlan(round=1, method="fedavg", deadline_s=10.0, config=RunConfig(SPEC, FedAvgConfig()).to_wire())
    edge.handle("splitedge/r/cloud/cloud/down/round", env("round", plan.to_body(), "cloud", 1))
    assert edge.stopped.is_set() and edge.part is None
    assert edge.fatal == ("edge e0: fedavg's edge part needs torch, which this install lacks: "
                          "pip install 'splitedge[all]'")


def test_out_holding_a_run_is_refused_unless_overwrite_and_one_writer_at_a_time(tmp_path) -> None:
    out = tmp_path / "run"
    with RunFolder(out):
        (out / "metrics.jsonl").write_text("{}\n")
        with pytest.raises(ValueError, match="in use by another run"):
            RunFolder(out).__enter__() if _other_pid_lock(out) else None
    with pytest.raises(ValueError, match="holds a previous run .*--overwrite"):
        RunFolder(out).__enter__()
    with RunFolder(out, overwrite=True):
        assert not (out / "metrics.jsonl").exists()
    assert not (out / LOCK).exists()
    with RunFolder(tmp_path / "empty"):
        pass
    assert not (tmp_path / "empty").exists()  # a run that wrote nothing leaves no folder


def _other_pid_lock(out: Path) -> bool:
    """Make the lock look held by another live process (pid 1 is always alive)."""
    (out / LOCK).write_text("1")
    return True


def test_json_outputs_never_carry_nan() -> None:
    text = dumps({"final_accuracy": float("nan"), "per_round": [0.5, float("inf")], "n": np.float32(2.5)})
    assert json.loads(text) == {"final_accuracy": None, "per_round": [0.5, None], "n": 2.5}


def test_broker_on_a_taken_port_is_one_line(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = _run(capsys, "broker", "--port", str(s.getsockname()[1]))
    assert code == 2 and "another broker may be running there" in err and len(err.splitlines()) == 1


def test_help_shows_defaults_and_version(capsys) -> None:
    from splitedge.protocol.codec import PROTOCOL_VERSION

    for argv in (["--version"], ["edge", "--version"], ["device", "--version"]):  # no other flag needed
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert out.startswith("splitedge ") and f"wire protocol {PROTOCOL_VERSION}" in out, (argv, out)
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    assert "(default: 4)" in capsys.readouterr().out


def test_a_second_node_with_a_live_id_is_refused_and_a_join_timeout_stops_the_waiting(mosquitto, tmp_path,
                                                                                      capsys) -> None:
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.runtime.session import check_identity_free, connect

    # Prepare: edge e0 of run "hour" is up and listening
    transport = connect(mosquitto.url, run="hour", tier="edge", node_id="e0")
    edge = EdgeAggregator(transport, run="hour", node_id="e0")
    edge.start()
    thread = threading.Thread(target=edge.run_forever, daemon=True)
    thread.start()
    try:
        # Execute / Assert: a second e0 is refused; a free id is not
        with pytest.raises(ValueError, match="another edge with id 'e0' is online in run 'hour'"):
            check_identity_free(mosquitto.url, run="hour", tier="edge", node_id="e0")
        check_identity_free(mosquitto.url, run="hour", tier="edge", node_id="e1")
        # a cloud that waits for 2 edges gives up, says so in one line, and tells e0 to stop
        code, err = _run(capsys, "cloud", "--broker", mosquitto.url, "--run", "hour", "--edges", "2",
                         "--devices", "2", "--join-timeout", "2", "--rounds", "1")
        assert code == 1 and "joined within 2 s" in err and len(err.splitlines()) == 1, err
        thread.join(10)
        assert edge.stopped.is_set()
    finally:
        edge.stop()
        transport.close(offline=True)
    # and once e0 is gone (clean exit: status offline), its id is free again
    check_identity_free(mosquitto.url, run="hour", tier="edge", node_id="e0")


def test_an_interrupted_sim_keeps_valid_json_marked_interrupted(tmp_path) -> None:
    from splitedge.sim import SimSettings, run_sim

    def stop_after_first(record: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sim(SimSettings(rounds=3, devices=2, edges=1, out=tmp_path / "run"), on_round=stop_after_first)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_done"] == 1
    assert not (tmp_path / "run" / LOCK).exists()


def test_a_run_without_any_evaluation_exits_non_zero(tmp_path, capsys) -> None:
    import ring_method  # noqa: F401 - registers "ring-test", a method that reports no accuracy

    code, err = _run(capsys, "sim", "--method", "ring-test", "--rounds", "1", "--devices", "2", "--edges", "1",
                     "--max-train", "40", "--out", str(tmp_path / "run"))
    assert code == 1 and "no round produced an evaluation: devices took part (up to 2 a round)" in err
    assert "above" not in err  # the line says why itself
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_accuracy"] is None


def test_why_no_round_was_evaluated_is_told_from_the_records() -> None:
    from splitedge.runtime.outputs import why_unevaluated

    assert why_unevaluated([]) == "no round ran"
    empty = {"edges": 0, "participants": 0, "rejected": {"cloud": {}}}
    assert why_unevaluated([empty, empty]) == "no edge reported in any of the 2 rounds"
    idle = {"edges": 2, "participants": 0, "rejected": {"e0": {"state.shape": 3}, "e1": {"state.shape": 1}}}
    assert why_unevaluated([idle]) == ("no device took part in any of the 1 rounds (2 edges reported); "
                                       "refused messages: state.shape x4")


def test_every_option_of_every_command_says_what_it_does() -> None:
    from splitedge.cli import build_parser

    parser = build_parser()
    (commands,) = parser._subparsers._group_actions
    undocumented = [f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
                    for name, sub in commands.choices.items() for a in sub._actions
                    if not a.help and a.dest != "help"]
    assert undocumented == []


def test_every_model_option_names_every_registered_model() -> None:
    from splitedge.cli import build_parser
    from splitedge.models import list_models

    (commands,) = build_parser()._subparsers._group_actions
    helps = {name: a.help for name, sub in commands.choices.items() for a in sub._actions if "--model" in a.option_strings}
    assert helps and all(all(m in h for m in list_models()) for h in helps.values()), helps


@pytest.mark.parametrize("content", [b"hello, not a tarball", None])
def test_a_broken_cifar_archive_is_one_line(content, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPLITEDGE_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "cifar.tar.gz"
    real = Path(__file__).resolve().parents[3] / "shared" / "data" / "cifar10-jpeg.tar.gz"
    archive.write_bytes(content if content is not None else real.read_bytes()[:200_000])  # or a truncated copy
    code, err = _run(capsys, "sim", "--dataset", "cifar10", "--data", str(archive), "--out", str(tmp_path / "o"))
    assert code == 2 and "not a readable CIFAR-10 archive" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_an_unreachable_broker_is_one_line_and_leaves_no_folder(tmp_path, capsys) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = _run(capsys, "sim", "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", "1", "--out",
                     str(tmp_path / "o"))
    assert code == 1 and "cannot connect to the MQTT broker" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_missing_extra_names_it_and_a_device_without_torch_is_pointed_at_onnx(capsys, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "amqtt", None)  # as in the base install: `import amqtt` fails
    monkeypatch.setitem(sys.modules, "amqtt.broker", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["broker", "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip() == "splitedge broker needs amqtt: pip install 'splitedge[all]'", err
    assert "listening" not in out
    from splitedge.cli import explain

    code, text = explain(ModuleNotFoundError("No module named 'torch'", name="torch"), "device")
    assert code == 2 and text.endswith("a device without torch runs with --backend onnx")


def test_device_backend_auto_is_torch_where_installed_else_onnx(monkeypatch) -> None:
    import importlib.util

    from splitedge.device.cli import resolve_backend

    assert resolve_backend("auto") == "torch" and resolve_backend("onnx") == "onnx"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert resolve_backend("auto") == "onnx" and resolve_backend("torch") == "torch"


def test_bench_without_out_writes_a_new_folder_never_the_committed_results(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "throughput", "--quick", "--no-plots"]) == 0
    (made,) = (tmp_path / "runs" / "bench").iterdir()
    assert made.name.startswith("throughput-") and (made / "throughput.json").exists()
    assert not (tmp_path / "bench").exists()


def test_bench_refuses_missing_data_before_any_work(capsys, tmp_path) -> None:
    # every suite that spawns nodes passes --data on; a missing one is one line, up front
    code, err = _run(capsys, "bench", "ram", "--dataset", "cifar10", "--data", str(tmp_path / "nope.tar.gz"),
                     "--out", str(tmp_path / "o"))
    assert code == 2 and "no such file or folder" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_sigterm_stops_a_bench_and_the_broker_it_started(tmp_path) -> None:
    """`kill` (SIGTERM) unwinds like Ctrl-C: a bench's own Mosquitto does not outlive it."""
    import signal
    import subprocess
    import sys

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "splitedge", "bench", "throughput", "--quick", "--no-plots",
                             "--out", str(tmp_path / "o")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, brokers = time.monotonic() + 60, []
        while not brokers and time.monotonic() < deadline and proc.poll() is None:
            brokers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "mosquitto" in c.name()]
            time.sleep(0.2)
        assert brokers, "the bench never started its Mosquitto"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 130, proc.stderr.read().decode()
        assert "interrupted" in proc.stderr.read().decode()
        gone, alive = psutil.wait_procs(brokers, timeout=10)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_cloud_whose_every_device_left_stops_instead_of_running_rounds_with_nobody(tmp_path) -> None:
    """A thin device in a fedprox run leaves at round 1 (it says why); it was the only one, and
    the cloud used to run every round with nobody and end at chance with exit 0."""
    from federation import Federation
    from splitedge.protocol.broker import MosquittoBroker

    with MosquittoBroker() as broker:
        fed = Federation(tmp_path, broker.url, edges=1, devices=1, rounds=3,
                         extra=["--method", "fedprox", "--deadline", "10", "--rejoin-timeout", "5"],
                         node_extra={"d0": ["--backend", "onnx"]})
        try:
            assert fed.procs["cloud"].wait(120) == 1, fed.logs()
            assert fed.procs["d0"].wait(30) == 2, fed.logs()
        finally:
            fed.close()
    cloud, device = fed.log("cloud"), fed.log("d0")
    # (round 2 may open before its edge's hello says d0 is gone)
    assert len(fed.metrics()) in (1, 2) and f"no device is online before round {len(fed.metrics()) + 1}" in cloud
    assert "--rejoin-timeout" in cloud, cloud
    # ... saying why, as the device told its edge (its `done`) and the edge the cloud
    assert "d0 (edge e0) left the run: device d0: fedprox has no device part for backend 'onnx'" in cloud, cloud
    assert device.count("fedprox has no device part for backend 'onnx'") == 1, device  # one line, not two
