"""Final accuracy and bytes per method and label split, for one rounds budget.

Methods come from the registry (or ``--methods``) so a newly registered method is compared
without bench changes; ``--variant NAME=METHOD:KEY=VALUE,...`` adds a method with changed
settings as its own row. Splits are IID and Dirichlet(0.3) by default (``--alphas``). Every run
goes through a real Mosquitto, like a deployment. Per split, every row also says how many
rounds and bytes it needed to reach FedAvg's final accuracy (the issue's yardstick).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from splitedge.methods.metrics import plateau
from splitedge.bench.bandwidth import TARGET_REFERENCE, selected_methods
from splitedge.bench.lib.central import CENTRAL, central_run
from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import Progress, table, save_figure
from splitedge.bench.lib.simrun import (FederationSettings, bytes_to_target, device_bytes, parse_sets, parse_variant,
                                    run_on_mosquitto, sim_folder, slim_rounds)
from splitedge.runtime.cost import summed

log = logging.getLogger(__name__)


def jobs_of(a: argparse.Namespace) -> int:
    """--jobs: runs at a time (each a process; one torch thread each)."""
    jobs = getattr(a, "jobs", None) or 1
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1 (runs at a time), got {jobs}")
    return jobs


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
    variants: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)
    jobs: int = 1  # runs at a time, each in a process of its own
    deadline_s: float | None = None  # None: the sim's default (a large model on all 50,000 images needs more)
    keep_in: Path | None = None  # the bench's --out: each run keeps its sim there until it finishes (resumable)
    resume_sims: bool = False  # --resume: a run whose sim was kept carries it on (else it starts afresh)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> AccuracySettings:
        quick = a.quick
        virtual = getattr(a, "virtual", None) or 0
        if virtual < 0:
            raise ValueError(f"--virtual must be >= 0 (devices training at a time; 0: every device keeps its model), "
                             f"got {virtual}")
        variants = {}
        for text in getattr(a, "variant", None) or []:
            name, method, overrides = parse_variant(text)
            variants[name] = (method, overrides)
        return cls(methods=a.methods, splits=parse_splits(a.alphas), dataset=a.dataset, data=a.data, model=a.model,
                   devices=a.devices or 4, edges=a.edges or 2, rounds=a.rounds or (1 if quick else 5), seed=a.seed,
                   max_train=a.max_train or (400 if quick else None), max_test=a.max_test or (200 if quick else None),
                   variants=variants, groups=getattr(a, "groups", None) or 0,
                   group_skew=getattr(a, "group_skew", None) or "rotate", deadline_s=getattr(a, "deadline", None),
                   virtual=virtual, jobs=jobs_of(a), until_plateau=bool(getattr(a, "until_plateau", False)),
                   overrides=parse_sets(getattr(a, "set", None) or []))

    def sim(self, method: str, alpha: float | None, run: str, overrides: dict[str, Any] | None = None) -> Any:
        sim = super().sim(method, alpha, run, overrides)
        return sim if self.deadline_s is None else dataclasses.replace(sim, deadline_s=self.deadline_s)

    def entries(self) -> list[tuple[str, str, dict[str, str]]]:
        """(row label, registered method, overrides): the methods, then the variants. Variants
        without --methods run alone (they name what to compare). Every row carries the --set
        settings all rows share (a variant's own win), so a row's record says what it ran with."""
        methods = selected_methods(self.methods) if self.methods or not self.variants else []
        out = [(m, m, dict(self.overrides)) for m in methods]
        for name, (method, overrides) in self.variants.items():
            if method != CENTRAL:
                selected_methods((method,))  # an unknown method fails before any run
            out.append((name, method, {**self.overrides, **overrides}))
        return out


def one_run(s: AccuracySettings, label: str, method: str, overrides: dict[str, str],
            alpha: float | None) -> dict[str, Any]:
    sim = s.sim(method, alpha, run=f"bench-acc-{method}", overrides=overrides)
    res = run_on_mosquitto(sim, check_sys=False, keep=sim_folder(s.keep_in, label, split_name(alpha)),
                           resume=s.resume_sims)
    summary, rounds = res["summary"], max(1, len(res["per_round"]))
    if not any(a is not None and math.isfinite(a) for a in summary["accuracy_per_round"]):
        # an error row, rerun by --resume: stored as a result it looked like data (a fedproto run
        # whose edges failed every round ran its whole budget and was kept with accuracy nan)
        raise RuntimeError(f"{label}: no round of {len(res['per_round'])} was evaluated (every accuracy is null)")
    device = res["tiers"].get("device", {})
    return {"method": label, "base_method": method, "overrides": overrides, "split": split_name(alpha),
            "alpha": alpha, "final_accuracy": summary["final_accuracy"], "best_accuracy": summary["best_accuracy"],
            "accuracy_per_round": summary["accuracy_per_round"],
            "accuracy_calibrated_per_round": summary.get("accuracy_calibrated_per_round"),
            "device_up_per_device_per_round": device.get("out_payload", 0) / s.devices / rounds,
            "device_down_per_device_per_round": device.get("in_payload", 0) / s.devices / rounds,
            "device_bytes_by_kind": summary.get("device_bytes_by_kind"),
            "effective_rank": (res["per_round"][-1] if res["per_round"] else {}).get("effective_rank"),
            "device_payload_per_device_per_round": device_bytes(res["tiers"]) / s.devices / rounds,
            "total_device_payload_bytes": device_bytes(res["tiers"]),
            "all_tiers_out_payload_bytes": sum(r["out_payload"] for r in res["tiers"].values()),
            "train_images": summary.get("train_images"), "images_per_device": summary.get("images_per_device"),
            "planted_groups": summary.get("planted_groups"),
            "device_costs": summary.get("device_costs"),  # per device over the run (bench/simrun.slim_rounds)
            "per_round": res["per_round"], "round_seconds": summary["round_seconds"],
            "wall_seconds": summary["wall_seconds"]}


def personalised(method: str) -> bool:
    from splitedge.methods.registry import get_method

    if method == CENTRAL:
        return False
    return bool(getattr(get_method(method), "personalised", False))


def add_curves(rows: list[dict[str, Any]]) -> None:
    """Each row's plateau summary (bench/plateau.py) of its own accuracy and, when it
    calibrated, of the calibrated one."""
    for r in rows:
        if "error" in r:
            continue
        r["own"] = plateau.summary(r["accuracy_per_round"])
        curve = r.get("accuracy_calibrated_per_round")
        r["calibrated"] = plateau.summary(curve) if curve else None


def add_bytes_to_reference(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per split, each row's rounds and bytes until it first reached FedAvg's final accuracy
    (not for personalised accuracies, which measure something else)."""
    targets: dict[str, float | None] = {}
    for split in dict.fromkeys(r["split"] for r in rows):
        ref = next((r for r in rows if r["split"] == split and r["method"] == TARGET_REFERENCE
                    and "error" not in r and r["final_accuracy"] is not None), None)
        targets[split] = None if ref is None else float(ref["final_accuracy"])
        for r in rows:
            if r["split"] == split and "error" not in r:
                target = None if personalised(r.get("base_method", r["method"])) else targets[split]
                r["to_reference"] = None if target is None else bytes_to_target(r["per_round"], target)
    return targets


Task = tuple[str, str, dict[str, str], "float | None"]
"""(row label, registered method, overrides, split): one run of the bench."""

RESUME_KEYS = ("dataset", "model", "devices", "edges", "rounds", "seed", "max_train", "max_test", "groups",
               "group_skew", "virtual", "overrides", "until_plateau")
"""Settings a resumed bench must share with the runs it keeps."""


def guarded_run(s: AccuracySettings, label: str, method: str, overrides: dict[str, str],
                alpha: float | None) -> dict[str, Any]:
    """One run, or its error row: one broken method does not stop the others."""
    log.info("accuracy: %s on %s", label, split_name(alpha))
    try:
        if method == CENTRAL:
            return central_run(s, label, overrides, alpha, split_name(alpha))
        return one_run(s, label, method, overrides, alpha)
    except Exception as exc:  # report the others even if one method is broken
        log.exception("accuracy: %s on %s failed", label, split_name(alpha))
        return {"method": label, "base_method": method, "split": split_name(alpha), "alpha": alpha,
                "error": repr(exc)}


def refuse_other_settings(mine: Mapping[str, Any], theirs: Mapping[str, Any], keys: Sequence[str]) -> None:
    """--resume's check, for every suite that resumes: ValueError naming the `keys` whose values
    differ (compared as JSON) between this bench and the folder's earlier one."""
    differ = [k for k in keys if json.dumps(mine.get(k), default=str) != json.dumps(theirs.get(k), default=str)]
    if differ:
        raise ValueError(f"--resume: the folder's runs were made with other settings ({', '.join(differ)}); use "
                         f"another --out or the same settings")


def kept_runs(s: AccuracySettings, tasks: list[Task], previous: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """With `--resume`: the finished runs of the folder's earlier bench that are tasks of this
    one (same label, split and settings), by task index. ValueError when that bench measured
    other settings (mixing them would compare unlike runs)."""
    if not previous:
        return {}
    mine = {k: getattr(s, k) for k in RESUME_KEYS}
    defaults = AccuracySettings()
    theirs = {k: previous["config"].get(k, getattr(defaults, k)) for k in RESUME_KEYS}  # older runs lack new keys
    refuse_other_settings(mine, theirs, RESUME_KEYS)
    done = {(r["method"], r["split"]): r for r in previous["results"]["runs"] if "error" not in r}
    kept = {}
    for i, (label, _, overrides, alpha) in enumerate(tasks):
        row = done.get((label, split_name(alpha)))
        if row is not None and row.get("overrides", {}) == overrides:
            kept[i] = row
    return kept


def run(s: AccuracySettings, progress: Progress | None = None,
        previous: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every (method or variant, split) run, `s.jobs` at a time (each in a process of its own,
    with its own Mosquitto); `progress(config, results)` after each, so an hours-long bench that
    is stopped keeps the runs it finished, and `previous` (the folder's JSON, `--resume`) gives
    back the runs an earlier bench finished."""
    tasks: list[Task] = [(label, method, overrides, alpha) for label, method, overrides in s.entries()
                         for alpha in s.splits]
    rows = kept_runs(s, tasks, previous)
    if rows:
        log.info("accuracy: %d of %d runs kept from the earlier bench", len(rows), len(tasks))

    def finished(i: int, row: dict[str, Any]) -> None:
        rows[i] = row
        if progress is not None:
            progress(*_results(s, [rows[j] for j in sorted(rows)]))

    todo = [i for i in range(len(tasks)) if i not in rows]
    if s.jobs <= 1:
        for i in todo:
            finished(i, guarded_run(s, *tasks[i]))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=s.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(guarded_run, s, *tasks[i]): i for i in todo}
            for future in as_completed(futures):
                finished(futures[future], future.result())
    return _results(s, [rows[i] for i in range(len(tasks))])


def run_summarised(s: AccuracySettings, summarise: Callable[[dict[str, Any]], None],
                   progress: Progress | None = None,
                   previous: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`run`, with `summarise(results)` (a suite built on these runs, e.g. ssl or cluster,
    deriving its columns in place) applied before every partial write and at the end."""
    def partial(config: dict[str, Any], results: dict[str, Any]) -> None:
        summarise(results)
        progress(config, results)

    config, results = run(s, progress=partial if progress else None, previous=previous)
    summarise(results)
    return config, results


def _results(s: AccuracySettings, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    add_curves(rows)
    targets = add_bytes_to_reference(rows)
    config = {**vars(s), "methods": list(dict.fromkeys(r["method"] for r in rows)),
              "splits": [split_name(a) for a in s.splits]}
    return config, {"runs": rows, "reference": TARGET_REFERENCE, "reference_accuracy": targets}


def refresh(results: dict[str, Any], config: dict[str, Any] | None = None) -> None:
    """Recompute the derived columns of a finished run (``splitedge bench accuracy --rerender``)."""
    for r in results["runs"]:  # runs recorded before these columns were kept: from their rounds
        if "error" in r or not r.get("per_round"):
            continue
        if r.get("device_costs") is None and any("device_costs" in p for p in r["per_round"]):
            r["device_costs"] = summed(p["device_costs"] for p in r["per_round"] if "device_costs" in p)
        slim_rounds(r["per_round"])  # a run recorded before the rounds were slimmed
        if "final_accuracy" not in r:  # a row written by hand or by an older bench: from its curve
            seen = [a for a in r.get("accuracy_per_round") or [] if a is not None]
            r["final_accuracy"], r["best_accuracy"] = (seen[-1], max(seen)) if seen else (None, None)
        if r.get("accuracy_calibrated_per_round") is None:
            curve = [p.get("accuracy_calibrated") for p in r["per_round"]]
            r["accuracy_calibrated_per_round"] = curve if any(a is not None for a in curve) else None
        if "device_up_per_device_per_round" not in r:
            device = r["per_round"][-1]["bytes"].get("device", {})
            devices, rounds = (config or {}).get("devices"), len(r["per_round"])
            if devices:
                r["device_up_per_device_per_round"] = device.get("out_payload", 0) / devices / rounds
                r["device_down_per_device_per_round"] = device.get("in_payload", 0) / devices / rounds
    add_curves(results["runs"])
    results["reference_accuracy"] = add_bytes_to_reference(results["runs"])


def markdown(results: dict[str, Any]) -> str:
    ok = [r for r in results["runs"] if "error" not in r]
    ref = results.get("reference", TARGET_REFERENCE)
    rows = []
    ranked = any(r.get("effective_rank") is not None for r in ok)
    for r in ok:
        hit = r.get("to_reference") or {}
        own = personalised(r.get("base_method", r["method"]))
        rank = [_rank(r.get("effective_rank"))] if ranked else []
        rows.append((r["method"] + (" (personalised)" if own else ""), r["split"], r["final_accuracy"],
                     r["best_accuracy"], *rank, round(r["device_payload_per_device_per_round"]),
                     "n/a" if own else hit.get("round", "never"),
                     hit.get("device_payload_bytes"), hit.get("all_tiers_out_wire_bytes"),
                     round(r["wall_seconds"])))
    out = []
    sized = next((r for r in ok if r.get("images_per_device")), None)
    if sized:
        per = sized["images_per_device"]
        out.append(f"Federation: {sized['train_images']} training images, per device min {per['min']}, "
                   f"median {per['median']:g}, max {per['max']}.\n")
    out += ["## Final accuracy and bytes per method and split\n",
            table(["method", "split", "final acc", "best acc", *(["eff. rank"] if ranked else []),
                   "device B/device/round (up+down)",
                   f"round reaching {ref} final", f"device B to {ref} final", f"all tiers wire B to {ref} final",
                   "wall s"], rows)]
    if any(personalised(r.get("base_method", r["method"])) for r in ok):
        out.append("\n(personalised): each device's own model on held-out local data, not a global model on "
                   "the test split, so it is not compared with the reference.")
    if ranked:
        out.append("\neff. rank: effective rank (exp of the entropy of the normalised singular values, centred) of "
                   "the final model's penultimate features on the test split; personalised rows: the devices' "
                   "own models on their held-out data, weighted by its size.")
    out += ["", *curves_table(ok)]
    targets = results.get("reference_accuracy") or {}
    out.append("")
    out += [f"- {split}: {ref} final accuracy {t:.4g}" for split, t in targets.items() if t is not None]
    out += [f"- {r['method']}: settings {r['overrides']}" for r in ok if r.get("overrides")
            and r["split"] == ok[0]["split"]]
    out += [f"- {r['method']} / {r['split']} failed: {r['error']}" for r in results["runs"] if "error" in r]
    return "\n".join(out)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def curves_table(rows: list[dict[str, Any]]) -> list[str]:
    """Final, best, round to 90 % of final and plateau status, of the model's own head and of
    the calibrated one, and the bytes a device sends and receives per round."""
    body = []
    for r in rows:
        own, cal = r.get("own") or plateau.summary(r["accuracy_per_round"]), r.get("calibrated")
        status = lambda c: "-" if c is None else (f"yes (r{c['plateau_round']})" if c["plateaued"] else "no")  # noqa: E731
        body.append((r["method"], r["split"], len(r["accuracy_per_round"]), _pct(own["final"]), _pct(own["best"]),
                     _pct(own.get("last_mean")), own["round_to_90pct_of_final"] or "-", status(own),
                     _pct(cal and cal["final"]), _pct(cal and cal["best"]), _pct(cal and cal.get("last_mean")),
                     status(cal),
                     round(r.get("device_up_per_device_per_round", 0)),
                     round(r.get("device_down_per_device_per_round", 0))))
    return ["## Own head and calibrated head, to a plateau\n",
            table(["method", "split", "rounds", "final %", "best %", f"last {plateau.LAST} mean %",
                   "round to 90 % of final", "plateaued", "calibrated final %", "calibrated best %",
                   f"calibrated last {plateau.LAST} mean %", "calibrated plateaued", "device up B/round",
                   "device down B/round"], body),
            f"\n{plateau.RULE}. Calibrated: the model of the same round with the closed-form head fitted on the devices' "
            f"head statistics (methods/calibration)."]


def _rank(value: Any) -> Any:
    return "-" if value is None or value != value else round(float(value), 1)


def series(results: dict[str, Any]) -> list[Series]:
    """Each finished run's accuracy per round, and its calibrated head's (dashed) when it has one."""
    out = []
    for r in results["runs"]:
        if "error" in r:
            continue
        out.append(Series(r["method"], r["accuracy_per_round"], split=r["split"]))
        cal = r.get("accuracy_calibrated_per_round")
        if cal and any(a is not None for a in cal):
            out.append(Series(r["method"], cal, split=r["split"], dashed=True))
    return out


def figure(results: dict[str, Any]) -> Any:
    """Accuracy per round, a colour per method (bench/lib/plotstyle.py); bars after one round."""
    curves = series(results)
    fig = new_figure(curves)
    draw(fig.axes[0], curves, xlabel="round", ylabel="test accuracy")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "accuracy.png")


Settings = AccuracySettings
