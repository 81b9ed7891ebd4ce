"""The strategy interface: how much of each update is encrypted, and where.

A strategy is a small object with hooks on both sides of a round; the round itself (train,
score, protect, aggregate, decrypt, apply) is run by the simulator or the fleet runtime, so
every strategy runs unchanged in both.

Coordinator side (public key only):
  * :meth:`Strategy.plan_fleet` turns bootstrap reports into clusters, encryption budgets and
    any fixed masks (SenseCrypt Alg. 1 lines 1-3);
  * :meth:`Strategy.consensus` merges per-client mask proposals into one shared mask
    (negotiating strategies only).
Client side:
  * :meth:`Strategy.propose` proposes positions (negotiating strategies only);
  * :meth:`Strategy.select_mask` decides which positions of this round's update are
    encrypted (SenseCrypt Alg. 1 line 9).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from senseshield import defaults
from senseshield.engine.clustering import nearest_cluster
from senseshield.engine.budgets import encryption_budgets, measured_budgets, snap_budgets
from senseshield.engine.dp import check_clip, check_sigma
from senseshield.engine.measurements import pool_agreeing
from senseshield.engine.zones import check_unit, parse_ratio
from senseshield.errors import ConfigError
from senseshield.registry import Registry


BUDGET_MODES = ("measured", "paper", "calibrated")
MASK_MODES = ("solver", "nested")


class StrategyOptions(BaseModel):
    """Knobs shared by the strategies; each strategy reads the ones it needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    he_ratio: float = Field(0.1, gt=0.0, le=1.0, description="Encrypted fraction (maskcrypt, fedml-he).")
    security_c: float = Field(0.5, ge=0.0, description="C of the security level 1 - C e^(-B alpha) (SenseCrypt eq. 7).")
    security_b: float = Field(2.0, ge=0.0, description="B of the security level (SenseCrypt eq. 7).")
    eta_mi: float | None = Field(2.0, ge=0.0, description="MI bound in bits (SenseCrypt eq. 8); None disables it.")
    mi_bins: int = Field(16, ge=2, description="Histogram bins of the MI estimator.")
    cluster_epsilon: float | None = Field(None, gt=0.0, description="DP epsilon of the clustering vectors; None = no noise.")
    cluster_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="DP delta of the clustering vectors.")
    cluster_clip: float = Field(1.0, gt=0.0, description="Per-sample L2 clip G of sensitivity vectors (Alg. 2).")
    server_lr: float = Field(1.0, gt=0.0, description="Server learning rate applied to the mean update.")
    budget_mode: str = Field(
        "measured",
        description=(
            "Encryption budgets: 'measured' (from the encryption rate and bandwidth every device of a "
            "cluster measured at join, refreshed from its rounds; the paper's formula where one did "
            "not measure), 'paper' (max-abs over bandwidth and CPU speed, SenseCrypt sec. 3.2) "
            "or 'calibrated' (from measured train/encrypt rates and bandwidth, so that predicted "
            "round times line up under the deadline)."
        ),
    )
    budget_tolerance: float | None = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description=(
            "Relative tolerance added to every measured figure's probe interval [min, max] before "
            "budgets: devices whose widened intervals overlap count as equal and share the median "
            "figure (declared figures are exact); measured budgets are then snapped to the grid "
            "1, s^-1, s^-2, ... with s = (1 + tolerance)^2 (within 1 + tolerance of the cluster's "
            "top budget is 1). 0 pools only overlapping probe intervals and does not snap; None "
            "uses every figure as reported (no pooling, no snapping)."
        ),
    )
    min_encryptors: int = Field(
        defaults.MIN_ENCRYPTORS,
        ge=1,
        description=(
            "Never a sum of fewer than k: with per-client masks (Paillier, packed "
            "Paillier) a position fewer than k clients of the cluster encrypted is never "
            "decrypted; its mean comes from the clients that sent it in plaintext. 1 = the "
            "papers' rule (a single encryptor's value is decrypted)."
        ),
    )
    masks: str = Field(
        "solver",
        description=(
            "SenseCrypt's per-client masks: 'solver' (each client solves eqs. 4-8 on its own "
            "sensitivity every round) or 'nested' (the cluster ranks blocks once by its "
            "members' mean bootstrap sensitivity and each member encrypts the prefix of that one "
            "ranking the solver picks at its budget, the largest min_encryptors-1 prefixes capped "
            "at the next, so every encrypted block has at least min_encryptors encryptors; each "
            "member also encrypts its own most sensitive blocks up to its budget, which the "
            "prefix adds to but never replaces: such a block fewer encrypt is sealed)."
        ),
    )
    straggle_limit: float | None = Field(
        None,
        ge=1.0,
        description=(
            "Partial work: a device whose predicted round exceeds this many times the quickest "
            "device's trains fewer local steps (sent as trained, with its data weight; see partial_fednova); None: every "
            "device trains in full unless its training would miss the round deadline."
        ),
    )
    partial_fednova: bool = Field(
        False,
        description=(
            "Partial work: send a partial update FedNova-normalised (delta x full / steps) instead of "
            "as trained; measured unstable at 10x step ratios (docs: partial work)."
        ),
    )
    buffer: int | None = Field(
        None,
        ge=1,
        description=(
            "Buffered rounds (FedBuff): a cluster's round closes as soon as this many updates are in, and a "
            "device still training is carried into the next round, its update weighted by staleness (see "
            "staleness_exponent); None: synchronous rounds (each waits for every planned device or its deadline)."
        ),
    )
    staleness_exponent: float = Field(
        0.5,
        ge=0.0,
        description="Buffered rounds: an update tau rounds stale weighs n_i x (1 + tau)^-a for this a (0: no discount).",
    )
    # ---- hybrid HE + DP strategies (docs/hybrid.md) ----
    tau: float = Field(0.1, description="Fisher threshold of the local masks (SelectiveShield eq. 14), in [0, 1].")
    rho: float = Field(0.5, description="Consensus threshold of the encrypted zone (SelectiveShield eq. 16), in [0, 1].")
    clip: float = Field(1.0, description="L2 clipping norm C of DP releases (update clip or DP-SGD per-sample clip).")
    sigma: float = Field(1.0, description="Gaussian noise multiplier; ignored when target_epsilon is set.")
    target_epsilon: float | None = Field(None, description="Calibrate sigma so the run spends this epsilon (Opacus).")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="DP delta of the accountant.")
    sample_rate: float = Field(1.0, description="Poisson client sampling rate q per round, in (0, 1].")
    dp_quorum: float = Field(
        1.0,
        description=(
            "masked-dp (distributed DP): each agent's noise share is sized for ceil(dp_quorum x the round's "
            "planned participants) contributors, so the sum carries the accounted sigma while at least that "
            "many contribute (a round with fewer is charged at the sigma it carried); in (0, 1]."
        ),
    )
    plain_noise: float = Field(
        0.0,
        description=(
            "SenseCrypt hybrid: Gaussian noise on the plaintext part of each update, its "
            "norm this fraction of that part's norm (a noise-to-signal ratio against gradient "
            "inversion; not a DP guarantee); 0 = off."
        ),
    )
    ring_bits: int | str = Field(
        "auto",
        description=(
            "masked scheme: the ring of the masked words, 32 (4 bytes per parameter, fixed point 2^-15, values "
            "clipped to ±1, a cluster's total weight below 2^16), 64 (8 bytes, 2^-24, |x| < 4096, weight below "
            "2^26) or auto: 32 when the cluster's planned total weight fits and the strategy adds no noise to "
            "what it masks, else 64 (docs/security.md)."
        ),
    )
    score: str | None = Field(None, description="Per-round sensitivity score of the clients (see `senseshield strategies`: taylor, fisher, grad_delta, leakage); default: the strategy's.")
    dp_ratio: float = Field(0.1, description="Fraction of coordinates Selective-DP noises (top-k by |g|*|dw|).")
    budget_skew: float = Field(1.0, description="Selective-DP schedule: the most sensitive coordinate gets (1+skew) x noise.")
    rho_syn: int = Field(1, description="Alt-FL: synthetic (or DP) rounds in every rho_tot rounds.")
    rho_tot: int = Field(2, description="Alt-FL: period of the interleaving schedule.")
    synthetic_epsilon: float = Field(1.0, description="Epsilon of the DP synthetic-data provider (Alt-FL SI).")

    @field_validator("tau", "rho", "dp_ratio")
    @classmethod
    def _unit(cls, value: float, info: Any) -> float:
        return check_unit(info.field_name, value)

    @field_validator("sigma")
    @classmethod
    def _sigma(cls, value: float) -> float:
        return check_sigma(value)

    @field_validator("clip")
    @classmethod
    def _clip(cls, value: float) -> float:
        return check_clip(value)

    @field_validator("ring_bits", mode="before")
    @classmethod
    def _ring_bits(cls, value: Any) -> int | str:
        from senseshield.he.masked import ring_option

        return ring_option(value)

    @field_validator("score")
    @classmethod
    def _score(cls, value: str | None) -> str | None:
        from senseshield.engine.sensitivity import SCORES

        if value is not None and value not in SCORES.names():
            raise ConfigError(f"score={value!r} is not allowed; choose one of: {', '.join(sorted(SCORES.names()))}.")
        return value

    @field_validator("plain_noise")
    @classmethod
    def _plain_noise(cls, value: float) -> float:
        if not (np.isfinite(value) and 0.0 <= value <= 10.0):
            raise ConfigError(f"plain_noise={value!r} is not allowed; use a noise-to-signal ratio in [0, 10] (0 = off).")
        return value

    @field_validator("dp_quorum")
    @classmethod
    def _quorum(cls, value: float) -> float:
        from senseshield.engine.dp import noised_for

        noised_for(1, value)  # one sentence naming the value if it is outside (0, 1]
        return value

    @field_validator("sample_rate")
    @classmethod
    def _rate(cls, value: float) -> float:
        if not (0.0 < value <= 1.0):
            raise ConfigError(f"sample_rate={value!r} is not allowed; the Poisson rate q must lie in (0, 1].")
        return value

    @field_validator("target_epsilon", "synthetic_epsilon")
    @classmethod
    def _epsilon(cls, value: float | None, info: Any) -> float | None:
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ConfigError(f"{info.field_name}={value!r} is not allowed; epsilon must be a finite number > 0.")
        return value

    @field_validator("budget_mode")
    @classmethod
    def _budget_mode(cls, value: str) -> str:
        if value not in BUDGET_MODES:
            raise ConfigError(
                f"budget_mode={value!r} is not allowed; use one of: {', '.join(BUDGET_MODES)}."
            )
        return value

    @field_validator("masks")
    @classmethod
    def _masks(cls, value: str) -> str:
        if value not in MASK_MODES:
            raise ConfigError(f"masks={value!r} is not allowed; use one of: {', '.join(MASK_MODES)}.")
        return value

    @field_validator("budget_skew")
    @classmethod
    def _skew(cls, value: float) -> float:
        if not (np.isfinite(value) and value >= 0):
            raise ConfigError(f"budget_skew={value!r} is not allowed; it must be a finite number >= 0.")
        return value

    @model_validator(mode="after")
    def _ratio(self) -> "StrategyOptions":
        parse_ratio(self.rho_syn, self.rho_tot)
        if self.buffer is not None and self.buffer < self.min_encryptors:
            raise ConfigError(
                f"buffer={self.buffer} is not allowed with min_encryptors={self.min_encryptors}; the key server "
                "unmasks no sum of fewer contributors, so a buffer needs at least min_encryptors updates."
            )
        if self.buffer is not None and self.straggle_limit is not None:
            raise ConfigError(
                f"buffer={self.buffer} with straggle_limit={self.straggle_limit!r} is not allowed; buffered rounds "
                "carry a slow device into later rounds instead of cutting its work (unset one of them)."
            )
        if self.masks == "nested" and self.cluster_epsilon is not None:
            raise ConfigError(
                f"masks='nested' with cluster_epsilon={self.cluster_epsilon!r} is not allowed; nested masks "
                "rank blocks by the members' full bootstrap sensitivity, which the DP sketches do not carry "
                "(unset cluster_epsilon or use masks='solver')."
            )
        return self


@dataclass(frozen=True)
class RoundCosts:
    """What a device measured about its own round (for ``budget_mode = "calibrated"``).

    ``train_s``: predicted seconds of local training + sensitivity per round;
    ``encrypt_per_s``: values it encrypts per second with the fleet's key;
    ``bytes_per_encrypted``: bytes on the wire per encrypted value;
    ``latency_s``: one-way network latency it knows of (0 if unknown).
    """

    train_s: float
    encrypt_per_s: float
    bytes_per_encrypted: float
    latency_s: float = 0.0

    @staticmethod
    def from_profile(profile: dict[str, Any] | None) -> "RoundCosts | None":
        """The ``measured`` entry an agent puts in its hello profile, if complete."""
        data = (profile or {}).get("measured")
        if not isinstance(data, dict):
            return None
        try:
            costs = RoundCosts(float(data["train_s"]), float(data["encrypt_per_s"]),
                               float(data["bytes_per_encrypted"]), float(data.get("latency_s", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None
        ok = all(np.isfinite(v) and v >= 0 for v in (costs.train_s, costs.bytes_per_encrypted, costs.latency_s))
        return costs if ok and np.isfinite(costs.encrypt_per_s) and costs.encrypt_per_s > 0 else None


@dataclass(frozen=True)
class EncryptionRate:
    """What a device measured of its encryption speed at join (its profile, ``edge-agent join
    --profile auto``): ``per_s`` values encrypted per second, ``bytes_per_value`` ciphertext bytes
    on the wire per value (0 when unknown), ``method`` the scheme and key size it was measured
    with (rates of different methods are not compared)."""

    per_s: float
    method: str
    bytes_per_value: float = 0.0

    @staticmethod
    def from_profile(profile: dict[str, Any] | None) -> "EncryptionRate | None":
        """The rate of a hello profile (:class:`senseshield.profiles.DeviceProfile` fields
        ``he_encryptions_per_s``, ``he_scheme``, ``he_key_bits``, ``he_bytes_per_value``); None
        when absent or malformed (the device then counts as not measured)."""
        profile = profile or {}
        rate, scheme = profile.get("he_encryptions_per_s"), profile.get("he_scheme")
        size = profile.get("he_bytes_per_value") or 0.0
        if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and np.isfinite(rate) and rate > 0
                and isinstance(scheme, str) and scheme):
            return None
        if not (isinstance(size, (int, float)) and not isinstance(size, bool) and np.isfinite(size) and size >= 0):
            size = 0.0
        bits = profile.get("he_key_bits")
        return EncryptionRate(float(rate), f"{scheme}/{bits}" if bits else scheme, float(size))


@dataclass(frozen=True)
class BootstrapReport:
    """What a client sends once at join/bootstrap: its profile and a clustering vector."""

    client_id: str
    n_samples: int
    bandwidth: float  # r_i, e.g. MB/s
    cpu_speed: float  # v_i, e.g. GHz x cores
    sensitivity: np.ndarray | None = None  # (noised, normalised) sensitivity vector
    costs: RoundCosts | None = None  # measured on the device (calibrated budgets)
    # probe interval [min, max] of measured figures (:data:`BUDGET_FIGURES`); a figure
    # without one is declared, i.e. exact
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    encryption: EncryptionRate | None = None  # measured at join (measured budgets)


BUDGET_FIGURES = ("bandwidth", "cpu_speed", "train_s", "encrypt_per_s", "he_encryptions_per_s")
"""The measured figures budgets are computed from: the first two on the report, ``train_s`` and
``encrypt_per_s`` in its costs (calibrated), ``he_encryptions_per_s`` its join's encryption rate."""


def measured_intervals(profile: dict[str, Any] | None) -> dict[str, tuple[float, float]]:
    """Probe intervals ``[min, max]`` of an agent's measured budget figures, from its hello
    profile: ``measurements`` (``edge-agent join --profile auto``; bounded by the declared
    ``bounds`` like the figures themselves) and ``measured.spread`` (calibrated round costs).
    Malformed entries are left out: the figure then counts as exact."""
    profile = profile or {}
    out: dict[str, tuple[float, float]] = {}
    caps = profile.get("bounds") if isinstance(profile.get("bounds"), dict) else {}
    summaries = profile.get("measurements") if isinstance(profile.get("measurements"), dict) else {}
    spread = (profile.get("measured") or {}).get("spread") if isinstance(profile.get("measured"), dict) else None
    candidates = {name: summaries.get(name) for name in BUDGET_FIGURES}
    for name, pair in (spread if isinstance(spread, dict) else {}).items():
        candidates[name] = {"min": pair[0], "max": pair[1]} if isinstance(pair, (list, tuple)) and len(pair) == 2 else None
    for name, entry in candidates.items():
        if name not in BUDGET_FIGURES or not isinstance(entry, dict):
            continue
        try:
            cap = float(caps.get(name, np.inf))
            lo, hi = min(float(entry["min"]), cap), min(float(entry["max"]), cap)
        except (KeyError, TypeError, ValueError):
            continue
        if np.isfinite(lo) and np.isfinite(hi) and 0 < lo <= hi:
            out[name] = (lo, hi)
    return out


def _figure(report: BootstrapReport, name: str) -> float | None:
    if name == "he_encryptions_per_s":
        return None if report.encryption is None else report.encryption.per_s
    holder = report.costs if name in ("train_s", "encrypt_per_s") else report
    return None if holder is None else float(getattr(holder, name))


def stable_inputs(
    reports: Sequence[BootstrapReport], *, tolerance: float | None
) -> tuple[list[BootstrapReport], dict[str, dict[str, list[float]]]]:
    """The reports with every budget figure (:data:`BUDGET_FIGURES`) pooled over the devices
    the measurements cannot tell apart (:func:`senseshield.engine.measurements.pool_agreeing`):
    a measured figure's interval is its probe ``[min, max]`` widened by ``tolerance``, a
    declared figure is exact. Returns the new reports and, per figure, ``{client: [measured,
    used]}`` for the figures that changed. ``tolerance=None`` returns the reports unchanged."""
    from dataclasses import replace

    if tolerance is None:
        return list(reports), {}
    figures: dict[str, dict[str, float]] = {}
    changed: dict[str, dict[str, list[float]]] = {}
    for name in BUDGET_FIGURES:
        have = [r for r in reports if _figure(r, name) is not None and _figure(r, name) > 0]
        if len(have) < 2:
            continue
        values = np.array([_figure(r, name) for r in have])
        inside = [name in r.intervals and r.intervals[name][0] <= v <= r.intervals[name][1] for r, v in zip(have, values)]
        low = np.array([r.intervals[name][0] if ok else v for r, v, ok in zip(have, values, inside)])
        high = np.array([r.intervals[name][1] if ok else v for r, v, ok in zip(have, values, inside)])
        pooled = pool_agreeing(values, low=low, high=high, tolerance=np.where(inside, tolerance, 0.0))
        figures[name] = {r.client_id: float(p) for r, p in zip(have, pooled)}
        diff = {r.client_id: [float(v), float(p)] for r, v, p in zip(have, values, pooled) if p != v}
        if diff:
            changed[name] = diff
    out = []
    for r in reports:
        top = {n: figures[n][r.client_id] for n in ("bandwidth", "cpu_speed") if r.client_id in figures.get(n, {})}
        cost = {n: figures[n][r.client_id] for n in ("train_s", "encrypt_per_s") if r.client_id in figures.get(n, {})}
        costs = replace(r.costs, **cost) if cost and r.costs is not None else r.costs
        rate = figures.get("he_encryptions_per_s", {}).get(r.client_id)
        encryption = replace(r.encryption, per_s=rate) if rate is not None and r.encryption is not None else r.encryption
        out.append(replace(r, **top, costs=costs, encryption=encryption))
    return out, changed


@dataclass
class FleetContext:
    """What the runtime tells a strategy before :meth:`Strategy.plan_fleet` (optional)."""

    round_deadline: float | None = None  # seconds; the calibrated budgets stay under it


@dataclass
class FleetPlan:
    """Bootstrap outcome: cluster and encryption budget per client, fixed masks per cluster."""

    cluster_of: dict[str, int]
    budget_of: dict[str, float]
    fixed_masks: dict[int, np.ndarray] = field(default_factory=dict)
    budget_notes: dict[str, Any] = field(default_factory=dict)  # how budgets were chosen (reports)
    # per cluster, the agreed sensitivity (one value per position) its nested masks rank
    rankings: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def clusters(self) -> list[int]:
        return sorted(set(self.cluster_of.values()))

    def members(self, cluster: int) -> list[str]:
        return [c for c, k in self.cluster_of.items() if k == cluster]


@dataclass(frozen=True)
class ClientContext:
    """What a client knows when it protects its update in one round."""

    client_id: str
    round: int
    cluster: int
    encryption_budget: float
    shared_mask: np.ndarray | None = None
    block_size: int = 1  # mask granularity of the HE scheme (PublicKey.block_size)
    participants: int = 1  # |K^t|, clients sampled this round in this cluster
    noise_multiplier: float | None = None  # sigma of this run (calibrated if target epsilon)
    # the device's own floor (--min-he-ratio; 0 in the simulator): nested masks keep its most
    # sensitive blocks up to this fraction whatever mask the coordinator sends
    min_encrypted: float = 0.0


@dataclass(frozen=True)
class RoundPlan:
    """How a client trains in one round (Alt-FL's round types)."""

    dpsgd: bool = False  # record-level DP-SGD through Opacus
    synthetic: bool = False  # train on the DP synthetic data instead of the real data


@dataclass
class MaskChoice:
    """A client's mask for one round, with solver diagnostics for reports."""

    mask: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    withheld: np.ndarray | None = None  # positions never sent (personalised zone)


class Strategy(ABC):
    """Base class of every registered strategy (see :data:`STRATEGIES`)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    scheme: ClassVar[str | None] = "paillier"  # HE scheme, None for plaintext
    score: ClassVar[str] = "taylor"  # per-round sensitivity score the clients compute
    clusters_clients: ClassVar[bool] = False  # bootstrap clustering by sensitivity
    needs_bootstrap_sensitivity: ClassVar[bool] = False
    negotiates: ClassVar[bool] = False
    per_client_masks: ClassVar[bool] = False  # clients of a cluster encrypt different positions
    # "user": the client noises the update it sends (privatise); "record": DP-SGD; None: no DP
    dp_level: ClassVar[str | None] = None
    dp_adjacency: ClassVar[str | None] = None  # the accounting.ADJACENCY entry, if not dp_level's
    needs_synthetic: ClassVar[bool] = False  # clients fit the DP synthetic-data provider

    def __init__(self, options: StrategyOptions | None = None) -> None:
        self.options = options or StrategyOptions()
        self.fleet_context = FleetContext()
        if self.options.buffer is not None and (self.negotiates or self.dp_level is not None):
            why = "negotiates one mask per round among its members" if self.negotiates else \
                f"accounts {self.dp_level}-level DP per round"
            raise ConfigError(
                f"buffer={self.options.buffer} is not allowed with strategy {self.name!r}, which {why}; buffered "
                "rounds run with strategies that do neither (e.g. masked, sensecrypt, paillier-full, plaintext)."
            )

    @property
    def score_name(self) -> str:
        """The sensitivity score the clients compute: ``options.score``, else the strategy's."""
        return self.options.score or self.score

    # ---- coordinator side -------------------------------------------------------------
    def plan_fleet(
        self, reports: Sequence[BootstrapReport], *, size: int, block_size: int = 1
    ) -> FleetPlan:
        """Default: one cluster; budgets from the profiles over the whole fleet (sec. 3.2)."""
        cluster_of = {r.client_id: 0 for r in reports}
        budgets, notes = self.budgets_for(reports, cluster_of, size=size, block_size=block_size)
        return FleetPlan(cluster_of, budgets, budget_notes={"mode": self.options.budget_mode, "clusters": notes})

    def budgets_for(
        self, reports: Sequence[BootstrapReport], cluster_of: dict[str, int], *, size: int, block_size: int = 1
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """Budgets of ``reports`` with their clusters fixed (re-planning after a join); the
        strategy's own budget rule (measured rates, else the paper's max-abs scaling) and its notes."""
        notes: dict[str, Any] = {}
        mode = "paper" if self.options.budget_mode == "paper" else "measured"
        budgets = budgets_per_cluster(reports, cluster_of, mode=mode, notes=notes, tolerance=self.options.budget_tolerance)
        return budgets, notes

    def admit(
        self, reports: Sequence[BootstrapReport], plan: FleetPlan, newcomer: BootstrapReport, *, size: int,
        block_size: int = 1,
    ) -> FleetPlan:
        """A device that joins after the bootstrap: its cluster (the nearest by its bootstrap
        vector for clustering strategies, else the first) and every budget recomputed with
        it (budgets are relative to the most capable device of a cluster). Clusters and
        fixed masks of the others do not change."""
        clusters = plan.clusters
        k = clusters[0] if clusters else 0
        if self.clusters_clients and newcomer.sensitivity is not None:
            known = [r for r in reports if r.sensitivity is not None and r.client_id in plan.cluster_of]
            if known:
                k = nearest_cluster(newcomer.sensitivity, np.stack([r.sensitivity for r in known]),
                                    np.array([plan.cluster_of[r.client_id] for r in known]))
        cluster_of = {**plan.cluster_of, newcomer.client_id: k}
        everyone = [r for r in reports if r.client_id in plan.cluster_of] + [newcomer]
        budgets, notes = self.budgets_for(everyone, cluster_of, size=size, block_size=block_size)
        budget_notes = dict(plan.budget_notes)
        if notes:
            budget_notes.setdefault("admissions", {})[newcomer.client_id] = notes
        return FleetPlan(cluster_of, budgets, plan.fixed_masks, budget_notes, plan.rankings)

    def rebudget(
        self,
        reports: Sequence[BootstrapReport],
        cluster_of: dict[str, int],
        *,
        size: int,
        block_size: int = 1,
        observed: dict[str, tuple[float, float]] | None = None,
    ) -> tuple[dict[str, float], dict[str, Any]] | None:
        """Between rounds: new budgets from refined figures (measured mode: the reports'
        ``encryption`` rates as the rounds showed them), or None to keep them (paper mode)."""
        if self.options.budget_mode != "measured":
            return None
        budgets, notes = self.budgets_for(reports, cluster_of, size=size, block_size=block_size)
        return budgets, {"mode": "measured", "clusters": notes}

    def consensus(
        self, proposals: Sequence[np.ndarray], *, size: int, block_size: int = 1
    ) -> np.ndarray:
        raise TypeError(f"Strategy {self.name!r} does not negotiate masks (negotiates = False).")

    def planned_mask(
        self, plan: FleetPlan, client_id: str, members: Sequence[str], *, size: int, block_size: int = 1
    ) -> np.ndarray | None:
        """The mask the coordinator hands ``client_id`` in its round plan (``members``: the
        round's participants of its cluster), or None. Default: the cluster's fixed mask."""
        return plan.fixed_masks.get(plan.cluster_of[client_id])

    def encryption_floor(self, budget: float, *, size: int, block_size: int = 1) -> float:
        """The least fraction of the parameters a genuine update of a device with encryption
        budget ``budget`` encrypts; the coordinator refuses an update below it. Default: a
        positive budget encrypts at least one block (the mask solvers choose how much from
        the device's own sensitivity, which the coordinator does not see); strategies that
        encrypt a known share say so."""
        if budget <= 0 or size <= 0:
            return 0.0
        return min(1.0, block_size / size)

    # ---- client side ------------------------------------------------------------------
    def propose(self, sensitivity: np.ndarray, *, block_size: int = 1) -> np.ndarray:
        raise TypeError(f"Strategy {self.name!r} does not negotiate masks (negotiates = False).")

    def round_plan(self, round: int) -> RoundPlan:
        """How clients train in ``round`` (default: plain SGD on the real data)."""
        return RoundPlan()

    def user_dp_round(self, round: int) -> bool:
        """Whether clients noise their update in ``round`` (counted by the accountant)."""
        return self.dp_level == "user"

    def ring_bits(self, n_samples: Iterable[int]) -> int:
        """The masked scheme's ring for one cluster's round whose members joined with
        ``n_samples`` (:func:`senseshield.he.masked.choose_ring` of the job's ``ring_bits``,
        the members' total :meth:`sample_weight`, and whether the values sent are free of
        added noise, which the 32-bit ring would clip). The simulator and the coordinator
        call it with the same members: the same ring."""
        from senseshield.he.masked import choose_ring

        total = sum(self.sample_weight(int(n)) for n in n_samples)
        return choose_ring(self.options.ring_bits, total, bounded=self.dp_level != "user")

    def sample_weight(self, n_samples: int) -> int:
        """The weight of a client's update in its cluster's mean (default: its sample count
        n_i, FedAvg). The coordinator checks an update's weight against this of the count
        the device joined with."""
        return int(n_samples)

    def release_sigma(self, sigma: float, cohorts: Sequence[tuple[int, int]]) -> float:
        """The noise multiplier the accountant charges for a user-level DP round whose
        aggregates had ``cohorts``: (planned participants, contributors) per cluster
        aggregate (default: ``sigma``, each update carries its own noise)."""
        return sigma

    def privatise(
        self,
        context: ClientContext,
        delta: np.ndarray,
        choice: MaskChoice,
        *,
        sensitivity: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Client side, before encryption: the values it will send (default: unchanged)."""
        return delta, {}

    @abstractmethod
    def select_mask(
        self, context: ClientContext, *, sensitivity: np.ndarray, weights: np.ndarray
    ) -> MaskChoice:
        """The positions of this round's update that the client encrypts."""


STRATEGIES: Registry[type[Strategy]] = Registry("strategy", group="senseshield.strategies")


def _budgets(reports: Sequence[BootstrapReport]) -> dict[str, float]:
    alphas = encryption_budgets(
        bandwidth=np.array([r.bandwidth for r in reports], dtype=np.float64),
        cpu_speed=np.array([r.cpu_speed for r in reports], dtype=np.float64),
    )
    return {r.client_id: float(a) for r, a in zip(reports, alphas)}


def measured_cluster_budgets(
    reports: Sequence[BootstrapReport], *, tolerance: float | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """Budgets of one cluster from what its members measured
    (:func:`senseshield.engine.budgets.measured_budgets`: values encrypted and sent per second,
    relative to the cluster's most capable member) when every member measured its encryption
    rate with the same scheme and key size, snapped to the grid of ``tolerance``
    (:func:`senseshield.engine.budgets.snap_budgets`: within ``1 + tolerance`` of the top
    budget is 1; None or 0: not snapped); else the paper's formula over bandwidth and the spec
    sheet's CPU speed, and the note says why. The note keeps the budgets before snapping
    (``unsnapped``) where snapping changed them."""
    rates = [r.encryption for r in reports]
    if not reports or any(e is None for e in rates):
        missing = [r.client_id for r, e in zip(reports, rates) if e is None]
        note: dict[str, Any] = {"mode": "paper"}
        if len(missing) < len(reports):
            note["fallback"] = f"{', '.join(missing)} did not measure an encryption rate"
        return _budgets(reports), note
    methods = sorted({e.method for e in rates})  # type: ignore[union-attr]
    if len(methods) > 1:
        return _budgets(reports), {"mode": "paper", "fallback": f"encryption rates measured with {', '.join(methods)}"}
    sizes = [e.bytes_per_value for e in rates if e.bytes_per_value > 0]  # type: ignore[union-attr]
    alphas = measured_budgets(
        encrypt_per_s=np.array([e.per_s for e in rates]),  # type: ignore[union-attr]
        bandwidth=np.array([r.bandwidth for r in reports], dtype=np.float64),
        bytes_per_encrypted=float(np.mean(sizes)) if sizes else 0.0,
    )
    snapped = snap_budgets(alphas, tolerance=tolerance) if tolerance else alphas
    note = {"mode": "measured", "method": methods[0],
            "encrypt_per_s": {r.client_id: round(e.per_s, 1) for r, e in zip(reports, rates)}}  # type: ignore[union-attr]
    if tolerance:
        note["step"] = round((1.0 + tolerance) ** 2, 6)
        moved = {r.client_id: round(float(a), 4) for r, a, b in zip(reports, alphas, snapped) if a != b}
        if moved:
            note["unsnapped"] = moved
    return {r.client_id: float(a) for r, a in zip(reports, snapped)}, note


def budgets_per_cluster(
    reports: Sequence[BootstrapReport],
    cluster_of: dict[str, int],
    *,
    mode: str = "measured",
    size: int | None = None,
    block_size: int = 1,
    deadline: float | None = None,
    fractions: dict[str, np.ndarray] | None = None,
    notes: dict[str, Any] | None = None,
    tolerance: float | None = StrategyOptions.model_fields["budget_tolerance"].default,
) -> dict[str, float]:
    """SenseCrypt sec. 3.2: the max-abs scaling runs over the N^c clients of each cluster.

    Every budget in SenseShield is decided here. First the measured figures are made stable
    (:func:`stable_inputs`: devices whose probe intervals, widened by ``tolerance``, overlap
    get one figure, so identical devices get identical budgets). ``mode="calibrated"`` then
    uses :func:`calibrated_cluster_budgets` (it needs ``size`` and the reports' measured
    ``costs``); ``"measured"`` (the default) :func:`measured_cluster_budgets` (the encryption rates
    measured at join, relative to the cluster's best and snapped to the grid of ``tolerance``;
    the paper's formula in a cluster where one device did not measure);
    ``"paper"`` the paper's max-abs formula; ``notes`` (a dict) receives what was decided
    per cluster (with ``pooled``: the figures pooling changed), for the run's report.
    """
    reports, pooled = stable_inputs(reports, tolerance=tolerance)
    out: dict[str, float] = {}
    for cluster in sorted(set(cluster_of.values())):
        members = [r for r in reports if cluster_of[r.client_id] == cluster]
        if mode == "calibrated":
            budgets, note = calibrated_cluster_budgets(
                members, size=size, block_size=block_size, deadline=deadline, fractions=fractions,
                slack=tolerance or 0.0,
            )
        elif mode == "measured":
            budgets, note = measured_cluster_budgets(members, tolerance=tolerance)
        else:
            budgets, note = _budgets(members), {"mode": "paper"}
        out.update(budgets)
        ids = {r.client_id for r in members}
        changed = {f: {c: v for c, v in d.items() if c in ids} for f, d in pooled.items()}
        changed = {f: d for f, d in changed.items() if d}
        if changed:
            note = {**note, "pooled": changed}
        if notes is not None:
            notes[str(cluster)] = note
    return out


def calibrated_cluster_budgets(
    reports: Sequence[BootstrapReport],
    *,
    size: int | None,
    block_size: int = 1,
    deadline: float | None = None,
    fractions: dict[str, np.ndarray] | None = None,
    slack: float = 0.0,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Calibrated budgets (:func:`senseshield.engine.budgets.calibrated_budgets`) of one
    cluster from the members' measured :class:`RoundCosts` and bandwidths; ``slack``: predicted
    times within that fraction of the target count as on target.

    Members that measured nothing get costs scaled from the measured ones by CPU speed
    (train time / v_i, encryption rate x v_i); if nobody measured, the paper's budgets are
    used and the note says so. Every member encrypts at least one block.
    """
    from senseshield.engine.budgets import calibrated_budgets

    measured = [r for r in reports if r.costs is not None]
    if not measured or size is None:
        why = "no device measured its round costs" if not measured else "the model size is unknown"
        return _budgets(reports), {"mode": "paper", "fallback": f"calibrated budgets need measurements; {why}"}
    ref_train = float(np.mean([r.costs.train_s * r.cpu_speed for r in measured]))  # type: ignore[union-attr]
    ref_rate = float(np.mean([r.costs.encrypt_per_s / r.cpu_speed for r in measured]))  # type: ignore[union-attr]
    ref_bytes = float(np.mean([r.costs.bytes_per_encrypted for r in measured]))  # type: ignore[union-attr]
    estimated = []
    costs = []
    for r in reports:
        if r.costs is not None:
            costs.append(r.costs)
        else:
            estimated.append(r.client_id)
            costs.append(RoundCosts(ref_train / r.cpu_speed, ref_rate * r.cpu_speed, ref_bytes))
    fraction = None
    if fractions and all(r.client_id in fractions for r in reports):
        fraction = np.stack([fractions[r.client_id] for r in reports])
    result = calibrated_budgets(
        fixed_s=np.array([c.train_s + c.latency_s for c in costs]),
        encrypt_per_s=np.array([c.encrypt_per_s for c in costs]),
        bandwidth=np.array([r.bandwidth for r in reports], dtype=np.float64),
        size=int(size),
        bytes_per_encrypted=float(np.mean([c.bytes_per_encrypted for c in costs])),
        fraction=fraction,
        deadline_s=deadline,
        floor=min(1.0, block_size / size),
        slack=slack,
    )
    note: dict[str, Any] = {
        "mode": "calibrated",
        "target_s": round(result.target_s, 4),
        "deadline_capped": result.deadline_capped,
        "predicted_s": {r.client_id: round(float(t), 4) for r, t in zip(reports, result.predicted_s)},
        "full_budget_s": {r.client_id: round(float(t), 4) for r, t in zip(reports, result.full_s)},
        "solver_fractions": fraction is not None,
    }
    if estimated:
        note["estimated_costs"] = estimated
    return {r.client_id: float(a) for r, a in zip(reports, result.alphas)}, note
