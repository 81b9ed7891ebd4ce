"""Privacy accounting through Opacus (one place for every DP strategy), and against whom it holds.

* :class:`Accountant` wraps ``opacus.accountants.RDPAccountant``: ``step(sigma, q)`` per
  release, ``epsilon(delta)`` by RDP or (``accountant="pld"``) by Opacus' PRV accountant.
  Its ``history`` is plain data, so a client (or the simulator for it) keeps it between rounds.
* :func:`calibrate_sigma` is Opacus' ``get_noise_multiplier``: the smallest noise multiplier
  that keeps ``steps`` releases at sample rate ``q`` within (target_epsilon, delta). An
  unreachable target raises :class:`ConfigError`.
* :func:`epsilons`: a run's epsilon against an outside observer of the released models and
  against the server, by RDP and by PLD.

**Against whom.** Client sampling (``sample_rate`` q < 1) amplifies privacy only against an
adversary who does not know who was sampled: an outside observer of the released models.
The coordinator knows (each update arrives under its agent id), so against the server a
client's guarantee is that of the unamplified Gaussian mechanism (q = 1) composed over the
rounds it took part in. The sampling is independent of the data and the server sees it, so
the guarantee given the run's actual sampling is a valid one (for every sampling outcome,
the mechanism that follows it is that Gaussian composition); we report it for the client
sampled most often (``server_rounds``). Before a run, the promise that holds whatever the
sampling is the worst case, the same mechanism over every DP round
(``Accountant.unamplified(Accountant.releases)``): for dp-fedavg at q = 0.3, sigma 3.32,
5 rounds, delta 1e-5, 1.00 against an observer, 2.27 against the server for a client
sampled 3 times, 3.02 for one sampled in all 5 (RDP). The worst case is never below the
observer's figure; the figure for the actual sampling can be, in a fleet of one or two
clients at a high rate (q = 0.9, 10 rounds, sigma 2: 7.38 amplified, 7.08 for a client
sampled 8 times), because the amplified figure holds whatever the sampling and this one
only for the sampling that happened. They answer different questions; both hold.

**Adjacency.** User level, against an observer: add/remove one client (Opacus' analysis of
the Poisson-sampled Gaussian, the client's update clipped to norm C). Against the server the
client's presence is known (add/remove is visible in the agent ids), so the neighbouring run
keeps the client and zeroes its update: zero-out adjacency (Kairouz et al., ICML 2021),
sensitivity C again. The server sees each sampled client's own noised update (dp-fedavg;
selective-dp its noised coordinates; selectiveshield its noise zone, noised at sigma
sqrt(|K|), so sigma is an upper bound there), which is then exactly a Gaussian mechanism
at sigma per participation. Under replace-one adjacency (the client's data swapped for any
other) the sensitivity is 2C, the guarantee that of sigma / 2: in the example 4.97 (RDP) or
4.60 (exact) for 3 participations instead of 2.27 and 2.09. Record level (DP-SGD): add/
remove one record of a client's data; its batch sampling happens on the device, out of the
server's sight, so the amplification holds against the server too and both figures agree.

**Distributed noise** (``masked-dp``): no party sees an individual update, only the key
server the cluster's sum, which carries the central noise N(0, (C sigma)^2) split over the
contributors. The noise then depends on who contributes, not on anyone's data, so both
figures use zero-out adjacency (the client's update zeroed, its noise share kept); against
the observer it is the same sampled Gaussian (Kairouz et al. 2021 show the accounting carries
over). The "server" figure holds against the key server and the coordinator each alone.

**Accountants.** ``epsilon`` / ``server`` are Opacus' RDP (what :func:`calibrate_sigma`
calibrates, so a ``--target-epsilon`` run meets its target against an observer); the
``*_pld`` figures are Opacus' PRV accountant (Gopi, Lee, Wutschitz, NeurIPS 2021: numerical
composition of privacy loss distributions, an upper bound within ``eps_error`` = 0.01 of
the exact value), about 10 % tighter. tests/test_accounting.py checks both against Google's
``dp-accounting`` (RDP to 1e-9; PLD), Microsoft's ``prv_accountant``, the integer-order RDP
formula of the sampled Gaussian (Mironov, Talwar, Zhang 2019) and the exact epsilon of a
Gaussian (Balle and Wang 2018).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from senseshield.errors import ConfigError

History = list[tuple[float, float, int]]  # (noise multiplier, sample rate, releases), as Opacus keeps it


class Accountant:
    """RDP accountant over Gaussian releases (subsampled with rate q)."""

    def __init__(self, history: History | None = None) -> None:
        from opacus.accountants import RDPAccountant  # opacus loads when accounting runs, not at a service's start

        self._acc = RDPAccountant()
        self._acc.history = list(history or [])

    @property
    def history(self) -> History:
        return list(self._acc.history)

    @property
    def releases(self) -> int:
        """Releases so far (the steps of the history)."""
        return sum(count for _, _, count in self._acc.history)

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
        from opacus.accountants import PRVAccountant

        prv = PRVAccountant()
        prv.history = list(self._acc.history)
        with warnings.catch_warnings():  # q = 1 takes a log(0) branch inside the PRV of a subsampled Gaussian
            warnings.simplefilter("ignore", RuntimeWarning)
            return float(prv.get_epsilon(delta=delta))

    def unamplified(self, releases: int) -> "Accountant":
        """The same noise without subsampling (q = 1), for ``releases`` of the history's
        releases (the ones with the least noise first): what the server, which knows who was
        sampled, can tell about a client that took part in that many. ``releases`` = all of
        them is the guarantee against the server whatever the sampling."""
        steps: History = []
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
    from opacus.accountants.utils import get_noise_multiplier

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


ADJACENCY = {
    "user": "add/remove one client; against the server, one sampled client's update zeroed out",
    "record": "add/remove one record of a client's data",
    # masked-dp: only the cluster sum is ever seen, its noise split over the contributors
    "distributed": ("one client's clipped update zeroed out, its noise share stays; 'server' is the key server "
                    "(it alone unmasks the sum) and the coordinator, each alone; agents colluding with the "
                    "key server remove their own shares"),
}


@dataclass(frozen=True)
class Epsilons:
    """A run's epsilon at ``delta`` against an outside observer of the released models and
    against the server, by RDP (``observer``, ``server``) and by PLD (``*_pld``, Opacus'
    PRV; ``None`` unless asked for). ``server_rounds``: the releases the user-level server
    figure composes (the rounds of the client sampled most often); ``None`` at record level.
    See the module docstring for the adjacency of each figure."""

    observer: float
    server: float
    observer_pld: float | None = None
    server_pld: float | None = None
    server_rounds: int | None = None


def epsilons(delta: float, *, user: Accountant | None = None, participations: int = 0,
             records: Sequence[History] = (), pld: bool = False) -> Epsilons:
    """Epsilons of a run so far: ``user``, the coordinator's user-level accountant (one
    release per DP round, rate q), when the client sampled most often took part in
    ``participations`` of those releases; ``records``, each client's DP-SGD history. The
    figure of each is the worst over the accountants that apply (a strategy has one DP
    level; 0 before any release). ``pld``: also by PLD, never above the RDP figure (both
    are upper bounds; PRV's grid gives up, inf, for epsilons in the hundreds)."""
    if participations < 0 or (user is not None and participations > user.releases):
        raise ConfigError(f"participations {participations} is not allowed; use 0 to the "
                          f"{0 if user is None else user.releases} user-level releases.")
    pairs = [(user, user.unamplified(participations))] if user is not None and user.history else []
    pairs += [(acc, acc) for acc in (Accountant(h) for h in records if h)]

    def worst(method: str) -> tuple[float, float]:
        observer = server = 0.0
        for o, s in pairs:
            eo = o.epsilon(delta, accountant=method)
            es = eo if s.history == o.history else s.epsilon(delta, accountant=method)  # q = 1: the same
            observer, server = max(observer, eo), max(server, es)
        return observer, server

    observer, server = worst("rdp")
    rounds = participations if user is not None and user.history else None
    if not pld:
        return Epsilons(observer, server, server_rounds=rounds)
    observer_pld, server_pld = worst("pld")
    return Epsilons(observer, server, min(observer_pld, observer), min(server_pld, server), rounds)
