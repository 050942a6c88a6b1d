"""What differential privacy costs in accuracy: accuracy against epsilon (issue 32, item 4).

Per method (`fedavg` and `hsfp-cal` by default, each with the calibrated head, calibrate=lda),
seed and target epsilon (8, 4, 1 at delta 1e-5, over the whole run), one federation in which
every device release is private (docs/privacy.md), beside the same method without DP (the upper
bound) and the lower bound: `fedavg --calibrate lda --set local_epochs=0`, a random network with
the calibrated head, what a device gets without the federation's training (README), without DP
and at each epsilon (its only release is the head statistics: a device that trains nothing sends
its weights back as received, which costs no release). Every run goes through its own Mosquitto
(bench/lib/simrun.py).

Each DP run is set before it starts from what the cloud can know (no tuning on devices' data,
except the update clip, see below):
- clips (`clip_rule`): the median L2 norm, over the test split the cloud holds, of the W_c
  features H-SFP takes moments of (`dp_clip`) and of the classifier inputs
  (`features_and_logits`, `dp_head_clip`), of the run's initial model (its seed) in eval mode on
  normalised images; with `--set dp_bn_clip=rule`, `dp_bn_clip` likewise: the largest over
  BatchNorm layers of the median norm of each image's input moments to the layer
  (methods/privacy/norm_stats.py), so BatchNorm statistics are released too (by default they go
  back as received, as in a run); a clip given with --set is used as given;
- releases: a dry run of the same plan (method, settings, rounds, seed) with sigma 1e-6; its
  last record's `dp_releases_total` (what a device releases does not depend on sigma);
- `dp_update_clip`: the median L2 norm, before clipping, of the first weight update each device
  sends in that dry run (in effect a clean run: its placeholder clip of 100 clips nothing seen,
  its noise is 2e-4 per coordinate), or a stated value (`--set dp_update_clip=X`);
- sigma = accountant.sigma_for_epsilon(epsilon, releases, delta); after the run, its last
  record's `dp_epsilon` must be within 1 % of the target (`epsilon_ok`).

Each mechanism at its own unit (`--units`, docs/privacy.md "The privacy unit"; default device):
- `device`: device-level DP-FedAvg (`dp_unit=device`): each weight update clipped to
  `dp_update_clip` and noised on the device once a round, which protects a device's whole data
  (its statistics releases, the head statistics here, protect one image);
- `sample`: sample-level DP-SGD (`dp_unit=sample`, methods/privacy/dpsgd.py): per-image
  gradients clipped to `dp_grad_clip` (`--set dp_grad_clip=C`, else GRAD_CLIP), noise at every
  step, Poisson sampling at `dp_sample_rate` (`--set dp_sample_rate=q`, else `sample_rule`:
  device_batch over the images of a device of average size); the model goes up as trained (no
  release of its own), so its releases are the head statistics (and BatchNorm statistics with
  `dp_bn_clip`), and its dry run also counts the run's DP-SGD steps (`dp_sgd_steps_total`, a
  public count: ceil(local_epochs / q) a round); sigma =
  accountant.sigma_for_epsilon(epsilon, releases, delta, steps=, sample_rate=q).
Both share the run without DP and the lower bound (whose one release, head statistics, is at
one image either way).

DP runs calibrate the head once, after the last round (`calibrate_every=0`): a calibration
only measures and serves the head (nothing of it feeds training, methods/calibration/serving.py)
and each costs every device a release. They run all `--rounds` (their epsilon is planned for
them); the runs without DP stop at their plateau with `--until-plateau` (the same budget). The
lower bound runs one round: with local_epochs=0 nothing changes after it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from splitedge.bench.accuracy import jobs_of, parse_splits, refuse_other_settings, split_name
from splitedge.bench.lib.plotstyle import Series, lines, method_colour, new_figure
from splitedge.bench.lib.report import Progress, save_figure, table
from splitedge.bench.lib.simrun import FederationSettings, parse_sets, run_on_mosquitto
from splitedge.methods.metrics import plateau

log = logging.getLogger(__name__)

DP_METHODS = ("fedavg", "fedprox", "hsfp", "hsfp-cal")
"""Methods whose every release has a private form (the others are refused with dp_sigma)."""
DEFAULT_METHODS = ("fedavg", "hsfp-cal")
EPSILONS = (8.0, 4.0, 1.0)
DELTA = 1e-5
DRY_SIGMA = 1e-6
"""The dry run's noise multiplier: releases are counted as in the real run, the noise is negligible."""
DRY_UPDATE_CLIP = 100.0
"""The dry run's update clip when none is stated: norms are taken before clipping, and at sigma
1e-6 the noise it sets is 2e-4 per coordinate."""
EPSILON_RTOL = 0.01
LOWER = "lower bound"
UNITS = {"device": "DP-FedAvg, device-level", "sample": "DP-SGD, sample-level"}
"""`--units`: the dp_unit of a method's private runs, and what the reports call the mechanism."""
GRAD_CLIP = 1.0
"""DP-SGD's per-image gradient clip when none is stated (`--set dp_grad_clip`): the usual choice
(Opacus' examples; De et al. 2022 clip at 1 and tune the learning rate instead)."""
SAMPLE_SETS = ("dp_sample_rate", "dp_grad_clip")
"""--set settings that are DP-SGD's plan (its private runs only), not every run's."""
KINDS = ("none", "dry", "dp", "lower")
"""A run's kind: no DP (upper bound), the dry run of a plan, a DP run, the lower bound without DP.
A task with "untrained" is the lower bound's network (fedavg, local_epochs 0, one round) in a
dry or DP run: the lower bound at each epsilon."""


@dataclass
class DPSettings(FederationSettings):
    methods: tuple[str, ...] = DEFAULT_METHODS
    units: tuple[str, ...] = ("device",)
    epsilons: tuple[float, ...] = EPSILONS
    seeds: tuple[int, ...] = (0, 1)
    alpha: float | None = 0.3  # None: IID
    delta: float = DELTA
    settings: dict[str, str] = field(default_factory=dict)  # method settings every run shares (--set)
    jobs: int = 1
    deadline_s: float | None = None  # None: the sim's default

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> DPSettings:
        quick = a.quick
        methods = tuple(a.methods) or DEFAULT_METHODS
        unknown = [m for m in methods if m not in DP_METHODS]
        if unknown:
            raise ValueError(f"--methods: {unknown} have no differentially private form; pick from "
                             f"{', '.join(DP_METHODS)}")
        epsilons = tuple(float(e) for e in (a.epsilons or (() if not quick else ("8",)))) or EPSILONS
        if any(not e > 0 for e in epsilons):
            raise ValueError(f"--epsilons must be > 0, got {epsilons}")
        seeds = tuple(int(v) for v in a.seeds) or ((a.seed,) if quick else (a.seed, a.seed + 1))
        if a.alphas:
            splits = parse_splits(a.alphas)
            if len(splits) != 1:
                raise ValueError(f"--alphas: the dp suite runs one split, got {a.alphas!r}")
            alpha = splits[0]
        else:
            alpha = 0.3 if a.alpha is None else a.alpha
        units = tuple(getattr(a, "units", ()) or ()) or ("device",)
        if any(u not in UNITS for u in units) or len(set(units)) != len(units):
            raise ValueError(f"--units: device and/or sample (dp_unit of the private runs), got {','.join(units)}")
        sets = parse_sets(a.set)
        if "dp_sigma" in sets or "dp_delta" in sets or "dp_unit" in sets:
            raise ValueError("--set dp_sigma / dp_delta / dp_unit: the dp suite sets them (sigma from --epsilons, "
                             "delta 1e-5, the unit from --units)")
        if "sample" not in units and any(k in sets for k in SAMPLE_SETS):
            raise ValueError(f"--set {'/'.join(SAMPLE_SETS)}: DP-SGD's settings need --units sample")
        return cls(methods=methods, units=units, epsilons=epsilons, seeds=seeds, alpha=alpha, settings=sets,
                   dataset=a.dataset, data=a.data, model=a.model, devices=a.devices or (4 if quick else 10),
                   edges=a.edges or 2, rounds=a.rounds or (2 if quick else 40),
                   max_train=a.max_train or (400 if quick else None), max_test=a.max_test or (200 if quick else None),
                   until_plateau=bool(a.until_plateau), jobs=jobs_of(a), deadline_s=a.deadline,
                   virtual=a.virtual or 0)


Task = dict[str, Any]
"""One run: {"kind", "method", "seed", "epsilon"} and, for a DP run, its "plan"."""


# -- the rules a DP run is set by ------------------------------------------------------------------

def median_norm(features: Any) -> float:
    """The clip rule: the median L2 norm of the rows (each flattened) of `features` [N, ...]."""
    x = np.asarray(features, dtype=np.float64)
    if not len(x):
        raise ValueError("no features to take a median norm of")
    return float(np.median(np.linalg.norm(x.reshape(len(x), -1), axis=1)))


def clip_rule(s: DPSettings, method: str, seed: int) -> dict[str, float]:
    """`dp_clip` and `dp_head_clip` for a run of `method` at `seed`: the median norms of its
    initial model's W_c features (as H-SFP takes moments of them: before W_c's final ReLU with
    pre_relu) and classifier inputs over the test split, in eval mode on normalised images."""
    import torch

    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import batches, to_input
    from splitedge.methods.torch_utils import build_split, norm_input_moments
    from splitedge.models import pre_activation

    _, test, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=seed)
    config = build_run_config(method, info, s.model, seed, {"calibrate": "lda", **stated(s, private=False)})
    spec = config.model
    model = build_split(spec).eval()
    wc = pre_activation(model.wc) if getattr(config.method, "pre_relu", False) else model.wc
    wc_out, head_in = [], []
    with torch.inference_mode():
        for sl in batches(len(test[1]), 256):
            x = torch.from_numpy(to_input(test[0][sl], spec.mean, spec.std))
            wc_out.append(wc(x).flatten(1).numpy())
            head_in.append(model.features_and_logits(x)[0].numpy())
    # dp_bn_clip: each BatchNorm layer's per-image input moments (as the devices release them) of
    # the part a device sends (H-SFP: W_c; else the model): the largest of the layers' medians
    sent = model.wc if method.startswith("hsfp") else model
    layout, vectors = norm_input_moments(sent, (torch.from_numpy(to_input(test[0][sl], spec.mean, spec.std))
                                                for sl in batches(len(test[1]), 256)))
    moments, at, bn = np.concatenate(vectors), 0, 0.0
    for _, channels in layout:
        bn = max(bn, median_norm(moments[:, at:at + 2 * channels]))
        at += 2 * channels
    return {"dp_clip": median_norm(np.concatenate(wc_out)), "dp_head_clip": median_norm(np.concatenate(head_in)),
            **({"dp_bn_clip": bn} if layout else {})}


RULE = "rule"
"""`--set dp_bn_clip=rule`: BatchNorm statistics released with the clip the rule sets (off by
default, as in a run: on digits at epsilon 64 and below their release moved neither head beyond
the seeds' spread, the update noise dominating, and doubled the releases; bench/results/dp-digits-bn)."""


PRIVATE_ONLY = ("dp_devices",)
"""--set settings only the runs with DP take (a run without DP refuses them): `--set secagg=plus
--set dp_devices=5` compares distributed DP against the same federation without DP."""


def stated(s: DPSettings, private: bool = True) -> dict[str, str]:
    """The --set settings a run takes as given (not those left to the rule, nor DP-SGD's, which
    its plan holds); `private`: a run with DP, which also takes PRIVATE_ONLY."""
    return {k: v for k, v in s.settings.items()
            if v != RULE and k not in SAMPLE_SETS and (private or k not in PRIVATE_ONLY)}


def sample_rule(s: DPSettings, method: str, seed: int, clips: Mapping[str, float]) -> dict[str, float]:
    """DP-SGD's plan for `method`'s sample-level runs at `seed`: `dp_grad_clip` (stated, else
    GRAD_CLIP) and `dp_sample_rate` (stated, else the method's device_batch over the training
    images of a device of average size, at most 1: the expected batch is then device_batch, the
    divisor DP-SGD uses; public, from the run's settings). ValueError, in one line, when the
    method's config refuses DP-SGD (e.g. H-SFP's SupCon target: `--set device_target=etf`)."""
    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset

    train, _, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=seed)
    base = {"calibrate": "lda", **stated(s)}
    batch = build_run_config(method, info, s.model, seed, base).method.device_batch
    plan = {"dp_sample_rate": float(s.settings.get("dp_sample_rate") or min(1.0, batch * s.devices / len(train[1]))),
            "dp_grad_clip": float(s.settings.get("dp_grad_clip") or GRAD_CLIP)}
    try:
        build_run_config(method, info, s.model, seed, {**base, **clips, "dp_sigma": 1.0, "dp_unit": "sample", **plan})
    except ValueError as exc:
        raise ValueError(f"--units sample: {exc}") from None
    return plan


def by_rule(s: DPSettings, method: str, clip: str) -> bool:
    """Whether the rule sets `clip` for `method`'s DP runs: dp_clip for H-SFP, dp_head_clip, and
    dp_bn_clip when asked for; a clip stated with --set is used as stated."""
    if clip == "dp_bn_clip":
        return s.settings.get(clip) == RULE
    return clip not in s.settings and (method.startswith("hsfp") or clip != "dp_clip")


def update_norm(weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> float:
    """L2 norm of weights - start over the float entries, as dp.clip_update measures it."""
    total = 0.0
    for k, v in start.items():
        if np.issubdtype(np.asarray(v).dtype, np.floating):
            total += float(np.square(np.asarray(weights[k], np.float64) - np.asarray(v, np.float64)).sum())
    return math.sqrt(total)


@contextlib.contextmanager
def first_updates() -> Iterator[dict[str, float]]:
    """The norm, before clipping, of the first weight update each device of this process's sim
    releases, by its node id (the sim runs each node in a thread of that name): a tap on the one
    function every private weight release goes through (methods/privacy/release.py)."""
    from splitedge.methods.privacy import release

    original, seen = release.dp_weights, {}

    def tapped(weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], **kwargs: Any) -> Any:
        seen.setdefault(threading.current_thread().name, update_norm(weights, start))
        return original(weights, start, **kwargs)

    release.dp_weights = tapped
    try:
        yield seen
    finally:
        release.dp_weights = original


def sigma_for(epsilon: float, releases: int, delta: float = DELTA, steps: int = 0, sample_rate: float = 0.0) -> float:
    """sigma for `epsilon` over `releases` Gaussian releases and `steps` DP-SGD steps at `sample_rate`."""
    from splitedge.methods.privacy.accountant import sigma_for_epsilon

    return sigma_for_epsilon(epsilon, releases, delta, steps=steps, sample_rate=sample_rate)


def epsilon_ok(target: float | None, reached: float | None) -> bool | None:
    """The run spent its target epsilon, to within EPSILON_RTOL (None: not a DP run)."""
    if target is None:
        return None
    return reached is not None and abs(reached / target - 1) <= EPSILON_RTOL


# -- one run ---------------------------------------------------------------------------------------

def overrides_of(s: DPSettings, task: Task) -> dict[str, Any]:
    """The method settings of `task`: the calibrated head, --set, and its DP settings."""
    kind, plan = task["kind"], task.get("plan") or {}
    out: dict[str, Any] = {"calibrate": "lda", **stated(s, private=kind in ("dry", "dp"))}
    if untrained(task):
        out["local_epochs"] = 0
    if kind in ("dry", "dp"):
        out.update({"calibrate_every": 0, "dp_delta": s.delta, **plan["clips"],
                    "dp_sigma": DRY_SIGMA if kind == "dry" else plan["sigma"]})
        if unit_of(task) == "sample":  # DP-SGD: the model goes up as trained, no update clip
            out.update({"dp_unit": "sample", **plan["dpsgd"]})
        else:
            out["dp_update_clip"] = plan.get("update_clip") or s.settings.get("dp_update_clip", DRY_UPDATE_CLIP)
    return out


def unit_of(task: Mapping[str, Any]) -> str | None:
    """The dp_unit of a private run of a trained network ("device" for rows from before
    `--units`); None for a run without DP and for the lower bound (one head release, at one
    image whatever the unit)."""
    if task["kind"] not in ("dry", "dp") or untrained(task):
        return None
    return task.get("unit") or "device"


def untrained(task: Task) -> bool:
    """The lower bound's network: without DP (kind "lower") or at an epsilon ("untrained")."""
    return task["kind"] == "lower" or bool(task.get("untrained"))


def one_run(s: DPSettings, task: Task) -> dict[str, Any]:
    kind, method, seed = task["kind"], task["method"], task["seed"]
    fed = dataclasses.replace(s, seed=seed, until_plateau=s.until_plateau and kind == "none",
                              rounds=1 if untrained(task) else s.rounds)
    overrides = overrides_of(s, task)
    name = "lower" if untrained(task) and kind != "lower" else method
    sgd = "-sgd" if unit_of(task) == "sample" else ""
    sim = fed.sim(method, s.alpha, run=f"bench-dp-{name}-{kind}{sgd}-s{seed}", overrides=overrides)
    if s.deadline_s is not None:
        sim = dataclasses.replace(sim, deadline_s=s.deadline_s)
    with first_updates() if kind == "dry" else contextlib.nullcontext({}) as updates:
        res = run_on_mosquitto(sim, check_sys=False)
    summary, per_round = res["summary"], res["per_round"]
    last = per_round[-1] if per_round else {}
    own = summary["accuracy_per_round"]
    cal = summary.get("accuracy_calibrated_per_round")
    up = res["tiers"].get("device", {}).get("out_payload", 0) / s.devices
    row = {"kind": kind, "method": LOWER if untrained(task) else method, "base_method": method, "seed": seed,
           "untrained": untrained(task), "unit": unit_of(task), "epsilon": task.get("epsilon"), "overrides": overrides,
           "sigma": overrides.get("dp_sigma"), "releases": last.get("dp_releases_total"),
           "sgd_steps": last.get("dp_sgd_steps_total"), "sample_rate": last.get("dp_sample_rate"),
           "epsilon_reached": last.get("dp_epsilon"),
           "final_accuracy": summary["final_accuracy"], "best_accuracy": summary["best_accuracy"],
           "final_accuracy_calibrated": summary.get("final_accuracy_calibrated"),
           "best_accuracy_calibrated": summary.get("best_accuracy_calibrated"),
           "accuracy_per_round": own, "accuracy_calibrated_per_round": cal, "rounds": len(own),
           "own": plateau.summary(own), "calibrated": plateau.summary(cal) if cal else None,
           "stopped_on_plateau": summary.get("stopped_on_plateau"),
           "device_up_bytes_per_device": up, "device_up_bytes_per_device_per_round": up / max(1, len(own)),
           "wall_seconds": summary["wall_seconds"]}
    row["epsilon_ok"] = epsilon_ok(row["epsilon"], row["epsilon_reached"])
    if kind == "dry":
        row["update_norms"] = dict(sorted(updates.items()))
    if kind in ("dry", "dp"):
        row["plan"] = task["plan"]
    return row


def guarded_run(s: DPSettings, task: Task) -> dict[str, Any]:
    """One run, or its error row: one broken run does not stop the others."""
    label = f"{task['method']} {task['kind']} seed {task['seed']} epsilon {task.get('epsilon')}"
    log.info("dp: %s", label)
    try:
        return one_run(s, task)
    except Exception as exc:
        log.exception("dp: %s failed", label)
        return {**{k: v for k, v in task.items() if k != "plan"}, "base_method": task["method"],
                "method": LOWER if untrained(task) else task["method"], "error": repr(exc)}


def plan_from_dry(s: DPSettings, dry: dict[str, Any]) -> dict[str, Any]:
    """What the DP runs of the dry run's (method, seed) are told: its releases and clips, and the
    update clip (stated, or the median first update of the dry run's devices)."""
    plan = dict(dry["plan"])
    plan["releases"] = int(dry["releases"] or 0)
    if unit_of(dry) == "sample":
        plan["steps"] = int(dry.get("sgd_steps") or 0)
    if plan["releases"] + plan.get("steps", 0) < 1:
        raise ValueError(f"{dry['method']} seed {dry['seed']}: the dry run reported no release")
    norms = list(dry.get("update_norms", {}).values())
    if unit_of(dry) == "sample":
        plan["update_clip"], plan["update_clip_rule"] = None, "none: DP-SGD sends the model as trained"
    elif "dp_update_clip" in s.settings:
        plan["update_clip"], plan["update_clip_rule"] = float(s.settings["dp_update_clip"]), "stated (--set)"
    elif norms:
        plan["update_clip"] = float(np.median(norms))
        plan["update_clip_rule"] = f"median first update of the dry run's {len(norms)} devices"
    else:  # nothing released weights in the plan (e.g. hsfp with rounds < ic): the clip is never used
        plan["update_clip"], plan["update_clip_rule"] = DRY_UPDATE_CLIP, "placeholder: no weight update released"
    return plan


def follow_ups(s: DPSettings, row: dict[str, Any]) -> list[Task]:
    """The DP runs a finished dry run makes possible (none when it failed)."""
    if row["kind"] != "dry" or "error" in row:
        return []
    try:
        plan = plan_from_dry(s, row)
    except ValueError as exc:
        log.error("dp: %s", exc)
        return []
    unit = unit_of(row)
    rate = plan.get("dpsgd", {}).get("dp_sample_rate", 0.0)
    return [{"kind": "dp", "method": row["base_method"], "seed": row["seed"], "epsilon": e,
             "untrained": bool(row.get("untrained")), **({"unit": unit} if unit else {}),
             "plan": {**plan, "sigma": sigma_for(e, plan["releases"], s.delta, plan.get("steps", 0), rate)}}
            for e in s.epsilons]


def schedule(s: DPSettings, first: list[Task], follow: Callable[[dict[str, Any]], list[Task]],
             finished: Callable[[dict[str, Any]], None]) -> None:
    """Run `first` and whatever `follow(row)` adds as runs finish, `s.jobs` at a time (each in a
    process of its own, as bench accuracy does)."""
    if s.jobs <= 1:
        queue = list(first)
        while queue:
            row = guarded_run(s, queue.pop(0))
            finished(row)
            queue[0:0] = follow(row)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    with ProcessPoolExecutor(max_workers=s.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(guarded_run, s, t) for t in first}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                row = future.result()
                finished(row)
                pending |= {pool.submit(guarded_run, s, t) for t in follow(row)}


RESUME_KEYS = ("dataset", "data", "model", "devices", "edges", "rounds", "max_train", "max_test", "overrides",
               "virtual", "until_plateau", "split", "delta", "settings", "deadline_s", "dry_sigma")
"""Settings a resumed dp bench must share with the runs it keeps. Methods, seeds and epsilons may
differ: a kept run is one of the new bench's tasks, the others run."""


def task_key(t: Mapping[str, Any]) -> tuple[Any, ...]:
    """What names a run, for a task and for its row alike (a row's "method" may be LOWER)."""
    return (t["kind"], t.get("base_method", t["method"]), t["seed"], t.get("epsilon"), untrained(t), unit_of(t))


def _close(a: Any, b: Any) -> bool:
    """Equal plans, numbers to 1e-9 (a dry run's clips are recomputed from the test split)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def kept_rows(config: dict[str, Any], previous: dict[str, Any] | None) -> dict[tuple[Any, ...], dict[str, Any]]:
    """With `--resume`: the finished runs of the folder's earlier dp bench, by task_key.
    ValueError when it measured other settings (mixing them would compare unlike runs)."""
    if not previous:
        return {}
    refuse_other_settings(config, previous.get("config", {}), RESUME_KEYS)
    return {task_key(r): r for r in previous["results"]["runs"] if "error" not in r}


def run(s: DPSettings, progress: Progress | None = None,
        previous: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Clips per (method, seed), then its dry run and the runs without DP; each dry run's DP runs
    once it has finished. `progress` after every run; `previous` (the folder's JSON, --resume)
    gives back the runs an earlier bench finished, a kept dry run its DP runs' plan."""
    config = {**vars(s), "split": split_name(s.alpha), "dry_sigma": DRY_SIGMA, "epsilon_rtol": EPSILON_RTOL}
    kept = kept_rows(config, previous)
    clips = {(m, sd): clip_rule(s, m, sd) for m in dict.fromkeys((*s.methods, "fedavg")) for sd in s.seeds}
    config["clips"] = {f"{m} seed {sd}": c for (m, sd), c in clips.items()}

    def ruled(method: str, seed: int) -> dict[str, float]:
        return {k: v for k, v in clips[method, seed].items() if by_rule(s, method, k)}

    dpsgd = {(m, sd): sample_rule(s, m, sd, ruled(m, sd)) for m in s.methods for sd in s.seeds
             if "sample" in s.units}
    if dpsgd:
        config["dpsgd"] = {f"{m} seed {sd}": p for (m, sd), p in dpsgd.items()}

    def dry(method: str, seed: int, unit: str = "device", **extra: Any) -> Task:
        plan = {"clips": ruled(method, seed), **({"dpsgd": dpsgd[method, seed]} if unit == "sample" else {})}
        return {"kind": "dry", "method": method, "seed": seed, "epsilon": None, **extra,
                **({"unit": unit} if unit == "sample" else {}), "plan": plan}

    first: list[Task] = [dry(m, sd, u) for m in s.methods for u in s.units for sd in s.seeds]
    first += [{"kind": "none", "method": m, "seed": sd, "epsilon": None} for m in s.methods for sd in s.seeds]
    first += [{"kind": "lower", "method": "fedavg", "seed": sd, "epsilon": None} for sd in s.seeds]
    first += [dry("fedavg", sd, untrained=True) for sd in s.seeds]
    rows: list[dict[str, Any]] = []

    def finished(row: dict[str, Any]) -> None:
        rows.append(row)
        if progress is not None:
            progress(config, results_of(s, rows))

    def to_run(tasks: list[Task]) -> list[Task]:
        """The tasks still to run: one the earlier bench finished with the same plan is finished
        now, and its follow-ups are taken in turn."""
        todo = []
        for t in tasks:
            row = kept.pop(task_key(t), None)
            if row is not None and _close(row.get("plan"), t.get("plan")):
                finished(row)
                todo += to_run(follow_ups(s, row))
            else:
                todo.append(t)
        return todo

    todo = to_run(first)
    if rows:
        log.info("dp: %d runs kept from the earlier bench", len(rows))
    schedule(s, todo, lambda row: to_run(follow_ups(s, row)), finished)
    return config, results_of(s, rows)


def results_of(s: DPSettings, rows: list[dict[str, Any]]) -> dict[str, Any]:
    order = {m: i for i, m in enumerate((*s.methods, LOWER))}

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (order.get(r["method"], len(order)), list(UNITS).index(unit_of(r) or "device"), r["seed"],
                KINDS.index(r["kind"]), -(r.get("epsilon") or 0))

    return {"runs": sorted(rows, key=key), "epsilons": list(s.epsilons), "seeds": list(s.seeds),
            "methods": list(s.methods), "units": list(s.units), "split": split_name(s.alpha), "delta": s.delta,
            "rounds": s.rounds,
            "until_plateau": s.until_plateau, "devices": s.devices, "edges": s.edges, "dataset": s.dataset,
            "dp_devices": int(s.settings.get("dp_devices", 1)), "secagg": s.settings.get("secagg", "off")}


# -- reports ---------------------------------------------------------------------------------------

def _pct(v: Any) -> str:
    return "-" if v is None or v != v else f"{100 * float(v):.1f}"


def _eps_label(r: dict[str, Any]) -> str:
    return {"none": "none", "dry": f"clips only (sigma {DRY_SIGMA:g})", "lower": "none"}.get(r["kind"]) \
        or f"{r['epsilon']:g}"


def _plateau(r: dict[str, Any]) -> str:
    """Whether the run's curves plateaued (plateau.py's rule): own head, calibrated head (only
    runs that calibrated every round have a calibrated curve to judge)."""
    def one(c: dict[str, Any] | None) -> str:
        return "-" if c is None else (f"yes (r{c['plateau_round']})" if c["plateaued"] else "no")
    cal = r.get("calibrated")
    judged = cal if cal and sum(a is not None for a in r.get("accuracy_calibrated_per_round") or []) > 1 else None
    return one(r.get("own")) + " / " + one(judged)


def _cell(rows: list[dict[str, Any]], seeds: list[int], key: str) -> str:
    by_seed = {r["seed"]: r for r in rows}
    return " / ".join(_pct(by_seed[sd].get(key)) if sd in by_seed else "-" for sd in seeds)


def markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    ok = [r for r in runs if "error" not in r]
    seeds, epsilons = results["seeds"], results["epsilons"]
    seeds_text = " / ".join(str(sd) for sd in seeds)
    budget = f"to their plateau (budget {results['rounds']})" if results["until_plateau"] else "all of them"
    out = [f"{results.get('dataset', '?')}, {results.get('devices', '?')} devices, {results['split']}, "
           f"{results['rounds']} rounds: every DP run all of them, the runs without DP {budget}; epsilon at delta "
           f"{results['delta']:g} over the whole run, of the device that released the most.\n",
           *([f"Distributed DP: each device adds the noise of sigma / sqrt({results['dp_devices']}) behind "
              f"secagg {results.get('secagg')}, and an edge sums no fewer than {results['dp_devices']} devices "
              f"(methods/privacy/distributed.py); {results.get('edges', '?')} edges.\n"]
             if results.get("dp_devices", 1) > 1 else []),
           f"## Accuracy against epsilon (%, seeds {seeds_text})\n"]
    cols = ["none", *[f"{e:g}" for e in epsilons]]
    body = []
    for method in results["methods"]:
        for unit in results.get("units", ["device"]):
            for key, head in (("final_accuracy_calibrated", "calibrated head"), ("final_accuracy", "own head")):
                cells = [_cell([r for r in ok if r["method"] == method and r["kind"] == "none"], seeds, key)]
                cells += [_cell([r for r in ok if r["method"] == method and r["kind"] == "dp" and r["epsilon"] == e
                                 and unit_of(r) == unit], seeds, key) for e in epsilons]
                body.append((f"{method}, {UNITS[unit]} ({head})", *cells))
    lower = [r for r in ok if r["kind"] == "lower"]
    body.append((f"{LOWER}: fedavg local_epochs=0 (calibrated head)", _cell(lower, seeds, "final_accuracy_calibrated"),
                 *[_cell([r for r in ok if r["method"] == LOWER and r["kind"] == "dp" and r["epsilon"] == e], seeds,
                         "final_accuracy_calibrated") for e in epsilons]))
    out += [table(["method", *[f"epsilon {c}" for c in cols]], body),
            "\nFinal accuracy of the last round; calibrated head: the closed-form head fitted on the devices' "
            "(private, under DP) head statistics after the last round; own head: the model's own classifier. "
            "none: no DP (the upper bound, one run for both units). The lower bound at an epsilon: the random "
            "network's head statistics released privately (its weights go back as received, no release). "
            f"{UNITS['device']} (dp_unit=device): each weight update clipped and noised on the device once a round, "
            f"a device's whole data; {UNITS['sample']} (dp_unit=sample): per-image gradients clipped, noise at "
            "every step, Poisson sampling, one image (add/remove); the head statistics are at one image in both "
            "(docs/privacy.md, 'The privacy unit').\n"]
    out += ["## Every run\n",
            table(["method", "unit", "epsilon", "seed", "sigma", "final %", "best %", "calibrated final %",
                   "calibrated best %", "rounds", "plateaued (own / calibrated)", "epsilon reached", "releases",
                   "DP-SGD steps", "device up KB (per device, run)", "wall s"],
                  [(r["method"], unit_of(r) or "-", _eps_label(r), r["seed"], _num(r.get("sigma")),
                    _pct(r["final_accuracy"]),
                    _pct(r["best_accuracy"]), _pct(r.get("final_accuracy_calibrated")),
                    _pct(r.get("best_accuracy_calibrated")), r["rounds"], _plateau(r),
                    _num(r.get("epsilon_reached")) + ("" if r.get("epsilon_ok") in (None, True) else " (off target)"),
                    r.get("releases") if r.get("releases") is not None else "-",
                    r.get("sgd_steps") if r.get("sgd_steps") is not None else "-",
                    round(r["device_up_bytes_per_device"] / 1000), round(r["wall_seconds"])) for r in ok]),
            f"\n{plateau.RULE}. DP runs calibrate only "
            "after the last round, so they have no calibrated curve to judge. clips only: the dry run that counts "
            "a plan's releases, with every clip of the DP runs but the update clip (placeholder "
            f"{DRY_UPDATE_CLIP:g}, unless stated) and sigma {DRY_SIGMA:g}: what clipping alone does.\n"]
    plans = [r for r in ok if r["kind"] == "dry"]
    if plans:
        out += ["## How each DP run was set\n",
                table(["method", "unit", "seed", "releases", "DP-SGD steps", "dp_sample_rate", "dp_grad_clip",
                       "dp_clip (W_c features)", "dp_head_clip (classifier inputs)",
                       "dp_bn_clip (BatchNorm inputs)", "dp_update_clip", "update clip from",
                       *[f"sigma at epsilon {e:g}" for e in epsilons]],
                      [(r["method"], unit_of(r) or "-", r["seed"], r["releases"],
                        r.get("sgd_steps") if unit_of(r) == "sample" else "-",
                        _num(r["plan"].get("dpsgd", {}).get("dp_sample_rate")),
                        _num(r["plan"].get("dpsgd", {}).get("dp_grad_clip")),
                        _num(r["plan"]["clips"].get("dp_clip")),
                        _num(r["plan"]["clips"].get("dp_head_clip")), _num(r["plan"]["clips"].get("dp_bn_clip")),
                        *_update_clip(r, runs),
                        *[_num(next((d["sigma"] for d in ok if d["kind"] == "dp" and d["method"] == r["method"]
                                     and d["seed"] == r["seed"] and d["epsilon"] == e and unit_of(d) == unit_of(r)),
                                    None)) for e in epsilons])
                       for r in plans]),
                "\nClips: the median L2 norm over the test split (held by the cloud) of the run's initial model "
                "(its seed) in eval mode on normalised images: W_c features as H-SFP takes their moments "
                "(dp_clip, H-SFP only), classifier inputs (dp_head_clip), each image's input moments to a BatchNorm "
                "layer, the largest of the layers' medians (dp_bn_clip; '-': sent back as received, no release). "
                "Releases: the dry run's last "
                "dp_releases_total. Update clip: the median L2 norm, before clipping, of the first weight update "
                "each device sent in the dry run, a clean run in effect (this one number is read off the devices' "
                "data and not accounted for), unless stated; DP-SGD runs release no update. DP-SGD "
                "(unit sample): steps are the dry run's last dp_sgd_steps_total (ceil(local_epochs / q) a round, "
                "every round), q = dp_sample_rate (stated, else device_batch over the training images of a device "
                "of average size), dp_grad_clip stated or 1. sigma: accountant.sigma_for_epsilon(epsilon, "
                f"releases, {results['delta']:g}, steps=, sample_rate=q) (RDP; steps 0 for unit device).\n"]
    dp_rows = [r for r in ok if r["kind"] == "dp"]
    if dp_rows:
        off = [r for r in dp_rows if not r.get("epsilon_ok")]
        out.append(f"Epsilon check: {len(dp_rows) - len(off)} of {len(dp_rows)} DP runs ended within "
                   f"{100 * EPSILON_RTOL:g} % of their target" + ("." if not off else "; off: " + ", ".join(
                       f"{r['method']}{' (' + unit_of(r) + ')' if unit_of(r) else ''} seed {r['seed']} target "
                       f"{r['epsilon']:g} reached "
                       f"{_num(r.get('epsilon_reached'))}" for r in off)))
    out += [f"- {r['method']} {r['kind']} seed {r['seed']} epsilon {r.get('epsilon')} failed: {r['error']}"
            for r in runs if "error" in r]
    return "\n".join(out)


def _update_clip(dry: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[str, str]:
    """(value, rule) of the update clip the dry run's DP runs used."""
    used = next((r["plan"] for r in runs if r["kind"] == "dp" and "error" not in r and r["method"] == dry["method"]
                 and r["seed"] == dry["seed"] and unit_of(r) == unit_of(dry)), None)
    if used is None:
        return "-", "-"
    return _num(used["update_clip"]), used["update_clip_rule"]


def _num(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Final accuracy (calibrated head solid, own head dashed) against epsilon, a line per method
    and seed, the lower bound's calibrated head in grey; each method's run without DP as a dotted
    line, the lower bound's in grey."""
    ok = [r for r in results["runs"] if "error" not in r]
    curves = []
    units = results.get("units", ["device"])
    for method, unit in [(m, u) for m in results["methods"] for u in units] + [(LOWER, None)]:
        label = "lower" if method == LOWER else method  # plotstyle's fixed colour of the bound
        named = f"{unit}, " if unit and len(units) > 1 else ""
        for sd in results["seeds"]:
            dp = sorted((r for r in ok if r["kind"] == "dp" and r["method"] == method and r["seed"] == sd
                         and unit_of(r) == unit), key=lambda r: r["epsilon"])
            if not dp:
                continue
            xs = [r["epsilon"] for r in dp]
            curves.append(Series(label, [r.get("final_accuracy_calibrated") for r in dp], x=xs,
                                 split=f"{named}seed {sd}"))
            if method != LOWER:  # a random network's own head is at chance
                curves.append(Series(label, [r["final_accuracy"] for r in dp], x=xs, split=f"{named}seed {sd}",
                                     dashed=True))
    fig = new_figure(curves)
    ax = fig.axes[0]
    if curves:
        lines(ax, curves, dashed_label="own head (solid: calibrated)", markersize=5)
    for r in ok:
        if r["kind"] == "none" and r.get("final_accuracy_calibrated") is not None:
            ax.axhline(r["final_accuracy_calibrated"], color=method_colour(r["method"]), linestyle=":", linewidth=1)
        if r["kind"] == "lower" and r.get("final_accuracy_calibrated") is not None:
            ax.axhline(r["final_accuracy_calibrated"], color=method_colour("lower"), linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks(results["epsilons"], [f"{e:g}" for e in results["epsilons"]])
    ax.set(xlabel=f"epsilon at delta {results['delta']:g} (whole run)", ylabel="final test accuracy", ylim=(0, 1),
           title="dotted: no DP (colour of the method; lower bound grey)")
    return save_figure(fig, out_dir / "dp.png")


Settings = DPSettings
