"""H-SFP edge part: merge device moments exactly, sample, train W_e with SupCon, report moments up."""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import numpy as np
import torch

from splitedge.methods.averaging import GlobalModels, weight_updates
from splitedge.methods.checks import check_space, check_stats, check_version, check_weights, weight_specs
from splitedge.methods.hsfp.method import AVERAGE, LABELS, REPORT_LABELS, WC, WE
from splitedge.methods.hsfp.torch_ops import output_moments, sample_batches, with_counts
from splitedge.methods.moments import ClassMoments, moments_from_body, moments_to_body, moments_without
from splitedge.methods.contract import SUM_SUFFIX, EdgeContext, EdgePart, Kept, Message, Report, RoundPlan, device
from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.torch_utils import retune
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import create_split, load_numpy_state, pool, seeded_init, state_to_numpy
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)


class HSFPEdge(EdgePart[HSFPConfig]):
    # Left out: shapes and weight specs (from the spec) and info (the round's, read by
    # round_info as it ends).
    we_global: Kept[torch.nn.Module]
    we_local: Kept[torch.nn.Module]
    opt: Kept[torch.optim.Optimizer]
    we_version: Kept[int]
    wc_version: Kept[int]  # the newest W_c version announced
    last_wc_version: Kept[int | None]
    cache: Kept[dict[str, tuple[int, ClassMoments]]]  # device -> (wc_version, moments)
    cached_ids: Kept[dict[str, str]]  # device -> msg_id of its cached moments
    cached_at: Kept[dict[str, tuple[int, int]]]  # device -> (wc_version, round) of its cached moments
    reference: Kept[tuple[int, ClassMoments] | None]  # (wc_version, last merge): robust="clip"'s reference
    # edge_features="global": the federation's W_c moments (version, merge) from the cloud, and
    # what this edge last sent up ((version, the message ids merged), merge) to take out of it
    global_wc: Kept[tuple[int, ClassMoments] | None]
    sent_wc: Kept[tuple[tuple, ClassMoments] | None]

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        with seeded_init(self.spec.seed):  # the cloud's W_e v0 replaces these weights before any training
            split = create_split(self.spec.model, num_classes=self.spec.num_classes,
                                 in_channels=self.spec.channels, image_size=self.spec.image_size)
        self.wc_shape, self.we_shape = split.wc_shape, split.we_shape
        self.wc_specs, self.we_specs = weight_specs(state_to_numpy(split.wc)), weight_specs(state_to_numpy(split.we))
        self.we_global = split.we.eval()
        self.we_local = copy.deepcopy(split.we)
        self.we_version = -1
        self.opt = self._new_optimizer()
        self.cache = {}
        self.models = GlobalModels()  # the global W_c relayed: what the devices' W_c updates train from
        self.cached_ids, self.cached_at, self.reference = {}, {}, None
        self.info: dict[str, Any] = {}
        self.wc_version = 0
        self.global_wc, self.sent_wc, self.last_wc_version = None, None, None

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.we_local.parameters(), lr=self.cfg.edge_lr, momentum=0.9, weight_decay=5e-4)

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        retune(self.opt, lr=self.cfg.edge_lr)

    def ready(self, plan: RoundPlan) -> bool:
        return self.we_version >= plan.version(WE) and self.we_version >= 0

    def check(self, env: Any, source: str) -> None:
        """Device moments of W_c outputs and device W_c updates; the cloud's global W_e."""
        body = env.body
        if env.kind == "moments":  # a device's, or (edge_features="global") the federation's merge
            if source == "parent" and self.cfg.edge_features != "global":
                raise ProtocolError("state.space", "W_c moments from the cloud, but edge_features is not 'global'")
            check_wc_moments(body, int(np.prod(self.wc_shape)), self.spec.num_classes, self.cfg.feature_dtype,
                             wc=self.wc_version)
            if source != "parent":
                self._check_newer(env)
        elif env.kind == "weights" and body["part"] in (WC, WE):
            check_weights(body, self.wc_specs if body["part"] == WC else self.we_specs, source=source,
                          trained_from=self.models.of(body))
        elif env.kind == "arrays" and source == "child":
            raise ProtocolError("state.name", f"H-SFP devices send no {body['name']!r} records")

    def _check_newer(self, env: Any) -> None:
        """A device's cached moments are replaced only by newer ones: a message of an older W_c
        version or round (a replay, or a redelivery overtaken by a newer message) is refused as
        `state.stale`, and a second one of the same version and round under a fresh message id
        (a device sends one per round) as `state.replay`. The same message again passes (the
        runtime drops it as a duplicate)."""
        dev, at = env.sender, (int(env.body["versions"].get(WC, 0)), int(env.round))
        held = self.cached_at.get(dev)
        if held is None or self.cached_ids.get(dev) == env.msg_id or at > held:
            return
        if at < held:
            raise ProtocolError("state.stale", f"moments of W_c v{at[0]} round {at[1]}; {dev}'s cached ones are of "
                                               f"v{held[0]} round {held[1]}")
        raise ProtocolError("state.replay", f"second moments of W_c v{at[0]} round {at[1]} under a new id")

    def on_message(self, env: Any) -> list[Message]:
        """The global W_e replaces both our copies (W_c for devices is relayed by the runtime)."""
        if env.kind == "weights" and env.body["part"] == WC:
            self.models.note(WC, int(env.body["version"]), env.body["weights"])
        if env.kind == "weights" and env.body["part"] == WE and int(env.body["version"]) > self.we_version:
            load_numpy_state(self.we_global, env.body["weights"])
            load_numpy_state(self.we_local, env.body["weights"])
            self.opt = self._new_optimizer()
            self.we_version = int(env.body["version"])
        elif env.kind == "moments":
            version = int(env.body["versions"].get(WC, 0))
            if self.global_wc is None or version >= self.global_wc[0]:
                self.global_wc = (version, moments_from_body(env.body))
        return []

    def members_changed(self, members: set[str]) -> None:
        """Moments of a device that moved to another edge must not count here any more."""
        for dev in set(self.cache) - members:
            del self.cache[dev]
            self.cached_ids.pop(dev, None)
            self.cached_at.pop(dev, None)

    def on_device_message(self, env: Any) -> list[Message]:
        """Moments are state, kept whenever they arrive (a device sends them only when they
        change), and only here: the round's reports hold the same messages, which aggregate()
        does not walk again (a secure sum's result comes through here too, runtime/mods/secure.py)."""
        if env.kind == "moments":
            self._remember(env)
        return []

    def _remember(self, env: Any) -> None:
        """Cache a device's moments, decoded once."""
        at = (int(env.body["versions"].get(WC, 0)), int(env.round))
        if at <= self.cached_at.get(env.sender, (-1, -1)):
            return  # refused by check() on arrival; never replaces newer moments
        self.cache[env.sender] = (at[0], moments_from_body(env.body))
        self.cached_ids[env.sender], self.cached_at[env.sender] = env.msg_id, at

    def on_round_open(self, plan: RoundPlan, members: set[str]) -> list[Message]:
        """Ask devices for moments this edge lacks (e.g. it restarted), unless a new W_c version
        just started, when every device sends them anyway."""
        self.wc_version = max(self.wc_version, plan.version(WC))
        steady = self.last_wc_version == plan.version(WC)
        self.last_wc_version = plan.version(WC)
        if not steady:
            return []
        if any(d.endswith(SUM_SUFFIX) and v == plan.version(WC) for d, (v, _) in self.cache.items()):
            return []  # a secure sum of this W_c's moments stands for its devices: asking again costs a DP release
        missing = sorted(d for d in members if self.cache.get(d, (-1,))[0] != plan.version(WC))
        return [Message("request", {"what": "moments"}, to=device(d)) for d in missing]

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        version = plan.version(WC)  # the moments are in the cache already (on_device_message)
        merged_ids = tuple(sorted((d, self.cached_ids[d]) for d, (v, _) in self.cache.items() if v == version))
        current = [self.cache[d][1] for d, _ in merged_ids]  # one order, one sum
        out: list[Message] = []
        self.info = {"merged": len(current)}
        merged = self._merge(version, current) if current else None
        if merged is not None and not len(merged.classes):  # every device withheld every class it holds
            self.info["no_classes"] = 1
            log.warning("edge %s: round %d: none of its %d devices sent a class's statistics (each holds fewer than "
                        "min_class_count=%d images of every class); W_e is not trained and no moments go up",
                        self.ctx.node_id, plan.round, len(current), self.cfg.min_class_count)
        elif merged is not None:
            out.append(self._train_and_report(plan, merged, current))
            if self.cfg.edge_features == "global" and (self.sent_wc is None or self.sent_wc[0] != (version, merged_ids)):
                self.sent_wc = ((version, merged_ids), merged)
                out.append(Message("moments", moments_to_body(merged, dtype=self.cfg.feature_dtype, space=WC,
                                                              versions={WC: version})))
        averaged = plan.directives.get(AVERAGE, ())
        if WC in averaged:
            out.extend(self._average_wc(plan, reports))
        if WE in averaged:
            total = sum(int(m.counts.sum()) for _, m in self.cache.values())
            out.append(Message("weights", {"part": WE, "version": self.we_version, "samples": total,
                                           "weights": state_to_numpy(self.we_local)}))
        if plan.directives.get(REPORT_LABELS):
            out.extend(self._label_histograms(plan))
        return out

    def _merge(self, version: int, current: list[ClassMoments]) -> ClassMoments:
        """The configured merge (exact by default); "clip" clips against the last merge of this W_c version."""
        reference = self.reference[1] if self.reference is not None and self.reference[0] == version else None
        merged = self.method.merge_moments(current, reference)
        self.reference = (version, merged)
        return merged

    def round_info(self) -> dict[str, Any]:
        """`merged`: how many devices' moments the round's merge took; `global`: 1 when W_e
        trained on the federation's W_c moments (edge_features="global")."""
        return dict(self.info)

    def _label_histograms(self, plan: RoundPlan) -> list[Message]:
        """Each device's class counts (from the moments it sent) for the cloud's assignment."""
        hists = {}
        for dev, (_, m) in self.cache.items():
            counts = np.zeros(self.spec.num_classes, dtype=np.float32)
            counts[m.classes] = m.counts
            hists[dev] = counts
        return [Message("arrays", {"name": LABELS, "version": plan.round, "arrays": hists})] if hists else []

    def forward(self, batch: Batch) -> Outputs:
        return {"features": pool(self.we_local(batch.x))}

    def _training_source(self, version: int, merged: ClassMoments,
                         parts: list[ClassMoments]) -> tuple[ClassMoments, list[ClassMoments]]:
        """What W_e trains on: this edge's merge and devices, or (edge_features="global", once
        the cloud's merge of this W_c version is here) the federation's merge, its sources being
        this edge's devices and the rest of the federation (the merge minus what we sent)."""
        held, sent = self.global_wc, self.sent_wc
        if self.cfg.edge_features != "global" or held is None or held[0] != version or sent is None \
                or sent[0][0] != version:
            return merged, parts
        try:
            rest = moments_without(held[1], sent[1])
        except ValueError as exc:  # the cloud's merge does not hold ours (yet): train on our own
            log.info("edge %s: global W_c moments unusable (%s); sampling our own", self.ctx.node_id, exc)
            return merged, parts
        return held[1], parts + ([rest] if rest is not None else [])

    def _train_and_report(self, plan: RoundPlan, merged: ClassMoments, parts: list[ClassMoments]) -> Message:
        seed = int(self.ctx.rng.integers(2**31))
        source, sources = self._training_source(plan.version(WC), merged, parts)
        if self.cfg.edge_features == "global":
            self.info["global"] = int(source is not merged)
        x, y = self.method.sample_features(source, self.cfg.edge_samples, self.ctx.rng, parts=sources)
        batches = sample_batches(x, y, self.wc_shape, batch=self.cfg.edge_batch, seed=seed)
        epochs = self.cfg.edge_epochs if self.cfg.ie else 0  # ie = 0: W_e stays as initialised, nothing to train
        self.losses = train_epochs(self.forward, self.method.loss_terms("edge"), batches, self.opt, [self.we_local],
                                   epochs=epochs)
        module = self.method.moment_module(self.we_global if self.cfg.we_moments == "global" else self.we_local)
        x2, y2 = self.method.sample_features(merged, self.cfg.edge_samples, self.ctx.rng, parts=parts)
        moments = with_counts(output_moments(module, x2, y2, self.wc_shape), merged)
        body = moments_to_body(moments, dtype=self.cfg.feature_dtype, space=WE,
                               versions={WC: plan.version(WC), WE: self.we_version})
        return Message("moments", body)

    def _average_wc(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        parts = weight_updates(reports, WC, plan.version(WC))
        if not parts:
            log.warning("edge %s: slow round %d without any W_c from devices", self.ctx.node_id, plan.round)
            return []
        body = {"part": WC, "version": plan.version(WC), "samples": sum(n for _, n in parts),
                "weights": self.method.merge_weights(parts, reference=self.models.trained_from(WC, plan.version(WC)))}
        return [Message("weights", body)]


def check_wc_moments(body: Any, dim: int, num_classes: int, dtype: str, *, wc: int) -> None:
    """Moments of W_c outputs (a device's, an edge's merge, the federation's) of the
    federation's dimension, classes and wire dtype, with no W_c version newer than `wc`."""
    check_space(body, WC)
    check_stats(body, "mean", dim=dim, num_classes=num_classes, dtype=dtype)
    check_version(WC, int(body["versions"].get(WC, 0)), at_most=wc)
