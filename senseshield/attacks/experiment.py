"""Attack experiments: ``senseshield attack`` and ``senseshield attack sweep``.

* :func:`run_attack_experiment` trains a fleet with a strategy to the captured round
  (:mod:`senseshield.attacks.capture`), captures the server's view of the victims' updates
  for ``trials`` batches, attacks each view and scores it against the truth.
* :func:`run_sweep` is SenseCrypt's App. H experiment: one client's update, a growing
  encrypted fraction chosen high-sensitivity-first, at random or low-sensitivity-first;
  iLRG's LeAcc/LnAcc, the leakage MI and an image attack's PSNR against the ratio. With
  ``heterogeneity`` it also runs the extreme-heterogeneity check of SenseCrypt sec. 4.3:
  SenseCrypt clients with 32..1 CPUs (budgets down to 1/32) attacked one by one, next to a
  client that sends its update unprotected.

All randomness is seeded: the same configuration gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from senseshield.attacks.base import ATTACKS, Attack, AttackSettings, Reconstruction, torch_threads
from senseshield.attacks.capture import ORDERS, Capture, FleetSpec, capture, order_mask, prepare_fleet
from senseshield.attacks.metrics import (
    identifiability_precision,
    label_counts,
    label_metrics,
    leakage_mi,
    match_reconstructions,
    psnr,
    ssim,
)
from senseshield.attacks.view import hide
from senseshield.engine.dp import relative_noise
from senseshield.errors import ConfigError
from senseshield.strategies import STRATEGIES, StrategyOptions

__all__ = [
    "AttackConfig",
    "SweepConfig",
    "run_attack_experiment",
    "run_sweep",
    "score_reconstruction",
]

Progress = Callable[[str, int, int], None]
METRICS = ("he_ratio", "unknown_ratio", "last_layer_hidden", "mi", "leacc", "lnacc", "irec", "psnr", "ssim", "iip")


def _finite(x: float | None) -> float | None:
    """JSON-safe float: None for NaN/inf (e.g. the PSNR of an exact copy is +inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def _machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
    }


def score_reconstruction(
    cap: Capture, rec: Reconstruction, *, pool: np.ndarray, num_classes: int
) -> tuple[dict[str, Any], np.ndarray | None]:
    """Metrics of one attack on one capture, and the reconstructions in the truth's order.

    PSNR/SSIM are per-image means after pairing reconstructions with true inputs
    (minimum total MSE); IIP uses the client's training data as the search pool.
    """
    record: dict[str, Any] = {
        "he_ratio": cap.he_ratio,
        "unknown_ratio": cap.view.unknown_ratio,
        "last_layer_hidden": _last_layer_hidden(cap),
        "mi": leakage_mi(cap.weights, cap.view.unknown),
        **label_metrics(cap.y, rec.counts, num_classes),
        "true_counts": label_counts(cap.y, num_classes).tolist(),
        "restored_counts": [int(c) for c in rec.counts],
        "psnr": None,
        "ssim": None,
        "iip": None,
    }
    ordered = None
    if rec.images is not None:
        order = match_reconstructions(rec.images, cap.x)
        record["psnr"] = _finite(float(np.mean(psnr(rec.images, cap.x[order]))))
        record["ssim"] = float(np.mean(ssim(rec.images, cap.x[order])))
        record["iip"] = identifiability_precision(rec.images, cap.indices[order], pool)
        ordered = np.empty_like(rec.images)
        ordered[order] = rec.images  # ordered[j] is the reconstruction of true input j
    return record, ordered


def _last_layer_hidden(cap: Capture) -> float:
    """Share of the classification layer (weights and bias) the server cannot read."""
    from senseshield.attacks.ilrg import last_layer_gradients

    grad_w, grad_b, _ = last_layer_gradients(cap.view)
    hidden = int(np.isnan(grad_w).sum() + np.isnan(grad_b).sum())
    return hidden / (grad_w.size + grad_b.size)


# --------------------------------------------------------------------------- one attack


class _FleetFields(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: str = "digits"
    model: str = "lenet5"
    activation: str | None = None
    clients: int = Field(10, ge=1)
    partition: str = "iid"
    round: int = Field(2, ge=1, description="captured round; rounds before it are trained")
    local_epochs: int = Field(1, ge=1)
    train_batch_size: int = Field(16, ge=1)
    lr: float = Field(0.1, gt=0.0)
    trials: int = Field(3, ge=1)
    iterations: int = Field(600, ge=1)
    restarts: int = Field(1, ge=1)
    attack_lr: float = Field(0.3, gt=0.0)
    tv: float = Field(0.0, ge=0.0)
    optimizer: str = "adam"
    seed: int = 0

    def settings(self) -> AttackSettings:
        return AttackSettings(self.iterations, self.restarts, self.attack_lr, self.tv, self.optimizer)


class AttackConfig(_FleetFields):
    """Everything that defines ``senseshield attack``; same config, same result."""

    attack: str = "ilrg"
    strategy: str = "sensecrypt"
    batch_size: int = Field(8, ge=1, description="samples behind each attacked update")
    victims: list[int] = [0]
    order: str | None = None
    bandwidth: list[float] | None = None
    cpu: list[float] | None = None
    options: StrategyOptions = StrategyOptions()

    @field_validator("attack")
    @classmethod
    def _known_attack(cls, value: str) -> str:
        ATTACKS.get(value)
        return value

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        STRATEGIES.get(value)
        return value

    @field_validator("order")
    @classmethod
    def _known_order(cls, value: str | None) -> str | None:
        if value is not None and value not in ORDERS:
            raise ConfigError(f"--order={value!r} is not allowed; choose one of: {', '.join(ORDERS)}.")
        return value

    @field_validator("victims")
    @classmethod
    def _some_victims(cls, value: list[int]) -> list[int]:
        if not value:
            raise ConfigError("--victims is empty; give at least one client index, e.g. 0.")
        return value

    def fleet_spec(self) -> FleetSpec:
        return FleetSpec(
            strategy=self.strategy,
            dataset=self.dataset,
            model=self.model,
            activation=self.activation,
            clients=self.clients,
            partition=self.partition,
            round=self.round,
            local_epochs=self.local_epochs,
            train_batch_size=self.train_batch_size,
            lr=self.lr,
            bandwidth=tuple(self.bandwidth) if self.bandwidth else None,
            cpu=tuple(self.cpu) if self.cpu else None,
            options=self.options,
            seed=self.seed,
        )


def run_attack_experiment(
    config: AttackConfig, *, figure: Path | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Train, capture, attack, score; returns the result dict (``--out`` JSON)."""
    started = time.perf_counter()
    attack: Attack = ATTACKS.get(config.attack)
    settings = config.settings()
    with torch_threads(1):
        fleet = prepare_fleet(config.fleet_spec(), progress=progress)
        trials: list[dict[str, Any]] = []
        panels: list[dict[str, Any]] = []
        for t in range(config.trials):
            caps = capture(
                fleet,
                config.victims,
                batch_size=config.batch_size,
                trial=t,
                order=config.order,
                ratio=config.options.he_ratio if config.order else None,
            )
            for cap in caps:
                t0 = time.perf_counter()
                rec = attack.run(cap.view, settings=settings, seed=_seed(config.seed, t, cap.client))
                seconds = time.perf_counter() - t0
                record, ordered = score_reconstruction(
                    cap, rec, pool=fleet.clients[cap.client].x_train, num_classes=fleet.num_classes
                )
                record.update(
                    client=fleet.clients[cap.client].id,
                    trial=t,
                    encryption_budget=cap.budget,
                    attack_seconds=seconds,
                    attack_info={k: v for k, v in rec.info.items() if k != "counts_float"},
                    mask_info={k: v for k, v in cap.mask_info.items() if _jsonable(v)},
                )
                trials.append(record)
                if len(panels) < 16:
                    panels.append(
                        {
                            "truth": cap.x,
                            "reconstruction": ordered,
                            "caption": f"{record['client']} t{t} HE {cap.he_ratio:.3f}",
                            "label": (
                                f"{record['client']} trial {t}: HE ratio {cap.he_ratio:.3f}, "
                                f"LeAcc {record['leacc']:.2f}, LnAcc {record['lnacc']:.2f}"
                            ),
                            "true_counts": record["true_counts"],
                            "restored_counts": record["restored_counts"],
                        }
                    )
            if progress:
                progress("attack", t + 1, config.trials)
    clients = []
    for v in config.victims:
        cid = fleet.clients[v].id
        rows = [r for r in trials if r["client"] == cid]
        clients.append(
            {
                "id": cid,
                "index": v,
                "cluster": fleet.cluster_of(v),
                "encryption_budget": fleet.budget_of(v),
                **{m: _mean([r[m] for r in rows]) for m in METRICS},
            }
        )
    result: dict[str, Any] = {
        "attack": config.attack,
        "strategy": config.strategy,
        "order": config.order,
        "dataset": config.dataset,
        "model": config.model,
        "model_options": config.fleet_spec().model_options(),
        "num_params": fleet.num_params,
        "captured_round": config.round,
        "global_accuracy": fleet.accuracy[-1] if fleet.accuracy else None,
        "batch_size": config.batch_size,
        "summary": {m: _mean([r[m] for r in trials]) for m in METRICS},
        "clients": clients,
        "trials": trials,
        "config": config.model_dump(mode="json"),
        "machine": _machine(),
        "seconds": time.perf_counter() - started,
        "figure": None,
    }
    if figure is not None:
        from senseshield.attacks.plots import image_grid, label_bars

        title = (
            f"{config.attack} vs {config.strategy}"
            + (f" ({config.order} order, ratio {config.options.he_ratio:g})" if config.order else "")
            + f" on {config.dataset}/{config.model}, batch {config.batch_size}, round {config.round}"
        )
        figure.parent.mkdir(parents=True, exist_ok=True)
        if attack.reconstructs_images:
            image_grid(panels, figure, title=title)
        else:
            label_bars(panels[:4], figure, title=title)
        result["figure"] = str(figure)
    return result


def _jsonable(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str, type(None))) or (
        isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value)
    )


# --------------------------------------------------------------------------- App. H sweep


DEFAULT_RATIOS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8)
DEFAULT_CPUS = (32.0, 24.0, 16.0, 12.0, 10.0, 8.0, 2.0, 1.0)


class SweepConfig(_FleetFields):
    """``senseshield attack sweep``: SenseCrypt App. H and the heterogeneity check."""

    label_batch: int = Field(30, ge=1, description="batch behind the update iLRG attacks")
    image_batch: int = Field(1, ge=1, description="batch behind the update the image attack gets")
    image_attack: str | None = "inverting"
    ratios: list[float] = list(DEFAULT_RATIOS)
    orders: list[str] = list(ORDERS)
    victim: int = Field(0, ge=0)
    heterogeneity: bool = True
    cpus: list[float] = list(DEFAULT_CPUS)
    bandwidth: float = Field(50.0, gt=0.0)
    options: StrategyOptions = StrategyOptions()

    @field_validator("image_attack")
    @classmethod
    def _image_attack(cls, value: str | None) -> str | None:
        if value is not None and not ATTACKS.get(value).reconstructs_images:
            images = [n for n, a in ATTACKS.items() if a.reconstructs_images]
            raise ConfigError(
                f"--image-attack={value!r} does not reconstruct images; choose one of: "
                f"{', '.join(images)}, or none."
            )
        return value

    @field_validator("ratios")
    @classmethod
    def _ratios(cls, value: list[float]) -> list[float]:
        if not value:
            raise ConfigError("--ratios is empty; give at least one ratio in [0, 1].")
        for r in value:
            if not (math.isfinite(r) and 0.0 <= r <= 1.0):
                raise ConfigError(f"--ratios value {r!r} is not allowed; ratios must lie in [0, 1].")
        return sorted(value)

    @field_validator("orders")
    @classmethod
    def _orders(cls, value: list[str]) -> list[str]:
        if not value:
            raise ConfigError(f"--orders is empty; choose from: {', '.join(ORDERS)}.")
        for o in value:
            if o not in ORDERS:
                raise ConfigError(f"--orders value {o!r} is not allowed; choose from: {', '.join(ORDERS)}.")
        return value

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: list[float]) -> list[float]:
        if not value:
            raise ConfigError("--cpus is empty; give the CPU count of each protected client.")
        for v in value:
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"--cpus value {v!r} is not allowed; every value must be > 0.")
        return value


def _sweep_spec(config: SweepConfig, strategy: str, **over: Any) -> FleetSpec:
    fields = dict(
        strategy=strategy,
        dataset=config.dataset,
        model=config.model,
        activation=config.activation,
        clients=config.clients,
        partition=config.partition,
        round=config.round,
        local_epochs=config.local_epochs,
        train_batch_size=config.train_batch_size,
        lr=config.lr,
        options=config.options,
        seed=config.seed,
    )
    fields.update(over)
    return FleetSpec(**fields)


def run_sweep(
    config: SweepConfig, *, figure_prefix: Path | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """SenseCrypt App. H (and the heterogeneity check); returns the result dict.

    With ``figure_prefix`` the plots go to ``<prefix>-sweep.png`` and
    ``<prefix>-heterogeneity.png``.
    """
    started = time.perf_counter()
    settings = config.settings()
    label_attack = ATTACKS.get("ilrg")
    image_attack = ATTACKS.get(config.image_attack) if config.image_attack else None
    with torch_threads(1):
        fleet = prepare_fleet(_sweep_spec(config, "plaintext"))
        if config.victim >= len(fleet.clients):
            raise ConfigError(
                f"--victim={config.victim} is not allowed; clients are 0..{len(fleet.clients) - 1}."
            )
        pool = fleet.clients[config.victim].x_train
        records: dict[tuple[str, float], list[dict[str, Any]]] = {
            (o, r): [] for o in config.orders for r in config.ratios
        }
        blind: list[dict[str, Any]] = []
        steps = config.trials * len(config.orders) * len(config.ratios)
        done = 0
        for t in range(config.trials):
            label_cap = capture(fleet, [config.victim], batch_size=config.label_batch, trial=t)[0]
            image_cap = (
                capture(fleet, [config.victim], batch_size=config.image_batch, trial=t)[0]
                if image_attack
                else None
            )
            seed = _seed(config.seed, t)
            blind.append(
                _attack_pair(label_cap, image_cap, np.ones(label_cap.view.size, bool),
                             np.ones(label_cap.view.size, bool), label_attack, image_attack,
                             settings, seed, pool, fleet.num_classes)
            )
            for order in config.orders:
                for ri, ratio in enumerate(config.ratios):
                    rng = np.random.default_rng([config.seed, t, ri, 23])
                    label_mask = order_mask(label_cap.sensitivity, ratio=ratio, order=order, rng=rng)
                    image_mask = (
                        order_mask(image_cap.sensitivity, ratio=ratio, order=order, rng=rng)
                        if image_cap is not None
                        else None
                    )
                    noise = config.options.plain_noise
                    records[(order, ratio)].append(
                        _attack_pair(_plain_noised(label_cap, label_mask, noise, [config.seed, t, ri, 29]),
                                     _plain_noised(image_cap, image_mask, noise, [config.seed, t, ri, 31]),
                                     label_mask, image_mask, label_attack,
                                     image_attack, settings, seed, pool, fleet.num_classes)
                    )
                    done += 1
                    if progress:
                        progress("sweep", done, steps)
        points = []
        for (order, ratio), rows in records.items():
            points.append(
                {
                    "order": order,
                    "ratio": ratio,
                    **{m: _mean([r[m] for r in rows]) for m in METRICS},
                    "trials": rows,
                }
            )
        result: dict[str, Any] = {
            "title": (
                f"SenseCrypt App. H on {config.dataset}/{config.model} (round {config.round}): "
                f"iLRG on batch {config.label_batch}"
                + (f", {config.image_attack} on batch {config.image_batch}" if image_attack else "")
                + f", {config.trials} trial(s)"
            ),
            "orders": config.orders,
            "ratios": config.ratios,
            "points": points,
            "blind": {m: _mean([r[m] for r in blind]) for m in METRICS if m != "he_ratio"},
            "global_accuracy": fleet.accuracy[-1] if fleet.accuracy else None,
            "num_params": fleet.num_params,
        }
        if config.heterogeneity:
            result["heterogeneity"] = _heterogeneity(config, settings, label_attack, image_attack, progress)
    result.update(config=config.model_dump(mode="json"), machine=_machine(),
                  seconds=time.perf_counter() - started, figures=[])
    if figure_prefix is not None:
        from senseshield.attacks.plots import heterogeneity_figure, sweep_figure

        prefix = Path(figure_prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        result["figures"].append(
            str(sweep_figure(result, prefix.with_name(prefix.name + "-sweep.png")))
        )
        if "heterogeneity" in result:
            path = prefix.with_name(prefix.name + "-heterogeneity.png")
            result["figures"].append(str(heterogeneity_figure(result["heterogeneity"], path)))
    return result


def _attack_pair(
    label_cap: Capture,
    image_cap: Capture | None,
    label_mask: np.ndarray,
    image_mask: np.ndarray | None,
    label_attack: Attack,
    image_attack: Attack | None,
    settings: AttackSettings,
    seed: int,
    pool: np.ndarray,
    num_classes: int,
) -> dict[str, Any]:
    """iLRG on the label capture and the image attack on the image capture, both masked."""
    lc = _masked(label_cap, label_mask)
    rec = label_attack.run(lc.view, settings=settings, seed=seed)
    row, _ = score_reconstruction(lc, rec, pool=pool, num_classes=num_classes)
    if image_cap is not None and image_attack is not None and image_mask is not None:
        ic = _masked(image_cap, image_mask)
        irec = image_attack.run(ic.view, settings=settings, seed=seed)
        irow, _ = score_reconstruction(ic, irec, pool=pool, num_classes=num_classes)
        row.update(psnr=irow["psnr"], ssim=irow["ssim"], iip=irow["iip"], image_he_ratio=irow["he_ratio"])
    return row


def _plain_noised(cap: Capture | None, mask: np.ndarray | None, ratio: float, seed: list[int]) -> Capture | None:
    """``cap`` with SenseCrypt's hybrid noise (``plain_noise``, :func:`relative_noise`) on
    what ``mask`` leaves visible, as the client would send it; unchanged at ratio 0."""
    if cap is None or mask is None or ratio == 0:
        return cap
    visible = np.flatnonzero(~np.asarray(mask, dtype=bool) & ~cap.view.unknown)
    known, _ = relative_noise(cap.view.known, visible, ratio=ratio, rng=np.random.default_rng(seed))
    return dataclasses.replace(cap, view=dataclasses.replace(cap.view, known=known))


def _masked(cap: Capture, mask: np.ndarray) -> Capture:
    """``cap`` with ``mask`` encrypted as well."""
    encrypted = mask if cap.encrypted is None else cap.encrypted | mask
    return Capture(cap.client, hide(cap.view, mask), cap.indices, cap.x, cap.y, cap.weights,
                   cap.sensitivity, cap.budget, cap.mask_info, encrypted)


def _heterogeneity(
    config: SweepConfig,
    settings: AttackSettings,
    label_attack: Attack,
    image_attack: Attack | None,
    progress: Progress | None,
) -> dict[str, Any]:
    """SenseCrypt sec. 4.3: per-CPU budgets, each client attacked, plus one unprotected client."""
    cpus = [*config.cpus, max(config.cpus)]
    n = len(cpus)
    ref = n - 1
    spec = _sweep_spec(config, "sensecrypt", clients=n, cpu=tuple(cpus), bandwidth=(config.bandwidth,))
    fleet = prepare_fleet(spec)
    rows: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    for t in range(config.trials):
        label_caps = capture(fleet, list(range(n)), batch_size=config.label_batch, trial=t, unprotected=[ref])
        image_caps = (
            capture(fleet, list(range(n)), batch_size=config.image_batch, trial=t, unprotected=[ref])
            if image_attack
            else [None] * n
        )
        seed = _seed(config.seed, t, 99)
        for lc, ic in zip(label_caps, image_caps):
            pool = fleet.clients[lc.client].x_train
            row = _attack_pair(lc, ic, np.zeros(lc.view.size, bool),
                               None if ic is None else np.zeros(ic.view.size, bool),
                               label_attack, image_attack, settings, seed, pool, fleet.num_classes)
            row["infeasible"] = lc.mask_info.get("feasible") is False
            rows[lc.client].append(row)
        if progress:
            progress("heterogeneity", t + 1, config.trials)
    clients = []
    for i in range(n):
        clients.append(
            {
                "id": fleet.clients[i].id,
                "cpu": cpus[i],
                "cluster": fleet.cluster_of(i),
                "encryption_budget": fleet.budget_of(i),
                "unprotected": i == ref,
                **{m: _mean([r[m] for r in rows[i]]) for m in METRICS},
                "infeasible_masks": sum(bool(r.get("infeasible")) for r in rows[i]),
                "trials": rows[i],
            }
        )
    return {
        "title": (
            f"SenseCrypt under extreme system heterogeneity ({config.dataset}/{config.model}, "
            f"round {config.round}): iLRG batch {config.label_batch}"
            + (f", {config.image_attack} batch {config.image_batch}" if image_attack else "")
        ),
        "num_clusters": len(fleet.plan.clusters),
        "clients": clients,
    }
