"""A round waits briefly for a child that just went offline (a broker restart fires every will)."""

from __future__ import annotations

from types import SimpleNamespace

from splitedge.runtime.presence import Presence
from splitedge.runtime.rounds import RoundCollector


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def done(sender: str, round_: int = 1) -> SimpleNamespace:
    return SimpleNamespace(msg_id=f"{sender}-{round_}", round=round_, sender=sender, kind="done", body={"phase": "round"})


def test_a_child_gone_for_less_than_the_grace_is_still_awaited_then_dropped() -> None:
    clock = Clock()
    p = Presence(grace_s=5.0, clock=clock)
    assert p.update("d0", "online") and p.update("d1", "online")
    assert not p.update("d1", "online")  # the same status again changes nothing
    assert p.update("d1", "offline")
    assert p.live({"d0", "d1", "d2"}) == {"d0"}
    assert p.awaited({"d0", "d1", "d2"}) == {"d0", "d1"}  # d2 was never online
    clock.now += 4.9
    assert p.awaited({"d0", "d1"}) == {"d0", "d1"}
    clock.now += 0.2
    assert p.awaited({"d0", "d1"}) == {"d0"}
    p.update("d1", "online")  # back: awaited again, and its next outage gets a full grace
    assert p.awaited({"d1"}) == {"d1"}


def test_a_round_opened_while_every_child_blinked_waits_for_them_instead_of_closing_empty() -> None:
    clock = Clock()
    p = Presence(grace_s=5.0, clock=clock)
    for d in ("d0", "d1"):
        p.update(d, "online")
    for d in ("d0", "d1"):  # the broker restarts: both wills arrive before the next round opens
        p.update(d, "offline")
    rounds = RoundCollector(clock=clock)
    rounds.open(1, 60.0, p.awaited({"d0", "d1"}))
    assert rounds.expected == {"d0", "d1"} and not rounds.complete(p.awaited({"d0", "d1"}))
    # d0 comes back first and finishes; d1, still within its grace, holds the round open
    p.update("d0", "online")
    rounds.add(done("d0"))
    clock.now += 1.0
    assert not rounds.complete(p.awaited({"d0", "d1"}))
    p.update("d1", "online")
    rounds.add(done("d1"))
    assert rounds.complete(p.awaited({"d0", "d1"}))
    assert [r.sender for r in rounds.close()] == ["d0", "d1"]


def test_a_child_that_does_not_come_back_is_dropped_after_the_grace() -> None:
    clock = Clock()
    p = Presence(grace_s=5.0, clock=clock)
    for d in ("d0", "d1"):
        p.update(d, "online")
    rounds = RoundCollector(clock=clock)
    rounds.open(1, 60.0, p.awaited({"d0", "d1"}))
    p.update("d1", "offline")  # died during the round
    rounds.add(done("d0"))
    assert not rounds.complete(p.awaited({"d0", "d1"}))
    clock.now += 5.0
    assert rounds.complete(p.awaited({"d0", "d1"}))
    rounds.close()
    assert rounds.counts["missed"] == 1
    # the next round does not wait for it at all
    rounds.open(2, 60.0, p.awaited({"d0", "d1"}))
    assert rounds.expected == {"d0"}
