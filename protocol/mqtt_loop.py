"""ClientLoop: many paho clients driven by ONE thread on an epoll loop (paho's external-loop API).

``loop_start()`` gives every client its own thread and a wake-up socket pair, and waits with
``select()``: 3 descriptors and a thread per client, and nothing past descriptor 1023. Here one
thread waits on a :mod:`selectors` selector (epoll on Linux) holding each client's socket, so a
client costs one descriptor and no thread:

* paho calls ``on_socket_open`` / ``on_socket_close`` (always on this loop's thread, since only
  the loop connects and reads) and the loop (un)registers the socket for reading;
* ``on_socket_register_write`` may fire on any thread (a caller's ``publish()``): it marks the
  client and wakes the loop, which then watches the socket for writing while
  ``want_write()`` holds. The loop recomputes that interest itself after every read and write
  instead of trusting paho's unregister callback, which can race with a caller's publish;
* every ``tick`` seconds ``loop_misc()`` runs for each connected client (keepalive PINGREQs,
  dead-broker detection);
* reconnecting is the loop's job (``loop_start``'s auto-reconnect does not exist in this
  mode): a closed socket schedules ``reconnect()`` after a back-off that doubles from
  ``reconnect_min`` to ``reconnect_max`` and resets once the client is connected again;
* ``reconnect()`` opens the TCP connection and TLS handshake blocking (up to the client's
  connect timeout, 5 s by default), so it runs on a few connector threads (``connectors``),
  never on the loop thread: an unreachable or silent broker host stalls only the clients
  connecting to it, not the ones already connected. The socket is handed to the loop when
  paho opens it.

Handlers run on the loop thread and must not block (the runtimes' handlers only enqueue).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import resource
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho

log = logging.getLogger(__name__)

FD_SPARE = 64
"""Descriptors kept free beyond one per client: the loop's own, logs, data files, the broker probe."""


class Session:
    """One paho client on a :class:`ClientLoop`: its socket, back-off and interest."""

    def __init__(self, client: paho.Client, reconnect_min: float, reconnect_max: float) -> None:
        self.client = client
        self.sock: Any = None
        self.events = 0
        self.closing = False
        self.delay_min, self.delay_max = reconnect_min, reconnect_max
        self.delay = reconnect_min
        self.attempts = 0  # connect attempts that failed before a socket opened
        self.connecting = False  # a connector thread is in reconnect() for this client

    @property
    def open(self) -> bool:
        """True while the client has a socket (connecting or connected)."""
        return self.sock is not None


class ClientLoop:
    """One thread driving every attached paho client; a context manager (see module docstring)."""

    def __init__(self, *, name: str = "mqtt-loop", tick: float = 1.0, connectors: int = 4) -> None:
        self.name = name
        self.tick = tick
        self._connect_queue: queue.SimpleQueue[Session | None] = queue.SimpleQueue()
        self._connectors = [threading.Thread(target=self._connector, name=f"{name}-connect-{i}", daemon=True)
                            for i in range(max(1, connectors))]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._sessions: set[Session] = set()
        self._calls: deque[Callable[[], None]] = deque()
        self._marked: set[Session] = set()
        self._lock = threading.Lock()
        self._timers: list[tuple[float, int, Session]] = []
        self._seq = itertools.count()
        self._next_tick = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        for thread in self._connectors:
            thread.start()

    # -- any thread -----------------------------------------------------------------------
    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    @property
    def connectors(self) -> int:
        """Connector threads (each runs one blocking reconnect() at a time)."""
        return len(self._connectors)

    @property
    def clients(self) -> int:
        """Clients attached now."""
        return len(self._sessions)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (FIFO); thread-safe."""
        self._calls.append(fn)
        self._wake()

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now when on the loop thread, else queue it there (a connector's callbacks)."""
        if self.in_loop_thread():
            fn()
        else:
            self.call_soon(fn)

    def call_and_wait(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the loop thread and return its result (directly when already there)."""
        if self.in_loop_thread():
            return fn()
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(fn())
            finally:
                done.set()
        self.call_soon(run)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: loop did not run a call within {timeout:g}s")
        return box[0] if box else None

    def attach(self, client: paho.Client, *, reconnect_min: float = 0.5, reconnect_max: float = 10.0) -> Session:
        """Drive ``client`` (``connect_async()`` already called) from this loop; it connects now
        and reconnects with back-off whenever its connection drops, until :meth:`release`."""
        if self._stopping:
            raise RuntimeError(f"{self.name} is closed")
        session = Session(client, reconnect_min, reconnect_max)
        client.on_socket_open = lambda c, u, sock: self._on_loop(lambda: self._opened(session, sock))
        client.on_socket_close = lambda c, u, sock: self._on_loop(lambda: self._closed(session, sock))
        client.on_socket_register_write = lambda c, u, sock: self._mark(session)
        self.call_soon(lambda: self._add(session))
        return session

    def release(self, session: Session, timeout: float = 2.0) -> None:
        """Disconnect cleanly (the DISCONNECT written, so the broker drops the will) and stop
        driving the client; after ``timeout`` the socket is closed anyway. Idempotent."""
        if session.closing:
            return
        session.closing = True
        session.client.disconnect()
        if not self.in_loop_thread():
            deadline = time.monotonic() + timeout
            while session.open and time.monotonic() < deadline and self._thread.is_alive():
                time.sleep(0.005)
        if self._thread.is_alive():
            self.call_and_wait(lambda: self._remove(session), timeout)
        else:
            self._remove(session)

    def close(self, timeout: float = 5.0) -> None:
        """Close every client still attached (without DISCONNECT) and stop the thread."""
        if self._stopping:
            return
        self._stopping = True
        for _ in self._connectors:
            self._connect_queue.put(None)
        self._wake()
        self._thread.join(timeout)
        for session in list(self._sessions):
            self._remove(session)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> ClientLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        if self.in_loop_thread():
            return
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # a wake-up is already pending (or we are closing)
            pass

    def _mark(self, session: Session) -> None:
        """paho has bytes to write for this client (called on any thread)."""
        with self._lock:
            self._marked.add(session)
        self._wake()

    # -- paho socket callbacks (loop thread) ----------------------------------------------
    def _opened(self, session: Session, sock: Any) -> None:
        session.sock, session.events = sock, selectors.EVENT_READ
        self._selector.register(sock, selectors.EVENT_READ, session)

    def _closed(self, session: Session, sock: Any) -> None:
        if session.sock is sock:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            session.sock, session.events = None, 0
        if not session.closing and not self._stopping:
            self._schedule(session)

    # -- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._once()
            except Exception:  # the loop must outlive any one client's bug
                log.exception("%s: iteration failed", self.name)
                time.sleep(0.01)

    def _once(self) -> None:
        for key, mask in self._selector.select(self._timeout()):
            if key.data is None:
                self._drain_wake()
            else:
                self._serve(key.data, mask)
        while self._calls:
            self._calls.popleft()()
        with self._lock:
            marked, self._marked = self._marked, set()
        for session in marked:
            self._interest(session)
        self._fire_timers()

    def _timeout(self) -> float:
        if self._calls or self._marked:
            return 0.0
        due = self._next_tick if not self._timers else min(self._next_tick, self._timers[0][0])
        return max(0.0, min(due - time.monotonic(), self.tick))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _serve(self, session: Session, mask: int) -> None:
        client = session.client
        try:
            if mask & selectors.EVENT_READ:
                client.loop_read()
                while session.open and getattr(session.sock, "pending", lambda: 0)() > 0:  # TLS buffers
                    client.loop_read()
            if mask & selectors.EVENT_WRITE and session.open:
                client.loop_write()
        except Exception:
            log.exception("%s: client %s failed; dropping its connection", self.name, client._client_id)
            self._drop(session)
        self._interest(session)

    def _interest(self, session: Session) -> None:
        """Watch for writing exactly while paho has bytes queued."""
        if not session.open or session not in self._sessions:
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if session.client.want_write() else 0)
        if want != session.events:
            self._selector.modify(session.sock, want, session)
            session.events = want

    def _add(self, session: Session) -> None:
        self._sessions.add(session)
        self._attempt(session)

    def _remove(self, session: Session) -> None:
        session.closing = True
        if session.open:
            self._drop(session)
        self._sessions.discard(session)

    def _drop(self, session: Session) -> None:
        """Close the socket without MQTT courtesy (paho then calls on_socket_close)."""
        reset = getattr(session.client, "_reset_sockets", None)
        if callable(reset):
            reset()
        if session.open:  # paho did not call back: unregister ourselves
            self._closed(session, session.sock)

    def _schedule(self, session: Session) -> None:
        heapq.heappush(self._timers, (time.monotonic() + session.delay, next(self._seq), session))
        session.delay = min(session.delay * 2, session.delay_max)

    def _attempt(self, session: Session) -> None:
        """Hand the client to a connector thread (reconnect() blocks for TCP and TLS)."""
        if session.closing or session.open or session.connecting or session not in self._sessions:
            return
        session.connecting = True
        self._connect_queue.put(session)

    def _connector(self) -> None:
        """Connector thread: reconnect() one client at a time; the outcome goes back to the loop."""
        while (session := self._connect_queue.get()) is not None:
            try:
                session.client.reconnect()
            except Exception as exc:  # refused, unreachable, TLS refused, timed out: try again later
                self.call_soon(lambda s=session, e=exc: self._connect_failed(s, e))
            else:
                self.call_soon(lambda s=session: self._connect_done(s))

    def _connect_failed(self, session: Session, exc: BaseException) -> None:
        session.connecting = False
        session.attempts += 1
        log.debug("%s: connect of %s failed (%s); retry in %.1fs", self.name, session.client._client_id,
                  exc, session.delay)
        if session.open:
            self._drop(session)  # on_socket_close schedules the retry
        elif not session.closing and not self._stopping:
            self._schedule(session)

    def _connect_done(self, session: Session) -> None:
        session.connecting = False
        if session.closing or session not in self._sessions:
            if session.open:
                self._drop(session)
            return
        if not session.open:  # the socket closed before this call came through: a retry it skipped
            self._schedule(session)
            return
        self._interest(session)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, session = heapq.heappop(self._timers)
            self._attempt(session)
        if now >= self._next_tick:
            self._next_tick = now + self.tick
            self._misc()

    def _misc(self) -> None:
        """Keepalive for every open client; a connected client's back-off starts over."""
        for session in list(self._sessions):
            if not session.open:
                continue
            client = session.client
            try:
                client.loop_misc()
            except Exception:
                log.exception("%s: loop_misc of %s failed", self.name, client._client_id)
                self._drop(session)
            if client.is_connected():
                session.delay = session.delay_min
            self._interest(session)


def ensure_fd_limit(clients: int, spare: int = FD_SPARE) -> int:
    """Make room for ``clients`` sockets (one each on a :class:`ClientLoop`) plus ``spare``:
    raise this process's soft RLIMIT_NOFILE up to the hard limit when needed. Returns the soft
    limit now in force; RuntimeError naming the fix when even the hard limit is too low."""
    need = clients + spare
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else hard
    if hard != resource.RLIM_INFINITY and hard < need:
        raise RuntimeError(f"{clients} MQTT clients need about {need} file descriptors, but this process may open "
                           f"at most {hard} (hard RLIMIT_NOFILE); raise it (ulimit -Hn, or LimitNOFILE= in a "
                           f"systemd unit) or spread the clients over several processes")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        raise RuntimeError(f"{clients} MQTT clients need about {need} file descriptors; the soft limit is {soft} "
                           f"and raising it to {target} failed ({exc}); raise it with ulimit -n") from None
    log.info("raised the open-file limit from %d to %d for %d MQTT clients", soft, target, clients)
    return target


__all__ = ["ClientLoop", "Session", "ensure_fd_limit"]
