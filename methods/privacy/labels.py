"""Length-prefixed labels for hashes and key derivation; plain bytes, no `cryptography`.

Apart from crypto.py because the roster (imported by every device, through runtime/secure_sum.py)
hashes with them, and a thin device without the [sign] extra must still import it.
"""

from __future__ import annotations


def label(*parts: bytes | str) -> bytes:
    """An unambiguous byte string of ``parts`` (each 4-byte length-prefixed), for HKDF info and AAD."""
    out = []
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        out.append(len(b).to_bytes(4, "big") + b)
    return b"".join(out)
