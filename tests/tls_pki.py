"""A test CA made with openssl, and a Mosquitto that requires client certificates signed by it:
the mutual-TLS fixtures the TLS, broker-error and client-loop tests share."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from brokers import require_mosquitto
from splitedge.protocol.broker import MosquittoBroker


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _signed(d: Path, name: str, ca: str, san: str | None = None) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    extra: list[str] = []
    if san:
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (signs the broker and client e0), other-ca (signs nothing the broker knows)."""
    require_mosquitto("mosquitto", "openssl")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _signed(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
    _signed(d, "e0", "ca")
    return d


@pytest.fixture(scope="module")
def mtls_broker(pki: Path):
    conf = (f"cafile {pki / 'ca.pem'}\ncertfile {pki / 'server.pem'}\nkeyfile {pki / 'server.key'}\n"
            "require_certificate true\nuse_identity_as_username true\n")
    with MosquittoBroker(extra_conf=conf) as broker:
        yield broker


def tls_url(broker: MosquittoBroker) -> str:
    return f"mqtts://127.0.0.1:{broker.port}"
