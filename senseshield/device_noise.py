"""Where a device draws the randomness that protects privacy: secret by default.

Every random draw that a privacy claim rests on is made on the device from a key nobody
else holds (docs/security.md, "Randomness: public and secret"):

====================  ==============================================  ====================
purpose               draws                                           strategies
====================  ==============================================  ====================
``protect``           the noise on the values sent in plaintext       dp-fedavg, selective-dp,
                      (clip + Gaussian, or the hybrid's relative       selectiveshield's noise
                      noise; masked-dp's shares of the sum's noise)   zone, sensecrypt
                                                                      ``plain_noise``,
                                                                      masked-dp
``dpsgd``             DP-SGD's Poisson sampling and gradient noise    dpsgd, alt-si-dp, alt-pi
                      (Opacus, through two torch generators)
``bootstrap-sketch``  Alg. 2's DP sketch for clustering               ``cluster_epsilon``
``synthetic-fit``     the DP synthetic-data provider's fit            alt-si-*
====================  ==============================================  ====================

By default (:class:`DeviceNoise()`) each draw is keyed with 256 fresh bits of the OS CSPRNG
(:meth:`ChaChaGenerator.fresh`): the coordinator, the key server and every reader of the job
file hold nothing that reproduces it, and two devices (or one device twice) never draw the
same noise. The job's seed keeps what must be shared: the initial model, the simulator's
data split, the clustering, the training order of plain SGD, the coordinator's sampling.

:class:`DeviceNoise(replay_seed=N)` derives every key from ``N`` instead (SHA-256 of ``N``,
the purpose, the round and the device's index): anyone who knows ``N`` replays the noise,
so it exists for tests and reproducible experiments only. The simulator and a fleet agree
bit for bit when both are handed the same ``N`` (``run_simulation(..., noise_seed=N)``,
``FleetOptions(noise_seed=N)``); an edge agent accepts ``--dev-noise-seed N`` only in
development mode (:data:`DEVELOPMENT_ENV` set to 1) and refuses to start otherwise.

Opacus draws DP-SGD's noise and Poisson sampling through torch generators (Mersenne
Twister); here they are seeded with 63 bits from the device's ChaCha stream, so they are
secret, though not cryptographic generators. Opacus' ``secure_mode`` (a CSPRNG) needs
``torchcsprng``, whose last release (2021) does not install with the torch we pin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from senseshield.development import DEVELOPMENT_ENV, DEV_FLAG, development_mode  # noqa: F401 - one switch
from senseshield.engine.csprng import ChaChaGenerator
from senseshield.errors import ConfigError

if TYPE_CHECKING:
    import torch

PURPOSES = ("protect", "dpsgd", "bootstrap-sketch", "synthetic-fit")


@dataclass(frozen=True)
class DeviceNoise:
    """A device's source of privacy randomness: fresh OS entropy, or (tests only) a
    replayable stream derived from ``replay_seed``."""

    replay_seed: int | None = None

    @property
    def secret(self) -> bool:
        return self.replay_seed is None

    def describe(self) -> str:
        if self.secret:
            return "secret (ChaCha20 keyed from the OS CSPRNG on each device)"
        return f"replayed from the test-only noise seed {self.replay_seed} (not secret)"

    def generator(self, purpose: str, *, round: int, index: int) -> ChaChaGenerator:
        """The generator of device ``index``'s draws for ``purpose`` in ``round``."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r} is not a privacy draw; use one of {', '.join(PURPOSES)}.")
        if self.replay_seed is None:
            return ChaChaGenerator.fresh()
        return ChaChaGenerator.from_seed(self.replay_seed, purpose, int(round), int(index))

    def torch_generators(self, purpose: str, *, round: int, index: int, count: int = 2) -> list[torch.Generator]:
        """``count`` torch generators seeded from this purpose's stream (Opacus: sampling, noise)."""
        import torch

        stream = self.generator(purpose, round=round, index=index)
        return [torch.Generator().manual_seed(stream.torch_seed()) for _ in range(count)]


SECRET = DeviceNoise()


def check_noise_seed(seed: int | None, *, flag: str = "--dev-noise-seed") -> DeviceNoise:
    """The device noise for a test-only seed given to a service: refused with one sentence
    outside development mode, since it lets whoever knows the seed remove the device's noise."""
    if seed is None:
        return SECRET
    if not development_mode():
        raise ConfigError(
            f"{flag} {seed} is not allowed outside development mode: it makes this device's privacy noise "
            f"replayable by anyone who knows the seed; on a test machine add {DEV_FLAG} (or set {DEVELOPMENT_ENV}=1), or drop the flag."
        )
    if seed < 0:
        raise ConfigError(f"{flag} {seed} is not allowed; use 0 or more.")
    return DeviceNoise(replay_seed=int(seed))
