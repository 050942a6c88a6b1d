"""Clustered FL on planted device groups: how well the clusters are recovered (adjusted Rand
index against the planted groups), each cluster model on its own devices' held-out data, the
rounds to reach clustered FL's final accuracy, and bytes per device per round.

Rows by default: CFLHKD, clustered FL without distillation (`kd=false`), and one global model
(`clustering=false,kd=false`: FedAvg, scored the same way on each device's held-out data).
Devices come in `--groups` planted groups (contiguous blocks; `--group-skew rotate` turns group
g's images by g quarter turns, `labels` permutes its labels).

The global model is reported too: on every group's held-out data with that group's labels
where the devices hold it (the two-way hierarchy, `global_teacher=model` or `distill_global`;
the global-model row, whose devices train it), and on the test split (meaningful with
`rotate`, whose groups share one labelling; not with `labels`). The paper's ablation:
`--variant two-way=cflhkd:global_teacher=model,distill_global=true --variant
no-global-teacher=cflhkd:global_teacher=model,lambda_g=0,distill_global=true --variant
no-upward=cflhkd:global_teacher=model`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitedge.bench import accuracy
from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import Progress, save_figure, table
from splitedge.methods.metrics import plateau

DEFAULT_VARIANTS = ("clustered-fl=cflhkd:kd=false", "global-model=cflhkd:clustering=false,kd=false")
REFERENCE = "clustered-fl"


@dataclass
class ClusterSettings(accuracy.AccuracySettings):
    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ClusterSettings":
        if not a.methods:
            a.methods = ("cflhkd",)
            a.variant = [*DEFAULT_VARIANTS, *(a.variant or [])]
        a.alphas = a.alphas or "iid"
        a.groups = a.groups or 3
        base = accuracy.AccuracySettings.from_args(a)
        return cls(**vars(base))


def _personalised(row: dict[str, Any]) -> list[float | None]:
    return [r.get("personalised_accuracy") for r in row.get("per_round", [])]


def _global_on_groups(row: dict[str, Any]) -> float | None:
    """The global model's final accuracy on the groups' held-out data with their own labels:
    measured by the devices in the two-way form; the global-model row's devices hold nothing else."""
    last = (row.get("per_round") or [{}])[-1]
    if "global_personal_accuracy" in last:
        return last["global_personal_accuracy"]
    one_model = str((row.get("overrides") or {}).get("clustering", "")).lower() == "false"
    return row.get("personalised_final") if one_model else None


def _summarise(row: dict[str, Any]) -> None:
    from splitedge.methods.clustering import adjusted_rand

    acc = _personalised(row)
    finite = [a for a in acc if a is not None and a == a]
    row["personalised_final"] = acc[-1] if acc else None
    row["personalised_best"] = max(finite) if finite else None
    row["held_out"] = plateau.summary(acc) if finite else None  # the figure this suite judges a row by
    row["global_on_groups_final"] = _global_on_groups(row)
    last = (row.get("per_round") or [{}])[-1]
    row["cluster_accuracy"] = last.get("cluster_accuracy")
    assignment, truth = last.get("assignment"), row.get("planted_groups")
    row["clusters"] = last.get("clusters")
    row["ari"] = adjusted_rand(assignment, truth) if assignment and truth else None


def run(s: ClusterSettings, progress: Progress | None = None,
        previous: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The accuracy suite's runs, summarised per cluster."""
    return accuracy.run_summarised(s, refresh, progress, previous)


def refresh(results: dict[str, Any]) -> None:
    """Per row: final/best personalised accuracy, ARI, and rounds to the reference's final."""
    rows = [r for r in results["runs"] if "error" not in r]
    for row in rows:
        _summarise(row)
    for split in dict.fromkeys(r["split"] for r in rows):
        ref = next((r for r in rows if r["split"] == split and r["method"] == REFERENCE), None)
        target = None if ref is None else ref.get("personalised_final")
        for row in (r for r in rows if r["split"] == split):
            acc = _personalised(row)
            row["target"] = target
            row["rounds_to_target"] = next((i + 1 for i, a in enumerate(acc) if target is not None and a is not None
                                            and a >= target), None)


def _cell(value: Any) -> Any:
    return "-" if value is None or value != value else round(float(value), 4)


def _plateau(row: dict[str, Any]) -> str:
    """Whether the held-out curve (and the global model's on the test split) had plateaued."""
    def status(curve: dict[str, Any] | None) -> str:
        return "-" if not curve else (f"yes (r{curve['plateau_round']})" if curve["plateaued"] else "no")
    return f"{status(row.get('held_out'))} / {status(row.get('own'))}"


def markdown(results: dict[str, Any]) -> str:
    ok = [r for r in results["runs"] if "error" not in r]
    rows = [(r["method"], r["split"], len(r.get("per_round") or []), _plateau(r),
             _cell(r.get("personalised_final")), _cell(r.get("personalised_best")),
             _cell(r.get("global_on_groups_final")), _cell(r.get("final_accuracy")),
             _cell(r.get("ari")), r.get("clusters") or "-",
             r.get("rounds_to_target") or "never", round(r["device_payload_per_device_per_round"]),
             ", ".join(f"{e} {_cell(a)}" for e, a in sorted((r.get("cluster_accuracy") or {}).items())))
            for r in ok]
    groups = next((r.get("planted_groups") for r in ok if r.get("planted_groups")), None)
    out = ["## Planted groups, clusters and accuracy on the devices' own data\n",
           table(["method", "split", "rounds", "plateaued (held-out / test split)", "held-out acc (final)", "best",
                  "global model on groups (final)",
                  "global model on test split (final)", "ARI", "clusters",
                  f"round reaching {REFERENCE}'s final", "device B/device/round (up+down)", "per edge (final)"], rows),
           "",
           "plateaued: by the accuracy suite's rule (methods/metrics/plateau.py), the held-out curve, then the "
           "global model's on the test split; --until-plateau stops a run once both have (before, once the test "
           "split's had, whatever the held-out one did). "
           "held-out acc: each device's model of its cluster (or the global model) on the device's own held-out "
           "share, weighted by its size. Global model on groups: the cloud's global model on every device's "
           "held-out share with its group's labels (where the devices hold it: the two-way hierarchy, and the "
           "global-model row); on the test split: meaningful when the groups share one labelling (rotate). ARI: adjusted Rand index of the cloud's clusters against the planted "
           "groups. Per edge: after clustering, one cluster per edge."]
    if groups:
        out.append(f"\nPlanted groups: {groups}")
    out += [f"- {r['method']}: settings {r['overrides']}" for r in ok if r.get("overrides") and r["split"] == ok[0]["split"]]
    out += [f"- {r['method']} / {r['split']} failed: {r['error']}" for r in results["runs"] if "error" in r]
    return "\n".join(out)


def figure(results: dict[str, Any]) -> Any:
    """Each row's held-out accuracy on its devices' own data per round, a colour per row
    (bench/lib/plotstyle.py); bars after one round."""
    curves = [Series(r["method"], _personalised(r), split=r["split"]) for r in results["runs"] if "error" not in r]
    fig = new_figure(curves)
    draw(fig.axes[0], curves, xlabel="round", ylabel="held-out accuracy on the devices' own data")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "cluster.png")


Settings = ClusterSettings
