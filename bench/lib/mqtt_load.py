"""Realistic device `moments` messages, and a publisher process that floods a broker with them.

The end-to-end throughput bench needs the sender in another OS process: on a 2-core box a
publisher thread would share the receiver's GIL and the measurement would be of Python's
scheduler, not of the edge. ``python -m bench.lib.mqtt_load --url ... --count N`` encodes its
messages and connects first, prints ``ready``, waits for one line on stdin, then publishes them all (QoS 1,
as devices do) and prints ``sent``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from splitedge.protocol.codec import Envelope, encode
from splitedge.protocol.topics import topic

DISTINCT = 16  # distinct payloads cycled: realistic content without N x 650 KB of RAM


def moments_payloads(count: int, dim: int, classes: int = 10, dtype: str = "f4", run: str = "bench",
                     seed: int = 0) -> list[tuple[str, bytes]]:
    """``count`` (topic, encoded moments envelope) pairs from ``count`` device ids.

    Each envelope has its own sender and msg_id (receivers drop duplicate ids); the array
    content repeats every DISTINCT messages to bound memory.
    """
    from splitedge.methods.moments import ClassMoments, moments_to_body

    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(min(count, DISTINCT)):
        m = ClassMoments(np.arange(classes), rng.integers(5, 60, classes), rng.normal(size=(classes, dim)),
                         rng.random((classes, dim)) + 0.1)
        bodies.append(moments_to_body(m, dtype=dtype, versions={"wc": 1}))
    out = []
    for i in range(count):
        device = f"d{i:04d}"
        env = Envelope(kind="moments", run=run, round=1, sender=device, body=bodies[i % len(bodies)])
        out.append((topic(run, "device", device, "up", "moments"), encode(env)))
    return out


def publish_all(transport: Any, payloads: list[tuple[str, bytes]], timeout: float = 300.0) -> None:
    """Publish every payload at QoS 1 through one connection and wait for all PUBACKs."""
    for topic_, payload in payloads:
        transport.publish_raw(topic_, payload, qos=1)
    if not transport.flush(timeout):
        raise TimeoutError(f"not every message was acknowledged within {timeout:g}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    p.add_argument("--url", required=True)
    p.add_argument("--run", default="bench")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dtype", default="f4")
    args = p.parse_args(argv)
    from splitedge.protocol.mqtt import MqttTransport

    payloads = moments_payloads(args.count, args.dim, args.classes, args.dtype, args.run)
    with MqttTransport(args.url, client_id=f"bench-load-{args.run}", role="device") as transport:
        sys.stdout.write("ready\n")  # connected and encoded: the clock starts at "go"
        sys.stdout.flush()
        sys.stdin.readline()
        publish_all(transport, payloads)
    sys.stdout.write("sent\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
