"""Consistency checks a part runs on a peer's message before it touches state (numpy only).

The schema (protocol/kinds.py) already guarantees types, dtypes from the whitelist, matching
symbolic shapes and finite values. These checks add what only the federation knows: the
feature dimension and class range of this model, the model's parameter names and shapes, the
wire dtype the config chose, and model versions that exist. Each failure is a ProtocolError
whose rule names what did not fit, so the runtime can log and count it per rule.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

from splitedge.protocol.errors import ProtocolError

WeightSpecs = Mapping[str, tuple[tuple[int, ...], str]]
MAX_ABS_WEIGHT = 1e6
"""No round of training grows a parameter of these models by anything near it; a finite 1e37
would overflow a float32 model to inf and make every later round NaN. A child's value may exceed
the magnitude of the same value in the model it was trained from by at most this, so a merge
that went wrong cannot make every honest update look out of range, and a merge of such values
grows by at most this per round."""
STATISTIC_BUFFERS = ("running_mean", "running_var")
MAX_ABS_STATISTIC = 1e30
"""BatchNorm's running statistics are estimates of the data's features through the model, not
trained values: once a bad merge inflated the weights, an honest device's statistics are
inflated with them, by any amount. They are bounded only to stay well inside float32's range
(3.4e38) through a merge of many of them."""
VARIANCE_BUFFERS = ("running_var",)
"""Buffers that hold variances (BatchNorm's): a negative one is no model (a peer that sends one
made the cloud's evaluation crash in an SVD)."""


def weight_specs(state: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype kind) of a weight map: what every later map must match."""
    return {name: (tuple(np.shape(a)), np.asarray(a).dtype.kind) for name, a in state.items()}


def check_weights(body: Mapping[str, Any], specs: WeightSpecs, *, part: str | None = None, source: str = "child",
                  trained_from: Mapping[str, Any] | None = None) -> None:
    """A `weights` body must name the expected part and fit its model (check_weight_map).

    A child's or a peer's weights are bounded as an update: relative to `trained_from`, the
    model they were trained from when the receiver holds it, else absolutely. The parent's
    model is the federation's own and is not bounded: a bound there would freeze every later
    round once a merge went wrong, and a merge of bounded updates cannot overflow."""
    if part is not None and body.get("part") != part:
        raise ProtocolError("state.part", f"weights of part {body.get('part')!r}, expected {part!r}")
    check_weight_map(body["weights"], specs, bounded=source != "parent", trained_from=trained_from)


def check_weight_map(weights: Mapping[str, Any], specs: WeightSpecs, *, bounded: bool = True,
                     trained_from: Mapping[str, Any] | None = None) -> None:
    """Exactly the model's parameters, with their shapes and kinds (float for float, int for int),
    no negative variance buffer, and (`bounded`) no float parameter grown by more than
    MAX_ABS_WEIGHT in magnitude beyond the same value of `trained_from` (beyond 0 without it), no
    running statistic beyond MAX_ABS_STATISTIC."""
    missing, unknown = sorted(set(specs) - set(weights)), sorted(set(weights) - set(specs))
    if missing or unknown:
        raise ProtocolError("state.weights", f"names differ from the model: missing {missing[:3]}, unknown {unknown[:3]}")
    for name, (shape, kind) in specs.items():
        arr = weights[name]
        if tuple(arr.shape) != shape:
            raise ProtocolError("state.weights", f"{name}: shape {tuple(arr.shape)}, the model has {shape}")
        if (arr.dtype.kind == "f") != (kind == "f"):
            raise ProtocolError("state.weights", f"{name}: dtype {arr.dtype} where the model has kind {kind!r}")
        if bounded and kind == "f" and arr.size:
            if name.endswith(STATISTIC_BUFFERS):
                _check_magnitude(name, arr, None, MAX_ABS_STATISTIC)
            else:
                _check_magnitude(name, arr, None if trained_from is None else trained_from.get(name), MAX_ABS_WEIGHT)
        if name.endswith(VARIANCE_BUFFERS) and arr.size and float(np.min(arr)) < 0:
            raise ProtocolError("state.range", f"{name}: a variance below 0 ({float(np.min(arr)):.3g})")


def _check_magnitude(name: str, arr: np.ndarray, base: Any, bound: float) -> None:
    """Refuse a value whose magnitude exceeds that of the same value in `base` (0 without one) by
    more than `bound`: an honest update of a model that a bad merge inflated stays near it; only
    a value grown beyond any round's training is refused."""
    size = np.abs(arr.astype(np.float64))
    if base is not None and np.shape(base) == arr.shape:
        grown = float(np.max(size - np.abs(np.asarray(base, dtype=np.float64))))
        if grown > bound:
            raise ProtocolError("state.magnitude", f"{name}: a value grew by {grown:.3g} beyond the model it was "
                                                   f"trained from (at most {bound:g})")
    elif float(np.max(size)) > bound:
        raise ProtocolError("state.magnitude", f"{name}: |w| up to {float(np.max(size)):.3g}, beyond {bound:g}")


STATS_COMPANIONS = ("var",)
"""Arrays that travel beside a statistic's values (moments: `var` beside `mean`) and must have
their shape and dtype."""


def check_stats(body: Mapping[str, Any], key: str, *, dim: int, num_classes: int, dtype: str | None = None) -> None:
    """Per-class statistics (moments' `mean` and `var`, logits' `logits`): the federation's
    feature dimension, class ids inside the model's range, and the configured wire dtype.

    Together these bound the message: at most `num_classes` rows (ids are unique and in range)
    of `dim` values per array, so a moments body can never exceed num_classes x dim x 2 values of
    the wire dtype plus two i8 vectors, whatever the transport's frame cap allows."""
    classes, values = np.asarray(body["classes"]), body[key]
    if np.ndim(values) != 2 or values.shape[1] != dim:
        raise ProtocolError("state.dim", f"{key} has shape {np.shape(values)}, the federation uses dimension {dim}")
    if len(classes) > num_classes or (len(classes) and int(classes.max()) >= num_classes):
        raise ProtocolError("state.classes", f"class {int(classes.max())} outside the model's {num_classes} classes")
    if values.shape[0] != len(classes):
        raise ProtocolError("state.shape", f"{key} has {values.shape[0]} rows for {len(classes)} classes")
    if dtype is not None and values.dtype != np.dtype(dtype).newbyteorder("<"):
        raise ProtocolError("state.dtype", f"{key} is {values.dtype.str}, the config says {dtype}")
    for other in STATS_COMPANIONS:
        if other == key or other not in body:
            continue
        if np.shape(body[other]) != values.shape:
            raise ProtocolError("state.shape", f"{other} has shape {np.shape(body[other])}, {key} {values.shape}")
        if body[other].dtype != values.dtype:
            raise ProtocolError("state.dtype", f"{other} is {body[other].dtype.str}, {key} {values.dtype.str}")


def check_vector(v: Any, length: int | None, what: str) -> int:
    """One 1-D array of `length` entries (any length while the federation's is not known yet):
    a mean latent, a clustering signal. Returns its length, for the caller to keep."""
    if v is None or np.ndim(v) != 1 or (length is not None and len(v) != length):
        raise ProtocolError("state.shape", f"{what} must be one vector" + (f" of length {length}" if length else ""))
    return len(v)


def check_space(body: Mapping[str, Any], space: str) -> None:
    if body["space"] != space:
        raise ProtocolError("state.space", f"statistics of space {body['space']!r}, expected {space!r}")


def check_version(name: str, got: int, *, at_most: int) -> None:
    """A statistic or update computed with a model version this node has not seen is forged or
    from another incarnation of the run."""
    if got > at_most:
        raise ProtocolError("state.version", f"{name} version {got} is newer than the current {at_most}")


def check_within_samples(body: Mapping[str, Any], announced: int, *, classes: Collection[int] | None = None,
                         class_counts: Mapping[int, int] | None = None) -> None:
    """A device cannot count more samples than it may (its hello's, or the operator's manifest
    entry's): per-class `counts` (moments, logits, or an `arrays` record's `counts` array such as
    head statistics) may sum to at most `announced`, and a `weights` body's `samples` may not
    exceed it. With `classes`, its per-class statistics may name only those (state.classes); with
    `class_counts`, count at most that many of each. Counts are summed as Python ints, so values
    near 2**63 cannot wrap around to something small."""
    record = body["arrays"] if isinstance(body.get("arrays"), Mapping) else body
    counts, named = body.get("counts"), body.get("classes")
    if counts is None and record is not body:
        counts, named = record.get("counts"), record.get("classes")
    if counts is not None:
        total = sum(int(c) for c in np.asarray(counts).ravel())
        if total > announced:
            raise ProtocolError("state.samples", f"counts sum to {total}, the sender announced {announced} samples")
    if named is not None and (classes is not None or class_counts is not None):
        _check_classes(np.asarray(named).ravel().tolist(), None if counts is None else np.asarray(counts).ravel().tolist(),
                       classes, class_counts)
    samples = body.get("samples")
    if isinstance(samples, (int, np.integer)) and int(samples) > announced:
        raise ProtocolError("state.samples", f"samples {int(samples)}, the sender announced {announced}")


def _check_classes(named: list, counts: list | None, classes: Collection[int] | None,
                   class_counts: Mapping[int, int] | None) -> None:
    """Per-class statistics only of the classes the sender may hold, no more of each than it holds."""
    for i, c in enumerate(named):
        if classes is not None and int(c) not in classes:
            raise ProtocolError("state.classes", f"statistics of class {int(c)}, which the sender did not announce")
        if class_counts is not None and counts is not None and i < len(counts) and \
                int(counts[i]) > class_counts.get(int(c), 0):
            raise ProtocolError("state.samples", f"{int(counts[i])} samples of class {int(c)}, the sender holds "
                                                 f"{class_counts.get(int(c), 0)}")
