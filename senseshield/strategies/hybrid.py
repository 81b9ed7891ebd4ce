"""Hybrid HE + DP strategies: SelectiveShield, Selective-DP, DP baselines, Alt-FL.

See docs/hybrid.md for the protocol of each and what we decided where the papers leave room.
Every strategy is hooks only; the round (train, score, negotiate, protect, aggregate,
decrypt, merge) is :mod:`senseshield.rounds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from senseshield.engine.dp import distributed_noise, gaussian_noise, noised_for, realised_sigma, sensitivity_schedule
from senseshield.engine.masks import top_fraction_block_mask
from senseshield.engine.zones import client_zones, consensus_zone, is_primary_round, local_mask
from senseshield.strategies.baselines import MaskedFull
from senseshield.strategies.base import (
    STRATEGIES,
    BootstrapReport,
    ClientContext,
    FleetPlan,
    MaskChoice,
    RoundPlan,
    Strategy,
)


def _block_mask(scores: np.ndarray, *, tau: float, block_size: int) -> np.ndarray:
    """eq. 14 at the HE scheme's granularity: a block is marked if any of its positions is."""
    mask = local_mask(scores, tau=tau)
    if block_size <= 1:
        return mask
    pad = (-mask.size) % block_size
    blocks = np.concatenate([mask, np.zeros(pad, bool)]).reshape(-1, block_size).any(axis=1)
    return np.repeat(blocks, block_size)[: mask.size]


def _sigma(context: ClientContext, fallback: float) -> float:
    return fallback if context.noise_multiplier is None else context.noise_multiplier


@STRATEGIES.register("selectiveshield")
class SelectiveShield(Strategy):
    """SelectiveShield Alg. 1: Fisher masks, consensus zones, CKKS + personalisation + DP.

    Each client marks Ĩ_j > tau (per-layer min-max Fisher, eqs. 12-14) and proposes it; the
    coordinator forms M_enc = positions marked by >= rho of the sampled clients (eq. 16).
    The client encrypts M_enc with CKKS, withholds its personalised zone (own mask minus
    M_enc, eq. 17) and clips the noise zone to C and adds N(0, (C sigma)^2 |K|) (eqs. 20-21).
    After aggregation it keeps its personalised values (selective merge, eq. 27).
    """

    name = "selectiveshield"
    summary = "Fisher zones: CKKS consensus zone, personalised zone kept local, DP noise zone"
    scheme = "ckks"
    score = "fisher"
    negotiates = True
    dp_level = "user"

    def propose(self, sensitivity: np.ndarray, *, block_size: int = 1) -> np.ndarray:
        return _block_mask(sensitivity, tau=self.options.tau, block_size=block_size)

    def consensus(self, proposals: Sequence[np.ndarray], *, size: int, block_size: int = 1) -> np.ndarray:
        return consensus_zone(proposals, rho=self.options.rho)

    def select_mask(self, context: ClientContext, *, sensitivity: np.ndarray, weights: np.ndarray) -> MaskChoice:
        assert context.shared_mask is not None, "selectiveshield needs the round's encrypted zone"
        own = _block_mask(sensitivity, tau=self.options.tau, block_size=context.block_size)
        zones = client_zones(own, context.shared_mask)
        return MaskChoice(
            zones.encrypted,
            {"zones": zones.ratios(), "empty_zones": zones.empty()},
            withheld=zones.personalised if zones.personalised.any() else None,
        )

    def privatise(self, context, delta, choice, *, sensitivity, rng):  # type: ignore[no-untyped-def]
        noise = ~choice.mask if choice.withheld is None else ~choice.mask & ~choice.withheld
        sigma = _sigma(context, self.options.sigma)
        out, report = gaussian_noise(
            delta,
            np.flatnonzero(noise),
            clip=self.options.clip,
            sigma=sigma,
            rng=rng,
            scale=np.sqrt(max(context.participants, 1)),
        )
        return out, {"noised": report.count, "clipped": report.clipped}


@STRATEGIES.register("dp-fedavg")
class DPFedAvg(Strategy):
    """User-level DP-FedAvg: each client clips its whole update to C and adds N(0, (C sigma)^2).

    The noise is added on the client (local DP of the update), so the server never sees an
    un-noised value; the accountant counts one subsampled Gaussian release per round.
    """

    name = "dp-fedavg"
    summary = "user-level DP: clip every update to C, Gaussian noise, RDP accounting"
    scheme = None
    dp_level = "user"

    def select_mask(self, context, *, sensitivity, weights):  # type: ignore[no-untyped-def]
        return MaskChoice(np.zeros(weights.size, dtype=bool))

    def privatise(self, context, delta, choice, *, sensitivity, rng):  # type: ignore[no-untyped-def]
        out, report = gaussian_noise(
            delta, np.arange(delta.size), clip=self.options.clip, sigma=_sigma(context, self.options.sigma), rng=rng
        )
        return out, {"noised": report.count, "clipped": report.clipped}


@STRATEGIES.register("masked-dp")
class MaskedDP(MaskedFull):
    """Distributed DP on masked sums: every parameter masked (as ``masked``), and before
    masking each agent clips its whole update to C and adds its share of the sum's Gaussian
    noise, N(0, (C sigma)^2 / m') per coordinate with m' = ceil(dp_quorum x the round's
    planned participants) (:func:`~senseshield.engine.dp.distributed_noise`). The key server
    unmasks only the cluster sum, which carries N(0, (C sigma)^2) while at least m' agents
    contribute: the central Gaussian mechanism, accounted as dp-fedavg's release, with
    sqrt(m) times less noise on the mean than dp-fedavg at the same epsilon. Updates weigh
    1 each (not n_i), so one client moves the sum by at most C (user-level sensitivity);
    the noise comes from the device's secret ``protect`` stream. docs/security.md.
    """

    name = "masked-dp"
    summary = "every parameter masked, each agent adds its share of Gaussian noise: distributed user-level DP"
    dp_level = "user"
    dp_adjacency = "distributed"

    def sample_weight(self, n_samples: int) -> int:
        return 1  # equal weights: the sum's sensitivity is C whatever a device claims as its n_i

    def release_sigma(self, sigma: float, cohorts: Sequence[tuple[int, int]]) -> float:
        quorum = self.options.dp_quorum
        return min((realised_sigma(sigma, shares=noised_for(planned, quorum), contributed=c)
                    for planned, c in cohorts), default=sigma)

    def privatise(self, context, delta, choice, *, sensitivity, rng):  # type: ignore[no-untyped-def]
        shares = noised_for(context.participants, self.options.dp_quorum)
        out, report = distributed_noise(delta, clip=self.options.clip, sigma=_sigma(context, self.options.sigma),
                                        shares=shares, rng=rng)
        return out, {"noised": report.count, "clipped": report.clipped, "noise_std_mean": report.noise_std_mean,
                     "shares": shares}


@STRATEGIES.register("selective-dp")
class SelectiveDP(Strategy):
    """Selective-DP: noise only the top-k coordinates of |g|·|dw|, sensitivity-guided schedule.

    The mask (fraction ``dp_ratio``) is recomputed every round (eq. 8); the masked
    sub-vector is clipped to C and gets N(0, (C sigma s_j)^2) with s_j in [1, 1 + skew]
    rising with sensitivity (eq. 10 + the budget schedule); the rest is sent unchanged.
    The reported epsilon covers the masked coordinates only (the paper's guarantee).
    """

    name = "selective-dp"
    summary = "noise only on the top-k |g|*|dw| coordinates, sensitivity-guided noise schedule"
    scheme = None
    score = "grad_delta"
    dp_level = "user"

    def select_mask(self, context, *, sensitivity, weights):  # type: ignore[no-untyped-def]
        return MaskChoice(np.zeros(weights.size, dtype=bool))

    def privatise(self, context, delta, choice, *, sensitivity, rng):  # type: ignore[no-untyped-def]
        selected = top_fraction_block_mask(sensitivity, ratio=max(self.options.dp_ratio, 1e-12), block_size=1)
        positions = np.flatnonzero(selected)
        scale = sensitivity_schedule(sensitivity[positions], skew=self.options.budget_skew)
        out, report = gaussian_noise(
            delta, positions, clip=self.options.clip, sigma=_sigma(context, self.options.sigma), rng=rng, scale=scale
        )
        return out, {"noised": report.count, "clipped": report.clipped, "noise_std_mean": report.noise_std_mean}


@STRATEGIES.register("dpsgd")
class DPSGD(Strategy):
    """Record-level DP-SGD on every client through Opacus' PrivacyEngine; nothing encrypted."""

    name = "dpsgd"
    summary = "record-level DP-SGD (Opacus PrivacyEngine), plaintext aggregation"
    scheme = None
    dp_level = "record"

    def round_plan(self, round: int) -> RoundPlan:
        return RoundPlan(dpsgd=True)

    def select_mask(self, context, *, sensitivity, weights):  # type: ignore[no-untyped-def]
        return MaskChoice(np.zeros(weights.size, dtype=bool))


class _AltFL(Strategy):
    """Alt-FL (PI, SI/DP, SI/HE, MP): S-HE with a fixed mask, DP-SGD, synthetic rounds.

    The S-HE mask is the top ``he_ratio`` (eta) fraction of the server-averaged bootstrap
    sensitivity, fixed for the run. The round type follows ``t mod rho_tot < rho_tot - rho_syn``.
    Subclasses say what a "primary" round (rule true) and a secondary round do.
    """

    scheme = "ckks"
    needs_bootstrap_sensitivity = True
    primary: ClassVar[RoundPlan]
    secondary: ClassVar[RoundPlan]
    encrypt_primary: ClassVar[bool]
    encrypt_secondary: ClassVar[bool]

    def _primary(self, round: int) -> bool:
        return is_primary_round(round, rho_syn=self.options.rho_syn, rho_tot=self.options.rho_tot)

    def plan_fleet(self, reports: Sequence[BootstrapReport], *, size: int, block_size: int = 1) -> FleetPlan:
        plan = super().plan_fleet(reports, size=size)
        vectors = [r.sensitivity for r in reports if r.sensitivity is not None]
        mean = np.mean(np.stack(vectors), axis=0) if vectors else np.zeros(size)
        plan.fixed_masks[0] = top_fraction_block_mask(mean, ratio=self.options.he_ratio, block_size=block_size)
        return plan

    def round_plan(self, round: int) -> RoundPlan:
        return self.primary if self._primary(round) else self.secondary

    def select_mask(self, context, *, sensitivity, weights):  # type: ignore[no-untyped-def]
        encrypt = self.encrypt_primary if self._primary(context.round) else self.encrypt_secondary
        if not encrypt:
            return MaskChoice(np.zeros(weights.size, dtype=bool), {"round_type": self._kind(context.round)})
        assert context.shared_mask is not None, f"{self.name} needs its fixed S-HE mask"
        return MaskChoice(context.shared_mask.copy(), {"round_type": self._kind(context.round)})

    def _kind(self, round: int) -> str:
        plan = self.round_plan(round)
        encrypt = self.encrypt_primary if self._primary(round) else self.encrypt_secondary
        parts = [p for p, on in (("dpsgd", plan.dpsgd), ("synthetic", plan.synthetic), ("s-he", encrypt)) if on]
        return "+".join(parts) or "plain"


@STRATEGIES.register("alt-pi")
class AltPI(_AltFL):
    """Privacy Interleaving (Alg. 3): S-HE rounds when the rule holds, DP-SGD rounds otherwise."""

    name = "alt-pi"
    summary = "Alt-FL PI: alternate selective-HE rounds and DP-SGD rounds"
    dp_level = "record"
    primary = RoundPlan()
    secondary = RoundPlan(dpsgd=True)
    encrypt_primary = True
    encrypt_secondary = False


@STRATEGIES.register("alt-si-dp")
class AltSIDP(_AltFL):
    """Synthetic Interleaving with DP (Alg. 1): DP-SGD on real data, plaintext synthetic rounds."""

    name = "alt-si-dp"
    summary = "Alt-FL SI/DP: authentic DP-SGD rounds, plaintext rounds on DP synthetic data"
    scheme = None
    needs_bootstrap_sensitivity = False
    dp_level = "record"
    needs_synthetic = True
    primary = RoundPlan(dpsgd=True)
    secondary = RoundPlan(synthetic=True)
    encrypt_primary = False
    encrypt_secondary = False

    def plan_fleet(self, reports, *, size, block_size=1):  # type: ignore[no-untyped-def]
        return Strategy.plan_fleet(self, reports, size=size)


@STRATEGIES.register("alt-si-he")
class AltSIHE(_AltFL):
    """Synthetic Interleaving with HE (Alg. 2): S-HE on real data, plaintext synthetic rounds."""

    name = "alt-si-he"
    summary = "Alt-FL SI/HE: authentic selective-HE rounds, plaintext rounds on DP synthetic data"
    needs_synthetic = True
    primary = RoundPlan()
    secondary = RoundPlan(synthetic=True)
    encrypt_primary = True
    encrypt_secondary = False


@STRATEGIES.register("alt-mp")
class AltMP(_AltFL):
    """MP baseline (Sébert et al.): DP-SGD and selective HE in every round."""

    name = "alt-mp"
    summary = "Alt-FL MP: DP-SGD and selective HE every round"
    dp_level = "record"
    primary = RoundPlan(dpsgd=True)
    secondary = RoundPlan(dpsgd=True)
    encrypt_primary = True
    encrypt_secondary = True


__all__: list[str] = []
_ = Any
