"""Privacy accounting through Opacus' RDP accountant (one place for every DP strategy).

* :class:`Accountant` wraps ``opacus.accountants.RDPAccountant``: ``step(sigma, q)`` per
  release, ``epsilon(delta)``. Its ``history`` is plain data, so a client (or the simulator
  for it) keeps it between rounds.
* :func:`calibrate_sigma` is Opacus' ``get_noise_multiplier``: the smallest noise multiplier
  that keeps ``steps`` releases at sample rate ``q`` within (target_epsilon, delta). An
  unreachable target raises :class:`ConfigError`.
* :func:`user_level_epsilons`: against whom the user-level epsilon holds (issue 16).

**Against whom.** Client sampling (``sample_rate`` q < 1) amplifies privacy only against an
adversary who does not know who was sampled: an outside observer of the released models.
The coordinator knows (each update arrives under its agent id), so against the server a
client's guarantee is that of the unamplified Gaussian mechanism composed over the rounds it
took part in. Both figures use the add/remove-one-client adjacency of Opacus' sampled
Gaussian analysis (Poisson sampling); under replace-one adjacency the guarantees roughly
double. ``*_pld`` figures come from Opacus' PRV accountant (Gopi, Lee, Wutschitz, NeurIPS
2021: numerical composition of privacy loss distributions), tighter than RDP's conversion;
the RDP figures stay the calibrated ones (``calibrate_sigma`` uses RDP).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from senseshield.errors import ConfigError


class Accountant:
    """RDP accountant over Gaussian releases (subsampled with rate q)."""

    def __init__(self, history: list[tuple[float, float, int]] | None = None) -> None:
        self._acc = RDPAccountant()
        self._acc.history = list(history or [])

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return list(self._acc.history)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        for _ in range(steps):
            self._acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def epsilon(self, delta: float, *, accountant: str = "rdp") -> float:
        """Epsilon spent so far at ``delta`` (0 before any release, inf with sigma = 0);
        ``accountant``: ``"rdp"`` (Opacus' RDP, the default) or ``"pld"`` (Opacus' PRV)."""
        if accountant not in ("rdp", "pld"):
            raise ConfigError(f"accountant {accountant!r} is not allowed; use rdp or pld.")
        if not self._acc.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self._acc.history):
            return math.inf
        if accountant == "rdp":
            return float(self._acc.get_epsilon(delta=delta))
        prv = PRVAccountant()
        prv.history = list(self._acc.history)
        with warnings.catch_warnings():  # q = 1 takes a log(0) branch inside the PRV of a subsampled Gaussian
            warnings.simplefilter("ignore", RuntimeWarning)
            return float(prv.get_epsilon(delta=delta))

    def unamplified(self, releases: int) -> "Accountant":
        """The same noise without subsampling (q = 1), for ``releases`` of the history's
        releases (the ones with the least noise first): what the server, which knows who was
        sampled, can tell about a client that took part in that many."""
        steps: list[tuple[float, float, int]] = []
        left = releases
        for sigma, _, count in sorted(self._acc.history):
            take = min(count, left)
            if take > 0:
                steps.append((sigma, 1.0, take))
                left -= take
        return Accountant(steps)


def calibrate_sigma(*, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Noise multiplier for ``steps`` releases at rate ``sample_rate`` to stay within the target."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError(f"Target epsilon {target_epsilon!r} is not allowed; it must be a finite number > 0.")
    if steps < 1:
        raise ConfigError(f"Target epsilon needs at least one private release, not {steps}.")
    try:
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant="rdp",
            )
        )
    except ValueError as exc:
        raise ConfigError(
            f"Target epsilon {target_epsilon} at delta {delta} is unreachable in {steps} private "
            f"release(s) at sample rate {sample_rate:g} ({exc}); raise epsilon or lower the rounds."
        ) from None


@dataclass(frozen=True)
class Epsilons:
    """A user-level run's epsilon at ``delta`` against an outside observer of the released
    models (with the sampling amplification) and against the server (without it, for the
    client that took part most often), by RDP and by PLD (PRV)."""

    observer: float
    server: float
    observer_pld: float
    server_pld: float


def user_level_epsilons(accountant: Accountant, participations: int, delta: float) -> Epsilons:
    """:class:`Epsilons` of the coordinator's user-level ``accountant`` (one release per
    round, rate q) when the most frequent client took part in ``participations`` rounds."""
    server = accountant.unamplified(participations)
    return Epsilons(accountant.epsilon(delta), server.epsilon(delta),
                    accountant.epsilon(delta, accountant="pld"), server.epsilon(delta, accountant="pld"))
