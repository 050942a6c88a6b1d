"""MqttTransport: the Transport interface on paho-mqtt 2.x (MQTT 3.1.1).

Design choices, and why:

* Connect blocks in ``__init__`` until CONNACK (or raises ``ConnectionError``) so a role
  either runs connected or fails loudly at start; after that paho's network thread
  (``loop_start``) reconnects on its own with back-off, and ``on_connect`` re-sends every
  subscription, because with a clean session a broker forgets them on disconnect.
* With ``loop=`` (a :class:`~splitedge.protocol.mqtt_loop.ClientLoop`) the client has no thread
  of its own: the shared loop reads, writes, pings and reconnects it with the same back-off, one
  descriptor per client, so one process holds thousands of clients (``splitedge sim``, the
  scale bench). Everything else (QoS, will, births, resubscription, counters) is the same code.
* A failed connect names its cause: a refused login as an authentication failure (the broker
  is plainly up), a TLS/plain mismatch or an untrusted certificate as soon as the first attempt
  fails (our own handshake, at most HANDSHAKE_TIMEOUT_S) rather than at the connect timeout,
  and only a silent address asks whether the broker runs. No message or log line shows a
  password (``credentials.redact_url``; ``self.url`` has no login at all).
* The last will (a retained, QoS 1 encoded Envelope, typically ``status: offline``) is set
  before connecting, so the broker announces a crashed node without any help from it. It is
  minted afresh (a new msg_id, a new signature) before every connect (paho's on_pre_connect),
  and a clean ``close(offline=True)`` says offline in a new message too: a receiver that had a
  will of this node drops an identical copy as a duplicate, and would keep the node online.
* Handlers run on paho's network thread (or the loop's). The inbound chain (protocol/inbound.py)
  never raises: bad messages and failing handlers are logged and counted.
* Byte accounting: PUBLISH sizes come from the MQTT 3.1.1 framing; control packets are
  counted from paho's own "Sending X"/"Received X" log events (CONNECT, SUBACK, PUBACK,
  PINGREQ, ...), which fire once per packet actually written or read. Re-sends of in-flight
  messages after a reconnect are not counted (paho does not expose them).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from splitedge.protocol.accounting import (
    CONNACK_BYTES,
    DISCONNECT_BYTES,
    PINGREQ_BYTES,
    PINGRESP_BYTES,
    PUBACK_BYTES,
    UNSUBACK_BYTES,
    connect_packet_bytes,
    suback_packet_bytes,
    subscribe_packet_bytes,
    unsubscribe_packet_bytes,
)
from splitedge.protocol.codec import Envelope
from splitedge.protocol.credentials import ENV, PORTS, check_scheme, redact_url
from splitedge.protocol.credentials import TLS_SCHEMES as CREDENTIAL_TLS_SCHEMES
from splitedge.protocol.inbound import WIRE_STEPS, Step
from splitedge.protocol.mqtt_loop import ClientLoop
from splitedge.protocol.signing import KeyRing, Signer
from splitedge.protocol.transport import DEFAULT_MAX_BYTES, Transport, wait_for

logger = logging.getLogger(__name__)

DEFAULT_PORTS = PORTS
TLS_SCHEMES = tuple(s.removesuffix("://") for s in CREDENTIAL_TLS_SCHEMES)  # ("mqtts", "ssl")
HANDSHAKE_TIMEOUT_S = 3.0  # our own TLS probe: a listener that does not answer TLS is named in seconds
AUTH_REFUSALS = ("Bad user name or password", "Not authorized")  # CONNACK 4 and 5 (Mosquitto sends 5)
UNREACHABLE_HINT = "is it running, and is the URL right?"

# Control packets recognised in paho's log lines -> (direction, size or None if computed).
_LOGGED_CONTROL: dict[str, tuple[str, int | None]] = {
    "Sending CONNECT": ("out", None),
    "Sending PUBACK": ("out", PUBACK_BYTES),
    "Sending PINGREQ": ("out", PINGREQ_BYTES),
    "Sending DISCONNECT": ("out", DISCONNECT_BYTES),
    "Received CONNACK": ("in", CONNACK_BYTES),
    "Received SUBACK": ("in", suback_packet_bytes(1)),  # we always subscribe one filter per packet
    "Received UNSUBACK": ("in", UNSUBACK_BYTES),
    "Received PUBACK": ("in", PUBACK_BYTES),
    "Received PINGRESP": ("in", PINGRESP_BYTES),
}


def parse_url(url: str) -> tuple[str, str, int, str | None, str | None]:
    """``mqtt[s]://[user[:pass]@]host[:port]`` -> (scheme, host, port, user, password); a URL of
    any other scheme is a one-line ValueError naming the ones that work."""
    scheme = check_scheme(url)
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a port that is not a number, often a password with an unescaped '/' or '@'
        raise ValueError(f"broker URL {redact_url(url)!r}: {exc} (percent-encode special characters in a "
                         f"password, or use --password-file)") from None
    if not host:
        raise ValueError(f"broker URL has no host: {redact_url(url)!r}")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return scheme, host, port or DEFAULT_PORTS[scheme], user, password


def check_reachable(url: str, timeout: float = 5.0) -> None:
    """One TCP connect to the broker: a wrong URL or a broker that is not running fails in
    seconds, before a simulation opens hundreds of clients that would each retry for a minute."""
    _, host, port, _, _ = parse_url(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConnectionError(f"cannot connect to the MQTT broker at {redact_url(url)}: {reason}; "
                              f"{UNREACHABLE_HINT}") from None


def refusal(reason_code: Any, username: str | None) -> str:
    """What a failed CONNACK means for the user: a wrong login is named as such (the broker is
    plainly running), with where the user name and the password come from."""
    if str(reason_code) not in AUTH_REFUSALS:
        return f"the broker refused the connection: {reason_code}"
    login = f"as user {username!r}" if username else "with no user name"
    return (f"the broker refused the connection: authentication failed ({reason_code}) {login}: wrong or "
            f"missing user name or password; the user name goes in the URL (mqtt://NAME@host), the password in "
            f"a role's --password-file (env {ENV['password_file']}) or the URL")


def tls_problem(raw: socket.socket, host: str, files: tuple[str | None, str | None, str | None]) -> str | None:
    """Our own TLS handshake on `raw` with the client's files: what TLS refused, or None when it
    works. Bounded by HANDSHAKE_TIMEOUT_S, so a plain listener is named in seconds."""
    ca, cert, key = files
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    plain = "the listener may be plain MQTT (use mqtt://)"
    raw.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            return _after_handshake(tls)
    except ssl.SSLCertVerificationError as exc:
        where = f"--ca-file {ca}" if ca else f"the system's CA store (give --ca-file or env {ENV['ca_file']})"
        return (f"the TLS handshake failed: the broker's certificate is not trusted: {exc.verify_message}; is it "
                f"signed by {where}?")
    except ssl.SSLError as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        if "ALERT" not in str(reason).upper():  # no TLS answer at all (WRONG_VERSION_NUMBER, EOF)
            return f"the TLS handshake failed ({reason}): {plain}"
        return f"the TLS handshake failed: the broker sent {reason}"
    except TimeoutError:
        return f"the TLS handshake got no answer within {HANDSHAKE_TIMEOUT_S:g}s: {plain}"
    except OSError as exc:  # a plain MQTT listener resets a ClientHello
        return f"the TLS handshake failed ({exc.strerror or exc}): {plain}"


def _after_handshake(tls: ssl.SSLSocket) -> str | None:
    """TLS 1.3: a broker that wants a client certificate says so only after the handshake."""
    tls.settimeout(1.0)
    try:
        tls.recv(1)
    except ssl.SSLError as exc:
        if "CERTIFICATE_REQUIRED" in str(exc) or "certificate required" in str(exc):
            return "the broker requires a client certificate: give --cert-file and --key-file"
        return f"the broker closed the TLS connection ({getattr(exc, 'reason', None) or exc})"
    except OSError:
        pass
    return None


def speaks_tls(raw: socket.socket, host: str) -> bool:
    """Whether the listener behind `raw` answers a TLS handshake (any certificate, any alert):
    how an mqtt:// URL that reached a TLS port is told apart from a broker that hung up."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    raw.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        with context.wrap_socket(raw, server_hostname=host):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(getattr(exc, "reason", None) or exc).upper()
    except OSError:
        return False


class MqttTransport(Transport):
    """A connected MQTT client with splitedge semantics (see module docstring)."""

    def __init__(self, url: str, *, client_id: str, role: str, will: tuple[str, Envelope] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, username: str | None = None, password: str | None = None,
                 ca_certs: str | None = None, certfile: str | None = None, keyfile: str | None = None,
                 connect_timeout: float = 10.0, keepalive: int = 30,
                 reconnect_min: float = 0.5, reconnect_max: float = 10.0, subscribe_timeout: float = 5.0,
                 signer: Signer | None = None, keyring: KeyRing | None = None,
                 loop: ClientLoop | None = None, steps: Sequence[Step] = WIRE_STEPS) -> None:
        super().__init__(role=role, client_id=client_id, max_bytes=max_bytes, signer=signer, keyring=keyring,
                         steps=steps)
        if loop is not None and loop.in_loop_thread():
            raise ValueError("create an MqttTransport outside its ClientLoop's thread (not in a handler): "
                             "its connect waits for the loop")
        self._loop = loop
        self._session: Any = None  # the ClientLoop's Session, in loop mode
        self._reconnect = (reconnect_min, reconnect_max)
        scheme, self.host, self.port, url_user, url_password = parse_url(url)
        self.url = f"{scheme}://{self.host}:{self.port}"  # never keep the password in the URL
        self._username = username if username is not None else url_user
        self._password = password if password is not None else url_password
        # signed at each connect, fired by the broker later: a will has its own replay window (signing.py)
        self._keep_last_word(will)
        self._connected = threading.Event()
        self._connect_error: str | None = None
        self._closed = False
        self._sent = 0  # publishes handed to paho; compared with acks in flush()
        self._acked = 0
        self._count_lock = threading.Lock()
        self.reconnects = 0
        self._had_connection = False
        self._failed_attempts = 0  # connect attempts that failed before the first CONNACK
        self._net_thread: int | None = None
        self._subacks: set[int] = set()
        self.subscribe_timeout = subscribe_timeout
        self._client = self._make_client(scheme, keepalive, ca_certs, certfile, keyfile, reconnect_min, reconnect_max)
        self._connect(keepalive, connect_timeout)

    # -- setup ----------------------------------------------------------------------------
    def _make_client(self, scheme: str, keepalive: int, ca_certs: str | None, certfile: str | None,
                     keyfile: str | None, reconnect_min: float, reconnect_max: float) -> paho.Client:
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=paho.MQTTv311, clean_session=True)
        self._tls = (ca_certs, certfile, keyfile) if scheme in TLS_SCHEMES else None
        if self._tls is not None:
            try:
                client.tls_set(ca_certs=ca_certs, certfile=certfile, keyfile=keyfile)
            except (ssl.SSLError, OSError) as exc:  # not PEM, a key that does not match its certificate, ...
                raise ValueError(f"cannot use the TLS files (CA {ca_certs}, certificate {certfile}, key {keyfile}): "
                                 f"{getattr(exc, 'reason', None) or exc}") from None
        if self._username is not None:
            client.username_pw_set(self._username, self._password)
        if self._will:
            client.will_set(self._will[0], self._will[1], qos=1, retain=True)
        client.reconnect_delay_set(reconnect_min, reconnect_max)  # type: ignore[arg-type]
        client.max_inflight_messages_set(100)
        client.on_pre_connect = self._on_pre_connect
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._on_connect_fail
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_log = self._on_log
        return client

    def _connect(self, keepalive: int, timeout: float) -> None:
        """Block until CONNACK; paho retries refused TCP connects until the deadline."""
        self._client.connect_async(self.host, self.port, keepalive=keepalive)
        if self._loop is None:
            self._client.loop_start()
        else:
            self._session = self._loop.attach(self._client, reconnect_min=self._reconnect[0],
                                              reconnect_max=self._reconnect[1])
        reason = self._await_connack(time.monotonic() + timeout, timeout)
        if reason is None:
            logger.info("%s (%s) connected to %s", self.client_id, self.role, self.url)
            return
        self._closed = True
        self._stop_network(timeout=1.0)
        raise ConnectionError(f"cannot connect to the MQTT broker at {self.url}: {reason}")

    def _await_connack(self, deadline: float, timeout: float) -> str | None:
        """None once connected, else why not: a refused login at once, a TLS mismatch as soon as
        the first attempt fails (retrying cannot fix it), anything else at the deadline (a broker
        that is still starting gets the whole timeout)."""
        if self._wait_connack(deadline, or_failed=True) and not self._connected.is_set() \
                and self._connect_error is None:
            reason, certain = self._diagnose(timeout)  # an attempt failed before the deadline
            if certain:
                return reason
            self._wait_connack(deadline, or_failed=False)
        if self._connected.is_set():
            return None
        return self._connect_error or self._diagnose(timeout)[0]

    def _wait_connack(self, deadline: float, *, or_failed: bool) -> bool:
        """Wait until connected, refused, the deadline, or (`or_failed`) a failed attempt."""
        return wait_for(lambda: self._connected.is_set() or self._connect_error is not None
                        or (or_failed and self._attempt_failed()), max(0.0, deadline - time.monotonic()))

    def _attempt_failed(self) -> bool:
        """A connect attempt failed before CONNACK: paho's own thread reports it in
        on_connect_fail, a ClientLoop counts it, and a socket closed early is seen in on_disconnect."""
        return self._failed_attempts > 0 or (self._session is not None and self._session.attempts > 0)

    def _diagnose(self, timeout: float) -> tuple[str, bool]:
        """(why no CONNACK came, whether that is certain): certain when something listens but
        speaks TLS where we do not (or the reverse), or refuses our TLS files; not when nothing
        listens (yet)."""
        try:
            raw = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
        except OSError as exc:
            return f"no broker reachable within {timeout:g}s ({exc}); {UNREACHABLE_HINT}", False
        with raw:
            if self._tls is not None:
                problem = tls_problem(raw, self.host, self._tls)
                if problem is not None:
                    return problem, True
                return f"TLS works but no CONNACK within {timeout:g}s (does the broker accept this login?)", False
            if self._failed_attempts and speaks_tls(raw, self.host):
                return (f"no CONNACK: the broker closed the connection, and {self.host}:{self.port} speaks TLS: "
                        f"use mqtts:// (with --ca-file for a private CA)"), True
        return f"TCP connects but no CONNACK within {timeout:g}s (TLS/port mismatch?); {UNREACHABLE_HINT}", False

    # -- paho callbacks (network thread: must never raise) ------------------------------
    def _on_pre_connect(self, client: paho.Client, userdata: Any) -> None:
        """Before every CONNECT (the first and each reconnect): arm a will of its own, so a
        will that fires after an earlier one fired is not a duplicate to its receivers."""
        if self._last_word is None:
            return
        try:
            self._will = self._mint_will()
            client.will_set(self._will[0], self._will[1], qos=1, retain=True)  # type: ignore[index]
        except Exception:  # keep the will armed before; never break a reconnect
            logger.exception("%s: re-arming the last will failed", self.client_id)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._connect_error = refusal(reason_code, self._username)
            # before the first CONNACK the ConnectionError says it; later (a login revoked) only this does
            logger.log(logging.WARNING if self._had_connection else logging.DEBUG, "%s: %s: %s", self.client_id,
                       self.url, self._connect_error)
            return
        self._net_thread = threading.get_ident()
        with self._count_lock:
            self._subacks.clear()
        patterns = self._subscriptions()
        for pattern, qos in patterns:  # clean session: the broker forgot them
            self._subscribe_now(pattern, qos)
        if self._had_connection:
            self.reconnects += 1
            self._republish_births()  # the broker fired our will while we were away
            logger.info("%s: reconnected to %s, resubscribed %d pattern(s)", self.client_id, self.url, len(patterns))
        self._had_connection = True
        self._connected.set()

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self._failed_attempts += 1  # TCP refused, TLS refused or timed out (paho's own thread only)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self._connected.clear()
        if not self._had_connection:
            self._failed_attempts += 1  # closed before CONNACK: a TLS listener does that to plain MQTT
        if not self._closed and self._had_connection:
            logger.warning("%s: lost connection to %s (%s); reconnecting", self.client_id, self.url, reason_code)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            self._reject(repr(msg._topic), "topic.encoding", "topic is not valid UTF-8")
            return
        self._on_inbound(topic, msg.payload, msg.qos)

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        if any(rc.is_failure for rc in reason_codes):
            logger.warning("%s: broker refused subscription (mid %d): %s", self.client_id, mid, reason_codes)
        with self._count_lock:
            self._subacks.add(mid)

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        with self._count_lock:
            self._acked += 1

    def _on_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        head = " ".join(buf.split(" ", 2)[:2])
        entry = _LOGGED_CONTROL.get(head)
        if entry is not None:
            direction, size = entry
            if size is None:  # CONNECT: depends on our id, will and credentials
                size = connect_packet_bytes(self.client_id, will_topic=self._will and self._will[0],
                                            will_payload_len=len(self._will[1]) if self._will else 0,
                                            username=self._username, password=self._password)
            self.counters.record_control(direction, size, head.split(" ")[1])
        elif level in (paho.MQTT_LOG_WARNING, paho.MQTT_LOG_ERR) and not self._closed:
            # paho 2.2 logs "Client is not connected" at ERR once after a clean disconnect (hence
            # not when closed); failures before the first CONNACK end up in ConnectionError.
            logger.log(logging.WARNING if self._had_connection else logging.DEBUG, "%s: paho: %s",
                       self.client_id, buf)

    # -- Transport ------------------------------------------------------------------------
    def _send(self, topic: str, payload: bytes, *, qos: int, retain: bool, wait: float | None) -> None:
        if self._closed:
            raise ConnectionError(f"{self.client_id}: transport is closed")
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
            raise ConnectionError(f"{self.client_id}: paho outgoing queue full, message to {topic} dropped")
        with self._count_lock:
            self._sent += 1
        if wait is not None and not self._on_net_thread():
            # paho leaves rc=NO_CONN on messages queued while offline even after they are
            # delivered on reconnect, so is_published()/wait_for_publish() would raise: poll the flag.
            if not wait_for(lambda: info._published, wait):  # noqa: SLF001
                raise TimeoutError(f"{self.client_id}: no PUBACK for {topic} within {wait:g}s")

    def _send_subscribe(self, pattern: str, qos: int) -> None:
        """Subscribe and, from a caller's thread, wait for the SUBACK so that a publish made
        right after ``subscribe()`` returns cannot overtake the subscription on the broker."""
        mid = self._subscribe_now(pattern, qos)
        if mid is None or self._on_net_thread():
            return  # offline (on_connect will resubscribe) or inside a handler (would deadlock)
        if not wait_for(lambda: self._take_suback(mid), self.subscribe_timeout):
            logger.warning("%s: no SUBACK for %s within %gs", self.client_id, pattern, self.subscribe_timeout)

    def _subscribe_now(self, pattern: str, qos: int) -> int | None:
        rc, mid = self._client.subscribe(pattern, qos=qos)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            logger.debug("%s: subscribe %s deferred (%s)", self.client_id, pattern, paho.error_string(rc))
            return None
        self.counters.record_control("out", subscribe_packet_bytes([pattern]), "SUBSCRIBE")
        return mid

    def _take_suback(self, mid: int) -> bool:
        with self._count_lock:
            if mid in self._subacks:
                self._subacks.discard(mid)
                return True
            return False

    def _send_unsubscribe(self, pattern: str) -> None:
        rc, _ = self._client.unsubscribe(pattern)
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
            self.counters.record_control("out", unsubscribe_packet_bytes([pattern]), "UNSUBSCRIBE")

    def _on_net_thread(self) -> bool:
        """True on the thread that reads this client's socket, where waiting for an ack deadlocks."""
        if self._loop is not None:
            return self._loop.in_loop_thread()
        return threading.get_ident() == self._net_thread

    def on_raw(self, topic: str, callback: Any) -> None:
        """Hand each PUBLISH on exactly `topic` to ``callback(payload)``, outside the envelope
        chain (paho's per-topic callback): the identity check's echo (runtime/session.py)."""
        self._client.message_callback_add(topic, lambda client, userdata, msg: callback(bytes(msg.payload)))

    @property
    def connected(self) -> bool:
        """True while a CONNACK'd session is up."""
        return self._connected.is_set()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every publish so far is acknowledged (QoS 1) or written (QoS 0)."""
        def done() -> bool:
            with self._count_lock:
                return self._acked >= self._sent
        return wait_for(done, 0.0 if self._on_net_thread() else timeout)

    def close(self, *, offline: bool = False, timeout: float = 2.0) -> None:
        """Flush, then disconnect cleanly (the broker then discards the will).

        ``offline=True`` first publishes the offline status (the will's envelope with a new
        msg_id, signed as an ordinary frame), so peers see the node leave even though a clean
        disconnect suppresses the will, and see it even when a will of this node fired before.
        """
        if self._closed:
            return
        if offline and self._last_word is not None and self.connected:
            try:
                self._say_offline(wait=timeout)
            except (TimeoutError, ConnectionError) as exc:
                logger.warning("%s: offline status not confirmed: %s", self.client_id, exc)
        if not self.flush(timeout):
            logger.warning("%s: closing with unacknowledged messages", self.client_id)
        self._closed = True
        self._stop_network(timeout)
        logger.info("%s: disconnected from %s", self.client_id, self.url)

    def _stop_network(self, timeout: float) -> None:
        """Send DISCONNECT and stop driving the client: its own thread, or its loop session."""
        if self._session is not None:
            self._loop.release(self._session, timeout)  # type: ignore[union-attr]
            return
        self._client.disconnect()
        self._client.loop_stop()
        # paho 2.2 keeps loop_start's wake-up socketpair open until the Client is garbage
        # collected. A process that opens and closes many clients (the bench runs several
        # 200-device sims in one process) then climbs past file descriptor 1024, beyond which
        # paho's select() cannot watch a new client's socket and its CONNACK never arrives.
        reset = getattr(self._client, "_reset_sockets", None)
        if callable(reset):
            reset()
