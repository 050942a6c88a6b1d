"""FedProto baseline: local models regularised towards global per-class prototypes; only prototypes travel."""

BUILDS_ON: tuple[str, ...] = ()
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ("protos", "device")
"""Its modules other methods may import: CFLHKD builds on its prototypes and its device."""
