"""FedMAR / DecMAR devices: train the small ViT MAE on their unlabelled images with
MAE + gamma_k * A-MMD(batch latents, z_bar), and send their model and mean latent.

FedMAR sends them up (edges and the cloud average); DecMAR sends them to its graph neighbours,
waits (bounded) for theirs, and averages itself with them.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, TypeVar

import numpy as np
import torch

from splitedge.methods.checks import check_weights, weight_specs
from splitedge.methods.mar.method import LATENT, MODEL, UPLOAD, ZBAR
from splitedge.methods.mar.losses import mar_gamma
from splitedge.methods.ssl.model import normalise, to_unit
from splitedge.methods.contract import DONE, PEERS, DeviceContext, DevicePart, Kept, Message, RoundPlan
from splitedge.methods.mar.config import DecMARConfig, MARConfig
from splitedge.methods.privacy.release import private_means_of, private_weights
from splitedge.methods.torch_utils import device_optimizer, shuffled_batches
from splitedge.methods.training import Batch, Outputs, train_epochs
from splitedge.models import load_numpy_state, state_to_numpy
from splitedge.protocol.errors import ProtocolError


def build_mae(spec: Any, cfg: Any) -> Any:
    """The run's small ViT MAE, from the spec's seed (models/vit_mae.py)."""
    from splitedge.models import seeded_init
    from splitedge.models.vit_mae import MaskedAutoencoder

    with seeded_init(spec.seed):
        return MaskedAutoencoder(spec.image_size, spec.channels, patch=cfg.patch, dim=cfg.vit_dim,
                                 depth=cfg.vit_depth, heads=cfg.vit_heads, decoder_dim=cfg.decoder_dim,
                                 decoder_depth=cfg.decoder_depth, mask_ratio=cfg.mask_ratio)


ConfigT = TypeVar("ConfigT", bound=MARConfig)


class MARDevice(DevicePart[ConfigT]):
    # mean_latent is the mean of this round's batches, taken before it is sent
    model: Kept[torch.nn.Module]
    version: Kept[int]
    zbar: Kept[torch.Tensor | None]
    zbar_version: Kept[int]
    participations: Kept[int]
    # under DP (FedMAR): the model update clipped and noised as FedAvg's, and the mean latent one
    # noisy release of the images' latents clipped to dp_clip (private_latent)
    private, private_clips = True, ("dp_update_clip", "dp_clip")
    clear_private = "FedMAR's mean latents travel device by device (its edge forwards each to the cloud)"

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.model = build_mae(self.spec, self.cfg).eval()
        self.specs = weight_specs(state_to_numpy(self.model))
        self.version = -1
        self.zbar = None
        self.zbar_version = 0
        self.participations = 0
        self.mean_latent: np.ndarray | None = None

    def ready(self, plan: RoundPlan) -> bool:
        return self.version >= max(plan.version(MODEL), 0) and self.zbar_version >= plan.version(ZBAR)

    def check(self, env: Any, source: str) -> None:
        body = env.body
        if env.kind == "weights":
            check_weights(body, self.specs, part=MODEL, source=source)
        elif env.kind == "arrays" and body["name"] in (ZBAR, LATENT):
            z = body["arrays"].get("z")
            if z is None or z.shape[-1] != self.model.dim or z.ndim not in (1, 2):
                raise ProtocolError("state.shape", f"{body['name']} needs z of width {self.model.dim}")

    def on_message(self, env: Any) -> None:
        body = env.body
        if env.kind == "weights" and body["version"] > self.version:
            load_numpy_state(self.model, body["weights"])
            self.version = int(body["version"])
        elif env.kind == "arrays" and body["name"] == ZBAR and body["version"] > self.zbar_version:
            self.zbar = torch.from_numpy(np.array(body["arrays"]["z"], dtype=np.float32))
            self.zbar_version = int(body["version"])

    can_calibrate = True

    def classifier_input(self, x: np.ndarray) -> np.ndarray:
        """The encoder's mean latent with every patch visible (the federated probe's input)."""
        with torch.inference_mode():
            return self.model.encode(torch.from_numpy(x)).numpy()

    def forward(self, batch: Batch) -> Outputs:
        out = self.model(normalise(batch.x, self.spec), generator=batch.extra["gen"])
        latent = out["latent"]
        batch.extra["latents"].append((latent.detach().sum(dim=0), len(latent)))
        return {"mae": out["loss"], "latent": latent, "features": latent}

    def train_round(self) -> None:
        """Local epochs of MAE (+ MAR); keeps the mean latent of the last epoch's batches."""
        opt = device_optimizer(self.model.parameters(), self.cfg)
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        x = self.data[0]
        extra = {"gen": gen, "zbar": self.zbar, "latents": [],
                 "gamma": mar_gamma(self.participations, g_min=self.cfg.g_min, g_max=self.cfg.g_max,
                                    cap=self.cfg.gamma_cap)}

        def epoch() -> Iterator[Batch]:
            extra["latents"] = []
            for idx in shuffled_batches(len(x), self.cfg.device_batch, gen):
                yield Batch(to_unit(x[idx.numpy()]), None, extra)

        self.losses = train_epochs(self.forward, self.method.loss_terms("device"), epoch, opt, [self.model],
                                   epochs=self.cfg.local_epochs)
        if not extra["latents"]:  # no epoch (local_epochs=0: the random-encoder bound): one pass, no training
            with torch.inference_mode():
                for batch in epoch():
                    self.forward(batch)
        sums = [s for s, _ in extra["latents"]]
        self.mean_latent = (torch.stack(sums).sum(0) / max(1, sum(n for _, n in extra["latents"]))).numpy()
        self.participations += 1

    def local_state(self) -> dict[str, np.ndarray]:
        return state_to_numpy(self.model)

    def latent_message(self, round_: int, to: Any = None) -> Message:
        body = {"name": LATENT, "version": round_, "arrays": {"z": self.mean_latent.astype(np.float32)}}
        # to peers, retained (a slot): a neighbour that subscribes late still gets this round's
        return Message("arrays", body) if to is None else Message("arrays", body, to=to, slot=LATENT)

    def model_body(self) -> dict[str, Any]:
        return {"part": MODEL, "version": max(self.version, 0), "samples": self.reported_samples(len(self.data[0])),
                "weights": state_to_numpy(self.model)}

    def private_latent(self) -> np.ndarray | None:
        """One differentially private release of the mean latent: each image's latent (masked as
        in training) clipped to `dp_clip`, summed with noise; None when the noisy count falls below
        the run's floor (the round then sends no latent). Taken by the encoder the round starts
        from, a function of releases only, before it trains: by the encoder trained on the same
        images every image's latent would move with every other image, unbounded."""
        gen = torch.Generator().manual_seed(int(self.ctx.rng.integers(2**31)))
        x = self.data[0]
        rows = []
        self.model.eval()
        with torch.inference_mode():
            for i in range(0, len(x), 256):
                latent = self.model(normalise(to_unit(x[i:i + 256]), self.spec), generator=gen)["latent"]
                rows.append((latent.double().numpy(), np.zeros(len(latent), dtype=np.int64)))
        one = np.zeros(len(x), dtype=np.int64)  # every image in one group: the release's class 0
        classes, _, means = private_means_of(self, rows, one, self.model.dim)
        kept = [i for i, c in enumerate(classes) if int(c) == 0]
        return means[kept[0]].astype(np.float32) if kept else None

    def released_round(self) -> dict[str, Any]:
        """Train this round; the model body to send and `mean_latent` set, both private under DP
        (methods/privacy): the latent one noisy release by the encoder the round started from
        (None when its noisy count fell below the floor), the update clipped and noised, and the
        model then holds what it released, so the next round starts from releases only."""
        private = self.cfg.dp_sigma > 0
        start = state_to_numpy(self.model) if private else None
        latent = self.private_latent() if private else None
        self.train_round()
        body = self.model_body()
        if start is not None:
            body["weights"] = private_weights(self, body["weights"], start)
            load_numpy_state(self.model, body["weights"])
            self.mean_latent = latent
        return body

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        yield Message("weights", self.released_round())
        if self.mean_latent is not None:
            yield self.latent_message(plan.round)
        yield DONE


SUSPECT_WAIT_S = 1.0
"""How long a round waits for a neighbour that was missing the round before."""


class DecMARDevice(MARDevice[DecMARConfig]):
    """Trains, sends its model and mean latent to its neighbours, waits (bounded) for theirs,
    averages itself with them; z_bar for the next round is the mean of their mean latents.
    Every device builds the same initial model from the run's seed, so it needs nobody's
    model to start (a run with no cloud, device/peer_agent.py).

    Under DP it releases as FedMAR does (its model update clipped and noised, its mean latent
    one noisy release), and averages its neighbours' releases with its own release, not with
    the model it trained: the model each round starts from is then a function of releases
    only (the seeded initial model first), so every update is clipped against a start that
    reveals nothing more, and the rounds compose as the accountant counts them."""

    missed: Kept[set[str]]  # neighbours not heard last round; info: this round's, read by round_info as it ends
    clear_private = "DecMAR's models and mean latents go to each neighbour as they are (no secure sum)"
    clear_info = ("neighbours_heard", "neighbours_missed")  # which of its peers answered: no image in it

    def __init__(self, ctx: DeviceContext, data: tuple[np.ndarray, np.ndarray], backend: Any) -> None:
        super().__init__(ctx, data, backend)
        self.version = 0
        self.missed = set()

    def run_round(self, plan: RoundPlan) -> Iterator[Message | object]:
        own = self.released_round()
        yield Message("weights", own, to=PEERS, slot=MODEL)
        if self.mean_latent is not None:  # under DP, None when the noisy count fell below the floor
            yield self.latent_message(plan.round, to=PEERS)
        models, latents = self.hear_neighbours(min(self.cfg.gather_timeout_s, plan.deadline_s / 2))
        parts = [(own["weights"], 1)] + [(env.body["weights"], 1) for env in models.values()]
        load_numpy_state(self.model, self.method.merge_weights(parts))  # self (as sent) and neighbours, equally
        means = ([] if self.mean_latent is None else [self.mean_latent]) + \
            [np.asarray(e.body["arrays"]["z"]) for e in latents.values() if e.body["name"] == LATENT]
        if means:  # none only under DP, when no release of this round passed the floor: keep the last
            stacked = np.stack(means)  # the paper's reference is the latents themselves, ours their mean
            self.zbar = torch.from_numpy((stacked if self.cfg.ammd == "paper" else stacked.mean(axis=0))
                                         .astype(np.float32))
        self.version = plan.round
        self.info = {"neighbours_heard": len(models), "neighbours_missed": sorted(self.missed)}
        if plan.directives.get(UPLOAD):  # the cloud evaluates the consensus of the devices' models
            yield Message("weights", self.model_body())
        yield DONE

    def hear_neighbours(self, wait: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """This round's models and latents from the neighbours, within one window of `wait` s.
        A neighbour that was missing last round gets only a short grace (SUSPECT_WAIT_S) until it
        is heard again: a dead peer must not cost every round the whole window, or the live
        devices fall out of step with each other and miss each other's rounds too."""
        gather, peers = self.ctx.gather, list(self.ctx.view.peers)
        deadline = time.monotonic() + wait
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        models = gather("weights", senders=[p for p in peers if p not in self.missed], timeout=wait)
        suspects = [p for p in peers if p in self.missed]
        if suspects:
            models.update(gather("weights", senders=suspects, timeout=min(SUSPECT_WAIT_S, left())))
        latents = gather("arrays", senders=sorted(models), timeout=max(left(), SUSPECT_WAIT_S))
        self.missed = set(peers) - set(models)
        return models, latents

    def round_info(self) -> dict[str, Any]:
        return dict(getattr(self, "info", {}))
