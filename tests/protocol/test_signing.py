"""Per-node Ed25519 signatures (protocol/signing.py): a frame signed by its topic's node passes;
a forged, unsigned, replayed or unknown-key frame is refused and counted before it is parsed;
unsigned federations are unchanged; and a signed federation runs on a real Mosquitto while a
client with broker access forges, strips and replays frames."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography")

from splitedge.cli import main
from splitedge.protocol import credentials
from splitedge.protocol.codec import Envelope, encode
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.signing import (
    TRAILER_LEN, KeyRing, Signer, Verifier, load_keyring, load_signer, split_trailer,
)
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

RUN = "sig"
HELLO = f"splitedge/{RUN}/device/d0/up/hello"


def hello(samples: int = 10, sender: str = "d0") -> Envelope:
    return Envelope(kind="hello", run=RUN, round=0, sender=sender,
                    body={"role": "device", "parent": "e0", "samples": samples, "backend": "onnx",
                          "classes": np.arange(2, dtype=np.int64)})


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """cloud, e0, d0, d1 key pairs, written by the CLI; `intruder.key` is not in the folder's ring."""
    folder = tmp_path_factory.mktemp("keys")
    assert main(["keys", "generate", "--out", str(folder / "ring"), "cloud", "e0", "d0", "d1"]) == 0
    assert main(["keys", "generate", "--out", str(folder / "other"), "intruder", "dx"]) == 0
    return folder


def signer(keys: Path, node: str) -> Signer:
    return load_signer(keys / ("other" if node in ("intruder", "dx") else "ring") / f"{node}.key")


def verifier(keys: Path) -> Verifier:
    return Verifier(load_keyring(keys / "ring"))


def refused(rule: str, fn, *args) -> None:
    with pytest.raises(ProtocolError) as err:
        fn(*args)
    assert err.value.rule == rule, err.value


# -- the trailer and the verifier ---------------------------------------------------------------
def test_a_signed_frame_is_the_unchanged_frame_plus_a_76_byte_trailer(keys: Path) -> None:
    frame = encode(hello())
    sealed = signer(keys, "d0").seal(HELLO, frame)
    assert len(sealed) == len(frame) + TRAILER_LEN == len(frame) + 76
    assert sealed[:len(frame)] == frame and sealed[len(frame):len(frame) + 3] == bytes([0xC7, 0x49, 0x02])
    assert bytes(verifier(keys).open(HELLO, sealed)) == frame
    assert split_trailer(frame) is None


def test_forged_tampered_moved_unsigned_and_unknown_frames_are_refused(keys: Path) -> None:
    v, frame = verifier(keys), encode(hello())
    good = signer(keys, "d0").seal(HELLO, frame)
    refused("sig.bad", v.open, HELLO, signer(keys, "intruder").seal(HELLO, frame))  # another key
    refused("sig.bad", v.open, HELLO, signer(keys, "d1").seal(HELLO, frame))  # a real node, not d0
    flipped = bytearray(good)
    flipped[len(frame) // 2] ^= 1
    refused("sig.bad", v.open, HELLO, bytes(flipped))  # one bit of the frame
    refused("sig.bad", v.open, HELLO.replace("/hello", "/done"), good)  # the topic is signed too
    refused("sig.missing", v.open, HELLO, frame)
    dx = HELLO.replace("/d0/", "/dx/")
    refused("sig.unknown_key", v.open, dx, signer(keys, "dx").seal(dx, encode(hello(sender="dx"))))
    refused("sig.unknown_key", v.open, "not/splitedge", good)


def test_an_older_frame_is_a_replay_and_a_copy_of_the_newest_a_duplicate_until_resubscribed(keys: Path) -> None:
    v, s = verifier(keys), signer(keys, "d0")
    first, second = s.seal(HELLO, encode(hello(1))), s.seal(HELLO, encode(hello(2)))
    assert v.open(HELLO, first) is not None and v.open(HELLO, second) is not None
    refused("sig.replay", v.open, HELLO, first)
    assert v.open(HELLO, second) is None  # what a broker re-sends (QoS 1 retry, retained after reconnect)
    v.reopen(f"splitedge/{RUN}/device/+/up/#")  # a new subscription: the retained copy comes once more
    assert v.open(HELLO, second) is not None and v.open(HELLO, second) is None
    other = HELLO.replace("hello", "done")  # each topic has its own window
    assert v.open(other, s.seal(other, encode(Envelope(kind="done", run=RUN, round=1, sender="d0",
                                                       body={"phase": "x"})))) is not None


def test_a_restarted_sender_continues_above_its_old_sequence(keys: Path) -> None:
    v, path = verifier(keys), keys / "ring" / "d0.key"
    before = load_signer(path).seal(HELLO, encode(hello(1)))
    assert v.open(HELLO, before) is not None
    after = load_signer(path).seal(HELLO, encode(hello(2)))  # a new process: a new counter, same key
    assert v.open(HELLO, after) is not None


def test_a_will_signed_at_connect_is_accepted_after_newer_frames_on_its_topic(keys: Path) -> None:
    status = HELLO.replace("hello", "status")
    s, v = signer(keys, "d0"), verifier(keys)
    offline = Envelope(kind="status", run=RUN, round=0, sender="d0", body={"state": "offline", "role": "device"})
    online = Envelope(kind="status", run=RUN, round=0, sender="d0", body={"state": "online", "role": "device"})
    will = s.seal(status, encode(offline), will=True)
    assert v.open(status, s.seal(status, encode(online))) is not None
    assert v.open(status, will) is not None  # the broker fires it later
    assert v.open(status, will) is None  # fired again after a reconnect: a duplicate, not news


# -- the transport --------------------------------------------------------------------------------
def test_transport_refuses_before_handlers_and_counts_and_unsigned_receivers_still_read(keys: Path) -> None:
    # Prepare: a signing device, a verifying edge, an edge without keys, and a broker-side forger
    bus, got, plain = LoopbackBus(), [], []
    ring = load_keyring(keys / "ring")
    edge = LoopbackTransport(bus, role="edge", client_id="e0", keyring=ring, signer=signer(keys, "e0"))
    old = LoopbackTransport(bus, role="edge", client_id="e-old")
    edge.subscribe(f"splitedge/{RUN}/device/+/up/#", lambda t, e: got.append(e.body["samples"]))
    old.subscribe(f"splitedge/{RUN}/device/+/up/#", lambda t, e: plain.append(e.body["samples"]))
    device = LoopbackTransport(bus, role="device", client_id="d0", signer=signer(keys, "d0"))
    forger = LoopbackTransport(bus, role="device", client_id="x")
    # Execute
    device.publish(HELLO, hello(10))
    forger.publish(HELLO, hello(999))
    forger.publish_raw(HELLO, signer(keys, "intruder").seal(HELLO, encode(hello(998))))
    device.publish(HELLO, hello(11))
    # Assert: only d0's own frames reached the handler; every refusal has its rule
    assert got == [10, 11]
    assert edge.rejected == {"sig.missing": 1, "sig.bad": 1}
    assert plain == [10, 999, 998, 11] and old.rejected == {}  # keyless receivers: as before signing


def test_a_transport_without_keys_sends_exactly_the_unsigned_frame() -> None:
    bus, payloads = LoopbackBus(), []
    rx = LoopbackTransport(bus, role="edge", client_id="e0")
    rx._on_inbound = lambda topic, payload, qos: payloads.append(payload)  # type: ignore[method-assign]
    rx.subscribe(HELLO, lambda t, e: None)
    env = hello()
    LoopbackTransport(bus, role="device", client_id="d0").publish(HELLO, env)
    assert payloads == [encode(env)]


# -- the command line -----------------------------------------------------------------------------
def options(*argv: str, node: str = "e0") -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--id", default=node)
    credentials.add_arguments(p)
    return credentials.connect_options(p.parse_args(list(argv)), "mqtt://127.0.0.1:1883")


def test_flags_and_env_give_the_transport_its_signer_and_keyring(keys: Path, monkeypatch) -> None:
    opts = options("--sign-key", str(keys / "ring" / "e0.key"), "--verify-keys", str(keys / "ring"))
    assert isinstance(opts["signer"], Signer) and set(opts["keyring"].keys) == {"cloud", "e0", "d0", "d1"}
    monkeypatch.setenv("SPLITEDGE_SIGN_KEY", str(keys / "ring" / "d1.key"))
    monkeypatch.setenv("SPLITEDGE_VERIFY_KEYS", str(keys / "ring"))
    assert isinstance(options(node="d1")["keyring"], KeyRing)
    monkeypatch.delenv("SPLITEDGE_VERIFY_KEYS")
    assert "keyring" not in options(node="d1") and "signer" in options(node="d1")


@pytest.mark.parametrize("argv, message", [
    (["--sign-key", "{k}/ring/nope.key"], "--sign-key .*nope.key: no such file"),
    (["--sign-key", "{k}/ring/e0.pub"], "not an unencrypted PEM private key; make one with `splitedge keys generate`"),
    (["--sign-key", "{k}/ring/d0.key", "--verify-keys", "{k}/ring"], "is not the private key of .*e0.pub"),
    (["--sign-key", "{k}/other/intruder.key", "--verify-keys", "{k}/other"], "has no e0.pub: copy this node's own"),
    (["--verify-keys", "{k}/ring"], "--verify-keys without --sign-key"),
    (["--sign-key", "{k}/ring/e0.key", "--verify-keys", "{k}/none"], "--verify-keys .*none: no such directory"),
])
def test_user_mistakes_are_one_line_that_says_what_to_fix(keys: Path, argv: list[str], message: str,
                                                         capsys) -> None:
    argv = [a.format(k=keys) for a in argv]
    with pytest.raises(ValueError, match=message):
        options(*argv)
    # the same through the command, before any connection is tried (no broker on port 9)
    assert main(["edge", "--broker", "mqtt://127.0.0.1:9", "--id", "e0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("splitedge edge: error: "), err


def test_keys_generate_writes_private_keys_600_and_never_replaces_one(tmp_path: Path, capsys) -> None:
    assert main(["keys", "generate", "--out", str(tmp_path), "d0"]) == 0
    assert (tmp_path / "d0.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "d0.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    before = (tmp_path / "d0.key").read_bytes()
    assert main(["keys", "generate", "--out", str(tmp_path), "d9", "d0"]) == 2
    assert "d0.key exists" in capsys.readouterr().err
    assert (tmp_path / "d0.key").read_bytes() == before and not (tmp_path / "d9.key").exists()
    assert main(["keys", "generate", "--out", str(tmp_path), "a/b"]) == 2


def test_signing_off_never_imports_cryptography_and_signing_on_without_it_names_the_extra(keys: Path) -> None:
    code = f"""
import sys
sys.modules["cryptography"] = None  # as in a thin install without the [sign] extra
import numpy as np
from splitedge import protocol
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport
from splitedge.cli import main
bus, got = LoopbackBus(), []
rx = LoopbackTransport(bus, role="edge", client_id="e0")
rx.subscribe("splitedge/r/device/d0/up/status", lambda t, e: got.append(e.body["state"]))
env = protocol.Envelope(kind="status", run="r", round=0, sender="d0", body={{"state": "online", "role": "device"}})
LoopbackTransport(bus, role="device", client_id="d0").publish("splitedge/r/device/d0/up/status", env)
assert got == ["online"]
sys.exit(main(["device", "--broker", "mqtt://127.0.0.1:9", "--id", "d0", "--edge", "e0", "--data", "x.npz",
               "--sign-key", {str(keys / "ring" / "d0.key")!r}]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "splitedge device needs cryptography: pip install 'splitedge[sign]'"


# -- a signed federation on a real broker ---------------------------------------------------------
class RawTap:
    """A plain paho client with broker access: it records every frame of the run as bytes and
    publishes whatever bytes it likes (the attacker the signatures are for)."""

    def __init__(self, host: str, port: int, run: str) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.frames: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="tap", protocol=paho.MQTTv311)
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.subscribe(f"splitedge/{run}/#", qos=1)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.frames.append((msg.topic, bytes(msg.payload)))

    def older_frame(self, prefix: str) -> tuple[str, bytes]:
        """The first frame on a topic under `prefix` that carried a newer one since."""
        with self.lock:
            frames = [f for f in self.frames if f[0].startswith(prefix) and f[1]]
        for topic, payload in frames:
            if sum(t == topic and p != payload for t, p in frames) and not topic.endswith("/status"):
                return topic, payload
        raise AssertionError(f"no topic under {prefix} carried two frames: {sorted({t for t, _ in frames})}")

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_a_signed_federation_runs_while_forged_unsigned_and_replayed_frames_are_refused(keys: Path,
                                                                                           mosquitto) -> None:
    import torch

    from live_nodes import LiveNodes
    from splitedge.cloud.coordinator import CloudCoordinator, CloudSettings
    from splitedge.cloud.options import build_run_config
    from splitedge.device.agent import DeviceAgent
    from splitedge.edge.aggregator import EdgeAggregator
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.runtime.session import connect

    torch.set_num_threads(1)
    run = "signed-run"
    train, test, info = load_dataset("digits", max_train=400)
    config = build_run_config("fedavg", info, None, 0, {})
    ring = keys / "ring"

    def transport(tier: str, node: str) -> Any:
        opts = options("--sign-key", str(ring / f"{node}.key"), "--verify-keys", str(ring), node=node)
        return live.adopt(connect(mosquitto.url, run=run, tier=tier, node_id=node, **opts))

    tap = RawTap(mosquitto.host, mosquitto.port, run)
    forged_hello = hello(12345, "d0")
    d0_hello = f"splitedge/{run}/device/d0/up/hello"
    dx_hello = f"splitedge/{run}/device/dx/up/hello/e0"  # a stranger joins by the copy addressed to the edge

    def attack(record: dict) -> None:
        """After round 1: forge d0 with another key, strip the signature, use an unknown key.
        After round 2: replay, byte for byte, frames both the edge and the cloud already had newer
        ones of."""
        env = Envelope(kind="hello", run=run, round=0, sender="d0", body=forged_hello.body)
        if record["round"] == 1:
            tap.publish(d0_hello, signer(keys, "intruder").seal(d0_hello, encode(env)))  # (a)
            tap.publish(d0_hello, encode(env))  # (b)
            dx_env = Envelope(kind="hello", run=run, round=0, sender="dx", body=forged_hello.body)
            tap.publish(dx_hello, signer(keys, "dx").seal(dx_hello, encode(dx_env)))
        if record["round"] == 2:
            tap.publish(*tap.older_frame(f"splitedge/{run}/cloud/cloud/down/round"))  # (c) to the edge
            tap.publish(*tap.older_frame(f"splitedge/{run}/edge/e0/up/"))  # (c) to the cloud

    with LiveNodes(lambda node: mosquitto.url, run) as live:
        live.adopt(tap)
        edge = live.start(EdgeAggregator(transport("edge", "e0"), run=run, node_id="e0"))
        parts = np.array_split(np.arange(len(train[1])), 2)
        devices = [live.start(DeviceAgent(transport("device", d), run=run, node_id=d, edge="e0",
                                          data=(train[0][idx], train[1][idx])))
                   for d, idx in zip(("d0", "d1"), parts)]
        cloud_t = transport("cloud", "cloud")
        settings = CloudSettings(method="fedavg", rounds=3, config=config, deadline_s=60.0, min_edges=1,
                                 min_devices=2, on_round=attack)
        history = CloudCoordinator(cloud_t, settings, run=run, test=test).run()
        edge_t = edge.down
        expected_edge = {"sig.bad": 1, "sig.missing": 1, "sig.unknown_key": 1, "sig.replay": 1}
        assert edge_t.wait_for(lambda: edge_t.rejected == expected_edge, 10), edge_t.rejected
        assert cloud_t.wait_for(lambda: cloud_t.rejected == {"sig.replay": 1}, 10), cloud_t.rejected
        members = dict(edge.members)
    # Assert: every round ran and was evaluated, nothing forged reached the edge's state, and
    # the honest nodes' frames were never refused (no false positives, wills included)
    assert [r["round"] for r in history] == [1, 2, 3] and history[-1]["accuracy"] > 0.3
    assert 12345 not in members.values() and "dx" not in members and set(members) == {"d0", "d1"}
    assert all(d.transport.rejected == {} for d in devices), [d.transport.rejected for d in devices]
    assert json.dumps(edge_t.rejected)  # the counts write_counters leaves for the bench


@pytest.mark.parametrize("role", ["device", "edge", "cloud"])
def test_every_role_takes_the_signing_and_cap_flags(role: str) -> None:
    from splitedge.cli import build_parser

    sub = next(a for a in build_parser(role)._actions if a.dest == "command").choices[role]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--sign-key", "--verify-keys", "--max-frame-bytes"} <= flags


def test_the_size_cap_comes_before_the_signature(keys: Path) -> None:
    bus, got = LoopbackBus(), []
    edge = LoopbackTransport(bus, role="edge", client_id="e0", keyring=load_keyring(keys / "ring"), max_bytes=2048)
    edge.subscribe(HELLO, lambda t, e: got.append(e))
    big = Envelope(kind="hello", run=RUN, round=0, sender="d0",
                   body={**hello().body, "classes": np.arange(300, dtype=np.int64)})
    LoopbackTransport(bus, role="device", client_id="d0", signer=signer(keys, "d0")).publish(HELLO, big)
    assert got == [] and edge.rejected == {"frame.too_large": 1}


def test_the_trailer_of_protocol_md_worked_example_byte_for_byte(monkeypatch) -> None:
    """Ed25519 is deterministic: key bytes 00..1f, seq 1767225600000000, the page's moments frame."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from splitedge.protocol import signing
    from splitedge.protocol.examples import worked_example

    monkeypatch.setattr(signing, "_now_us", lambda: 1767225600000000)
    s = Signer(ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
    frame = encode(worked_example())
    sealed = s.seal("splitedge/demo/device/d1/up/moments", frame)
    assert s.public_bytes().hex() == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert sealed[len(frame):].hex() == (
        "c7490200" "0040204648470600"
        "cc939a88d93f77a2f976ef3d8d1cd925e8524bf1d6ccc32775e94573b7da8a28"
        "d5007fb2193931b76137970c80a044f7b9197c00367020d38773ce6ae6e7a902")
