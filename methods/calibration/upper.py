"""The layers a split device lacks to reach the classifier's input: W_e and W_g's trunk (torch).

A device that holds only W_c (H-SFP, SplitFed) computes head statistics through the served
W_e and W_g without its classifier. The cloud sends them as the `weights` part CALIB before a
calibration phase, only when they changed since it last sent them (the phase's plan names the
version a device must hold), kept for late joiners; the device builds the module at the first
one it takes.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from splitedge.methods.calibration import CALIB  # noqa: F401 - re-exported: the parts import it from here
from splitedge.methods.checks import check_weight_map, weight_specs
from splitedge.methods.config import ModelSpec
from splitedge.methods.contract import DEVICES, Message
from splitedge.models import ClassifierInput, SplitModel, create_split, seeded_init, state_to_numpy


def upper_layers(spec: ModelSpec) -> ClassifierInput:
    """W_e and W_g without its classifier, as the run's model builds them (eval mode)."""
    with seeded_init(spec.seed):
        split = create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                             image_size=spec.image_size)
    return ClassifierInput(split.we, split.wg).eval()


def check_upper(held: ClassifierInput, weights: Mapping[str, np.ndarray]) -> None:
    """A CALIB map must fit the device's W_e and trunk (ProtocolError naming the rule)."""
    check_weight_map(weights, weight_specs(state_to_numpy(held)))


def upper_update(sent: ClassifierInput, version: int, model: SplitModel) -> tuple[int, list[Message]]:
    """The cloud's side: `sent` is its copy of what it last sent as `version` (-1: nothing yet).
    When the model's W_e and trunk differ from it (or nothing was sent), `sent` takes them and
    they go to every device as the next version; returns (the version in use, messages)."""
    new = ClassifierInput(model.we, model.wg).state_dict()  # a view: the live model's tensors
    current = sent.state_dict()
    if version >= 0 and all(torch.equal(new[k], current[k]) for k in current):
        return version, []
    sent.load_state_dict(new)
    body = {"part": CALIB, "version": version + 1, "samples": 0, "weights": state_to_numpy(sent)}
    return version + 1, [Message("weights", body, to=DEVICES, slot=CALIB)]


def sent_copy(model: SplitModel) -> ClassifierInput:
    """The cloud's copy of W_e and the trunk, before anything was sent."""
    import copy

    return ClassifierInput(copy.deepcopy(model.we), copy.deepcopy(model.wg))
