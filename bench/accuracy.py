"""Final accuracy and bytes per method and label split, for one rounds budget.

Methods come from the registry (or ``--methods``) so a newly registered method is compared
without bench changes; splits are IID and Dirichlet(0.3) by default (``--alphas``). Every run
goes through a real Mosquitto, like a deployment.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bandwidth import selected_methods
from bench.report import pyplot, table, save_figure
from bench.simrun import FederationSettings, device_bytes, run_on_mosquitto

log = logging.getLogger(__name__)


def parse_splits(value: str | None) -> tuple[float | None, ...]:
    """'iid,0.3' -> (None, 0.3); None is IID."""
    if not value:
        return (None, 0.3)
    return tuple(None if v.strip().lower() == "iid" else float(v) for v in value.split(","))


def split_name(alpha: float | None) -> str:
    return "IID" if alpha is None else f"Dirichlet({alpha:g})"


@dataclass
class AccuracySettings(FederationSettings):
    splits: tuple[float | None, ...] = (None, 0.3)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> AccuracySettings:
        quick = a.quick
        return cls(methods=a.methods, splits=parse_splits(a.alphas), dataset=a.dataset, data=a.data, model=a.model,
                   devices=a.devices or 4, edges=a.edges or 2, rounds=a.rounds or (1 if quick else 5), seed=a.seed,
                   max_train=a.max_train or (400 if quick else None), max_test=a.max_test or (200 if quick else None))


def one_run(s: AccuracySettings, method: str, alpha: float | None) -> dict[str, Any]:
    sim = s.sim(method, alpha, run=f"bench-acc-{method}")
    res = run_on_mosquitto(sim, check_sys=False)
    summary, rounds = res["summary"], max(1, len(res["per_round"]))
    return {"method": method, "split": split_name(alpha), "alpha": alpha,
            "final_accuracy": summary["final_accuracy"], "best_accuracy": summary["best_accuracy"],
            "accuracy_per_round": summary["accuracy_per_round"],
            "device_payload_per_device_per_round": device_bytes(res["tiers"]) / s.devices / rounds,
            "total_device_payload_bytes": device_bytes(res["tiers"]),
            "all_tiers_out_payload_bytes": sum(r["out_payload"] for r in res["tiers"].values()),
            "wall_seconds": summary["wall_seconds"]}


def run(s: AccuracySettings) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = []
    for method in selected_methods(s.methods):
        for alpha in s.splits:
            log.info("accuracy: %s on %s", method, split_name(alpha))
            try:
                rows.append(one_run(s, method, alpha))
            except Exception as exc:  # report the others even if one method is broken
                log.exception("accuracy: %s on %s failed", method, split_name(alpha))
                rows.append({"method": method, "split": split_name(alpha), "alpha": alpha, "error": repr(exc)})
    config = {**vars(s), "methods": sorted({r["method"] for r in rows}), "splits": [split_name(a) for a in s.splits]}
    return config, {"runs": rows}


def markdown(results: dict[str, Any]) -> str:
    ok = [r for r in results["runs"] if "error" not in r]
    rows = [(r["method"], r["split"], r["final_accuracy"], r["best_accuracy"],
             round(r["device_payload_per_device_per_round"]), r["all_tiers_out_payload_bytes"]) for r in ok]
    out = ["## Final accuracy and bytes per method and split\n",
           table(["method", "split", "final acc", "best acc", "device B/device/round (up+down)",
                  "all tiers out B"], rows)]
    out += [f"- {r['method']} / {r['split']} failed: {r['error']}" for r in results["runs"] if "error" in r]
    return "\n".join(out)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results["runs"]:
        if "error" not in r:
            acc = r["accuracy_per_round"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['method']} {r['split']}")
    ax.set(xlabel="round", ylabel="test accuracy")
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir / "accuracy.png")


Settings = AccuracySettings
