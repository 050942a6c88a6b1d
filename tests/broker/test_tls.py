"""Broker credentials from the command line: mutual TLS against a Mosquitto that requires
client certificates (a test CA made here with openssl), a password read from a file, and the
mistakes (unknown CA, no client certificate, missing files) each named in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from brokers import require_mosquitto
from splitedge.cli import main
from splitedge.protocol.broker import MosquittoBroker
from splitedge.protocol.codec import Envelope
from splitedge.protocol.mqtt import MqttTransport
from splitedge.protocol.topics import topic
from splitedge.protocol.transport import wait_for
from tls_pki import mtls_broker, pki, tls_url  # noqa: F401 - fixtures

RUN = "tls"


def test_mutual_tls_carries_messages(pki: Path, mtls_broker: MosquittoBroker) -> None:
    files = {"ca_certs": str(pki / "ca.pem"), "certfile": str(pki / "e0.pem"), "keyfile": str(pki / "e0.key")}
    got: list[str] = []
    with MqttTransport(tls_url(mtls_broker), client_id="sub", role="cloud", **files) as sub, \
            MqttTransport(tls_url(mtls_broker), client_id="pub", role="edge", **files) as pub:
        sub.subscribe(topic(RUN, "edge", "e0", "up", "status"), lambda t, e: got.append(e.body["state"]))
        pub.publish(topic(RUN, "edge", "e0", "up", "status"),
                    Envelope(kind="status", run=RUN, round=0, sender="e0", body={"state": "online", "role": "edge"}),
                    wait=5)
        assert wait_for(lambda: got == ["online"], 5)


def test_a_role_connects_over_mutual_tls_with_files_from_the_environment(pki: Path, mtls_broker: MosquittoBroker,
                                                                          monkeypatch, capsys) -> None:
    monkeypatch.setenv("SPLITEDGE_CA_FILE", str(pki / "ca.pem"))
    monkeypatch.setenv("SPLITEDGE_CERT_FILE", str(pki / "e0.pem"))
    monkeypatch.setenv("SPLITEDGE_KEY_FILE", str(pki / "e0.key"))
    # the cloud connects, waits for an edge that never comes, and says so: it got through TLS
    code = main(["cloud", "--broker", tls_url(mtls_broker), "--run", RUN, "--edges", "1", "--join-timeout", "2",
                 "--rounds", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "joined within 2 s" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("files, says", [
    ({"ca_certs": "other-ca.pem", "certfile": "e0.pem", "keyfile": "e0.key"},
     "the broker's certificate is not trusted: self-signed certificate in certificate chain; is it signed by "
     "--ca-file"),
    ({"ca_certs": "ca.pem"}, "the broker requires a client certificate: give --cert-file and --key-file"),
])
def test_what_tls_refused_is_named(pki: Path, mtls_broker: MosquittoBroker, files: dict, says: str) -> None:
    with pytest.raises(ConnectionError) as caught:
        MqttTransport(tls_url(mtls_broker), client_id="x", role="device", connect_timeout=2,
                      **{k: str(pki / v) for k, v in files.items()})
    assert says in str(caught.value), caught.value


def test_a_key_that_does_not_match_its_certificate_is_a_value_error(pki: Path, mtls_broker: MosquittoBroker) -> None:
    with pytest.raises(ValueError, match="cannot use the TLS files"):
        MqttTransport(tls_url(mtls_broker), client_id="x", role="device", ca_certs=str(pki / "ca.pem"),
                      certfile=str(pki / "e0.pem"), keyfile=str(pki / "server.key"))


def test_password_from_a_file_logs_in_and_a_wrong_one_is_refused(tmp_path: Path, capsys) -> None:
    require_mosquitto("mosquitto", "mosquitto_passwd")
    passwords = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwords), "e0", "s3cret"], check=True, capture_output=True)
    with MosquittoBroker(extra_conf=f"allow_anonymous false\npassword_file {passwords}\n") as broker:
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text("s3cret\n")
        bad.write_text("guess\n")
        url = f"mqtt://e0@127.0.0.1:{broker.port}"
        code = main(["cloud", "--broker", url, "--password-file", str(good), "--run", RUN, "--edges", "1",
                     "--join-timeout", "1", "--rounds", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 1 and "joined within 1 s" in err, err  # logged in
        code = main(["cloud", "--broker", url, "--password-file", str(bad), "--run", RUN, "--edges", "1",
                     "--join-timeout", "1", "--rounds", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 1 and "refused the connection" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("extra, says", [
    (["--ca-file", "nope.pem"], "--ca-file nope.pem: no such file"),
    (["--cert-file", "{d}/e0.pem"], "--cert-file and --key-file go together"),
    (["--ca-file", "{d}/ca.pem"], "--ca-file is for TLS: use an mqtts:// broker URL"),
    (["--password-file", "{d}/empty"], "the first line is empty"),
    (["--password-file", "{d}/pw"], "--password-file needs the user name in the broker URL"),
])
def test_credential_mistakes_are_one_line_before_anything_starts(extra: list[str], says: str, tmp_path: Path,
                                                                 capsys) -> None:
    for name in ("e0.pem", "ca.pem", "pw"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "empty").write_text("")
    shard = tmp_path / "missing-shard.npz"  # never read: the credentials are checked first
    argv = ["device", "--broker", "mqtt://127.0.0.1:1", "--id", "d0", "--edge", "e0", "--data", str(shard),
            *[a.format(d=tmp_path) for a in extra]]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
