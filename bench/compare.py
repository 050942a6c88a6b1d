"""One table from several accuracy benches (seeds, splits, settings): `splitedge bench compare`.

`--inputs A,B,...` names folders of `splitedge bench accuracy` (or ssl, cluster) runs; rows of
the same label and split are one row here, one value per seed. For each: the final accuracy of
the model's own head and of the calibrated one (and their mean over seeds), whether every seed
had plateaued (methods/metrics/plateau.py), the rounds run, what a device sent and received per
round, and over the run until the row's best curve first reached its split's target (`--target`
for every split, default 90 % of the best final accuracy of any federated row of that split:
one target across splits left every Dir(0.1) row at "never"), in bytes per device. Rows named
`upper`/`lower` (or a `central` row) are the bounds. With `--ram A,...` (folders of `splitedge
bench ram --methods ...`) each row also gets its device's peak RSS, read from the run of its
method on its backend, shown as a column and as the marker's size in the accuracy-against-bytes
plot. Nothing is run: the JSON is read.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from splitedge.bench.lib.plotstyle import Series, lines, new_figure
from splitedge.bench.lib.report import save_figure, table
from splitedge.methods.metrics import plateau


@dataclass
class CompareSettings:
    inputs: tuple[str, ...]
    target: float | None = None
    ram: tuple[str, ...] = ()  # folders of `bench ram` runs: each row's device peak RSS

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "CompareSettings":
        inputs = tuple(getattr(a, "inputs", ()) or ())
        if not inputs:
            raise ValueError("bench compare needs --inputs FOLDER,FOLDER,... (folders of bench accuracy runs)")
        missing = [f for f in inputs if not (Path(f) / "accuracy.json").exists() and not list(Path(f).glob("*.json"))]
        if missing:
            raise ValueError(f"bench compare: no bench JSON in {missing}")
        return cls(inputs=inputs, target=getattr(a, "target", None), ram=ram_folders(a))


def ram_folders(a: argparse.Namespace) -> tuple[str, ...]:
    """--ram's folders, each checked to hold a `bench ram` result."""
    ram = tuple(getattr(a, "ram", ()) or ())
    no_ram = [f for f in ram if not (Path(f) / "ram.json").exists()]
    if no_ram:
        raise ValueError(f"--ram: no ram.json in {no_ram} (folders of `splitedge bench ram` runs)")
    return ram


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


def device_peaks(folders: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """(method, backend) -> the device's peak MB (max of RSS and VmHWM) over the `bench ram`
    folders' completed runs; a pair measured twice keeps its larger peak."""
    out: dict[tuple[str, str], float] = {}
    for folder in folders:
        for run_ in json.loads((Path(folder) / "ram.json").read_text())["results"]["runs"]:
            device = [r for r in run_["rows"] if r["role"] == "device"]
            if run_.get("completed") and device:
                key = (run_.get("method", "hsfp"), run_["backend"])
                out[key] = max(out.get(key, 0.0), device[0]["peak_mb"])
    return out


def device_ram(r: dict[str, Any], peaks: dict[tuple[str, str], float]) -> float | None:
    """A run's device peak MB: its method's on the backends its devices ran (a mixed federation:
    the largest), None when one of them was not measured or the run is central."""
    if r.get("central"):
        return None
    method = r.get("base_method") or r["method"]
    backends = str((r.get("overrides") or {}).get("backends", "torch")).split("+")
    found = [peaks.get((method, b)) for b in backends]
    return None if None in found else max(found)  # type: ignore[type-var]


def own_models(r: dict[str, Any]) -> bool:
    """A personalised row (FedProto): each device's own model on its own held-out data, another
    task than a global model on the test split, so it sets no target and reaches none."""
    from splitedge.bench.accuracy import personalised

    return personalised(r.get("base_method") or r["method"])


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
    targets = {split: s.target if s.target is not None else 0.9 * max(
        (best_curve(r)[-1] for (_, sp), rows in groups.items() if sp == split for r in rows
         if not r.get("central") and not own_models(r) and best_curve(r) and best_curve(r)[-1] is not None), default=0.0)
        for split in dict.fromkeys(sp for _, sp in groups)}
    peaks = device_peaks(s.ram)
    rows = [{**summarise(label, split, rs, targets[split]), "device_ram_mb": device_ram(rs[0], peaks) if peaks else None}
            for (label, split), rs in groups.items()]
    config = {"inputs": list(s.inputs), "target": s.target, "ram": list(s.ram),
              "partial": [d["folder"] for d in docs if d["partial"]]}
    return config, {"rows": rows, "targets": targets, "ram": list(s.ram)}


def split_targets(results: dict[str, Any]) -> dict[str, float]:
    """Each split's target (a result written before per-split targets holds one for all)."""
    if "targets" in results:
        return results["targets"]
    return {r["split"]: results["target"] for r in results["rows"]}


def summarise(label: str, split: str, runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """One compared row: per seed and their mean."""
    own = [plateau.summary(r["accuracy_per_round"]) for r in runs]
    cal = [plateau.summary(r["accuracy_calibrated_per_round"]) if r.get("accuracy_calibrated_per_round") else None
           for r in runs]
    hits = [None if own_models(r) else to_target(r, target, r["devices"] or 1) for r in runs]
    return {"method": label, "split": split, "seeds": [r["seed"] for r in runs], "target": target,
            "rounds": [len(r["accuracy_per_round"]) for r in runs],
            "own_final": [o["final"] for o in own], "own_plateaued": [o["plateaued"] for o in own],
            "calibrated_final": [c and c["final"] for c in cal], "calibrated_plateaued": [c and c["plateaued"] for c in cal],
            "up_per_round": mean(r.get("device_up_per_device_per_round") or 0 for r in runs),
            "down_per_round": mean(r.get("device_down_per_device_per_round") or 0 for r in runs),
            "to_target": hits, "central": any(r.get("central") for r in runs),
            "personalised": any(own_models(r) for r in runs),
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
    ram = any(r.get("device_ram_mb") is not None for r in results["rows"])
    body = []
    for r in results["rows"]:
        hits = [h for h in r["to_target"] if h is not None]
        reach = "-" if r["central"] or r.get("personalised") else ("never" if not hits else
                                          f"r{round(mean(h['round'] for h in hits))}: {_mb([h['up'] for h in hits])} up, "
                                          f"{_mb([h['down'] for h in hits])} down"
                                          + ("" if len(hits) == len(r["to_target"]) else f" ({len(hits)} of "
                                                                                        f"{len(r['to_target'])} seeds)"))
        body.append((r["method"] + (" (personalised)" if r.get("personalised") else ""), r["split"], " / ".join(map(str, r["seeds"])), " / ".join(map(str, r["rounds"])),
                     _seeds(r["own_final"]), _plateau(r["own_plateaued"]), _seeds(r["calibrated_final"]),
                     _plateau(r["calibrated_plateaued"]), round(r["up_per_round"] / 1e3, 1),
                     round(r["down_per_round"] / 1e3, 1), reach,
                     *([_ram(r.get("device_ram_mb"))] if ram else [])))
    return "\n".join([
        table(["method", "split", "seeds", "rounds", "own head final %", "plateaued", "calibrated final %",
               "plateaued", "device up KB/round", "device down KB/round",
               "round and MB per device to the split's target", *(["device peak RSS MB"] if ram else [])], body),
        "\nTarget: " + ", ".join(f"{split} {100 * t:.1f} %" for split, t in split_targets(results).items())
        + " test accuracy (90 % of the split's best federated final, unless --target set one; the row's "
        "calibrated curve when it has one). "
        f"{plateau.RULE} ('1 of 2': one seed had, the other had not). Central rows train on every image at once: an upper bound, no bytes. (personalised): "
        "each device's own model on its own held-out data, another task: it sets no target and reaches none."
        + (" Device peak RSS: one device process of the row's method on its backend, measured by `bench ram` "
           f"({', '.join(results.get('ram') or [])}), not during these runs (their devices share one process)."
           if ram else ""),
    ])


def _ram(mb: float | None) -> str:
    return "-" if mb is None else f"{mb:.0f}"


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
            out.append(Series(r["method"] + (" (personalised)" if r.get("personalised") else ""),
                              [100 * mean(finals)], x=[total], split=r["split"],
                              size=marker_size(r.get("device_ram_mb"))))
    return out


RAM_MARKER = 7.0 / 400 ** 0.5
"""Marker size per sqrt(MB) of device RAM: a torch device (~400-700 MB) draws at 7 to 9 points,
a thin one (~80 MB) at 3; the area grows with the RAM."""


def marker_size(mb: float | None) -> float | None:
    return None if mb is None else max(2.0, RAM_MARKER * mb ** 0.5)


def figure(results: dict[str, Any]) -> Any:
    """Final accuracy against bytes per device, a point per row: colour = method as in every
    bench plot, marker = split (bench/lib/plotstyle.py)."""
    rows = points(results)
    fig = new_figure([])
    ax = fig.axes[0]
    if rows:
        lines(ax, rows, dashed_label="", markersize=7)
    ram = sorted(r["device_ram_mb"] for r in results["rows"] if not r["central"] and r.get("device_ram_mb") is not None)
    if ram:
        ax.set_title(f"marker area: device peak RSS, {ram[0]:.0f} to {ram[-1]:.0f} MB (bench ram)" if ram[0] != ram[-1]
                     else f"device peak RSS {ram[0]:.0f} MB for every row (bench ram)", fontsize=8)
    ax.set(xlabel="MB per device over the run (up + down)", ylabel="final test accuracy %")
    if any(s.xs[0] > 0 for s in rows):
        ax.set_xscale("log")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "accuracy-vs-bytes.png")
