"""Shared fixtures: real brokers on free ports (never the system broker on 1883).

Brokers are module-scoped: starting Mosquitto costs ~50 ms and amqtt ~100 ms, but tests that
restart or kill a broker get their own instance instead of sharing one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from splitedge.protocol.broker import EmbeddedBroker, MosquittoBroker


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[MosquittoBroker]:
    """A private Mosquitto ($SYS every 1 s) for the module; skipped if the binary is missing."""
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto binary not installed")
    with MosquittoBroker() as broker:
        yield broker


@pytest.fixture(scope="module")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """An amqtt broker in a background thread for the module; skipped without amqtt."""
    pytest.importorskip("amqtt")
    with EmbeddedBroker() as broker:
        yield broker
