"""H-SFP thin device: moments of the global W_c run by onnxruntime, no torch in the process.

The cloud publishes W_c once as a retained `onnx_model`; slow-scale averages arrive as weight
maps and are swapped into the graph by name between rounds. Until a graph has arrived the
device is not ready. When the head is calibrated (`calibrate_every`), a second retained graph
(W_e and W_g's trunk on W_c features) gets the calibration weights the same way, and the device
sends head statistics once it has both. Anything that does not load (bad bytes, names, shapes) is logged and
dropped, and the device keeps running the model it had.

It also trains, as a torch device does: a numpy copy of W_c (methods/thin/trainer.py) starts from
each new global W_c, takes `local_epochs` of SupCon per round and goes up on the rounds W_c is
averaged, while the moments stay those of the global W_c (the consistency rule). A W_c the thin
trainer cannot train (the ResNet-18 split's) leaves the device a statistics reporter, said once.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

import numpy as np

from splitedge.methods.data.preprocess import to_input
from splitedge.methods.privacy.release import private_weights
from splitedge.methods.hsfp.device import WC_IN_USE, HSFPDevice
from splitedge.methods.hsfp.method import AVERAGE, CALIB, WC
from splitedge.methods.contract import Message, NodeContext, RoundPlan
from splitedge.protocol.errors import ProtocolError

log = logging.getLogger(__name__)


class HSFPOnnxDevice(HSFPDevice):
    """HSFPDevice whose extractor (device.onnx_backend.OnnxExtractor) is built from the first model."""

    # Small batches bound peak RSS (onnxruntime's activation buffers and the float64 moment
    # temporaries scale with the batch). On the CIFAR CNN with 5,000 streamed images the peak
    # over the moments pass is +150 MB at 256 against 32, +10 MB at 32 against 8 and +1.6 MB
    # at 8 against 4; 4 still takes ~2 s (a batch of 1 takes 6 s for 2.6 MB less).
    moment_batch = 4
    # The same for head statistics: the calibration graph (W_e and the head's trunk) runs its convolutions
    # unoptimised (weights patched in), whose im2col buffers grow with the batch: on fedcnn with 1,000
    # images the device peaked at 148 MB at 64 images a call (bench/results/ram-fedcnn-methods).
    stats_batch = moment_batch
    # The graphs themselves are no attribute: resume_state adds their bytes (see there).
    state = HSFPDevice.state + ("model_version", "unapplied", "trainer", "trained_version", "dp_start")
    private, private_clips = True, ("dp_clip", "dp_update_clip")
    secure_kinds = ("moments", "weights")

    def __init__(self, ctx: NodeContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.extractor = None  # type: ignore[assignment]  # built when the onnx_model arrives
        self.model_version = -1
        self.calib_extractor: Any = None  # W_e and W_g's trunk, built when their onnx_model arrives
        # the newest weight map seen per part (WC, CALIB), kept until its graph is there
        self.latest: dict[str, tuple[int, Mapping[str, np.ndarray]]] = {}
        self.trainer = self._new_trainer()
        self.trained_version = -1  # the global W_c version the trainer's local copy started from
        self.dp_start: dict[str, np.ndarray] = {}  # with DP on: the weights it started from (the update's origin)

    def _new_trainer(self) -> Any:
        """The numpy SupCon trainer of this run's W_c, or None when there is none for it (said once)."""
        from splitedge.methods.thin.trainer import SupConTrainer

        cfg, spec = self.cfg, self.spec
        if not getattr(cfg, "proj_head", True) and cfg.device_target == "supcon":
            if cfg.local_epochs > 0:
                log.warning("device %s: sends statistics of the global W_c but trains none: the thin trainer trains "
                            "through its projection head only (proj_head=false needs a torch device)", self.ctx.node_id)
            return None
        try:
            return SupConTrainer(spec.model, spec.channels, proj_dim=cfg.proj_dim, lr=cfg.device_lr, tau=cfg.tau,
                                 seed=int(self.ctx.rng.integers(2**31)), target=cfg.device_target,
                                 classes=spec.num_classes, etf_seed=spec.seed, etf_tau=cfg.etf_tau,
                                 feddecorr_beta=cfg.feddecorr_beta, chunk=self.ctx.train_chunk)
        except ValueError as exc:
            if cfg.local_epochs > 0:
                log.warning("device %s: sends statistics of the global W_c but trains none: %s", self.ctx.node_id, exc)
            return None

    def reconfigure(self, method: Any) -> None:
        super().reconfigure(method)
        if self.trainer is not None:
            self.trainer.retune(self.cfg.device_lr)

    def train_round(self, plan: RoundPlan) -> Iterator[Message]:
        """`local_epochs` of SupCon on the local W_c copy; the copy goes up when W_c is averaged.
        With local_epochs=0 the device is the statistics reporter it always was: nothing trains,
        so nothing goes up but moments (a torch device sends its untouched copy; this one spares
        its uplink)."""
        if self.trainer is None or self.cfg.local_epochs == 0 or not self._sync_trainer():
            return
        for _ in range(self.cfg.local_epochs):
            rng = np.random.default_rng(int(self.ctx.rng.integers(2**31)))
            self.losses = self.trainer.train_epoch(self.data[0], self.data[1], self.spec.mean, self.spec.std,
                                                   self.cfg.device_batch, rng)
        if WC in plan.directives.get(AVERAGE, ()):
            weights = self.trainer.weights()
            if self.cfg.dp_sigma > 0:  # the update clipped and noised (methods/privacy)
                from splitedge.methods.thin.norms import private_norms

                norms = private_norms(self, self.trainer.wc, self.dp_start, self.images)  # of the global W_c
                weights = private_weights(self, weights, self.dp_start, norms)
            yield Message("weights", {"part": WC, "version": self.wc_version, "samples": self.num_samples,
                                      "weights": weights})

    def images(self, size: int = 256) -> Iterator[np.ndarray]:
        """The local images, normalised a batch at a time, in order."""
        for i in range(0, len(self.data[1]), size):
            yield to_input(np.asarray(self.data[0][i:i + size]), self.spec.mean, self.spec.std)

    def local_features(self, x: np.ndarray) -> np.ndarray:
        """The trained local copy's outputs (numpy, eval mode), before its final ReLU with
        pre_relu; the global W_c's while there is no copy that started from it."""
        if self.trainer is None or self.trained_version != self.wc_version:
            return super().local_features(x)
        return self.trainer.features(x, pre_relu=self.cfg.pre_relu)

    def _sync_trainer(self) -> bool:
        """A new global W_c in use: the local copy starts again from it, with fresh momentum. Its
        weight map if this device holds it, else the weights inside the graph in use."""
        if self.trained_version == self.wc_version:
            return True
        entry = self.latest.get(WC)
        if entry is not None and entry[0] == self.wc_version:
            weights = dict(entry[1])
        else:
            weights = {**self.trainer.weights(), **self.extractor.weights()}
        try:
            self.trainer.load(weights)
        except ValueError as exc:
            log.warning("device %s: the local W_c cannot start from global W_c v%d, no training this round: %s",
                        self.ctx.node_id, self.wc_version, exc)
            return False
        self.trained_version = self.wc_version
        if self.cfg.dp_sigma > 0:
            self.dp_start = {k: np.array(v, copy=True) for k, v in self.trainer.weights().items()}
        return True

    # The calibration graph comes with W_c's (both retained, exported together), so a device waits
    # for it in a calibrating round rather than sitting the calibration out.
    can_calibrate = True

    def ready(self, plan: RoundPlan) -> bool:
        return self.extractor is not None and super().ready(plan)

    def check_global(self, weights: Mapping[str, np.ndarray]) -> None:
        _check_fits(self.extractor, weights)

    def check_calib(self, weights: Mapping[str, np.ndarray]) -> None:
        _check_fits(self.calib_extractor, weights)

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        h = self.extractor.features(x)
        if self.cfg.pre_relu:  # the W_c graph stops before the final ReLU (moments are taken there)
            np.maximum(h, 0, out=h)
        return self.calib_extractor.features(h)

    @property
    def unapplied(self) -> dict[str, tuple[int, Mapping[str, np.ndarray]]]:
        """`latest` without the weight maps a graph already carries (their version in use): what
        is saved of it. Kept whole, the state held those weights twice, in the graph and here
        (a ResNet-18 trunk: ~44 MB more per parked device)."""
        graphs = {WC: (self.extractor, self.wc_version), CALIB: (self.calib_extractor, self.calib_version)}
        return {part: (version, weights) for part, (version, weights) in self.latest.items()
                if graphs[part][0] is None or version > graphs[part][1]}

    @unapplied.setter
    def unapplied(self, latest: Mapping[str, tuple[int, Mapping[str, np.ndarray]]]) -> None:
        self.latest = dict(latest)

    def resume_state(self) -> dict[str, Any]:
        """Parked (a virtual device) or restarted: beside the declared state, the graphs in
        use as ONNX bytes with their current weights patched in; sessions are rebuilt on
        restore, so a parked thin device holds no onnxruntime session."""
        graphs = {WC: self.extractor, CALIB: self.calib_extractor}
        return {**super().resume_state(),
                "onnx_graphs": {part: graph.model_bytes for part, graph in graphs.items() if graph is not None}}

    def restore_state(self, state: dict[str, Any]) -> None:
        graphs = dict(state.get("onnx_graphs") or {})
        super().restore_state({k: v for k, v in state.items() if k != "onnx_graphs"})
        if graphs:
            from splitedge.methods.thin.onnx_backend import OnnxExtractor

            self.extractor = OnnxExtractor(graphs[WC]) if WC in graphs else None
            self.calib_extractor = OnnxExtractor(graphs[CALIB]) if CALIB in graphs else None

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "onnx_model" and body["part"] == WC:
            self._on_model(body)
        elif env.kind == "onnx_model" and body["part"] == CALIB:
            self._on_calib_model(body)
        elif env.kind == "weights" and body["part"] in (WC, CALIB):
            part, version = body["part"], int(body["version"])
            if part not in self.latest or version > self.latest[part][0]:
                self.latest[part] = (version, body["weights"])
            graph, in_use, swap = ((self.extractor, self.wc_version, self._swap) if part == WC else
                                   (self.calib_extractor, self.calib_version, self._swap_calib))
            if graph is not None and version > in_use:
                swap(version, body["weights"])
        else:
            super().on_message(env)  # e.g. the edge asking for moments again

    def _on_model(self, body: Mapping[str, Any]) -> None:
        version = int(body["version"])
        if version <= self.model_version:
            return
        try:
            if self.extractor is None:
                from splitedge.methods.thin.onnx_backend import OnnxExtractor  # onnxruntime only where needed

                self.extractor = OnnxExtractor(body["model"], sha256=body["sha256"])
            else:
                self.extractor.load_model(body["model"], body["sha256"])
        except ValueError as exc:
            log.warning("device %s: rejected onnx_model v%d: %s", self.ctx.node_id, version, exc)
            return
        self.model_version = self.wc_version = version
        log.info("device %s: onnx W_c v%d loaded (%d bytes)", self.ctx.node_id, version, len(body["model"]))
        if WC in self.latest and self.latest[WC][0] > version:
            self._swap(*self.latest[WC])

    def _swap(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        try:
            self.extractor.load_weights(weights)
        except ValueError as exc:
            log.warning("device %s: rejected W_c v%d weights, keeping v%d: %s", self.ctx.node_id, version,
                        self.wc_version, exc)
            return
        self.wc_version = version
        log.info("device %s: %s%d", self.ctx.node_id, WC_IN_USE, version)

    def _on_calib_model(self, body: Mapping[str, Any]) -> None:
        """The calibration graph: its own weights are a placeholder until a CALIB weight map."""
        try:
            from splitedge.methods.thin.onnx_backend import OnnxExtractor

            extractor = OnnxExtractor(body["model"], sha256=body["sha256"])
        except ValueError as exc:
            log.warning("device %s: rejected calibration onnx_model: %s", self.ctx.node_id, exc)
            return
        self.calib_extractor, self.calib_version = extractor, -1
        if CALIB in self.latest:
            self._swap_calib(*self.latest[CALIB])

    def _swap_calib(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        try:
            self.calib_extractor.load_weights(weights)
        except ValueError as exc:
            log.warning("device %s: rejected calibration v%d weights: %s", self.ctx.node_id, version, exc)
            return
        self.calib_version = version


def _check_fits(graph: Any, weights: Mapping[str, np.ndarray]) -> None:
    """A weight map must fit its graph; with no graph yet it is kept and checked when swapped in."""
    if graph is None:
        return
    try:
        graph.check_weights(weights)
    except ValueError as exc:
        raise ProtocolError("state.weights", str(exc)) from None
