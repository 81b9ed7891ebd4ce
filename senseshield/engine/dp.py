"""Client-side Gaussian mechanisms on update vectors (pure numpy, no accounting).

The accounting (Opacus' RDP accountant) lives in :mod:`senseshield.accounting`; here are
only the clip-and-noise steps a client applies to the values it is about to send:

* :func:`clip_l2` — scale a sub-vector to L2 norm at most ``clip`` (SelectiveShield eq. 20);
* :func:`gaussian_noise` — clip the sub-vector at ``positions`` and add N(0, std_j²) per
  coordinate, with ``std_j = clip · sigma · scale_j`` (eq. 21 with ``scale = sqrt(|K|)``;
  Selective-DP eq. 10 with a per-coordinate schedule ``scale_j >= 1``);
* :func:`sensitivity_schedule` — the Selective-DP budget schedule: more noise where the
  sensitivity is higher, never less than the accounted ``sigma``;
* :func:`distributed_noise` — distributed DP on masked sums (``masked-dp``): each agent clips
  its whole update and adds its share N(0, (clip·sigma)² / shares) of the sum's noise
  (:func:`noised_for` sizes the shares, :func:`realised_sigma` is what a sum of fewer
  contributors carried).

Adding noise with ``scale_j >= 1`` is the accounted Gaussian mechanism (std ``clip·sigma``)
followed by extra independent noise, i.e. post-processing, so the accounted epsilon is an
upper bound for every schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from senseshield.errors import ConfigError

if TYPE_CHECKING:
    from senseshield.engine.csprng import NoiseSource


def check_sigma(sigma: float) -> float:
    """Raise ConfigError unless ``sigma`` is a finite number >= 0."""
    if not (np.isfinite(sigma) and sigma >= 0):
        raise ConfigError(f"Noise multiplier sigma={sigma!r} is not allowed; it must be a finite number >= 0.")
    return float(sigma)


def check_clip(clip: float) -> float:
    if not (np.isfinite(clip) and clip > 0):
        raise ConfigError(f"Clipping norm C={clip!r} is not allowed; it must be a finite number > 0.")
    return float(clip)


def clip_l2(values: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """``values · min(1, clip / ||values||)`` and the norm before clipping."""
    check_clip(clip)
    values = np.asarray(values, dtype=np.float64)
    norm = float(np.linalg.norm(values))
    if norm > clip:
        values = values * (clip / norm)
    return values, norm


@dataclass(frozen=True)
class NoiseReport:
    """What a client did to the sub-vector it noised (for round reports)."""

    count: int  # coordinates noised
    norm_before: float  # L2 norm before clipping
    clipped: bool
    noise_std_mean: float  # mean per-coordinate std


def gaussian_noise(
    delta: np.ndarray,
    positions: np.ndarray,
    *,
    clip: float,
    sigma: float,
    rng: np.random.Generator,
    scale: float | np.ndarray = 1.0,
) -> tuple[np.ndarray, NoiseReport]:
    """Clip ``delta[positions]`` to L2 norm ``clip`` and add N(0, (clip·sigma·scale_j)²).

    Returns a new vector (other positions unchanged) and a :class:`NoiseReport`.
    """
    check_sigma(sigma)
    out = np.array(delta, dtype=np.float64, copy=True)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return out, NoiseReport(0, 0.0, False, 0.0)
    scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), positions.shape)
    if np.any(scale < 1.0) or not np.all(np.isfinite(scale)):
        raise ConfigError("Per-coordinate noise scales must be finite and >= 1 (never below the accounted sigma).")
    clipped, norm = clip_l2(out[positions], clip)
    std = clip * sigma * scale
    out[positions] = clipped + rng.standard_normal(positions.size) * std
    return out, NoiseReport(int(positions.size), norm, norm > clip, float(std.mean()))


def relative_noise(
    delta: np.ndarray,
    positions: np.ndarray,
    *,
    ratio: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, NoiseReport]:
    """Add to ``delta[positions]`` Gaussian noise whose expected L2 norm is ``ratio`` times
    that sub-vector's own norm: N(0, s²) per coordinate with s = ratio·‖delta[positions]‖/√k
    (k positions). A noise-to-signal ratio, scale-free (no clipping norm to tune per model),
    against gradient-matching attacks; the noise depends on the update's norm, so this is
    **not** a differential-privacy mechanism and no epsilon is claimed for it.

    Returns a new vector (other positions unchanged) and a :class:`NoiseReport` (its
    ``norm`` is the sub-vector's norm, ``std`` the per-coordinate standard deviation).
    """
    if not (np.isfinite(ratio) and ratio >= 0):
        raise ConfigError(f"Noise ratio {ratio!r} is not allowed; it must be a finite number >= 0.")
    out = np.array(delta, dtype=np.float64, copy=True)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0 or ratio == 0:
        return out, NoiseReport(int(positions.size), 0.0, False, 0.0)
    norm = float(np.linalg.norm(out[positions]))
    std = ratio * norm / np.sqrt(positions.size)
    out[positions] += rng.standard_normal(positions.size) * std
    return out, NoiseReport(int(positions.size), norm, False, float(std))


def sensitivity_schedule(scores: np.ndarray, *, skew: float) -> np.ndarray:
    """Selective-DP budget schedule: noise scale ``1 + skew · rank(score)`` in [1, 1 + skew].

    ``rank`` is the normalised rank in [0, 1] (0 for the least sensitive coordinate of the
    set, 1 for the most sensitive), so the most sensitive coordinates get the most noise
    (the smallest share of the budget). ``skew = 0`` is uniform noise.
    """
    if not (np.isfinite(skew) and skew >= 0):
        raise ConfigError(f"Budget skew {skew!r} is not allowed; it must be a finite number >= 0.")
    scores = np.asarray(scores, dtype=np.float64)
    if scores.size <= 1:
        return np.ones_like(scores)
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[np.argsort(scores, kind="stable")] = np.arange(scores.size)
    return 1.0 + skew * ranks / (scores.size - 1)


# ---- distributed DP on masked sums (masked-dp, docs/security.md) -------------------------
def noised_for(participants: int, quorum: float) -> int:
    """The number of contributors each agent's noise share is sized for: ``ceil(quorum · m)``
    of the round's ``m`` planned participants (at least 1). The sum of that many shares has
    the accounted noise; every further contributor adds more."""
    if not (np.isfinite(quorum) and 0.0 < quorum <= 1.0):
        raise ConfigError(f"dp_quorum={quorum!r} is not allowed; give a fraction of the round's participants in (0, 1].")
    if participants < 1:
        raise ConfigError(f"participants={participants!r} is not allowed; a round has at least 1 participant.")
    return max(1, int(np.ceil(quorum * participants - 1e-9)))


def share_std(*, clip: float, sigma: float, shares: int) -> float:
    """Per-coordinate std of one agent's share of the sum's noise: ``clip · sigma / sqrt(shares)``,
    so ``shares`` independent shares add up to N(0, (clip · sigma)²), the central Gaussian
    mechanism on the sum of updates clipped to ``clip``."""
    check_clip(clip)
    check_sigma(sigma)
    if shares < 1:
        raise ConfigError(f"shares={shares!r} is not allowed; the noise is split over at least 1 contributor.")
    return clip * sigma / float(np.sqrt(shares))


def distributed_noise(
    delta: np.ndarray, *, clip: float, sigma: float, shares: int, rng: NoiseSource
) -> tuple[np.ndarray, NoiseReport]:
    """Clip the whole update to L2 norm ``clip`` and add this agent's noise share
    N(0, (clip · sigma)² / shares) per coordinate (:func:`share_std`)."""
    std = share_std(clip=clip, sigma=sigma, shares=shares)
    clipped, norm = clip_l2(delta, clip)
    out = clipped + rng.standard_normal(clipped.size) * std
    return out, NoiseReport(int(clipped.size), norm, norm > clip, std)


def realised_sigma(sigma: float, *, shares: int, contributed: int) -> float:
    """The noise multiplier the key server's sum actually carried when ``contributed`` agents,
    each adding a share sized for ``shares``, entered it: ``sigma · sqrt(contributed / shares)``,
    never counted above ``sigma`` (extra contributors' noise is not claimed, so a calibrated
    run meets its target exactly when at least ``shares`` contribute)."""
    check_sigma(sigma)
    if shares < 1 or contributed < 0:
        raise ConfigError(f"shares={shares!r}, contributed={contributed!r} are not allowed; shares >= 1, contributed >= 0.")
    return sigma * float(np.sqrt(min(1.0, contributed / shares)))
