"""Brokers for simulation and tests: an embedded amqtt broker and a Mosquitto subprocess.

``splitedge sim`` needs a broker without asking the user to install one, so
:class:`EmbeddedBroker` runs amqtt (pure Python) on its own asyncio loop in a background
thread. Integration tests and the byte-agreement check use :class:`MosquittoBroker`, the
broker we deploy on edge sites, started on a free port with a throw-away config so tests
never touch a system broker.

amqtt notes (0.12.1): it has no maximum-packet-size setting (payloads are read with
``readexactly``, so a 100 MB PUBLISH was read whole), no deadline for the CONNECT packet (a
connection that sends nothing was kept for ever), and a connection whose peer went away before
CONNECT was never closed (3,000 of them stayed in CLOSE_WAIT: a descriptor each, until the
process ran out). :class:`EmbeddedBroker` adds all three, in front of amqtt (see
:class:`FloodGuard`): every connection must send its CONNECT within ``connect_timeout`` seconds;
a packet longer than ``max_packet_size`` (Mosquitto's setting, default the deploy files' value)
ends its connection when its header arrives, before its body is read; every connection amqtt
is done with is closed; and at most ``max_connections`` are open at once (default: half the
process's open-file limit), a new one evicting the oldest still without CONNECT
or else being closed at once. Its default plugins include a per-packet logger and an event
logger, which we leave out; ``Broker()`` must be created inside the running loop (it calls
``asyncio.get_running_loop()``); it gives a subscriber 5 s (not configurable) to acknowledge a
QoS 1 message it has already written to the socket, and past that logs a warning and a
traceback for each one (see :class:`LateAcks`).
"""

from __future__ import annotations

import asyncio
import collections
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
from .limits import DEFAULT_MAX_BYTES

logger = logging.getLogger(__name__)

MAX_PACKET_SIZE = DEFAULT_MAX_BYTES + 1024 * 1024
"""The embedded broker's default max_packet_size, 68157440 bytes: the value of the deploy files'
(deploy/mosquitto/*.conf), a little above the receivers' 64 MiB frame cap plus topic, MQTT
header and signature trailer, so the broker never drops a frame a receiver would accept."""
CONNECT_TIMEOUT_S = 5.0
"""Seconds a new connection has to deliver its CONNECT (a connection whose bytes have started to
arrive by then gets as long again, once); then it is closed."""
CONNECTIONS_PER_FD = 0.5
"""With max_connections left to the open-file limit, at most this share of the soft limit: a sim's
clients share the broker's process (a descriptor each), asyncio accepts a burst of connections
(up to its listen backlog, 100, per wake-up) before the guard sees them, and connections the
guard closed are released a loop turn later. A broker that used every descriptor could not
accept, and said `Too many open files` each second (3,000 idle connections at a limit of 1,024
made amqtt log it 77,000 times)."""


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


class _PacketFraming:
    """Follows MQTT's framing over the bytes amqtt reads (one type byte, a 1-4 byte remaining
    length, the body), so a packet's length is known as soon as its header is in: a packet over
    ``max_size`` bytes in all, or a malformed length, raises :class:`_Refused` before its body
    is read. amqtt reads a header a byte at a time and a body in reads that end with it; a read
    that would cross the end of the packet it starts in means amqtt took the packet for another
    length than its header gave (a CONNECT's fields need not fill it), and is refused before it
    is made (``check_read``): no read, and so no packet amqtt parses, outgrows one framed packet."""

    __slots__ = ("max_size", "state", "length", "multiplier", "header", "left", "packets")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.state = 0  # 0: packet type byte next, 1: remaining-length bytes, 2: body
        self.length = self.multiplier = self.header = self.left = 0
        self.packets = 0  # complete packets so far; the first is the CONNECT

    def check_read(self, n: int) -> None:
        """Refuse a read of ``n`` bytes that would cross the end of the current packet's header or body."""
        if n == 0 or (self.state == 2 and 0 < n <= self.left) or (self.state != 2 and n == 1):
            return
        raise _Refused("malformed", f"a packet whose fields overrun its length (a read of {n} bytes with "
                                    f"{self.left if self.state == 2 else 1} left in it)")

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.state == 2:
                take = min(self.left, n - i)
                self.left -= take
                i += take
                if self.left == 0:
                    self.state, self.packets = 0, self.packets + 1
            elif self.state == 0:
                self.state, self.length, self.multiplier, self.header = 1, 0, 1, 1
                i += 1
            else:
                byte = data[i]
                i += 1
                self.header += 1
                self.length += (byte & 0x7F) * self.multiplier
                self.multiplier *= 128
                if byte & 0x80:
                    if self.header > 4:  # a 5th length byte: MQTT allows four
                        raise _Refused("malformed", "a remaining length longer than 4 bytes")
                    continue
                total = self.header + self.length
                if total > self.max_size:
                    raise _Refused("oversize", f"a packet of {total} bytes > max_packet_size {self.max_size}")
                self.left = self.length
                if self.left == 0:
                    self.state, self.packets = 0, self.packets + 1
                else:
                    self.state = 2


class _Refused(Exception):
    def __init__(self, why: str, text: str) -> None:
        super().__init__(text)
        self.why = why


class _Connection:
    """One accepted TCP connection, as the guard follows it."""

    __slots__ = ("reader", "writer", "framing", "accepted", "timer", "extended", "evicted", "refused", "bytes_in")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_packet_size: int) -> None:
        self.reader, self.writer = reader, writer
        self.framing = _PacketFraming(max_packet_size)
        self.accepted = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.extended = self.evicted = self.refused = False
        self.bytes_in = 0

    @property
    def connected(self) -> bool:
        """Its first packet (the CONNECT) has been read whole."""
        return self.framing.packets > 0

    def abort(self) -> None:
        transport = self.writer.transport
        if not transport.is_closing():
            transport.abort()


class FloodGuard:
    """What the embedded broker adds in front of amqtt against floods: a CONNECT deadline, a
    packet-size cap, a connection cap, and closing every connection amqtt is done with.

    Lives on the broker's loop; its counters (``stats()``) are plain ints, read from any thread.
    A refusal is logged once at WARNING per cause, then at DEBUG, and counted: a flood must not
    become a flood of log lines (the broker says how many of each when it stops)."""

    CAUSES = ("no_connect", "oversize", "malformed", "full", "evicted", "extended", "closed")

    def __init__(self, *, max_packet_size: int, connect_timeout: float, max_connections: int | None) -> None:
        self.max_packet_size = int(max_packet_size)
        self.connect_timeout = float(connect_timeout)
        self.max_connections = max_connections
        self.pending: collections.OrderedDict[_Connection, None] = collections.OrderedDict()  # no CONNECT yet
        self.open = 0
        self.peak_open = 0
        # every key from the start: stats() copies the dict from other threads, and a dict that
        # gained a key while being copied would raise
        self.counts: collections.Counter[str] = collections.Counter(dict.fromkeys(self.CAUSES, 0))
        self._said: set[str] = set()

    def limit(self) -> int:
        """Connections open at once: the setting, else half the soft open-file limit (CONNECTIONS_PER_FD)."""
        if self.max_connections is not None:
            return self.max_connections
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ImportError, OSError, ValueError):  # not on a POSIX system: no limit we can read
            return 1 << 30
        return (1 << 30) if soft == resource.RLIM_INFINITY else max(16, int(soft * CONNECTIONS_PER_FD))

    def stats(self) -> dict[str, int]:
        """Open connections (and the most at once), those still without CONNECT, and the counts
        of each refusal: `no_connect` (closed at the CONNECT deadline), `oversize` (a packet over
        max_packet_size), `malformed` (a bad packet length), `full` (refused at the cap),
        `evicted` (an idle one closed to make room), `closed` (connections amqtt ended), and
        `extended` (connections given a second CONNECT deadline: their bytes had started)."""
        return {"open": self.open, "peak_open": self.peak_open, "pending": len(self.pending), **self.counts}

    def _say(self, why: str, text: str) -> None:
        self.counts[why] += 1
        first = why not in self._said
        self._said.add(why)
        logger.log(logging.WARNING if first else logging.DEBUG, "embedded broker: %s (%s; counted, further ones are "
                   "logged at DEBUG)" if first else "embedded broker: %s (%s)", text, why)

    async def serve(self, broker: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    listener_name: str) -> None:
        """amqtt's handling of one accepted connection, guarded (Broker.stream_connected)."""
        from amqtt.adapters import StreamWriterAdapter

        conn = _Connection(reader, writer, self.max_packet_size)
        if not self._admit(conn):
            return
        _keepalive(writer)
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        self.pending[conn] = None
        conn.timer = asyncio.get_running_loop().call_later(self.connect_timeout, self._expire, conn)
        try:
            await broker._client_connected(listener_name, _guarded_reader(reader, conn, self), StreamWriterAdapter(writer))
        except Exception as exc:  # noqa: BLE001 - amqtt's own errors end the connection, never the listener
            logger.debug("embedded broker: a connection ended with %r", exc)
        finally:
            if conn.timer is not None:
                conn.timer.cancel()
            self.pending.pop(conn, None)
            self.open -= 1
            self.counts["closed"] += 1
            conn.abort()  # amqtt leaves a connection that failed before CONNECT open (CLOSE_WAIT)

    def _admit(self, conn: _Connection) -> bool:
        """Room for one more connection: under the cap, or by evicting the oldest connection still
        without CONNECT; else the new one is closed at once."""
        if self.open < self.limit():
            return True
        if self.pending:
            oldest, _ = self.pending.popitem(last=False)
            oldest.evicted = True
            self._say("evicted", f"{self.open} connections open (the limit): closed the oldest one without CONNECT "
                                 f"({time.monotonic() - oldest.accepted:.1f} s old) to admit a new one")
            oldest.abort()
            return True
        self._say("full", f"{self.open} connections open (the limit): refused a new one")
        conn.abort()
        return False

    def _expire(self, conn: _Connection) -> None:
        """The CONNECT deadline: a connection still without its CONNECT is closed; one whose bytes
        have started to arrive (a busy loop may not have read them yet) gets one more deadline."""
        conn.timer = None
        if conn.connected or conn.writer.transport.is_closing():
            return
        if not conn.extended and (conn.bytes_in or len(getattr(conn.reader, "_buffer", b""))):
            conn.extended = True
            self.counts["extended"] += 1
            conn.timer = asyncio.get_running_loop().call_later(self.connect_timeout, self._expire, conn)
            return
        self.pending.pop(conn, None)
        self._say("no_connect", f"closed a connection that sent no CONNECT within {self.connect_timeout:g} s")
        conn.abort()

    def check(self, conn: _Connection, n: int) -> None:
        """amqtt is about to read ``n`` bytes on ``conn``: refuse a read past the packet's end."""
        try:
            conn.framing.check_read(n)
        except _Refused as refused:
            self._refuse(conn, refused)

    def read(self, conn: _Connection, data: bytes) -> None:
        """Bytes amqtt has just read on ``conn``: follow the framing; refuse an oversized packet."""
        conn.bytes_in += len(data)
        was_connected = conn.connected
        try:
            conn.framing.feed(data)
        except _Refused as refused:
            self._refuse(conn, refused)
        if conn.connected and not was_connected:
            self.pending.pop(conn, None)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None

    def _refuse(self, conn: _Connection, refused: _Refused) -> None:
        conn.refused = True
        self._say(refused.why, f"closed a connection that sent {refused}")
        conn.abort()
        raise ConnectionResetError(str(refused)) from None


def _guarded_reader(reader: asyncio.StreamReader, conn: _Connection, guard: FloodGuard) -> Any:
    """amqtt's reader adapter over ``reader``, every read shown to the guard first. A refused
    connection reads as reset (amqtt ends it as it ends a client that went away)."""
    from amqtt.adapters import StreamReaderAdapter

    class GuardedReader(StreamReaderAdapter):
        async def read(self, n: int = -1) -> bytes:
            if conn.refused:  # its next bytes are the refused packet's body: never parsed
                raise ConnectionResetError("connection refused by the broker")
            guard.check(conn, n)
            data = await super().read(n)
            guard.read(conn, data)
            return data

    return GuardedReader(reader)


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on an accepted socket: a peer that vanished without a FIN (power cut, lost
    link) is found in about 90 s and its connection closed, even when its MQTT keep-alive is 0."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass


class _PreConnectNoise(logging.Filter):
    """amqtt logs each connection that ends before its CONNECT (an ERROR and a WARNING when the
    peer closes, more when the guard closes it): a flood of them is counted by the guard instead."""

    PATTERNS = ("No data from ", "Failed to initialize client session", "Can't read first packet as CONNECT")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p in text for p in self.PATTERNS)


PRE_CONNECT_NOISE = _PreConnectNoise()


class EmbeddedBroker:
    """amqtt broker in a daemon thread; a context manager. ``url`` is ``mqtt://host:port``.

    ``max_packet_size`` (bytes, the whole MQTT packet, as Mosquitto's setting), ``connect_timeout``
    (seconds to the CONNECT) and ``max_connections`` (None: half the soft open-file limit)
    bound what one peer can take (see :class:`FloodGuard`); ``guard_stats()`` counts what they refused."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, sys_interval: int | None = None,
                 max_packet_size: int = MAX_PACKET_SIZE, connect_timeout: float = CONNECT_TIMEOUT_S,
                 max_connections: int | None = None) -> None:
        if max_packet_size < 1024 or connect_timeout <= 0 or (max_connections is not None and max_connections < 1):
            raise ValueError(f"embedded broker limits: max_packet_size {max_packet_size} (>= 1024), connect_timeout "
                             f"{connect_timeout} (> 0), max_connections {max_connections} (>= 1 or None)")
        self.host = host
        self.port = port
        self.sys_interval = sys_interval
        self.guard = FloodGuard(max_packet_size=max_packet_size, connect_timeout=connect_timeout,
                                max_connections=max_connections)
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

    def guard_stats(self) -> dict[str, int]:
        """Open connections and what the flood guard refused, by cause (FloodGuard.stats)."""
        return self.guard.stats()

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
        broker_log = logging.getLogger("amqtt.broker")
        if PRE_CONNECT_NOISE not in broker_log.filters:
            broker_log.addFilter(PRE_CONNECT_NOISE)
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

        guard = self.guard

        class GuardedBroker(Broker):
            async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                       listener_name: str) -> None:
                await guard.serve(self, reader, writer, listener_name)

        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        broker = GuardedBroker(self.config())
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
        refused = {k: v for k, v in self.guard.counts.items() if k not in ("closed", "extended") and v}
        if refused:
            logger.warning("embedded broker: closed or refused connections by cause: %s",
                           ", ".join(f"{k} {v}" for k, v in sorted(refused.items())))

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


def start_embedded_broker(port: int = 1883, host: str = "127.0.0.1", **limits: Any) -> EmbeddedBroker:
    """Start an embedded broker and return it running (caller stops it); ``limits`` are
    EmbeddedBroker's max_packet_size, connect_timeout and max_connections."""
    return EmbeddedBroker(port=port, host=host, **limits).start()


def serve_forever(port: int = 1883, host: str = "127.0.0.1", on_ready: Callable[[str], None] | None = None,
                  **limits: Any) -> None:
    """Blocking entry point for ``splitedge broker``: run until Ctrl-C (or SIGTERM).
    ``on_ready(url)`` is called once the broker listens.

    ``host="0.0.0.0"`` exposes the broker to the network; it accepts anonymous clients, each
    bounded by the broker's limits (EmbeddedBroker; ``limits`` overrides them).
    """
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGINT too: a process started in the background by a shell (`... &`, nohup) inherits it
        # ignored, and Python then never raises KeyboardInterrupt: the broker outlived every Ctrl-C
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        broker = start_embedded_broker(port, host, **limits)
        try:
            guard = broker.guard
            logger.info("embedded broker limits: CONNECT within %g s, packets of at most %d bytes, at most %d "
                        "connections at once", guard.connect_timeout, guard.max_packet_size, guard.limit())
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


__all__ = ["EmbeddedBroker", "MosquittoBroker", "FloodGuard", "MAX_PACKET_SIZE", "CONNECT_TIMEOUT_S", "free_port",
           "wait_port", "serve_forever", "start_embedded_broker", "read_sys"]
