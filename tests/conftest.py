"""Shared fixtures: real brokers on free ports (never the system broker on 1883).

Brokers are module-scoped: starting Mosquitto costs ~50 ms and amqtt ~100 ms, but tests that
restart or kill a broker get their own instance instead of sharing one. The fixtures live in
brokers.py (so a subprocess test can import them): a missing Mosquitto skips locally and
fails on CI (CI=true).
"""

from __future__ import annotations

from brokers import embedded_broker, mosquitto, mosquitto_binary  # noqa: F401 - fixtures, found by name
