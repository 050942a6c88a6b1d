"""Broker fixtures and the one rule for a missing Mosquitto, importable on their own.

conftest.py re-exports the fixtures; tests/broker/test_ci_mosquitto.py imports this module in a
throwaway pytest run to check the rule. Locally a missing binary skips the broker tests; on
CI (``CI=true`` or ``CI=1``) it fails them, so a runner without Mosquitto cannot pass green
with the transport, bridge and process tests silently skipped.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator

import pytest

from splitedge.protocol.broker import EmbeddedBroker, MosquittoBroker

INSTALL_HINT = "install it with: sudo apt-get install mosquitto"


def on_ci() -> bool:
    """True when the environment says this is a CI run (CI=true/1, any case)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_mosquitto(*tools: str) -> None:
    """Skip the calling test (fail it on CI) unless every tool (default: `mosquitto`) is on PATH."""
    missing = [t for t in (tools or ("mosquitto",)) if shutil.which(t) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not found on PATH; {INSTALL_HINT}"
    if on_ci():
        pytest.fail(f"{message} (CI={os.environ['CI']}: broker tests fail instead of skipping)", pytrace=False)
    pytest.skip(message)


@pytest.fixture()
def mosquitto_binary() -> None:
    """For tests that start their own MosquittoBroker: `@pytest.mark.usefixtures("mosquitto_binary")`."""
    require_mosquitto()


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[MosquittoBroker]:
    """A private Mosquitto ($SYS every 1 s) for the module; see require_mosquitto if the binary is missing."""
    require_mosquitto()
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture(scope="module")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """An amqtt broker in a background thread for the module; skipped without amqtt."""
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as broker:
        yield broker


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    """Poll `check` every 50 ms until it holds or `timeout` s pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()
