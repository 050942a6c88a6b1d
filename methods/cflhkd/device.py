"""CFLHKD device: train its cluster's model with CE + distillation from the teachers, and send
up the model, its clustering signal and the class-wise mean logits of the model it received.

Before clustering the "cluster" model is the global one (from the cloud); afterwards it comes
from the device's edge, which averages its cluster. Each round the device also scores the model
it received on a fixed held-out share of its data: the cluster model on its own devices' data.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from splitedge.methods.calibration.personal import PersonalHead
from splitedge.methods.checks import check_stats, check_weights, weight_specs
from splitedge.methods.cflhkd.distill import teachers
from splitedge.methods.cflhkd.layout import layout_signal
from splitedge.methods.cflhkd.method import GLOBAL, MODEL, SIGNAL, TEACHERS
from splitedge.methods.fedproto.device import held_out_tensors, holdout_split
from splitedge.methods.cflhkd.config import CFLHKDConfig
from splitedge.methods.contract import DONE, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.metrics.evaluate import accuracy
from splitedge.methods.data.preprocess import batches
from splitedge.methods.privacy.release import private_means_of, private_weights
from splitedge.methods.torch_utils import (build_split, input_batches, model_outputs, private_norms, sgd,
                                          shuffled_batches)
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import load_numpy_state, state_to_numpy
from splitedge.protocol.errors import ProtocolError


class CFLHKDDevice(PersonalHead, DevicePart[CFLHKDConfig]):
    # As FedProto's device: the held-out rows are kept (drawn from the node's rng at build), the
    # tensors rebuilt from them; info is the round's, read by round_info as it ends. head: its
    # cluster's calibrated head (calibrate=lda), scored on the held-out share.
    model: Kept[torch.nn.Module]
    version: Kept[int]
    tables: Kept[dict[int, tuple[np.ndarray, np.ndarray]]]  # cluster -> (counts [C], logits [C, C])
    holdout_rows: Kept[np.ndarray]
    head: Kept[tuple[np.ndarray, np.ndarray] | None]
    head_version: Kept[int]
    global_model: Kept[torch.nn.Module | None]  # two_way: the cloud's global model beside the cluster's
    global_version: Kept[int]
    can_calibrate = True
    clear_private = "its clustering signal, computed from its noisy update, goes to the cloud device by device"
    secure_kinds = ("logits", "weights")  # its clustering signal is the cloud's to compare, device by device
    private, private_clips = True, ("dp_clip", "dp_update_clip")  # logits; the model (the signal follows from it)

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.model = build_split(self.spec).eval()
        self.specs = weight_specs(state_to_numpy(self.model))
        self.holdout_rows = holdout_split(len(data[1]), self.cfg.holdout, ctx.rng)
        self.x, self.y, self.x_eval, self.y_eval = held_out_tensors(data, self.spec, self.holdout_rows)
        self.version = -1
        # the two-way hierarchy: the cloud's global model beside the cluster's (a teacher, a student)
        self.global_model = build_split(self.spec).eval() if self.cfg.two_way else None
        self.global_version = -1
        self.tables = {}
        self.info: dict[str, Any] = {}
        self.label_counts = np.zeros(self.spec.num_classes, np.float32)  # what this round's logits counted

    def restore_state(self, state: dict[str, Any]) -> None:
        super().restore_state(state)
        self.x, self.y, self.x_eval, self.y_eval = held_out_tensors(self.data, self.spec, self.holdout_rows)

    @property
    def cluster(self) -> int | None:
        """The cluster the cloud placed this device in (its group "c<k>"), None before clustering."""
        groups = [g for g in getattr(self.ctx.view, "groups", ()) if g.startswith("c") and g[1:].isdigit()]
        return int(groups[0][1:]) if groups else None

    def ready(self, plan: RoundPlan) -> bool:
        wants_global = GLOBAL in plan.versions and self.global_model is not None
        return self.version >= max(plan.version(MODEL), 0) and self.head_ready(plan) and \
            (not wants_global or self.global_version >= plan.version(GLOBAL))

    @torch.no_grad()
    def head_features(self, x: torch.Tensor) -> np.ndarray:
        """The cluster model's classifier input (eval mode)."""
        self.model.eval()
        return self.model.features_and_logits(x)[0].numpy()

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        return self.head_features(torch.from_numpy(x))

    def check(self, env: Any, source: str) -> None:
        body = env.body
        if self.is_head(env):
            self.check_head(env, int(self.model.wg[-1].in_features))
        elif env.kind == "weights":
            two_way = self.global_model is not None and body.get("part") == GLOBAL
            check_weights(body, self.specs, part=GLOBAL if two_way else MODEL, source=source)
        elif env.kind == "arrays" and body["name"] == TEACHERS:
            c = self.spec.num_classes
            logits, counts = body["arrays"].get("logits"), body["arrays"].get("counts")
            if logits is None or counts is None or logits.shape[1:] != (c, c) or counts.shape != logits.shape[:2]:
                raise ProtocolError("state.shape", f"teachers need logits [K, {c}, {c}] and counts [K, {c}]")

    def on_message(self, env: Any) -> None:
        body = env.body
        if self.is_head(env):
            self.take_head(env)
        elif env.kind == "weights" and body["part"] == GLOBAL:
            if body["version"] > self.global_version:
                load_numpy_state(self.global_model, body["weights"])
                self.global_version = int(body["version"])
        elif env.kind == "weights" and body["version"] > self.version:
            load_numpy_state(self.model, body["weights"])
            self.version = int(body["version"])
        elif env.kind == "arrays" and body["name"] == TEACHERS:
            arrays = body["arrays"]
            self.tables = {int(k): (np.asarray(n), np.asarray(t, dtype=np.float32))
                           for k, n, t in zip(arrays["clusters"], arrays["counts"], arrays["logits"])}

    def forward(self, batch: Batch) -> Outputs:
        return model_outputs(self.model, batch.x)

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        self.info = {"accuracy": accuracy(self.model, self.x_eval, self.y_eval), "eval_samples": int(len(self.y_eval))}
        two_way = GLOBAL in plan.versions and self.global_model is not None  # clustered, the global model here
        if two_way:  # the global model on this group's held-out data, with this group's labels
            self.info["global_accuracy"] = accuracy(self.global_model, self.x_eval, self.y_eval)
        yield Message("logits", self.mean_logits())
        start = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        layout = layout_signal(self.model, self.x) if self.cfg.signal == "layout" else None  # of the model received
        norms = private_norms(self, self.model, input_batches(self.x))  # of the model received, before training
        opt = sgd(self.model.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        extra: dict[str, Any] = self.teacher_tensors()
        if two_way and self.cfg.global_teacher == "model":
            extra["teacher_global"] = self.global_model

        def epoch() -> Iterator[Batch]:
            for idx in shuffled_batches(len(self.y), self.cfg.device_batch, gen):
                yield Batch(self.x[idx], self.y[idx], extra)

        self.losses = train_epochs(self.forward, self.method.loss_terms("device"), epoch, opt, [self.model],
                                   epochs=self.cfg.local_epochs)
        weights, before = state_to_numpy(self.model), {k: v.numpy() for k, v in start.items()}
        if self.cfg.dp_sigma > 0:  # the update clipped and noised; the signal is computed from what is sent
            weights = private_weights(self, weights, before, norms)
            load_numpy_state(self.model, weights)  # it holds what it released: whatever it computes next is of that
        yield Message("weights", {"part": MODEL, "version": self.version, "samples": self.reported_samples(len(self.y)),
                                  "weights": weights})
        yield Message("arrays", {"name": SIGNAL, "version": plan.round,
                                 "arrays": {"v": layout if layout is not None else self.signal(weights, before)}})
        if two_way and self.cfg.distill_global:
            yield Message("weights", self.distil_upward(gen))
        yield DONE

    def distil_upward(self, gen: torch.Generator) -> dict[str, Any]:
        """The paper's cluster-to-global flow: the copy of the global model this device received
        trains for `local_epochs` on its data, taught by its freshly trained cluster model's soft
        outputs beside the cross-entropy (methods/cflhkd/method.py, upward_terms); the result goes
        up as the `global` part."""
        model = self.global_model
        opt = sgd(model.parameters(), self.cfg.device_lr, self.cfg.momentum, self.cfg.weight_decay)

        def batches_with_teacher() -> Iterator[Batch]:
            for idx in shuffled_batches(len(self.y), self.cfg.device_batch, gen):
                yield Batch(self.x[idx], self.y[idx], {"teacher_cluster": self.model})

        self.losses.update(train_epochs(lambda b: model_outputs(model, b.x), self.method.upward_terms(),
                                        batches_with_teacher, opt, [model], epochs=self.cfg.local_epochs))
        return {"part": GLOBAL, "version": self.global_version, "samples": self.reported_samples(len(self.y)),
                "weights": state_to_numpy(model)}

    def teacher_tensors(self) -> dict[str, Any]:
        """The class-wise teacher tables (the global one only where the global model does not teach)."""
        if not self.cfg.kd or not self.tables:
            return {}
        g, has_g, p, has_p = teachers(self.tables, self.cluster, self.cfg.teacher_weights)
        as_t = lambda a, h: (torch.from_numpy(np.asarray(a, np.float32)), torch.from_numpy(h))  # noqa: E731
        out = {"teacher_peers": as_t(p, has_p)}
        if self.cfg.global_teacher == "table":
            out["teacher_global"] = as_t(g, has_g)
        return out

    @torch.no_grad()
    def mean_logits(self) -> dict[str, Any]:
        """Class-wise mean logits of the model this device received, on its training share, of the
        classes above the run's minimum count. Under DP that model is a function of releases only
        (its cluster's, or its own released update), so the release is bounded at one image."""
        self.model.eval()
        c = self.spec.num_classes
        if self.cfg.dp_sigma > 0:  # one noisy release of every class; the floor applies to its noisy counts
            rows = [(model_outputs(self.model, self.x[sl])["logits"].numpy(), self.y[sl].numpy())
                    for sl in batches(len(self.y), 256)]
            classes, counts, means = private_means_of(self, rows, self.data[1], c)
            means = means.astype(np.float32)
        else:
            keep = self.stats_floor(self.y.numpy()).keep
            y = self.y.numpy()[keep]
            logits = model_outputs(self.model, self.x[torch.from_numpy(keep)])["logits"].numpy().astype(np.float64) \
                if keep.any() else np.zeros((0, c))
            classes = np.unique(y)
            means = np.stack([logits[y == k].mean(axis=0) for k in classes]).astype(np.float32) if len(classes) \
                else np.zeros((0, c), np.float32)
            counts = np.array([(y == k).sum() for k in classes], dtype=np.int64)
        self.label_counts = np.zeros(c, np.float32)
        self.label_counts[classes] = counts  # the label signal: the counts this release sent
        body = {"classes": classes.astype(np.int64), "counts": counts.astype(np.int64), "logits": means,
                "versions": {MODEL: max(self.version, 0)}}
        check_stats(body, "logits", dim=self.spec.num_classes, num_classes=self.spec.num_classes)
        return body

    def signal(self, weights: dict[str, np.ndarray], start: dict[str, np.ndarray]) -> np.ndarray:
        """What the cloud clusters devices by: this round's update in the `weights` sent (cosine
        similarity of updates, METHODS.md) of the classifier (`updates`: skews of the labels),
        of the first layer (`stem`: skews of the images, e.g. rotation) or of the whole model,
        or the device's label histogram as its logits message counted it. All come from what
        the device already sent, so under DP the signal costs no privacy of its own (`layout`,
        a statistic of its own, is computed in run_round: layout.py)."""
        if self.cfg.signal == "labels":
            return self.label_counts / max(float(self.label_counts.sum()), 1.0)
        floats = [k for k in weights if np.issubdtype(weights[k].dtype, np.floating)]
        if self.cfg.signal == "updates":
            classifier = f"wg.{list(self.model.wg.named_children())[-1][0]}."  # the head's last layer
            floats = [k for k in floats if k.startswith(classifier)]
        elif self.cfg.signal == "stem":
            first = next(k for k in floats if k.endswith("weight"))  # the first layer's, in the model's order
            floats = [k for k in floats if k.rsplit(".", 1)[0] == first.rsplit(".", 1)[0]]
        return np.concatenate([(weights[k] - start[k]).ravel() for k in floats]).astype(np.float32)

    def round_info(self) -> dict[str, Any]:
        return dict(self.info)
