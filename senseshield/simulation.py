"""In-process simulation of a fleet: real training, real encryption, one process.

The round is the one the fleet runtime runs (bootstrap -> per cluster: train, score,
[negotiate], mask, encrypt -> aggregate -> decrypt -> apply), with the three roles as
function calls instead of MQTT messages. Results follow the JSON contract of
:class:`~senseshield.results.RunResult` (``senseshield simulate --out``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score

from senseshield.accounting import Accountant, Epsilons, epsilons
from senseshield.data import Dataset, load_dataset
from senseshield.data.shards import LocalData, Shard, device_shards, shards
from senseshield.determinism import Trace, mask_digest
from senseshield.engine.aggregation import ProtectedUpdate, aggregate_sealed, aggregate_updates, decrypt_aggregate
from senseshield.errors import ConfigError
from senseshield.job import Job, effective_scheme, initial_model, job_shape, key_pair, noise_multipliers, train_config
from senseshield.results import (
    ClientRecord,
    RoundRecord,
    RoundTally,
    RunResult,
    SimulationResult,
    privacy_fields,
    weighted_metrics,
)
from senseshield.engine.buffered import staleness
from senseshield.engine.work import full_steps
from senseshield.rounds import (
    ClientState,
    apply_mean,
    choice_report,
    client_bootstrap,
    client_seed,
    plan_local_steps,
    fit_synthetic,
    keep_personal,
    local_update,
    merge_personal,
    negotiate,
    protect_local,
)
from senseshield.device_noise import SECRET, DeviceNoise
from senseshield.he.base import job_key, round_context
from senseshield.runtime.identity import Identity
from senseshield.strategies import BootstrapReport, ClientContext, FleetPlan, Strategy, build_strategy
from senseshield.training import evaluate_model, layout_of, set_vector

Progress = Callable[[str, int, int], None]

SimulationConfig = Job  # the name of a run's definition before jobs


@dataclass
class _Client(Shard):
    """A simulated client: its shard plus what it keeps between rounds."""

    he_ratios: list[float] = field(default_factory=list)
    state: ClientState = field(default_factory=ClientState)


def build_clients(config: Job, dataset: Dataset) -> list[_Client]:
    """The simulator's clients: every shard of ``dataset`` with a fresh client state."""
    return [_Client(**vars(s)) for s in shards(config, dataset)]


def bootstrap_reports(
    config: Job,
    strategy: Strategy,
    clients: list[_Client],
    model: torch.nn.Module,
    initial: np.ndarray,
    progress: Progress | None = None,
    *,
    noise: DeviceNoise = SECRET,
) -> list[BootstrapReport]:
    """Every client's bootstrap report (profile + sensitivity vector, Alg. 1 lines 1-2)."""
    reports = []
    for client in clients:
        vector = client_bootstrap(config, strategy, model, initial, client.data, client.index, noise=noise)
        reports.append(
            BootstrapReport(client.id, client.data.n_train, client.bandwidth, client.cpu_speed, vector)
        )
        if progress:
            progress("bootstrap", len(reports), len(clients))
    return reports


Schedule = dict[int, dict[int, dict[str, tuple[int, int]]]]
"""A buffered job's rounds: round -> cluster -> contributor -> (round trained in, model round started from)."""


def buffered_schedule(report: dict) -> Schedule:
    """The rounds of a buffered fleet job as its ``report.json`` records them: for each
    round's cluster whose aggregate the key server accepted, its contributors with the round
    each trained in and the model round it started from (``agents[].rounds``)."""
    rounds_of = {a["id"]: a.get("rounds", {}) for a in report["agents"]}
    out: Schedule = {}
    for record in report["server"]:
        for k, cluster in record["clusters"].items():
            if not cluster.get("accepted"):
                continue
            r = int(record["round"])
            out.setdefault(r, {})[int(k)] = {
                a: (int(rounds_of[a][str(r)]["trained_in"]), int(rounds_of[a][str(r)]["model_round"]))
                for a in cluster["updates"]}
    return out


Observer = Callable[[int, int, "list[ProtectedUpdate]", np.ndarray, "dict[str, np.ndarray]"], None]


def run_simulation(
    config: Job, progress: Progress | None = None, *, trace: bool = False, devices: Sequence[LocalData] | None = None,
    noise_seed: int | None = None, observe: Observer | None = None, schedule: Schedule | None = None,
) -> RunResult:
    """Run ``config.rounds`` rounds of ``config.strategy`` and return the results.

    ``devices``: one client per given data set (each device's own data, e.g. from
    :func:`senseshield.data.local.load_local_data`) instead of shards of ``config.dataset``;
    the job must then give ``input_shape`` and ``num_classes``.
    ``trace``: also record what decided the run (``result.trace``, a
    :class:`senseshield.determinism.Trace`: budgets, every mask, every round's models).
    ``noise_seed``: replay every client's privacy noise from this seed (reproducible runs,
    and the same noise as a fleet given the same seed; :mod:`senseshield.device_noise`); None
    (default) draws it from OS entropy, as devices do, so noisy strategies differ run to run.
    ``observe(round, cluster, updates, mean, truth)``: called after every cluster's aggregate
    with what the coordinator sees (the protected updates and the published mean update) and
    what only the experimenter knows (``truth``: each client's update before protection), for
    attack experiments written apart from this package).
    ``schedule``: a buffered job's rounds as a fleet ran them (:func:`buffered_schedule` of its
    report): round -> cluster -> each contributor's (round it trained in, model round it
    started from); each round then aggregates exactly these contributors, each trained from
    its cluster's model of that round with its training round's seeds and weighted for its
    staleness (:mod:`senseshield.engine.buffered`), so the simulator replays the fleet's
    model. Without it, a buffered job's simulation is synchronous (every device keeps up)."""
    started = time.perf_counter()
    noise = DeviceNoise(noise_seed)
    np.random.seed(config.seed % 2**32)
    strategy = build_strategy(config.strategy, config.options)
    if devices is not None:
        if not devices:
            raise ConfigError("devices=[] is not allowed; give at least one device's data.")
        input_shape, num_classes = job_shape(config)
        clients = [_Client(**vars(s)) for s in device_shards(config, devices)]
    else:
        if config.task != "classification":
            raise ConfigError(f"task={config.task!r} needs each device's data (devices=, --data); the built-in "
                              f"dataset {config.dataset!r} is for classification.")
        dataset = load_dataset(config.dataset, seed=config.seed)
        input_shape, num_classes = dataset.input_shape, dataset.num_classes
        if config.input_shape is not None and tuple(config.input_shape) != tuple(input_shape):
            raise ConfigError(f"input_shape={config.input_shape} does not match dataset {config.dataset!r}, whose inputs are {list(input_shape)}.")
        if config.num_classes is not None and config.num_classes != num_classes:
            raise ConfigError(f"num_classes={config.num_classes} does not match dataset {config.dataset!r}, which has {num_classes} classes.")
        clients = build_clients(config, dataset)
    model, initial = initial_model(config, input_shape, num_classes)
    layout = layout_of(model)
    scheme = effective_scheme(config, strategy)
    public_key, secret_key = key_pair(scheme, config.key_bits)
    public_key = job_key(public_key, per_client_masks=strategy.per_client_masks)  # masked: ragged for sensecrypt

    reports = bootstrap_reports(config, strategy, clients, model, initial, progress, noise=noise)
    # each client's box key, as a device's identity holds it (the masked scheme's pads)
    boxes = {c.id: Identity.generate(c.id) for c in clients}
    o = config.options
    sigma_user, sigma_record = noise_multipliers(config, strategy, {c.id: c.data.n_train for c in clients})
    if strategy.needs_synthetic:
        for c in clients:
            fit_synthetic(
                c.state, c.data, num_classes=num_classes, epsilon=o.synthetic_epsilon,
                delta=o.delta, rng=noise.generator("synthetic-fit", round=0, index=c.index),
            )
    user_accountant = Accountant()
    participations: dict[str, int] = {}  # user-DP rounds each client was sampled in (the server knows)
    sampler = np.random.default_rng([config.seed, 5])
    block_size = public_key.block_size if public_key is not None else 1
    plan: FleetPlan = strategy.plan_fleet(reports, size=layout.size, block_size=block_size)
    globals_ = {k: initial.copy() for k in plan.clusters}
    # a replayed buffered run: cluster -> round -> its model then (what a carried device started from)
    history = {k: {0: initial.copy()} for k in plan.clusters} if schedule is not None else {}
    by_id = {c.id: c for c in clients}
    train = train_config(config)

    rounds: list[RoundRecord] = []
    evaluations: dict[str, dict[str, float]] = {}  # each client's latest metrics
    trained: dict[str, dict[str, float]] = {}  # each client's latest training metrics
    metric_name = train.metric_name
    recorder = Trace(dict(plan.cluster_of), dict(plan.budget_of)) if trace else None
    for r in range(1, config.rounds + 1):
        t_round = time.perf_counter()
        tally = RoundTally()
        round_masks: dict[str, str] = {}
        round_models: dict[int, np.ndarray] = {}
        cohorts: list[tuple[int, int]] = []  # (planned, contributors) of each cluster's aggregate
        sampled = (
            {c.id for c in clients}
            if o.sample_rate >= 1.0
            else {c.id for c in clients if sampler.random() < o.sample_rate}
        )
        for k in plan.clusters:
            members = [by_id[cid] for cid in plan.members(k) if cid in sampled]
            replay = None
            if schedule is not None:  # the fleet's contributors, each from its own start
                replay = schedule.get(r, {}).get(k, {})
                members = [by_id[cid] for cid in sorted(replay)]
            if not members:
                continue
            steps = plan_local_steps({c.id: c.data.n_train for c in members}, train,
                                     step_s={c.id: 1.0 / c.cpu_speed for c in members},
                                     limit=None if strategy.round_plan(r).dpsgd else o.straggle_limit)
            for c in members:
                tally.add_work(c.id, steps=steps[c.id], budget=plan.budget_of[c.id],
                               full_steps=full_steps(c.data.n_train, batch_size=train.batch_size, epochs=train.epochs))
            local = {
                c.id: local_update(
                    strategy,
                    model,
                    merge_personal(globals_[k] if replay is None else history[k][replay[c.id][1]], c.state),
                    c.data,
                    train=train,
                    seed=client_seed(config.seed, r if replay is None else replay[c.id][0], c.index),
                    round=r if replay is None else replay[c.id][0],
                    state=c.state,
                    noise_multiplier=sigma_record.get(c.id),
                    noise=noise,
                    index=c.index,
                    steps=steps[c.id],
                )
                for c in members
            }
            for cid, update in local.items():
                trained[cid] = {f"training_{name}": v for name, v in update.metrics.items()}
            shared = None
            if strategy.negotiates:
                t = time.perf_counter()
                sens = [local[c.id].sensitivity for c in members]
                shared = negotiate(strategy, sens, size=layout.size, block_size=block_size)
                tally.phases["mask"] += time.perf_counter() - t
            updates: list[ProtectedUpdate] = []
            ring_bits = strategy.ring_bits(c.data.n_train for c in members)  # as the coordinator plans it
            for client in members:
                planned = (shared if strategy.negotiates else strategy.planned_mask(
                    plan, client.id, [c.id for c in members], size=layout.size, block_size=block_size))
                context = ClientContext(
                    client.id, r, k, plan.budget_of[client.id], planned, block_size,
                    participants=len(members), noise_multiplier=sigma_user,
                )
                key = (public_key.for_contributor(boxes[client.id].exchange, round_context("simulation", "", r, k),
                                                  ring_bits=ring_bits)
                       if public_key is not None else None)
                update, choice = protect_local(
                    strategy, context, local[client.id], key, n_samples=client.data.n_train,
                    rng=noise.generator("protect", round=r, index=client.index),
                    staleness=staleness(r, replay[client.id][1]) if replay is not None else 0,
                )
                keep_personal(client.state, local[client.id], choice.withheld)
                round_masks[client.id] = mask_digest(update.mask, update.withheld)
                tally.add_update(client.id, update.timings, update.he_ratio, update.nbytes, choice_report(choice))
                client.he_ratios.append(update.he_ratio)
                updates.append(update)
            t = time.perf_counter()
            aggregate = aggregate_updates(updates, public_key, round=r, cluster=k,
                                          min_encryptors=config.options.min_encryptors)
            tally.phases["aggregate"] += time.perf_counter() - t
            t = time.perf_counter()
            if aggregate.ciphertext is not None:
                weights = {u.client_id: u.n_samples for u in updates}
                secret_key.bind_contributions(
                    aggregate.ciphertext, [(boxes[c].box_key, weights[c]) for c in aggregate.contributors],
                    round_context("simulation", "", r, k),
                    masks=[aggregate.masks[c] for c in aggregate.contributors] if aggregate.masks else None)
            mean = decrypt_aggregate(aggregate, secret_key)
            cohorts.append((len(members), len(aggregate.contributors)))
            tally.phases["decrypt"] += time.perf_counter() - t
            tally.union_ratios.append(float(aggregate.union_mask.mean()))
            tally.add_sealed(r, k, aggregate_sealed(aggregate, public_key), config.options.min_encryptors)
            if observe is not None:
                observe(r, k, updates, mean, {c.id: local[c.id].delta for c in members})
            globals_[k] = apply_mean(globals_[k], mean, server_lr=config.options.server_lr)
            if schedule is not None:
                history[k][r] = globals_[k]
            round_models[k] = globals_[k]
            tally.bytes_down += len(members) * layout.size * 4
        if recorder is not None:
            recorder.record_round(r, round_masks, round_models)
        if strategy.user_dp_round(r) and sampled:
            user_accountant.step(noise_multiplier=strategy.release_sigma(sigma_user or 0.0, cohorts),
                                 sample_rate=o.sample_rate)
            for cid in sampled:
                participations[cid] = participations.get(cid, 0) + 1
        spent = _epsilons(strategy, user_accountant, participations, clients, o.delta)
        t = time.perf_counter()
        for client in clients:
            set_vector(model, merge_personal(globals_[plan.cluster_of[client.id]], client.state))
            evaluations[client.id] = {**evaluate_model(model, client.data.x_test, client.data.y_test, train, round=r),
                                      **trained.get(client.id, {})}
        tally.phases["evaluate"] += time.perf_counter() - t
        rounds.append(
            tally.record(
                r,
                strategy,
                metric_name=metric_name,
                metrics=weighted_metrics([(evaluations[c.id], len(c.data.y_test)) for c in clients]),
                seconds=time.perf_counter() - t_round,
                participants=len(sampled),
                sample_rate=o.sample_rate,
                epsilon=spent.observer if spent else None,
                epsilon_server=spent.server if spent else None,
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
    final = _epsilons(strategy, user_accountant, participations, clients, o.delta, pld=True)
    result = RunResult(
        strategy=config.strategy,
        scheme=scheme,
        dataset=config.dataset if devices is None else "devices",
        model=config.model,
        partition=config.partition if devices is None else "devices",
        seed=config.seed,
        num_params=layout.size,
        num_clusters=len(plan.clusters),
        cluster_ari=ari,
        clustering_epsilon=config.options.cluster_epsilon if strategy.clusters_clients else None,
        final_accuracy=rounds[-1].accuracy,
        metric_name=metric_name,
        final_metric=rounds[-1].metric,
        seconds_total=time.perf_counter() - started,
        rounds=rounds,
        clients=[
            ClientRecord(
                id=c.id,
                cluster=plan.cluster_of[c.id],
                category=c.category,
                encryption_budget=plan.budget_of[c.id],
                he_ratio=float(np.mean(c.he_ratios)) if c.he_ratios else 0.0,
                accuracy=evaluations[c.id].get(metric_name, 0.0) if metric_name == "accuracy" else None,
                metric=evaluations[c.id].get(metric_name),
                metrics=evaluations[c.id],
                n_train=c.data.n_train,
                n_test=len(c.data.y_test),
                bandwidth=c.bandwidth,
                cpu_speed=c.cpu_speed,
            )
            for c in clients
        ],
        config=config.model_dump(mode="json"),
        machine={"python": platform.python_version(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        **privacy_fields(strategy, final),
        delta=o.delta if strategy.dp_level is not None else None,
        noise_multiplier=sigma_user if sigma_user is not None else (max(sigma_record.values()) if sigma_record else None),
        synthetic_epsilon=(
            max(c.state.synthetic_epsilon or 0.0 for c in clients) if strategy.needs_synthetic else None
        ),
        device_noise=noise.describe(),
    )
    result._models = {k: v.copy() for k, v in globals_.items()}
    result._shape = (tuple(input_shape), num_classes)
    result._trace = recorder
    return result


def _epsilons(strategy: Strategy, user: Accountant, participations: dict[str, int], clients: list,
              delta: float, *, pld: bool = False) -> Epsilons | None:
    """Epsilon spent so far against an outside observer and against the server (None
    without DP): the user-level accountant, the server's figure for the client sampled
    most often, or the worst client's DP-SGD accountant (senseshield.accounting)."""
    if strategy.dp_level is None:
        return None
    return epsilons(delta, user=user, participations=max(participations.values(), default=0),
                    records=[c.state.dp_history for c in clients], pld=pld)


__all__ = ["Job", "SimulationConfig", "RunResult", "SimulationResult", "run_simulation", "ConfigError"]
