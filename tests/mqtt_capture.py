"""A raw MQTT client that keeps what a federation publishes: tests read the wire as a broker
carries it, with no splitedge code between (test_protocol_doc, test_private_reports)."""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt
from paho.mqtt.subscribeoptions import SubscribeOptions


class Capture:
    """A raw MQTT 5 client on `splitedge/#` that keeps every PUBLISH with the retain flag its
    publisher set (retain-as-published), as (topic, payload, retain, qos)."""

    def __init__(self, broker, name: str, topic: str = "splitedge/#", password: str | None = None) -> None:
        """With `password`, it logs in as `name` (a broker with logins: tests/app/test_provision.py)."""
        self.messages: list[tuple[str, bytes, bool, int]] = []
        self.lock = threading.Lock()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
        if password is not None:
            self.client.username_pw_set(name, password)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        self.client.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=True))
        assert self.subscribed.wait(5), "no SUBACK"

    def _on_message(self, client, userdata, msg) -> None:
        with self.lock:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain), msg.qos))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
