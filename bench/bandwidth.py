"""Bandwidth per method on the same data, split, model, devices and rounds.

Every registered method (or ``--methods``) runs through ``splitedge.sim.run_sim`` on a fresh
Mosquitto. Bytes come from the transports' counters (summary["bytes"] and the per-round tap),
never from the strategies; Mosquitto's ``$SYS/broker/bytes/received`` is the witness that the
counters are right. The H-SFP moments message is also priced against its raw tensor bytes.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import Progress, table, save_figure
from splitedge.bench.lib.simrun import FederationSettings, all_out_wire, bytes_to_target, run_on_mosquitto

log = logging.getLogger(__name__)

TARGET_REFERENCE = "fedavg"
MOMENT_DIMS = (512, 8192)  # cnn W_c on digits and on CIFAR-10


@dataclass
class BandwidthSettings(FederationSettings):
    alpha: float | None = None
    target: float | None = None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> BandwidthSettings:
        quick = a.quick
        return cls(methods=a.methods, dataset=a.dataset, data=a.data, model=a.model,
                   devices=a.devices or 4, edges=a.edges or 2, rounds=a.rounds or (2 if quick else 5),
                   alpha=a.alpha, seed=a.seed, max_train=a.max_train or (400 if quick else None),
                   max_test=a.max_test or (200 if quick else None), target=a.target)


def selected_methods(methods: tuple[str, ...]) -> list[str]:
    """``methods`` checked against the registry, or the whole registry (new methods appear here
    without bench changes)."""
    from splitedge.methods.registry import list_methods

    known = list_methods()
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; registered: {known}")
    return list(methods) or known


def sim_settings(s: BandwidthSettings, method: str) -> Any:
    return s.sim(method, s.alpha, run=f"bench-bw-{method}")


def method_row(method: str, run: dict[str, Any], s: BandwidthSettings) -> dict[str, Any]:
    """Per device per round (up = device out, down = device in) and per edge per round."""
    b, rounds = run["summary"]["bytes"], max(1, len(run["per_round"]))
    per_dev, per_edge = s.devices * rounds, s.edges * rounds
    return {
        "method": method, "rounds_run": len(run["per_round"]),
        "final_accuracy": run["summary"]["final_accuracy"],
        "accuracy_per_round": [r["accuracy"] for r in run["per_round"]],
        "device_up_payload_per_device_per_round": b["device"]["out_payload"] / per_dev,
        "device_down_payload_per_device_per_round": b["device"]["in_payload"] / per_dev,
        "device_up_packet_per_device_per_round": b["device"]["out_packet"] / per_dev,
        "device_down_packet_per_device_per_round": b["device"]["in_packet"] / per_dev,
        "edge_up_payload_per_edge_per_round": b["edge"]["out_payload"] / per_edge,
        "edge_down_payload_per_edge_per_round": b["edge"]["in_payload"] / per_edge,
        "all_tiers_out_wire_bytes": all_out_wire(run["tiers"]),
        "bytes_by_tier": run["tiers"], "per_round": run["per_round"], "sys_agreement": run["sys"],
        "wall_seconds": run["summary"]["wall_seconds"],
    }


def pick_target(rows: list[dict[str, Any]], given: float | None) -> tuple[float | None, str]:
    """FedAvg's final accuracy when it ran, else the given target, else the lowest final
    accuracy (so every method has a defined bytes-to-target)."""
    ref = next((r for r in rows if r["method"] == TARGET_REFERENCE and r.get("final_accuracy") is not None), None)
    if ref is not None:
        return float(ref["final_accuracy"]), f"{TARGET_REFERENCE} final accuracy"
    if given is not None:
        return given, "--target"
    finals = [r["final_accuracy"] for r in rows if r.get("final_accuracy") is not None]
    return (min(finals), "lowest final accuracy of the methods") if finals else (None, "no accuracy")


def moments_overhead(dims: tuple[int, ...] = MOMENT_DIMS, classes: int = 10) -> list[dict[str, Any]]:
    """Encoded H-SFP ``moments`` message vs the raw bytes of its arrays, per dim and dtype."""
    from splitedge.methods.moments import ClassMoments, moments_to_body
    from splitedge.protocol import Envelope, encode

    rng, rows = np.random.default_rng(0), []
    for dim in dims:
        m = ClassMoments(np.arange(classes), np.full(classes, 50), rng.normal(size=(classes, dim)),
                         rng.random((classes, dim)))
        for dtype in ("f4", "f2"):
            body = moments_to_body(m, dtype=dtype, versions={"wc": 1})
            wire = len(encode(Envelope(kind="moments", run="bench", round=1, sender="d0001", body=body)))
            raw = sum(v.nbytes for v in body.values() if isinstance(v, np.ndarray))
            rows.append({"dim": dim, "classes": classes, "dtype": dtype, "raw_bytes": raw, "wire_bytes": wire,
                         "overhead_bytes": wire - raw, "overhead_pct": 100.0 * (wire - raw) / raw})
    return rows


def run(s: BandwidthSettings, progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, results) of the suite; `progress(config, results)` after each method's run."""
    from splitedge.bench.wire_overhead import wire_overhead

    overheads = {"moments_overhead": moments_overhead(), "wire_overhead": wire_overhead()}
    rows: list[dict[str, Any]] = []
    for method in selected_methods(s.methods):
        log.info("bandwidth: %s", method)
        try:
            rows.append(method_row(method, run_on_mosquitto(sim_settings(s, method)), s))
        except Exception as exc:  # one broken method must not hide the others' numbers
            log.exception("bandwidth: method %s failed", method)
            rows.append({"method": method, "error": repr(exc)})
        if progress is not None:
            progress(*_results(s, rows, overheads))
    return _results(s, rows, overheads)


def _results(s: BandwidthSettings, rows: list[dict[str, Any]],
             overheads: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rows so far, with bytes to the target accuracy picked among them."""
    target, source = pick_target([r for r in rows if "error" not in r], s.target)
    for r in rows:
        if "error" not in r:
            r["bytes_to_target"] = bytes_to_target(r["per_round"], target) if target is not None else None
    config = {**vars(s), "methods": [r["method"] for r in rows]}
    return config, {"methods": rows, "target_accuracy": target, "target_source": source, **overheads}


def markdown(results: dict[str, Any]) -> str:
    ok = [r for r in results["methods"] if "error" not in r]
    rows = [(r["method"], r["final_accuracy"], round(r["device_up_payload_per_device_per_round"]),
             round(r["device_down_payload_per_device_per_round"]), round(r["edge_up_payload_per_edge_per_round"]),
             (r["bytes_to_target"] or {}).get("round"), (r["bytes_to_target"] or {}).get("device_payload_bytes"),
             r["sys_agreement"]["diff_pct"] if r["sys_agreement"] else None) for r in ok]
    out = ["## Bytes per device per round (payload)\n",
           table(["method", "final acc", "device up B", "device down B", "edge up B", "target round",
                  "device B to target", "$SYS diff %"], rows),
           f"\nTarget accuracy {results['target_accuracy']} ({results['target_source']}).\n"]
    out += [f"- {r['method']} failed: {r['error']}" for r in results["methods"] if "error" in r]
    out += ["\n## H-SFP moments message: wire vs raw tensor bytes (10 classes)\n",
            table(["dim", "dtype", "raw B", "wire B", "overhead B", "overhead %"],
                  [(r["dim"], r["dtype"], r["raw_bytes"], r["wire_bytes"], r["overhead_bytes"], r["overhead_pct"])
                   for r in results["moments_overhead"]])]
    return "\n".join(out)


def series(results: dict[str, Any]) -> list[Series]:
    """Each finished method's accuracy against its cumulative device bytes (MB, up + down)."""
    out = []
    for r in results["methods"]:
        if "error" in r:
            continue
        mb = [(rec["bytes"]["device"]["out_payload"] + rec["bytes"]["device"]["in_payload"]) / 1e6
              for rec in r["per_round"]]
        out.append(Series(r["method"], r["accuracy_per_round"], x=mb, note=f"{mb[-1]:.3g} MB" if mb else ""))
    return out


def figure(results: dict[str, Any]) -> Any:
    """Accuracy against cumulative device bytes, a line per method in its colour
    (bench/lib/plotstyle.py); one bar per method, its bytes written by it, after one round."""
    curves = series(results)
    fig = new_figure(curves)
    draw(fig.axes[0], curves, xlabel="cumulative device bytes (MB, payload up + down)", ylabel="test accuracy")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "bandwidth.png")


Settings = BandwidthSettings
