"""The two halves of the inbound chain: the transport's steps (protocol/inbound.py) in their
order, a step added without touching the others, and the node's steps (runtime/inbound.py):
another session dropped, counts past the announced samples (a class beyond those announced, more
of a class than the manifest lists) and a part's refusal counted by rule, nothing of it reaching
the part."""

from __future__ import annotations

import numpy as np

from parts import env
from splitedge.protocol.codec import encode
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.inbound import WIRE_STEPS, Frame, cap_size, open_frame
from splitedge.protocol.transport import LoopbackBus, LoopbackTransport
from splitedge.runtime.inbound import Inbound, NodeInbound
from splitedge.runtime.allowance import Allowance, listed

TOPIC = "splitedge/r/device/d0/up/done"


def _pair(steps=WIRE_STEPS) -> tuple[LoopbackTransport, LoopbackTransport, list]:
    bus, got = LoopbackBus(), []
    rx = LoopbackTransport(bus, role="edge", client_id="e0", max_bytes=4096, steps=steps)
    rx.subscribe("splitedge/r/device/+/up/#", lambda t, e: got.append(e))
    return LoopbackTransport(bus, role="device", client_id="d0"), rx, got


def test_a_step_added_to_the_chain_sees_every_frame_the_others_judge() -> None:
    # Prepare: a tap after the size cap, as a byte or timing "mod" would be
    seen: list[int] = []

    def tap(frame: Frame, t, nxt) -> None:
        seen.append(len(frame.payload))
        nxt(frame)

    steps = list(WIRE_STEPS)
    steps.insert(steps.index(cap_size) + 1, tap)
    tx, rx, got = _pair(tuple(steps))
    # Execute: a good message, then one over the receiver's 4,096-byte cap
    tx.publish(TOPIC, env("done", {"phase": "round", "info": {}}))
    tx.publish_raw(TOPIC, b"\x80" * 5000)
    # Assert: the tap saw the good frame only (the cap stopped the other first), both were counted
    assert len(got) == 1 and len(seen) == 1
    assert rx.rejected == {"frame.too_large": 1} and rx.counters.total("in", "messages") == 2


def test_the_steps_run_in_their_order_size_before_decoding() -> None:
    # A frame too large AND malformed is refused for its size: nothing parsed it
    tx, rx, got = _pair()
    tx.publish_raw(TOPIC, b"\xc1" * 5000)
    tx.publish_raw(TOPIC, b"\xc1" * 10)
    assert got == [] and rx.rejected["frame.too_large"] == 1 and sum(rx.rejected.values()) == 2
    assert WIRE_STEPS.index(cap_size) < WIRE_STEPS.index(open_frame)


class _Part:
    """A part whose check refuses any body with a 'bad' key."""

    def __init__(self) -> None:
        self.checked = 0

    def check(self, env_, source: str) -> None:
        self.checked += 1
        if "bad" in env_.body.get("info", {}):
            raise ProtocolError("state.bad", "refused by the part")


def test_the_node_chain_drops_another_session_and_counts_refusals_by_rule() -> None:
    session = "a" * 16
    chain, part = NodeInbound("edge e0", lambda: session), _Part()
    moments = {"space": "wc", "version": 0, "classes": np.array([0]), "counts": np.array([50]),
               "mean": np.zeros((1, 2), "<f4"), "var": np.zeros((1, 2), "<f4")}
    cases = [
        (env("done", {"phase": "round", "info": {}}), None, True),
        (env("done", {"phase": "round", "info": {"bad": 1}}), None, False),  # the part's check
        (env("moments", moments), Allowance(10), False),  # counts 50 > 10 announced
        (env("moments", {**moments, "session": "b" * 16}), Allowance(100), False),  # another incarnation
        (env("moments", moments), Allowance(100), True),
        (env("moments", moments), Allowance(100, frozenset({1, 2})), False),  # class 0 never announced
        (env("moments", moments), listed(100, [40, 60]), False),  # 50 of class 0; its manifest entry holds 40
        (env("moments", moments), listed(100, [50, 60]), True),
        (env("done", {"phase": "round", "info": {}, "session": "b" * 16}), None, False),  # a replay of an earlier run
        (env("done", {"phase": "round", "info": {}, "session": session}), None, True),
    ]
    results = [chain.admit(Inbound(e, "child", part, announced)) for e, announced, _ in cases]
    assert results == [ok for *_, ok in cases]
    assert dict(chain.refused) == {"state.bad": 1, "state.samples": 2, "state.classes": 1} and chain.foreign == 2
    assert part.checked == 5  # neither the over-counts, the unannounced class nor the foreign message reached it
    assert encode(cases[0][0])  # the envelopes are valid messages, not hand-made shapes
