"""A head calibrated on differentially private statistics (methods/calibration): the statistics
are of classifier inputs clipped to `dp_head_clip`, so the head is scored and served on inputs
clipped the same way. The cloud's `accuracy_calibrated` is the exported model's accuracy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from splitedge.cli import main
from splitedge.exporters.checkpoint import read_header
from splitedge.models.split import NormClip, clip_head_input
from splitedge.sim import SimSettings, run_sim


def test_norm_clip_scales_only_rows_over_the_clip() -> None:
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out = NormClip(1.0)(x)
    assert torch.allclose(out, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="clip must be > 0"):
        NormClip(0.0)


def test_a_clipped_head_keeps_its_weights_and_sees_clipped_inputs() -> None:
    from splitedge.models import create_split

    model = create_split("cnn", num_classes=10, in_channels=1, image_size=8).eval()
    x = torch.randn(5, 1, 8, 8) * 10
    features, _ = model.features_and_logits(x)
    fc = model.wg[-1]
    clip_head_input(model, 0.05)
    _, logits = model.features_and_logits(x)
    assert torch.allclose(logits, fc(NormClip(0.05)(features)), atol=1e-6)
    assert torch.allclose(model(x), logits, atol=1e-6)


def test_the_served_private_head_is_the_scored_one(mosquitto, tmp_path) -> None:
    # FedAvg with DP (negligible noise) on digits: the checkpoint says its head's input clip, and
    # the exported ONNX model, which clips, scores exactly the cloud's accuracy_calibrated
    import onnxruntime as ort

    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.data.preprocess import to_input

    torch.set_num_threads(1)
    out = tmp_path / "run"
    s = SimSettings(rounds=2, devices=4, edges=2, broker=mosquitto.url, run="private-head", out=out, method="fedavg",
                    max_train=600, deadline_s=30.0,
                    overrides={"calibrate": "lda", "calibrate_every": 0, "dp_sigma": 1e-6, "dp_head_clip": 0.1,
                               "dp_update_clip": 100.0, "min_class_count": 2})
    run_sim(s)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert read_header(out / "model.safetensors").metadata["head_input_clip"] == "0.1"
    assert main(["export", "--checkpoint", str(out / "model.safetensors"), "--out", str(tmp_path / "export")]) == 0
    _, test, info = load_dataset("digits")
    session = ort.InferenceSession(str(tmp_path / "export" / "model.onnx"))
    x = to_input(test[0], info.mean, info.std).astype(np.float32)
    exported = float((session.run(None, {session.get_inputs()[0].name: x})[0].argmax(1) == test[1]).mean())
    assert exported == pytest.approx(last["accuracy_calibrated"], abs=1 / len(test[1]))
    assert last["accuracy_calibrated"] > 0.8, last
