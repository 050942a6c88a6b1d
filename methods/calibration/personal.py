"""Calibration where each device keeps its own model (FedProto) or its cluster's (CFLHKD).

There is no one served model to refit at the cloud: devices send head statistics of their
training share, the cloud fits a head per model group (the federation's, or one per cluster)
and sends it back (`arrays` record `head`), and in the evaluation phase each device scores that
head on its held-out share with its own model. A device part mixes this in before DevicePart;
it needs `holdout_rows` (train, held-out rows of its data) and `head_features(x)` (its model's
classifier input for normalised images, as the part's own evaluation uses them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from splitedge.methods.calibration import HEAD, head_input_clip
from splitedge.methods.calibration.records import check_head
from splitedge.methods.privacy.dp import clip_rows


class PersonalHead:
    head: tuple[np.ndarray, np.ndarray] | None = None
    head_version = -1

    def head_ready(self, plan: Any) -> bool:
        """In an evaluation phase, the head of that round has arrived."""
        return not plan.evaluating or self.head_version >= plan.version(HEAD)

    def is_head(self, env: Any) -> bool:
        return env.kind == "arrays" and env.body.get("name") == HEAD

    def check_head(self, env: Any, dim: int) -> None:
        check_head(env.body, self.spec.num_classes, dim)  # type: ignore[attr-defined]

    def take_head(self, env: Any) -> None:
        if int(env.body["version"]) > self.head_version:
            arrays = env.body["arrays"]
            self.head = (np.array(arrays["weight"], dtype=np.float64), np.array(arrays["bias"], dtype=np.float64))
            self.head_version = int(env.body["version"])

    def calibration_data(self) -> tuple[Any, np.ndarray]:
        """The training share: the held-out one scores the head."""
        rows = self.holdout_rows[0]  # type: ignore[attr-defined]
        x, y = self.data  # type: ignore[attr-defined]
        return x[rows], np.asarray(y)[rows]

    def evaluate_head(self) -> dict[str, Any]:
        """The head it was sent on its own model's held-out features."""
        y = np.asarray(self.y_eval)  # type: ignore[attr-defined]
        if self.head is None or not len(y):
            return {}
        feats = np.asarray(self.head_features(self.x_eval), dtype=np.float64).reshape(len(y), -1)  # type: ignore
        clip = head_input_clip(self.cfg)  # type: ignore[attr-defined]
        if clip > 0:  # the head was fitted on clipped inputs
            feats = clip_rows(feats, clip)
        predicted = np.argmax(feats @ self.head[0].T + self.head[1], axis=1)
        return {"accuracy": float((predicted == y).mean()), "eval_samples": int(len(y))}
