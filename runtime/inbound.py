"""Whether a decoded message may reach a node's part: the node's half of the inbound chain.

The transport's chain (protocol/inbound.py) judged the wire on the network thread. On the
node's own thread a message from a parent, a child or a peer then passes these steps in
order before the method's part sees it: drop it when it belongs to another incarnation of
the run (a cloud restarted without its state), refuse it when its counts exceed the samples
its sender announced, judge head statistics against the open calibration phase (the runtime
merges those; the part never sees them), and let the part refuse what does not fit the
federation (its `check`).
A refusal raises ProtocolError naming its rule: the node logs it and counts it by rule, and
the message never touches the part's state. Steps take `(message, next)` like the wire's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitedge.methods.calibration import is_head_stats
from splitedge.methods.calibration.layers import layer_names, selects
from splitedge.methods.calibration.records import check_heads, is_heads
from splitedge.methods.update_codec import decode_update
from splitedge.methods.checks import check_within_samples
from splitedge.methods.privacy.release import fit_to_allowance
from splitedge.protocol.codec import Envelope
from splitedge.protocol.errors import ProtocolError
from splitedge.protocol.schema import get_schema
from splitedge.runtime.allowance import Allowance
from splitedge.runtime.downlink import DownlinkBases

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inbound:
    """A message for a part: from its "parent", a "child" or a "peer"; `announced` is what a
    child may count (runtime/allowance.py: its hello, bounded by the operator's manifest; None
    when the sender announced nothing); `gate` what the
    open calibration phase's head statistics must fit (methods.calibration.records.Gate), None
    outside one."""

    env: Envelope
    source: str
    part: Any = None
    announced: Allowance | None = None
    gate: Any = None
    bases: Any = None  # the node's downlink bases (runtime/downlink.py), set by NodeInbound


Next = Callable[[Inbound], bool]
Step = Callable[[Inbound, Next], bool]


def within_announced(msg: Inbound, nxt: Next) -> bool:
    """A child may count no more samples than it may hold, and only of its classes. In a run
    with DP on, a child's per-class counts are a noisy release, which may exceed what it holds:
    they are fitted to its allowance first (post-processing with bounds public to this node,
    methods/privacy/release.py fit_to_allowance), then held to it like exact counts."""
    a = msg.announced
    if a is not None and getattr(getattr(msg.part, "cfg", None), "dp_sigma", 0) > 0:
        fit_to_allowance(msg.env.body, a.samples, a.class_counts)
    if a is not None:
        check_within_samples(msg.env.body, a.samples, classes=a.classes, class_counts=a.class_counts)
    return nxt(msg)


def head_statistics(msg: Inbound, nxt: Next) -> bool:
    """A child's head statistics fit the open calibration phase (its round, the classifier
    input's dimension, classes, dtype and covariance form); they end here, admitted or refused."""
    if not is_head_stats(msg.env):
        return nxt(msg)
    if msg.gate is None or msg.source != "child":
        raise ProtocolError("state.phase", "head statistics outside a calibration phase")
    msg.gate.check(msg.env)
    return True


def candidate_heads(msg: Inbound, nxt: Next) -> bool:
    """Candidate heads come from above, in a run that chooses its head's layer, one head per
    layer its config names, each of the run's classes; they end here, admitted or refused."""
    if not is_heads(msg.env):
        return nxt(msg)
    cfg, spec = msg.part.method.config, msg.part.method.spec
    if msg.source != "parent" or not selects(cfg):
        raise ProtocolError("state.phase", "candidate heads outside a run that chooses its head's layer")
    check_heads(msg.env.body, layer_names(cfg), spec.num_classes)
    return True


def unpack_update(msg: Inbound, nxt: Next) -> bool:
    """A compressed model becomes the dense weights it stands for before the part's own checks
    see it, so parts only ever see dense models; one the node cannot decode is refused.
    - From a child, an update: the global model the node relayed plus its delta
      (methods/update_codec.py).
    - From the parent, a model compressed against a base (runtime/downlink.py): the base the
      node holds plus the distance; a dense model that names itself as a base is kept as one."""
    body = msg.env.body
    if msg.env.kind != "weights":
        return nxt(msg)
    codec = body.get("codec") or "dense"
    if msg.source == "parent" and msg.bases is not None:
        if codec == "dense":
            if body.get("base") is not None and int(body["base"]) == int(body["version"]):
                msg.bases.note(body)
            body.pop("base", None)
            return nxt(msg)
        weights = msg.bases.decode(body)
        if weights is None:
            return False  # its base has not come (it brings this model along), or a newer base has
        body["weights"] = weights
    elif codec == "dense":
        return nxt(msg)
    elif msg.source != "child":
        raise ProtocolError("state.codec", "a compressed update comes from a child")
    else:
        reference = getattr(msg.part, "update_reference", lambda _: None)(body)
        body["weights"] = decode_update(body, reference)
    for key in ("codec", "scales", "indices", "base"):  # now a dense model, as any other
        body.pop(key, None)
    return nxt(msg)


def part_check(msg: Inbound, nxt: Next) -> bool:
    """The method's own rules: dimension, classes, model names and shapes, versions."""
    msg.part.check(msg.env, msg.source)
    return nxt(msg)


NODE_STEPS: tuple[Step, ...] = (within_announced, head_statistics, candidate_heads, unpack_update, part_check)
"""A node's inbound steps, in order (a compressed update is decoded before the part's checks)."""


class NodeInbound:
    """The node's chain: `admit(message)` is True when the part may take it. Refusals are
    counted by rule in `refused`, messages of another session in `foreign`."""

    def __init__(self, name: str, session: Callable[[], str], steps: Sequence[Step] = NODE_STEPS):
        self.name, self.session = name, session
        self.refused: Counter[str] = Counter()
        self.last_refusal: str | None = None  # the rule of the last message refused (None: it was admitted)
        self.foreign = 0
        self.bases = DownlinkBases()  # the models' bases this node's parent sent (runtime/downlink.py)
        chain: Next = lambda msg: True  # noqa: E731 - the end of the chain: admitted
        for step in reversed(steps):
            chain = (lambda s, n: lambda msg: s(msg, n))(step, chain)
        self._chain = chain

    def current(self, env: Envelope) -> bool:
        """False (and counted) for stateful messages of another incarnation of this run."""
        theirs = env.body.get("session", "") if carries_session(env.kind) else ""
        mine = self.session()
        if theirs and mine and theirs != mine:
            self.foreign += 1
            log.info("%s: dropped %s of session %s (current %s)", self.name, env.kind, theirs, mine)
            return False
        return True

    def admit(self, msg: Inbound) -> bool:
        self.last_refusal = None
        if not self.current(msg.env):
            return False
        if msg.part is None:  # no method loaded yet: nothing for the steps to judge against
            return True
        try:
            return self._chain(dataclasses.replace(msg, bases=self.bases))
        except ProtocolError as exc:
            self.refused[exc.rule] += 1
            self.last_refusal = exc.rule
            log.warning("%s: refused %s from %s [%s]: %s", self.name, msg.env.kind, msg.env.sender, exc.rule,
                        str(exc)[:300])
            return False


def carries_session(kind: str) -> bool:
    """Kinds whose schema has a `session` field carry state of one run incarnation: stamped
    with the session on the way out, dropped on the way in when of another incarnation."""
    try:
        return "session" in get_schema(kind).fields
    except ProtocolError:
        return False
