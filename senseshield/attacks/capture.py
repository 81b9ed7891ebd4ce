"""Train a fleet to a round and capture what the server sees of chosen clients' updates.

:func:`prepare_fleet` runs the strategy's bootstrap and fleet plan (clusters, budgets,
fixed masks) and trains ``round − 1`` rounds with the strategy's own hooks, as
:mod:`senseshield.simulation` does: local training from :mod:`senseshield.rounds`
(SGD, DP-SGD or synthetic data, per ``round_plan``), negotiation, ``select_mask``,
``privatise`` (client-side DP noise), withheld personalised zones and the selective merge.
Only the encryption is left out: the coordinator's mixed ciphertext/plaintext sum equals
the plaintext sum up to the scheme's fixed-point rounding (property-tested in
``tests/test_aggregation.py``), so the rounds aggregate in plaintext, per position over
the clients that sent it. Poisson client sampling and target-epsilon calibration are not
replayed (every client takes part; ``sigma`` is used as given).

:func:`capture` then plays the captured round the way the threat model of the attacks
assumes (FedSGD-style, as in iDLG, Inverting Gradients and iLRG): each client takes one
full-batch step (``local_steps`` steps) on a batch of ``B`` of its own samples from its
(merged) model: SGD, or DP-SGD with the batch as the lot when the strategy's round plan
says so. It computes its strategy's sensitivity score on that batch and picks its mask
with the strategy's hooks (``propose``/``consensus`` for negotiating strategies, the plan's
fixed mask, ``select_mask`` with its budget, then ``privatise``). Masks are per value
(``block_size = 1``, the papers' per-value Paillier). The result is a
:class:`~senseshield.attacks.view.ServerView` per victim, unknown at encrypted and withheld
positions, plus the ground truth the experimenter (not the server) keeps for scoring.
A synthetic-data round (Alt-FL SI) carries no real sample and is refused.

``order`` replaces the strategy's mask by the ``ratio`` fraction of positions taken in
``high`` (most sensitive first), ``low`` (least sensitive first) or ``random`` order of the
strategy's sensitivity score: the three selections of SenseCrypt App. H (no noise, nothing
withheld).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from senseshield.attacks.base import torch_threads
from senseshield.attacks.view import ServerView, server_view
from senseshield.data import load_dataset, partition_dataset, split_train_test
from senseshield.device_noise import DeviceNoise
from senseshield.engine.clustering import normalise_rows
from senseshield.engine.masks import budget_count, top_fraction_mask
from senseshield.engine.sensitivity import SCORES
from senseshield.errors import ConfigError
from senseshield.models import build_model
from senseshield.rounds import (
    ClientState,
    LocalData,
    fit_synthetic,
    keep_personal,
    local_update,
    merge_personal,
    negotiate,
)
from senseshield.strategies import (
    BootstrapReport,
    ClientContext,
    FleetPlan,
    MaskChoice,
    Strategy,
    StrategyOptions,
    build_strategy,
)
from senseshield.training import (
    TrainConfig,
    evaluate,
    get_vector,
    layout_of,
    per_sample_gradients,
    score_inputs,
    set_vector,
    train_local,
)

__all__ = [
    "ORDERS",
    "Capture",
    "Fleet",
    "FleetSpec",
    "capture",
    "order_mask",
    "prepare_fleet",
]

ORDERS = ("high", "random", "low")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FleetSpec:
    """The federated setting the attacked updates come from."""

    strategy: str = "sensecrypt"
    dataset: str = "digits"
    model: str = "lenet5"
    activation: str | None = None  # lenet5 only; None = sigmoid, the inversion literature's
    clients: int = 10
    partition: str = "iid"
    round: int = 2  # the captured round; rounds 1 .. round-1 are trained first
    local_epochs: int = 1
    train_batch_size: int = 16
    lr: float = 0.1
    bandwidth: tuple[float, ...] | None = None  # per client, by index (cycled)
    cpu: tuple[float, ...] | None = None
    options: StrategyOptions = field(default_factory=StrategyOptions)
    seed: int = 0

    def model_options(self) -> dict[str, Any]:
        if self.model == "lenet5":
            return {"activation": self.activation or "sigmoid"}
        if self.activation is not None:
            raise ConfigError(
                f"--activation={self.activation!r} is not allowed for model {self.model!r}; "
                "only lenet5 has an activation option."
            )
        return {}


@dataclass
class ClientData:
    id: str
    index: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    bandwidth: float
    cpu_speed: float
    state: ClientState = field(default_factory=ClientState)

    @property
    def data(self) -> LocalData:
        return LocalData(self.x_train, self.y_train, self.x_test, self.y_test)


@dataclass
class Fleet:
    """A trained fleet, ready for the captured round."""

    spec: FleetSpec
    clients: list[ClientData]
    model: torch.nn.Module
    strategy: Strategy
    plan: FleetPlan
    globals_: dict[int, np.ndarray]
    input_shape: tuple[int, int, int]
    num_classes: int
    accuracy: list[float]  # weighted test accuracy after each trained round

    @property
    def num_params(self) -> int:
        return layout_of(self.model).size

    def cluster_of(self, index: int) -> int:
        return self.plan.cluster_of[self.clients[index].id]

    def budget_of(self, index: int) -> float:
        return self.plan.budget_of[self.clients[index].id]


@dataclass
class Capture:
    """One victim's update in the captured round: the server's view and the ground truth."""

    client: int
    view: ServerView
    indices: np.ndarray  # positions of the batch in the client's training data
    x: np.ndarray  # the true batch (experimenter only)
    y: np.ndarray
    weights: np.ndarray  # W_i after the local step (for the leakage MI)
    sensitivity: np.ndarray
    budget: float
    mask_info: dict[str, Any]

    encrypted: np.ndarray | None = None  # the HE mask (unknown = encrypted | withheld)

    @property
    def he_ratio(self) -> float:
        """Encrypted share of the update (``unknown_ratio`` also counts withheld positions)."""
        if self.encrypted is None:
            return self.view.unknown_ratio
        return float(np.count_nonzero(self.encrypted)) / self.encrypted.size


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def prepare_fleet(spec: FleetSpec, progress: Progress | None = None) -> Fleet:
    """Bootstrap, plan and train ``spec.round − 1`` rounds (see the module docstring)."""
    with torch_threads(1):
        return _prepare_fleet(spec, progress)


def _prepare_fleet(spec: FleetSpec, progress: Progress | None) -> Fleet:
    if spec.round < 1:
        raise ConfigError(f"--round={spec.round} is not allowed; it must be an integer >= 1.")
    torch.manual_seed(spec.seed)
    strategy = build_strategy(spec.strategy, spec.options)
    dataset = load_dataset(spec.dataset, seed=spec.seed)
    part = partition_dataset(dataset.y, spec.clients, spec.partition, seed=spec.seed)
    clients = []
    for i, idx in enumerate(part.indices):
        train, test = split_train_test(idx, test_fraction=0.2, seed=spec.seed + i)
        clients.append(
            ClientData(
                id=f"c{i:03d}",
                index=i,
                x_train=dataset.x[train],
                y_train=dataset.y[train],
                x_test=dataset.x[test],
                y_test=dataset.y[test],
                bandwidth=_profile(spec.bandwidth, i, "bandwidth"),
                cpu_speed=_profile(spec.cpu, i, "cpu"),
            )
        )
    model = build_model(spec.model, dataset.input_shape, dataset.num_classes, **spec.model_options())
    initial = get_vector(model).astype(np.float64)
    train = TrainConfig(spec.local_epochs, spec.train_batch_size, spec.lr)
    reports = []
    for c in clients:
        vector = None
        if strategy.needs_bootstrap_sensitivity:
            set_vector(model, initial)
            train_local(model, c.x_train, c.y_train, train, seed=_seed(spec.seed, 0, c.index))
            vector = SCORES.get("taylor")(score_inputs(model, c.x_train, c.y_train, needs=frozenset()))
            vector = normalise_rows(vector[None, :])[0]
        reports.append(BootstrapReport(c.id, len(c.y_train), c.bandwidth, c.cpu_speed, vector))
    plan = strategy.plan_fleet(reports, size=initial.size, block_size=1)
    if strategy.needs_synthetic:
        for c in clients:
            fit_synthetic(
                c.state, c.data, num_classes=dataset.num_classes,
                epsilon=spec.options.synthetic_epsilon, delta=spec.options.delta,
                rng=np.random.default_rng([_seed(spec.seed, 0, c.index), 11]),
            )
    globals_ = {k: initial.copy() for k in plan.clusters}
    accuracy: list[float] = []
    for r in range(1, spec.round):
        for k in plan.clusters:
            members = [c for c in clients if plan.cluster_of[c.id] == k]
            globals_[k] = _train_round(spec, strategy, plan, model, members, globals_[k], k, r, train)
        accuracy.append(_accuracy(model, clients, plan, globals_))
        if progress:
            progress("train", r, spec.round - 1)
    return Fleet(
        spec=spec,
        clients=clients,
        model=model,
        strategy=strategy,
        plan=plan,
        globals_=globals_,
        input_shape=dataset.input_shape,
        num_classes=dataset.num_classes,
        accuracy=accuracy,
    )


def _train_round(
    spec: FleetSpec,
    strategy: Strategy,
    plan: FleetPlan,
    model: torch.nn.Module,
    members: list[ClientData],
    start: np.ndarray,
    cluster: int,
    r: int,
    train: TrainConfig,
) -> np.ndarray:
    """One trained round of one cluster, as the simulator runs it minus the encryption.

    Local training, masks, the strategy's client-side DP noise (``privatise``) and withheld
    (personalised) positions are the strategy's own; the mean is taken per position over
    the clients that sent it, weighted by sample counts.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus (DP-SGD rounds) warns about its internals
        local = {
            c.id: local_update(
                strategy, model, merge_personal(start, c.state), c.data, train=train,
                seed=_seed(spec.seed, r, c.index), round=r, state=c.state,
                # experiments replay the clients' noise for reproducible tables (devices never
                # do); the attacker is never handed this seed
                noise=DeviceNoise(replay_seed=spec.seed), index=c.index,
            )
            for c in members
        }
    shared = None
    if strategy.negotiates:
        shared = negotiate(strategy, [local[c.id].sensitivity for c in members], size=start.size, block_size=1)
    total = np.zeros_like(start)
    weight = np.zeros_like(start)
    for c in members:
        planned = shared if strategy.negotiates else strategy.planned_mask(
            plan, c.id, [m.id for m in members], size=start.size, block_size=1)
        context = ClientContext(c.id, r, cluster, plan.budget_of[c.id], planned, 1, participants=len(members))
        choice = strategy.select_mask(context, sensitivity=local[c.id].sensitivity, weights=local[c.id].weights)
        sent, _ = strategy.privatise(
            context, local[c.id].delta, choice, sensitivity=local[c.id].sensitivity,
            rng=np.random.default_rng([spec.seed, 3, r, c.index]),
        )
        keep_personal(c.state, local[c.id], choice.withheld)
        senders = np.ones(start.size) if choice.withheld is None else (~choice.withheld).astype(np.float64)
        total += len(c.y_train) * senders * sent
        weight += len(c.y_train) * senders
    mean = np.divide(total, weight, out=np.zeros_like(total), where=weight > 0)
    return start + spec.options.server_lr * mean


def _profile(values: tuple[float, ...] | None, index: int, name: str) -> float:
    if values is None:
        return 1.0
    if not values:
        raise ConfigError(f"--{name} is empty; give at least one value.")
    return float(values[index % len(values)])


def _accuracy(model: torch.nn.Module, clients: list[ClientData], plan: FleetPlan, globals_: dict[int, np.ndarray]) -> float:
    total = sum(len(c.y_test) for c in clients)
    correct = 0.0
    for c in clients:
        set_vector(model, globals_[plan.cluster_of[c.id]])
        correct += evaluate(model, c.x_test, c.y_test) * len(c.y_test)
    return correct / total if total else 0.0


def order_mask(
    scores: np.ndarray, *, ratio: float, order: str, rng: np.random.Generator
) -> np.ndarray:
    """The ``⌊ratio N⌋`` positions first in ``order`` (high/low sensitivity, or random)."""
    s = np.asarray(scores, dtype=np.float64)
    if order == "high":
        return top_fraction_mask(s, ratio=ratio)
    if order == "low":
        return top_fraction_mask(-s, ratio=ratio)
    if order == "random":
        mask = np.zeros(s.size, dtype=bool)
        mask[rng.choice(s.size, budget_count(alpha=ratio, n=s.size), replace=False)] = True
        return mask
    raise ConfigError(f"--order={order!r} is not allowed; choose one of: {', '.join(ORDERS)}.")


def _local_step(fleet: Fleet, index: int, batch_size: int, trial: int, local_steps: int):  # type: ignore[no-untyped-def]
    spec = fleet.spec
    c = fleet.clients[index]
    if batch_size > len(c.y_train):
        raise ConfigError(
            f"--batch-size={batch_size} is not allowed; client {c.id} holds only "
            f"{len(c.y_train)} training samples."
        )
    if batch_size < 2 and any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in fleet.model.modules()
    ):
        raise ConfigError(
            f"--batch-size={batch_size} is not allowed for model {spec.model!r}: BatchNorm "
            "cannot train on one sample; use a batch of at least 2."
        )
    rng = np.random.default_rng([spec.seed, spec.round, trial, index, batch_size])
    idx = np.sort(rng.choice(len(c.y_train), batch_size, replace=False))
    x, y = c.x_train[idx], c.y_train[idx]
    # the client starts from its merged model (its personalised zone, if any, is its own)
    start = merge_personal(fleet.globals_[fleet.cluster_of(index)], c.state)
    set_vector(fleet.model, start)
    seed = _seed(spec.seed, spec.round, trial, index)
    if fleet.strategy.round_plan(spec.round).dpsgd:
        delta = _dpsgd_steps(fleet, x, y, local_steps, seed)
        weights = start + delta
        set_vector(fleet.model, weights)
    else:
        train_local(fleet.model, x, y, TrainConfig(local_steps, batch_size, spec.lr), seed=seed)
        weights = get_vector(fleet.model).astype(np.float64)
        delta = weights - start
    score = SCORES.get(fleet.strategy.score_name)
    sensitivity = score(score_inputs(fleet.model, x, y, needs=score.needs, delta=delta))
    return idx, x, y, weights, delta, sensitivity


def _dpsgd_steps(fleet: Fleet, x: np.ndarray, y: np.ndarray, steps: int, seed: int) -> np.ndarray:
    """DP-SGD (Abadi et al. 2016) on the batch as one lot: per-sample gradients clipped to
    C, summed, plus N(0, (sigma C)^2) per coordinate, divided by the batch size; ``steps``
    such steps with the local learning rate. Returns the update."""
    o = fleet.strategy.options
    layout = layout_of(fleet.model)
    trainable = layout.trainable_mask()
    rng = np.random.default_rng([seed, 29])
    start = get_vector(fleet.model).astype(np.float64)
    w = start.copy()
    for _ in range(steps):
        set_vector(fleet.model, w)
        total = np.zeros(layout.size)
        for mat, _b in per_sample_gradients(fleet.model, x, y):
            norms = np.linalg.norm(mat, axis=1, keepdims=True)
            total += (mat * np.minimum(1.0, o.clip / np.maximum(norms, 1e-12))).sum(axis=0)
        noise = rng.standard_normal(layout.size) * o.sigma * o.clip * trainable
        w = w - fleet.spec.lr * (total + noise) / len(y)
    return w - start


def capture(
    fleet: Fleet,
    victims: Sequence[int],
    *,
    batch_size: int,
    trial: int,
    order: str | None = None,
    ratio: float | None = None,
    unprotected: Sequence[int] = (),
    local_steps: int = 1,
    draw: int = 0,
) -> list[Capture]:
    """The captured round for ``victims`` (client indices); see the module docstring.

    ``unprotected`` lists victims that send their update without any encryption (the
    reference client of SenseCrypt's heterogeneity experiment). ``draw`` > 0 draws the
    client-side noise afresh (the same batch, model and mask): a later round of a client
    that holds the same data while the global model stays put, the multi-round attacker's
    best case (``benchmarks/bench_rounds_attack.py``); 0 is the single captured update.
    """
    with torch_threads(1):
        return _capture(fleet, victims, batch_size, trial, order, ratio, unprotected, local_steps, draw)


def _capture(
    fleet: Fleet,
    victims: Sequence[int],
    batch_size: int,
    trial: int,
    order: str | None,
    ratio: float | None,
    unprotected: Sequence[int],
    local_steps: int,
    draw: int = 0,
) -> list[Capture]:
    strategy, plan, spec = fleet.strategy, fleet.plan, fleet.spec
    n = len(fleet.clients)
    for v in victims:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < n:
            raise ConfigError(f"--victims value {v!r} is not allowed; clients are 0..{n - 1}.")
    if isinstance(draw, bool) or not isinstance(draw, (int, np.integer)) or draw < 0:
        raise ConfigError(f"draw={draw!r} is not allowed; it must be an integer >= 0.")
    if order is not None and ratio is None:
        raise ConfigError("--order needs --he-ratio, the fraction of positions to encrypt.")
    if strategy.round_plan(spec.round).synthetic:
        authentic = next(r for r in range(spec.round + 1, spec.round + 1000)
                         if not strategy.round_plan(r).synthetic)
        raise ConfigError(
            f"--round={spec.round} is a synthetic-data round of {strategy.name!r}: the update "
            f"carries no real sample to attack; capture an authentic round, e.g. --round {authentic}."
        )
    out: list[Capture] = []
    for k in plan.clusters:
        targets = [v for v in victims if fleet.cluster_of(v) == k]
        if not targets:
            continue
        members = (
            [c.index for c in fleet.clients if plan.cluster_of[c.id] == k]
            if strategy.negotiates
            else targets
        )
        local = {i: _local_step(fleet, i, batch_size, trial, local_steps) for i in members}
        shared = None
        if strategy.negotiates:
            shared = negotiate(strategy, [local[i][5] for i in members], size=fleet.num_params, block_size=1)
        cluster_ids = [c.id for c in fleet.clients if plan.cluster_of[c.id] == k]
        for v in targets:
            idx, x, y, weights, delta, sensitivity = local[v]
            budget = fleet.budget_of(v)
            withheld = None
            if v in unprotected:
                mask, info = np.zeros(delta.size, dtype=bool), {"unprotected": True}
            else:
                planned = shared if strategy.negotiates else strategy.planned_mask(
                    plan, fleet.clients[v].id, cluster_ids, size=fleet.num_params, block_size=1)
                context = ClientContext(
                    fleet.clients[v].id, spec.round, k, budget, planned, 1, participants=len(members)
                )
                if order is not None:  # a fixed-order mask in place of the strategy's own
                    rng = np.random.default_rng([spec.seed, spec.round, trial, v, 17])
                    choice = MaskChoice(
                        order_mask(sensitivity, ratio=float(ratio), order=order, rng=rng),  # type: ignore[arg-type]
                        {"order": order, "ratio": ratio},
                    )
                else:
                    choice = strategy.select_mask(context, sensitivity=sensitivity, weights=weights)
                # the strategy's own client-side noise on what stays plaintext (DP strategies,
                # sensecrypt's plain_noise hybrid; a no-op for plaintext), as in a real round
                delta, noise = strategy.privatise(
                    context, delta, choice, sensitivity=sensitivity,
                    rng=np.random.default_rng([spec.seed, 3, spec.round, trial, v, *([draw] if draw else [])]),
                )
                mask, info = np.asarray(choice.mask, dtype=bool), {**choice.info, **noise}
                if choice.withheld is not None and np.any(choice.withheld):
                    withheld = np.asarray(choice.withheld, dtype=bool)
            unknown = mask if withheld is None else mask | withheld
            view = server_view(
                delta,
                unknown,
                global_vector=fleet.globals_[k],
                model=spec.model,
                model_options=spec.model_options(),
                input_shape=fleet.input_shape,
                num_classes=fleet.num_classes,
                n_samples=batch_size,
                lr=spec.lr,
                local_steps=local_steps,
                client_id=fleet.clients[v].id,
                round=spec.round,
            )
            out.append(Capture(v, view, idx, x, y, weights, sensitivity, budget, info, mask))
    out.sort(key=lambda c: list(victims).index(c.client))
    return out
