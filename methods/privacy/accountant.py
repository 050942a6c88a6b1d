"""Epsilon at a stated delta for the Gaussian releases of dp.py, and the inverse.

Every release in dp.py is a Gaussian mechanism with noise multiplier sigma (noise sd over L2
sensitivity) under add/remove-one-image adjacency (weight updates: any change of the device's
data, which covers it), so a device's guarantee after R releases is that of R self-composed
Gaussian mechanisms. There is no subsampling (a device uses all its images) and so no
amplification. Count only the rounds a device actually sends (`releases`, or a `Ledger` fed
with what was sent): statistics sent every `ic` rounds are about rounds / ic releases, not `rounds`.

DP-SGD (`dp_unit = "sample"`, dpsgd.py) adds, per training round, dpsgd.steps(cfg) Poisson-
subsampled Gaussian mechanisms (rate q = `dp_sample_rate`, multiplier sigma): amplified by the
sampling, and composed with the Gaussian releases above (`run_epsilon`).

Uses Google's dp-accounting (an edge / cloud / CLI dependency, imported lazily; devices only
need sigma): "rdp" (Renyi DP, Mironov 2017; fast, a few percent to ~10 % conservative) or
"pld" (privacy loss distributions; tight, but seconds per evaluation for many releases).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

Method = Literal["rdp", "pld"]
DELTA = 1e-5


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise ImportError("DP accounting needs dp-accounting: pip install 'splitedge[privacy]'") from None
    return dp_accounting


def gaussian_event(sigma: float, releases: int = 1) -> Any:
    """The dp_accounting event of `releases` Gaussian releases with noise multiplier `sigma`."""
    dpa = _dp_accounting()
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0 for a finite epsilon, got {sigma}")
    if releases < 0:
        raise ValueError(f"releases must be >= 0, got {releases}")
    return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(float(sigma)), int(releases))


def epsilon_of(event: Any, delta: float = DELTA, method: Method = "rdp") -> float:
    """Epsilon of any dp_accounting event at `delta`."""
    dpa = _dp_accounting()
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if method == "rdp":
        acc = dpa.rdp.RdpAccountant()
    elif method == "pld":
        acc = dpa.pld.PLDAccountant()
    else:
        raise ValueError(f"method must be 'rdp' or 'pld', got {method!r}")
    with _unconverged_orders_quiet():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


UNCONVERGED = "_compute_log_a_frac failed to converge"
"""The start of dp-accounting's warning for a fractional Renyi order (1.1 to about 1.5 at
sigma near 1) whose series for a Poisson-subsampled Gaussian did not converge in 1,000 terms.
The RDP accountant then leaves that order out (its RDP is taken as infinite), so epsilon is the
minimum over the other orders: never below what the order would have given, and the same figure
whether or not the warning is shown. It comes with every DP-SGD epsilon (each round's record of
a dp_unit=sample run), so it is dropped, this message only and only while we compute."""


class _DropUnconverged(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(UNCONVERGED)


_QUIET = _DropUnconverged()
_QUIET_LOCK = threading.Lock()
_quiet_users = 0


@contextlib.contextmanager
def _unconverged_orders_quiet() -> Iterator[None]:
    """While the body runs, the "absl" logger (dp-accounting logs through absl) drops UNCONVERGED
    and nothing else; counted, so that threads computing epsilons at once leave it as they found it."""
    global _quiet_users
    absl = logging.getLogger("absl")
    with _QUIET_LOCK:
        if _quiet_users == 0:
            absl.addFilter(_QUIET)
        _quiet_users += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_users -= 1
            if _quiet_users == 0:
                absl.removeFilter(_QUIET)


def epsilon(sigma: float, releases: int = 1, delta: float = DELTA, method: Method = "rdp") -> float:
    """Epsilon at `delta` after `releases` Gaussian releases of noise multiplier `sigma`
    (0 releases: 0; sigma = 0: inf)."""
    if releases == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return epsilon_of(gaussian_event(sigma, releases), delta, method)


def dpsgd_event(sample_rate: float, sigma: float, steps: int) -> Any:
    """The dp_accounting event of `steps` DP-SGD steps: each the Gaussian mechanism of multiplier
    `sigma` on a Poisson sample of rate `sample_rate` (dpsgd.py)."""
    dpa = _dp_accounting()
    if not 0 < sample_rate <= 1 or not sigma > 0 or steps < 0:
        raise ValueError(f"need sample_rate in (0, 1], sigma > 0 and steps >= 0, got {sample_rate}, {sigma}, {steps}")
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(float(sample_rate), dpa.GaussianDpEvent(float(sigma))),
                                   int(steps))


def run_epsilon(sigma: float, releases: int = 0, steps: int = 0, sample_rate: float = 0.0, delta: float = DELTA,
                method: Method = "rdp") -> float:
    """Epsilon at `delta` of a device that made `releases` Gaussian releases and `steps` DP-SGD
    steps at rate `sample_rate`, all at multiplier `sigma`, composed (0 of both: 0; sigma 0: inf)."""
    if releases == 0 and steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    dpa = _dp_accounting()
    events = ([gaussian_event(sigma, releases)] if releases else []) + \
        ([dpsgd_event(sample_rate, sigma, steps)] if steps else [])
    return epsilon_of(dpa.ComposedDpEvent(events), delta, method)


def privacy_spent(cfg: Any, last: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A round record's privacy fields with DP on (`cfg.dp_sigma` > 0; else none): the releases
    of the device that made the most (an upper bound, summed over phases and rounds: the `last`
    record's total plus this round's `metrics`) and the epsilon at `dp_delta` they spend,
    composed under dp_unit=sample with every round's DP-SGD steps (dpsgd.steps, counted for every
    round, an upper bound for a device that sat one out); with distributed DP, the devices whose
    noise each sum adds up (distributed.py)."""
    if not cfg.dp_sigma > 0:
        return {}
    from splitedge.methods.privacy.dpsgd import steps

    total = int(last.get("dp_releases_total", 0)) + int(metrics.get("dp_releases", 0)) + \
        int(metrics.get("calibration_dp_releases", 0))
    spent: dict[str, Any] = {"dp_unit": cfg.dp_unit, "dp_releases_total": total}
    sgd = 0
    if cfg.dp_unit == "sample":  # every round, each device takes at most steps(cfg) DP-SGD steps (a public count)
        sgd = int(last.get("dp_sgd_steps_total", 0)) + steps(cfg)
        spent.update(dp_sgd_steps_total=sgd, dp_sample_rate=cfg.dp_sample_rate)
    spent["dp_epsilon"] = run_epsilon(cfg.dp_sigma, total, sgd, cfg.dp_sample_rate, cfg.dp_delta)
    if cfg.dp_devices > 1:  # the epsilon holds while each sum holds that many devices whose noise is unknown
        spent["dp_devices"] = int(cfg.dp_devices)
    return spent


def sigma_for_epsilon(target: float, releases: int = 1, delta: float = DELTA, method: Method = "rdp",
                      rtol: float = 1e-4, *, steps: int = 0, sample_rate: float = 0.0) -> float:
    """The smallest noise multiplier whose epsilon after `releases` (and `steps` DP-SGD steps at
    `sample_rate`) is <= `target` (bisection on sigma, epsilon being decreasing in it), to
    relative precision `rtol`: how `--dp-epsilon` becomes the sigma devices are told."""
    if not target > 0:
        raise ValueError(f"target epsilon must be > 0, got {target}")
    if releases < 0 or steps < 0 or releases + steps < 1:
        raise ValueError(f"releases and steps must be >= 0, one of them >= 1, got {releases} and {steps}")

    def spent(sigma: float) -> float:
        return run_epsilon(sigma, releases, steps, sample_rate, delta, method)

    lo, hi = 0.0, 1.0
    while spent(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"epsilon {target} at delta {delta} is out of reach")
    while hi - lo > rtol * hi:
        mid = (lo + hi) / 2
        if spent(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def releases(rounds: int, every: int = 1, offset: int = 0, last: bool = False) -> int:
    """How many of rounds 1..`rounds` send: those with (round - offset) % every == 0, and the last
    one too if `last`. Head statistics: every=calibrate_every, last=True; H-SFP moments resent on
    a new W_c: every=ic, offset=1 (rounds 1, ic+1, 2ic+1, ...); weights or stats of every round:
    every=1. A Ledger fed with what was actually sent needs no such prediction."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    sent = {r for r in range(1, rounds + 1) if (r - offset) % every == 0}
    if last and rounds >= 1:
        sent.add(rounds)
    return len(sent)


class Ledger:
    """What one device has released so far, per round (several releases in one round, of
    possibly different sigmas, compose); epsilon per round and over the run."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[float]] = {}

    def record(self, round_: int, sigma: float, count: int = 1) -> None:
        self.rounds.setdefault(round_, []).extend([float(sigma)] * count)

    def _event(self, sigmas: Iterable[float]) -> Any:
        dpa = _dp_accounting()
        counts: dict[float, int] = {}
        for s in sigmas:
            counts[s] = counts.get(s, 0) + 1
        return dpa.ComposedDpEvent([gaussian_event(s, n) for s, n in sorted(counts.items())])

    def epsilon(self, delta: float = DELTA, method: Method = "rdp", round_: int | None = None) -> float:
        """Epsilon at `delta` of round `round_`'s releases, or (None) of all of them."""
        sigmas = self.rounds.get(round_, []) if round_ is not None else [s for v in self.rounds.values() for s in v]
        if not sigmas:
            return 0.0
        if min(sigmas) == 0:
            return math.inf
        return epsilon_of(self._event(sigmas), delta, method)
