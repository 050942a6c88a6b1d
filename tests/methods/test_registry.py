"""Every registered method names real part classes and parses its own config; generated from the
registry, so a new method is checked without new test code."""

from __future__ import annotations

import numpy as np
import pytest

from parts import SPEC, device_ctx, method_for
from splitedge.methods.config import MethodConfig, RunConfig, to_wire
from splitedge.methods.registry import create_method, get_method, list_methods, register_method
from splitedge.methods.contract import CloudPart, DevicePart, EdgePart, Method

BASES = {"device": DevicePart, "edge": EdgePart, "cloud": CloudPart}


@pytest.mark.parametrize("name", list_methods())
def test_method_parts_resolve_to_the_right_bases(name: str) -> None:
    method = method_for(name)
    assert method.name == name and {"edge", "cloud"} <= set(method.parts)
    assert any(k.split(":")[0] == "device" for k in method.parts)
    for key in method.parts:
        assert issubclass(method._part_class(key), BASES[key.split(":")[0]]), key


@pytest.mark.parametrize("name", list_methods())
def test_config_round_trips_through_the_wire_form(name: str) -> None:
    # Prepare: every setting at its default, as the cloud announces it
    cls = get_method(name)
    wire = RunConfig(SPEC, cls.Config()).to_wire()
    # Execute
    method = create_method(name, wire)
    # Assert: typed again, equal, and refused when a setting is unknown or of the wrong type
    assert method.config == cls.Config() and method.spec == SPEC and issubclass(cls.Config, MethodConfig)
    with pytest.raises(ValueError, match="unknown setting"):
        create_method(name, {**wire, "method": {**wire["method"], "nope": 1}})
    with pytest.raises(ValueError, match="feddecorr_beta: expected float"):
        create_method(name, {**wire, "method": {**wire["method"], "feddecorr_beta": "0.1"}})


@pytest.mark.parametrize("name", [n for n in list_methods() if "device" not in get_method(n).parts])
def test_unknown_backend_is_a_clear_error(name: str) -> None:
    ctx = device_ctx(name, "d0")
    with pytest.raises(ValueError, match="no device part for backend 'tpu'"):
        ctx.method.device_part(ctx, (np.zeros((1, 8, 8, 1), np.uint8), np.zeros(1, np.int64)), "tpu")


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        get_method("nope")


def test_a_variant_registers_under_its_own_name_and_announces_it() -> None:
    # Prepare: FedAvg with one hook overridden, registered as a class
    from splitedge.methods.fedavg.method import FedAvg

    class FedAvgMax(FedAvg):
        def merge_weights(self, parts, reference=None):
            return {k: np.max([w[k] for w, _ in parts], axis=0) for k in parts[0][0]}

    register_method("fedavg-max-test", FedAvgMax)
    # Execute
    method = method_for("fedavg-max-test")
    merged = method.merge_weights([({"w": np.array([1.0, 5.0])}, 1), ({"w": np.array([3.0, 2.0])}, 9)])
    # Assert: the registry name (not the base's) is what a round announces; the hook is the variant's
    assert method.name == "fedavg-max-test" and isinstance(method, Method)
    np.testing.assert_array_equal(merged["w"], [3.0, 5.0])
    with pytest.raises(ValueError, match="already registered"):
        register_method("fedavg-max-test", FedAvg)


def test_settings_from_the_command_line_are_typed_by_the_config() -> None:
    from splitedge.methods.registry import default_config

    cfg = default_config("hsfp", SPEC, ic="2", mean_only="yes", feddecorr_beta="0.1", feature_dtype="f2")
    assert (cfg.method.ic, cfg.method.mean_only, cfg.method.feddecorr_beta) == (2, True, 0.1)
    assert to_wire(cfg)["method"]["feature_dtype"] == "f2"
    with pytest.raises(ValueError, match="ic: cannot read 'two' as int"):
        default_config("hsfp", SPEC, ic="two")
    with pytest.raises(ValueError, match="unknown setting"):
        default_config("fedavg", SPEC, ic="2")


def test_a_setting_a_method_has_no_form_of_names_the_methods_that_have_it(monkeypatch) -> None:
    """The contract names no method (issue 52): which methods have DP's, DP-SGD's or secagg's form
    is read off their parts' declarations by the registry, so a method added (a plug-in) that
    declares the form is named, one that loses it is not, and no message is edited."""
    from splitedge.methods.fedavg.device import FedAvgDevice
    from splitedge.methods.registry import settled

    def refusal(name: str, **settings) -> str:
        method = create_method(name, RunConfig(SPEC, get_method(name).Config(**settings)))
        with pytest.raises(ValueError) as err:
            settled(method)
        return str(err.value)

    said = refusal("splitfed", dp_sigma=1.0, dp_update_clip=1.0)
    covered = said.split("dp_sigma covers ")[1].split(":")[0].split(", ")
    assert "fedavg" in covered and "scaffold" in covered and "splitfed" not in covered, said
    assert set(covered) >= PRIVATE_BEFORE and set(covered) <= set(list_methods()), said  # as the contract listed them
    assert "dp_unit=sample covers" in refusal("scaffold", dp_sigma=1.0, dp_unit="sample", dp_grad_clip=1.0,
                                              dp_sample_rate=0.1)
    monkeypatch.setattr(FedAvgDevice, "secure_kinds", ())  # FedAvg's devices no longer declare a summable kind
    said = refusal("splitfed", secagg="full")
    covered = said.split("(those of ")[1].split(")")[0].split(", ")
    assert "fedavg" not in covered and "fedprox" not in covered and "hsfp" in covered, said  # FedProx's are FedAvg's
    assert "splitfed's devices send none of them" in said



PRIVATE_BEFORE = {"fedavg", "fedadam", "fedyogi", "fedavgm", "fedprox", "scaffold", "hsfp", "hsfp-cal", "fedproto",
                  "cflhkd", "simsiam", "align-uniform", "ssd", "fedmar", "decmar"}
"""The methods the contract's DP message named by hand before the registry named them."""
