"""`splitedge provision` (issue 55, item 5): a bundle per node and a broker that serves every run.

Each bundle holds its node's own secrets and no other node's, works wherever it is copied (its
config's paths are relative to the config), and its systemd unit keeps the service settings of
deploy/'s units. A federation starts from the bundles alone, twice, with two run ids, on one
broker whose files and process are not touched in between; and the run-agnostic ACL still keeps
a node's login from speaking as another node.
"""

from __future__ import annotations

import configparser
import hashlib
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from brokers import require_mosquitto, wait_until
from generated_broker import Broker, as_root, broker_user_exists
from mqtt_capture import Capture
from splitedge.cli import build_parser, main
from splitedge.protocol.acl import ANY_RUN, federation_acl
from splitedge.protocol.broker import free_port
from splitedge.provision.units import unit_name
from typed_commands import Processes, remove, scratch

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NODES = {"cloud": "cloud", "e0": "edge", "e1": "edge", "d0": "device", "d1": "device", "d2": "device", "d3": "device"}
ONE_ROUND = " --rounds 1 --max-test 200 --deadline 90 --join-timeout 120"


def provision(folder: Path, port: int, *extra: str, capsys=None) -> str:
    """`data split` (digits, four devices) then `provision` onto two edges; provision's stdout."""
    if not (folder / "shards").exists():
        assert main(["data", "split", "--dataset", "digits", "--devices", "4", "--max-train", "400",
                     "--out", str(folder / "shards")]) == 0
    if capsys is not None:
        capsys.readouterr()
    assert main(["provision", "--shards", str(folder / "shards"), "--edges", "2", "--out", str(folder / "bundles"),
                 "--broker", f"mqtt://127.0.0.1:{port}", "--listener", f"127.0.0.1:{port}", *extra]) == 0
    return capsys.readouterr().out if capsys is not None else ""


@pytest.fixture
def bundles(tmp_path: Path, capsys) -> Path:
    provision(tmp_path, 18830, capsys=capsys)
    return tmp_path / "bundles"


def test_each_bundle_holds_its_node_s_own_secrets_and_nothing_of_another(bundles: Path) -> None:
    passwords = {n: (bundles / "operator" / "logins" / f"{n}.password").read_text().strip() for n in NODES}
    private = {n: (bundles / "operator" / "keys" / f"{n}.key").read_bytes() for n in NODES}
    for node, role in NODES.items():
        bundle = bundles / node
        assert bundle.stat().st_mode & 0o777 == 0o700
        for secret in ("login.password", "node.key"):
            assert (bundle / secret).stat().st_mode & 0o777 == 0o600, (node, secret)
        assert (bundle / "login.password").read_text().strip() == passwords[node]
        assert (bundle / "node.key").read_bytes() == private[node]
        assert sorted(p.name for p in (bundle / "keys").iterdir()) == sorted(
            f"{n}{ext}" for n in NODES for ext in (".pub", ".role"))
        assert all((bundle / "keys" / f"{n}.role").read_text().strip() == r for n, r in NODES.items())
        assert (bundle / unit_name(role)).is_file()
        assert (bundle / "shard.npz").exists() == (role == "device")
        assert (bundle / "shards.json").exists() == (role == "edge")
        every_byte = b"".join(p.read_bytes() for p in bundle.rglob("*") if p.is_file())
        for other in NODES:
            if other != node:
                assert passwords[other].encode() not in every_byte, (node, other)
                assert private[other] not in every_byte, (node, other)
    shard = bundles.parent / "shards" / "shard-d2.npz"
    assert (bundles / "d2" / "shard.npz").read_bytes() == shard.read_bytes()
    broker = bundles / "broker"
    assert sorted(p.name for p in broker.iterdir()) == ["broker.acl", "broker.conf", "broker.passwd"]
    assert (broker / "broker.passwd").stat().st_mode & 0o777 == 0o600


def test_a_bundle_s_config_is_its_node_s_command_wherever_it_is_copied(bundles: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.chdir(tmp_path)  # neither the bundle's folder nor its parent
    for node, role in NODES.items():
        shutil.copytree(bundles / node, elsewhere / node)
        argv = [role, "--config", str(elsewhere / node / "splitedge.toml"), "--run", "r1"]
        args = build_parser(role, argv).parse_args(argv)
        assert args.run == "r1" and args.broker == f"mqtt://{node}@127.0.0.1:18830"
        for path in (args.password_file, args.sign_key, args.verify_keys):
            assert path.parent == elsewhere / node or path == elsewhere / node / "keys", path
            assert path.exists()
        if role == "device":
            assert (args.id, args.edge, args.backend) == (node, f"e{int(node[1:]) % 2}", "onnx")
            assert args.data == elsewhere / node / "shard.npz"
        if role == "edge":
            assert args.manifest == elsewhere / node / "shards.json" and args.cloud == "cloud"
        if role == "cloud":
            assert (args.edges, args.devices, args.dataset) == (2, 4, "digits")


def read_unit(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    unit.optionxform = str
    unit.read_string(text)
    return unit


@pytest.mark.parametrize("role", ["device", "edge", "cloud"])
def test_a_provisioned_unit_keeps_the_deploy_unit_s_service_settings(bundles: Path, role: str) -> None:
    node = {"device": "d0", "edge": "e0", "cloud": "cloud"}[role]
    ours = read_unit((bundles / node / unit_name(role)).read_text())
    theirs = read_unit((DEPLOY / f"splitedge-{role}.service").read_text())
    how = {"Description", "EnvironmentFile", "ExecStart"}  # how the node gets its settings, and its name
    for section in ("Unit", "Service", "Install"):
        mine = {k: v for k, v in ours[section].items() if k not in how}
        deployed = {k: v for k, v in theirs[section].items() if k not in how}
        assert mine == deployed, (role, section)
    exec_start = ours["Service"]["ExecStart"].replace("%i", "r7").split()
    assert exec_start[:4] == ["/opt/splitedge/venv/bin/splitedge", "-v", role, "--config"]
    assert exec_start[4] == "/etc/splitedge/splitedge.toml" and exec_start[5:7] == ["--run", "r7"]
    argv = [exec_start[2], "--config", str(bundles / node / "splitedge.toml"), *exec_start[5:]]
    args = build_parser(role, argv).parse_args(argv)
    assert args.command == role and args.run == "r7"
    if role == "edge":
        assert args.state_dir == Path("/var/lib/splitedge/state/r7")  # runs never resume each other
    if role == "cloud":
        assert args.out == Path("/var/lib/splitedge/runs/r7")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_provisioned_units(bundles: Path, tmp_path: Path) -> None:
    splitedge = Path(sys.executable).with_name("splitedge")
    if not splitedge.exists():
        pytest.skip("no splitedge console script next to this Python")
    units = tmp_path / "units"
    units.mkdir()
    for node, role in (("d0", "device"), ("e0", "edge"), ("cloud", "cloud")):
        text = (bundles / node / unit_name(role)).read_text().replace("/opt/splitedge/venv/bin/splitedge", str(splitedge))
        (units / unit_name(role).replace("@.", "@r1.")).write_text(text)  # an instance: %i is its run
    result = subprocess.run(["systemd-analyze", "verify", *map(str, sorted(units.iterdir()))],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0 and "splitedge-" not in result.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_provisioning_again_keeps_every_key_and_password(bundles: Path, capsys) -> None:
    before = {p.relative_to(bundles): p.read_bytes() for p in bundles.rglob("*")
              if p.is_file() and p.name in ("node.key", "login.password") or p.suffix == ".pub"}
    provision(bundles.parent, 18830, "--overwrite", capsys=capsys)
    after = {p.relative_to(bundles): p.read_bytes() for p in bundles.rglob("*")
             if p.is_file() and p.name in ("node.key", "login.password") or p.suffix == ".pub"}
    assert before == after and len(before) > len(NODES)


@pytest.mark.parametrize("change,says", [
    (["--shards", "nowhere"], "--shards nowhere: no such file"),
    (["--edges", "0"], "--edges must be >= 1"),
    (["--cloud-id", "broker"], "node ids must be unique and not broker or operator: broker"),
    (["--cloud-id", "d1"], "node ids must be unique and not broker or operator: d1"),
    (["--watchers", "-1"], "the number of watcher logins must be >= 0"),
    (["--broker", "http://x:1883"], "http"),
    (["--listener", "x:y"], "--listener 'x:y': give [ADDR:]PORT"),
])
def test_a_mistake_is_one_line_and_writes_nothing(tmp_path: Path, capsys, change: list[str], says: str) -> None:
    assert main(["data", "split", "--dataset", "digits", "--devices", "2", "--max-train", "100",
                 "--out", str(tmp_path / "shards")]) == 0
    capsys.readouterr()
    argv = {"--shards": str(tmp_path / "shards"), "--out": str(tmp_path / "bundles"),
            "--broker": "mqtt://127.0.0.1:1883"}
    argv.update(dict(zip(change[::2], change[1::2])))
    code = main(["provision", *(w for kv in argv.items() for w in kv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "bundles").exists()


def test_bundles_already_there_are_refused_without_overwrite(bundles: Path, capsys) -> None:
    code = main(["provision", "--shards", str(bundles.parent / "shards"), "--out", str(bundles),
                 "--broker", "mqtt://127.0.0.1:18830"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds bundles" in err and "--overwrite" in err, err


def test_the_broker_acl_names_no_run_and_confines_each_login_to_its_node() -> None:
    text = federation_acl(ANY_RUN, {"d0": "e0", "d1": "e0"}, watcher=["watcher"])
    topics = [line.split()[-1] for line in text.splitlines() if line.startswith("topic ")]
    assert topics and all(t.startswith(("splitedge/+/", "splitedge-probe/+/")) for t in topics), topics
    block = text.split("user d0\n")[1].split("\n\n")[0].splitlines()
    assert block == ["topic readwrite splitedge/+/device/d0/#", "topic read splitedge/+/edge/e0/down/+",
                     "topic read splitedge/+/edge/e0/down/+/d0", "topic read splitedge/+/edge/e0/up/status"]
    with pytest.raises(ValueError, match="control characters"):
        federation_acl("\x01any-run\x01", {"d0": "e0"})  # a run id can never pose as every run


# -- on a real broker ------------------------------------------------------------------------------

def printed(stdout: str, run: str) -> dict[str, str]:
    """node -> the command `provision` printed for it, for run `run`."""
    lines = [line.strip().replace("RUN", run) for line in stdout.splitlines()
             if line.startswith("  splitedge ") and "--config" in line]
    return {Path(line.split("--config ")[1].split()[0]).parent.name: line for line in lines}


def fingerprint(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in ("broker.acl", "broker.conf", "broker.passwd")}


def test_two_runs_from_the_bundles_alone_on_one_untouched_broker(capsys) -> None:
    require_mosquitto()
    folder, port = scratch(), free_port()
    try:
        stdout = provision(folder, port, capsys=capsys)
        broker_files = folder / "bundles" / "broker"
        if as_root() and broker_user_exists():  # what broker.conf's comment says to do first
            shutil.chown(broker_files / "broker.passwd", "mosquitto", "mosquitto")
        with Broker(broker_files / "broker.conf", port) as broker:
            files, pid = fingerprint(broker_files), broker.proc.pid
            for run in ("field-1", "field-2"):
                commands = printed(stdout, run)
                assert sorted(commands) == sorted(NODES), stdout
                with Processes(folder) as nodes:
                    nodes.start(commands["cloud"] + ONE_ROUND)
                    for node in NODES:
                        if node != "cloud":
                            nodes.start(commands[node])
                    exits = nodes.wait(300)
                    assert set(exits.values()) == {0}, nodes.logs()
                    for node in NODES:
                        assert "unsigned" not in nodes.log(node) and "no --manifest" not in nodes.log(node), \
                            nodes.log(node)
                metrics = (folder / "runs" / run / "metrics.jsonl").read_text().splitlines()
                assert len(metrics) == 1 and '"devices_reported": 4' in metrics[0], metrics
            assert fingerprint(broker_files) == files and broker.proc.poll() is None and broker.proc.pid == pid

            # a device's login, in any run, writes only as its own node
            password = (folder / "bundles" / "d0" / "login.password").read_text().strip()
            at = SimpleNamespace(port=port)
            logins = folder / "bundles" / "operator" / "logins"
            watcher = Capture(at, "watcher", password=(logins / "watcher.password").read_text().strip())
            d0 = Capture(at, "d0", topic="splitedge/+/device/d0/#", password=password)
            try:
                mark = uuid.uuid4().hex[:8]
                for run in ("field-2", f"new-{mark}"):
                    d0.client.publish(f"splitedge/{run}/device/d1/up/hello", b"forged", qos=1)
                    d0.client.publish(f"splitedge/{run}/edge/e0/down/round", b"forged", qos=1)
                    d0.client.publish(f"splitedge/{run}/device/d0/up/mark-{mark}", b"mine", qos=1)
                assert wait_until(lambda: sum(f"mark-{mark}" in m[0] for m in watcher.messages) == 2, 10), \
                    watcher.messages
                time.sleep(0.5)
                forged = [m[0] for m in watcher.messages if m[1] == b"forged"]
                assert forged == [], forged
            finally:
                d0.close()
                watcher.close()
    finally:
        remove(folder)


def test_devices_that_hold_their_data_get_a_bundle_that_names_it(tmp_path: Path, capsys) -> None:
    provision(tmp_path, 18830, "--device-data", "/var/lib/splitedge/shard.npz", "--backend", "torch", capsys=capsys)
    bundle = tmp_path / "bundles" / "d1"
    assert not (bundle / "shard.npz").exists()
    argv = ["device", "--config", str(bundle / "splitedge.toml"), "--run", "r"]
    args = build_parser("device", argv).parse_args(argv)
    assert args.data == Path("/var/lib/splitedge/shard.npz") and args.backend == "torch"
