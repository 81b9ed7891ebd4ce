"""What a job is: the run's definition, shared by the simulator and all three roles.

:class:`Job` is the whole definition of a run (strategy and its options, model, data
layout, rounds, seeds, HE parameters). The functions here derive what every role needs
from it the same way: the HE scheme (:func:`effective_scheme`), a key pair
(:func:`key_pair`), the initial model (:func:`initial_model`), the local training
configuration (:func:`train_config`) and the DP noise multipliers
(:func:`noise_multipliers`). Nothing here touches the network or the disk.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from senseshield.accounting import calibrate_sigma
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, PublicKey, SecretKey
from senseshield.models import build_model
from senseshield.strategies import STRATEGIES, Strategy, StrategyOptions
from senseshield.training import TrainConfig, dpsgd_sample_rate, get_vector


class Job(BaseModel):
    """Everything that defines a run, in the simulator or on a fleet: the same job and seed
    give the same result (bit for bit on one machine, except that CKKS's encryption noise
    moves results by about 1e-8; see :mod:`senseshield.determinism`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: str = "sensecrypt"
    dataset: str = "digits"
    model: str = "mlp"
    clients: int = Field(20, ge=1)
    rounds: int = Field(5, ge=1)
    local_epochs: int = Field(2, ge=1)
    bootstrap_epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(0.1, gt=0.0)
    partition: str = "iid"
    seed: int = 0
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    bandwidth: list[float] | None = None  # r_i per client (MB/s), cycled within a category
    cpu: list[float] | None = None  # v_i per client (GHz x cores), cycled within a category
    key_bits: int = Field(2048, ge=512)
    # torch threads of a client's training and scoring: part of the determinism contract
    # (the same seed and train_threads on the same CPU give the same model bit for bit)
    train_threads: int = Field(1, ge=1, le=256)
    scheme: str | None = None  # HE scheme override; None = the strategy's default
    options: StrategyOptions = StrategyOptions()

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        STRATEGIES.get(value)  # raises ConfigError naming the allowed strategies
        return value

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            SCHEMES.get(value)  # raises ConfigError naming the allowed schemes
        return value

    @field_validator("bandwidth", "cpu")
    @classmethod
    def _positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one value")
            for v in value:
                if not (np.isfinite(v) and v > 0):
                    raise ValueError(f"{v} is not allowed; every value must be a finite number > 0")
        return value


def initial_model(config: Job, input_shape: tuple[int, ...], num_classes: int) -> tuple[torch.nn.Module, np.ndarray]:
    """The run's model and its round-0 weights: seeded by ``config.seed`` only."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, tuple(input_shape), num_classes)
    return model, get_vector(model).astype(np.float64)


def train_config(config: Job) -> TrainConfig:
    return TrainConfig(config.local_epochs, config.batch_size, config.lr, threads=config.train_threads)


def effective_scheme(config: Job, strategy: Strategy) -> str | None:
    """The HE scheme of a run: the strategy's, or ``config.scheme`` if the strategy encrypts."""
    if strategy.scheme is None:
        return None
    scheme = config.scheme or strategy.scheme
    if strategy.per_client_masks and not SCHEMES.get(scheme).ragged_masks:
        raise ConfigError(
            f"Scheme {scheme!r} needs every client to encrypt the same positions, but strategy "
            f"{strategy.name!r} gives each client its own mask; use a Paillier scheme."
        )
    return scheme


def key_pair(scheme: str | None, key_bits: int) -> tuple[PublicKey | None, SecretKey | None]:
    """A fresh key pair of ``scheme`` (``key_bits`` where the scheme has that parameter)."""
    if scheme is None:
        return None, None
    factory = SCHEMES.get(scheme)
    params = {"key_bits": key_bits} if "key_bits" in factory.info().params else {}
    secret = factory.generate(**params)
    return secret.public_key, secret


def noise_multipliers(
    config: Job, strategy: Strategy, n_train: dict[str, int]
) -> tuple[float | None, dict[str, float]]:
    """Sigma of the user-level mechanism and of each client's DP-SGD.

    Without ``target_epsilon`` both are ``options.sigma``. With it, sigma is calibrated with
    Opacus' ``get_noise_multiplier``: user level over the rounds that noise updates at
    client rate q; record level per client over its DP-SGD steps (epochs x batches of its
    DP rounds) at its batch rate, assuming it takes part in every DP round (conservative).
    """
    o = config.options
    user = record = None
    if strategy.dp_level is None:
        return None, {}
    dp_rounds = [r for r in range(1, config.rounds + 1) if strategy.user_dp_round(r)]
    sgd_rounds = [r for r in range(1, config.rounds + 1) if strategy.round_plan(r).dpsgd]
    if o.target_epsilon is None:
        user = o.sigma if dp_rounds else None
        return user, {c: o.sigma for c in n_train} if sgd_rounds else {}
    if dp_rounds:
        user = calibrate_sigma(target_epsilon=o.target_epsilon, delta=o.delta, sample_rate=o.sample_rate, steps=len(dp_rounds))
    record = {}
    if sgd_rounds:
        for c, n in n_train.items():
            q = dpsgd_sample_rate(n, config.batch_size)
            steps = len(sgd_rounds) * config.local_epochs * round(1 / q)
            record[c] = calibrate_sigma(target_epsilon=o.target_epsilon, delta=o.delta, sample_rate=q, steps=steps)
    return user, record


def announced_run(config: dict) -> tuple[Job, Strategy, str | None]:
    """The run a ``fleet/config`` message announces (its ``config`` field), checked before a
    service acts on it: (job, strategy, HE scheme); :class:`ProtocolError` naming the
    first bad field otherwise (a forged or broken config never reaches a service's state)."""
    from pydantic import ValidationError

    from senseshield.strategies import build_strategy

    try:
        run = Job(**config)
        strategy = build_strategy(run.strategy, run.options)
        return run, strategy, effective_scheme(run, strategy)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ProtocolError(f"fleet/config field {where!r}: {first['msg'].lower()}.") from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise ProtocolError(f"fleet/config does not describe a run: {exc}") from None


__all__ = ["Job", "announced_run", "effective_scheme", "initial_model", "key_pair", "noise_multipliers", "train_config"]
