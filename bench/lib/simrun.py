"""One `splitedge sim` run through a private Mosquitto, with per-round byte totals.

The bandwidth, accuracy and round-time suites all need the same thing: run_sim on a real
broker (bytes on the wire are the product), the transports' counters after every round (for
bytes-to-target-accuracy) and, optionally, Mosquitto's own byte count as a witness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from splitedge.bench.lib.sysbytes import SysMonitor, agreement, capture_transports, tier_totals
from splitedge.runtime.outputs import dumps

log = logging.getLogger(__name__)

SETTLE_S = 0.3  # after the last DISCONNECT, before asking $SYS, so the broker has read it
REPRESENTATION_KEYS = ("effective_rank", "spectrum", "probe_accuracy", "knn_accuracy", "alignment", "uniformity")
"""What a round's record may say about the representation (methods/metrics/report.py), kept per round."""


SIM_KEYS = {"sample_fraction": float, "sample_count": int, "sample_min": int,
            "backends": lambda v: tuple(b for b in str(v).split("+") if b)}
"""Variant keys that set the run rather than the method (e.g. all=fedavg:sample_fraction=0.1;
thin=hsfp-cal:backends=onnx, or onnx+torch for a mixed federation, devices taking them in turn)."""


@dataclasses.dataclass
class FederationSettings:
    """What every federation suite (bandwidth, accuracy) varies; `sim()` makes one run of it."""

    methods: tuple[str, ...] = ()  # empty: every method in the registry
    dataset: str = "digits"
    data: str | None = None
    model: str | None = None
    devices: int = 4
    edges: int = 2
    rounds: int = 5
    seed: int = 0
    max_train: int | None = None
    max_test: int | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    groups: int = 0  # planted device groups (see splitedge.sim)
    group_skew: str = "rotate"
    virtual: int = 0  # > 0: virtual devices, this many training at a time (splitedge sim --virtual)
    until_plateau: bool = False  # runs stop at their plateau, `rounds` being the budget

    def sim(self, method: str, alpha: float | None, run: str, overrides: dict[str, Any] | None = None) -> Any:
        """One run's SimSettings; of `overrides`, the run's own keys (SIM_KEYS: client sampling)
        go to the sim, the rest to the method."""
        from splitedge.sim import SimSettings

        settings = {**self.overrides, **(overrides or {})}
        sim_keys = {k: SIM_KEYS[k](settings.pop(k)) for k in list(settings) if k in SIM_KEYS}
        return SimSettings(rounds=self.rounds, devices=self.devices, edges=self.edges, method=method,
                           dataset=self.dataset, data=self.data, model=self.model, alpha=alpha, seed=self.seed,
                           max_train=self.max_train, max_test=self.max_test, run=run, overrides=settings,
                           groups=self.groups, group_skew=self.group_skew, virtual=self.virtual,
                           until_plateau=self.until_plateau, **sim_keys)


def parse_sets(items: list[str] | tuple[str, ...], where: str = "--set expects") -> dict[str, str]:
    """KEY=VALUE items (--set, a variant's settings) as a map (values stay strings, typed by the
    method's config); a ValueError naming the item for one without '='."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{where} KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_variant(text: str) -> tuple[str, str, dict[str, str]]:
    """'hsfp-ic2=hsfp:ic=2,ie=2' -> ('hsfp-ic2', 'hsfp', {'ic': '2', 'ie': '2'}); an item without
    '=' continues the value before it ('x=fedavg:calib_layer=wc_8,we,ic=2': calib_layer 'wc_8,we').

    A variant is a registered method with some settings changed, compared as its own row; the
    values stay strings here and are typed and checked by the method's config class.
    """
    name, sep, rest = text.partition("=")
    method, _, settings = rest.partition(":")
    if not sep or not name.strip() or not method.strip():
        raise ValueError(f"--variant expects NAME=METHOD[:KEY=VALUE,...], got {text!r}")
    items: list[str] = []
    for item in (i.strip() for i in settings.split(",")):
        if item and "=" not in item and items:  # a comma list's next value ('calib_layer=wc_8,we,classifier')
            items[-1] += "," + item
        elif item:
            items.append(item)
    return name.strip(), method.strip(), parse_sets(items, f"--variant {name}: expected")


SIMS_DIR = "sims"
"""Under a bench's --out: the sim folder of each run not yet finished (`run_on_mosquitto(keep=)`)."""
BENCH_ROUNDS = "bench-rounds.jsonl"  # in a kept sim folder: the bench's record of each finished round


def sim_folder(out: Path | None, *names: Any) -> Path | None:
    """Where a bench run keeps its sim (None: a temporary folder, nothing to resume)."""
    if out is None:
        return None
    return Path(out) / SIMS_DIR / "-".join(str(n).replace("/", "_").replace(" ", "") for n in names)


def run_on_mosquitto(settings: Any, *, check_sys: bool = True,
                     attach: Callable[[str, str], Any] | None = None, keep: Path | None = None,
                     resume: bool = True) -> dict[str, Any]:
    """Run ``splitedge.sim.run_sim(settings)`` on a fresh Mosquitto; `attach(url, run)`, if
    given, starts a peer of the run's own on that broker (a rogue device, bench/lib/rogues.py) before
    the federation, and its `close()` is called after.

    With `keep`, the sim runs resumable in that folder (splitedge/sim/resume.py), the bench's
    record of each round beside it: a bench killed in the middle of a run (hours on `fedcnn`)
    and started again carries that run on from its last finished round, on a new broker. The
    folder goes once the run has finished (its results are the bench's JSON). Without `resume`,
    a sim found there is replaced.

    Returns ``{"summary", "per_round", "tiers", "sys"}``: the sim summary, per round the
    accuracy, round seconds and cumulative bytes by tier, the final bytes by tier (payload,
    packet, wire) and the $SYS cross-check (None when ``check_sys`` is False; a resumed run's
    broker saw only the part after the restart, so keep it off with `keep`).
    """
    from splitedge.protocol.broker import MosquittoBroker
    from splitedge.sim import run_sim

    with MosquittoBroker(sys_interval=1) as broker, tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        monitor = SysMonitor(broker.url) if check_sys else None
        try:
            before = monitor.next_value(after=0.0) if monitor else 0
            resumable = keep is not None
            folder = Path(keep) if resumable else Path(tmp)
            resuming = resumable and resume and (folder / "sim.state").exists()
            s = dataclasses.replace(settings, broker=broker.url, out=folder, resumable=resumable,
                                    overwrite=resumable and not resuming)
            per_round: list[dict[str, Any]] = []
            rounds_file = folder / BENCH_ROUNDS
            if resumable and not resuming:
                rounds_file.unlink(missing_ok=True)

            def on_resume(run: str, last: int) -> None:  # the rounds the resumed run finished before
                per_round.extend(r for r in read_rounds(rounds_file) if int(r["round"]) <= last)
                rounds_file.write_text("".join(dumps(r) + "\n" for r in per_round))
                log.info("bench: %s resumes after round %d (%s)", run, last, folder)

            peer = None if attach is None else attach(broker.url, s.run)
            with capture_transports() as opened:
                def on_round(record: dict[str, Any]) -> None:
                    kept = {k: v for k, v in record.items() if k != "bytes"}  # the cloud's own counters
                    per_round.append({**kept, "accuracy": record.get("accuracy"), "bytes": tier_totals(opened)})
                    slim_rounds(per_round)
                    if resumable:  # before the sim's snapshot of this round (its callback comes after)
                        with open(rounds_file, "a") as fh:
                            fh.write(dumps(per_round[-1]) + "\n")

                try:
                    summary = run_sim(s, on_round=on_round, on_resume=on_resume)
                finally:
                    if peer is not None:
                        peer.close()
            if resumable:
                shutil.rmtree(folder, ignore_errors=True)
                if folder.parent.name == SIMS_DIR and not any(folder.parent.iterdir()):
                    with contextlib.suppress(OSError):  # a run of another --jobs process may have just made its folder
                        folder.parent.rmdir()  # no run of the bench left unfinished
            if not opened:
                raise RuntimeError("no transport was opened through runtime.session.connect; the byte tap saw nothing")
            time.sleep(SETTLE_S)
            closed_at = time.monotonic()
            counted = sum(t.counters.total("out", "wire") for t in opened)
            sys_check = agreement(counted, monitor.settled_value(closed_at) - before) if monitor else None
        finally:
            if monitor:
                monitor.close()
    return {"summary": summary, "per_round": per_round, "tiers": tier_totals(opened), "sys": sys_check}


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The bench's round records of a kept sim (a line cut short by a kill is left out)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def device_bytes(tiers: dict[str, dict[str, int]], field: str = "payload") -> int:
    """Bytes every device sent plus received, summed over devices."""
    row = tiers.get("device", {})
    return row.get(f"out_{field}", 0) + row.get(f"in_{field}", 0)


def all_out_wire(tiers: dict[str, dict[str, int]]) -> int:
    """Every byte any tier wrote to the broker (PUBLISH + control)."""
    return sum(row.get("out_wire", 0) for row in tiers.values())


PER_DEVICE_KEYS = ("device_costs", "edge_costs")
"""A round's cost per node: in the run's metrics.jsonl, summed per device in its summary."""


def slim_rounds(per_round: list[dict[str, Any]]) -> None:
    """What the reports read of a bench's rounds, no more: no per-node costs, and a spectrum
    (hundreds of values) only on the newest round that reported one, the final representation.
    Kept whole, a 150-round, 4-arm bench's JSON was 5.7 MB; the run's own metrics.jsonl keeps
    every round's."""
    for r in per_round:
        for key in PER_DEVICE_KEYS:
            r.pop(key, None)
    reported = [r for r in per_round if "spectrum" in r]
    for r in reported[:-1]:
        del r["spectrum"]


def bytes_to_target(per_round: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """Cumulative bytes until the first round whose accuracy reaches ``target``; None if never."""
    for rec in per_round:
        acc = rec.get("accuracy")
        if acc is not None and acc >= target:
            return {"round": rec["round"], "device_payload_bytes": device_bytes(rec["bytes"]),
                    "all_tiers_out_wire_bytes": all_out_wire(rec["bytes"])}
    return None
