"""What a job is: the run's definition, shared by the simulator and all three roles.

:class:`Job` is the whole definition of a run (strategy and its options, model, data
layout, rounds, seeds, HE parameters). The functions here derive what every role needs
from it the same way: the HE scheme (:func:`effective_scheme`), a key pair
(:func:`key_pair`), the initial model (:func:`initial_model`), the local training
configuration (:func:`train_config`) and the DP noise multipliers
(:func:`noise_multipliers`). Nothing here touches the network or the disk.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from senseshield import defaults
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, PublicKey, SecretKey
from senseshield.shapes import check_input_shape, check_num_classes
from senseshield.strategies import STRATEGIES, Strategy, StrategyOptions

if TYPE_CHECKING:  # torch, the models and Opacus load on first use: `job` commands stay quick
    import torch

    from senseshield.training import TrainConfig


class Selection(BaseModel):
    """Which devices a job takes: device classes (the declared profile's name, e.g. ``rpi4``,
    or the measured board) and labels (``edge-agent join --label site=lab``). Empty: all."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_class: list[str] = []
    labels: dict[str, str] = {}

    def refusal(self, device_class: str | None, labels: dict[str, str]) -> str | None:
        """Why a device with ``device_class`` and ``labels`` is not selected, or None."""
        if self.device_class and device_class not in self.device_class:
            return f"the job selects device classes {self.device_class}; this device is {device_class!r}"
        for key, value in sorted(self.labels.items()):
            if labels.get(key) != value:
                return f"the job selects label {key}={value}; this device has {key}={labels.get(key)!r}"
        return None


class Job(BaseModel):
    """Everything that defines a run, in the simulator or on a fleet: the same job and seed
    give the same result (bit for bit on one machine, except that CKKS's encryption noise
    moves results by about 1e-8; see :mod:`senseshield.determinism`).

    The model is any registered name or import path (:mod:`senseshield.models`) with
    ``model_args``; ``input_shape`` (without the batch axis) and ``num_classes`` say what
    it takes and gives. On a fleet each device brings its data (``data`` names the
    device's source, ``edge-agent join --data NAME=PATH``); ``dataset``, ``partition``,
    ``clients``, ``bandwidth`` and ``cpu`` describe simulated clients and ``--shard``
    agents of controlled trials, and give ``input_shape``/``num_classes`` when those are
    not set (:func:`with_shape`).

    A key that is unknown or a value that is not allowed raises :class:`ConfigError` (a
    ``ValueError``) of one sentence naming the key, the value and what is allowed (the same
    sentence a job file gets, :func:`validation_reason`); pydantic's ``ValidationError`` is
    its ``__cause__``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(validation_reason(exc, Job)) from exc

    name: str | None = None  # a label for people (job list, reports)
    strategy: str = defaults.STRATEGY
    dataset: str = defaults.DATASET
    model: str = defaults.MODEL
    model_args: dict[str, Any] = {}
    input_shape: list[int] | None = None  # the model's input without the batch axis
    num_classes: int | None = None
    data: str | None = None  # the device data source a fleet job uses (None: the device's only one)
    min_devices: int = Field(defaults.MIN_DEVICES, ge=1)  # a fleet job starts when this many devices are ready
    round_deadline: float = Field(defaults.ROUND_DEADLINE, gt=0)  # seconds a round waits for updates
    select: Selection = Selection()
    clients: int = Field(defaults.CLIENTS, ge=1)
    rounds: int = Field(defaults.ROUNDS, ge=1)
    local_epochs: int = Field(defaults.LOCAL_EPOCHS, ge=1)
    bootstrap_epochs: int = Field(1, ge=1)
    batch_size: int = Field(defaults.BATCH_SIZE, ge=1)
    lr: float = Field(defaults.LR, gt=0.0)
    partition: str = defaults.PARTITION
    seed: int = defaults.SEED
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    bandwidth: list[float] | None = None  # r_i per client (MB/s), cycled within a category
    cpu: list[float] | None = None  # v_i per client (GHz x cores), cycled within a category
    key_bits: int = Field(defaults.KEY_BITS, ge=512)
    # torch threads of a client's training and scoring: part of the determinism contract
    # (the same seed and train_threads on the same CPU give the same model bit for bit)
    train_threads: int = Field(defaults.TRAIN_THREADS, ge=1, le=256)
    scheme: str | None = None  # HE scheme override; None = the strategy's default
    options: StrategyOptions = StrategyOptions()
    # what is learnt and how (senseshield.tasks, senseshield.training; docs/training.md)
    task: str = "classification"  # classification | regression | multilabel
    loss: str | None = None  # None: the task's; a name or an import path
    metric: str | None = None  # None: the task's (accuracy, mse, label_accuracy)
    optimizer: str = "sgd"  # sgd | adam | adamw | rmsprop | adagrad, or an import path
    optimizer_args: dict[str, Any] = {}  # the optimizer's keywords besides lr (e.g. momentum)
    train: str | None = None  # None: the built-in loop; a registered name or an import path
    evaluate: str | None = None  # None: the task's metrics; a registered name or an import path

    @model_validator(mode="after")
    def _training(self) -> "Job":
        from senseshield.tasks import check_training

        check_training(task=self.task, loss=self.loss, metric=self.metric, optimizer=self.optimizer,
                       custom_evaluate=self.evaluate is not None, num_classes=self.num_classes)
        return self

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        from senseshield.tasks import TASKS

        TASKS.get(value)  # raises ConfigError naming the tasks
        return value

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

    @field_validator("input_shape")
    @classmethod
    def _shape(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else list(check_input_shape(value))

    @field_validator("num_classes")
    @classmethod
    def _classes(cls, value: int | None) -> int | None:
        return None if value is None else check_num_classes(value, minimum=1)  # per task: _training

    @field_validator("model_args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not k.isidentifier()]
        if bad:
            raise ValueError(f"model_args keys {bad} are not allowed; they must be Python identifiers")
        return value

    @property
    def label(self) -> str:
        """The job's name, else its strategy and model."""
        return self.name or f"{self.strategy}/{self.model}"

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


def with_shape(job: Job) -> Job:
    """``job`` with ``input_shape`` and ``num_classes`` set: its own, else its built-in
    dataset's (loaded here; the launchers call this, never a service)."""
    if job.input_shape is not None and job.num_classes is not None:
        return job
    from senseshield.data import load_dataset

    facts = load_dataset(job.dataset, seed=job.seed)
    return job.model_copy(update={
        "input_shape": job.input_shape or list(facts.input_shape),
        "num_classes": job.num_classes or facts.num_classes,
    })


def job_shape(job: Job) -> tuple[tuple[int, ...], int]:
    """(input_shape, num_classes) of a job that has them; ConfigError naming what is missing."""
    if job.input_shape is None or job.num_classes is None:
        raise ConfigError(
            f"Job {job.label!r} has no {'input_shape' if job.input_shape is None else 'num_classes'}; "
            "give input_shape (the model's input without the batch axis, e.g. [3, 64]) and "
            "num_classes, or a built-in dataset."
        )
    return tuple(job.input_shape), job.num_classes


def build_job_model(job: Job, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A fresh instance of the job's model (its architecture; the weights are torch's)."""
    from senseshield.models import build_model

    return build_model(job.model, tuple(input_shape), num_classes, model_args=job.model_args)


def initial_model(config: Job, input_shape: tuple[int, ...], num_classes: int) -> tuple[torch.nn.Module, np.ndarray]:
    """The run's model and its round-0 weights: seeded by ``config.seed`` only."""
    import torch

    from senseshield.training import get_vector

    torch.manual_seed(config.seed)
    model = build_job_model(config, input_shape, num_classes)
    return model, get_vector(model).astype(np.float64)


def check_job(job: Job) -> None:
    """What a coordinator checks before it queues ``job``: the strategy and scheme go
    together and the model builds for the job's input shape and classes (a forward pass);
    :class:`ConfigError` naming what is wrong. ``fleet up`` calls it before it starts any
    process."""
    from senseshield.strategies import build_strategy

    strategy = build_strategy(job.strategy, job.options)
    effective_scheme(job, strategy)
    model, _ = initial_model(job, *job_shape(job))
    check_job_training(job, strategy, model)


def check_job_training(job: Job, strategy: Strategy, model: torch.nn.Module) -> None:
    """The job's training resolves: its loss, optimizer and train/evaluate functions (import
    paths and entry points load, the functions take (model, loader, config)); a strategy
    that fits class-conditional synthetic data needs a classification task; DP-SGD needs an
    optimizer Opacus can wrap. :class:`ConfigError` of one sentence otherwise."""
    from senseshield.tasks import make_loss, make_optimizer
    from senseshield.training import training_function

    if strategy.needs_synthetic and job.task != "classification":
        raise ConfigError(
            f"Strategy {strategy.name!r} trains on class-conditional synthetic data, so it needs "
            f"task 'classification', not {job.task!r}.")
    make_loss(job.task, job.loss)
    make_optimizer(job.optimizer, model.parameters(), lr=job.lr, args=job.optimizer_args)
    training_function(job.train)
    training_function(job.evaluate, evaluate=True)


def device_index(agent_id: str) -> int:
    """The seed index of a device that holds its own data (no ``--shard``): a stable hash
    of its id, so its randomness never depends on who else is in the fleet."""
    return int.from_bytes(hashlib.sha256(agent_id.encode()).digest()[:4], "big") % (2**31)


def load_job(path: Path | str) -> Job:
    """A job file (YAML ``.yaml``/``.yml``, or TOML ``.toml``); ConfigError naming the file
    and the first unknown key or bad value."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"Job file {str(path)!r} cannot be read ({exc.strerror or exc}); give a YAML or TOML job file.") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        raise ConfigError(f"Job file {str(path)!r} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {str(exc).splitlines()[0]}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Job file {str(path)!r} must hold a mapping of keys (strategy, model, rounds, ...).")
    return job_from_dict(data, where=f"job file {str(path)!r}")


def job_from_dict(data: dict[str, Any], *, where: str = "job") -> Job:
    """A :class:`Job` from plain data; ConfigError naming ``where``, the key and what is allowed."""
    try:
        return Job(**data)
    except ConfigError as exc:  # Job's own sentence (validation_reason), said of where
        raise ConfigError(f"{where[0].upper()}{where[1:]}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{where[0].upper()}{where[1:]}: {exc}.") from None


def validation_reason(exc: ValidationError, model: type[BaseModel]) -> str:
    """The first pydantic error as "key ... is not allowed: rule" (unknown keys list the known ones)."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    loc = [str(p) for p in first.get("loc", ())]
    key = ".".join(loc) or "value"
    if first.get("type") == "extra_forbidden":
        known = model.model_fields if len(loc) == 1 else (StrategyOptions.model_fields if loc[0] == "options" else {})
        return f"unknown key {key!r}; allowed: {', '.join(sorted(known))}."
    if isinstance(cause, ConfigError):
        return str(cause)
    msg = first.get("msg", "is not allowed").removeprefix("Value error, ").rstrip(".")
    return f"{key}={first.get('input')!r} is not allowed: {msg}."


def train_config(config: Job, *, epochs: int | None = None) -> TrainConfig:
    """The local training a job asks for (``epochs``: instead of ``local_epochs``, e.g. the
    bootstrap's)."""
    from senseshield.training import TrainConfig

    return TrainConfig(
        config.local_epochs if epochs is None else epochs, config.batch_size, config.lr,
        threads=config.train_threads, task=config.task, loss=config.loss, metric=config.metric,
        optimizer=config.optimizer, optimizer_args=tuple(sorted(config.optimizer_args.items())),
        train=config.train, evaluate=config.evaluate,
    )


def effective_scheme(config: Job, strategy: Strategy) -> str | None:
    """The HE scheme of a run: the strategy's, or ``config.scheme`` if the strategy encrypts."""
    if strategy.scheme is None:
        return None
    scheme = config.scheme or strategy.scheme
    if strategy.per_client_masks and not (SCHEMES.get(scheme).ragged_masks or SCHEMES.get(scheme).ragged_capable):
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
    from senseshield.accounting import calibrate_sigma
    from senseshield.training import dpsgd_sample_rate

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


def opacus_use(config: Job, strategy: Strategy) -> str | None:
    """Why a device taking ``config`` needs Opacus (None: it does not): DP-SGD rounds train
    through Opacus' PrivacyEngine, and with ``target_epsilon`` a device calibrates the noise
    multipliers it checks the plans against with Opacus' accountant (as
    :func:`noise_multipliers` does). Opacus comes with the ``dp`` extra (senseshield.extras)."""
    rounds = range(1, config.rounds + 1)
    if any(strategy.round_plan(r).dpsgd for r in rounds):
        return f"strategy {config.strategy!r} trains with DP-SGD"
    if (strategy.dp_level is not None and config.options.target_epsilon is not None
            and any(strategy.user_dp_round(r) for r in rounds)):
        return f"its noise is calibrated to target_epsilon {config.options.target_epsilon:g}"
    return None


def announced_run(config: dict) -> tuple[Job, Strategy, str | None]:
    """The run a ``fleet/config`` message announces (its ``config`` field), checked before a
    service acts on it: (job, strategy, HE scheme); :class:`ProtocolError` naming the
    first bad field otherwise (a forged or broken config never reaches a service's state)."""
    from senseshield.strategies import build_strategy

    try:
        run = Job(**config)
        strategy = build_strategy(run.strategy, run.options)
        return run, strategy, effective_scheme(run, strategy)
    except ConfigError as exc:
        if isinstance(exc.__cause__, ValidationError):  # a field of the job itself
            first = exc.__cause__.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            raise ProtocolError(f"fleet/config field {where!r}: {first['msg'].lower()}.") from None
        raise ProtocolError(f"fleet/config does not describe a run: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"fleet/config does not describe a run: {exc}") from None


__all__ = ["Job", "Selection", "announced_run", "build_job_model", "device_index", "job_from_dict", "job_shape",
           "load_job", "with_shape", "effective_scheme", "initial_model", "key_pair", "noise_multipliers", "opacus_use",
           "train_config"]
