"""Topic building, parsing and MQTT filter matching (cross-checked against paho)."""

from __future__ import annotations

import numpy as np
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
                                 "splitedge/r/device/d/up/hello/d2/extra", "splitedge/r/device//up/hello",
                                 "splitedge/r/device/d/up/hello/", "splitedge/r/edge/e/peer/weights"])
def test_parse_rejects_foreign_topics(bad: str) -> None:
    with pytest.raises(ProtocolError):
        parse(bad)


def test_addressed_topics_name_publisher_and_addressee() -> None:
    t = topic("r", "edge", "e1", "down", "weights-wc", to="d7")
    assert t == "splitedge/r/edge/e1/down/weights-wc/d7"
    where = parse(t)
    assert (where.node_id, where.to, where.kind, where.message_kind) == ("e1", "d7", "weights-wc", "weights")
    assert parse(topic("r", "device", "d1", "peer", "arrays")).to is None
    assert parse(topic("r", "cloud", "c", "down", "assign", to="@g1")).to == "@g1"


def test_addressed_patterns_match_only_their_addressee() -> None:
    mine = pattern("r", "edge", "e1", "down", to="d7")
    assert mine == "splitedge/r/edge/e1/down/+/d7"
    assert matches(mine, topic("r", "edge", "e1", "down", "request", to="d7"))
    assert not matches(mine, topic("r", "edge", "e1", "down", "request", to="d8"))
    assert not matches(pattern("r", "edge", "e1", "down"), topic("r", "edge", "e1", "down", "request", to="d7"))
    assert matches(pattern("r", "edge", "e1", "down", "#"), topic("r", "edge", "e1", "down", "request", to="d7"))
    with pytest.raises(ProtocolError):
        pattern("r", kind="#", to="d7")
    with pytest.raises(ProtocolError):
        topic("r", "cloud", "c", "peer", "weights")  # only devices talk to peers


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


@pytest.mark.parametrize("role, argv", [
    ("device", ["--edge", "e0", "--data", "SHARD"]),
    ("edge", []),
    ("cloud", ["--out", "OUT"]),
])
def test_a_role_refuses_an_id_that_addresses_a_group(role: str, argv: list[str], tmp_path, capsys) -> None:
    """PROTOCOL.md: a node id must not start with '@' (it addresses a group); every role says so
    in one line before it connects (on 52b8928 an edge and a cloud took '@e' and went on)."""
    from splitedge.cli import main
    from splitedge.methods.data.datasets import save_shard

    shard = tmp_path / "shard.npz"
    save_shard(shard, np.zeros((4, 8, 8, 1), np.uint8), np.arange(4) % 2)
    argv = [str(shard) if a == "SHARD" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main([role, "--broker", "mqtt://127.0.0.1:1", "--id", "@x", *argv]) == 2
    err = capsys.readouterr().err
    assert "--id '@x': a node id must not start with '@'" in err and err.count("\n") == 1, err
