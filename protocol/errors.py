"""The one exception type of the wire format.

Every malformed input (a peer's bad frame) and every caller mistake caught by the codec
raises :class:`ProtocolError`. It subclasses ``ValueError`` so a local caller's mistake is
still the ordinary Python error for a bad value, and it carries ``rule`` so transports can
count rejected messages by the rule they broke without parsing strings.
"""

from __future__ import annotations

__all__ = ["ProtocolError"]


class ProtocolError(ValueError):
    """A frame or message broke a named rule of the wire format.

    ``rule`` is a short dotted id such as ``"frame.too_large"`` or ``"schema.finite"``;
    ``str(error) == f"{rule}: {message}"``.
    """

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message

    def __reduce__(self):  # keep the two-argument constructor picklable (multiprocessing)
        return (type(self), (self.rule, self.message))
