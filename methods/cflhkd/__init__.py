"""CFLHKD (METHODS.md): clustered FL with clusters on edges and hierarchical distillation."""

BUILDS_ON: tuple[str, ...] = ("fedavg", "fedproto")
"""The method packages this one imports from, only their SHARED modules (tests/app/test_layering.py)."""
SHARED: tuple[str, ...] = ()
"""No other method imports from this one."""
