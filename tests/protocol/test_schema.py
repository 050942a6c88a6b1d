"""Schema mechanism: field specs, symbolic dims, bounds, registry, cross-field checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitedge.protocol import (
    Array, Bool, Bytes, Data, Envelope, Float, Int, Map, Number, ProtocolError, Scalar, Schema,
    Str, decode, encode, get_schema, register_kind, registered_kinds, validate_body,
)
from splitedge.protocol.examples import EXAMPLES, example_body
from splitedge.protocol.kinds import BUILTIN_KINDS

DOCUMENTED_KINDS = {"hello", "status", "round", "assign", "moments", "weights", "arrays", "logits",
                    "metrics", "request", "secagg", "done"}


def _rule(kind: str, body: dict) -> str:
    with pytest.raises(ProtocolError) as err:
        validate_body(kind, body)
    return err.value.rule


def test_builtin_kinds_are_the_documented_ones_and_registered():
    assert set(BUILTIN_KINDS) == DOCUMENTED_KINDS == set(EXAMPLES)
    assert DOCUMENTED_KINDS <= set(registered_kinds())


@pytest.mark.parametrize("kind", sorted(DOCUMENTED_KINDS))
def test_every_example_body_validates(kind):
    # Prepare
    body = example_body(kind)
    # Execute
    out = validate_body(kind, body)
    # Assert: same fields in the same order, optional ones filled with their defaults
    assert list(out)[: len(body)] == list(body)
    assert set(out) - set(body) == {n for n, f in get_schema(kind).fields.items() if f.optional} - set(body)


@pytest.mark.parametrize("kind", sorted(DOCUMENTED_KINDS - {"metrics"}))
def test_every_required_field_is_required_and_unknown_fields_rejected(kind):
    # Prepare
    body = example_body(kind)
    required = [n for n, f in get_schema(kind).fields.items() if not f.optional]
    # Execute / Assert
    for name in required:
        assert _rule(kind, {k: v for k, v in body.items() if k != name}) == "schema.missing"
    assert _rule(kind, {**body, "surprise": 1}) == "schema.unknown_field"


@pytest.mark.parametrize("field, value, rule", [
    ("mean", np.ones((2, 4), dtype="f4"), "schema.shape"),       # D disagrees with var
    ("classes", np.arange(3, dtype="i8"), "schema.shape"),       # K disagrees with counts
    ("mean", np.full((2, 3), np.nan, dtype="f4"), "schema.finite"),
    ("var", np.full((2, 3), np.inf, dtype="f8"), "schema.finite"),
    ("var", -np.ones((2, 3), dtype="f4"), "schema.bounds"),
    ("counts", np.zeros(2, dtype="i8"), "schema.bounds"),
    ("classes", np.array([1, 1], dtype="i8"), "schema.unique"),
    ("classes", np.array([-1, 0], dtype="i8"), "schema.bounds"),
    ("classes", np.arange(2, dtype="i4"), "schema.dtype"),
    ("mean", np.ones((2, 3), dtype="i8"), "schema.dtype"),
    ("mean", np.ones(6, dtype="f4"), "schema.shape"),
    ("mean", [[1.0, 2.0, 3.0]] * 2, "schema.type"),
    ("space", "Wc", "schema.pattern"),  # method-chosen names are lower-case identifiers
    ("space", "wc-1", "schema.pattern"),  # no '-': it separates a kind from its slot in topics
    ("space", 1, "schema.type"),
    ("versions", {"wc": -1}, "schema.bounds"),
    ("versions", {"wc": True}, "schema.type"),
    ("versions", {"wc": 1.0}, "schema.type"),
    ("versions", [1], "schema.type"),
])
def test_moments_body_rules(field, value, rule):
    # Prepare
    body = example_body("moments")  # K=2, D=3
    body[field] = value
    # Execute / Assert
    assert _rule("moments", body) == rule


def test_symbolic_dims_bind_per_message_not_globally():
    # A second message with other K, D is fine: bindings do not leak between validations.
    validate_body("moments", example_body("moments"))
    small = {**example_body("moments"), "classes": np.array([9], dtype="i8"),
             "counts": np.array([1], dtype="i8"), "mean": np.zeros((1, 5), dtype="f2"),
             "var": np.zeros((1, 5), dtype="f2")}
    assert validate_body("moments", small)["mean"].shape == (1, 5)


def test_variadic_dims_and_batch_agreement():
    from splitedge.methods.registry import get_method

    get_method("splitfed")  # looking a method up registers its own kinds
    body = {"batch": 0, "x": np.zeros((2, 4, 3, 3), dtype="f2"), "y": np.array([1, 0], dtype="i8")}
    assert validate_body("activations", {**body, "x": np.zeros((2, 7), dtype="f4")})
    assert _rule("activations", {**body, "x": np.zeros((3, 7), dtype="f4")}) == "schema.shape"
    assert _rule("activations", {**body, "x": np.zeros((), dtype="f4")}) == "schema.shape"
    assert _rule("activations", {**body, "y": np.array([1, -1], dtype="i8")}) == "schema.bounds"


def test_round_config_is_nested_data_and_assign_lists_are_typed():
    body = example_body("round")
    assert validate_body("round", body)["config"]["model"]["mean"] == [0.5]
    assert _rule("round", {**body, "config": {"x": object()}}) == "schema.type"
    assert validate_body("round", {k: v for k, v in body.items() if k != "stop"})["stop"] is False
    assign = example_body("assign")
    assert _rule("assign", {**assign, "peers": "d4"}) == "schema.type"
    assert _rule("assign", {**assign, "peers": ["d/4"]}) == "schema.pattern"
    assert _rule("assign", {**assign, "groups": ["c1"] * 65}) == "schema.bounds"


def test_weights_maps_check_each_entry_and_allow_int_buffers():
    body = example_body("weights")
    bad = dict(body["weights"], extra=np.array([1.0, np.nan], dtype="f4"))
    assert _rule("weights", {**body, "weights": bad}) == "schema.finite"
    assert _rule("weights", {**body, "weights": {1: np.zeros(1)}}) == "schema.key"
    assert _rule("weights", {**body, "weights": {"a": 1.0}}) == "schema.type"
    assert validate_body("weights", body)["weights"]["bn.num_batches_tracked"].dtype == "i8"


def test_scalar_specs_normalise_and_bound():
    dims: dict = {}
    assert Float(gt=0).check("x", 3, dims) == 3.0 and isinstance(Float().check("x", 3, dims), float)
    assert Int(ge=0).check("x", np.int64(4), dims) == 4
    assert Scalar().check("x", np.float32(0.5), dims) == 0.5
    assert Bool().check("x", np.bool_(True), dims) is True
    for spec, value, rule in [
        (Float(gt=0), 0.0, "schema.bounds"), (Float(), math.nan, "schema.finite"),
        (Float(), "1", "schema.type"), (Int(le=3), 4, "schema.bounds"), (Bool(), 1, "schema.type"),
        (Str(max_len=2), "abc", "schema.bounds"), (Bytes(max_len=1), b"ab", "schema.bounds"),
        (Number(finite=True), math.inf, "schema.finite"), (Scalar(), None, "schema.type"),
        (Data(max_depth=1), [[[1]]], "schema.depth"), (Data(), {1: 2}, "schema.key"),
        (Map(values=Int()), {"a": "b"}, "schema.type"), (Map(max_entries=1), {"a": 1, "b": 2},
                                                        "schema.bounds"),
    ]:
        with pytest.raises(ProtocolError) as err:
            spec.check("x", value, dims)
        assert err.value.rule == rule, (spec, value)


def test_optional_fields_take_a_fresh_copy_of_their_default():
    first = validate_body("done", {"phase": "train"})
    first["info"]["x"] = 1
    assert validate_body("done", {"phase": "train"})["info"] == {}


def test_metrics_accepts_any_numeric_keys_only():
    assert validate_body("metrics", {"acc": 0.9, "loss": math.nan, "n": 3})["n"] == 3
    assert _rule("metrics", {"acc": "high"}) == "schema.type"


def test_no_kind_carries_a_graph_or_code():
    """The wire carries data: no built-in kind has a field of raw bytes (where a graph would
    travel), and a weight map whose values are bytes is refused by the schema."""
    assert not [(kind, name) for kind, schema in BUILTIN_KINDS.items()
                for name, field in schema.fields.items() if isinstance(field, Bytes)]
    body = example_body("weights")
    assert _rule("weights", {**body, "weights": {"w": b"\x08\x07onnx-graph"}}).startswith("schema")


def test_register_kind_adds_a_kind_the_codec_understands():
    # Prepare
    def k_matches(body: dict) -> None:
        if body["k"] != body["protos"].shape[0]:
            raise ValueError("k does not match protos")

    schema = Schema({"k": Int(ge=1), "protos": Array(dtypes="f4", shape=("K", 4), finite=True),
                     "tag": Str(optional=True, default="none")}, checks=(k_matches,))
    # Execute
    register_kind("test_prototypes", schema)
    register_kind("test_prototypes", schema)  # idempotent for an equal schema
    env = Envelope("test_prototypes", "r", 1, "e1", {"k": 2, "protos": np.zeros((2, 4), "f4")})
    out = decode(encode(env))
    # Assert
    assert out.body["tag"] == "none" and out.body["protos"].shape == (2, 4)
    bad = Envelope("test_prototypes", "r", 1, "e1", {"k": 3, "protos": np.zeros((2, 4), "f4")})
    with pytest.raises(ProtocolError) as err:
        encode(bad)
    assert err.value.rule == "schema.check"


def test_register_kind_rejects_conflicts_and_bad_names():
    register_kind("test_conflict", Schema({"a": Int()}))
    with pytest.raises(ValueError):
        register_kind("test_conflict", Schema({"a": Float()}))
    for name in ("", "Bad", "has/slash", "a+b", "x" * 65, 3):
        with pytest.raises(ValueError):
            register_kind(name, Schema({}))
    with pytest.raises(TypeError):
        register_kind("test_not_schema", {"a": Int()})
    with pytest.raises(ValueError):
        Array(dtypes=("c8",))


def test_encode_validates_so_caller_mistakes_raise_value_error_early():
    body = {**example_body("moments"), "mean": np.full((2, 3), np.nan, dtype="f4")}
    env = Envelope("moments", "r", 0, "d1", body)
    with pytest.raises(ValueError):
        encode(env)
    assert decode_rule(encode(env, validate=False)) == "schema.finite"
    with pytest.raises(ProtocolError) as err:
        encode(Envelope("nope", "r", 0, "d1", {}))
    assert err.value.rule == "envelope.kind_unknown"


def decode_rule(data: bytes) -> str:
    with pytest.raises(ProtocolError) as err:
        decode(data)
    return err.value.rule

