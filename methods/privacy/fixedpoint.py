"""Fixed-point encoding of float and int arrays into uint64 words, summed mod 2^64.

Masks only cancel in a ring, so inputs become integers mod 2^64 (numpy's uint64 wraps
silently, which is exactly that arithmetic). A float x encodes as round(x * 2^f) in two's
complement; an int as itself (scale 0). The sum of the encodings decodes exactly as long as
it stays inside the signed 64-bit range, so each device checks its own values against a
headroom of 1/n of it: |encoding| <= (2^63 - 1) // n for n devices in the round. With the
default f = 24 a float must satisfy |x| <= (2^63 - 1) / (n * 2^24), about 5.5e11 / n
(5.5e8 at n = 1,000), at a resolution of 2^-24 ~ 6e-8; ints must satisfy |x| <= (2^63 - 1) // n.
The decoded sum is exactly the sum of the encodings (as int64); converted to float64 it is
exact while that integer is below 2^53 in magnitude, otherwise rounded to float64's nearest.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import SecAggError

FRAC_BITS = 24
"""Fractional bits of a float's encoding: float32-like resolution (2^-24) near 1 while leaving
39 - log2(n) integer bits, enough for per-class sums of squares of a few thousand samples."""
MAX_FRAC_BITS = 52


def headroom(devices: int) -> int:
    """The largest |encoding| one of ``devices`` inputs may have so that the sum cannot overflow."""
    if devices < 1:
        raise SecAggError(f"fixed point: devices must be >= 1, got {devices}")
    return (2**63 - 1) // devices


def float_range(frac_bits: int, devices: int) -> float:
    """The largest |x| a float input may have: headroom / 2^f."""
    return headroom(devices) / 2.0**frac_bits


def encode(name: str, values: np.ndarray, frac_bits: int, devices: int) -> tuple[np.ndarray, int]:
    """``values`` as uint64 words of the same shape, and the scale bits used (``frac_bits`` for
    floats, 0 for ints and bools). Raises SecAggError naming ``name`` when a value is not finite
    or would overflow the headroom of ``devices`` inputs."""
    if not 0 <= frac_bits <= MAX_FRAC_BITS:
        raise SecAggError(f"fixed point: frac_bits must be in 0..{MAX_FRAC_BITS}, got {frac_bits}")
    arr = np.asarray(values)
    limit = headroom(devices)
    if arr.dtype.kind == "f":
        x = arr.astype(np.float64)
        if not np.all(np.isfinite(x)):
            raise SecAggError(f"fixed point: {name!r} holds NaN or inf; only finite values can be summed")
        scaled = np.rint(x * 2.0**frac_bits)
        top = float(np.max(np.abs(scaled))) if scaled.size else 0.0
        if top > _float_below(limit):
            raise SecAggError(
                f"fixed point: {name!r} has |value| {top / 2.0**frac_bits:.6g}, over the range "
                f"{float_range(frac_bits, devices):.6g} of {devices} devices at {frac_bits} fractional bits "
                f"((2^63 - 1) / (n * 2^f)); rescale the input or lower frac_bits")
        return scaled.astype(np.int64).view(np.uint64), frac_bits
    if arr.dtype.kind in "iub":
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if max(abs(lo), abs(hi)) > limit:
                raise SecAggError(f"fixed point: {name!r} has |value| {max(abs(lo), abs(hi))}, over the integer "
                                  f"range {limit} of {devices} devices ((2^63 - 1) // n)")
        return arr.astype(np.int64).view(np.uint64), 0
    raise SecAggError(f"fixed point: {name!r} has dtype {arr.dtype}; only float, int and bool arrays can be summed")


def decode(words: np.ndarray, scale_bits: int) -> np.ndarray:
    """A summed uint64 array back to numbers: int64 for scale 0, float64 (sum * 2^-scale) otherwise."""
    ints = np.asarray(words, dtype=np.uint64).view(np.int64)
    if scale_bits == 0:
        return ints.copy()
    return ints.astype(np.float64) * 2.0**-scale_bits


def _float_below(limit: int) -> float:
    """The largest float64 <= ``limit`` (float(limit) may round up past it)."""
    f = float(limit)
    return f if int(f) <= limit else math.nextafter(f, 0.0)
