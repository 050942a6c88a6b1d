"""One table from several accuracy benches (seeds, splits, settings): `splitedge bench compare`.

`--inputs A,B,...` names folders of `splitedge bench accuracy` (or ssl, cluster) runs; rows of
the same label and split are one row here, one value per seed. For each: the final accuracy of
the model's own head and of the calibrated one (and their mean over seeds), whether every seed
had plateaued (methods/metrics/plateau.py), the rounds run, what a device sent and received per
round, and over the run until the row's best curve first reached the common target (`--target`,
default 90 % of the best final accuracy of any federated row), in bytes per device. Rows named
`upper`/`lower` (or a `central` row) are the bounds. Nothing is run: the JSON is read.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from splitedge.bench.plotstyle import Series, lines, new_figure
from splitedge.bench.report import save_figure, table
from splitedge.methods.metrics import plateau


@dataclass
class CompareSettings:
    inputs: tuple[str, ...]
    target: float | None = None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "CompareSettings":
        inputs = tuple(getattr(a, "inputs", ()) or ())
        if not inputs:
            raise ValueError("bench compare needs --inputs FOLDER,FOLDER,... (folders of bench accuracy runs)")
        missing = [f for f in inputs if not (Path(f) / "accuracy.json").exists() and not list(Path(f).glob("*.json"))]
        if missing:
            raise ValueError(f"bench compare: no bench JSON in {missing}")
        return cls(inputs=inputs, target=getattr(a, "target", None))


Settings = CompareSettings


def _load(folder: str) -> dict[str, Any]:
    path = Path(folder) / "accuracy.json"
    if not path.exists():
        path = sorted(Path(folder).glob("*.json"))[0]
    doc = json.loads(path.read_text())
    if doc.get("suite") in ("accuracy", "ssl", "cluster"):
        from splitedge.bench.accuracy import refresh

        refresh(doc["results"], doc["config"])  # columns a run predating them lacks, from its rounds
    return {"folder": folder, "seed": doc["config"].get("seed"), "devices": doc["config"].get("devices"),
            "partial": bool(doc.get("partial")), "runs": [r for r in doc["results"]["runs"] if "error" not in r]}


def best_curve(r: dict[str, Any]) -> list[Any]:
    """The row's calibrated curve when it has one, else its own."""
    return r.get("accuracy_calibrated_per_round") or r["accuracy_per_round"]


def to_target(r: dict[str, Any], target: float, devices: int) -> dict[str, Any] | None:
    """Round and bytes per device (up, down) until the row's best curve first reached `target`."""
    for i, a in enumerate(best_curve(r)):
        if a is not None and a == a and a >= target:
            dev = (r["per_round"][i].get("bytes") or {}).get("device", {})
            return {"round": i + 1, "up": dev.get("out_payload", 0) / devices, "down": dev.get("in_payload", 0) / devices}
    return None


def run(s: CompareSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = [_load(f) for f in s.inputs]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for doc in docs:
        for r in doc["runs"]:
            groups.setdefault((r["method"], r["split"]), []).append({**r, "seed": doc["seed"], "devices": doc["devices"]})
    federated = [max(a for a in best_curve(r)[-1:] if a is not None) for rows in groups.values() for r in rows
                 if not r.get("central") and best_curve(r) and best_curve(r)[-1] is not None]
    target = s.target if s.target is not None else 0.9 * max(federated, default=0.0)
    rows = [summarise(label, split, rs, target) for (label, split), rs in groups.items()]
    config = {"inputs": list(s.inputs), "target": target, "partial": [d["folder"] for d in docs if d["partial"]]}
    return config, {"rows": rows, "target": target}


def summarise(label: str, split: str, runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """One compared row: per seed and their mean."""
    own = [plateau.summary(r["accuracy_per_round"]) for r in runs]
    cal = [plateau.summary(r["accuracy_calibrated_per_round"]) if r.get("accuracy_calibrated_per_round") else None
           for r in runs]
    hits = [to_target(r, target, r["devices"] or 1) for r in runs]
    return {"method": label, "split": split, "seeds": [r["seed"] for r in runs],
            "rounds": [len(r["accuracy_per_round"]) for r in runs],
            "own_final": [o["final"] for o in own], "own_plateaued": [o["plateaued"] for o in own],
            "calibrated_final": [c and c["final"] for c in cal], "calibrated_plateaued": [c and c["plateaued"] for c in cal],
            "up_per_round": mean(r.get("device_up_per_device_per_round") or 0 for r in runs),
            "down_per_round": mean(r.get("device_down_per_device_per_round") or 0 for r in runs),
            "to_target": hits, "central": any(r.get("central") for r in runs),
            "wall_seconds": [round(r.get("wall_seconds") or 0) for r in runs]}


def _seeds(values: list[Any]) -> str:
    shown = ["-" if v is None else f"{100 * v:.1f}" for v in values]
    known = [v for v in values if v is not None]
    return " / ".join(shown) + (f" (mean {100 * mean(known):.1f})" if len(known) > 1 else "")


def _plateau(flags: list[Any]) -> str:
    known = [f for f in flags if f is not None]
    if not known:
        return "-"
    return "yes" if all(known) else ("no" if not any(known) else f"{sum(known)} of {len(known)}")


def _mb(values: list[float]) -> str:
    return f"{mean(values) / 1e6:.1f}" if values else "-"


def markdown(results: dict[str, Any]) -> str:
    body = []
    for r in results["rows"]:
        hits = [h for h in r["to_target"] if h is not None]
        reach = "-" if r["central"] else ("never" if not hits else
                                          f"r{round(mean(h['round'] for h in hits))}: {_mb([h['up'] for h in hits])} up, "
                                          f"{_mb([h['down'] for h in hits])} down"
                                          + ("" if len(hits) == len(r["to_target"]) else f" ({len(hits)} of "
                                                                                        f"{len(r['to_target'])} seeds)"))
        body.append((r["method"], r["split"], " / ".join(map(str, r["seeds"])), " / ".join(map(str, r["rounds"])),
                     _seeds(r["own_final"]), _plateau(r["own_plateaued"]), _seeds(r["calibrated_final"]),
                     _plateau(r["calibrated_plateaued"]), round(r["up_per_round"] / 1e3, 1),
                     round(r["down_per_round"] / 1e3, 1), reach))
    return "\n".join([
        table(["method", "split", "seeds", "rounds", "own head final %", "plateaued", "calibrated final %",
               "plateaued", "device up KB/round", "device down KB/round",
               f"round and MB per device to {100 * results['target']:.1f} %"], body),
        f"\nTarget: {100 * results['target']:.1f} % test accuracy (the row's calibrated curve when it has one). "
        f"plateaued: the best accuracy of the last {plateau.WINDOW} rounds beat the best before by less than "
        f"{100 * plateau.TOLERANCE:g} points, judged from round {plateau.START} ('1 of 2': one seed had, the "
        f"other had not). Central rows train on every image at once: an upper bound, no bytes.",
    ])


def points(results: dict[str, Any]) -> list[Series]:
    """Each federated row's final accuracy (best curve, mean over seeds, %) at its bytes per
    device over the run (MB): one point."""
    out = []
    for r in results["rows"]:
        if r["central"]:
            continue
        finals = [c if c is not None else o for c, o in zip(r["calibrated_final"], r["own_final"]) if
                  (c if c is not None else o) is not None]
        total = (r["up_per_round"] + r["down_per_round"]) * mean(r["rounds"]) / 1e6
        if finals:
            out.append(Series(r["method"], [100 * mean(finals)], x=[total], split=r["split"]))
    return out


def figure(results: dict[str, Any]) -> Any:
    """Final accuracy against bytes per device, a point per row: colour = method as in every
    bench plot, marker = split (bench/plotstyle.py)."""
    rows = points(results)
    fig = new_figure([])
    ax = fig.axes[0]
    if rows:
        lines(ax, rows, dashed_label="", markersize=7)
    ax.set(xlabel="MB per device over the run (up + down)", ylabel="final test accuracy %")
    if any(s.xs[0] > 0 for s in rows):
        ax.set_xscale("log")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "accuracy-vs-bytes.png")
