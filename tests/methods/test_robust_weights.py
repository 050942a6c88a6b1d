"""Robust merges of weight maps and of per-class mean tables (methods/robust.py), and update
bounds relative to the model an update was trained from (methods/checks.py): "none" is the
exact merge bit for bit; on clean updates every rule stays near it; one source scaled by 100
moves only the exact merge; an honest update of a model that a bad merge pushed beyond the
absolute bound is still accepted."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitedge.methods.averaging import average_states
from splitedge.methods.checks import MAX_ABS_WEIGHT, check_weight_map, check_weights, weight_specs
from splitedge.methods.cflhkd.distill import merge_tables
from splitedge.methods.fedproto.protos import merge_protos
from splitedge.methods.moments import ROBUST_MERGES
from splitedge.methods.robust import robust_average, robust_class_means
from splitedge.protocol.errors import ProtocolError

RULES = [h for h in ROBUST_MERGES if h != "none"]


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A map of the kinds a model holds: a conv weight, a bias, BatchNorm buffers of another
    scale, and an integer counter."""
    return {"conv.weight": rng.normal(size=(4, 3, 3, 3)).astype(np.float32),
            "conv.bias": rng.normal(size=4).astype(np.float32),
            "bn.running_var": (50 + rng.random(4) * 100).astype(np.float32),
            "bn.num_batches_tracked": np.array(10, dtype=np.int64)}


def updates(seed: int, n: int = 8, step: float = 0.05) -> tuple[dict, list[tuple[dict, int]]]:
    """A global model and n devices' honest updates of it (small steps, counts 50-200)."""
    rng = np.random.default_rng(seed)
    ref = model(rng)
    parts = []
    for _ in range(n):
        w = {k: (v + step * rng.normal(size=v.shape) * (np.abs(v) + 1)).astype(v.dtype) if v.dtype.kind == "f"
             else np.array(int(v) + int(rng.integers(1, 5)), dtype=v.dtype) for k, v in ref.items()}
        parts.append((w, int(rng.integers(50, 200))))
    return ref, parts


def scaled(w: dict, by: float) -> dict:
    return {k: (v * by).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in w.items()}


def gap(a: dict, b: dict, ref: dict, parts: list[tuple[dict, int]]) -> float:
    """Largest distance between two merges, per tensor, in units of a typical honest step (the
    median norm of the devices' updates)."""
    def step(k: str) -> float:
        return float(np.median([np.linalg.norm(w[k] - ref[k]) for w, _ in parts]))

    return max(float(np.linalg.norm(a[k] - b[k])) / step(k) for k in a if a[k].dtype.kind == "f")


@pytest.mark.parametrize("seed", range(3))
def test_none_is_the_exact_average_bit_for_bit(seed: int) -> None:
    ref, parts = updates(seed)
    exact, none = average_states(parts), robust_average(parts, "none", reference=ref)
    assert all(exact[k].tobytes() == none[k].tobytes() and exact[k].dtype == none[k].dtype for k in exact)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("how", RULES)
def test_on_clean_updates_every_rule_stays_near_the_average(seed: int, how: str) -> None:
    ref, parts = updates(seed)
    exact, got = average_states(parts), robust_average(parts, how, reference=ref)
    assert gap(got, exact, ref, parts) < 0.75, gap(got, exact, ref, parts)  # within the noise of 8 honest steps
    assert all(got[k].dtype == exact[k].dtype and got[k].shape == exact[k].shape for k in exact)
    assert int(got["bn.num_batches_tracked"]) == max(int(w["bn.num_batches_tracked"]) for w, _ in parts)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("how", RULES)
def test_one_device_scaled_by_100_moves_only_the_exact_merge(seed: int, how: str) -> None:
    # Prepare: the attack, a device sending 100x its weights
    ref, parts = updates(seed)
    poisoned = [(scaled(parts[0][0], 100.0), parts[0][1]), *parts[1:]]
    clean = robust_average(parts[1:], how, reference=ref)
    # Execute
    exact, got = average_states(poisoned), robust_average(poisoned, how, reference=ref)
    # Assert: the exact merge is dragged by about 100/8 of the model; the robust one stays
    # within a few honest steps of what the honest devices alone give
    assert gap(exact, clean, ref, parts) > 50
    assert gap(got, clean, ref, parts) < 1.5, (how, gap(got, clean, ref, parts))


def test_clip_bounds_each_update_by_k_median_norms_around_the_reference() -> None:
    ref = {"w": np.zeros(2)}
    parts = [({"w": np.array([1.0, 0.0])}, 1), ({"w": np.array([0.0, 2.0])}, 1), ({"w": np.array([30.0, 40.0])}, 2)]
    got = robust_average(parts, "clip", reference=ref, clip_k=2.0)
    # norms 1, 2, 50; bound 2 x 2 = 4: the third is scaled to (2.4, 3.2), then the weighted mean
    np.testing.assert_allclose(got["w"], (np.array([1.0, 0.0]) + [0.0, 2.0] + 2 * np.array([2.4, 3.2])) / 4)
    moved = {"w": np.array([100.0, 100.0])}  # clipping is about updates: a shifted reference moves the result along
    shifted = robust_average([({"w": w["w"] + 100}, n) for w, n in parts], "clip", reference=moved, clip_k=2.0)
    np.testing.assert_allclose(shifted["w"], got["w"] + 100)


def test_two_sources_merge_exactly_whatever_the_rule() -> None:
    ref, parts = updates(0, n=2)
    exact = average_states(parts)
    for how in RULES:
        got = robust_average(parts, how, reference=ref)
        assert all(np.array_equal(got[k], exact[k]) for k in exact), how


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(3, 9), st.sampled_from(RULES), st.floats(-1e3, 1e3))
def test_every_rule_is_order_free_stays_inside_the_sources_and_moves_with_a_shift(seed: int, n: int, how: str,
                                                                                    shift: float) -> None:
    rng = np.random.default_rng(seed)
    parts = [({"w": rng.normal(size=5) * rng.choice([1, 100])}, int(rng.integers(1, 50))) for _ in range(n)]
    got = robust_average(parts, how)["w"]
    perm = [parts[i] for i in rng.permutation(n)]
    np.testing.assert_allclose(robust_average(perm, how)["w"], got, rtol=1e-12, atol=1e-12)
    stacked = np.stack([w["w"] for w, _ in parts])
    assert np.all(got >= stacked.min(axis=0) - 1e-9) and np.all(got <= stacked.max(axis=0) + 1e-9)
    moved = robust_average([({"w": w["w"] + shift}, c) for w, c in parts], how)["w"]
    np.testing.assert_allclose(moved, got + shift, rtol=1e-9, atol=1e-6 * (1 + abs(shift)))


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="robust merge must be one of"):
        robust_average(updates(0)[1], "mean")


# -- per-class mean tables (FedProto's prototypes, CFLHKD's class-mean logits) -----------------

def tables(seed: int, n: int = 6, dim: int = 10) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        classes = np.sort(rng.choice(dim, size=int(rng.integers(4, dim + 1)), replace=False)).astype(np.int64)
        out.append((classes, rng.integers(5, 60, len(classes)).astype(np.int64),
                    (3.0 * np.eye(dim)[classes] + rng.normal(size=(len(classes), dim)) * 0.3).astype(np.float32)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_none_tables_are_the_weighted_means_and_rules_keep_counts(seed: int) -> None:
    parts = tables(seed)
    classes, counts, means = merge_protos(parts)
    for how in ROBUST_MERGES:
        c, n, m = robust_class_means(parts, how)
        np.testing.assert_array_equal(c, classes)
        np.testing.assert_array_equal(n, counts)  # counts stay the exact sums
        np.testing.assert_allclose(m, means, atol=0.6 if how != "none" else 1e-12)


@pytest.mark.parametrize("how", RULES)
def test_a_table_scaled_by_50_moves_only_the_exact_merge(how: str) -> None:
    parts = tables(1)
    clean = merge_tables(parts[1:], 10)[1]
    bad = [(parts[0][0], parts[0][1], parts[0][2] * 50), *parts[1:]]
    exact, robust = merge_tables(bad, 10)[1], merge_tables(bad, 10, how)[1]
    held = np.flatnonzero(merge_tables(bad, 10)[0])
    assert np.abs(exact - clean)[held].max() > 20
    assert np.abs(robust - clean)[held].max() < 2, np.abs(robust - clean)[held].max()  # honest spread: ~1
    c, n, m = merge_protos(bad, how)
    np.testing.assert_allclose(m, robust[c])  # FedProto and CFLHKD share the rule


# -- update bounds ------------------------------------------------------------------------------

def test_an_honest_update_of_a_model_beyond_the_absolute_bound_is_accepted() -> None:
    """The issue's freeze: after a bad merge the global model holds values above 1e6, so every
    honest update did too and was refused. Bounded as updates, they pass; a value grown by more
    than the bound beyond the model trained from is still refused, and so is any value beyond it
    without one. BatchNorm statistics follow the inflated weights: bounded only by float32's range."""
    rng = np.random.default_rng(0)
    ref = scaled(model(rng), 3e6)
    ref["bn.running_var"] = np.abs(ref["bn.running_var"])
    specs = weight_specs(ref)
    honest = {k: (v + 0.01).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in ref.items()}
    check_weight_map(honest, specs, trained_from=ref)
    with pytest.raises(ProtocolError, match="\\|w\\| up to") as absolute:
        check_weight_map(honest, specs)
    assert absolute.value.rule == "state.magnitude"
    grown = ref["conv.bias"] + 2 * MAX_ABS_WEIGHT * np.sign(ref["conv.bias"])
    far = dict(honest, **{"conv.bias": grown.astype(np.float32)})
    with pytest.raises(ProtocolError, match="conv.bias: a value grew by 2e\\+06 beyond the model") as moved:
        check_weight_map(far, specs, trained_from=ref)
    assert moved.value.rule == "state.magnitude"
    wider = dict(honest, **{"bn.running_var": (ref["bn.running_var"] + 1e20).astype(np.float32)})
    check_weight_map(wider, specs, trained_from=ref)  # the data's statistics through inflated weights
    with pytest.raises(ProtocolError, match="bn.running_var: \\|w\\| up to 1e\\+31, beyond 1e\\+30"):
        check_weight_map(dict(honest, **{"bn.running_var": np.full(4, 1e31, np.float32)}), specs, trained_from=ref)


def test_the_parents_model_is_not_bounded_but_must_still_be_a_model() -> None:
    rng = np.random.default_rng(0)
    ref = model(rng)
    specs = weight_specs(ref)
    big = {"part": "model", "version": 3, "weights": scaled(ref, 1e7)}
    check_weights(big, specs, part="model", source="parent")
    with pytest.raises(ProtocolError):
        check_weights(big, specs, part="model", source="child")
    negative = {"part": "model", "version": 3, "weights": dict(ref, **{"bn.running_var": -ref["bn.running_var"]})}
    with pytest.raises(ProtocolError) as caught:
        check_weights(negative, specs, part="model", source="parent")
    assert caught.value.rule == "state.range"
