"""t-of-n Shamir secret sharing of byte strings over the prime field of 2^127 - 1.

The Mersenne prime keeps field elements at 16 bytes and products cheap for Python's big ints; a
32-byte secret is cut into chunks of 15 bytes (15 + 15 + 2), each shared with its own random
polynomial of degree t - 1, so a share is 3 x 16 bytes. Reconstruction is Lagrange interpolation
at 0, with the coefficients cached per set of x-coordinates (full SecAgg reconstructs every
survivor's secret from nearly the same holders). A share is only a number, so a wrong one would
silently give a wrong secret: every reconstructed chunk must fit its byte length (the 2-byte last
chunk catches a random wrong share with probability 1 - 2^-111), and when more than t shares
arrived a second subset of t must give the same secret.
"""

from __future__ import annotations

import secrets
from functools import lru_cache
from typing import Mapping, Sequence

from .errors import SecAggError

PRIME = 2**127 - 1
CHUNK_BYTES = 15
"""Bytes of secret per field element (2^120 < PRIME)."""
FIELD_BYTES = 16


def chunk_sizes(secret_len: int) -> list[int]:
    """How a secret of ``secret_len`` bytes is cut: 32 -> [15, 15, 2]."""
    full, rest = divmod(secret_len, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + ([rest] if rest else [])


def share_len(secret_len: int) -> int:
    """Bytes of one share of a ``secret_len``-byte secret."""
    return FIELD_BYTES * len(chunk_sizes(secret_len))


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> dict[int, bytes]:
    """Shares of ``secret`` at the x-coordinates ``xs`` (distinct, in 1..PRIME-1); any ``threshold``
    of them give the secret back, fewer reveal nothing about it."""
    if not 1 <= threshold <= len(xs):
        raise SecAggError(f"shamir: threshold {threshold} needs 1 <= t <= {len(xs)} share holders")
    _check_xs(xs)
    polys, start = [], 0
    for size in chunk_sizes(len(secret)):
        value = int.from_bytes(secret[start:start + size], "big")
        start += size
        polys.append([value] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)])
    out = {}
    for x in xs:
        parts = []
        for coeffs in polys:
            acc = 0
            for c in reversed(coeffs):  # Horner
                acc = (acc * x + c) % PRIME
            parts.append(acc.to_bytes(FIELD_BYTES, "big"))
        out[x] = b"".join(parts)
    return out


def combine(shares: Mapping[int, bytes], threshold: int, secret_len: int, what: str = "secret") -> bytes:
    """The secret from at least ``threshold`` shares keyed by x-coordinate; SecAggError (naming
    ``what``) on too few, malformed or inconsistent shares."""
    if len(shares) < threshold:
        raise SecAggError(f"shamir: {len(shares)} shares of {what}, threshold {threshold}")
    xs = sorted(shares)
    _check_xs(xs)
    sizes = chunk_sizes(secret_len)
    values = {x: _elements(shares[x], len(sizes), what) for x in xs}
    secret = _interpolate(tuple(xs[:threshold]), values, sizes, what)
    if len(xs) > threshold and _interpolate(tuple(xs[-threshold:]), values, sizes, what) != secret:
        raise SecAggError(f"shamir: the shares of {what} disagree (two subsets of {threshold} give different "
                          f"secrets): a holder returned a wrong share")
    return secret


def _interpolate(xs: tuple[int, ...], values: Mapping[int, list[int]], sizes: list[int], what: str) -> bytes:
    lam = _lagrange_at_zero(xs)
    out = []
    for i, size in enumerate(sizes):
        chunk = sum(w * values[x][i] for w, x in zip(lam, xs)) % PRIME
        if chunk >> (8 * size):
            raise SecAggError(f"shamir: {what} does not reconstruct to a valid secret (chunk {i} out of range): "
                              f"a share is wrong")
        out.append(chunk.to_bytes(size, "big"))
    return b"".join(out)


@lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """lambda_i = prod_{j != i} x_j / (x_j - x_i) mod PRIME: the weights of f(0) = sum lambda_i f(x_i).
    The t denominators are inverted with one modular exponentiation (prefix products)."""
    nums, dens = [], []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        nums.append(num)
        dens.append(den)
    prefix = [1]
    for d in dens:
        prefix.append(prefix[-1] * d % PRIME)
    inv = pow(prefix[-1], PRIME - 2, PRIME)  # 1 / (d_0 ... d_{t-1})
    out = [0] * len(xs)
    for i in range(len(xs) - 1, -1, -1):
        out[i] = nums[i] * inv % PRIME * prefix[i] % PRIME  # inv * prefix[i] = 1 / d_i
        inv = inv * dens[i] % PRIME
    return tuple(out)


def _elements(share: bytes, count: int, what: str) -> list[int]:
    if not isinstance(share, bytes) or len(share) != count * FIELD_BYTES:
        raise SecAggError(f"shamir: a share of {what} must be {count * FIELD_BYTES} bytes")
    out = [int.from_bytes(share[i:i + FIELD_BYTES], "big") for i in range(0, len(share), FIELD_BYTES)]
    if any(v >= PRIME for v in out):
        raise SecAggError(f"shamir: a share of {what} holds a value outside the field")
    return out


def _check_xs(xs: Sequence[int]) -> None:
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise SecAggError("shamir: x-coordinates must be distinct and in 1..PRIME-1")
