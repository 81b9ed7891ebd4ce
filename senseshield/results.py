"""What a run reports: per round, per client, and the whole run (``simulate --out`` and the
fleet's ``report.json`` share these field names; they are a contract).

:class:`RoundTally` adds up a round's updates; the simulator and the coordinator both keep
one, so their records are computed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, PrivateAttr

from senseshield.accounting import ADJACENCY, Epsilons
from senseshield.determinism import Trace
from senseshield.strategies import Strategy

if TYPE_CHECKING:  # torch loads on first use
    import torch

PHASES = ("train", "sensitivity", "mask", "noise", "encrypt", "aggregate", "decrypt", "evaluate")


class RoundRecord(BaseModel):
    round: int
    accuracy: float | None  # the test accuracy when the job's metric is accuracy, else None
    metric: float | None = None  # the job's metric (RunResult.metric_name), weighted by test samples
    metrics: dict[str, float] = {}  # every metric the clients reported (evaluation and training_*)
    he_ratio_mean: float
    union_ratio_mean: float
    # union positions encrypted by fewer than min_encryptors clients: never decrypted
    sealed_positions: int = 0
    bytes_up: int
    bytes_down: int
    seconds: float
    phase_seconds: dict[str, float]
    infeasible_masks: int
    violations: list[str] = []  # first violation sentence of each infeasible mask (max 3)
    participants: int | None = None  # clients whose update was aggregated (simulator: the sampled ones)
    epsilon: float | None = None  # DP epsilon spent up to and including this round (RDP, outside observer)
    # against the server, which knows who was sampled: no sampling amplification, the most
    # frequent participant's rounds (user-level DP; record-level: the same as epsilon)
    epsilon_server: float | None = None
    delta: float | None = None
    zone_ratios: dict[str, float] | None = None  # mean M_enc / M_pers / M_noise (SelectiveShield)
    round_type: str | None = None  # Alt-FL round type
    notes: list[str] = []  # e.g. an empty zone, a round nobody was sampled in
    joined: list[str] = []  # fleet: devices that joined (admitted or back online) before this round
    left: list[str] = []  # fleet: devices that went offline since the last round (not sampled)
    # per device this round: local "steps" trained of its "full_steps" and its encryption "budget"
    work: dict[str, dict[str, float]] = {}


class ClientRecord(BaseModel):
    id: str
    cluster: int
    category: int | None
    encryption_budget: float
    he_ratio: float
    accuracy: float | None  # None when the job's metric is not accuracy
    metric: float | None = None  # the job's metric on this client's test split
    metrics: dict[str, float] = {}  # its latest evaluation metrics and training_* metrics
    n_train: int
    n_test: int
    bandwidth: float
    cpu_speed: float


class RunResult(BaseModel):
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
    final_accuracy: float | None  # None when the job's metric is not accuracy
    metric_name: str = "accuracy"  # the job's metric: accuracy, mse, mae, ... (task and job)
    final_metric: float | None = None
    seconds_total: float
    rounds: list[RoundRecord]
    clients: list[ClientRecord]
    config: dict
    machine: dict
    # Privacy (senseshield.accounting says against whom each figure holds, and why):
    epsilon: float | None = None  # final DP epsilon (None: the strategy uses no DP), RDP, outside observer
    epsilon_server: float | None = None  # final epsilon against the server, which knows who was sampled
    epsilon_pld: float | None = None  # the final epsilon by PLD (Opacus' PRV), outside observer
    epsilon_server_pld: float | None = None  # by PLD, against the server
    server_rounds: int | None = None  # user-level DP: the rounds epsilon_server composes (most-sampled client)
    accountant: str | None = None  # the accountant of epsilon / epsilon_server ("rdp"; *_pld: Opacus' PRV)
    adjacency: str | None = None  # the neighbouring relation of the figures
    delta: float | None = None
    noise_multiplier: float | None = None  # sigma used (calibrated when target_epsilon is set)
    synthetic_epsilon: float | None = None  # epsilon of the DP synthetic-data provider
    device_noise: str | None = None  # where the clients' privacy noise came from (senseshield.device_noise)
    # the final global model of every cluster (float64); not part of the JSON
    _models: dict[int, np.ndarray] = PrivateAttr(default_factory=dict)
    _trace: Trace | None = PrivateAttr(default=None)
    _shape: tuple[tuple[int, ...], int] | None = PrivateAttr(default=None)  # the models' (input_shape, num_classes)

    @property
    def models(self) -> dict[int, np.ndarray]:
        """The final global model of every cluster as a flat float64 vector (the layout of
        :func:`senseshield.training.get_vector`); :meth:`final_model` makes one a module."""
        return self._models

    def final_model(self, cluster: int = 0) -> torch.nn.Module:
        """Cluster ``cluster``'s final global model as a ``torch.nn.Module`` in eval mode, built
        as the job built it (its ``model`` and ``model_args``, for the run's input shape and
        classes) and holding ``models[cluster]``: its outputs are the logits the run's last
        evaluation scored. :class:`ConfigError` naming the run's clusters for another one."""
        from senseshield.errors import ConfigError
        from senseshield.models import model_with_weights

        if not self._models:
            raise ConfigError(
                "This result holds no models (a result read back from JSON has none); take "
                "final_model from the result simulate returns.")
        if isinstance(cluster, bool) or cluster not in self._models:
            raise ConfigError(
                f"cluster={cluster!r} is not allowed; this run has cluster(s) "
                f"{', '.join(map(str, sorted(self._models)))}.")
        shape, classes = self._shape or (self.config.get("input_shape"), self.config.get("num_classes"))
        if shape is None or classes is None:
            raise ConfigError("This result does not say its models' input_shape and num_classes; "
                              "build the model with senseshield.model_with_weights.")
        return model_with_weights(self.config.get("model", self.model), tuple(shape), classes,
                                  self._models[cluster], model_args=self.config.get("model_args") or {})

    @property
    def trace(self) -> Trace | None:
        """What decided the run (``run_simulation(..., trace=True)``), else None."""
        return self._trace


SimulationResult = RunResult  # the name of the simulate --out contract before jobs


def privacy_fields(strategy: Strategy, eps: Epsilons | None) -> dict:
    """A run's final privacy figures as :class:`RunResult` fields (empty without DP)."""
    if strategy.dp_level is None or eps is None:
        return {}
    return {"epsilon": eps.observer, "epsilon_server": eps.server, "epsilon_pld": eps.observer_pld,
            "epsilon_server_pld": eps.server_pld, "server_rounds": eps.server_rounds,
            "accountant": "rdp", "adjacency": ADJACENCY[strategy.dp_adjacency or strategy.dp_level]}


def privacy_line(report: dict) -> str | None:
    """One sentence of a run's privacy figures (``report``: a run's JSON), None without DP."""
    if report.get("epsilon") is None:
        return None
    server = report.get("epsilon_server")
    server = report["epsilon"] if server is None else server
    rounds = report.get("server_rounds")
    who = f" and saw one client in {rounds} DP round(s)" if rounds is not None else ""
    pld = report.get("epsilon_pld"), report.get("epsilon_server_pld")
    how = (report.get("accountant") or "rdp").upper() + (f"; by PLD {pld[0]:.2f} and {pld[1]:.2f}" if None not in pld else "")
    adjacency = f" Adjacency: {report['adjacency']}." if report.get("adjacency") else ""
    if str(report.get("device_noise") or "").startswith("replayed"):
        adjacency += " The noise was replayed from a test-only seed: none of this holds against whoever knows it."
    return (f"privacy (δ = {report.get('delta'):g}): ε = {report['epsilon']:.2f} against an outside observer of "
            f"the models, {server:.2f} against the server, which knows who was sampled{who} ({how}).{adjacency}")


def metric_line(report: dict) -> str:
    """``final accuracy 0.912`` / ``final mse 0.0312``: a run's final metric in words."""
    name = report.get("metric_name") or "accuracy"
    value = report.get("final_metric")
    value = report.get("final_accuracy") if value is None else value
    return f"final {name} {value:.4g}" if value is not None else f"final {name}: none reported"


def failed_phrase(failed: dict[str, str], shown: int = 2) -> str:
    """``N failed (who: why; ...)``: the devices that failed, grouped by their sentence (the
    ``shown`` most common sentences; the others counted)."""
    by_reason: dict[str, list[str]] = {}
    for agent in sorted(failed):
        by_reason.setdefault(failed[agent], []).append(agent)
    groups = sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    said = [f"{_names(who)}: {why.rstrip('.')}" for why, who in groups[:shown]]
    if len(groups) > shown:
        said.append(f"{sum(len(who) for _, who in groups[shown:])} more with other reasons")
    return f"{len(failed)} failed ({'; '.join(said)})"


def _names(who: list[str], shown: int = 3) -> str:
    return ", ".join(who[:shown]) + (f" and {len(who) - shown} more" if len(who) > shown else "")


def weighted_metrics(items: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Each metric name's mean over clients weighted by their test-set sizes (clients that
    did not report a metric do not count for it)."""
    names = sorted({k for m, _ in items for k in m})
    return {k: weighted_accuracy([(m[k], n) for m, n in items if k in m]) for k in names}


def weighted_accuracy(pairs: list[tuple[float, int]]) -> float:
    """Test accuracy over all clients: each client's accuracy weighted by its test-set size."""
    total = sum(n for _, n in pairs)
    if total == 0:
        return 0.0
    return float(sum(a * n for a, n in pairs) / total)


def _round_type(strategy: Strategy, r: int) -> str | None:
    kind = getattr(strategy, "_kind", None)
    return kind(r) if kind is not None else None


@dataclass
class RoundTally:
    """What a round's updates add up to (the simulator and the coordinator both keep one)."""

    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    bytes_up: int = 0
    bytes_down: int = 0
    infeasible: int = 0
    violations: list[str] = field(default_factory=list)
    union_ratios: list[float] = field(default_factory=list)
    sealed_positions: int = 0
    he_ratios: list[float] = field(default_factory=list)
    zone_sums: dict[str, list[float]] = field(default_factory=dict)
    empty_zones: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    work: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> steps, full_steps, budget

    def add_work(self, client_id: str, *, steps: int, full_steps: int, budget: float) -> None:
        self.work[client_id] = {"steps": int(steps), "full_steps": int(full_steps), "budget": round(float(budget), 6)}

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

    def add_sealed(self, r: int, k: int, sealed: dict | None, min_encryptors: int) -> None:
        """Cluster ``k``'s positions left sealed (:func:`~senseshield.engine.aggregation.thin_report`)."""
        if not sealed or not sealed["positions"]:
            return
        self.sealed_positions += sealed["positions"]
        first = "; ".join(f"block {b} by {', '.join(a)}" for b, a in sealed["blocks"][:3])
        self.notes.append(f"round {r} cluster {k}: {sealed['positions']} position(s) in {sealed['blocks_total']} "
                          f"block(s) encrypted by fewer than {min_encryptors} agents were not decrypted ({first})")

    def record(
        self, r: int, strategy: Strategy, *, metric_name: str = "accuracy", metrics: dict[str, float] | None = None,
        seconds: float, participants: int,
        sample_rate: float, epsilon: float | None, delta: float, sampled: int | None = None,
        epsilon_server: float | None = None,
    ) -> RoundRecord:
        notes = list(self.notes)
        if not (participants if sampled is None else sampled):
            notes.append(f"round {r}: no client was sampled (q={sample_rate}); the model is unchanged")
        for name, count in sorted(self.empty_zones.items()):
            notes.append(f"round {r}: the {name} zone is empty for {count} client(s)")
        metrics = dict(metrics or {})
        value = metrics.get(metric_name)
        return RoundRecord(
            round=r,
            accuracy=(value or 0.0) if metric_name == "accuracy" else None,
            metric=value,
            metrics=metrics,
            he_ratio_mean=float(np.mean(self.he_ratios)) if self.he_ratios else 0.0,
            union_ratio_mean=float(np.mean(self.union_ratios)) if self.union_ratios else 0.0,
            sealed_positions=self.sealed_positions,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            seconds=seconds,
            phase_seconds={k: round(v, 6) for k, v in self.phases.items()},
            infeasible_masks=self.infeasible,
            violations=self.violations,
            participants=participants,
            epsilon=epsilon,
            epsilon_server=epsilon_server if epsilon_server is not None else epsilon,
            delta=delta if epsilon is not None else None,
            zone_ratios={k: float(np.mean(v)) for k, v in self.zone_sums.items()} or None,
            round_type=_round_type(strategy, r),
            notes=notes,
            work=dict(sorted(self.work.items())),
        )
