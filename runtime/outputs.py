"""A run's output folder: valid JSON only, no silent overwrite, one writer at a time.

`metrics.jsonl` and `summary.json` are read by other programs, so a NaN (no evaluation yet)
is written as null, never as the invalid token NaN. A folder that holds a previous run is
refused unless the caller says `overwrite`; a lock file refuses a second run writing into the
same folder at the same time (a lock left by a process that is gone is taken over).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from splitedge.methods.snapshot import write_atomic

log = logging.getLogger(__name__)

RUN_FILES = ("metrics.jsonl", "summary.json", "model.safetensors", "resume.state", "sim.state")
RESUME_FILE = "resume.state"  # cloud.resume.STATE_FILE
LOCK = ".splitedge.lock"


def json_safe(obj: Any) -> Any:
    """`obj` with NaN and infinities as None and numpy scalars as Python numbers."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (allow_nan=False) of json_safe(obj)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunFolder:
    """Claim `path` for one run: refuse a previous run's files unless `overwrite`, and a folder
    another live process is writing into. Use as a context manager; the lock goes at exit.
    With `resumable`, a folder holding a cloud's resume state (a sim's: `resume_file`) is kept as
    it is (`resuming`): the caller carries that run on."""

    def __init__(self, path: Path, *, overwrite: bool = False, resumable: bool = False,
                 resume_file: str = RESUME_FILE) -> None:
        self.path, self.overwrite, self.resumable = Path(path), overwrite, resumable
        self.resume_file = resume_file  # what a resumable run carries on from (a sim's: sim.state)
        self.lock = self.path / LOCK
        self.created = False
        self.resuming = False

    def __enter__(self) -> "RunFolder":
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--out {self.path} is a file; give a folder")
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            previous = [f for f in RUN_FILES if (self.path / f).exists()]
            self.resuming = self.resumable and not self.overwrite and self.resume_file in previous
            if self.resuming:
                return self
            if previous and not self.overwrite:
                raise ValueError(f"--out {self.path} holds a previous run ({', '.join(previous)}); "
                                 f"choose another --out or pass --overwrite")
            for name in previous:
                (self.path / name).unlink()
        except BaseException:
            self.lock.unlink(missing_ok=True)
            raise
        return self

    def _take_lock(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _alive(pid) and pid != os.getpid():
                    raise ValueError(f"--out {self.path} is in use by another run (pid {pid}); "
                                     f"choose another --out") from None
                log.warning("taking over the lock of a run that is gone (pid %s) in %s", pid or "?", self.path)
                self.lock.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            return
        raise ValueError(f"--out {self.path}: cannot take its lock file {self.lock}")

    def __exit__(self, *exc: object) -> None:
        self.lock.unlink(missing_ok=True)
        if self.created and not any(self.path.iterdir()):  # a run that failed before writing anything
            self.path.rmdir()


def why_unevaluated(history: list[dict[str, Any]]) -> str:
    """One line, from the round records alone, of why no round has an accuracy: no round ran, no
    edge or no device took part, or what was refused (so a CLI's error needs no log above it)."""
    rounds = len(history)
    if not rounds:
        return "no round ran"
    edges = max(int(r.get("edges") or 0) for r in history)
    devices = max(int(r.get("participants") or 0) for r in history)
    refused: dict[str, int] = {}
    for r in history:
        for counts in (r.get("rejected") or {}).values():
            for rule, n in (counts or {}).items():
                refused[rule] = refused.get(rule, 0) + int(n)
    why = (f"no edge reported in any of the {rounds} rounds" if not edges
           else f"no device took part in any of the {rounds} rounds ({edges} edges reported)" if not devices
           else f"devices took part (up to {devices} a round), but the cloud's evaluation gave no accuracy")
    if refused:
        top = sorted(refused.items(), key=lambda kv: -kv[1])[:3]
        why += "; refused messages: " + ", ".join(f"{rule} x{n}" for rule, n in top)
    return why


def ending(history: list[dict[str, Any]], left: Mapping[str, str] | None = None,
           devices: int | None = None) -> tuple[str, str | None]:
    """How a run that ran its rounds ended: ("complete", None), or ("no_devices", why) when no
    round had a device's training reach the cloud (`devices_reported`, the cloud's round record)
    or, with `devices` given, every one of them left (`left`: the cloud's node -> why, devices
    named "<id> (edge <e>)") and the last round had none. Records without the count (written by
    an older cloud) are taken as having devices."""
    known = [int(h["devices_reported"]) for h in history if h.get("devices_reported") is not None]
    gone = {node: why for node, why in (left or {}).items() if " (edge " in node}
    why_left = "".join(f"; {node} left: {why}" for node, why in sorted(gone.items())[:3])
    if known and not any(known):
        return "no_devices", f"no device's training reached the cloud in any of the {len(history)} rounds{why_left}"
    if known and not known[-1] and devices is not None and len(gone) >= devices:
        last = max(int(h["round"]) for h in history if int(h.get("devices_reported") or 0) > 0)
        return "no_devices", f"every device left the run; none took part after round {last}{why_left}"
    return "complete", None


def served(history: list[dict[str, Any]]) -> tuple[str, Any]:
    """(which head the served model carries, its accuracy): "calibrated" (the last calibration's
    head held every class: its accuracy_calibrated) or "own" (the last round's accuracy)."""
    head = str(history[-1].get("served_head") or "own") if history else "own"
    if head == "calibrated":
        scored = [h["accuracy_calibrated"] for h in history if h.get("accuracy_calibrated") is not None]
        if scored:
            return head, scored[-1]
    return "own", history[-1].get("accuracy") if history else None


def write_counters(out: Path | None, node_id: str, transports: list[Any]) -> None:
    """Leave this node's byte counters (and rejection counts) for the bench and the tests."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    data = {"node": node_id, "transports": [{"role": t.role, "bytes": t.counters.snapshot(),
                                             "rejected": dict(t.rejected)} for t in transports]}
    write_atomic(out / f"counters-{node_id}.json", json.dumps(data, indent=1).encode())  # never a 0-byte file


def save_checkpoint(path: Path, weights: dict[str, np.ndarray], meta: dict[str, str]) -> None:
    """Write the served model without pickle (safetensors), atomically; never over a
    checkpoint of a later round (a cloud resumed from an older state must not erase it)."""
    if not weights:
        return
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import save

    if path.exists() and "round" in meta:
        try:
            with safe_open(str(path), framework="numpy") as fh:
                later = int((fh.metadata() or {}).get("round", 0)) > int(meta["round"])
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # damaged: kept aside, replaced
            later = False
            aside = path.with_name(path.name + ".damaged")
            log.warning("cloud: %s is unreadable (%s); kept as %s and replaced by round %s", path, exc, aside,
                        meta["round"])
            os.replace(path, aside)
        if later:
            log.error("cloud: %s holds a later round than %s; not overwritten", path, meta["round"])
            return

    data = save({k: np.array(v, order="C") for k, v in weights.items()}, metadata=meta)  # keeps 0-d
    write_atomic(path, canonical_safetensors(data))  # fsynced before the rename: a crash leaves the old checkpoint or the new one


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header's keys sorted: the library writes its
    metadata map in hash order, which changes from run to run, so two runs that served the same
    weights wrote files that differed (a checksum of an exported model said they were not the same).
    Offsets count from the end of the header, so only the header changes; padded to 8 bytes."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def plot_spectra_per_round(history: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """The representation's singular-value spectrum at every round that reported one (dimensional
    collapse made visible), written to `path`; None when no round did."""
    fig = spectra_per_round_figure(history, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    return Path(path)


def spectra_per_round_figure(history: list[dict[str, Any]], title: str = "") -> Any | None:
    """One line per round coloured by its round number on a colour scale with a colorbar, not a
    legend entry per round (40 rounds made a legend taller than the plot); the last round drawn
    thicker. A Figure not registered with pyplot; None when no round reported a spectrum."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from splitedge.methods.metrics.report import FLOOR

    spectra = [(int(h["round"]), np.asarray(h["spectrum"], dtype=np.float64)) for h in history if h.get("spectrum")]
    if not spectra:
        return None
    first, last = spectra[0][0], spectra[-1][0]
    scale = ScalarMappable(Normalize(first - 0.5, last + 0.5), round_colours())
    fig = Figure(figsize=(7, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for r, values in spectra:  # below FLOOR: numerical zeros a log axis cannot show (see plot_spectra)
        ax.plot(np.arange(1, len(values) + 1), np.where(values >= FLOOR, values, np.nan), color=scale.to_rgba(r),
                linewidth=2.0 if r == last else 1.0, marker="." if len(spectra) <= 5 else None)
    ax.set_yscale("log")
    ax.set(xlabel="index of the singular value (1-based)", ylabel="normalised singular values (sorted)",
           title=title or "representation per round")
    bar = fig.colorbar(scale, ax=ax, label=f"round ({len(spectra)} with a spectrum)")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    return fig


def round_colours() -> Any:
    """viridis without its last tenth: the pale yellow of the latest rounds is hard to see on white."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    return ListedColormap(colormaps["viridis"](np.linspace(0.0, 0.9, 256)), name="rounds")
