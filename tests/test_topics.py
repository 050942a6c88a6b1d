"""Topic building, parsing and MQTT filter matching (cross-checked against paho)."""

from __future__ import annotations

import pytest
from paho.mqtt.client import topic_matches_sub

from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.topics import Topic, matches, parse, pattern, topic, validate_filter, validate_topic_name


def test_build_and_parse_round_trip() -> None:
    t = topic("run-7", "device", "d03", "up", "moments")

    assert t == "splitedge/run-7/device/d03/up/moments"
    assert parse(t) == Topic("run-7", "device", "d03", "up", "moments")


@pytest.mark.parametrize("args, rule", [
    (("r/1", "device", "d", "up", "hello"), "topic.segment"),
    (("r", "device", "d+", "up", "hello"), "topic.segment"),
    (("r", "device", "d", "up", "he#llo"), "topic.segment"),
    (("", "device", "d", "up", "hello"), "topic.segment"),
    (("$r", "device", "d", "up", "hello"), "topic.segment"),
    (("r", "router", "d", "up", "hello"), "topic.tier"),
    (("r", "edge", "e", "sideways", "hello"), "topic.direction"),
])
def test_bad_segments_raise_protocol_error(args: tuple, rule: str) -> None:
    with pytest.raises(ProtocolError) as info:
        topic(*args)
    assert info.value.rule == rule
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", ["splitedge/r/device/d/up", "other/r/device/d/up/hello",
                                 "splitedge/r/device/d/up/hello/extra", "splitedge/r/device//up/hello"])
def test_parse_rejects_foreign_topics(bad: str) -> None:
    with pytest.raises(ProtocolError):
        parse(bad)


def test_pattern_defaults_and_wildcards() -> None:
    assert pattern("r") == "splitedge/r/+/+/+/+"
    assert pattern("r", tier="device", direction="up") == "splitedge/r/device/+/up/+"
    assert pattern("r", kind="#") == "splitedge/r/+/+/+/#"
    with pytest.raises(ProtocolError):
        pattern("+")  # runs never share subscriptions
    with pytest.raises(ProtocolError):
        pattern("r", tier="nope")


def test_filter_and_name_validation() -> None:
    assert validate_filter("a/+/#") == "a/+/#"
    for bad in ["a/#/b", "a/b#", "a/+b", ""]:
        with pytest.raises(ProtocolError):
            validate_filter(bad)
    with pytest.raises(ProtocolError):
        validate_topic_name("a/+/c")


CASES = [
    ("a/+/c", "a/b/c"), ("a/+/c", "a/b/d"), ("a/#", "a"), ("a/#", "a/b/c"), ("#", "x/y"),
    ("+", "x"), ("+", "x/y"), ("+/+", "/x"), ("a/+", "a/"), ("#", "$SYS/broker"),
    ("+/broker", "$SYS/broker"), ("$SYS/#", "$SYS/broker/bytes"), ("a/b", "a/b"), ("a/b", "a/b/c"),
    (pattern("r", tier="device"), topic("r", "device", "d1", "up", "hello")),
    (pattern("r", tier="edge"), topic("r", "device", "d1", "up", "hello")),
]


@pytest.mark.parametrize("filter_, name", CASES)
def test_matches_agrees_with_paho(filter_: str, name: str) -> None:
    assert matches(filter_, name) == topic_matches_sub(filter_, name)
