"""Bench results as files: one JSON document, one markdown page and plots per suite.

A number without the machine and the command that produced it cannot be compared with the
next run, so every document carries the command line, the suite's config, the machine (CPU,
RAM, platform) and the versions of the libraries on the measured path.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# distribution name -> key in the "versions" map; torch only when it was imported (see below)
Progress = Callable[[dict[str, Any], dict[str, Any]], None]
"""A long suite's `progress(config, results)`, called after each finished run: bench/cli.py then
writes the files, marked partial, so a stopped bench keeps what it measured."""

LIBRARIES = {"numpy": "numpy", "onnxruntime": "onnxruntime", "paho-mqtt": "paho-mqtt",
             "msgpack": "msgpack", "amqtt": "amqtt", "psutil": "psutil"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _total_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """CPU count and model, total RAM, platform; the box is shared, so load average too."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu_count": os.cpu_count(), "cpu_model": _cpu_model(), "ram_total_bytes": _total_ram_bytes(),
            "platform": platform.platform(), "machine": platform.machine(), "hostname": platform.node(),
            "loadavg_at_end": list(load) if load else None}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mosquitto_version() -> str | None:
    exe = shutil.which("mosquitto")
    if exe is None:
        return None
    out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5).stdout
    first = out.splitlines()[0] if out else ""
    return first.replace("mosquitto version", "").strip() or None


def versions() -> dict[str, str | None]:
    """Python and library versions; torch is listed only if this process imported it, because
    the RAM suite's point is which processes need it."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    out.update({key: _version(dist) for dist, key in LIBRARIES.items()})
    if "torch" in sys.modules:
        out["torch"] = _version("torch")
    out["mosquitto"] = _mosquitto_version()
    return out


def document(suite: str, argv: Sequence[str], config: dict[str, Any], results: dict[str, Any],
             seconds: float) -> dict[str, Any]:
    """The JSON document of one suite run."""
    return {"suite": suite, "command": " ".join(["splitedge", *argv]),
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": seconds, "config": config, "machine": machine(), "versions": versions(),
            "results": results}


def load_note(m: dict[str, Any]) -> str:
    """What the machine's load at the end says about the timings (measured, not assumed)."""
    load, cores = m.get("loadavg_at_end"), m.get("cpu_count") or 1
    if not load:
        return "load average not available: timings unqualified"
    busy = "more work than cores: timings are indicative" if load[0] > cores else "timings from a machine not overloaded"
    return f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {cores} cores at the end: {busy}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; floats get 4 significant digits, None shows as a dash."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def header_markdown(doc: dict[str, Any]) -> str:
    """Title, command and machine lines that start every suite's page."""
    m, v = doc["machine"], doc["versions"]
    ram = f"{m['ram_total_bytes'] / 2**30:.1f} GiB" if m.get("ram_total_bytes") else "?"
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return (f"# splitedge bench: {doc['suite']}\n\n"
            f"- command: `{doc['command']}`\n"
            + (f"- **partial**: written after each finished run; the suite was still running at "
               f"{doc['finished']} ({doc['seconds']:.1f} s)\n" if doc.get("partial") else
               f"- finished: {doc['finished']} ({doc['seconds']:.1f} s)\n")
            + f"- machine: {m['cpu_count']} x {m['cpu_model']}, {ram} RAM, {m['platform']}\n"
            f"- versions: {libs}\n"
            f"- load: {doc['note'] if 'note' in doc else load_note(m)}\n")


def write(out_dir: Path, doc: dict[str, Any], body_markdown: str) -> tuple[Path, Path]:
    """Write ``<suite>.json`` and ``<suite>.md`` into ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{doc['suite']}.json"
    md_path = out_dir / f"{doc['suite']}.md"
    json_path.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    md_path.write_text(header_markdown(doc) + "\n" + body_markdown.rstrip() + "\n")
    return json_path, md_path


def _jsonable(value: Any) -> Any:
    """numpy scalars and paths in results become plain JSON values."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display on a bench box)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> list[Path]:
    """Lay out, write and close a figure; returns [path] for the suite's list of outputs. A figure
    with a layout engine of its own (constrained: bench/lib/plotstyle.py) keeps it: tight_layout
    would replace it, with a warning."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return [path]
