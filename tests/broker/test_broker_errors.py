"""Broker errors that name their cause (issue 31, item 2), against real Mosquitto brokers: a
wrong login says authentication failed (not "is it running"), a TLS/plain mismatch says so in
seconds, an unsupported scheme is one line, no password reaches any message, and an edge that
hears nothing under an ACL says which run it uses."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokers import require_mosquitto
from splitedge.cli import main
from splitedge.protocol.acl import federation_acl
from splitedge.protocol.broker import MosquittoBroker, free_port
from splitedge.protocol.codec import Envelope
from splitedge.protocol.credentials import ENV, redact_url
from splitedge.protocol.mqtt import MqttTransport, parse_url
from splitedge.protocol.mqtt_loop import ClientLoop
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import wait_for
from splitedge.runtime.session import check_identity_free
from tls_pki import pki  # noqa: F401 - the mutual-TLS tests' CA, broker and client certificates

PASSWORD = "hunter2-s3cret"
WRONG = "guess-0f-the-day"
PROMPT_S = 8.0  # a generous bound: the connect timeouts below are 30 s
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def passwords(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mosquitto password file with logins e0 and d0, both PASSWORD."""
    require_mosquitto("mosquitto", "mosquitto_passwd")
    path = tmp_path_factory.mktemp("logins") / "passwd"
    for i, name in enumerate(("e0", "d0")):
        subprocess.run(["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(path), name, PASSWORD],
                       check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def login_broker(passwords: Path) -> Iterator[MosquittoBroker]:
    with MosquittoBroker(extra_conf=f"allow_anonymous false\npassword_file {passwords}\n") as broker:
        yield broker


@pytest.fixture(scope="module")
def plain_broker() -> Iterator[MosquittoBroker]:
    require_mosquitto()
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture(scope="module")
def tls_broker(pki: Path) -> Iterator[MosquittoBroker]:
    """Server-side TLS only (no client certificate asked for)."""
    with MosquittoBroker(extra_conf=f"certfile {pki / 'server.pem'}\nkeyfile {pki / 'server.key'}\n") as broker:
        yield broker


def connect_error(url: str, *, loop: ClientLoop | None = None, **kwargs: object) -> tuple[str, float]:
    """(the ConnectionError's text, seconds it took) for a connect that must fail."""
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        MqttTransport(url, client_id="probe", role="device", connect_timeout=30, loop=loop, **kwargs)
    return str(caught.value), time.monotonic() - started


@pytest.fixture(params=["thread", "loop"])
def loop(request: pytest.FixtureRequest) -> Iterator[ClientLoop | None]:
    """Both ways a client is driven: paho's own thread, and a shared ClientLoop (splitedge sim)."""
    if request.param == "thread":
        yield None
        return
    with ClientLoop() as shared:
        yield shared


# -- a wrong login ------------------------------------------------------------------------------
def test_wrong_password_says_authentication_failed_not_is_it_running(login_broker: MosquittoBroker,
                                                                      loop: ClientLoop | None) -> None:
    text, took = connect_error(f"mqtt://e0:{WRONG}@127.0.0.1:{login_broker.port}", loop=loop)
    assert "authentication failed" in text and "as user 'e0'" in text, text
    assert ENV["password_file"] in text and "--password-file" in text, text
    assert "is it running" not in text and WRONG not in text, text
    assert took < PROMPT_S, took


def test_no_login_says_so(login_broker: MosquittoBroker) -> None:
    text, _ = connect_error(f"mqtt://127.0.0.1:{login_broker.port}")
    assert "authentication failed" in text and "with no user name" in text and "is it running" not in text, text


def test_a_roles_wrong_password_file_is_one_line_without_the_password(login_broker: MosquittoBroker, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pw").write_text(f"{WRONG}\n")
    code = main(["cloud", "--broker", f"mqtt://e0@127.0.0.1:{login_broker.port}", "--password-file",
                 str(tmp_path / "pw"), "--run", "errs", "--edges", "1", "--join-timeout", "1", "--rounds", "1"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 1 and "authentication failed" in err and len(err.splitlines()) == 1, err
    assert WRONG not in captured.out + captured.err


@pytest.mark.parametrize("role", ["edge", "device"])
def test_a_password_in_a_roles_url_never_reaches_its_output(role: str, login_broker: MosquittoBroker, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--edge", "e0", "--data", str(tmp_path / "shard.npz")] if role == "device" else []
    if role == "device":  # a shard it never gets to train on: the connection fails first
        import numpy as np

        np.savez(tmp_path / "shard.npz", x=np.zeros((4, 8, 8, 1), np.uint8), y=np.zeros(4, np.int64))
    code = main([role, "--broker", f"mqtt://d0:{WRONG}@127.0.0.1:{login_broker.port}", "--id", "d0", *extra])
    captured = capsys.readouterr()
    assert code != 0 and "authentication failed" in captured.err, captured
    assert WRONG not in captured.out + captured.err


# -- sim --------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["unreachable", "wrong password"])
def test_sims_connection_errors_hide_the_password(where: str, login_broker: MosquittoBroker, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    port, password = (free_port(), PASSWORD) if where == "unreachable" else (login_broker.port, WRONG)
    code = main(["sim", "--broker", f"mqtt://e0:{password}@127.0.0.1:{port}", "--rounds", "1", "--devices", "2",
                 "--edges", "1", "--out", str(tmp_path / "sim")])
    captured = capsys.readouterr()
    says = "is it running" if where == "unreachable" else "authentication failed"
    assert code == 1 and says in captured.err and len(captured.err.strip().splitlines()) == 1, captured
    assert password not in captured.out + captured.err


def test_the_identity_check_hides_the_password(plain_broker: MosquittoBroker) -> None:
    # anonymous Mosquitto takes any login: the URL's password only has to stay out of the message
    url = f"mqtt://e0:{PASSWORD}@127.0.0.1:{plain_broker.port}"
    env = Envelope(kind="status", run="errs", round=0, sender="e0", body={"state": "online", "role": "edge"})
    with MqttTransport(plain_broker.url, client_id="errs-edge-e0", role="edge") as other:
        other.publish(topic("errs", "edge", "e0", "up", "status"), env, retain=True, wait=5)
        with pytest.raises(ValueError) as caught:
            check_identity_free(url, run="errs", tier="edge", node_id="e0", settle_s=10)  # until it is seen
        other.publish_raw(topic("errs", "edge", "e0", "up", "status"), b"", retain=True)
    assert "is online" in str(caught.value) and PASSWORD not in str(caught.value), caught.value


# -- TLS where there is none, and none where there is TLS ---------------------------------------
def test_mqtts_to_a_plain_listener_names_tls_in_seconds(plain_broker: MosquittoBroker,
                                                        loop: ClientLoop | None) -> None:
    text, took = connect_error(f"mqtts://127.0.0.1:{plain_broker.port}", loop=loop)
    assert "the TLS handshake failed" in text and "plain MQTT (use mqtt://)" in text, text
    assert "is it running" not in text, text
    assert took < PROMPT_S, took


def test_mqtt_to_a_tls_listener_hints_mqtts(tls_broker: MosquittoBroker, loop: ClientLoop | None) -> None:
    text, took = connect_error(f"mqtt://127.0.0.1:{tls_broker.port}", loop=loop)
    assert "no CONNACK: the broker closed the connection" in text and "speaks TLS: use mqtts://" in text, text
    assert took < PROMPT_S, took


def test_an_untrusted_certificate_names_the_ca_file_in_seconds(pki: Path, tls_broker: MosquittoBroker) -> None:
    text, took = connect_error(f"mqtts://127.0.0.1:{tls_broker.port}", ca_certs=str(pki / "other-ca.pem"))
    assert "the TLS handshake failed: the broker's certificate is not trusted" in text, text
    assert f"--ca-file {pki / 'other-ca.pem'}" in text and "is it running" not in text, text
    assert took < PROMPT_S, took


def test_the_right_ca_still_connects(pki: Path, tls_broker: MosquittoBroker) -> None:
    with MqttTransport(f"ssl://127.0.0.1:{tls_broker.port}", client_id="ok", role="device",
                       ca_certs=str(pki / "ca.pem")) as t:
        assert t.connected


# -- schemes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["tcp://127.0.0.1:1883", "http://h:1883", f"tcp://u:{PASSWORD}@h:1883",
                                 "127.0.0.1:1883", f"u:{PASSWORD}@h"])
def test_unsupported_schemes_are_one_line_naming_the_supported_ones(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_url(url)
    text = str(caught.value)
    assert len(text.splitlines()) == 1 and PASSWORD not in text, text
    assert "mqtt://" in text and "mqtts://" in text and "ssl://" in text, text


def test_a_role_refuses_tcp_before_reading_its_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["device", "--broker", f"tcp://d0:{PASSWORD}@127.0.0.1:1", "--id", "d0", "--edge", "e0",
                 "--data", str(tmp_path / "missing.npz")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "tcp:// is not supported" in err and len(err.splitlines()) == 1, err
    assert PASSWORD not in err


@pytest.mark.parametrize("url, shown", [
    ("mqtt://u:p@h:1", "mqtt://u:***@h:1"),
    ("mqtt://u:p@ss/w@h", "mqtt://u:***@h"),  # an unescaped '@' or '/' in the password
    ("mqtt://u@h", "mqtt://u@h"),
    ("mqtts://h:8883", "mqtts://h:8883"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- an edge under the generated ACL with the wrong run -----------------------------------------
def test_an_edge_that_hears_nothing_under_an_acl_says_which_run_it_uses(passwords: Path, tmp_path: Path) -> None:
    acl = tmp_path / "broker.acl"
    acl.write_text(federation_acl("r1", {"d0": "e0"}))
    (tmp_path / "pw").write_text(f"{PASSWORD}\n")
    conf = f"allow_anonymous false\npassword_file {passwords}\nacl_file {acl}\n"
    with MosquittoBroker(extra_conf=conf) as broker, open(tmp_path / "err", "w") as err_file:
        edge = subprocess.Popen([sys.executable, "-m", "splitedge", "edge", "--broker",  # no --run: "default"
                                 f"mqtt://e0@127.0.0.1:{broker.port}", "--id", "e0", "--password-file",
                                 str(tmp_path / "pw")], cwd=REPO, stdout=subprocess.PIPE, stderr=err_file, text=True)
        try:  # start-up (slow on a busy machine), then QUIET_WARN_S of silence, then a few seconds more
            assert wait_for(lambda: "nothing received" in (tmp_path / "err").read_text(), 90, interval=0.2)
            time.sleep(3)
        finally:
            edge.send_signal(signal.SIGTERM)
            out, _ = edge.communicate(timeout=30)
    err = (tmp_path / "err").read_text()
    assert "up (run default), waiting" in out, (out, err)
    warnings = [line for line in err.splitlines() if "nothing received" in line]
    assert len(warnings) == 1, err
    assert "uses run 'default'" in warnings[0] and "--run must match the cloud's" in warnings[0], warnings
