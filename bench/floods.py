"""Floods against what the project serves itself (issue 57, item 5): the embedded broker and the decoder.

``python -m splitedge.bench.floods --out bench/results/floods --before 52b8928`` measures this
checkout and, with ``--before REV``, the same code at an older commit (its protocol files run from
a temporary folder: the work tree is not touched). ``splitedge bench floods`` measures this
checkout only. Everything goes to 127.0.0.1, bounded in count and time.

Broker (`splitedge broker`'s `serve_forever`, in a process of its own whose open-file limit is
set, so its descriptors and RSS are its own):

- flood: ``--connections`` TCP connections opened without CONNECT (non-blocking, in batches),
  then closed by their peer (this process). Reported: the broker's open descriptors, RSS and
  sockets in CLOSE_WAIT before, with the flood open, just after it closed and once the CONNECT
  deadline has passed; a legitimate client's connect time (TCP + CONNECT -> CONNACK) before,
  during and after; its log lines (`Too many open files`). Run at two open-file limits: 4096
  (every connection is accepted: a leak shows whole) and 1024 (a common default: a leak
  locks every later client out).
- big publish: a client CONNECTs and sends one PUBLISH of ``--big-mb`` MB. Reported: the bytes
  the broker took before it closed the connection, its RSS before and at peak (the kernel's
  VmHWM) and after, a legitimate client's connect time during and after.

Decoder: a set of hostile frames (deep nesting, many tiny arrays, lists of small ints, huge map
headers, element bombs, short ids) and, beside them, the worst frames each limit still accepts;
for each, its bytes, the outcome (refusal rule or ok) and the CPU of one `decode` (process time,
median of repeats), per frame and per byte.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
PROTOCOL_FILES = ("errors", "arrays", "limits", "fields", "schema", "kinds", "codec", "children", "broker")
"""What the decoder and the embedded broker are made of (relative imports only): enough to run an
older commit's copy from a temporary package."""
LIMITS = (4096, 1024)
"""Open-file limits the flood runs under (soft and hard of the broker's process)."""


@dataclass
class Settings:
    connections: int = 3000
    big_mb: int = 100
    connect_timeout_s: float = 5.0
    """The broker's CONNECT deadline as this checkout sets it (CONNECT_TIMEOUT_S): the bench waits past it."""
    before: str | None = None
    repeats: int = 5

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "Settings":
        return cls(connections=300 if a.quick else cls.connections)


# -- the code under test, this checkout's or an older commit's --------------------------------------

def package_of(rev: str | None, tmp: Path) -> tuple[str, str | None]:
    """(package, sys.path entry) of the protocol code: this checkout's, or ``rev``'s written into
    ``tmp`` as the package `before` (git show, never a checkout)."""
    if rev is None:
        return "splitedge.protocol", None
    pkg = tmp / "before"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name in PROTOCOL_FILES:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:protocol/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(text)
    return "before", str(tmp)


def _python(path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- broker ---------------------------------------------------------------------------------------

def mqtt_connect_packet(client_id: str) -> bytes:
    """An MQTT 3.1.1 CONNECT of `client_id` (clean session, keepalive 60), as raw bytes."""
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id.encode()
    return bytes([0x10]) + varint(len(body)) + body


def varint(n: int) -> bytes:
    """MQTT's remaining-length encoding of `n`."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_time(port: int, timeout: float = 10.0) -> float | None:
    """Seconds from TCP connect to CONNACK for a fresh client, or None when it failed."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(max(0.1, timeout - (time.monotonic() - start)))
            s.sendall(mqtt_connect_packet(f"legit-{time.monotonic_ns()}"))
            ack = b""
            while len(ack) < 4:
                chunk = s.recv(4 - len(ack))
                if not chunk:
                    return None
                ack += chunk
            if ack[0] != 0x20 or ack[3] != 0:
                return None
            s.sendall(b"\xe0\x00")  # DISCONNECT
            return time.monotonic() - start
    except OSError:
        return None


class BrokerProcess:
    """`serve_forever(port)` of ``package`` in a child with RLIMIT_NOFILE ``nofile``; stderr kept."""

    def __init__(self, package: str, path: str | None, nofile: int, log: Path) -> None:
        from splitedge.protocol.broker import free_port, wait_port

        self.port = free_port()
        self.log = log
        code = ("import logging, resource, sys\n"
                f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))\n"
                "logging.basicConfig(level=logging.WARNING, format='%(name)s %(levelname)s %(message)s')\n"
                "import splitedge.protocol  # what `splitedge broker` imports, whichever broker.py runs\n"
                f"from {package}.broker import serve_forever\n"
                f"serve_forever({self.port})\n")
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=_python(path), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        if not wait_port("127.0.0.1", self.port, 30):
            self.stop()
            raise RuntimeError(f"broker did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)

    def fds(self) -> int | None:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return None

    def rss(self) -> int | None:
        return _status(self.proc.pid, "VmRSS:")

    def hwm(self) -> int | None:
        return _status(self.proc.pid, "VmHWM:")

    def close_wait(self) -> int | None:
        import psutil

        try:
            return sum(1 for c in psutil.Process(self.proc.pid).net_connections("tcp") if c.status == "CLOSE_WAIT")
        except psutil.Error:
            return None

    def snapshot(self) -> dict[str, Any]:
        return {"fds": self.fds(), "rss_mb": _mb(self.rss()), "close_wait": self.close_wait(),
                "connect_s": connect_time(self.port, 5.0)}

    def log_lines(self) -> dict[str, int]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = text.splitlines()
        return {"lines": len(lines), "too_many_open_files": sum("Too many open files" in ln for ln in lines)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _status(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / MB, 1)


def open_idle(port: int, count: int, batch: int = 500, wait_s: float = 5.0) -> tuple[list[socket.socket], int]:
    """``count`` TCP connections that send nothing, opened ``batch`` at a time without blocking;
    returns the established ones and how many did not establish within ``wait_s`` per batch."""
    held: list[socket.socket] = []
    failed = 0
    for start in range(0, count, batch):
        pending = {}
        sel = selectors.DefaultSelector()
        for _ in range(min(batch, count - start)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sel.register(s, selectors.EVENT_WRITE)
            pending[s.fileno()] = s
        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                s = pending.pop(key.fd)
                sel.unregister(s)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    held.append(s)
                else:
                    failed += 1
                    s.close()
        for s in pending.values():
            failed += 1
            sel.unregister(s)
            s.close()
        sel.close()
    return held, failed


def flood(package: str, path: str | None, nofile: int, settings: Settings, log: Path) -> dict[str, Any]:
    """Open ``settings.connections`` connections without CONNECT, close them, watch the broker."""
    from splitedge.protocol.mqtt_loop import ensure_fd_limit

    ensure_fd_limit(settings.connections + 64)
    broker = BrokerProcess(package, path, nofile, log)
    try:
        out: dict[str, Any] = {"nofile": nofile, "before": broker.snapshot()}
        started = time.monotonic()
        held, failed = open_idle(broker.port, settings.connections)
        out["opened"], out["not_established"], out["open_s"] = len(held), failed, round(time.monotonic() - started, 2)
        time.sleep(0.5)
        out["during"] = broker.snapshot()
        for s in held:
            s.close()
        time.sleep(1.0)
        out["closed_1s"] = broker.snapshot()
        time.sleep(settings.connect_timeout_s + 2.0)
        out["after_deadline"] = broker.snapshot()
        out["log"] = broker.log_lines()
        out["alive"] = broker.proc.poll() is None
        return out
    finally:
        broker.stop()


def big_publish(package: str, path: str | None, settings: Settings, log: Path) -> dict[str, Any]:
    """One client sends a PUBLISH of ``settings.big_mb`` MB; the broker's RSS and a legitimate
    client's connect time meanwhile."""
    broker = BrokerProcess(package, path, 4096, log)
    try:
        out: dict[str, Any] = {"before": broker.snapshot(), "hwm_before_mb": _mb(broker.hwm())}
        size = settings.big_mb * MB
        topic = b"flood/big"
        body_len = 2 + len(topic) + size
        header = bytes([0x30]) + varint(body_len) + len(topic).to_bytes(2, "big") + topic
        during: list[float | None] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                during.append(connect_time(broker.port, 10.0))
                done.wait(0.5)

        sent, started = 0, time.monotonic()
        prober = threading.Thread(target=probe, daemon=True)
        with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as s:
            s.sendall(mqtt_connect_packet("big"))
            s.recv(4)
            prober.start()
            chunk = b"x" * MB
            try:
                s.sendall(header)
                while sent < size and time.monotonic() - started < 120:
                    s.sendall(chunk[: min(MB, size - sent)])
                    sent += min(MB, size - sent)
                out["send_s"] = round(time.monotonic() - started, 2)
                s.settimeout(10)
                out["closed_by_broker"] = s.recv(1) == b""  # b"": closed; a timeout: still open (taken)
            except socket.timeout:
                out["closed_by_broker"] = False
            except OSError as exc:  # reset or broken pipe while sending: the broker closed it
                out["closed_by_broker"] = True
                out["send_error"] = type(exc).__name__
                out["send_s"] = round(time.monotonic() - started, 2)
        out["sent_mb"] = round(sent / MB, 1)
        time.sleep(1.0)
        done.set()
        prober.join(15)
        out["connect_during_s"] = {"max": max((d for d in during if d is not None), default=None),
                                   "failed": sum(d is None for d in during), "probes": len(during)}
        out["peak_rss_mb"] = _mb(broker.hwm())
        out["after"] = broker.snapshot()
        out["log"] = broker.log_lines()
        out["alive"] = broker.proc.poll() is None
        return out
    finally:
        broker.stop()


# -- decoder --------------------------------------------------------------------------------------

def _envelope(kind: str, body: Any) -> dict[str, Any]:
    return {"v": 2, "k": kind, "r": "r", "n": 1, "s": "d0", "i": "0" * 32, "b": body}


def _array(dims: tuple[int, ...] = (), code: int = 8, itemsize: int = 4) -> Any:
    """An array ext value (protocol/arrays.py's layout) built by hand: f4 zeros of ``dims``."""
    import math
    import struct

    import msgpack

    return msgpack.ExtType(1, struct.pack(f"<BB{len(dims)}I", code, len(dims), *dims)
                           + bytes(math.prod(dims) * itemsize))


def _pack(doc: Any) -> bytes:
    import msgpack

    return msgpack.packb(doc, use_bin_type=True)


def _nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def _paged_ids(ids: list[str]) -> list[Any]:
    return [ids[i:i + 1024] for i in range(0, len(ids), 1024)]


def _short_ids(n: int, width: int) -> list[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    out = []
    for i in range(n):
        s = ""
        for _ in range(width):
            i, d = divmod(i, len(alphabet))
            s = alphabet[d] + s
        out.append(s)
    return out


def hostile_frames() -> list[tuple[str, str, bytes]]:
    """(name, what it is, bytes): the issue's frames, each limit's attack, and the worst frames the
    limits still accept (padded with a long str so that their length pays for their elements)."""
    ints = [[1] * 1024 for _ in range(127)]
    hello = {"role": "edge", "parent": "cloud", "samples": 1, "backend": "torch", "groups": []}
    frames = [
        ("done-int-lists", "the issue's: a `done` of 127 lists of 1,024 ints (130 kB)",
         _pack(_envelope("done", {"phase": "round", "info": {"method": {"x": ints}}}))),
        ("done-int-lists-padded", "the same ints with a 400 kB str beside them",
         _pack(_envelope("done", {"phase": "round", "info": {"method": {"x": ints, "pad": "p" * 400_000}}}))),
        ("done-empty-strs", "a `done` of 127 lists of 1,024 empty strs",
         _pack(_envelope("done", {"phase": "round", "info": {"method": {"x": [[""] * 1024 for _ in range(127)]}}}))),
        ("tiny-arrays-map", "the issue's: `weights` of 131,000 0-d arrays",
         _pack(_envelope("weights", {"part": "p", "version": 0, "samples": 1,
                                     "weights": {f"w{i:06d}": _array() for i in range(131_000)}}))),
        ("tiny-arrays-long-keys", "`weights` of 14,000 0-d arrays under 40-byte names",
         _pack(_envelope("weights", {"part": "p", "version": 0, "samples": 1,
                                     "weights": {f"w{i:039d}": _array() for i in range(14_000)}}))),
        ("deep-nesting", "a `done` whose info nests 1,020 lists",
         _pack(_envelope("done", {"phase": "round", "info": {"method": {"x": _nested(1020)}}}))),
        ("deep-nesting-raw", "1,024 nested arrays, nothing else", b"\x91" * 1024 + b"\x00"),
        ("map-header-bomb", "a body map header announcing 131,072 entries, then nothing",
         _pack(_envelope("metrics", {}))[:-1] + b"\xdf\x00\x02\x00\x00"),
        ("empty-map-bomb", "1,000 lists of 1,000 empty maps (1 MB)", _pack([[{}] * 1000] * 1000)),
        ("metrics-max", "a `metrics` map of 131,063 entries (MAX_ELEMENTS)",
         _pack(_envelope("metrics", {f"m{i}": i for i in range(131_063)}))),
        ("hello-1-char-ids", "a `hello` of 65,536 members of 1 char",
         _pack(_envelope("hello", {**hello, "members": _paged_ids(_short_ids(65_536, 1))}))),
        ("hello-3-char-ids", "a `hello` of 65,536 members of 3 chars",
         _pack(_envelope("hello", {**hello, "members": _paged_ids(_short_ids(65_536, 3))}))),
    ]
    return frames


def _elements(data: bytes) -> int | None:
    """The frame's elements as the decoder counts them (items + 1 per container, 8 per array),
    read with msgpack alone; None when msgpack cannot read it."""
    import msgpack

    count = [0]

    def on_container(value: Any) -> Any:
        count[0] += len(value) + 1
        return value

    def on_ext(code: int, payload: bytes) -> Any:
        count[0] += 8
        return None

    try:
        msgpack.unpackb(data, list_hook=on_container, object_hook=on_container, ext_hook=on_ext, raw=False,
                        strict_map_key=False, max_map_len=1 << 22, max_array_len=1 << 22)
    except Exception:  # noqa: BLE001 - a truncated or too deep frame has no count
        return None
    return count[0]


def measure_decoder(package: str, repeats: int) -> list[dict[str, Any]]:
    """Each hostile frame through ``package``'s decode: outcome and CPU (median of ``repeats``)."""
    import importlib

    codec = importlib.import_module(f"{package}.codec")
    importlib.import_module(f"{package}.kinds")
    errors = importlib.import_module(f"{package}.errors")
    rows = []
    for name, what, data in hostile_frames():
        times, outcome = [], "ok"
        for _ in range(repeats):
            start = time.process_time()
            try:
                codec.decode(data)
                outcome = "ok"
            except errors.ProtocolError as exc:
                outcome = exc.rule
            times.append(time.process_time() - start)
        cpu = statistics.median(times)
        rows.append({"frame": name, "what": what, "bytes": len(data), "elements": _elements(data),
                     "outcome": outcome, "cpu_ms": round(cpu * 1e3, 3), "ns_per_byte": round(cpu * 1e9 / len(data), 2)})
    return rows


def decoder_in_child(package: str, path: str | None, repeats: int) -> list[dict[str, Any]]:
    code = ("import json, sys\nfrom splitedge.bench.floods import measure_decoder\n"
            f"print(json.dumps(measure_decoder({package!r}, {repeats})))\n")
    out = subprocess.run([sys.executable, "-c", code], env=_python(path), capture_output=True, text=True,
                         check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    accepted = [r for r in rows if r["outcome"] == "ok"]
    pick: Callable[[list[dict[str, Any]], str], dict[str, Any] | None] = \
        lambda rs, key: max(rs, key=lambda r: r[key]) if rs else None
    return {"cpu_ms": pick(rows, "cpu_ms"), "ns_per_byte": pick(rows, "ns_per_byte"),
            "accepted_cpu_ms": pick(accepted, "cpu_ms"), "accepted_ns_per_byte": pick(accepted, "ns_per_byte")}


# -- the suite ------------------------------------------------------------------------------------

def run(settings: Settings, progress: Callable[[dict[str, Any], dict[str, Any]], None] | None = None
        ) -> tuple[dict[str, Any], dict[str, Any]]:
    config = asdict(settings)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="splitedge-floods-") as tmp:
        versions = [("after", None)] + ([("before", settings.before)] if settings.before else [])
        for label, rev in versions:
            package, path = package_of(rev, Path(tmp))
            entry: dict[str, Any] = {"rev": rev or "this checkout"}
            print(f"floods {label}: decoder", flush=True)
            entry["decoder"] = decoder_in_child(package, path, settings.repeats)
            entry["decoder_worst"] = worst(entry["decoder"])
            for nofile in LIMITS:
                print(f"floods {label}: {settings.connections} connections without CONNECT, nofile {nofile}", flush=True)
                entry[f"flood_{nofile}"] = flood(package, path, nofile, settings, Path(tmp) / f"{label}-{nofile}.log")
            print(f"floods {label}: one PUBLISH of {settings.big_mb} MB", flush=True)
            entry["big_publish"] = big_publish(package, path, settings, Path(tmp) / f"{label}-big.log")
            results[label] = entry
            if progress is not None:
                progress(config, results)
    return config, results


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(results: dict[str, Any]) -> str:
    labels = [k for k in ("before", "after") if k in results]
    out = ["## Embedded broker: connections opened and closed without CONNECT", ""]
    for label in labels:
        for key in sorted((k for k in results[label] if k.startswith("flood_")), reverse=True):
            f = results[label][key]
            out += [f"**{label}** ({results[label]['rev']}), open-file limit {f['nofile']}: {f['opened']} connections "
                    f"established ({f['not_established']} not within 5 s) in {f['open_s']} s; broker log: "
                    f"{f['log']['lines']} lines, {f['log']['too_many_open_files']} `Too many open files`", "",
                    "| when | descriptors | RSS MB | CLOSE_WAIT | legit connect s |", "|---|---|---|---|---|"]
            for when in ("before", "during", "closed_1s", "after_deadline"):
                s = f[when]
                out.append(f"| {when} | {_cell(s['fds'])} | {_cell(s['rss_mb'])} | {_cell(s['close_wait'])} | "
                           f"{_cell(s['connect_s']) if s['connect_s'] is not None else 'failed'} |")
            out.append("")
    out += ["## Embedded broker: one big PUBLISH", "",
            "| code | sent MB | closed by broker | RSS before MB | peak RSS MB | RSS after MB | legit connect during (max s, failed/probes) | after s |",
            "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        b = results[label]["big_publish"]
        d = b["connect_during_s"]
        out.append(f"| {label} | {b['sent_mb']} | {b.get('closed_by_broker')} | {_cell(b['before']['rss_mb'])} | "
                   f"{_cell(b['peak_rss_mb'])} | {_cell(b['after']['rss_mb'])} | {_cell(d['max'])}, {d['failed']}/{d['probes']} | "
                   f"{_cell(b['after']['connect_s'])} |")
    out += ["", "## Decoder: hostile frames", "",
            "CPU of one `decode` (process time, median of repeats); elements as the decoder counts them.", ""]
    header = "| frame | bytes | elements |" + "".join(f" {lb}: outcome | {lb}: CPU ms | {lb}: ns/B |" for lb in labels)
    out += [header, "|" + "---|" * (3 + 3 * len(labels))]
    by = {lb: {r["frame"]: r for r in results[lb]["decoder"]} for lb in labels}
    for row in results[labels[-1]]["decoder"]:
        cells = [f"`{row['frame']}` ({row['what']})", str(row["bytes"]), _cell(row["elements"])]
        for lb in labels:
            r = by[lb].get(row["frame"], {})
            cells += [f"`{r.get('outcome')}`", _cell(r.get("cpu_ms")), _cell(r.get("ns_per_byte"))]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "| code | worst CPU per frame | worst CPU per byte | worst accepted per frame | worst accepted per byte |",
            "|---|---|---|---|---|"]
    for lb in labels:
        w = results[lb]["decoder_worst"]
        fmt = lambda r, key, unit: f"{_cell(r[key])} {unit} (`{r['frame']}`)" if r else "-"  # noqa: E731
        out.append(f"| {lb} | {fmt(w['cpu_ms'], 'cpu_ms', 'ms')} | {fmt(w['ns_per_byte'], 'ns_per_byte', 'ns/B')} | "
                   f"{fmt(w['accepted_cpu_ms'], 'cpu_ms', 'ms')} | {fmt(w['accepted_ns_per_byte'], 'ns_per_byte', 'ns/B')} |")
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, default=Path("runs/bench/floods"))
    p.add_argument("--connections", type=int, default=Settings.connections)
    p.add_argument("--big-mb", type=int, default=Settings.big_mb)
    p.add_argument("--repeats", type=int, default=Settings.repeats)
    p.add_argument("--before", default=None, metavar="REV", help="also measure the protocol code of this commit")
    a = p.parse_args(argv)
    if not 0 < a.connections <= 5000 or not 0 < a.big_mb <= 200:
        p.error("--connections 1..5000 and --big-mb 1..200 (a bounded load)")
    from splitedge.bench.lib import report

    settings = Settings(connections=a.connections, big_mb=a.big_mb, before=a.before, repeats=a.repeats)
    started = time.monotonic()
    argv_text = ["python", "-m", "splitedge.bench.floods", *(argv if argv is not None else sys.argv[1:])]
    config, results = run(settings)
    doc = report.document("floods", argv_text, config, results, time.monotonic() - started)
    doc["command"] = " ".join(argv_text)
    json_path, md_path = report.write(a.out, doc, markdown(results))
    print(f"bench floods: wrote {json_path}, {md_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
