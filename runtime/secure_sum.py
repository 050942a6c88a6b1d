"""Secure aggregation inside a round: an edge learns only the sum of its devices' statistics.

With the run's `secagg` setting on ("full": Bonawitz et al.'s SecAgg, every pair of devices
masks; "plus": SecAgg+, each device masks with 2 ceil(log2 n) neighbours), a device does not
publish the statistics its part yields (`moments`; head statistics in a calibration phase).
It turns them into their sums over every class (methods/privacy/additive.py) and runs the four
exchanges of methods/privacy/secagg.py with its edge, each one `secagg` message up and the
edge's reply down (matched by `batch`, the exchange's number):

    batch 0  keys    -> roster   (to every device)    the devices whose keys arrived (SecAgg+:
                                                       each device its own, with its neighbours' keys)
    batch 1  shares  -> inbox    (to each device)     the encrypted shares meant for it
    batch 2  masked  -> unmask   (to every device)    who is in the sum, who dropped out
   (batch 4  signed  -> signatures (to every device)  signed federations: the consistency round)
    batch 3  reveal                                    shares to remove the masks

In a signed federation (nodes with --sign-key and --verify-keys) every secure sum is the
authenticated form (methods/privacy/identity.py): keys signed and checked, and the consistency
round (batch 4) before anyone reveals, so an edge that deviates from the protocol cannot swap a
device's keys or unmask one device's input alone. Its edge must be signed too.

The edge closes each exchange when every device of the round has answered (or finished its
round without it), or at the latest: the keys half the round's deadline after the phase began
(devices may still be training), the later exchanges three tenths of it between them. A device that misses one
is a dropout, which the shares of the others cover. It then hands its part one message of the
summed statistics from a pseudo device `<edge>~sum`, checked like a device's against the
contributors' announced samples. If too few devices remain it aborts (every waiting device
hears it) and the round goes on without these statistics: never a wrong sum.

A peer's `secagg` message is validated (messages.py) before it touches the aggregation; a bad
one is refused by rule `secagg.<exchange>`, counted, and changes nothing.

Who a sum is over is not the edge's choice (methods/privacy/roster.py): the cloud names each
edge's devices in its round plan (`directives.secagg_members`, signed by the cloud in a signed
federation), and before it sends any share a device checks that plan's signature, that the
roster it got is within those devices, holds no edge and (signed) only keys of role device, and
is at least the run's minimum (`secagg_min_devices`, `dp_devices`); the threshold and quorum
follow from the membership. A value it revealed into one sum goes into another only over the
same devices. A refusal fails the device's round in one logged line and is counted
(`secagg.refused`) with the node's other refusals.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from splitedge.methods.calibration import HEAD_STATS
from splitedge.methods.calibration.stats import HeadStats, cov_form, head_stats_arrays
from splitedge.methods.contract import CHILDREN, SUM_SUFFIX, Message, RoundFailed, RoundPlan, RoundReport, device
from splitedge.methods.moments import WIRE_DTYPES, ClassMoments, moments_to_body
from splitedge.methods.privacy import additive, distributed, roster as rosters
from splitedge.methods.privacy.dp import SECONDS, NoisySums, class_means_from, head_stats_from, moments_from
from splitedge.methods.privacy.errors import SecAggError
from splitedge.protocol.codec import Envelope
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

KIND = "secagg"
UP = ("keys", "shares", "masked", "reveal", "signed")
DOWN = {0: "roster", 1: "inbox", 2: "unmask", 4: "signatures"}
CONSISTENCY = 4
"""The batch of the consistency round (signed federations), between `unmask` and `reveal`."""
ABORT = "abort"
KEYS_FRACTION = 0.5
"""The first exchange (keys) waits for devices still training, up to this share of the round's
deadline from the phase's start; every device that has not finished its round is waited for."""
STAGES_FRACTION = 0.3
"""The later exchanges (answered at once, nothing is computed between) share at most this part
of the round's deadline equally (a tenth each, three quarters of that with the consistency
round); with the keys' half, an edge's sums end within its 0.8 of the deadline."""
SUMMED = ("moments", "arrays", "weights", "logits")
"""The kinds a secure sum may carry (methods/privacy/additive.py has their sum forms)."""


def _secagg() -> Any:
    """methods/privacy/secagg.py, which needs `cryptography`: imported only by a run with secagg
    on, so a thin device without it still runs every other run."""
    from splitedge.methods.privacy import secagg

    return secagg


def unavailable() -> str | None:
    """Why this process cannot take part in a secure sum (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("cryptography") is None:
        return "secure aggregation (secagg) needs the cryptography package: pip install 'splitedge[sign]'"
    return None


def secured(part: Any, msg: Message) -> bool:
    """Whether a device part's message goes only inside a secure sum in this run: a kind the
    part declares summable (`DevicePart.secure_kinds`), or a head-statistics record."""
    if part.cfg.secagg == "off":
        return False
    return msg.kind in part.secure_kinds or (msg.kind == "arrays" and msg.body.get("name") == HEAD_STATS)


def sum_name(msg: Message) -> str:
    """Which of a phase's secure sums a message goes into: its kind and what it is of (e.g.
    `moments.wc`, `weights.wc`, `arrays.head_stats`); each is a separate aggregation."""
    what = msg.body.get("space") if msg.kind == "moments" else msg.body.get("part") if msg.kind == "weights" \
        else "mean" if msg.kind == "logits" else msg.body.get("name")
    return f"{msg.kind}.{what}"


def identity_of(transport: Any) -> Any:
    """The node's identity for secure sums (None: an unsigned federation). identity.py needs
    `cryptography`, imported only when the node signs (a thin device may lack it)."""
    if getattr(transport, "signer", None) is None:
        return None
    from splitedge.methods.privacy.identity import of_transport

    return of_transport(transport)


def agreement(cfg: Any, run: str, session: str, plan: RoundPlan, edge: str, name: str) -> Any:
    """What every party of one aggregation agrees on: a session string never used twice (run,
    cloud incarnation and its attempt, round, phase, edge, sum), SecAgg's or SecAgg+'s graph,
    the devices the cloud named for this edge (the threshold follows from their number) and the
    fewest a roster may hold (SecAggError: the plan's membership is malformed)."""
    label = f"{run}/{session}/{plan.attempt}/{plan.round}/{plan.phase}/{edge}/{name}".encode()
    membership = rosters.Membership.of_plan(plan)
    least = rosters.minimum(cfg) if membership is None else max(rosters.minimum(cfg), membership.least)
    return _secagg().SecAggConfig(session=label, neighbours=None if cfg.secagg == "full" else "log",
                                  min_survivors=distributed.min_survivors(cfg), min_devices=least,
                                  members=() if membership is None else membership.of(edge))


RELEASE_SECONDS = {"moments": ("class",), "prototypes": ("none",), "logits": ("none",), "arrays": ("full", "diag")}
"""The second-moment form of the raw release each statistics message stands for (distributed DP)."""


def meta_of(msg: Message, moments_per: str = "sample", shared_dp: bool = False) -> dict[str, Any]:
    """What travels beside a device's masked arrays in the clear (the kind, its feature space and
    model versions, its dtype), which every device of the sum must share."""
    body = msg.body
    if msg.kind == "logits":
        return {"kind": "logits", "versions": dict(body.get("versions", {})),
                "dtype": np.asarray(body["logits"]).dtype.str}
    if msg.kind == "weights":
        meta = {"kind": "weights", "part": body["part"], "version": int(body["version"]),
                "dtypes": {name: np.asarray(a).dtype.str for name, a in body["weights"].items()}}
        return {**meta, "alike": True} if shared_dp else meta
    if msg.kind == "moments":
        return {"kind": "moments", "space": body["space"], "versions": dict(body.get("versions", {})),
                "dtype": np.asarray(body["mean"]).dtype.str, "per": moments_per}
    mean = np.asarray(body["arrays"]["mean"])
    return {"kind": "arrays", "name": body["name"], "version": int(body["version"]), "dtype": mean.dtype.str,
            "cov": cov_form(body["arrays"]["cov"], mean.shape[1])}


def sums_of(msg: Message, num_classes: int, moments_per: str = "sample", *, shared_dp: bool = False,
            release: NoisySums | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A device message as the arrays it masks and their meta_of. `moments_per`: the part's
    (DevicePart.moments_per): "device" sums prototypes. `shared_dp`: the devices share the DP
    noise (methods/privacy/distributed.py): weights are summed with each device alike, and a
    statistics message is replaced by the raw `release` it was made from (SecAggError without
    one: its post-processed body must not go into the sum)."""
    body, meta = msg.body, meta_of(msg, moments_per, shared_dp)
    if msg.kind == "weights":
        return additive.weights_sums(body, alike=shared_dp), meta
    if shared_dp:
        what = "prototypes" if msg.kind == "moments" and moments_per == "device" else msg.kind
        if release is None or release.second not in RELEASE_SECONDS.get(what, ()):
            raise SecAggError(f"a {msg.kind} message of a run whose devices share the DP noise has no raw release "
                              f"to sum in its place: nothing is sent")
        values, meta["dp"] = distributed.release_sums(release)
        return values, meta
    if msg.kind == "logits":
        return additive.logits_sums(body, num_classes), meta
    if msg.kind == "moments":
        if moments_per == "device":
            return additive.prototype_sums(body, num_classes), meta
        return additive.moments_sums(body, num_classes), meta
    return additive.head_stats_sums(body["arrays"], num_classes), meta


@dataclasses.dataclass(frozen=True)
class SharedNoise:
    """What an edge needs to post-process a sum whose devices shared the DP noise
    (methods/privacy/distributed.py): the run's sigma and dp_devices, the devices in the sum,
    the run's minimum count per class, the samples its contributors announced (None: unknown),
    and the clips a release may be of (the run's dp_clip and dp_head_clip)."""

    sigma: float
    share: int
    devices: int
    min_count: int
    samples: int | None = None
    clips: tuple[float, ...] = ()

    @classmethod
    def of_run(cls, cfg: Any) -> SharedNoise:
        """The run's part (`devices` and `samples` are each sum's: SecureSum fills them in)."""
        return cls(cfg.dp_sigma, int(cfg.dp_devices), 0, int(cfg.min_class_count), None,
                   (float(cfg.dp_clip), float(cfg.dp_head_clip)))


Statistics = ClassMoments | HeadStats | tuple[np.ndarray, np.ndarray, np.ndarray]


def _private_statistics(meta: Mapping[str, Any], sums: Mapping[str, np.ndarray], noise: SharedNoise) -> Statistics:
    """A sum of raw releases post-processed as dp.py does one release, then fitted to the run's
    minimum count and the contributors' samples (distributed.fitted): costs no privacy."""
    noisy = distributed.sum_release(sums, meta["dp"], sigma=noise.sigma, share=noise.share, devices=noise.devices)

    def fit(classes: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return distributed.fitted(classes, counts, noise.min_count, noise.samples)

    if meta["kind"] == "arrays":
        h = head_stats_from(noisy)
        rows, counts = fit(h.classes, h.counts)
        return HeadStats(h.classes[rows], counts, h.mean[rows], h.cov)
    if meta["kind"] == "moments" and meta.get("per") != "device":
        m = moments_from(noisy)
        rows, counts = fit(m.classes, m.counts)
        return ClassMoments(m.classes[rows], counts, m.mean[rows], m.var[rows])
    classes, counts, means = class_means_from(noisy)
    rows, counts = fit(classes, counts)
    if meta["kind"] == "logits":
        return classes[rows], counts, means[rows]
    return ClassMoments(classes[rows], counts, means[rows], np.zeros_like(means[rows]))  # FedProto's prototypes


def _statistics(meta: Mapping[str, Any], sums: Mapping[str, np.ndarray], noise: SharedNoise | None) -> Statistics:
    """The statistics a sum stands for: the union's, or (devices sharing the DP noise) the
    post-processed sum of their releases."""
    if "dp" in meta:
        if noise is None:
            raise SecAggError("the devices summed raw DP releases, which this run does not expect")
        return _private_statistics(meta, sums, noise)
    if noise is not None:
        raise SecAggError("the devices summed post-processed statistics where their raw DP releases were due")
    if meta["kind"] == "logits":
        return additive.logits_of_sums(sums)
    if meta["kind"] == "moments":
        return additive.prototypes_of_sums(sums) if meta.get("per") == "device" else additive.moments_of_sums(sums)
    return additive.head_stats_of_sums(sums)


def body_of(meta: Mapping[str, Any], sums: Mapping[str, np.ndarray],
            noise: SharedNoise | None = None) -> tuple[str, dict[str, Any]] | None:
    """The (kind, body) the edge's part takes from summed arrays; None when no class is in it.
    `noise`: the devices shared the DP noise of their statistics (not of weights, which carry
    their noise in the clear form)."""
    if meta.get("kind") == "weights":
        total, weights = additive.weights_of_sums(sums, meta["dtypes"])
        return "weights", {"part": str(meta["part"]), "version": int(meta["version"]), "samples": total,
                           "weights": weights}
    wire = next((name for name, dtype in WIRE_DTYPES.items() if dtype.str == meta.get("dtype")), None)
    if wire is None:
        raise SecAggError(f"the sums are of dtype {meta.get('dtype')!r}, not a wire float")
    stats = _statistics(meta, sums, noise)
    if meta["kind"] == "logits":
        classes, counts, logits = stats
        if not len(classes):
            return None
        return "logits", {"classes": classes, "counts": counts, "logits": logits.astype(WIRE_DTYPES[wire]),
                          "versions": dict(meta["versions"])}
    if not len(stats.classes):
        return None
    if meta["kind"] == "moments":
        return "moments", moments_to_body(stats, dtype=wire, space=str(meta["space"]),
                                          versions=dict(meta["versions"]))
    return "arrays", {"name": str(meta["name"]), "version": int(meta["version"]),
                      "arrays": head_stats_arrays(stats, wire, str(meta["cov"]))}


# -- a device ---------------------------------------------------------------------------------

Request = Callable[[Message, str, float], Envelope]
REFUSED = "secagg.refused"
"""The rule a device counts a secure sum it refused under (a roster the edge chose, a resend)."""
_LEDGERS: "weakref.WeakKeyDictionary[Any, rosters.Contributions]" = weakref.WeakKeyDictionary()
_LEDGERS_BY_ID: dict[tuple[str, str], rosters.Contributions] = {}


def _node_of(request: Request) -> Any:
    """The device whose exchange `request` is (runtime/exchange.py), or None."""
    return getattr(getattr(request, "__self__", None), "node", None)


def ledger_of(request: Request, run: str, node_id: str) -> rosters.Contributions:
    """The device's record of what it summed with whom (kept as long as the device lives)."""
    node = _node_of(request)
    if node is not None:
        try:
            return _LEDGERS.setdefault(node, rosters.Contributions())
        except TypeError:
            pass
    return _LEDGERS_BY_ID.setdefault((run, node_id), rosters.Contributions())


def check_plan(plan: RoundPlan, *, cfg: Any, run: str, node_id: str, edge: str,
               identity: Any = None) -> tuple[tuple[str, ...] | None, int, set[str]]:
    """(the devices the cloud named for `edge`, None when the plan names none; the fewest a sum
    may hold; the ids that are not devices) after the checks a device makes before its keys go
    out: in a signed federation the membership must be there and signed by a key of role cloud;
    this device must be a member, with at least the minimum, and no edge among them.
    SecAggError (refused) otherwise."""
    membership = rosters.Membership.of_plan(plan)
    least = rosters.minimum(cfg) if membership is None else max(rosters.minimum(cfg), membership.least)
    if identity is not None:
        if membership is None:
            raise SecAggError(f"device {node_id}: refused: the round plan names no devices for the secure sums, and "
                              f"this device is in a signed federation (the cloud names and signs them)")
        membership.verify(identity, run, plan)
    if membership is None:
        return None, least, {edge}
    if membership.mode != cfg.secagg:
        raise SecAggError(f"device {node_id}: refused: the membership is for secagg {membership.mode}, the plan's "
                          f"config says {cfg.secagg}")
    not_devices = {edge, *membership.members}
    members = rosters.check_members(node_id, edge, membership.of(edge), least, identity=identity,
                                    not_devices=not_devices)
    return members, least, not_devices


def secure_send(msg: Message, *, cfg: Any, run: str, session: str, plan: RoundPlan, node_id: str, edge: str,
                num_classes: int, request: Request, publish: Callable[[Message], Any],
                moments_per: str = "sample", release: NoisySums | None = None, identity: Any = None) -> None:
    """Run the four exchanges for one device message (`request`: publish and wait for the edge's
    reply, runtime/exchange.py); five with an `identity` (identity_of). `release`: the raw DP
    release the message was made from, what goes into the sum when the devices share the noise
    (sums_of). An edge's abort, a broken exchange or a reply that never comes fail the device's
    round with RoundFailed: one logged line that names the sum and the edge, not a traceback."""
    secagg, name = _secagg(), sum_name(msg)
    ledger = ledger_of(request, run, node_id)
    exchange = _exchanger(request, name, edge, plan.deadline_s)
    try:
        values, meta = sums_of(msg, num_classes, moments_per, shared_dp=distributed.shares_noise(cfg), release=release)
        members, least, not_devices, value = _before_keys(name, values, meta, plan, cfg=cfg, run=run, node_id=node_id,
                                                          edge=edge, identity=identity, ledger=ledger)
        me = secagg.Device(node_id, agreement(cfg, run, session, plan, edge, name), identity)
        roster = secagg.KeyRoster.from_body(exchange(0, me.advertise_keys().to_body()))
        try:  # the roster the edge sent, before any share leaves the device
            rosters.check_members(node_id, edge, roster.devices, least, identity=identity, not_devices=not_devices)
            if members is not None:
                rosters.check_roster(node_id, roster.devices, members)
            ledger.before_keys(node_id, value, roster.devices)
            shares = me.share_keys(roster)
        except SecAggError as exc:
            raise _Refused(str(exc)) from None
        inbox = secagg.ShareInbox.from_body(exchange(1, shares.to_body()))
        request_ = secagg.UnmaskRequest.from_body(exchange(2, me.masked_input(inbox, values).to_body(), {"meta": meta}))
        try:  # the sum's devices, before this device signs or reveals anything
            ledger.before_reveal(node_id, value, request_.ids(roster.devices)[0])
        except SecAggError as exc:
            raise _Refused(str(exc)) from None
        signed = None if identity is None else \
            secagg.SignedSurvivors.from_body(exchange(CONSISTENCY, me.sign_request(request_).to_body()))
        publish(Message(KIND, {"stage": UP[3], "batch": 3, "sum": name, "data": me.unmask(request_, signed).to_body()}))
    except _Refused as exc:
        _count_refused(request)
        raise RoundFailed(f"refused the secure sum of {name} with edge {edge}: {exc}") from None
    except (SecAggError, TimeoutError) as exc:
        raise RoundFailed(f"the secure sum of {name} with edge {edge} failed: {str(exc) or type(exc).__name__}") \
            from exc


def _count_refused(request: Request) -> None:
    """Count a refused sum with the device's other refusals (REFUSED)."""
    node = _node_of(request)
    if node is not None and hasattr(node, "refused"):
        node.refused[REFUSED] += 1


def _exchanger(request: Request, name: str, edge: str, wait: float) -> Callable[..., Any]:
    """One exchange of the sum `name` with the edge: its stage up, the edge's reply's data (an
    abort is a SecAggError)."""

    def exchange(batch: int, data: dict[str, Any], extra: Mapping[str, Any] | None = None) -> Any:
        reply = request(Message(KIND, {"stage": UP[batch], "batch": batch, "sum": name, "data": data,
                                       **(extra or {})}), KIND, wait)
        if reply.body["stage"] == ABORT:
            raise SecAggError(f"edge {edge} aborted the secure sum: {reply.body['data'].get('reason', '')}")
        return reply.body["data"]

    return exchange


def _before_keys(name: str, values: Mapping[str, np.ndarray], meta: Mapping[str, Any], plan: RoundPlan, *,
                 cfg: Any, run: str, node_id: str, edge: str, identity: Any,
                 ledger: rosters.Contributions) -> tuple[Any, int, set[str], Any]:
    """The checks before anything leaves the device (check_plan, the differencing ledger):
    (members, the fewest a sum may hold, the ids that are not devices, the value's digest);
    _Refused otherwise."""
    try:
        members, least, not_devices = check_plan(plan, cfg=cfg, run=run, node_id=node_id, edge=edge,
                                                 identity=identity)
        value = rosters.value_digest(name, meta, values)
        if members is not None:
            ledger.before_keys(node_id, value, members)
    except SecAggError as exc:
        raise _Refused(str(exc)) from None
    return members, least, not_devices, value


class _Refused(Exception):
    """A secure sum this device refuses to take part in (counted as REFUSED)."""


# -- an edge ----------------------------------------------------------------------------------

class SecureSum:
    """An edge's aggregation for one phase of one round: the SecAgg server, the deadline of the
    open exchange, and the summed message once it is done."""

    def __init__(self, edge: str, plan: RoundPlan, config: Any, devices: set[str], name: str = "",
                 settled: Callable[[], set[str]] = set, clock: Callable[[], float] = time.monotonic,
                 keys_until: float | None = None, noise: SharedNoise | None = None,
                 announced: Callable[[tuple[str, ...]], int | None] = lambda devices: None,
                 identity: Any = None) -> None:
        self.edge, self.plan, self.clock, self.settled, self.name = edge, plan, clock, settled, name
        self.noise = noise  # the run's, when devices share the DP noise (SharedNoise.of_run)
        self.announced = announced  # the samples devices announced, which the post-processed counts respect
        self.keys_until = clock() + plan.deadline_s * KEYS_FRACTION if keys_until is None else keys_until
        secagg = _secagg()
        self.server = secagg.Server(config, devices, identity)
        self.up_types = (secagg.AdvertiseKeys, secagg.EncryptedShares, secagg.MaskedInput, secagg.UnmaskShares,
                         secagg.ConsistencySignature)
        self.receive = ("receive_keys", "receive_shares", "receive_masked", "receive_unmask", "receive_signature")
        self.devices = set(devices)
        self.stage_s = plan.deadline_s * STAGES_FRACTION / (3 if identity is None else 4)
        self.opened = clock()
        self.meta: dict[str, Any] | None = None
        self.result: tuple[str, dict[str, Any]] | None = None  # (kind, body) of the summed message
        self.contributors: tuple[str, ...] = ()
        self.failed = ""
        self.started = False  # a device's keys arrived: this phase has something to sum

    @property
    def busy(self) -> bool:
        """Still collecting: the round must not close before the sum is in (or has failed). A
        phase in which no device sent keys (nothing to sum) never holds the round."""
        return self.started and self.result is None and not self.failed

    def on_message(self, env: Envelope) -> list[Message]:
        """A device's `secagg` message: ProtocolError (refused, counted) when it does not fit."""
        body = env.body
        batch = int(body["batch"])
        if batch == 0 and not self.started and self.result is None and not self.failed:
            self.started, self.opened = True, self.clock()
        if batch == 3 and self.result is not None and env.sender in self.server.survivors:
            return []  # a survivor's shares after the sum was rebuilt from the others': expected, not refused
        if batch == CONSISTENCY and self.server.signers and env.sender in self.server.survivors:
            return []  # a survivor's signature after the quorum was forwarded: late, not wrong
        if not self.busy or batch != self.open_batch or body["stage"] != UP[batch]:
            raise ProtocolError(f"secagg.{body['stage']}", f"{body['stage']} while exchange {self.open_batch} "
                                                           f"is open" if self.busy else "the secure sum is closed")
        try:
            msg = self.up_types[batch].from_body(body["data"])
            if msg.device != env.sender:
                raise SecAggError(f"a message of {msg.device} sent by {env.sender}")
            if batch == 2:
                self._check_meta(body.get("meta"))
            getattr(self.server, self.receive[batch])(msg)
        except (SecAggError, ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"secagg.{UP[batch]}", str(exc)) from None
        return self.advance()

    @property
    def open_batch(self) -> int:
        """The exchange whose messages the edge takes now (the consistency round inside stage 3)."""
        return CONSISTENCY if self.server.signing else self.server.stage

    def _check_meta(self, meta: Any) -> None:
        """Every masked input must be of the same kind, space, versions and dtype; when the
        devices share the DP noise, a statistic must be a raw release (distributed.py)."""
        if not isinstance(meta, Mapping):
            raise SecAggError("the masked input carries no description of what it sums")
        if meta.get("kind") != "weights" and ("dp" in meta) != (self.noise is not None):
            raise SecAggError("a raw DP release where this run sums statistics" if "dp" in meta else
                              "post-processed statistics where this run's devices share the DP noise of raw releases")
        form = meta.get("dp")
        if form is not None and (not isinstance(form, Mapping) or form.get("second") not in SECONDS
                                 or form.get("clip") not in self.noise.clips):
            raise SecAggError(f"a raw DP release of form {form!r}: not a second moment form and one of the run's clips")
        if self.meta is None:
            self.meta = dict(meta)
        elif dict(meta) != self.meta:
            raise SecAggError(f"sums {dict(meta)} where the others sum {self.meta}")

    def tick(self) -> list[Message]:
        """Close the open exchange once its time is up, or once every device it waits for has
        finished its round without answering (it has nothing to add)."""
        if not self.busy:
            return []
        now = self.clock()
        late = now >= self.keys_until if self.server.stage == 0 else now - self.opened >= self.stage_s
        return self.advance(force=late)

    def advance(self, force: bool = False) -> list[Message]:
        """Close the open exchange when everyone answered (or `force`) and send what follows."""
        s = self.server
        try:
            if s.signing:
                if s.waiting_for() - self.settled() and not force:
                    return []
                self.opened = self.clock()
                return [self._down(CONSISTENCY, s.signed_survivors().to_body(), CHILDREN)]
            if s.stage == 3:
                if s.missing():
                    return [] if not force else self._abort(f"too few shares: {', '.join(s.missing()[:3])}")
                return self._finish()
            if s.waiting_for() - self.settled() and not force:
                return []
            self.opened = self.clock()
            if s.stage == 0:
                whole = s.roster()  # closes round 0: the graph is known from here
                assert s.graph is not None
                if s.graph.complete:  # SecAgg: every device needs every key
                    return [self._down(0, whole.to_body(), CHILDREN)]
                return [self._down(0, s.roster(d).to_body(), device(d)) for d in s.devices]
            if s.stage == 1:
                return [self._down(1, box.to_body(), device(d)) for d, box in sorted(s.route_shares().items())]
            return [self._down(2, s.unmask_request().to_body(), CHILDREN)]
        except SecAggError as exc:
            return self._abort(str(exc))

    def _down(self, batch: int, data: dict[str, Any], to: Any) -> Message:
        return Message(KIND, {"stage": DOWN[batch], "batch": batch, "sum": self.name, "data": data}, to=to)

    def _abort(self, reason: str) -> list[Message]:
        self.failed = reason
        log.warning("edge %s: secure sum of round %d (%s) aborted: %s", self.edge, self.plan.round, self.plan.phase,
                    reason)
        batch = CONSISTENCY if self.server.signing else min(self.server.stage, 2)
        return [Message(KIND, {"stage": ABORT, "batch": batch, "sum": self.name, "data": {"reason": reason[:200]}},
                        to=CHILDREN)]

    def _finish(self) -> list[Message]:
        result = self.server.finish()
        self.contributors = result.devices
        noise = None if self.noise is None else dataclasses.replace(
            self.noise, devices=len(result.devices), samples=self.announced(result.devices))
        try:
            built = body_of(self.meta or {}, result.sums, noise)
        except (KeyError, TypeError, ValueError) as exc:
            raise SecAggError(f"the sum does not decode: {exc}") from None
        if built is None:
            self.failed = "no class in the sum"
        self.result = built
        return []

    def report(self, run: str) -> RoundReport | None:
        """The summed message as a report of the pseudo device, for the part's merge."""
        if self.result is None:
            return None
        kind, body = self.result
        env = Envelope(kind=kind, run=run, round=self.plan.round, sender=self.edge + SUM_SUFFIX, body=body)
        report = RoundReport(env.sender, summed=True)
        report.messages[env.kind] = [env]
        return report

    def info(self) -> dict[str, Any]:
        """What the edge's `done` info says of it: devices summed, dropped, or why it failed."""
        out: dict[str, Any] = {"devices": len(self.contributors), "dropped": len(self.server.dropped)}
        if self.failed:
            out["failed"] = self.failed
        return out


MAX_SUMS = 8
"""Secure sums one phase may hold (one per kind of statistic or model part a device sends)."""


class SecureSums:
    """An edge's secure sums of one phase, one per `sum` name (runtime-level: a method's device
    may send moments and a W_c copy in one round); created by the first keys of each name."""

    def __init__(self, edge: str, plan: RoundPlan, cfg: Any, run: str, session: str, devices: set[str],
                 settled: Callable[[], set[str]] = set,
                 announced: Callable[[tuple[str, ...]], int | None] = lambda devices: None,
                 identity: Any = None) -> None:
        self.edge, self.plan, self.cfg, self.run, self.session = edge, plan, cfg, run, session
        self.identity = identity  # the edge's (identity_of its transport to the devices): signed sums
        try:  # the devices the cloud named for this edge: no other may join its sums
            membership = rosters.Membership.of_plan(plan)
        except SecAggError as exc:
            log.warning("edge %s: round %d's membership is unreadable (%s); its secure sums hold no device", edge,
                        plan.round, exc)
            membership = rosters.Membership({}, 0, "", None)
        if membership is not None:
            devices = set(devices) & set(membership.of(edge))
        self.devices, self.settled, self.announced = set(devices), settled, announced
        self.sums: dict[str, SecureSum] = {}
        self.keys_until = time.monotonic() + plan.deadline_s * KEYS_FRACTION  # from the phase's start

    def on_message(self, env: Envelope) -> list[Message]:
        name = env.body.get("sum")
        if not isinstance(name, str) or name not in self.sums and (
                env.body["batch"] != 0 or len(self.sums) >= MAX_SUMS or name.split(".")[0] not in SUMMED):
            raise ProtocolError(f"secagg.{env.body['stage']}", f"no secure sum {name!r} is open")
        if name not in self.sums:
            self.sums[name] = SecureSum(self.edge, self.plan, agreement(self.cfg, self.run, self.session, self.plan,
                                                                       self.edge, name),
                                        self.devices, name=name, settled=self.settled, keys_until=self.keys_until,
                                        noise=SharedNoise.of_run(self.cfg) if distributed.shares_noise(self.cfg)
                                        else None, announced=self.announced, identity=self.identity)
        return self.sums[name].on_message(env)

    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.sums.values())

    def tick(self) -> list[Message]:
        return [m for s in self.sums.values() for m in s.tick()]

    def reports(self, run: str) -> list[tuple[RoundReport, tuple[str, ...]]]:
        """Each finished sum as (a report of the pseudo device, its contributors)."""
        out = []
        for s in self.sums.values():
            report = s.report(run)
            if report is not None:
                out.append((report, s.contributors))
        return out

    def info(self) -> dict[str, Any]:
        return {name: s.info() for name, s in sorted(self.sums.items())}
