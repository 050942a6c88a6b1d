"""Topic strings: ``splitedge/<run>/<tier>/<id>/<direction>/<kind>[/<to>]``.

One module builds, parses and matches topics so that no role ever formats a topic by hand:
a typo in a hand-made topic is a silent black hole on a broker. Bad segments raise
:class:`~splitedge.protocol.errors.ProtocolError` (a ``ValueError``) naming the rule broken.

The tier/id pair always names the PUBLISHER, so a broker ACL can tie each login to the topics
it may write, and a receiver can check the envelope's sender against the topic. Directions:
``up`` (to the publisher's parent), ``down`` (to its children) and ``peer`` (device to its
neighbours). An optional last segment ``<to>`` addresses one node (its id) or a group
(``@<group>``; ``@all`` is every device) instead of every reader of the topic. ``<kind>`` is
the message kind, or ``<kind>-<slot>`` for a latest-value message kept (retained) per slot.
"""

from __future__ import annotations

from typing import NamedTuple

from splitedge.protocol.errors import ProtocolError

PREFIX = "splitedge"
TIERS = ("device", "edge", "cloud")
DIRECTIONS = ("up", "down", "peer")
ALL_DEVICES = "@all"
"""The `<to>` segment of a message for every device below the publisher (relayed by edges)."""
MAX_TOPIC_BYTES = 65535  # MQTT strings carry a 2-byte length
_FORBIDDEN = ("/", "+", "#", "\x00")


class Topic(NamedTuple):
    """The variable parts of a splitedge topic; ``to`` is None when it addresses every reader."""

    run: str
    tier: str
    node_id: str
    direction: str
    kind: str
    to: str | None = None

    @property
    def message_kind(self) -> str:
        """The envelope kind this topic carries (the kind segment without its ``-<slot>``)."""
        return self.kind.split("-", 1)[0]


def _check_segment(name: str, value: object) -> str:
    """Reject a segment that would change the topic's shape or act as a wildcard."""
    if not isinstance(value, str) or not value:
        raise ProtocolError("topic.segment", f"{name} must be a non-empty string, got {value!r}")
    bad = [c for c in _FORBIDDEN if c in value]
    if bad:
        raise ProtocolError("topic.segment", f"{name} {value!r} contains forbidden character(s) {bad!r}")
    if value.startswith("$"):
        raise ProtocolError("topic.segment", f"{name} {value!r} must not start with '$' (broker-reserved)")
    return value


def check_node_id(node_id: object) -> str:
    """A node's own id (its --id), as a caller's mistake: ValueError in one line. Beyond any
    segment's rules it must not start with '@', which addresses a group in a topic's last
    segment (`@all`, `@<group>`): a device named so would be read as one (PROTOCOL.md, "Topics")."""
    try:
        _check_segment("node id", node_id)
    except ProtocolError as exc:
        raise ValueError(f"--id {node_id!r}: {exc.message}") from None
    if str(node_id).startswith("@"):
        raise ValueError(f"--id {node_id!r}: a node id must not start with '@' (a topic's last segment "
                         f"addresses a group with it, e.g. @all)")
    return str(node_id)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ProtocolError(f"topic.{name}", f"{name} must be one of {allowed}, got {value!r}")
    return value


def topic(run: str, tier: str, node_id: str, direction: str, kind: str, to: str | None = None) -> str:
    """Build the topic a node publishes on; every segment is validated."""
    _check_segment("run", run)
    _check_choice("tier", tier, TIERS)
    _check_segment("node_id", node_id)
    _check_choice("direction", direction, DIRECTIONS)
    if direction == "peer" and tier != "device":
        raise ProtocolError("topic.direction", f"only devices publish peer messages, not a {tier}")
    _check_segment("kind", kind)
    parts = (PREFIX, run, tier, node_id, direction, kind)
    return "/".join(parts if to is None else (*parts, _check_segment("to", to)))


def parse(value: str) -> Topic:
    """Split a received topic into its parts; ProtocolError when it is not a splitedge topic."""
    if not isinstance(value, str):
        raise ProtocolError("topic.format", f"topic must be a string, got {type(value).__name__}")
    parts = value.split("/")
    if len(parts) not in (6, 7) or parts[0] != PREFIX:
        raise ProtocolError("topic.format",
                            f"expected {PREFIX}/<run>/<tier>/<id>/<direction>/<kind>[/<to>], got {value!r}")
    found = Topic(*parts[1:])
    topic(*found)  # same validation as when building
    return found


def pattern(run: str, tier: str = "+", node_id: str = "+", direction: str = "+", kind: str = "+",
            to: str | None = None) -> str:
    """Build a subscription filter; any segment may be the single-level wildcard ``+``.

    ``kind`` may also be ``#`` (everything below, addressed or not). ``to`` (a node id, a group
    ``@<g>`` or ``+``) matches addressed topics only; without it only unaddressed ones match.
    ``run`` must be concrete: runs never share subscriptions, which keeps a stale run's
    retained messages out of a new one.
    """
    _check_segment("run", run)
    if tier != "+":
        _check_choice("tier", tier, TIERS)
    if node_id != "+":
        _check_segment("node_id", node_id)
    if direction != "+":
        _check_choice("direction", direction, DIRECTIONS)
    if kind not in ("+", "#"):
        _check_segment("kind", kind)
    parts = (PREFIX, run, tier, node_id, direction, kind)
    if to is None:
        return "/".join(parts)
    if kind == "#":
        raise ProtocolError("topic.wildcard", "'#' already matches addressed topics; give no `to`")
    return "/".join((*parts, to if to == "+" else _check_segment("to", to)))


def validate_topic_name(value: str) -> str:
    """Check a concrete MQTT topic name (what one publishes to): no wildcards, bounded length."""
    if not isinstance(value, str) or not value:
        raise ProtocolError("topic.format", f"topic must be a non-empty string, got {value!r}")
    if "+" in value or "#" in value or "\x00" in value:
        raise ProtocolError("topic.wildcard", f"cannot publish to a filter: {value!r}")
    if len(value.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise ProtocolError("topic.length", "topic longer than 65535 bytes")
    return value


def validate_filter(value: str) -> str:
    """Check an MQTT subscription filter per MQTT 3.1.1 section 4.7."""
    if not isinstance(value, str) or not value:
        raise ProtocolError("topic.format", f"filter must be a non-empty string, got {value!r}")
    if "\x00" in value or len(value.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise ProtocolError("topic.format", f"invalid filter {value!r}")
    levels = value.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ProtocolError("topic.wildcard", f"'#' must be a whole last level in {value!r}")
        if "+" in level and level != "+":
            raise ProtocolError("topic.wildcard", f"'+' must be a whole level in {value!r}")
    return value


def matches(filter_: str, topic_name: str) -> bool:
    """MQTT 3.1.1 filter matching, including the rule that wildcards at the first level do not
    match topics starting with ``$`` (so ``#`` never sees ``$SYS``)."""
    if topic_name.startswith("$") and filter_[:1] in ("+", "#"):
        return False
    f_levels = filter_.split("/")
    t_levels = topic_name.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)
