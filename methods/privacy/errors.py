"""The one exception of secure aggregation, so the messaging layer can catch a refused piece
(and drop or abort the round) without also catching its own bugs."""

from __future__ import annotations


class SecAggError(ValueError):
    """A secure-aggregation step refused its input or cannot complete; the message says what failed.

    Raised instead of ever returning a wrong sum: a bad length, an unknown or duplicate device,
    a failed decryption, a device asked for both shares of one peer, too few survivors or shares.
    """
