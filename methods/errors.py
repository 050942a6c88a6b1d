"""Errors a method part raises for reasons in the data rather than bugs; a module of its own so
that the numpy-only statistics (methods/moments.py, methods/privacy/dp.py) can raise them without
importing the method contract."""

from __future__ import annotations


class RoundFailed(ValueError):
    """A part's round that cannot give what it owes for a reason in the data, not a bug (local
    training diverged to non-finite weights or features): the node logs the message in one line,
    counts it and tells its parent the round failed; the round goes on without this node's part."""


NON_FINITE_FEATURES = "the features contain NaN or inf (W_c's output is not finite: local training diverged?)"
"""What a device's statistics (clear or private) fail its round with when W_c's output is not finite."""
