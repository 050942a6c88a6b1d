"""A node's method part, hosted: built for the announced method, kept, reconfigured or replaced.

Every role holds at most one part. A round announcement names the method and its wire config;
`ensure` keeps the part when they are unchanged, hands it the new settings when only settings
changed (same method, same model), and builds a new one otherwise. A new session drops it.
`state` and `restore` carry the part (what it declares it saves) with the method and config
it was built with, so a restarted edge or cloud, or a device parked by a simulation, takes up
exactly where it was.

The round hooks (`begin_round`, `end_round`, `hold`, `working`) do nothing here: a simulation
wraps a host to share training slots between thousands of virtual devices (splitedge/sim/virtual.py),
and the runtimes call the hooks without knowing whether anyone listens.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, ContextManager, Generic, TypeVar

import numpy as np

from splitedge.methods.contract import Method, Part, Unsupported
from splitedge.protocol.plugins import HINT, NotInstalled
from splitedge.methods.registry import create_method

log = logging.getLogger(__name__)


class Misfit(ValueError):
    """The node can never take part in this run (e.g. its data does not fit the model)."""


P = TypeVar("P", bound=Part)
"""The part a host keeps: a tier's (DevicePart, EdgePart, CloudPart)."""


class PartHost(Generic[P]):
    """`build(method)` makes the part; `vet(method)` may raise Misfit before it is built;
    `stopped` is the node's stop flag (a host that waits, e.g. for a simulation's training
    slot, gives up when it is set)."""

    def __init__(self, build: Callable[[Method], P], *, rng: np.random.Generator | None = None,
                 vet: Callable[[Method], None] | None = None, stopped: threading.Event | None = None,
                 name: str = "node") -> None:
        self.build, self.rng, self.vet, self.stopped, self.name = build, rng, vet, stopped, name
        self.part: P | None = None
        self.key: tuple[str, dict] | None = None  # (method, wire config) the part was built with

    @property
    def loaded(self) -> bool:
        """A method is loaded (its kinds are registered, so its messages decode)."""
        return self.part is not None

    def ensure(self, method: str, config: Mapping[str, Any]) -> str:
        """The part for `method` with `config`: "kept", "reconfigured", "built" or "replaced".
        ValueError when the config cannot be used; Misfit when this node cannot take part."""
        wanted = (method, dict(config))
        if self.part is not None and self.key == wanted:
            return "kept"
        try:
            built = create_method(method, config)
        except NotInstalled as exc:
            raise Misfit(f"{exc}: {HINT}") from exc
        if self.vet is not None:
            self.vet(built)
        if self.part is not None and self.key[0] == method and self.part.spec == built.spec:
            self.part.reconfigure(built)
            outcome = "reconfigured"
        else:
            outcome = "replaced" if self.part is not None else "built"
            try:
                self.part = self.build(built)
            except Unsupported as exc:
                raise Misfit(str(exc)) from exc
            except NotInstalled as exc:  # a model this install lacks (models/registry.py)
                raise Misfit(f"{exc}: {HINT}") from exc
            except ModuleNotFoundError as exc:  # a thin install asked for a torch part: every round would fail
                needed = (exc.name or "a module").split(".")[0]
                raise Misfit(f"{method}'s {self.name.split()[0]} part needs {needed}, which this install lacks: "
                             f"pip install 'splitedge[all]'") from exc
        self.key = wanted
        return outcome

    def reset(self) -> None:
        """A new session: forget the part."""
        self.part = self.key = None

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The part's declared state with the method and config it was built with."""
        return {"method": self.key[0], "config": self.key[1], "part": self.part.resume_state()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """A part rebuilt from `state()`'s data. Building draws from the node's rng (model
        init); those draws are not the rounds', so the rng is put back as it was."""
        kept = self.rng.bit_generator.state if self.rng is not None else None
        self.part, self.key = self.build(create_method(state["method"], state["config"])), (
            state["method"], dict(state["config"]))
        self.part.restore_state(state["part"])
        if kept is not None:
            self.rng.bit_generator.state = kept

    # -- round hooks (a simulation overrides them) --------------------------------------------
    def begin_round(self) -> bool:
        """Before a round's work: False when the node was stopped while waiting for it."""
        return True

    def end_round(self) -> None:
        """After a round's work (done or failed): a device's round, an edge's or the cloud's
        aggregation, once what the round reports was read off the part."""

    def hold(self, event: tuple[str, Any]) -> bool:
        """True when the host keeps a message for the part until the next round."""
        return False

    def held(self) -> list[tuple[str, Any]]:
        """Messages kept by `hold`, in order, to handle now that the part is back."""
        return []

    def kept_for_part(self) -> list[tuple[str, Any]]:
        """The messages `hold` keeps now, without giving them up (the node's saved state)."""
        return []

    def keep_for_part(self, events: list[tuple[str, Any]]) -> None:
        """Hold `events` again, as saved by `kept_for_part` (a resumed node)."""

    def working(self) -> ContextManager[Any]:
        """Around an edge's aggregation (sampling and training)."""
        return contextlib.nullcontext()
