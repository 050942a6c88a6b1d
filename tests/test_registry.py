"""Every registered method names real part classes; generated from the registry, so a new
method is checked without new test code."""

from __future__ import annotations

import numpy as np
import pytest

from splitedge.methods.registry import get_method, list_methods
from splitedge.methods.strategy import CloudPart, DevicePart, EdgePart, NodeContext

BASES = {"device": DevicePart, "edge": EdgePart, "cloud": CloudPart}


@pytest.mark.parametrize("name", list_methods())
def test_method_parts_resolve_to_the_right_bases(name: str) -> None:
    method = get_method(name)
    assert method.name == name and {"edge", "cloud"} <= set(method.parts)
    assert any(k.split(":")[0] == "device" for k in method.parts)
    for key in method.parts:
        assert issubclass(method._part_class(key), BASES[key.split(":")[0]]), key


@pytest.mark.parametrize("name", [n for n in list_methods() if "device" not in get_method(n).parts])
def test_unknown_backend_is_a_clear_error(name: str) -> None:
    method = get_method(name)
    ctx = NodeContext("d0", {}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="no device part for backend 'tpu'"):
        method.device_part(ctx, (np.zeros((1, 8, 8, 1), np.uint8), np.zeros(1, np.int64)), "tpu")


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        get_method("nope")
