"""Brokers for simulation and tests: an embedded amqtt broker and a Mosquitto subprocess.

``splitedge sim`` needs a broker without asking the user to install one, so
:class:`EmbeddedBroker` runs amqtt (pure Python) on its own asyncio loop in a background
thread. Integration tests and the byte-agreement check use :class:`MosquittoBroker`, the
broker we deploy on edge sites, started on a free port with a throw-away config so tests
never touch a system broker.

amqtt notes (0.12.1): it has no maximum-packet-size setting (payloads are read with
``readexactly``), so 8+ MiB messages pass; its default plugins include a per-packet logger
and an event logger, which we leave out; ``Broker()`` must be created inside the running
loop (it calls ``asyncio.get_running_loop()``); it gives a subscriber 5 s (not configurable) to
acknowledge a QoS 1 message it has already written to the socket, and past that logs a warning
and a traceback for each one (see :class:`LateAcks`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .children import spawn_tied

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_port(host: str, port: int, timeout: float = 10.0) -> bool:
    """True once something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.02)
    return False


class _SnapshotDict(dict):
    """amqtt 0.12.1 iterates its subscription table across `await`s (on connect and on every
    broadcast) while other clients subscribe, which raises "dictionary changed size during
    iteration" and drops a client under load. Iterating over a snapshot makes those loops safe."""

    def __iter__(self):  # type: ignore[override]
        return iter(list(super().keys()))

    def items(self):  # type: ignore[override]
        return list(super().items())

    def keys(self):  # type: ignore[override]
        return list(super().keys())


class LateAcks(logging.Filter):
    """Counts, instead of logging, amqtt's complaints about acknowledgements that came late.

    amqtt waits 5 s for a subscriber's PUBACK. In a sim, every node shares the broker's process
    and cores, and a round fans out megabytes of models, so a busy process acknowledges later
    than that: amqtt then logs a warning, drops the message from its in-flight table (it was
    written to the socket in full before the wait, so the subscriber has it) and logs the
    failed task with a traceback, then warns again when the late PUBACK arrives. A 200-device
    `fedcnn` round made thousands of such lines. They are counted here, and the broker says
    how many in one line when it stops.
    """

    PATTERNS = ("Timeout waiting for PUBACK", "PUBACK waiter with Id", "Received PUBACK for unknown pending")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()  # a failed task's line names its TimeoutError's message too
        if not any(p in text for p in self.PATTERNS):
            return True
        if text.startswith("Timeout waiting for PUBACK"):  # one per late message; its task's failure is the same one
            with self._lock:
                self.count += 1
        return False


LATE_ACKS = LateAcks()
"""Installed on amqtt's loggers by the first embedded broker of a process."""
_AMQTT_LOGGERS = ("amqtt.mqtt.protocol.handler", "amqtt.broker")


def count_late_acks() -> LateAcks:
    for name in _AMQTT_LOGGERS:
        log = logging.getLogger(name)
        if LATE_ACKS not in log.filters:
            log.addFilter(LATE_ACKS)
    return LATE_ACKS


class EmbeddedBroker:
    """amqtt broker in a daemon thread; a context manager. ``url`` is ``mqtt://host:port``."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, sys_interval: int | None = None) -> None:
        self.host = host
        self.port = port
        self.sys_interval = sys_interval
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._late_before = 0

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def late_acks(self) -> int:
        """Messages whose subscriber acknowledged after amqtt's 5 s, since this broker started
        (counted per process: brokers running at once in one process share the count)."""
        return LATE_ACKS.count - self._late_before

    def config(self) -> dict[str, Any]:
        """amqtt 0.12 config: one TCP listener, anonymous clients, no packet/event loggers."""
        plugins: dict[str, Any] = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
        if self.sys_interval:
            plugins["amqtt.plugins.sys.broker.BrokerSysPlugin"] = {"sys_interval": self.sys_interval}
        return {"listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
                "plugins": plugins}

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start and wait until the listener accepts connections; a busy port gets one retry."""
        import amqtt.broker  # noqa: F401 - a missing extra raises here, in the caller's thread, by name
        self._late_before = count_late_acks().count
        chosen = self.port
        for attempt in range(3):
            self.port = chosen or free_port(self.host)
            self._ready.clear()
            self._error = None
            self._thread = threading.Thread(target=self._run, name=f"amqtt-{self.port}", daemon=True)
            self._thread.start()
            if not self._ready.wait(timeout):
                raise RuntimeError(f"embedded broker did not start within {timeout:g}s on port {self.port}")
            # Broker.start() returns once the listener is bound, so no TCP probe is needed (a
            # probe that connects without CONNECT makes amqtt log an ERROR).
            if self._error is None:
                logger.info("embedded amqtt broker listening on %s", self.url)
                return self
            self._thread.join(timeout)
            if chosen:  # the caller asked for this port: do not silently move
                break
            logger.debug("embedded broker attempt %d on port %d failed: %s", attempt, self.port, self._error)
        raise RuntimeError(f"embedded broker failed to start on {self.host}:{self.port}: {self._error!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        from amqtt.broker import Broker  # optional dependency, imported only when needed

        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        broker = Broker(self.config())
        broker._subscriptions = _SnapshotDict(broker._subscriptions)  # see _SnapshotDict
        await broker.start()
        self._ready.set()
        await self._stop_event.wait()
        await broker.shutdown()

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down (disconnects clients) and join its thread; idempotent."""
        thread, loop, event = self._thread, self._loop, self._stop_event
        if thread is None:
            return
        if loop is not None and event is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("embedded broker thread did not stop within %gs", timeout)
        self._thread = None
        logger.info("embedded amqtt broker on port %d stopped", self.port)
        if self.late_acks:
            logger.warning("embedded broker: %d messages were acknowledged after amqtt's 5 s limit (a busy "
                           "process; each was sent in full, and none was resent); for runs this large, "
                           "Mosquitto carries the load better: --broker mqtt://host:port", self.late_acks)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MosquittoBroker:
    """The ``mosquitto`` binary on a free port with a temporary config; a context manager.

    ``$SYS`` is published every ``sys_interval`` seconds so tests can read the broker's own
    byte counters. ``restart()`` keeps the port, to test client reconnects.
    """

    def __init__(self, port: int = 0, extra_conf: str = "", *, host: str = "127.0.0.1", sys_interval: int = 1,
                 binary: str = "mosquitto") -> None:
        self.host = host
        self.port = port
        self.extra_conf = extra_conf
        self.sys_interval = sys_interval
        self.binary = binary
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def config_text(self) -> str:
        # Started as root, mosquitto switches to user "mosquitto", which cannot read the
        # caller's temp files (TLS keys, password files): stay the caller's user instead.
        user = "user root\n" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
        return (f"listener {self.port} {self.host}\n"
                f"{user}"
                "allow_anonymous true\n"
                f"sys_interval {self.sys_interval}\n"
                "persistence false\n"
                "log_dest stderr\n"
                "log_type error\nlog_type warning\nlog_type notice\n"
                f"{self.extra_conf}\n")

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        """Write the config, spawn mosquitto, wait for the port; RuntimeError with its log if not."""
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(f"{self.binary!r} not found on PATH (apt install mosquitto)")
        self.port = self.port or free_port(self.host)
        self._dir = self._dir or Path(tempfile.mkdtemp(prefix="splitedge-mosquitto-"))
        conf = self._dir / "mosquitto.conf"
        conf.write_text(self.config_text())
        log = open(self._dir / "mosquitto.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = spawn_tied([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)  # ends with us, even after kill -9
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if wait_port(self.host, self.port, 0.2):
                logger.info("mosquitto (pid %d) listening on %s", self._proc.pid, self.url)
                return self
        self._terminate()
        raise RuntimeError(f"mosquitto did not start on port {self.port}: {self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        """Last lines of the broker's log, for error messages."""
        if self._dir is None or not (self._dir / "mosquitto.log").exists():
            return ""
        return "\n".join((self._dir / "mosquitto.log").read_text(errors="replace").splitlines()[-n:])

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop(self) -> None:
        """Terminate the broker and delete its temp directory; idempotent."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self, down_for: float = 0.0) -> None:
        """Stop and start again on the same port (clients must reconnect and resubscribe)."""
        self._terminate()
        if down_for:
            time.sleep(down_for)
        self.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_broker(port: int = 1883, host: str = "127.0.0.1") -> EmbeddedBroker:
    """Start an embedded broker and return it running (caller stops it)."""
    return EmbeddedBroker(port=port, host=host).start()


def serve_forever(port: int = 1883, host: str = "127.0.0.1", on_ready: Callable[[str], None] | None = None) -> None:
    """Blocking entry point for ``splitedge broker``: run until Ctrl-C (or SIGTERM).
    ``on_ready(url)`` is called once the broker listens.

    ``host="0.0.0.0"`` exposes the broker to the network; it accepts anonymous clients.
    """
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGINT too: a process started in the background by a shell (`... &`, nohup) inherits it
        # ignored, and Python then never raises KeyboardInterrupt: the broker outlived every Ctrl-C
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        broker = start_embedded_broker(port, host)
        try:
            if on_ready is not None:
                on_ready(broker.url)
            logger.info("broker at %s; press Ctrl-C to stop", broker.url)
            while not stop.wait(0.5):
                pass
        finally:
            broker.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def read_sys(url: str, pattern: str, *, timeout: float,
             done: Callable[[dict[str, str]], bool] = lambda values: False) -> dict[str, str]:
    """A broker's own `$SYS` values under `pattern` (topic -> text, the retained ones it hands
    over on subscribe included), read with a plain paho client until `done(values)` or
    `timeout`: its byte and message counters, a bridge's connection state."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from splitedge.protocol.mqtt import parse_url

    _, host, port, _, _ = parse_url(url)
    values: dict[str, str] = {}
    lock = threading.Lock()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        with lock:
            values[msg.topic] = msg.payload.decode(errors="replace")

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"splitedge-sys-{time.monotonic_ns()}")
    client.on_message = on_message
    client.connect(host, port)
    client.subscribe(pattern, qos=0)
    client.loop_start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with lock:
                if done(dict(values)):
                    break
            time.sleep(0.1)
    finally:
        client.loop_stop()
        client.disconnect()
    with lock:
        return dict(values)


__all__ = ["EmbeddedBroker", "MosquittoBroker", "free_port", "wait_port", "serve_forever",
           "start_embedded_broker", "read_sys"]
