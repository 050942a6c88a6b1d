"""The frame limits every decoder enforces, and the encoder's check against the same numbers.

One source of truth: ``decode`` (codec.py) hands these to msgpack's Unpacker, ``check_frame``
walks an outgoing envelope with them, and PROTOCOL.md's limits and budget tables are tested equal
to them (tests/protocol/test_wire_limits.py, tests/runtime/test_floods.py).
A sender that checked less would publish frames every receiver drops (`frame.invalid`), as an
edge with more than MAX_ARRAY_LEN members once did.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ProtocolError

__all__ = ["BROKER_PACKET_BYTES", "DEFAULT_MAX_BYTES", "MAX_ARRAY_LEN", "MAX_ELEMENTS", "MAX_STR_BYTES", "MAX_DEPTH",
           "FREE_ELEMENTS", "BYTES_PER_ELEMENT", "ARRAY_COST", "element_budget", "over_budget", "check_frame", "check_density"]

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
"""A receiver's default frame cap (the cap itself is each receiver's setting, --max-frame-bytes)."""
BROKER_PACKET_BYTES = DEFAULT_MAX_BYTES + 1024 * 1024
"""The `max_packet_size` of the broker configs splitedge writes: the default frame cap plus headroom
for the topic, the MQTT header and a signature, so the broker never drops a frame a receiver takes."""
MAX_ARRAY_LEN = 1024
"""Items of one msgpack array. msgpack preallocates a list before reading its items, so this
bounds what a small hostile frame can allocate: <= MAX_DEPTH levels x 1024 x 8 B = 8 MiB.
Longer lists travel as pages (fields.Paged)."""
MAX_ELEMENTS = 1 << 17
"""List items + map entries (+1 per container) per frame. Bodies carry their bulk in array ext
payloads, so this only stops a small frame from inflating into millions of Python objects.
It also bounds a single map (the decoder's max_map_len is the same number)."""
MAX_STR_BYTES = 1 << 20
"""UTF-8 bytes of one msgpack str (map keys included); a receiver with a smaller frame cap
allows at most its cap."""
MAX_DEPTH = 1024
"""Nested msgpack arrays and maps, the envelope map included: msgpack-python's fixed unpack
stack (decode reports `frame.depth` beyond it), and its packer's recursion limit as well.
Each level is a container, so nesting is paid for from the element budget too."""

# What a frame's elements cost a receiver is work per element (a Python object, a hook, a schema
# check: about 1 us each), not per byte, and a msgpack int, nil or empty list is one byte. So a
# frame may hold only as many elements as its length pays for: past FREE_ELEMENTS, one per
# BYTES_PER_ELEMENT bytes. A decoder's work is then linear in the frame's bytes with a small
# constant, whatever the frame holds (before: a 130 kB `done` of 127 lists of 1,024 ints was
# accepted and cost 0.6 us of CPU per byte; bench/floods.py measures it).
FREE_ELEMENTS = 2048
"""Elements any frame may hold whatever its length (a list of MAX_ARRAY_LEN small ints, msgpack's
MAX_DEPTH nested lists)."""
BYTES_PER_ELEMENT = 4
"""Frame bytes each element past FREE_ELEMENTS must come with: the budget of a frame of n bytes is
min(MAX_ELEMENTS, FREE_ELEMENTS + n // BYTES_PER_ELEMENT). Real bodies carry their bulk in
arrays, strings and floats (an id in a member list is 4 bytes or more, a float 9): a receiver
refuses a denser frame as `frame.too_dense` before validating it."""
ARRAY_COST = 8
"""Elements one array ext value counts for (decoding one is a header parse, a numpy view and a
schema check: about eight elements' work). It is counted before the array is decoded."""


def element_budget(frame_bytes: int) -> int:
    """The elements a frame of ``frame_bytes`` bytes may hold (the decoder's and the encoder's)."""
    return min(MAX_ELEMENTS, FREE_ELEMENTS + max(frame_bytes, 0) // BYTES_PER_ELEMENT)


def over_budget(used: int, frame_bytes: int) -> ProtocolError:
    """The refusal of a frame whose elements passed its budget: `frame.too_many_elements` when the
    budget is MAX_ELEMENTS itself, else `frame.too_dense` (the frame is too short for them)."""
    budget = element_budget(frame_bytes)
    if budget >= MAX_ELEMENTS:
        return ProtocolError("frame.too_many_elements", f"more than MAX_ELEMENTS {MAX_ELEMENTS} list items + map "
                                                        "entries (+1 per container, ARRAY_COST per array) in one frame")
    return ProtocolError("frame.too_dense", f"more than {budget} elements in a frame of {frame_bytes} bytes "
                                            f"(FREE_ELEMENTS {FREE_ELEMENTS} + one per BYTES_PER_ELEMENT "
                                            f"{BYTES_PER_ELEMENT} bytes)")


def check_density(used: int, frame_bytes: int) -> None:
    """Raise the refusal a decoder would give a frame of ``frame_bytes`` bytes holding ``used`` elements."""
    if used > element_budget(frame_bytes):
        raise over_budget(used, frame_bytes)


def check_frame(doc: Any) -> int:
    """Raise ProtocolError naming the limit when a decoder would refuse ``doc`` once packed;
    returns the elements it holds (for ``check_density`` once its packed length is known).

    Iterative (a frame may nest MAX_DEPTH deep, past Python's recursion limit) and counting
    elements exactly as the decoder's budget does."""
    used = 0
    stack: list[tuple[Any, int, str]] = [(doc, 1, "envelope")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (list, tuple)):
            _check_depth(depth, path)
            used = _spend(used, len(value), path)
            if len(value) > MAX_ARRAY_LEN:
                raise ProtocolError("frame.array_len", f"{path}: {len(value)} items > MAX_ARRAY_LEN {MAX_ARRAY_LEN}")
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value) if not _leaf(v, path, i))
        elif isinstance(value, dict):
            _check_depth(depth, path)
            used = _spend(used, len(value), path)
            for key, v in value.items():
                _check_key(key, path)
                if not _leaf(v, path, key):
                    stack.append((v, depth + 1, f"{path}.{key}"))
        elif isinstance(value, np.ndarray):
            used = _spend(used, ARRAY_COST - 1, path)
        else:
            _leaf(value, path, None)
    return used


def _leaf(value: Any, path: str, key: Any) -> bool:
    """Check a non-container value where it stands; False for a container or an array (walked
    later: both are counted)."""
    if isinstance(value, (list, tuple, dict, np.ndarray)):
        return False
    if isinstance(value, str):
        _check_str(value, path if key is None else f"{path}[{key!r}]")
    return True


def _check_str(value: str, path: str) -> None:
    if len(value) * 4 > MAX_STR_BYTES and len(value.encode("utf-8", "surrogatepass")) > MAX_STR_BYTES:
        raise ProtocolError("frame.str_len", f"{path}: str of more than MAX_STR_BYTES {MAX_STR_BYTES} UTF-8 bytes")


def _check_key(key: Any, path: str) -> None:
    """msgpack map keys must be str or bin (the decoder uses strict_map_key)."""
    if isinstance(key, str):
        _check_str(key, f"{path} key")
    elif not isinstance(key, (bytes, bytearray)):
        raise ProtocolError("frame.map_key", f"{path}: map key {key!r:.40} is neither str nor bytes")


def _check_depth(depth: int, path: str) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError("frame.depth", f"{path}: nested {depth} deep > MAX_DEPTH {MAX_DEPTH}")


def _spend(used: int, n: int, path: str) -> int:
    used += n + 1
    if used > MAX_ELEMENTS:
        raise ProtocolError("frame.too_many_elements", f"{path}: more than MAX_ELEMENTS {MAX_ELEMENTS} "
                                                       "list items + map entries (+1 per container, ARRAY_COST "
                                                       "per array) in one frame")
    return used
