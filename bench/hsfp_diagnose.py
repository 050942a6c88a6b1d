"""Where H-SFP's synthetic features lose information (issue 12): `splitedge bench hsfp-diagnose`.

Trains H-SFP afresh with its real parts (HSFPTorchDevice, HSFPEdge, HSFPCloud) driven in this
process without a broker (the bytes are not what is measured here), on the sim's Dirichlet
split, and measures:
(a) per class, the total variance (sum over channels) of *pooled* features, synthetic / real,
    at the W_e input (W_c output) and at the head input (W_e output) of the served triple, every
    round. Real: the served W_c (and W_e) on a fixed subset of training images. Synthetic: the
    method's own sampler on that subset's per-class moments (W_e input; with `mixture`, each
    device's share of the subset is a component; with `pre_relu`, moments before the ReLU as
    devices take them), W_e applied to those
    samples (head input, "propagated"), and the sampler again on the moments of those outputs
    (head input, "sampled": what the cloud trains W_g on). The per-position (unpooled) ratio is
    the sampler's sanity check (~1). Also a linear head (the cnn's W_g is pool + linear) fitted
    on real vs on sampled pooled head inputs, scored on the test split.
(b) oracles, trained on the same devices (device training never depends on W_e or W_g, so the
    W_c trajectory is the same as the plain run's): "oracle-edge" edges train W_e on real W_c
    features of their devices' images (global W_c, no augmentation) and report moments of W_e
    on them; "oracle" also trains the head on real W_e outputs. Their served accuracy is the
    ceiling of a moment interface at the edge, and of any interface above W_c.
(c) a linear probe (METHODS.md: frozen, Adam 3e-3, 100 epochs, standardised) of pooled W_c
    features before (the global W_c in use, and each device's local copy) and after each W_c
    average.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from splitedge.bench.lib.plotstyle import Series, draw, new_figure
from splitedge.bench.lib.report import save_figure, table

log = logging.getLogger(__name__)

STACKS = ("hsfp", "oracle-edge", "oracle")
"""Edge-and-cloud stacks trained side by side on the same devices; which tiers see real features."""
REAL_AT = {"hsfp": (), "oracle-edge": ("edge",), "oracle": ("edge", "cloud")}


@dataclass
class DiagnoseSettings:
    dataset: str = "digits"
    data: str | None = None
    model: str | None = None
    devices: int = 10
    edges: int = 2
    rounds: int = 10
    alpha: float | None = 0.3
    seed: int = 0
    max_train: int | None = None
    max_test: int | None = None
    overrides: dict[str, str] = field(default_factory=dict)
    stat_images: int = 2000  # training images for the variance ratios
    probe_images: int = 4000  # training images for the W_c probe (scored on the test split)
    stacks: tuple[str, ...] = STACKS  # --no-oracles: the H-SFP stack alone

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> DiagnoseSettings:
        from splitedge.bench.lib.simrun import parse_variant

        overrides = parse_variant("x=hsfp:" + ",".join(a.set))[2] if getattr(a, "set", None) else {}
        if a.quick:
            overrides = {"ic": "1", **overrides}
        return cls(dataset=a.dataset, data=a.data, model=a.model, devices=a.devices or (4 if a.quick else 10),
                   edges=a.edges or 2, rounds=a.rounds or (2 if a.quick else 10),
                   alpha=0.3 if a.alpha is None else a.alpha, seed=a.seed,
                   max_train=a.max_train or (400 if a.quick else None), max_test=a.max_test or (200 if a.quick else None),
                   overrides=overrides, stat_images=200 if a.quick else 2000, probe_images=300 if a.quick else 4000,
                   stacks=STACKS[:1] if getattr(a, "no_oracles", False) else STACKS)


Settings = DiagnoseSettings


# -- features -------------------------------------------------------------------------------

def _forward(module: Any, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """`module` (eval, no grad) on float32 inputs, batched; numpy out."""
    import torch

    module.eval()
    out = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            out.append(module(torch.from_numpy(np.ascontiguousarray(x[i:i + batch], dtype=np.float32))).numpy())
    return np.concatenate(out)


def pooled(feat: np.ndarray) -> np.ndarray:
    """Global average pool of [N, C, H, W] maps (what SupCon and the cnn's head see); flat rows pass."""
    return feat.mean(axis=(2, 3)) if feat.ndim == 4 else feat.reshape(len(feat), -1)


def class_total_var(x: np.ndarray, y: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Per class, the sum over columns of the unbiased variance (the trace of the covariance)."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    return np.array([flat[y == c].var(axis=0, ddof=1).sum() if (y == c).sum() > 1 else np.nan for c in classes])


def variance_ratios(real: np.ndarray, y_real: np.ndarray, synth: np.ndarray, y_synth: np.ndarray,
                    classes: np.ndarray) -> dict[str, Any]:
    """synthetic / real total variance per class, and their mean over classes."""
    ratio = class_total_var(synth, y_synth, classes) / class_total_var(real, y_real, classes)
    return {"per_class": [float(r) for r in ratio], "mean": float(np.nanmean(ratio))}


def probe(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], num_classes: int,
          seed: int) -> float:
    from splitedge.methods.metrics.report import linear_probe

    return float(linear_probe(train[0], train[1], test[0], test[1], num_classes=num_classes, seed=seed))


# -- the federation, in process -----------------------------------------------------------

class Replica:
    """Devices shared by every stack; per stack, edges and a cloud. Messages are handed over as
    envelopes in reports, as the runtimes would after their checks."""

    def __init__(self, s: DiagnoseSettings, config: Any, train: tuple[np.ndarray, np.ndarray],
                 test: tuple[np.ndarray, np.ndarray], shards: list[np.ndarray]) -> None:
        from splitedge.methods.hsfp.method import HSFP
        from splitedge.methods.contract import DeviceContext

        self.s, self.config, self.train, self.spec = s, config, train, config.model
        self.home = {f"d{i}": f"e{i % s.edges}" for i in range(len(shards))}
        self.devices = {}
        for i, idx in enumerate(shards):
            ctx = DeviceContext(f"d{i}", HSFP(config), np.random.default_rng([s.seed, 1, i]))
            self.devices[f"d{i}"] = ctx.method.device_part(ctx, (train[0][idx], train[1][idx]), "torch")
        self.shards = {f"d{i}": idx for i, idx in enumerate(shards)}
        self.edges: dict[str, dict[str, Any]] = {}
        self.clouds: dict[str, Any] = {}
        for k, stack in enumerate(s.stacks):
            self.edges[stack] = {e: self._part("edge", f"{stack}/{e}", stack, [s.seed, 2, k, j])
                                 for j, e in enumerate(sorted(set(self.home.values())))}
            self.clouds[stack] = self._part("cloud", f"{stack}/cloud", stack, [s.seed, 3, k], test=test)

    def _part(self, tier: str, node: str, stack: str, seed: list[int], test: Any = None) -> Any:
        from splitedge.methods.hsfp.method import HSFP
        from splitedge.methods.contract import CloudContext, EdgeContext

        method = HSFP(self.config)
        if tier in REAL_AT[stack]:
            method.sample_features = self._real_source(tier, node)  # the oracle: real features, same counts
        rng = np.random.default_rng(seed)
        if tier == "cloud":
            return method.cloud_part(CloudContext(node, method, rng, test=test or None))
        return method.edge_part(EdgeContext(node, method, rng))

    def _real_source(self, tier: str, node: str) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
        """`total` real features drawn uniformly from the tier's images (so classes in proportion to
        their counts, as the sampler draws them; with replacement only when there are fewer images): global W_c outputs at an edge, W_e(W_c) at the cloud."""
        from splitedge.methods.data.preprocess import to_input

        stack, name = node.split("/")
        if tier == "edge":
            pool_idx = np.concatenate([self.shards[d] for d, e in self.home.items() if e == name])
        else:
            pool_idx = np.arange(len(self.train[1]))

        def source(merged: Any, total: int, rng: np.random.Generator, shape: Any = None,
                   parts: Any = None) -> tuple[np.ndarray, np.ndarray]:
            idx = np.sort(rng.choice(pool_idx, size=total, replace=total > len(pool_idx)))
            x = to_input(self.train[0][idx], self.spec.mean, self.spec.std)
            if tier == "edge":
                feats = _forward(self.devices["d0"].wc_global, x)
            else:
                cloud = self.clouds[stack].model
                feats = _forward(cloud.we, _forward(cloud.wc, x))
            return feats.reshape(len(idx), -1), self.train[1][idx].astype(np.int64)

        return source

    def start(self) -> None:
        for stack in self.s.stacks:
            for msg in self.clouds[stack].initial_messages():
                self._deliver(stack, msg, "cloud")

    def _deliver(self, stack: str, msg: Any, sender: str) -> None:
        """W_c (to devices: the plain stack's; every stack averages the same updates), W_e and
        the federation's W_c moments (edge_features="global") to the stack's edges."""
        env = self._env(msg, sender, 0)
        if msg.kind == "moments":
            for edge in self.edges[stack].values():
                edge.on_message(env)
        if msg.kind != "weights":
            return
        if env.body["part"] == "wc" and stack == STACKS[0]:
            for dev in self.devices.values():
                dev.on_message(env)
        elif env.body["part"] == "we":
            for edge in self.edges[stack].values():
                edge.on_message(env)

    @staticmethod
    def _env(msg: Any, sender: str, round_: int) -> Any:
        from splitedge.protocol.codec import Envelope

        return Envelope(kind=msg.kind, run="diagnose", round=round_, sender=sender, body=msg.body)

    def plan(self, round_: int) -> Any:
        from splitedge.methods.contract import RoundPlan

        spec = self.clouds[STACKS[0]].plan(round_)
        return RoundPlan(round=round_, method="hsfp", deadline_s=0.0, config={}, versions=dict(spec.versions),
                         directives=dict(spec.directives))

    def device_reports(self, plan: Any) -> dict[str, Any]:
        from splitedge.methods.contract import DONE
        from splitedge.methods.contract import RoundReport

        reports = {}
        for d, dev in self.devices.items():
            report = RoundReport(d)
            for msg in dev.run_round(plan):
                if msg is not DONE:
                    report.messages.setdefault(msg.kind, []).append(self._env(msg, d, plan.round))
            reports[d] = report
        return reports

    def close_round(self, stack: str, plan: Any, reports: dict[str, Any]) -> dict[str, float]:
        """The stack's edges, then its cloud; returns the cloud's metrics and delivers new weights."""
        from splitedge.methods.contract import RoundReport
        from splitedge.methods.contract import Message

        up = []
        for e, edge in self.edges[stack].items():
            mine = [r for d, r in reports.items() if self.home[d] == e]
            edge.on_round_open(plan, {r.sender for r in mine})
            arrived(mine, edge.on_device_message)
            report = RoundReport(e)
            for msg in [*edge.aggregate(plan, mine), Message("done", {"info": {"method": edge.round_info()}})]:
                report.messages.setdefault(msg.kind, []).append(self._env(msg, e, plan.round))
            up.append(report)
        arrived(up, self.clouds[stack].on_edge_message)
        out, metrics = self.clouds[stack].aggregate(plan, up)
        for msg in out:
            self._deliver(stack, msg, "cloud")
        return metrics


def arrived(reports: list[Any], take: Any) -> None:
    """Every message of `reports` handed to a part as it arrives, as the runtime does
    (edge/aggregator.py, cloud/coordinator.py): parts take state such as moments there, and
    aggregate() does not walk the reports for it again."""
    for report in reports:
        for envs in report.messages.values():
            for env in envs:
                take(env)


# -- diagnostics ------------------------------------------------------------------------------

def variance_diagnostic(rep: Replica, idx: np.ndarray, test: tuple[np.ndarray, np.ndarray],
                        rng: np.random.Generator) -> dict[str, Any]:
    """(a) on the plain stack's served triple."""
    from splitedge.methods.moments import compute_moments
    from splitedge.methods.data.preprocess import to_input

    spec, served = rep.spec, rep.clouds[STACKS[0]].served
    method = rep.clouds[STACKS[0]].method
    x, y = to_input(rep.train[0][idx], spec.mean, spec.std), rep.train[1][idx].astype(np.int64)
    fc = _forward(served.wc, x)
    at_c = _forward(method.moment_module(served.wc), x).reshape(len(y), -1)  # what devices take moments of
    m_c = compute_moments(at_c, y)
    owner = np.empty(len(rep.train[1]), dtype=np.int64)  # which device holds each training image
    for k, shard in enumerate(rep.shards.values()):
        owner[shard] = k
    owner = owner[idx]
    parts = [compute_moments(at_c[owner == k], y[owner == k]) for k in np.unique(owner)]  # mixture components
    sc, ys = method.sample_features(m_c, len(y), rng, shape=fc.shape[1:], parts=parts)
    sc = sc.reshape(len(sc), *fc.shape[1:])
    fe, fe_synth = _forward(served.we, fc), _forward(served.we, sc)
    m_e = compute_moments(_forward(method.moment_module(served.we), sc).reshape(len(ys), -1), ys)  # as edges do
    se, ye = method.sample_features(m_e, len(ys), rng, shape=fe.shape[1:])
    se = se.reshape(len(se), *fe.shape[1:])
    classes = m_c.classes
    out = {"we_input_pooled": variance_ratios(pooled(fc), y, pooled(sc), ys, classes),
           "we_input_per_position": variance_ratios(fc, y, sc, ys, classes),
           "head_input_pooled_propagated": variance_ratios(pooled(fe), y, pooled(fe_synth), ys, classes),
           "head_input_pooled_sampled": variance_ratios(pooled(fe), y, pooled(se), ye, classes)}
    tx = _forward(served.we, _forward(served.wc, to_input(test[0], spec.mean, spec.std)))
    ty = test[1].astype(np.int64)
    out["head_fit_real"] = probe((pooled(fe), y), (pooled(tx), ty), spec.num_classes, rep.s.seed)
    out["head_fit_sampled"] = probe((pooled(se), ye), (pooled(tx), ty), spec.num_classes, rep.s.seed)
    return out


def wc_probe(module: Any, rep: Replica, probe_set: tuple[np.ndarray, np.ndarray],
             test: tuple[np.ndarray, np.ndarray]) -> float:
    """(c) linear probe of pooled W_c features of `module`."""
    from splitedge.methods.data.preprocess import to_input

    spec = rep.spec
    train_f = pooled(_forward(module, to_input(probe_set[0], spec.mean, spec.std)))
    test_f = pooled(_forward(module, to_input(test[0], spec.mean, spec.std)))
    return probe((train_f, probe_set[1]), (test_f, test[1]), spec.num_classes, rep.s.seed)


def probe_around_average(rep: Replica, probe_set: Any, test: Any) -> dict[str, Any]:
    """Before the average: the global W_c in use and each device's local copy."""
    devices = list(rep.devices.values())
    local = [wc_probe(dev.wc_local, rep, probe_set, test) for dev in devices]
    return {"global_before": wc_probe(devices[0].wc_global, rep, probe_set, test),
            "local_before": local, "local_before_mean": float(np.mean(local))}


def run(s: DiagnoseSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from splitedge.cloud.options import build_run_config
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.partition import dirichlet, iid

    torch.set_num_threads(1)
    train, test, info = load_dataset(s.dataset, s.data, max_train=s.max_train, max_test=s.max_test, seed=s.seed)
    config = build_run_config("hsfp", info, s.model, s.seed, s.overrides)
    split_rng = np.random.default_rng(s.seed)  # as splitedge.sim.partition
    shards = (iid(train[1], s.devices, split_rng) if s.alpha is None
              else dirichlet(train[1], s.devices, s.alpha, split_rng))
    rep = Replica(s, config, train, test, shards)
    rng = np.random.default_rng([s.seed, 9])
    stat_idx = np.sort(rng.choice(len(train[1]), size=min(s.stat_images, len(train[1])), replace=False))
    probe_idx = np.sort(rng.choice(len(train[1]), size=min(s.probe_images, len(train[1])), replace=False))
    probe_set = (train[0][probe_idx], train[1][probe_idx].astype(np.int64))
    test_y = (test[0], test[1].astype(np.int64))
    rep.start()
    rounds, probes = [], []
    for r in range(1, s.rounds + 1):
        plan = rep.plan(r)
        reports = rep.device_reports(plan)
        averaging = "wc" in plan.directives.get("average", ())
        entry = probe_around_average(rep, probe_set, test_y) if averaging else None
        record: dict[str, Any] = {"round": r, "average": list(plan.directives.get("average", ()))}
        for stack in s.stacks:
            metrics = rep.close_round(stack, plan, reports)
            record[stack] = {"accuracy": metrics.get("accuracy"), "wc_version": metrics.get("wc_version"),
                             "we_version": metrics.get("we_version")}
        if entry is not None:
            entry.update(round=r, after=wc_probe(rep.devices["d0"].wc_global, rep, probe_set, test_y))
            probes.append(entry)
        if rep.clouds[STACKS[0]].served_versions:
            record["variance"] = variance_diagnostic(rep, stat_idx, test_y, rng)
        log.info("hsfp-diagnose round %d: %s", r, {k: record[k]["accuracy"] for k in s.stacks})
        rounds.append(record)
    config_out = {**vars(s), "model": config.model.model, "settings": dict(s.overrides)}
    return config_out, {"rounds": rounds, "probes": probes, "stacks": list(s.stacks),
                        "train_images": int(len(train[1])), "test_images": int(len(test[1])),
                        "images_per_device": [int(len(i)) for i in shards]}


# -- report -----------------------------------------------------------------------------------

def _f(v: Any, nd: int = 4) -> Any:
    return "-" if v is None or v != v else round(float(v), nd)


VAR_KEYS = ("we_input_per_position", "we_input_pooled", "head_input_pooled_propagated", "head_input_pooled_sampled")


def markdown(results: dict[str, Any]) -> str:
    rounds, stacks = results["rounds"], results["stacks"]
    out = [f"Federation: {results['train_images']} training images over {len(results['images_per_device'])} "
           f"devices ({min(results['images_per_device'])}..{max(results['images_per_device'])} each), "
           f"{results['test_images']} test images.\n",
           "## Served accuracy per round (b: oracles train on real features)\n",
           table(["round", "average", *stacks], [(r["round"], ",".join(r["average"]) or "-",
                                                   *(_f(r[k]["accuracy"]) for k in stacks)) for r in rounds]),
           "\n## (a) Synthetic / real total variance per class, mean over classes (served triple)\n",
           table(["round", *VAR_KEYS, "head fit real", "head fit sampled"],
                 [(r["round"], *(_f(r["variance"][k]["mean"]) for k in VAR_KEYS), _f(r["variance"]["head_fit_real"]),
                   _f(r["variance"]["head_fit_sampled"])) for r in rounds if "variance" in r])]
    last = next((r for r in reversed(rounds) if "variance" in r), None)
    if last:
        v = last["variance"]
        out += [f"\nPer class at round {last['round']}:\n",
                table(["class", *VAR_KEYS], [(c, *(_f(v[k]["per_class"][c]) for k in VAR_KEYS))
                                             for c in range(len(v[VAR_KEYS[0]]["per_class"]))])]
    out += ["\n## (c) Linear probe of pooled W_c features around each W_c average (test accuracy)\n",
            table(["round", "global W_c before", "device copies before (mean)", "device copies min..max",
                   "averaged W_c after"],
                  [(p["round"], _f(p["global_before"]), _f(p["local_before_mean"]),
                    f"{min(p['local_before']):.4f}..{max(p['local_before']):.4f}", _f(p["after"]))
                   for p in results["probes"]])]
    out.append("\nVariance: trace of the within-class covariance; pooled = global average over positions. "
               "head fit: a linear head on pooled head inputs (real, or sampled as the cloud samples them), "
               "scored on the test split. Probe: Adam 3e-3, 100 epochs, standardised features.")
    return "\n".join(out)


def figure(results: dict[str, Any]) -> Any:
    """Each stack's served accuracy per round, a colour per stack (bench/lib/plotstyle.py: the
    H-SFP stack in hsfp's); bars after one round."""
    rounds = [r["round"] for r in results["rounds"]]
    curves = [Series(stack, [r[stack]["accuracy"] for r in results["rounds"]], x=rounds) for stack in results["stacks"]]
    fig = new_figure(curves)
    draw(fig.axes[0], curves, xlabel="round", ylabel="served test accuracy")
    return fig


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    fig = figure(results)
    return save_figure(fig, out_dir / "hsfp_diagnose.png")
