"""Virtual devices and training slots: how a simulation holds thousands of nodes in one process.

A *virtual* device holds its part only while it works on a round. Between rounds the part's
declared state is kept as bytes (float arrays as float16 with `park_dtype="f2"`) and the torch
objects are dropped, so a process holding thousands of devices needs the memory of only as
many parts as it has slots. Messages for the part that arrive while it is parked wait, in
order, until the next round takes it back. Edges of a sim share slots too: only so many
aggregate (sample, train) at once.

Both wrap the production runtimes from outside, as part hosts (runtime/parts.py): the device
and edge agents call the host's round hooks and never know whether they are virtual.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ContextManager

from splitedge.malloc import trim
from splitedge.methods import snapshot
from splitedge.protocol.topics import parse
from splitedge.runtime.parts import PartHost


def is_slot(topic: str) -> bool:
    """A latest-value topic (`<kind>-<slot>`): only its newest message matters."""
    return "-" in parse(topic).kind

SLOT_POLL_S = 0.5  # how often a device waiting for a slot checks whether it was stopped


class ParkingHost(PartHost):
    """A device's part, held only between `begin_round` and `end_round` (a shared slot)."""

    def __init__(self, *args: Any, slots: threading.Semaphore, park_dtype: str = "f4", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots, self.park_dtype = slots, park_dtype
        self.parked: bytes | None = None  # the part's state between rounds
        self.held_slot = False
        self.kept: list[tuple[str, Any]] = []  # messages for the parked part

    @property
    def loaded(self) -> bool:
        return self.part is not None or self.parked is not None

    def reset(self) -> None:
        super().reset()
        self.parked, self.kept = None, []

    def state(self) -> dict[str, Any]:
        """Parked, the part's state is its bytes as they are (a resumed sim parks it again)."""
        if self.parked is None:
            return super().state()
        return {"method": self.key[0], "config": self.key[1], "parked": self.parked}

    def restore(self, state: Any) -> None:
        if "parked" not in state:
            super().restore(state)
            return
        self.part, self.key, self.parked = None, (state["method"], dict(state["config"])), state["parked"]

    def begin_round(self) -> bool:
        """Wait for a slot (False when stopped meanwhile), then take the part back."""
        while not self.held_slot:
            if self.slots.acquire(timeout=SLOT_POLL_S):
                self.held_slot = True
            elif self.stopped is not None and self.stopped.is_set():
                return False
        if self.parked is not None:
            method, config = self.key
            self.restore({"method": method, "config": config, "part": snapshot.loads(self.parked)})
            self.parked = None
        return True

    def end_round(self) -> None:
        """Keep the part's state as bytes, drop the part, free the slot."""
        if self.part is not None:
            state = self.part.resume_state()
            self.parked = snapshot.dumps(snapshot.cast_floats(state, "f2") if self.park_dtype == "f2" else state)
            self.part = state = None
            trim()  # the dropped part's memory back to the system, not kept in malloc's arenas
        if self.held_slot:
            self.held_slot = False
            self.slots.release()

    def hold(self, event: tuple[str, Any]) -> bool:
        """Keep a message for the parked part. A latest-value one (a slot: each new model
        version) replaces the one kept from the same topic, so a device sitting out rounds
        (client sampling) holds one model, not one per round."""
        if self.parked is None:
            return False
        if is_slot(event[0]):
            self.kept = [e for e in self.kept if e[0] != event[0]]
        self.kept.append(event)
        return True

    def held(self) -> list[tuple[str, Any]]:
        kept, self.kept = self.kept, []
        return kept

    def kept_for_part(self) -> list[tuple[str, Any]]:
        return list(self.kept)

    def keep_for_part(self, events: list[tuple[str, Any]]) -> None:
        self.kept = list(events)


class SlottedHost(PartHost):
    """An edge's part, aggregating only while it holds one of the sim's shared slots."""

    def __init__(self, *args: Any, slots: threading.Semaphore, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = slots

    def working(self) -> ContextManager[Any]:
        return self.slots if self.slots is not None else contextlib.nullcontext()
