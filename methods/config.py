"""Typed run configuration, carried in the round announcement as a nested msgpack map.

Devices and edges are started with only a broker URL and an id; they learn the method, the
model and its normalisation from the cloud's `round` message. The config there is
``{"model": <ModelSpec>, "method": <the method's Config>}``, each a map of its dataclass
fields (tuples travel as lists, nested dataclasses as maps). Runtimes parse it once into the
typed classes below; a value of the wrong type, or a name the class does not know, is a
ValueError that names the setting, so a mismatched peer is refused instead of guessed at.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import numpy as np

from splitedge.methods.moments import ROBUST_MERGES
from splitedge.methods.update_codec import CODECS

T = TypeVar("T")


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A setting with a command-line flag of its own (methods/flags.py): `--<name> VALUE`, or
    for a boolean `--<name>` (default False) / `--no-<name>` (default True). Every setting is
    also reached by `--set <name>=VALUE`."""
    return dataclasses.field(default=default, metadata={"flag": help, "choices": choices})


@dataclass(frozen=True)
class MethodConfig:
    """Settings every method has; each method's Config subclasses it.

    feddecorr_beta: weight of the FedDecorr regulariser (METHODS.md) on the representation each
    tier trains; 0 switches it off. Any method can turn it on (`--set feddecorr_beta=0.1`).

    calibrate: "lda" refits the served model's classifier in closed form on the devices' head
    statistics (methods/calibration) after every `calibrate_every`-th round and after the last
    (0: only after the last); `calib_shrink` shrinks the shared covariance toward a multiple of
    the identity, `calib_cov` sends it whole ("full", D(D+1)/2 values) or its diagonal ("diag",
    D values), `calib_dtype` is the records' float type on the wire. `calib_layer` is where the
    head sits (methods/calibration/layers.py): the classifier's input, or W_e's or W_c's output
    (pooled to a side); several layers, and each device holds back `calib_holdout` of its images
    to score the candidates, and the best is served.

    robust: how an edge merges what its devices send and the cloud what its edges send (weight
    maps, feature moments, head statistics, class-mean tables): "none" exactly; "clip" each
    source clipped to `robust_clip_k` times the sources' own median spread (methods/robust.py);
    "trimmed" coordinate-wise, dropping `robust_trim` of the sources at each end; "median"
    coordinate-wise medians (methods/moments.py, methods/calibration/robust.py). "auto", the
    default, is "clip" (its cost on clean CIFAR-10 is within seed noise, and one device scaling
    what it sends no longer moves the merge without bound: docs/methods.md, "Robust merging"),
    or "none" under `secagg`, which hides each device's values from its edge.

    min_class_count: a device leaves every class it holds fewer images of out of the per-class
    statistics it sends (moments, head statistics, prototypes, mean logits; methods/privacy/floor.py)
    and reports what it held back. The default 10 is where an edge's inversion of CIFAR-10 W_c
    moments stopped rebuilding a device's images (bench/results/leak-cifar10); 1 sends every class.

    dp_sigma: with a value > 0 every device release is differentially private (at the unit
    `dp_unit` names, methods/privacy/dp.py): per-class statistics are sums of features clipped to L2 norm
    `dp_clip` (W_c features: moments) or `dp_head_clip` (classifier inputs: head statistics)
    plus Gaussian noise of `dp_sigma` times their sensitivity; weight updates are clipped to
    `dp_update_clip` and noised likewise. The cloud reports epsilon at `dp_delta` over the run.
    `dp_bn_clip` > 0 also releases, with every weight update, the BatchNorm statistics of the
    model the device received (each image's per-channel input moments clipped to that L2 norm;
    methods/privacy/norm_stats.py); at 0 a DP device sends them back as received.

    dp_unit: what one release protects (docs/privacy.md, "The privacy unit"). "device" (the
    default): a device's weight update is clipped to `dp_update_clip` and noised once a round
    (DP-FedAvg, local), which protects the device's whole data; its per-class statistics protect
    one image. "sample": devices train with DP-SGD (methods/privacy/dpsgd.py): each step draws
    every local image with probability `dp_sample_rate` (Poisson), clips each image's gradient to
    `dp_grad_clip` and adds N(0, (dp_sigma dp_grad_clip)^2); the model is then sent as trained
    (post-processing), and every other release must be bounded at one image (refused otherwise).

    dp_devices: N > 1 makes DP distributed (methods/privacy/distributed.py): behind `secagg`,
    each device adds 1/sqrt(N) of the noise to its raw sums, the edge sees only the sum of at
    least N devices (it aborts a smaller one), whose noise is then at least one release's.

    report_every: the cloud's representation report comes every `report_every` rounds and after
    the last: the effective rank and spectrum of the served model's features (each needs every
    test sample's features and an SVD), and for the self-supervised methods their whole report
    (linear probe, kNN, alignment, uniformity). Accuracy is measured every round.

    secagg: "full" or "plus" sends H-SFP's moments and every head-statistics record to the edge
    only inside a secure sum over the round's devices (runtime/secure_sum.py); needs robust
    "none" (a robust merge needs each device's own values). The devices of each sum are the ones
    the cloud names for the edge in its (signed) round plan; a device refuses a roster outside
    them, one holding a non-device, or one of fewer than `secagg_min_devices` (at least 2; and
    `dp_devices`), before it sends any share (methods/privacy/roster.py).
    """

    feddecorr_beta: float = 0.0
    calibrate: str = flag("none", "fit the served head in closed form on the devices' head statistics",
                          choices=("none", "lda"))
    calibrate_every: int = flag(1, "rounds between head calibrations (0: only after the last round)")
    calib_shrink: float = 0.1
    calib_cov: str = "full"
    calib_dtype: str = "f4"
    calib_layer: str = flag("classifier", "where the calibrated head sits: classifier, we, we_S, wc or wc_S (W_e's "
                                          "or W_c's output, average-pooled to S x S); several, comma-separated: the "
                                          "one that scores best on the images devices hold back (calib_holdout)")
    calib_holdout: float = 0.2
    robust: str = flag("auto", "how edges and the cloud merge what they receive: auto (clip; none under secagg), "
                               "none (exact: one device scaling what it sends moves the merge without bound), "
                               "clip, trimmed or median (docs/methods.md)", choices=("auto", *ROBUST_MERGES))
    robust_clip_k: float = 2.0
    robust_trim: float = 0.2
    min_class_count: int = flag(10, "a device sends no statistic of a class it holds fewer images of (privacy: an "
                                    "edge rebuilds the images of a class of 1 or 2 from its W_c mean and variance; "
                                    "bench/results/leak-cifar10)")
    dp_sigma: float = flag(0.0, "differential privacy: noise multiplier of every release a device makes (0: off; "
                                "methods/privacy, docs/privacy.md)")
    dp_clip: float = 0.0
    dp_head_clip: float = 0.0
    dp_update_clip: float = 0.0
    dp_bn_clip: float = 0.0
    dp_delta: float = 1e-5
    dp_unit: str = flag("device", "differential privacy's unit: device (DP-FedAvg: each update clipped and noised, "
                                  "a device's whole data) or sample (DP-SGD on the device: one image)",
                        choices=("device", "sample"))
    dp_sample_rate: float = 0.0
    dp_grad_clip: float = 0.0
    dp_devices: int = flag(1, "distributed DP: each device adds the noise of dp_sigma / sqrt(N), and an edge sums "
                              "securely no fewer than N devices (needs secagg; 1: each device's release is "
                              "private on its own)")
    secagg: str = flag("off", "secure aggregation: an edge learns only the sum of its devices' statistics (full: "
                              "every pair masks; plus: SecAgg+, log n neighbours each)",
                       choices=("off", "full", "plus"))
    secagg_min_devices: int = flag(3, "the fewest devices a secure sum may be over: a device refuses a smaller "
                                      "roster before it sends any share (dp_devices, when larger, applies instead)")
    downlink_codec: str = flag("none", "how a model the cloud sends every device travels: none (whole), int8 or topk "
                                       "(its distance from a base sent whole every downlink_base_every versions, "
                                       "with error feedback; runtime/downlink.py)", choices=CODECS)
    downlink_topk: float = 0.01
    downlink_base_every: int = 10
    report_every: int = flag(5, "rounds between the cloud's representation reports (effective rank, spectrum; the "
                                "self-supervised methods' probe and kNN), and the last round always")

    def __post_init__(self) -> None:
        if self.feddecorr_beta < 0:
            raise ValueError(f"feddecorr_beta must be >= 0, got {self.feddecorr_beta}")
        if self.calibrate not in ("none", "lda") or self.calibrate_every < 0 or not 0 < self.calib_shrink <= 1:
            raise ValueError(f"calibrate must be none or lda, calibrate_every >= 0 and calib_shrink in (0, 1], got "
                             f"{self.calibrate!r}, {self.calibrate_every} and {self.calib_shrink}")
        if self.calib_cov not in ("full", "diag") or self.calib_dtype not in ("f2", "f4", "f8"):
            raise ValueError(f"calib_cov must be full or diag and calib_dtype f2, f4 or f8, got {self.calib_cov!r} "
                             f"and {self.calib_dtype!r}")
        from splitedge.methods.calibration.layers import parse_layers

        if len(parse_layers(self.calib_layer)) > 1 and not 0 < self.calib_holdout <= 0.5:
            raise ValueError(f"calib_holdout must be in (0, 0.5] to choose among calib_layer {self.calib_layer}, got "
                             f"{self.calib_holdout}")
        if len(parse_layers(self.calib_layer)) > 1 and self.dp_sigma > 0:
            raise ValueError("calib_layer names several layers, and dp_sigma is on: each layer's statistics would be "
                             "a release of their own; name one layer")
        if self.robust == "auto":  # the safe rule this run can apply (see the docstring)
            object.__setattr__(self, "robust", "none" if self.secagg != "off" else "clip")
        if self.robust not in ROBUST_MERGES:
            raise ValueError(f"robust must be one of {', '.join(ROBUST_MERGES)}, got {self.robust!r}")
        if self.dp_sigma < 0 or min(self.dp_clip, self.dp_head_clip, self.dp_update_clip, self.dp_bn_clip) < 0 \
                or not 0 < self.dp_delta < 1:
            raise ValueError(f"dp_sigma and the dp clips must be >= 0 and dp_delta in (0, 1), got {self.dp_sigma}, "
                             f"{self.dp_clip}/{self.dp_head_clip}/{self.dp_update_clip}/{self.dp_bn_clip} and "
                             f"{self.dp_delta}")
        if self.dp_sigma > 0 and self.calibrate != "none" and not self.dp_head_clip > 0:
            raise ValueError("dp_sigma with calibrate needs dp_head_clip > 0: the L2 norm each image's classifier "
                             "input is clipped to in the head statistics (docs/privacy.md)")
        if self.dp_unit not in ("device", "sample") or not 0 <= self.dp_sample_rate <= 1 or self.dp_grad_clip < 0:
            raise ValueError(f"dp_unit must be device or sample, dp_sample_rate in [0, 1] and dp_grad_clip >= 0, got "
                             f"{self.dp_unit!r}, {self.dp_sample_rate} and {self.dp_grad_clip}")
        if self.dp_sigma > 0 and self.dp_unit == "sample":
            from splitedge.methods.privacy.dpsgd import check_sample_unit

            check_sample_unit(self)
        if self.dp_devices < 1:
            raise ValueError(f"dp_devices must be >= 1, got {self.dp_devices}")
        if self.dp_devices > 1 and (self.dp_sigma <= 0 or self.secagg == "off"):
            raise ValueError(f"dp_devices={self.dp_devices} shares the noise of each release between devices whose "
                             f"sum only the edge sees: it needs dp_sigma > 0 and secagg full or plus")
        if self.secagg not in ("off", "full", "plus"):
            raise ValueError(f"secagg must be off, full or plus, got {self.secagg!r}")
        if self.secagg_min_devices < 2:
            raise ValueError(f"secagg_min_devices must be >= 2 (a secure sum needs a pair), got "
                             f"{self.secagg_min_devices}")
        if self.secagg != "off" and self.robust != "none":
            raise ValueError(f"secagg={self.secagg} hides each device's statistics from its edge, so a robust merge "
                             f"(robust={self.robust}) has nothing to work on: use one of them")
        if self.min_class_count < 1:
            raise ValueError(f"min_class_count must be >= 1, got {self.min_class_count}")
        if self.report_every < 1:
            raise ValueError(f"report_every must be >= 1, got {self.report_every}")
        if self.downlink_codec not in CODECS or not 0 < self.downlink_topk <= 1 \
                or self.downlink_base_every < 1:
            raise ValueError(f"downlink_codec must be none, int8 or topk, downlink_topk in (0, 1] and "
                             f"downlink_base_every >= 1, got {self.downlink_codec!r}, {self.downlink_topk} and "
                             f"{self.downlink_base_every}")
        if not self.robust_clip_k > 0 or not 0 <= self.robust_trim < 0.5:
            raise ValueError(f"robust_clip_k must be > 0 and robust_trim in [0, 0.5), got {self.robust_clip_k} and "
                             f"{self.robust_trim}")


@dataclass(frozen=True)
class ModelSpec:
    """The network every tier builds and how its input is normalised."""

    model: str = "cnn"
    num_classes: int = 10
    channels: int = 1
    image_size: int = 8
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.25,)
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean/std need {self.channels} values, got {self.mean} / {self.std}")
        if self.num_classes < 2 or self.image_size < 4:
            raise ValueError(f"bad model spec: {self}")


@dataclass(frozen=True)
class RunConfig:
    """What a round announcement configures: the model and the method's own settings."""

    model: ModelSpec
    method: MethodConfig

    def to_wire(self) -> dict[str, Any]:
        return {"model": to_wire(self.model), "method": to_wire(self.method)}

    @classmethod
    def from_wire(cls, method_config: type[MethodConfig], data: Any) -> "RunConfig":
        """Parse a round's config for a method whose Config class is `method_config`."""
        if not isinstance(data, Mapping) or set(data) != {"model", "method"}:
            keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"config must be a map with 'model' and 'method', got {keys}")
        return cls(from_wire(ModelSpec, data["model"], "model"),
                   from_wire(method_config, data["method"], "method"))


def to_wire(obj: Any) -> Any:
    """A config value as plain msgpack data: dataclass -> map, tuple -> list (arrays stay)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_wire(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_wire(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def from_wire(cls: type[T], data: Any, path: str = "config") -> T:
    """Build dataclass `cls` from a nested map, checking every value against its field's type.

    Absent fields take their defaults; unknown names and wrong types raise ValueError.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a map of settings, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, f"{path}.{name}") for name, value in data.items()}
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    """`value` as type `hint` (bool, int, float, str, tuples, optionals, nested dataclasses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{path}: unsupported type {hint}")
    if origin is tuple:
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return from_wire(hint, value, path)
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    is_bool = isinstance(value, bool)
    if hint is bool and is_bool:
        return value
    if hint is int and isinstance(value, int) and not is_bool:
        return value
    if hint is float and isinstance(value, (int, float)) and not is_bool:
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if hint is Any:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ValueError(f"{path}: expected {name}, got {type(value).__name__} {value!r:.60}")


def parse_settings(cls: type, items: Mapping[str, Any], path: str = "setting") -> dict[str, Any]:
    """Command-line settings (strings, or values already typed) as typed values of `cls`'s fields.

    Text is read by the field's type: booleans as true/false/yes/no/1/0, tuples as
    comma-separated values or a JSON list. Unknown names and unreadable values: ValueError.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(items) - fields)
    if unknown:
        raise ValueError(f"unknown {path}(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    return {key: _coerce(hints[key], _from_text(hints[key], value, key), key) if isinstance(value, str)
            else _coerce(hints[key], value, key) for key, value in items.items()}


def _from_text(hint: Any, text: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if text.lower() in ("none", "null", "") else _from_text(args[0], text, key)
    if origin is tuple:
        items = json.loads(text) if text.strip().startswith("[") else [v for v in text.split(",") if v.strip()]
        item = typing.get_args(hint)[0] if typing.get_args(hint) else str
        return [_from_text(item, v, key) if isinstance(v, str) else v for v in items]
    try:
        if hint is bool:
            return _to_bool(text)
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{key}: cannot read {text!r} as {hint.__name__}") from None
    return text


def _to_bool(value: str) -> bool:
    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"not a boolean: {value!r}")
    return value.lower() in ("1", "true", "yes")
