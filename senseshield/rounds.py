"""The steps of a round, one function per step and per role.

The simulator calls them in a loop; the fleet runtime calls the client steps in the edge
agent, the aggregation in the coordinator and the decryption in the key server. One
implementation, so a strategy behaves the same in both (same seed, same model).

Client (edge agent):    :func:`bootstrap_vector`, :func:`local_update`, :func:`protect_local`
Coordinator:            ``Strategy.plan_fleet``, :func:`negotiate`,
                        :func:`senseshield.engine.aggregation.aggregate_updates`
Key server:             :func:`senseshield.engine.aggregation.decrypt_aggregate`
Everyone (new model):   :func:`apply_mean`
Client (after a round): :func:`merge_personal` (SelectiveShield's selective merge, eq. 27)

Per-client state that must live on the device (personalised values, DP-SGD accountant
history, the fitted synthetic-data provider) is a :class:`ClientState`.

Every privacy draw of a client step comes from a :class:`~senseshield.device_noise.DeviceNoise`
(secret by default); the job's seed only fixes what is shared (training order, initial model).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from senseshield.engine.buffered import staleness_weight
from senseshield.engine.aggregation import ProtectedUpdate, protect_update
from senseshield.engine.budgets import sigma_for_epsilon
from senseshield.engine.clustering import noisy_mean, normalise_rows
from senseshield.engine.masks import top_up_mask
from senseshield.engine.work import SCORE_SAMPLES, full_steps, score_samples, step_scale
from senseshield.engine.sensitivity import SCORES, Score
from senseshield.data.shards import LocalData  # a device's data; importable from here too
from senseshield.device_noise import SECRET, DeviceNoise
from senseshield.engine.csprng import ChaChaGenerator, NoiseSource
from senseshield.errors import ConfigError
from senseshield.he.base import PublicKey
from senseshield.strategies import ClientContext, MaskChoice, Strategy
from senseshield.synthetic import PROVIDERS, SyntheticProvider

# torch (senseshield.training) is imported by the steps that train, not with this module: a
# key server or coordinator that never trains, and an idle agent, start without it
if TYPE_CHECKING:
    import torch

    from senseshield.job import Job
    from senseshield.training import TrainConfig

@dataclass
class ClientState:
    """What a client keeps between rounds (on the device in the fleet runtime).

    ``personal_mask``/``personal_values``: its personalised zone and the values it kept
    there (eq. 27); ``dp_history``: its Opacus RDP accountant history (DP-SGD);
    ``synthetic``: its fitted synthetic-data provider (Alt-FL SI).
    """

    personal_mask: np.ndarray | None = None
    personal_values: np.ndarray | None = None
    dp_history: list = field(default_factory=list)
    synthetic: SyntheticProvider | None = None
    synthetic_epsilon: float | None = None


def merge_personal(global_vector: np.ndarray, state: ClientState | None) -> np.ndarray:
    """SelectiveShield eq. 27: global values everywhere except the client's personalised zone."""
    merged = np.array(global_vector, dtype=np.float64, copy=True)
    if state is not None and state.personal_mask is not None and state.personal_values is not None:
        merged[state.personal_mask] = state.personal_values
    return merged


def keep_personal(state: ClientState, local: "LocalUpdate", withheld: np.ndarray | None) -> None:
    """Remember this round's personalised zone and its locally trained values."""
    if withheld is None or not np.any(withheld):
        state.personal_mask = state.personal_values = None
        return
    state.personal_mask = withheld.copy()
    state.personal_values = local.weights[withheld].copy()


def fit_synthetic(
    state: ClientState, data: LocalData, *, num_classes: int, epsilon: float, delta: float, rng: NoiseSource,
    provider: str = "dp-gaussian",
) -> None:
    """Fit the client's DP synthetic-data provider once (Alt-FL SI strategies); ``rng`` is the
    device's secret ``synthetic-fit`` stream (:class:`~senseshield.device_noise.DeviceNoise`)."""
    model = PROVIDERS.get(provider)()
    report = model.fit(
        data.x_train, data.y_train, num_classes=num_classes, epsilon=epsilon, delta=delta, rng=rng,
    )
    state.synthetic, state.synthetic_epsilon = model, report.epsilon


@dataclass
class LocalUpdate:
    """A client's trained model, its update and its sensitivity for one round."""

    weights: np.ndarray
    delta: np.ndarray
    sensitivity: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # what the training function returned


def client_seed(seed: int, round_: int, index: int) -> int:
    """Seed of client ``index`` in round ``round_`` (round 0 is the bootstrap)."""
    return int(np.random.SeedSequence([seed, round_, index]).generate_state(1)[0])


def bootstrap_vector(
    strategy: Strategy,
    model: torch.nn.Module,
    initial: np.ndarray,
    data: LocalData,
    *,
    train: TrainConfig,
    seed: int,
    rng: NoiseSource,
) -> np.ndarray | None:
    """The sensitivity vector a client reports once at bootstrap (SenseCrypt Alg. 1 l. 1).

    None when the strategy needs none. Otherwise the client trains ``train.epochs`` from
    the initial model and reports its unit-norm Taylor sensitivity (eq. 2) or, for a
    clustering strategy with ``cluster_epsilon`` set, the DP sketch of Alg. 2 (see
    ``senseshield.engine.clustering``).
    """
    if not strategy.needs_bootstrap_sensitivity:
        return None
    from senseshield.training import torch_threads

    with torch_threads(train.threads):
        return _bootstrap_vector(strategy, model, initial, data, train=train, rng=rng, seed=seed)


def _bootstrap_vector(
    strategy: Strategy, model: torch.nn.Module, initial: np.ndarray, data: LocalData, *,
    train: TrainConfig, seed: int, rng: NoiseSource,
) -> np.ndarray:
    from senseshield.tasks import make_loss
    from senseshield.training import private_sketch_sum, score_inputs, set_vector, train_local

    options = strategy.options
    loss = make_loss(train.task, train.loss)
    set_vector(model, initial)
    train_local(model, data.x_train, data.y_train, train, seed=seed)
    if options.cluster_epsilon is not None and strategy.clusters_clients:
        sigma = sigma_for_epsilon(epsilon=options.cluster_epsilon, delta=options.cluster_delta)
        bounded = private_sketch_sum(model, data.x_train, data.y_train, norm=options.cluster_clip, loss=loss)
        vector = noisy_mean(
            bounded,
            count=data.n_train,
            clip_norm=options.cluster_clip,
            noise_multiplier=sigma,
            rng=rng,
        )
    else:
        vector = SCORES.get("taylor")(score_inputs(model, data.x_train, data.y_train, needs=frozenset(), loss=loss))
    return normalise_rows(vector[None, :])[0]


def local_update(
    strategy: Strategy,
    model: torch.nn.Module,
    global_vector: np.ndarray,
    data: LocalData,
    *,
    train: TrainConfig,
    seed: int,
    round: int = 1,
    state: ClientState | None = None,
    noise_multiplier: float | None = None,
    noise: DeviceNoise = SECRET,
    index: int = 0,
    steps: int | None = None,
) -> LocalUpdate:
    """Train from the global model, then score the parameters (Alg. 1 lines 7-8).

    ``global_vector`` is where the client starts (its merged model, eq. 27, when it keeps
    a personalised zone). The strategy's :meth:`~Strategy.round_plan` picks the data (real
    or the client's DP synthetic data) and the optimiser (SGD or Opacus DP-SGD with
    ``noise_multiplier`` and per-sample clip ``options.clip``; the history is kept in
    ``state``). Runs on ``train.threads`` torch threads (the determinism contract).
    ``seed`` fixes the training order of plain SGD (shared); DP-SGD's sampling and noise come
    from ``noise`` (client ``index``'s ``dpsgd`` stream of this round, secret by default).
    ``steps``: partial work (:mod:`senseshield.engine.work`): train only the first ``steps``
    minibatch steps of plain SGD; the update keeps its data weight n_i and is sent as trained,
    or FedNova-normalised (delta x full / steps) with ``options.partial_fednova``; None or
    full work: unchanged (see :mod:`senseshield.engine.work` for the weighting).
    DP-SGD rounds always train in full (their accountant counts the steps).
    """
    from senseshield.training import torch_threads

    with torch_threads(train.threads):
        return _local_update(strategy, model, global_vector, data, train=train, seed=seed, round=round,
                             state=state, noise_multiplier=noise_multiplier, noise=noise, index=index,
                             steps=steps)


def _local_update(
    strategy: Strategy, model: torch.nn.Module, global_vector: np.ndarray, data: LocalData, *,
    train: TrainConfig, seed: int, round: int, state: ClientState | None, noise_multiplier: float | None,
    noise: DeviceNoise, index: int, steps: int | None = None,
) -> LocalUpdate:
    from senseshield.tasks import make_loss
    from senseshield.training import fit, get_vector, score_inputs, set_vector, train_dpsgd

    score: Score = SCORES.get(strategy.score_name)
    plan = strategy.round_plan(round)
    x, y = data.x_train, data.y_train
    if plan.synthetic:
        if state is None or state.synthetic is None:
            raise ValueError(f"{strategy.name} trains on synthetic data but the client has no fitted provider.")
        x, y = state.synthetic.sample(data.n_train, np.random.default_rng([seed, 13]))
    set_vector(model, global_vector)
    scale, scored = 1.0, SCORE_SAMPLES  # partial work also scores fewer samples (engine.work.score_samples)
    # the update is measured from the weights the device actually starts from (float32),
    # so it is the same whether the global model arrived as float64 or float32
    start = get_vector(model).astype(np.float64)
    t = time.perf_counter()
    if plan.dpsgd:
        if state is None:
            raise ValueError(f"{strategy.name} runs DP-SGD and needs the client's state for its accountant.")
        sigma = strategy.options.sigma if noise_multiplier is None else noise_multiplier
        sampling, gaussian = noise.torch_generators("dpsgd", round=round, index=index)
        last, state.dp_history = train_dpsgd(
            model, x, y, train, noise_multiplier=sigma, max_grad_norm=strategy.options.clip,
            history=state.dp_history, sampling_generator=sampling, noise_generator=gaussian, round=round,
        )
        metrics = {"loss": last}
    else:
        full = full_steps(len(x), batch_size=train.batch_size, epochs=train.epochs)
        scored = score_samples(steps, full, batch_size=train.batch_size)
        if steps is not None and steps < full:
            scale = step_scale(steps, full) if strategy.options.partial_fednova else 1.0
            train = replace(train, max_steps=int(steps))
        metrics = fit(model, x, y, train, seed=seed, round=round)
    weights = get_vector(model).astype(np.float64)
    if not np.all(np.isfinite(weights)):
        if strategy.dp_level == "user":
            advice = (
                "usually because the update noise (std clip x sigma per coordinate) swamps the "
                "model; at a fixed epsilon only a smaller --clip lowers it (e.g. --clip 0.001), "
                "otherwise lower --sigma or raise --target-epsilon"
            )
        else:
            advice = (
                "usually because the learning rate or the DP-SGD noise is too large for the "
                "model; lower --lr or --sigma, or raise --target-epsilon"
            )
        raise ConfigError(
            f"Local training diverged in round {round} (the model has NaN or inf weights), {advice}."
        )
    delta = weights - start
    if scale != 1.0:
        delta = delta * scale  # FedNova: the mean step times the planned steps
    t_train = time.perf_counter() - t
    t = time.perf_counter()
    inputs = score_inputs(model, data.x_train, data.y_train, needs=score.needs, delta=delta,
                          loss=make_loss(train.task, train.loss), max_samples=scored)
    sensitivity = score(inputs)
    return LocalUpdate(
        weights, delta, sensitivity, {"train": t_train, "sensitivity": time.perf_counter() - t}, metrics,
    )


def plan_local_steps(
    n_train: dict[str, int], train: TrainConfig, *, step_s: dict[str, float], other_s: dict[str, float] | None = None,
    limit: float | None, deadline_s: float | None = None, margin: float = 1.0,
    cut: set[str] | None = None,
) -> dict[str, int]:
    """Local steps of every device this round (:func:`senseshield.engine.work.local_steps`):
    full work (``epochs x ceil(n / batch)``) unless its predicted round (``other_s`` + steps x
    ``step_s``, any common unit) would exceed ``limit`` x the quickest device's or the
    deadline. The simulator gives ``step_s = 1 / cpu_speed`` (the job's declared speeds), the
    coordinator what the devices measured (and a ``margin`` below the limit for their spread,
    and ``cut``: the devices on partial work in the last round, whose step times were measured
    on a few steps)."""
    from senseshield.engine.work import local_steps

    ids = sorted(n_train)
    full = np.array([full_steps(n_train[a], batch_size=train.batch_size, epochs=train.epochs) for a in ids])
    if not ids or (limit is None and deadline_s is None):
        return {a: int(f) for a, f in zip(ids, full)}
    other = np.array([(other_s or {}).get(a, 0.0) for a in ids], dtype=np.float64)
    steps = local_steps(step_s=np.array([step_s[a] for a in ids], dtype=np.float64), other_s=other, full=full,
                        limit=limit, deadline_s=deadline_s, margin=margin,
                        measured_in_full=np.array([a not in (cut or set()) for a in ids]))
    return {a: int(s) for a, s in zip(ids, steps)}


def negotiate(
    strategy: Strategy, sensitivities: Sequence[np.ndarray], *, size: int, block_size: int
) -> np.ndarray:
    """Proposals from the clients, consensus at the coordinator (negotiating strategies)."""
    proposals = [strategy.propose(s, block_size=block_size) for s in sensitivities]
    return strategy.consensus(proposals, size=size, block_size=block_size)


def protect_local(
    strategy: Strategy,
    context: ClientContext,
    local: LocalUpdate,
    public_key: PublicKey | None,
    *,
    n_samples: int,
    rng: NoiseSource | None = None,
    min_encrypted: float = 0.0,
    staleness: int = 0,
) -> tuple[ProtectedUpdate, MaskChoice]:
    """Choose this round's mask, privatise what is sent, encrypt (Alg. 1 lines 9-10).

    The strategy's :meth:`~Strategy.privatise` adds its client-side DP noise (only on
    values that travel in plaintext), drawn from ``rng``: the device's secret ``protect``
    stream (``DeviceNoise.generator``); None draws from fresh OS entropy.
    ``choice.withheld`` marks positions never sent. The update's weight is the strategy's
    :meth:`~Strategy.sample_weight` of ``n_samples`` (FedAvg: n_samples itself), discounted
    for ``staleness`` rounds in a buffered job (:func:`~senseshield.engine.buffered.staleness_weight`;
    0: not at all).
    ``min_encrypted``: the device's own floor (``--min-he-ratio``); with a scheme that lets
    each client choose its blocks, a mask below it is topped up with the most sensitive
    blocks (:func:`~senseshield.engine.masks.top_up_mask`) and ``choice.info["topped_up"]``
    says by how much.
    """
    t = time.perf_counter()
    choice = strategy.select_mask(context, sensitivity=local.sensitivity, weights=local.weights)
    if (min_encrypted > 0 and public_key is not None and public_key.for_masks(strategy.per_client_masks).ragged_masks
            and choice.mask.mean() < min_encrypted):
        before = float(choice.mask.mean())
        choice.mask = top_up_mask(choice.mask, local.sensitivity, fraction=min_encrypted,
                                  block_size=public_key.block_size, exclude=choice.withheld)
        choice.info["topped_up"] = [before, float(choice.mask.mean())]
    t_mask = time.perf_counter() - t
    t = time.perf_counter()
    rng = rng if rng is not None else ChaChaGenerator.fresh()
    delta, noise_info = strategy.privatise(context, local.delta, choice, sensitivity=local.sensitivity, rng=rng)
    choice.info.update(noise_info)
    t_noise = time.perf_counter() - t
    t = time.perf_counter()
    update = protect_update(
        delta,
        choice.mask,
        public_key,
        client_id=context.client_id,
        round=context.round,
        cluster=context.cluster,
        n_samples=update_weight(strategy, n_samples, staleness),
        withheld=choice.withheld,
    )
    update.timings.update(local.timings)
    update.timings.update({"mask": t_mask, "noise": t_noise, "encrypt": time.perf_counter() - t})
    return update, choice


def update_weight(strategy: Strategy, n_samples: int, staleness: int = 0) -> int:
    """The weight an update of a device with ``n_samples`` carries: the strategy's sample
    weight, discounted for ``staleness`` rounds when the job is buffered (``options.buffer``)."""
    weight = strategy.sample_weight(n_samples)
    if strategy.options.buffer is None or staleness == 0:
        return weight
    return staleness_weight(weight, staleness, exponent=strategy.options.staleness_exponent)


def choice_report(choice: MaskChoice) -> dict:
    """The JSON-able diagnostics of a mask choice that travel with an update (no values):
    zone ratios, empty zones, and whether the mask solver met its constraints."""
    info = choice.info
    report: dict = {}
    if "zones" in info:
        report["zones"] = {k: float(v) for k, v in info["zones"].items()}
    if info.get("empty_zones"):
        report["empty_zones"] = list(info["empty_zones"])
    if "feasible" in info:
        report["feasible"] = bool(info["feasible"])
        report["violations"] = [str(v) for v in info.get("violations", [])[:1]]
    if info.get("shares"):  # distributed DP: the receipt signs it (the key server's floor)
        report["shares"] = int(info["shares"])
    return report


def apply_mean(global_vector: np.ndarray, mean: np.ndarray, *, server_lr: float) -> np.ndarray:
    """W ← W + η_g · mean update (η_g = 1 is FedAvg)."""
    return np.asarray(global_vector, dtype=np.float64) + server_lr * np.asarray(mean, dtype=np.float64)


def client_bootstrap(
    config: Job, strategy: Strategy, model: torch.nn.Module, initial: np.ndarray, data: LocalData, index: int,
    *, noise: DeviceNoise = SECRET,
) -> np.ndarray | None:
    """Client ``index``'s bootstrap vector (the same on a device and in the simulator when
    both replay one noise seed); Alg. 2's sketch noise is ``noise``'s ``bootstrap-sketch`` draw."""
    from senseshield.job import train_config

    return bootstrap_vector(
        strategy,
        model,
        initial,
        data,
        train=train_config(config, epochs=config.bootstrap_epochs),
        seed=client_seed(config.seed, 0, index),
        rng=noise.generator("bootstrap-sketch", round=0, index=index),
    )
