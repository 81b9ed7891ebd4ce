"""In-process simulation of a fleet: real training, real encryption, one process.

The round is the one the fleet runtime runs (bootstrap -> per cluster: train, score,
[negotiate], mask, encrypt -> aggregate -> decrypt -> apply), with the three roles as
function calls instead of MQTT messages. Results follow the JSON contract of
:class:`SimulationResult` (``senseshield simulate --out``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator
from sklearn.metrics import adjusted_rand_score

from senseshield.data import Dataset, load_dataset, partition_dataset, split_train_test
from senseshield.engine.aggregation import ProtectedUpdate, aggregate_updates, decrypt_aggregate
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, PublicKey, SecretKey
from senseshield.models import build_model
from senseshield.strategies import (
    STRATEGIES,
    BootstrapReport,
    ClientContext,
    FleetPlan,
    Strategy,
    StrategyOptions,
    build_strategy,
)
from senseshield.accounting import Accountant, calibrate_sigma
from senseshield.rounds import (
    choice_report,
    ClientState,
    LocalData,
    apply_mean,
    bootstrap_vector,
    client_seed,
    fit_synthetic,
    keep_personal,
    local_update,
    merge_personal,
    negotiate,
    protect_local,
)
from senseshield.training import TrainConfig, dpsgd_sample_rate, evaluate, get_vector, layout_of, set_vector

PHASES = ("train", "sensitivity", "mask", "noise", "encrypt", "aggregate", "decrypt", "evaluate")

Progress = Callable[[str, int, int], None]


class SimulationConfig(BaseModel):
    """Everything that defines a simulation run; same config and seed, same result (bit for
    bit, except that CKKS's encryption noise moves results by about 1e-8)."""

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


class RoundRecord(BaseModel):
    round: int
    accuracy: float
    he_ratio_mean: float
    union_ratio_mean: float
    bytes_up: int
    bytes_down: int
    seconds: float
    phase_seconds: dict[str, float]
    infeasible_masks: int
    violations: list[str] = []  # first violation sentence of each infeasible mask (max 3)
    participants: int | None = None  # clients sampled this round (Poisson rate q)
    epsilon: float | None = None  # DP epsilon spent up to and including this round
    delta: float | None = None
    zone_ratios: dict[str, float] | None = None  # mean M_enc / M_pers / M_noise (SelectiveShield)
    round_type: str | None = None  # Alt-FL round type
    notes: list[str] = []  # e.g. an empty zone, a round nobody was sampled in


class ClientRecord(BaseModel):
    id: str
    cluster: int
    category: int | None
    encryption_budget: float
    he_ratio: float
    accuracy: float
    n_train: int
    n_test: int
    bandwidth: float
    cpu_speed: float


class SimulationResult(BaseModel):
    """The JSON written by ``senseshield simulate --out`` (field names are a contract)."""

    strategy: str
    scheme: str | None
    dataset: str
    model: str
    partition: str
    seed: int
    num_params: int
    num_clusters: int
    cluster_ari: float | None
    clustering_epsilon: float | None
    final_accuracy: float
    seconds_total: float
    rounds: list[RoundRecord]
    clients: list[ClientRecord]
    config: dict
    machine: dict
    epsilon: float | None = None  # final DP epsilon (None: the strategy uses no DP)
    delta: float | None = None
    noise_multiplier: float | None = None  # sigma used (calibrated when target_epsilon is set)
    synthetic_epsilon: float | None = None  # epsilon of the DP synthetic-data provider
    # the final global model of every cluster (float64); not part of the JSON
    _models: dict[int, np.ndarray] = PrivateAttr(default_factory=dict)

    @property
    def models(self) -> dict[int, np.ndarray]:
        return self._models


@dataclass
class _Client:
    id: str
    index: int
    category: int | None
    data: LocalData
    bandwidth: float
    cpu_speed: float
    he_ratios: list[float] = field(default_factory=list)
    state: ClientState = field(default_factory=ClientState)


def _profile_values(values: list[float] | None, ranks: list[int]) -> list[float]:
    if values is None:
        return [1.0] * len(ranks)
    return [float(values[r % len(values)]) for r in ranks]


def build_clients(config: SimulationConfig, dataset: Dataset) -> list[_Client]:
    """Partition the data, split each client's share into local train/test, attach profiles."""
    part = partition_dataset(dataset.y, config.clients, config.partition, seed=config.seed)
    groups = part.groups
    # rank of each client inside its category: the paper assigns 50,45,...,30 MBps and
    # 24,16,...,8 CPUs to the 5 clients of every category.
    ranks: list[int] = []
    seen: dict[int, int] = {}
    for i in range(config.clients):
        g = int(groups[i]) if groups is not None else 0
        ranks.append(seen.get(g, 0))
        seen[g] = seen.get(g, 0) + 1
    bandwidth = _profile_values(config.bandwidth, ranks)
    cpu = _profile_values(config.cpu, ranks)
    clients = []
    for i, idx in enumerate(part.indices):
        train, test = split_train_test(idx, test_fraction=config.test_fraction, seed=config.seed + i)
        clients.append(
            _Client(
                id=f"c{i:03d}",
                index=i,
                category=int(groups[i]) if groups is not None else None,
                data=LocalData(dataset.x[train], dataset.y[train], dataset.x[test], dataset.y[test]),
                bandwidth=bandwidth[i],
                cpu_speed=cpu[i],
            )
        )
    return clients


def bootstrap_reports(
    config: SimulationConfig,
    strategy: Strategy,
    clients: list[_Client],
    model: torch.nn.Module,
    initial: np.ndarray,
    progress: Progress | None = None,
) -> list[BootstrapReport]:
    """Every client's bootstrap report (profile + sensitivity vector, Alg. 1 lines 1-2)."""
    reports = []
    for client in clients:
        vector = client_bootstrap(config, strategy, model, initial, client.data, client.index)
        reports.append(
            BootstrapReport(client.id, client.data.n_train, client.bandwidth, client.cpu_speed, vector)
        )
        if progress:
            progress("bootstrap", len(reports), len(clients))
    return reports


def client_bootstrap(
    config: SimulationConfig, strategy: Strategy, model: torch.nn.Module, initial: np.ndarray, data: LocalData, index: int
) -> np.ndarray | None:
    """Client ``index``'s bootstrap vector (the same on a device and in the simulator)."""
    return bootstrap_vector(
        strategy,
        model,
        initial,
        data,
        train=TrainConfig(config.bootstrap_epochs, config.batch_size, config.lr, threads=config.train_threads),
        seed=client_seed(config.seed, 0, index),
        rng=np.random.default_rng([config.seed, 7, index]),
    )


def initial_model(config: SimulationConfig, input_shape: tuple[int, ...], num_classes: int) -> tuple[torch.nn.Module, np.ndarray]:
    """The run's model and its round-0 weights: seeded by ``config.seed`` only."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, tuple(input_shape), num_classes)
    return model, get_vector(model).astype(np.float64)


def train_config(config: SimulationConfig) -> TrainConfig:
    return TrainConfig(config.local_epochs, config.batch_size, config.lr, threads=config.train_threads)


def announced_run(config: dict) -> tuple[SimulationConfig, Strategy, str | None]:
    """The run a ``fleet/config`` message announces (its ``config`` field), checked before a
    service acts on it: (config, strategy, HE scheme); :class:`ProtocolError` naming the
    first bad field otherwise (a forged or broken config never reaches a service's state)."""
    from pydantic import ValidationError

    try:
        run = SimulationConfig(**config)
        strategy = build_strategy(run.strategy, run.options)
        return run, strategy, effective_scheme(run, strategy)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ProtocolError(f"fleet/config field {where!r}: {first['msg'].lower()}.") from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise ProtocolError(f"fleet/config does not describe a run: {exc}") from None


def effective_scheme(config: SimulationConfig, strategy: Strategy) -> str | None:
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
    config: SimulationConfig, strategy: Strategy, n_train: dict[str, int]
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


def run_simulation(config: SimulationConfig, progress: Progress | None = None) -> SimulationResult:
    """Run ``config.rounds`` rounds of ``config.strategy`` and return the results."""
    started = time.perf_counter()
    np.random.seed(config.seed % 2**32)
    strategy = build_strategy(config.strategy, config.options)
    dataset = load_dataset(config.dataset, seed=config.seed)
    clients = build_clients(config, dataset)
    model, initial = initial_model(config, dataset.input_shape, dataset.num_classes)
    layout = layout_of(model)
    scheme = effective_scheme(config, strategy)
    public_key, secret_key = key_pair(scheme, config.key_bits)

    reports = bootstrap_reports(config, strategy, clients, model, initial, progress)
    o = config.options
    sigma_user, sigma_record = noise_multipliers(config, strategy, {c.id: c.data.n_train for c in clients})
    if strategy.needs_synthetic:
        for c in clients:
            fit_synthetic(
                c.state, c.data, num_classes=dataset.num_classes, epsilon=o.synthetic_epsilon,
                delta=o.delta, seed=client_seed(config.seed, 0, c.index),
            )
    user_accountant = Accountant()
    sampler = np.random.default_rng([config.seed, 5])
    block_size = public_key.block_size if public_key is not None else 1
    plan: FleetPlan = strategy.plan_fleet(reports, size=layout.size, block_size=block_size)
    globals_ = {k: initial.copy() for k in plan.clusters}
    by_id = {c.id: c for c in clients}
    train = train_config(config)

    rounds: list[RoundRecord] = []
    accuracies: dict[str, float] = {}
    for r in range(1, config.rounds + 1):
        t_round = time.perf_counter()
        tally = RoundTally()
        sampled = (
            {c.id for c in clients}
            if o.sample_rate >= 1.0
            else {c.id for c in clients if sampler.random() < o.sample_rate}
        )
        for k in plan.clusters:
            members = [by_id[cid] for cid in plan.members(k) if cid in sampled]
            if not members:
                continue
            local = {
                c.id: local_update(
                    strategy,
                    model,
                    merge_personal(globals_[k], c.state),
                    c.data,
                    train=train,
                    seed=client_seed(config.seed, r, c.index),
                    round=r,
                    state=c.state,
                    noise_multiplier=sigma_record.get(c.id),
                )
                for c in members
            }
            shared = plan.fixed_masks.get(k)
            if strategy.negotiates:
                t = time.perf_counter()
                sens = [local[c.id].sensitivity for c in members]
                shared = negotiate(strategy, sens, size=layout.size, block_size=block_size)
                tally.phases["mask"] += time.perf_counter() - t
            updates: list[ProtectedUpdate] = []
            for client in members:
                context = ClientContext(
                    client.id, r, k, plan.budget_of[client.id], shared, block_size,
                    participants=len(members), noise_multiplier=sigma_user,
                )
                update, choice = protect_local(
                    strategy, context, local[client.id], public_key, n_samples=client.data.n_train,
                    rng=protect_rng(config.seed, r, client.index),
                )
                keep_personal(client.state, local[client.id], choice.withheld)
                tally.add_update(client.id, update.timings, update.he_ratio, update.nbytes, choice_report(choice))
                client.he_ratios.append(update.he_ratio)
                updates.append(update)
            t = time.perf_counter()
            aggregate = aggregate_updates(updates, public_key, round=r, cluster=k)
            tally.phases["aggregate"] += time.perf_counter() - t
            t = time.perf_counter()
            mean = decrypt_aggregate(aggregate, secret_key)
            tally.phases["decrypt"] += time.perf_counter() - t
            tally.union_ratios.append(float(aggregate.union_mask.mean()))
            globals_[k] = apply_mean(globals_[k], mean, server_lr=config.options.server_lr)
            tally.bytes_down += len(members) * layout.size * 4
        if strategy.user_dp_round(r) and sampled:
            user_accountant.step(noise_multiplier=sigma_user or 0.0, sample_rate=o.sample_rate)
        epsilon = _epsilon(strategy, user_accountant, [c.state.dp_history for c in clients], o.delta)
        t = time.perf_counter()
        for client in clients:
            set_vector(model, merge_personal(globals_[plan.cluster_of[client.id]], client.state))
            accuracies[client.id] = evaluate(model, client.data.x_test, client.data.y_test)
        tally.phases["evaluate"] += time.perf_counter() - t
        rounds.append(
            tally.record(
                r,
                strategy,
                accuracy=weighted_accuracy([(accuracies[c.id], len(c.data.y_test)) for c in clients]),
                seconds=time.perf_counter() - t_round,
                participants=len(sampled),
                sample_rate=o.sample_rate,
                epsilon=epsilon,
                delta=o.delta,
            )
        )
        if progress:
            progress("round", r, config.rounds)

    categories = [c.category for c in clients]
    labels = [plan.cluster_of[c.id] for c in clients]
    ari = (
        float(adjusted_rand_score(categories, labels))
        if all(c is not None for c in categories)
        else None
    )
    result = SimulationResult(
        strategy=config.strategy,
        scheme=scheme,
        dataset=config.dataset,
        model=config.model,
        partition=config.partition,
        seed=config.seed,
        num_params=layout.size,
        num_clusters=len(plan.clusters),
        cluster_ari=ari,
        clustering_epsilon=config.options.cluster_epsilon if strategy.clusters_clients else None,
        final_accuracy=rounds[-1].accuracy,
        seconds_total=time.perf_counter() - started,
        rounds=rounds,
        clients=[
            ClientRecord(
                id=c.id,
                cluster=plan.cluster_of[c.id],
                category=c.category,
                encryption_budget=plan.budget_of[c.id],
                he_ratio=float(np.mean(c.he_ratios)) if c.he_ratios else 0.0,
                accuracy=accuracies[c.id],
                n_train=c.data.n_train,
                n_test=len(c.data.y_test),
                bandwidth=c.bandwidth,
                cpu_speed=c.cpu_speed,
            )
            for c in clients
        ],
        config=config.model_dump(mode="json"),
        machine={"python": platform.python_version(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        epsilon=rounds[-1].epsilon,
        delta=o.delta if strategy.dp_level is not None else None,
        noise_multiplier=sigma_user if sigma_user is not None else (max(sigma_record.values()) if sigma_record else None),
        synthetic_epsilon=(
            max(c.state.synthetic_epsilon or 0.0 for c in clients) if strategy.needs_synthetic else None
        ),
    )
    result._models = {k: v.copy() for k, v in globals_.items()}
    return result


def _epsilon(strategy: Strategy, user: Accountant, histories: list[list], delta: float) -> float | None:
    """Epsilon spent so far: the user-level accountant, or the worst client's DP-SGD accountant."""
    if strategy.dp_level is None:
        return None
    eps = user.epsilon(delta)
    for history in histories:
        if history:
            eps = max(eps, Accountant(history).epsilon(delta))
    return eps


def _round_type(strategy: Strategy, r: int) -> str | None:
    kind = getattr(strategy, "_kind", None)
    return kind(r) if kind is not None else None


def weighted_accuracy(pairs: list[tuple[float, int]]) -> float:
    """Test accuracy over all clients: each client's accuracy weighted by its test-set size."""
    total = sum(n for _, n in pairs)
    if total == 0:
        return 0.0
    return float(sum(a * n for a, n in pairs) / total)


def protect_rng(seed: int, round: int, index: int) -> np.random.Generator:
    """The generator of client ``index``'s privatisation noise in ``round``."""
    return np.random.default_rng([seed, 3, round, index])


@dataclass
class RoundTally:
    """What a round's updates add up to (the simulator and the coordinator both keep one)."""

    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    bytes_up: int = 0
    bytes_down: int = 0
    infeasible: int = 0
    violations: list[str] = field(default_factory=list)
    union_ratios: list[float] = field(default_factory=list)
    he_ratios: list[float] = field(default_factory=list)
    zone_sums: dict[str, list[float]] = field(default_factory=dict)
    empty_zones: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add_update(self, client_id: str, timings: dict[str, float], he_ratio: float, nbytes: int, report: dict) -> None:
        for name, value in report.get("zones", {}).items():
            self.zone_sums.setdefault(name, []).append(value)
        for name in report.get("empty_zones", []):
            self.empty_zones[name] = self.empty_zones.get(name, 0) + 1
        for phase in ("train", "sensitivity", "mask", "noise", "encrypt"):
            self.phases[phase] += timings.get(phase, 0.0)
        if report.get("feasible") is False:
            self.infeasible += 1
            if len(self.violations) < 3 and report.get("violations"):
                self.violations.append(f"{client_id}: {report['violations'][0]}")
        self.he_ratios.append(he_ratio)
        self.bytes_up += nbytes

    def record(
        self, r: int, strategy: Strategy, *, accuracy: float, seconds: float, participants: int,
        sample_rate: float, epsilon: float | None, delta: float,
    ) -> RoundRecord:
        notes = list(self.notes)
        if not participants:
            notes.append(f"round {r}: no client was sampled (q={sample_rate}); the model is unchanged")
        for name, count in sorted(self.empty_zones.items()):
            notes.append(f"round {r}: the {name} zone is empty for {count} client(s)")
        return RoundRecord(
            round=r,
            accuracy=accuracy,
            he_ratio_mean=float(np.mean(self.he_ratios)) if self.he_ratios else 0.0,
            union_ratio_mean=float(np.mean(self.union_ratios)) if self.union_ratios else 0.0,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            seconds=seconds,
            phase_seconds={k: round(v, 6) for k, v in self.phases.items()},
            infeasible_masks=self.infeasible,
            violations=self.violations,
            participants=participants,
            epsilon=epsilon,
            delta=delta if epsilon is not None else None,
            zone_ratios={k: float(np.mean(v)) for k, v in self.zone_sums.items()} or None,
            round_type=_round_type(strategy, r),
            notes=notes,
        )


__all__ = ["SimulationConfig", "SimulationResult", "run_simulation", "ConfigError"]
