"""Wire overhead of the envelope + array ext type: encoded bytes / raw array bytes.

``python -m bench.wire_overhead`` prints a markdown table and the same rows as JSON, for a
float32 payload of 1 KiB, 64 KiB and 1 MiB in a ``weights`` and a ``moments`` message.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from splitedge.protocol import Envelope, encode

__all__ = ["SIZES", "overhead", "wire_overhead", "markdown"]

SIZES = (1024, 64 * 1024, 1024 * 1024)
_D = 256  # moments feature dim: K = size / (4 * D) classes


def _body(kind: str, nbytes: int, rng: np.random.Generator) -> dict[str, Any]:
    """A body whose main float32 array is exactly ``nbytes`` long."""
    n = nbytes // 4
    if kind == "weights":
        w = rng.normal(size=n).astype("f4")
        return {"part": "model", "version": 1, "samples": 100, "weights": {"w": w}}
    if kind == "moments":
        k = max(n // _D, 1)
        return {"classes": np.arange(k, dtype="i8"), "counts": np.ones(k, dtype="i8"),
                "mean": rng.normal(size=(k, _D)).astype("f4"),
                "var": rng.random((k, _D)).astype("f4"),
                "space": "wc", "versions": {"wc": 1, "we": 1}}
    raise ValueError(f"no overhead body for kind {kind!r}")


def _array_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_array_bytes(v) for v in value.values())
    return 0


def overhead(kind: str, nbytes: int, *, seed: int = 0) -> dict[str, Any]:
    """One row: encoded envelope bytes vs the raw bytes of every array in the body."""
    body = _body(kind, nbytes, np.random.default_rng(seed))
    env = Envelope(kind=kind, run="bench", round=1, sender="device-0001", body=body)
    wire = len(encode(env))
    raw = _array_bytes(body)
    return {"kind": kind, "array_bytes": nbytes, "raw_bytes": raw, "wire_bytes": wire,
            "overhead_bytes": wire - raw, "ratio": wire / raw}


def wire_overhead(sizes: tuple[int, ...] = SIZES,
                  kinds: tuple[str, ...] = ("weights", "moments")) -> list[dict[str, Any]]:
    return [overhead(kind, size) for kind in kinds for size in sizes]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| kind | array | raw bytes | wire bytes | overhead | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['array_bytes'] // 1024} KiB"
        lines.append(f"| {r['kind']} | {size} | {r['raw_bytes']} | {r['wire_bytes']} "
                     f"| {r['overhead_bytes']} | {r['ratio']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    rows = wire_overhead()
    sys.stdout.write(markdown(rows) + "\n\n" + json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
