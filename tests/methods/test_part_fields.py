"""A part's typed surface: its state declared as Kept fields (a field declared and never set, or
misspelt, fails as the part is built), its config type named, and a context per tier that offers
only that tier's fields."""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

import numpy as np
import pytest

from splitedge.methods import kept as kept_module
from splitedge.methods.config import MethodConfig
from splitedge.methods.contract import (CloudContext, CloudPart, DeviceContext, DevicePart, EdgeContext, EdgePart,
                                        FederationView, Kept, NodeContext, Part, Placement)
from splitedge.methods.kept import kept_fields

from parts import cloud_ctx, device_ctx, edge_ctx, method_for, shipped_methods

DATA = (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4))


# -- Kept fields ------------------------------------------------------------------------------

class _Base(Part):
    count: Kept[int]
    scratch: dict  # not kept: rebuilt

    def __init__(self) -> None:  # no context: these tests touch only the fields
        self.count, self.scratch = 0, {}


class _Mixin:
    table: Kept[dict]


class _Sub(_Mixin, _Base):
    pending: Kept[Any] = None  # a class default counts as set
    count: Kept[int]  # declared again: still once, where the base put it

    def __init__(self) -> None:
        super().__init__()
        self.table = {}


def test_kept_fields_are_the_bases_first_then_each_subclass_own_once() -> None:
    assert _Base.kept == ("count",)
    assert _Sub.kept == ("count", "table", "pending")
    assert sorted(_Sub().resume_state()) == ["count", "pending", "table"]


def test_a_kept_field_the_part_never_sets_fails_as_it_is_built() -> None:
    class Forgetful(_Base):
        model: Kept[Any]

    with pytest.raises(TypeError, match=r"Forgetful declares model Kept but leaves it unset once built"):
        Forgetful()


def test_a_misspelt_kept_field_fails_as_it_is_built_and_a_misspelt_read_is_an_attribute_error() -> None:
    class Misspelt(_Base):
        modle: Kept[Any]  # the constructor sets `model`

        def __init__(self) -> None:
            super().__init__()
            self.model = object()

    with pytest.raises(TypeError, match="Misspelt declares modle Kept"):
        Misspelt()
    with pytest.raises(AttributeError, match="coutn"):
        _ = _Base().coutn  # type: ignore[attr-defined]


class _Helper:
    def __init__(self) -> None:
        self.moments = {"w": np.zeros(2)}


class _ByProperty(_Base):
    """State that lives in a helper object: a Kept property, after the annotated fields."""

    def __init__(self) -> None:
        super().__init__()
        self.helper = _Helper()

    @property
    def moments(self) -> Kept[dict[str, np.ndarray]]:
        return self.helper.moments

    @moments.setter
    def moments(self, value: dict[str, np.ndarray]) -> None:
        self.helper.moments = dict(value)


def test_a_kept_property_is_kept_through_its_setter_and_one_without_a_setter_is_refused() -> None:
    part = _ByProperty()
    part.helper.moments["w"] += 3
    fresh = _ByProperty()
    fresh.restore_state(part.resume_state())
    assert _ByProperty.kept == ("count", "moments") and fresh.helper.moments["w"].tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="ReadOnly.moments is a Kept property without a setter"):
        class ReadOnly(_Base):
            @property
            def moments(self) -> Kept[dict]:
                return {}


def test_state_named_in_strings_is_refused_with_the_way_to_declare_it() -> None:
    with pytest.raises(TypeError, match=r"Old\.state names its state in strings; declare each field instead"):
        class Old(_Base):
            state = ("count", "model")


def test_kept_is_read_through_a_module_alias_and_a_foreign_kept_is_refused() -> None:
    module = types.ModuleType("kept_probe")
    module.kept = kept_module
    module.Kept = int  # some other Kept
    sys.modules[module.__name__] = module
    try:
        aliased = type("Aliased", (), {"__module__": module.__name__, "__annotations__": {"a": "kept.Kept[int]"}})
        assert kept_fields(aliased) == ("a",)
        foreign = type("Foreign", (), {"__module__": module.__name__, "__annotations__": {"b": "Kept[int]"}})
        with pytest.raises(TypeError, match="its Kept is not splitedge.methods.kept.Kept"):
            kept_fields(foreign)
    finally:
        del sys.modules[module.__name__]


def test_a_type_checker_sees_a_kept_field_as_its_own_type() -> None:
    hints = typing.get_type_hints(_Base, include_extras=False, localns={"Kept": Kept})
    assert hints["count"] is int


# -- configs ----------------------------------------------------------------------------------

def declared_config(cls: type) -> type:
    """The config type a part class names, through its bases (a TypeVar: its bound)."""
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Part):
                (arg,) = typing.get_args(base)
                return arg.__bound__ if isinstance(arg, typing.TypeVar) else arg
    raise AssertionError(f"{cls.__name__} names no config")


@pytest.mark.parametrize("name", shipped_methods())
def test_every_built_in_part_names_a_config_its_method_gives(name: str) -> None:
    method = method_for(name)
    for key in method.parts:
        config = declared_config(method._part_class(key))
        assert config is not MethodConfig, (name, key)
        assert isinstance(method.config, config), (name, key, config)


# -- contexts ---------------------------------------------------------------------------------

def test_each_tier_reads_only_its_own_context_fields() -> None:
    device = method_for("fedavg").device_part(device_ctx("fedavg"), DATA, "torch")
    edge = method_for("fedavg").edge_part(edge_ctx("fedavg"))
    cloud = method_for("fedavg").cloud_part(cloud_ctx("fedavg", rounds=3))
    assert isinstance(device.ctx.view, Placement) and isinstance(cloud.ctx.view, FederationView)
    assert cloud.ctx.rounds == 3 and device.ctx.train_chunk > 0
    for part, missing in ((device, "rounds"), (device, "test"), (edge, "view"), (edge, "request"),
                          (cloud, "gather"), (cloud, "private_reports")):
        with pytest.raises(AttributeError):
            getattr(part.ctx, missing)
    with pytest.raises(AttributeError):
        device.ctx.rounds = 3  # no field to stash it in either


@pytest.mark.parametrize("tier, wrong", [("device", EdgeContext), ("edge", CloudContext), ("cloud", DeviceContext),
                                         ("edge", NodeContext)])
def test_a_part_built_with_another_tiers_context_is_refused(tier: str, wrong: type) -> None:
    method = method_for("fedavg")
    ctx = wrong(node_id="n0", method=method, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=f"is built with a {tier.capitalize()}Context, not a {wrong.__name__}"):
        method.device_part(ctx, DATA, "torch") if tier == "device" else getattr(method, f"{tier}_part")(ctx)


def test_the_tier_bases_name_their_contexts() -> None:
    assert (DevicePart.context, EdgePart.context, CloudPart.context) == (DeviceContext, EdgeContext, CloudContext)
