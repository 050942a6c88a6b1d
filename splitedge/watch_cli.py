"""`splitedge watch`: a live, read-only view of a run from its broker.

An operator wants to see a federation without touching it: which edges and devices are online,
the round and phase open and how far each edge is, accuracy per round, what each device sends,
receives and holds in memory, who left and when, and what was refused. Everything is already on
the wire (watch_state.py says which messages), so the watcher only subscribes; it never
publishes and has no last will, and under the generated ACL its login (`watcher`, `watcher-2`, ...: one per
watch running at a time, since the generated broker.conf binds a login to one client id) can read the
run and write nothing. By default it subscribes to the few control kinds it reads, not to the
models and statistics, so watching costs the broker almost nothing (`--all-topics` takes the
run's every message, to count them by kind). Frames its decoder refuses are counted by rule.

Three ways to show it: a table refreshed twice a second (rich's Live), `--once` (one snapshot
after a few seconds, for a script or a ticket) and `--plain` (one timestamped line per event,
what one pipes into a log). rich is optional: without it the snapshot is plain text and the live
view falls back to lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import shutil
import sys
import threading
import time
import uuid
from typing import Any

from splitedge.protocol import credentials
from splitedge.protocol.codec import Envelope
from splitedge.protocol.credentials import redact_url
from splitedge.protocol.topics import PREFIX, pattern
from splitedge.watch_state import Table, WatchState, headline, tables

REFRESH_PER_S = 2
TAKEN_RECONNECTS, TAKEN_WINDOW_S = 3, 15.0
"""A watch whose connection is taken this many times within this window gives up: under
`use_username_as_clientid` another connection uses its login (each watch needs its own)."""
DEFAULT_ONCE_S = 3.0
READ_KINDS = (("up", "status"), ("up", "hello"), ("down", "round"), ("up", "done"))
"""What the view is made of (besides the cloud's `metrics`): liveness, membership, rounds, reports."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="the broker to watch, e.g. mqtt://watcher@cloud-host:1883 (with "
                   "an edge-site broker bridged to the cloud's, the cloud's shows edges, rounds and device costs; a "
                   "site's also shows its devices' own messages)")
    p.add_argument("--run", default="default", help="run id (topic namespace) to watch")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--once", nargs="?", type=float, const=DEFAULT_ONCE_S, default=None, metavar="SECONDS",
                      help=f"listen SECONDS (default {DEFAULT_ONCE_S:g}), print one snapshot and exit")
    mode.add_argument("--plain", action="store_true",
                      help="one timestamped line per event instead of the live table (for a log file; also what "
                           "happens when stdout is not a terminal)")
    p.add_argument("--all-topics", action="store_true",
                   help=f"subscribe to {PREFIX}/<run>/# (every model and statistic too, counted by kind) instead of "
                        "the control messages the view needs: the broker then sends the watcher a copy of everything, "
                        "and a method's own kinds (SplitFed's activations) count as not decoded")
    credentials.add_arguments(p)


def filters(run: str, everything: bool = False) -> list[str]:
    """The subscriptions: the run's whole tree, or only the kinds the view reads."""
    if everything:
        pattern(run)  # the run id's checks
        return [f"{PREFIX}/{run}/#"]
    return [*(pattern(run, direction=d, kind=k) for d, k in READ_KINDS),
            pattern(run, "cloud", direction="up", kind="metrics")]


class Watcher:
    """A subscribed MQTT client feeding a WatchState; handlers run on the network thread, so
    the state is only touched under `lock`, and event lines wait in `lines` for the printer."""

    def __init__(self, url: str, run: str, *, everything: bool = False, **options: Any) -> None:
        from splitedge.protocol.mqtt import MqttTransport

        self.state = WatchState(run)
        self.lock = threading.Lock()
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        client_id = f"{run}-watch-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # never a node's <run>-<tier>-<id>
        self.transport = MqttTransport(url, client_id=client_id, role="watcher", **options)
        self._reconnects: list[float] = []  # when each reconnect was noticed
        for f in filters(run, everything):
            self.transport.subscribe(f, self._on_message, qos=1)

    def link_news(self) -> str | None:
        """A line when the connection was lost and regained since the last call (events in between
        are missed); ValueError when that keeps happening: another connection with this login
        takes it (the generated broker.conf binds a login to one client id)."""
        seen = self.transport.reconnects
        if seen <= len(self._reconnects):
            return None
        now = time.monotonic()
        self._reconnects += [now] * (seen - len(self._reconnects))
        recent = [t for t in self._reconnects if now - t <= TAKEN_WINDOW_S]
        login = getattr(self.transport, "_username", None)
        if len(recent) >= TAKEN_RECONNECTS:
            raise ValueError(f"the broker took this watch's connection {len(recent)} times in {TAKEN_WINDOW_S:g} s: "
                             f"another connection uses the login {login!r} (another watch?); give each watch its own "
                             f"login (`splitedge data split --acl` writes watcher, watcher-2, ...)")
        return (f"broker connection lost and regained ({seen} time(s) so far): events in between are missed; if "
                f"another watch uses the login {login!r}, give each its own")

    def _on_message(self, topic: str, env: Envelope) -> None:
        now = time.time()
        with self.lock:
            for line in self.state.apply(topic, env, now):
                self.lines.put((now, line))

    def snapshot(self) -> tuple[str, list[Table]]:
        """The headline and tables now, with the transport's refusals and link state taken in."""
        with self.lock:
            self.state.undecodable = self.transport.rejected.copy()
            head = headline(self.state)
            if not self.transport.connected:
                head += " | broker connection lost, reconnecting"
            return head, tables(self.state)

    def close(self) -> None:
        self.transport.close()


def run(args: argparse.Namespace) -> int:
    options = credentials.connect_options(args, args.broker)
    if args.once is not None and args.once < 0:
        raise ValueError(f"--once {args.once:g}: give the seconds to listen, >= 0")
    logging.getLogger("splitedge.protocol.transport").setLevel(logging.ERROR)  # refusals: counted and shown
    watcher = Watcher(args.broker, args.run, everything=args.all_topics, **options)
    try:
        if args.once is not None:
            time.sleep(args.once)
            print_snapshot(*watcher.snapshot())
        elif args.plain or not sys.stdout.isatty():
            print_lines(watcher, args)
        elif not _has_rich():
            print("splitedge watch: rich is not installed, so plain lines (pip install rich for the live table)",
                  file=sys.stderr)
            print_lines(watcher, args)
        else:
            live(watcher)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) is how a watch ends
        pass
    finally:
        watcher.close()
    return 0


# -- showing it ------------------------------------------------------------------------------

def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def stamp(when: float) -> str:
    """A log line's time: date, time of day and milliseconds, local time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"


def print_lines(watcher: Watcher, args: argparse.Namespace) -> None:
    """--plain: one line per event as it happens; refusals by this watcher's decoder too."""
    print(f"{stamp(time.time())} watching run {args.run} on {redact_url(args.broker)}", flush=True)
    refused: dict[str, int] = {}
    while True:
        try:
            when, line = watcher.lines.get(timeout=1 / REFRESH_PER_S)
            print(f"{stamp(when)} {line}", flush=True)
        except queue.Empty:
            pass
        news = watcher.link_news()
        if news:
            print(f"{stamp(time.time())} {news}", flush=True)
        now = watcher.transport.rejected.copy()
        for rule, count in sorted(now.items()):
            if count != refused.get(rule, 0):
                print(f"{stamp(time.time())} not decoded: {count - refused.get(rule, 0)} frame(s) [{rule}]", flush=True)
        refused = now


def print_snapshot(head: str, tabs: list[Table], file: Any = None) -> None:
    """--once: rich's tables when rich is there, else aligned plain text."""
    if _has_rich():
        from rich.console import Console

        width = shutil.get_terminal_size((120, 40)).columns
        Console(file=file or sys.stdout, width=max(width, 100)).print(render_rich(head, tabs))
    else:
        print(render_text(head, tabs), file=file or sys.stdout)


def render_rich(head: str, tabs: list[Table]) -> Any:
    """The headline and every table as one rich renderable."""
    from rich.console import Group
    from rich.table import Table as RichTable
    from rich.text import Text

    parts: list[Any] = [Text(head, style="bold")]
    for t in tabs:
        table = RichTable(title=t.title, title_justify="left", title_style="bold")
        for column in t.columns:
            table.add_column(column)
        for row in t.rows:
            table.add_row(*row)
        parts += [table, Text(t.note, style="dim")] if t.note else [table]
    return Group(*parts)


def render_text(head: str, tabs: list[Table]) -> str:
    """The same as plain text, columns aligned: no rich needed."""
    lines = [head]
    for t in tabs:
        widths = [max([len(c), *(len(r[i]) for r in t.rows)]) for i, c in enumerate(t.columns)]
        row = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        lines += ["", t.title, row(t.columns), *(row(r) for r in t.rows)] + ([f"({t.note})"] if t.note else [])
    return "\n".join(lines)


def live(watcher: Watcher) -> None:
    """The table, redrawn REFRESH_PER_S times a second until Ctrl-C. The transport's warnings
    about refused frames would tear the display; the table's refusals row counts them instead."""
    from rich.console import Console
    from rich.live import Live

    logging.getLogger("splitedge.protocol").setLevel(logging.ERROR)
    with Live(render_rich(*watcher.snapshot()), console=Console(), auto_refresh=False) as view:
        while True:
            time.sleep(1 / REFRESH_PER_S)
            watcher.link_news()  # the headline says a link is down; a login in use by another ends the watch
            view.update(render_rich(*watcher.snapshot()), refresh=True)
