"""Torch networks and their split points (W_c, W_e, W_g).

Importing the package registers the built-in models ("cnn", "resnet18", "fedcnn", "fedcnn2");
registration only fills the in-process name table (no seeds, no downloads). One's own network
is a plug-in (models/registry.py), cut into parts by `split_module`.
"""
from splitedge.models.registry import create_split, list_models, register_model, use_model
from splitedge.models.split import (PART_NAMES, ClassifierInput, SplitModel, head_features, pool, pre_activation,
                                   seeded_init, split_module)
from splitedge.models.state import device_of, load_numpy_state, state_to_numpy
from splitedge.models import cnn as _cnn, resnet as _resnet, fedcnn as _fedcnn  # noqa: F401  (register the models)

__all__ = [
    "PART_NAMES", "ClassifierInput", "SplitModel", "create_split", "device_of", "head_features", "list_models",
    "load_numpy_state", "pool", "pre_activation", "register_model", "seeded_init", "split_module",
    "state_to_numpy", "use_model",
]
