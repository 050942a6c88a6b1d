"""H-SFP's cloud may train only W_g's classifier on synthetic features (cloud_trunk="frozen",
issue 54, item 2): the trunk the served model carries is then exactly its initial one, while
the paper's form trains it; both over the embedded broker on digits with fedcnn (whose trunk,
fc1, has weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitedge.sim import SimSettings, run_sim


@pytest.mark.parametrize("trunk", ["train", "frozen"])
def test_a_frozen_trunk_is_served_as_initialised_and_the_classifier_still_trains(trunk, tmp_path) -> None:
    from safetensors.numpy import load_file

    from splitedge.models import create_split, seeded_init, state_to_numpy

    torch.set_num_threads(1)
    out = tmp_path / trunk
    run_sim(SimSettings(rounds=2, devices=2, edges=1, method="hsfp", model="fedcnn", out=out, max_train=300,
                        max_test=100, overrides={"cloud_trunk": trunk, "ic": 1}))
    served = load_file(str(out / "model.safetensors"))
    with seeded_init(0):
        init = state_to_numpy(create_split("fedcnn", num_classes=10, in_channels=1, image_size=8))
    same = {k: np.array_equal(served[k], init[k]) for k in ("wg.fc1.weight", "wg.fc1.bias", "wg.fc.weight")}
    assert same == {"wg.fc1.weight": trunk == "frozen", "wg.fc1.bias": trunk == "frozen", "wg.fc.weight": False}
