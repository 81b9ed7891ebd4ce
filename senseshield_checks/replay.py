"""The coordinator's noise-replay attack (issue 24), written apart from the privacy engine.

Until issue 24 every device drew its privacy noise from values the coordinator holds: the
plaintext noise from ``numpy.random.default_rng([job seed, 3, round, index])``, DP-SGD's
Poisson sampling and gradient noise from torch generators seeded ``client_seed(job seed,
round, index)`` and that plus one. The attacker here regenerates those draws and subtracts
them from what a device sent. Against the old draws it recovers the clean update to
float32 rounding; against secret draws it subtracts somebody else's noise, so the result is
about sqrt(2) times farther from the clean update than the noisy one was.

To score the attack the clean update is needed; :func:`mechanism_oracle` gets it from the
strategy's own mechanism run with constant draws (0: the clipped values without noise; 1:
the per-coordinate standard deviation), which only a test or benchmark holding the
device's update can do. The attacker itself uses only the job's seed, the round, the
device's index, what the device sent, and the noise scale (which a DP job publishes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class Constant:
    """A source of draws that always returns ``value`` (the oracle's instrument)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def standard_normal(self, size=None):  # noqa: ANN001, ANN201
        return np.full(size, self.value, dtype=np.float64)

    def normal(self, loc=0.0, scale=1.0, size=None):  # noqa: ANN001, ANN201
        return loc + np.asarray(scale) * np.full(size, self.value)


def old_protect_draws(seed: int, round: int, index: int) -> np.random.Generator:
    """How every device drew its plaintext noise before issue 24 (``protect_rng``)."""
    return np.random.default_rng([seed, 3, round, index])


def old_client_seed(seed: int, round: int, index: int) -> int:
    """``senseshield.rounds.client_seed`` as the coordinator computes it from the job."""
    return int(np.random.SeedSequence([seed, round, index]).generate_state(1)[0])


def old_dpsgd_generators(seed: int, round: int, index: int) -> list[torch.Generator]:
    """DP-SGD's Poisson-sampling and noise generators before issue 24."""
    s = old_client_seed(seed, round, index)
    return [torch.Generator().manual_seed(s), torch.Generator().manual_seed(s + 1)]


def mechanism_oracle(strategy, context, delta: np.ndarray, choice, sensitivity: np.ndarray,  # noqa: ANN001
                     positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(clean values, per-coordinate noise std) of ``strategy.privatise`` at ``positions``."""
    zero, _ = strategy.privatise(context, delta, choice, sensitivity=sensitivity, rng=Constant(0.0))
    one, _ = strategy.privatise(context, delta, choice, sensitivity=sensitivity, rng=Constant(1.0))
    return zero[positions], (one - zero)[positions]


@dataclass(frozen=True)
class Replay:
    """Distances from the clean update: of what was sent, and of what the attacker recovered."""

    noisy: float
    recovered: float

    @property
    def relative_error(self) -> float:
        """|recovered - clean| / |noisy - clean|: ~1e-8 when the noise came off, ~1.4 when not."""
        return self.recovered / self.noisy if self.noisy > 0 else float("nan")


def replay_plaintext(sent: np.ndarray, clean: np.ndarray, std: np.ndarray, draws: np.random.Generator) -> Replay:
    """Subtract ``draws``' normals (in position order over the noised coordinates, as the
    mechanisms draw them) scaled by ``std`` from the ``sent`` plaintext values."""
    sent = np.asarray(sent, dtype=np.float64)
    noised = np.flatnonzero(std > 0)
    recovered = sent.copy()
    recovered[noised] -= draws.standard_normal(noised.size) * std[noised]
    return Replay(float(np.linalg.norm(sent - clean)), float(np.linalg.norm(recovered - clean)))


def dpsgd_noise_delta(model: torch.nn.Module, *, n: int, batch_size: int, lr: float, std: float,
                      sampling: torch.Generator, noise: torch.Generator) -> np.ndarray:
    """The noise part of a plain-SGD DP-SGD update through Opacus, regenerated from its two
    generators: ``-lr / B · Σ_steps N(0, std²)`` per parameter (B = Opacus' expected batch
    size), one draw per parameter per non-empty Poisson batch. The generators are consumed."""
    rate = 1.0 / int(np.ceil(n / min(batch_size, n)))
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for _ in range(int(1 / rate)):
        if not bool((torch.rand(n, generator=sampling) < rate).any()):
            continue  # an empty batch: the training loop skips it, no noise is drawn
        for t, p in zip(total, params):
            t += torch.normal(mean=0.0, std=std, size=p.shape, generator=noise)
    scale = -lr / int(n * rate)
    return np.concatenate([(scale * t).detach().numpy().ravel() for t in total]).astype(np.float64)


def clone(generator: torch.Generator) -> torch.Generator:
    copy = torch.Generator()
    copy.set_state(generator.get_state())
    return copy


@dataclass
class DeviceRound:
    """What one device computed and sent in a round (for the oracle and the attacker)."""

    strategy: object
    context: object
    local: object
    update: object
    choice: object

    def replay(self, draws: np.random.Generator) -> Replay:
        """The coordinator's replay of ``draws`` on the plaintext values this device sent."""
        positions = self.update.plain_positions
        clean, std = mechanism_oracle(self.strategy, self.context, self.local.delta, self.choice,
                                      self.local.sensitivity, positions)
        if not np.any(std > 0):
            raise ValueError("nothing in the plaintext part was noised; no replay to score.")
        return replay_plaintext(self.update.plaintext, clean, std, draws)


def device_round(strategy, model: torch.nn.Module, data, public_key, *, seed: int, round: int, index: int,  # noqa: ANN001
                 rng, train, participants: int = 4, budget: float = 0.1) -> DeviceRound:
    """One round of one device with the agent's calls (``local_update``, ``protect_local``),
    starting from ``model``'s weights; ``rng`` is the source of its ``protect`` draws."""
    from senseshield.rounds import ClientState, client_seed, local_update, negotiate, protect_local
    from senseshield.strategies import ClientContext
    from senseshield.training import get_vector

    local = local_update(strategy, model, get_vector(model).astype(np.float64), data, train=train,
                         seed=client_seed(seed, round, index), round=round, state=ClientState())
    block = public_key.block_size if public_key is not None else 1
    shared = (negotiate(strategy, [local.sensitivity], size=local.delta.size, block_size=block)
              if strategy.negotiates else None)
    context = ClientContext(f"c{index:03d}", round, 0, budget, shared, block, participants=participants,
                            noise_multiplier=getattr(strategy.options, "sigma", None))
    update, choice = protect_local(strategy, context, local, public_key, n_samples=data.n_train, rng=rng)
    return DeviceRound(strategy, context, local, update, choice)
