"""The strategy interface: a learning method is one part per tier; the runtimes own the loop.

A runtime (device, edge, cloud) owns messaging, addressing, membership, rounds, deadlines and
persistence. Each round it calls hooks of the active method's part for its tier and routes
whatever the hooks return. Parts never see MQTT: they receive decoded `Envelope`s and return
`Message`s addressed to a role (`UP`, `CHILDREN`, `DEVICES`, `PEERS`) or to one node or group
(`device(id)`, `edge(id)`, `peer(id)`, `group(name)`); they never choose topics or retain flags.

This module is torch-free so that a thin device can import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Generic, Iterator, Mapping, Sequence, TypeVar, cast

import numpy as np

from splitedge.methods.compute import CPU, Compute
from splitedge.methods.config import MethodConfig, ModelSpec, RunConfig
from splitedge.methods.kept import Kept, kept_fields, unset_fields
from splitedge.methods.errors import RoundFailed  # noqa: F401 - part of the contract (parts raise it)
from splitedge.methods.privacy.floor import ClassFloor

# -- addresses -------------------------------------------------------------------------------


@dataclass(frozen=True)
class To:
    """Where a message goes. `role` is one of ADDRESS_ROLES; `node` names the node or group."""

    role: str
    node: str | None = None


UP = To("up")
"""To the sender's parent: a device's edge, an edge's cloud."""
CHILDREN = To("children")
"""To every child: the cloud's edges, an edge's devices."""
DEVICES = To("devices")
"""From the cloud, to every device (each edge relays it to its own)."""
PEERS = To("peers")
"""From a device, to every one of its peer devices (its neighbours)."""


def device(node: str) -> To:
    """One device: from its edge, or from the cloud (relayed by the device's edge)."""
    return To("device", node)


def edge(node: str) -> To:
    """One edge, from the cloud."""
    return To("edge", node)


def peer(node: str) -> To:
    """One peer device, from a device."""
    return To("peer", node)


def group(name: str) -> To:
    """Every device in a group (e.g. a cluster), from the cloud or an edge."""
    return To("group", name)


@dataclass(frozen=True)
class Message:
    """Something a strategy wants sent; the runtime adds envelope, topic, QoS and retention.

    `slot` marks a latest-value message (a model version, a prototype table): the runtime keeps
    the newest one per slot for nodes that join late (a retained MQTT message), so each model
    part or table a method publishes gets its own slot name.
    """

    kind: str
    body: Mapping[str, Any]
    to: To = UP
    slot: str | None = None


DONE = object()
"""Yielded by a device part when the edge may close the device's round; later work is local."""


# -- rounds ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundSpec:
    """What a cloud part decides for a round: model versions in use and its directives."""

    versions: Mapping[str, int] = field(default_factory=dict)
    directives: Mapping[str, Any] = field(default_factory=dict)


PHASES = ("train", "calibrate", "evaluate")
"""A round's phases, in the order nodes work on them."""


@dataclass(frozen=True)
class RoundPlan:
    """The round announcement (body of the `round` message), built by the cloud runtime.

    `config` is the wire form of the run's RunConfig; `versions` names the model versions a
    node must hold before the round (whatever models the method versions); `directives` are
    the method's own instructions for this round (e.g. which parts are averaged).
    """

    round: int
    method: str
    deadline_s: float
    config: Mapping[str, Any]
    versions: Mapping[str, int] = field(default_factory=dict)
    directives: Mapping[str, Any] = field(default_factory=dict)
    session: str = ""
    stop: bool = False
    attempt: int = 0
    """How many times the cloud resumed this session after a crash: a node that already did
    round r under the dead cloud does it again when r is announced with a higher attempt."""
    phase: str = "train"
    """"train": the round's work; "calibrate": after it, devices send head statistics of the
    model they now hold and nothing else; "evaluate": then, where each device holds its own model
    (FedProto, CFLHKD's clusters), devices score the calibrated head they were sent on their
    held-out data (methods/calibration)."""
    participants: tuple[str, ...] = ()
    """The devices drawn for this round when the cloud samples (runtime/sampling.py); empty:
    every device."""

    def to_body(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body.pop("round")
        return body

    @classmethod
    def from_body(cls, round_: int, body: Mapping[str, Any]) -> "RoundPlan":
        return cls(round=round_, method=body["method"], deadline_s=body["deadline_s"], config=body["config"],
                   versions=dict(body["versions"]), directives=dict(body.get("directives") or {}),
                   session=body.get("session", ""), stop=bool(body.get("stop", False)),
                   attempt=int(body.get("attempt", 0)), phase=body.get("phase", "train"),
                   participants=tuple(body.get("participants") or ()))

    def takes_part(self, device_id: str) -> bool:
        """Whether `device_id` works on this round (every device, unless the cloud sampled)."""
        return not self.participants or device_id in self.participants

    @property
    def key(self) -> tuple[int, int, int]:
        """(round, attempt, phase): announcements are work in this order."""
        return self.round, self.attempt, PHASES.index(self.phase)

    @property
    def calibrating(self) -> bool:
        return self.phase == "calibrate"

    @property
    def evaluating(self) -> bool:
        return self.phase == "evaluate"

    def newer_than(self, other: "RoundPlan | None") -> bool:
        """Whether this announcement is work to do after `other`: a later round, the same round
        again from a cloud resumed after a crash (a higher attempt), or the round's calibration."""
        return other is None or self.key > other.key

    def version(self, name: str) -> int:
        """The announced version of model `name` (0 when the method does not version it)."""
        return int(self.versions.get(name, 0))


@dataclass(frozen=True)
class Placement:
    """Where a device sits: the edge it reports to, its groups and its peer devices."""

    edge: str
    groups: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()


class FederationView:
    """What the cloud knows of its federation (kept by the runtime, read by the cloud part)."""

    def __init__(self) -> None:
        self.members: dict[str, list[str]] = {}  # edge -> its devices, as the edge reported them
        self.placements: dict[str, Placement] = {}  # device -> last placement the cloud assigned

    @property
    def devices(self) -> dict[str, str]:
        """device -> the edge it reports to."""
        return {d: e for e, ds in sorted(self.members.items()) for d in ds}

    def placement(self, device_id: str) -> Placement:
        """The device's placement: the last one assigned, else where it joined."""
        return self.placements.get(device_id) or Placement(edge=self.devices.get(device_id, ""))


SUM_SUFFIX = "~sum"
"""The pseudo device an edge's securely summed statistics come from (`<edge>~sum`, runtime/secure_sum.py)."""


@dataclass
class RoundReport:
    """Everything one child sent in a round, in arrival order, grouped by kind."""

    sender: str
    messages: dict[str, list[Any]] = field(default_factory=dict)
    summed: bool = False
    """An edge's secure sum (runtime/secure_sum.py): the messages are sums over several devices,
    so a merge that weighs each device alike (FedProto) reads the per-class counts as devices."""

    def get(self, kind: str) -> Any:
        """The last message of `kind`, or None."""
        found = self.messages.get(kind)
        return found[-1] if found else None

    def all(self, kind: str) -> list[Any]:
        """Every message of `kind` (e.g. one `weights` message per model part)."""
        return list(self.messages.get(kind, ()))


Report = RoundReport


# -- parts -----------------------------------------------------------------------------------


Request = Callable[["Message", str, float], Any]
"""A device's `request(message, reply_kind, timeout)`: send up, block for the edge's reply."""
Gather = Callable[..., dict]
"""A device's `gather(kind, senders=None, timeout=60.0)`: this round's messages from its peers."""
TRAIN_CHUNK = 8
"""Samples a thin trainer's W_c step takes at a time by default (methods/thin/chunked.py): at 4 to
8 the step is fastest on this box (cache) and its peak ~9 MB for the cnn's 128 views."""


@dataclass(slots=True)
class NodeContext:
    """What every tier's part knows about where it runs; each tier's context adds its own
    services as named fields (DeviceContext, EdgeContext, CloudContext), so a part reads only
    what its tier offers (anything else is an AttributeError) and a method that needs a service
    the runtime already has edits nothing outside its own package.

    Parts are built with a tier's context, never this base (Part checks); the name stays as
    the type a part outside the repo (a plug-in's, docs/plugins.md) may annotate its context with."""

    node_id: str
    method: "Method"
    rng: np.random.Generator
    run: str = ""
    """The run id (topic namespace): e.g. what a generated broker ACL names."""
    compute: Compute = CPU
    """The torch device the node's parts compute on, resolved at start from `--device`
    (methods/compute.py); the method's parts builder narrows it to the CPU for a method whose
    parts are not ported to CUDA (`Method.runs_on_cuda`). Parts read it as `Part.device`."""


@dataclass(slots=True)
class DeviceContext(NodeContext):
    """A device's: where it is placed, its exchanges with its edge and peers, its owner's privacy
    settings and its thin trainer's chunk."""

    view: Placement = Placement(edge="")
    """The device's own placement (its edge, groups, peers); the runtime replaces it when the
    cloud moves the device. Unplaced (no edge) until then, and on a serverless peer."""
    request: Request | None = None
    """Send a message up and wait for the edge's reply (SplitFed)."""
    gather: Gather | None = None
    """Collect this round's messages from peers (DecMAR)."""
    min_class_count: int = 1
    """Its owner's own minimum count per class (`splitedge device --min-class-count`); the
    stricter of it and the run's `min_class_count` applies."""
    hide_classes: bool = False
    """Its hello names no class (`splitedge device --hide-classes`): under DP which classes it
    holds stays as private as its statistics, whose release then keeps every class the noise lets
    through, held or not (methods/privacy/release.py)."""
    private_reports: bool = False
    """Its hello and messages name only the power of two at or above its samples (`splitedge
    device --private-reports`, coarse_samples), so a DP run's edge, cloud and broker do not learn
    the exact count in the clear."""
    train_chunk: int = TRAIN_CHUNK
    """How many samples a thin (numpy) trainer passes through W_c at a time, exactly as the whole
    batch (methods/thin/chunked.py): memory flat in the batch size for ~2-3 times the compute; 0
    trains whole batches (`splitedge device --train-chunk`)."""


@dataclass(slots=True)
class EdgeContext(NodeContext):
    """An edge's: nothing beyond the common fields. It has no view; its devices come to its part
    through `EdgePart.members_changed` and each round's reports."""


@dataclass(slots=True)
class CloudContext(NodeContext):
    """The cloud's: its view of the federation, the run's length, its folder and test split."""

    view: FederationView = field(default_factory=FederationView)
    """Every device, its edge and its placement, kept by the runtime."""
    rounds: int | None = None
    """How many rounds the run has (a part reports on the last one)."""
    out_dir: Path | None = None
    """The run folder, for a part's own files (clusters.json, graph.png, ...)."""
    test: tuple[np.ndarray, np.ndarray] | None = None
    """The labelled test split the served model is evaluated on."""


class NotCovered(ValueError):
    """A run setting this method has no form of. The contract names no method: `covers(cls)`
    says whether a Method class has that form (from what its parts declare), and the registry,
    which knows every method, names them in the message (`{covered}`; methods/registry.py)."""

    def __init__(self, message: str, covers: Callable[[type], bool]) -> None:
        super().__init__(message.format(covered="the methods whose parts declare it"))
        self.template, self.covers = message, covers

    def naming(self, methods: Sequence[str]) -> ValueError:
        """The same error, naming the methods that have the form."""
        return ValueError(self.template.format(covered=", ".join(methods) or "no installed method"))


class Unsupported(ValueError):
    """A part that cannot be built on this node for this run, ever (e.g. a thin trainer asked to
    train a W_c it has no layers for): the node says why once and leaves (runtime Misfit)."""


C = TypeVar("C", bound=MethodConfig)
"""A part's config type: the `Config` of the method it belongs to (`Part.cfg`)."""
X = TypeVar("X", bound=NodeContext)
"""A tier's context, handed through `Method._placed` as it came."""


class _PartType(type):
    """The parts' metaclass, so that a part whose constructor leaves a declared Kept field unset
    fails as it is built, not at its first save rounds later."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        part = super().__call__(*args, **kwargs)
        unset = unset_fields(part, part.kept)
        if unset:
            raise TypeError(f"{cls.__name__} declares {', '.join(unset)} Kept but leaves "
                            f"{'it' if len(unset) == 1 else 'them'} unset once built: set each in "
                            f"__init__ (None for nothing yet), or drop the declaration")
        return part


class Part(Generic[C], metaclass=_PartType):
    """Hooks every tier's part has, typed by its method's config `C` (`self.cfg`).

    `losses` holds the mean of each loss term the part minimised this round (the runtime
    clears it before the round and reports it, merged per tier, in the cloud's metrics).

    Fields annotated `Kept[T]` (methods/kept.py) carry the part from one round to the next
    (models, optimisers, cached statistics, versions, pending messages): what a restarted edge
    or cloud, or a device parked between rounds, takes up again (state a helper object holds:
    a property whose getter returns `Kept[T]`); `kept` lists them, a base's first. What the
    part rebuilds from its context, config or data when it is built (weight specs, local
    tensors, views of its models) is left out, so it is neither stored twice nor restored over
    a fresh copy. A subclass extends its base's by declaring its own.
    """

    kept: ClassVar[tuple[str, ...]] = ()
    """The names of the Kept fields, read from the class's annotations (never written by hand)."""
    context: ClassVar[type[NodeContext]] = NodeContext
    """The tier's context type this part is built with."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        named = cls.__dict__.get("state")
        if isinstance(named, tuple) and all(isinstance(n, str) for n in named):
            raise TypeError(f"{cls.__name__}.state names its state in strings; declare each field "
                            f"instead, e.g. `model: Kept[nn.Module]` (splitedge.methods.kept)")
        cls.kept = kept_fields(cls)

    def __init__(self, ctx: NodeContext) -> None:
        if not isinstance(ctx, self.context):
            raise TypeError(f"{type(self).__name__} is built with a {self.context.__name__}, "
                            f"not a {type(ctx).__name__}")
        self.ctx = ctx
        self.losses: dict[str, float] = {}

    @property
    def method(self) -> "Method":
        return self.ctx.method

    @property
    def spec(self) -> ModelSpec:
        return self.ctx.method.spec

    @property
    def cfg(self) -> C:
        """The method's typed config (an instance of its `Config`)."""
        return cast(C, self.ctx.method.config)

    @property
    def device(self) -> str:
        """The torch device this part computes on ("cpu", "cuda", "cuda:N"): a part of a method
        ported to CUDA keeps its models there and moves each batch to it, its data staying on the CPU."""
        return self.ctx.compute.device

    def check(self, env: Any, source: str) -> None:
        """Refuse a message that the schema let through but that does not fit the federation
        (feature dimension, classes, model names and shapes, versions): raise ProtocolError
        naming the rule. `source` is "parent", "child" or "peer". The runtime logs, counts and
        drops a refused message before it can touch the part's state; the round goes on."""

    def reconfigure(self, method: "Method") -> None:
        """The cloud announced changed method settings (same method and model): take them."""
        self.ctx.method = method

    def ready(self, plan: RoundPlan) -> bool:
        """True when every model this round needs has arrived (e.g. the announced versions)."""
        return True

    def round_info(self) -> dict[str, Any]:
        """Plain data for this node's `done` info (e.g. losses, a personalised accuracy)."""
        return {}

    def resume_state(self) -> dict[str, Any]:
        """What a restarted cloud or edge (or a parked device) needs to carry on where this
        part was: its Kept fields, as methods.snapshot data. A declared value that cannot
        be kept is a SnapshotError naming it; a part with state that is no attribute (e.g. an
        ONNX graph's bytes) adds it here and takes it back in `restore_state`."""
        from splitedge.methods.snapshot import capture

        return capture(self, self.kept)

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take back `resume_state()`'s data into this freshly built part: models and
        optimisers in place, the rest replaced (SnapshotError when it does not fit: another
        model, another version of the method, a key it does not declare or one missing)."""
        from splitedge.methods.snapshot import restore

        restore(self, self.kept, state)


class DevicePart(Part[C]):
    """Device side of a method: local training and the statistics it sends up."""

    ctx: DeviceContext
    context = DeviceContext

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx)
        self.data, self.backend = data, backend
        self.withheld: dict[str, int] = {}
        self.dp_releases = 0  # differentially private releases this phase (methods/privacy/release.py)
        self.pending_release: Any = None  # a raw release that may only leave in a secure sum (distributed DP)

    def held_back(self, labels: np.ndarray) -> np.ndarray:
        """bool [N]: the images the part holds back to score the candidate layers of its head
        (`calib_layer` naming several; none otherwise), the same rows every time."""
        from splitedge.methods.calibration.layers import held_out, selects

        if not selects(self.cfg):
            return np.zeros(len(labels), dtype=bool)
        return held_out(labels, self.cfg.calib_holdout, self.ctx.node_id)

    def training_data(self) -> tuple[Any, np.ndarray]:
        """What the part trains on: its images, less those it holds back (`held_back`: a model
        trained on them would score itself, and favour the layers that fit them best)."""
        keep = ~self.held_back(self.data[1])
        if keep.all():
            return self.data
        return self.data[0][np.flatnonzero(keep)], np.asarray(self.data[1])[keep]

    stats_batch: int = 64
    """Images per forward pass while the part takes its head statistics (inference only): a
    thin device takes fewer, since onnxruntime's buffers grow with the batch."""

    private: bool = False
    """Whether everything this part sends from its data has a differentially private form that
    it takes when the run's `dp_sigma` > 0 (methods/privacy/release.py); a run with DP on is
    refused before round 1 for a method with any device part that has not."""
    private_clips: tuple[str, ...] = ()
    """The run's clip settings this part's releases need (each must be > 0 with DP on)."""
    dp_sgd: bool = False
    """Whether, with `dp_unit = "sample"`, this part trains with DP-SGD (methods/privacy/dpsgd.py)
    and sends what it trained as it is; a method with a device part that does not is refused."""
    own_model_statistics: str = ""
    """Why a release of this part is a statistic of a model the device trains on the same images
    (FedProto's personal model), "" when none is. Such a release is bounded at one image only when
    that training is itself DP-SGD, every step a counted release (adaptive composition,
    methods/privacy/dpsgd.py); trained without it, removing one image moves the model and so
    every image's vector, and no bound holds at any unit. So `dp_unit = "device"` refuses it and
    `dp_unit = "sample"` needs the part's `dp_sgd`."""
    clear_private: str = ""
    """Why a private release of this part travels outside every secure sum (e.g. CFLHKD's
    clustering signal), so that it cannot share its noise with other devices and a run with
    `dp_devices` > 1 is refused; "" when every release can."""
    secure_kinds: tuple[str, ...] = ()
    """Kinds of this part's messages that are sums in disguise (methods/privacy/additive.py),
    which the run's `secagg` sends only inside a secure sum; head statistics always are."""
    clear_info: tuple[str, ...] = ()
    """Entries of its `round_info` that are no function of its images (e.g. how many neighbours it
    heard), which its `done` keeps under private reports (runtime/mods/private.py); every other
    entry stays on the device."""
    moments_per: str = "sample"
    """What the edge's merge of this part's `moments` weighs alike: "sample" (moments of the union
    of the data) or "device" (FedProto: the mean over devices of their class means), which sets
    their sum form in a secure sum."""

    def release_info(self) -> dict[str, int]:
        """The differentially private releases this phase has made so far (`dp_releases`), for
        its `done` info, a failed round's too: a release made counts whatever becomes of the
        round (the cloud composes epsilon over them). Empty when it made none."""
        return {"dp_releases": int(self.dp_releases)} if self.dp_releases else {}

    def reported_samples(self, held: int) -> int:
        """The samples a message of this device names (a weight's weight in a merge): `held`,
        or with private reports the power of two at or above it, as its hello announced."""
        return coarse_samples(held) if self.ctx.private_reports else int(held)

    def announced_classes(self, labels: Any) -> np.ndarray:
        """The classes this device's hello named: those in `labels`, or every class of the
        federation when it hides them (DeviceContext.hide_classes)."""
        if self.ctx.hide_classes:
            return np.arange(self.spec.num_classes, dtype=np.int64)
        return np.unique(np.asarray(labels)).astype(np.int64)

    @property
    def min_class_count(self) -> int:
        """The minimum count per class this device applies: the run's or its owner's, the higher."""
        return max(self.cfg.min_class_count, self.ctx.min_class_count)

    def stats_floor(self, labels: Any) -> ClassFloor:
        """Which samples (labels [N]: those a per-class statistic is taken over) may enter it under
        `min_class_count` (methods/privacy/floor.py); what it holds back is kept as `withheld` for
        this phase's `done` info."""
        floor = ClassFloor.of(np.asarray(labels), self.min_class_count)
        self.withheld = floor.info
        return floor

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        """Do the round's work; yield messages to send, and DONE once the round may close."""
        raise NotImplementedError

    def on_message(self, env: Any) -> None:
        """A message from above (its edge, or the cloud through the edge), e.g. a global model."""

    def local_state(self) -> dict[str, np.ndarray]:
        """The device's own model as name -> array, for a device that keeps it (a run with no
        cloud saves it at the end); empty when the device holds nothing worth saving."""
        return {}

    can_calibrate: bool = False
    """Whether `classifier_input` works here: the part holds (or has been sent) everything
    between an image and the served model's classifier."""

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """The served model's classifier input [N, D] for normalised images [N, C, H, W], as the
        part holds the model in a calibration phase (methods/calibration)."""
        raise NotImplementedError

    encodes_updates: bool = False
    """Whether the part sends its model update through `update_codec` (methods/update_codec.py)."""
    layered_calibration: bool = False
    """Whether `stage_outputs` gives W_c's and W_e's outputs too, so the head may sit there
    (`calib_layer`, methods/calibration/layers.py); else only at the classifier's input."""

    def stage_outputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """One forward pass's outputs at the layers a head may sit at, for normalised images:
        "classifier" (the classifier's input [N, D]) and, where `layered_calibration`, "wc" and
        "we" (the split's stage outputs, [N, C, H, W] maps or [N, D])."""
        return {"classifier": self.classifier_input(x)}

    def calibration_data(self) -> tuple[Any, np.ndarray]:
        """The images and labels head statistics are taken over: all the device's, or (a part
        that keeps a held-out share to score itself) its training share."""
        return self.data

    def evaluate_head(self) -> dict[str, Any]:
        """In an evaluation phase: the calibrated head the part was sent, scored on its held-out
        data with its own model, as `{"accuracy": a, "eval_samples": n}` (empty: nothing to score)."""
        return {}


class EdgePart(Part[C]):
    """Edge side: merge what devices sent, train, report upward."""

    ctx: EdgeContext
    context = EdgeContext

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> list[Message]:
        """Called when the round closes (quorum or deadline); returns messages (UP: the cloud)."""
        raise NotImplementedError

    def on_message(self, env: Any) -> list[Message]:
        """A message from the cloud (for this edge, or relayed through it to devices)."""
        return []

    def on_device_message(self, env: Any) -> list[Message]:
        """A device message handled at once (e.g. SplitFed activations); replies, if any, mean
        the message is consumed and does not join the round's reports."""
        return []

    def on_round_open(self, plan: RoundPlan, members: set[str]) -> list[Message]:
        """Before the round is relayed down: messages for devices (e.g. ask one to resend)."""
        return []

    def members_changed(self, members: set[str]) -> None:
        """The edge's devices changed (one joined, or left for another edge): state kept per
        device (cached statistics) should forget those that left."""


def report_due(round_: int, every: int, rounds: int | None) -> bool:
    """Whether round `round_` of a run of `rounds` gets the representation report: every `every`
    rounds (MethodConfig.report_every) and the last."""
    return round_ % every == 0 or round_ == rounds


class CloudPart(Part[C]):
    """Cloud side: schedule, merge edge reports, train the head, evaluate, publish models."""

    ctx: CloudContext
    context = CloudContext

    def initial_messages(self) -> list[Message]:
        """Models every node needs before round 1 (usually with a slot, so late joiners get them)."""
        return []

    def on_edge_message(self, env: Any) -> None:
        """Every message from an edge as it arrives, whatever round it belongs to (state such as
        moments must not be lost because it came after its round closed)."""

    def adopt_sent(self, slot: str, weights: Mapping[str, np.ndarray] | None) -> None:
        """With a compressed downlink (runtime/downlink.py): `weights` is the model every device
        now holds of `slot`, the base plus what reached them. A part whose evaluation, head and
        checkpoint should be of that model (not of its merge, whose rest the codec carries into
        the next version) takes it here; by default nothing changes."""

    def plan(self, round_: int) -> RoundSpec:
        """The model versions and directives of round `round_`."""
        return RoundSpec()

    def before_round(self, round_: int) -> list[Message]:
        """Messages to send before round `round_` is announced, once the federation (and any
        placement) is known, e.g. what each device needs for that round (addressed to it)."""
        return []

    moves: Kept[Mapping[str, Placement] | None] = None
    """Devices to move before the next round, as a part decides while it aggregates (clusters
    found, an assignment computed); `placement` hands them to the runtime once (kept: decided
    while aggregating, handed over before the next round)."""

    def placement(self, round_: int) -> Mapping[str, Placement] | None:
        """Before round `round_`: devices to move (device -> Placement), or None. The runtime
        sends each an `assign` through its edge and opens the round once the edges report them.
        By default the pending `moves`, cleared as they are handed over."""
        moves, self.moves = self.moves, None
        return moves

    def aggregate(self, plan: RoundPlan, reports: Sequence[Report]) -> tuple[list[Message], dict[str, Any]]:
        """Close the round: returns (messages, metrics such as accuracy)."""
        raise NotImplementedError

    def report_due(self, round_: int) -> bool:
        """Whether the metrics of round `round_` carry the representation report (effective rank,
        spectrum, the self-supervised probe): `report_due` of the config and the run's rounds."""
        return report_due(round_, self.cfg.report_every, self.ctx.rounds)

    def state_for_checkpoint(self) -> dict[str, np.ndarray]:
        """The served global model as a flat name -> array map (saved without pickle)."""
        return {}

    def served_metadata(self) -> dict[str, str]:
        """Strings a checkpoint of the served model carries beside its weights (e.g. the clip a
        privately calibrated head needs, methods/calibration/serving.py); none by default."""
        return {}

    # -- calibration (methods/calibration): after round r is merged, when the config says so
    def calibration_dim(self) -> int | None:
        """The classifier input's dimension D the devices' head statistics must have, or None
        when this method cannot calibrate (no calibration phase is opened)."""
        return None

    def calibration_layers(self) -> dict[str, int] | None:
        """Each layer the head may sit at (`calib_layer`) with the dimension D its statistics
        must have, or None when this method cannot calibrate. By default the classifier's input
        alone (`calibration_dim`); parts serving a split model name the others too."""
        dim = self.calibration_dim()
        return None if dim is None else {"classifier": int(dim)}

    def before_calibration(self, round_: int) -> list[Message]:
        """What devices need to reach the classifier's input that they do not hold (e.g. the
        layers above a split), sent before the calibration phase of round `round_`."""
        return []

    def calibration_versions(self, round_: int) -> Mapping[str, int]:
        """The model versions a device must hold for round `round_`'s calibration phase: those
        it will train from next (the model just merged)."""
        return self.plan(round_ + 1).versions

    def calibrate(self, plan: RoundPlan, sources: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """The calibration phase closed: `sources` are the edges' merged head statistics
        (methods.calibration.stats.HeadStats) by layer ("classifier", or those `calib_layer`
        names), then by edge. Returns metrics (e.g. the calibrated model's accuracy) for the
        round's record."""
        return {}

    def heads_scored(self, scores: Mapping[str, Sequence[int]]) -> dict[str, Any]:
        """After the evaluation phase that chooses the head's layer: the devices' [correct,
        scored] of each candidate on the images they held back, summed. Returns metrics."""
        return {}

    def head_messages(self) -> list[Message]:
        """After `calibrate`: heads for the devices to score on data they held back, sent before
        an evaluation phase: the fitted heads where devices hold their own models (e.g. one per
        cluster), or every candidate layer's head. Empty (the default): no evaluation phase."""
        return []


# -- the method ------------------------------------------------------------------------------

ROLES = ("device", "edge", "cloud")


class Method:
    """A registered learning method: its typed config, its parts, and the hooks variants override.

    `parts` maps "device:<backend>" (or "device" for any backend), "edge" and "cloud" to
    "module:Class"; a part's module is imported only when that part is built, so looking a
    method up (and running its thin device part) never imports torch. A variant subclasses a
    method and overrides one hook (`objective`, `merge_weights`, or a method's own such as
    H-SFP's `sample_features`) and is registered under its own name.
    """

    name: str = ""
    Config: type[MethodConfig] = MethodConfig
    parts: Mapping[str, str] = {}
    personalised: bool = False
    """True when the reported accuracy is each device's own model on its own held-out data
    (FedProto), which is not comparable with a global model's test accuracy."""
    serverless: bool = False
    """True when the device part can run with no cloud and no edge, its rounds clocked by the
    devices themselves from a shared plan (`splitedge peers`, device/peer_agent.py): DecMAR."""
    head_calibration: bool = True
    """Whether `calibrate="lda"` is open to this method: its devices hold the served model after
    a round, or their own models scored with a head sent back (not DecMAR's consensus)."""
    exportable: bool = True
    """Whether the cloud's checkpoint (`state_for_checkpoint`) is the served SplitModel, which
    `splitedge export` turns into ONNX; False for a prototype table (FedProto) or a network of
    another shape (the self-supervised encoders, the MAE)."""
    runs_on_cuda: bool = False
    """Whether this method's torch parts compute on the node's `--device` (models, batches and
    evaluation there: methods/compute.py). False: they compute on the CPU, `auto` leaves a GPU
    unused and `--device cuda` is refused in one line. A subclass inherits its base's: set it
    back to False for one whose parts are not ported."""

    def __init__(self, config: RunConfig, name: str | None = None) -> None:
        if not isinstance(config.method, self.Config):
            raise ValueError(f"{self.name} needs a {self.Config.__name__}, got {type(config.method).__name__}")
        self.run_config = config
        self.name = name or self.name

    @property
    def spec(self) -> ModelSpec:
        return self.run_config.model

    @property
    def config(self) -> Any:
        return self.run_config.method

    # -- parts
    def _part_class(self, key: str) -> Any:
        return part_class(self.parts[key])

    @classmethod
    def device_backends(cls) -> list[str] | None:
        """The device backends this method's device parts run on; None: any (a generic part)."""
        return None if "device" in cls.parts else sorted(k.split(":", 1)[1] for k in cls.parts if k.startswith("device:"))

    def device_part(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> DevicePart[Any]:
        key = f"device:{backend}" if f"device:{backend}" in self.parts else "device"
        if key not in self.parts:
            raise ValueError(f"{self.name} has no device part for backend {backend!r}; it runs on "
                             f"{self.device_backends()}")
        return self._part_class(key)(self._placed(ctx), data, backend)

    def edge_part(self, ctx: EdgeContext) -> EdgePart[Any]:
        return self._part_class("edge")(self._placed(ctx))

    def cloud_part(self, ctx: CloudContext) -> CloudPart[Any]:
        return self._part_class("cloud")(self._placed(ctx))

    def _placed(self, ctx: X) -> X:
        """`ctx` with the device this method's parts compute on (`runs_on_cuda`); a GPU the
        operator named for a method not ported to it is Unsupported (the node says why and leaves)."""
        try:
            ctx.compute = ctx.compute.for_method(self.name, self.runs_on_cuda)
        except ValueError as exc:
            raise Unsupported(str(exc)) from None
        return ctx

    # -- hooks
    def objective(self, role: str) -> list[Any]:
        """The method's own loss terms (methods.training.LossTerm) for what `role` trains."""
        return []

    def regularisers(self, role: str) -> list[Any]:
        """Terms any method can switch on by config (FedDecorr on the 'features' output)."""
        if self.config.feddecorr_beta <= 0:
            return []
        from splitedge.methods.training import feddecorr_term  # torch only where a tier trains

        return [feddecorr_term(self.config.feddecorr_beta)]

    def settle(self) -> dict[str, Any]:
        """Settings the cloud derives from the model before round 1 (where torch is), so that
        numpy-only edges check every message against them instead of trusting the first one
        (e.g. FedProto's prototype dimension). Empty by default. A setting the method cannot
        honour is a ValueError here, before round 1."""
        if self.config.calibrate != "none" and not self.head_calibration:
            raise ValueError(f"{self.name} cannot calibrate its head (calibrate={self.config.calibrate!r}): its devices "
                             f"hold no model the cloud could serve a head for; leave calibrate at none")
        if self.config.calibrate != "none":
            self._check_layers()
        codec = getattr(self.config, "update_codec", "none")
        if codec != "none" and not all(p.encodes_updates for p in self._device_parts()):
            raise ValueError(f"{self.name} cannot compress its devices' updates (update_codec={codec}): it sends more "
                             f"than a model update; leave update_codec at none")
        if self.config.dp_sigma > 0:
            self._check_private()
        if self.config.secagg != "off":
            self._check_secure()
        return {}

    def _device_parts(self) -> list[Any]:
        """The classes of this method's device parts (one per backend)."""
        return device_part_classes(type(self))

    def _check_layers(self) -> None:
        """A head placed off the classifier's input needs devices that compute the split's stage
        outputs, and a stage output the layer's pooling fits."""
        from splitedge.methods.calibration.layers import CLASSIFIER, parse_layers

        layers = [layer for layer in parse_layers(self.config.calib_layer) if layer.stage != CLASSIFIER]
        if not layers:
            return
        if not all(p.layered_calibration for p in self._device_parts() if p.can_calibrate):
            raise ValueError(f"{self.name} calibrates its head only at the classifier's input (calib_layer "
                             f"{self.config.calib_layer}): its devices hold no split model; leave calib_layer at "
                             f"classifier")
        if self.config.secagg != "off":
            raise ValueError(f"calib_layer {self.config.calib_layer}: secure sums carry head statistics at the "
                             f"classifier's input only; leave calib_layer at classifier under secagg")
        from splitedge.models import create_split

        spec = self.spec
        split = create_split(spec.model, num_classes=spec.num_classes, in_channels=spec.channels,
                             image_size=spec.image_size)
        shapes = {"wc": split.wc_shape, "we": split.we_shape}
        for layer in layers:
            why = layer.fits(shapes[layer.stage])
            if why:
                raise ValueError(f"calib_layer {why} ({spec.model}); choose another side")

    def _check_secure(self) -> None:
        """With secagg on, some statistic of every device part must be securely summable."""
        if self.config.calibrate == "none" and not SUMMABLE(type(self)):
            raise NotCovered(f"secagg covers the statistics and models a method's devices declare summable "
                             f"(those of {{covered}}) and head statistics; {self.name}'s devices send none of "
                             f"them (set calibrate=lda for its head statistics, or leave secagg off)", SUMMABLE)

    def _check_private(self) -> None:
        """With DP on, every device part must release privately, with the clips it needs set."""
        parts = self._device_parts()
        if not PRIVATE(type(self)):
            raise NotCovered(f"{self.name} has no differentially private form of everything its devices send; "
                             f"dp_sigma covers {{covered}}: leave dp_sigma at 0", PRIVATE)
        clear = sorted({p.clear_private for p in parts if p.clear_private})
        if self.config.dp_devices > 1 and clear:
            raise ValueError(f"dp_devices={self.config.dp_devices} needs every private release of {self.name} inside "
                             f"a secure sum, but {clear[0]}: leave dp_devices at 1")
        own = sorted({p.own_model_statistics for p in parts if p.own_model_statistics})
        if self.config.dp_unit == "device" and own:
            raise ValueError(f"dp_unit=device refuses {self.name}: {own[0]} without DP-SGD, so removing one image "
                             f"moves it by more than its clip; use dp_unit=sample (DP-SGD, docs/privacy.md, "
                             f"'The privacy unit') or leave dp_sigma at 0")
        if self.config.dp_unit == "sample" and not DP_SGD(type(self)):
            raise NotCovered(f"{self.name}'s devices have no DP-SGD form: dp_unit=sample covers {{covered}} (H-SFP "
                             f"with device_target=etf); use dp_unit=device", DP_SGD)
        skip = ("dp_update_clip",) if self.config.dp_unit == "sample" else ()  # DP-SGD clips gradients instead
        unset = sorted({c for p in parts for c in p.private_clips if c not in skip and not getattr(self.config, c) > 0})
        if unset:
            raise ValueError(f"dp_sigma > 0 needs {' and '.join(u + ' > 0' for u in unset)}: the L2 norm each "
                             f"release is clipped to (docs/privacy.md)")

    def loss_terms(self, role: str) -> list[Any]:
        """Everything `role` minimises: objective plus switched-on regularisers."""
        return [*self.objective(role), *self.regularisers(role)]

    def merge_weights(self, parts: Sequence[tuple[Mapping[str, np.ndarray], int]],
                      reference: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """How edges and the cloud combine weight maps: by the run's `robust` rule
        (methods/robust.py; "none", the default: the sample-weighted average). `reference` is
        the model the parts were trained from, where the merging node holds it (clipping
        bounds updates relative to it)."""
        from splitedge.methods.robust import robust_average, robust_rule

        return robust_average(parts, reference=reference, **robust_rule(self.config))


def part_class(target: str) -> Any:
    """The part class a Method's `parts` names ("package.module:Class")."""
    import importlib

    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def device_part_classes(cls: type) -> list[Any]:
    """The classes of a Method class's device parts (one per backend)."""
    return [part_class(target) for key, target in cls.parts.items() if key.startswith("device")]


def every_device_part(declares: str) -> Callable[[type], bool]:
    """Whether a Method class has device parts and each declares `declares` (a truthy class
    attribute): what a run setting needs of them, read by the contract's checks and, through
    NotCovered, by the registry naming the methods that have it."""
    return lambda cls: bool(parts := device_part_classes(cls)) and all(getattr(p, declares) for p in parts)


SUMMABLE = every_device_part("secure_kinds")
"""secagg: some kind of every device part's messages is a sum in disguise (DevicePart.secure_kinds)."""
PRIVATE = every_device_part("private")
"""dp_sigma: every device part releases privately (DevicePart.private)."""
DP_SGD = every_device_part("dp_sgd")
"""dp_unit=sample: every device part trains with DP-SGD (methods/privacy/dpsgd.py), so its
statistics, even of the model it trained, are bounded at one image (DevicePart.dp_sgd)."""


def coarse_samples(held: int) -> int:
    """The samples a private device announces: the power of two at or above `held` (0 for none).
    The edge bounds what the device may count by it, so it must not be below; rounding up
    leaves the edge and the broker the count's order of magnitude only."""
    return 0 if held <= 0 else 1 << (int(held) - 1).bit_length()
