"""Privacy measured by attack: what the server can recover, per strategy and batch size.

    .venv/bin/python benchmarks/bench_attacks.py [--sections table,sweep] [--trials 3]
                                                 [--iterations 600] [--figures DIR]
                                                 [--out benchmarks/results/attacks.json]

Setting (both sections): LeNet-5 with sigmoid activations on mnist5k (5,000 MNIST digits,
28x28, 61,706 parameters), 10 IID clients, the first round captured (the model at its
initialisation, the setting of DLG/iDLG and iLRG, and the one SenseCrypt App. H chose as
"vulnerable to iLRG on plaintext"): each attacked client takes one SGD step (lr 0.1) on a
batch of B of its own samples and protects it with its strategy (per-value masks). One
extra row shows the unprotected update of a trained model (tanh LeNet-5, 4 rounds trained,
~74 % accuracy; the sigmoid one does not learn in a few rounds). iLRG attacks every batch
size, Inverting Gradients (600 signed-Adam steps, one start) B = 1 and 4; ``--trials``
batches per cell. The "blind" row hides everything: what the attacks output with no
information (iLRG then guesses K/C instances per class), the floor of every metric.

* ``table``: unprotected (plaintext FedAvg) vs SenseCrypt's mask for the budgets slow
  devices get (2 and 1 CPUs in a fleet of 32..1 CPUs: alpha = 1/16 and 1/32) vs MaskCrypt
  at the 1/32 ratio vs the 1/32 ratio chosen high-sensitivity-first / at random vs
  SelectiveShield and DP-FedAvg (every registered strategy of that list; missing ones are
  reported as such).
* ``leakage`` (issue 16): the leakage-aware selection (``score=leakage``: input and output
  layers first, then Taylor sensitivity) against Taylor-high-first and random selection at
  budgets 1/128 .. 1/8, and SenseCrypt's own mask with that score for its 2- and 1-CPU
  clients: Inverting Gradients at B = 1, 4 and 8 (PSNR, SSIM, identified), iLRG LnAcc at
  B = 8 and 30, ``--trials`` batches of each of ``--victims`` clients per cell.
  ``--leak-noise 0.1,...`` adds the hybrid (``plain_noise``: noise on the plaintext part,
  ``senseshield.engine.dp.relative_noise``) at every budget and for those two clients.
* ``sweep``: SenseCrypt App. H (ratio 0..0.8, high / random / low sensitivity first; iLRG
  LeAcc/LnAcc on B = 30, Inverting Gradients PSNR on B = 1, MI) and the
  extreme-heterogeneity check (SenseCrypt clients with 32..1 CPUs attacked one by one, next
  to an unprotected client).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arglists import numbers  # noqa: E402
from senseshield.bench.machine import cpu_model  # noqa: E402
from senseshield.attacks import ATTACKS, AttackSettings  # noqa: E402
from senseshield.attacks.base import torch_threads  # noqa: E402
from senseshield.attacks.capture import FleetSpec, capture, prepare_fleet  # noqa: E402
from senseshield.attacks.experiment import SweepConfig, run_sweep, score_reconstruction  # noqa: E402
from senseshield.strategies import STRATEGIES, StrategyOptions  # noqa: E402

DATASET, MODEL, ACTIVATION, ROUND = "mnist5k", "lenet5", "sigmoid", 1
CPUS = (32.0, 24.0, 16.0, 12.0, 10.0, 8.0, 4.0, 2.0, 1.0, 1.0)  # client 7: 2 CPUs, client 8: 1 CPU
LABEL_BATCHES = (1, 2, 4, 8, 16, 30)
IMAGE_BATCHES = (1, 4)
SLOW_RATIO = 1 / 32
METRICS = ("he_ratio", "unknown_ratio", "last_layer_hidden", "mi", "leacc", "lnacc", "irec",
           "psnr", "ssim", "iip")


def machine() -> dict[str, Any]:
    model = cpu_model("unknown")
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch_threads": 1}


def spec(strategy: str, **over: Any) -> FleetSpec:
    fields: dict[str, Any] = dict(strategy=strategy, dataset=DATASET, model=MODEL,
                                  activation=ACTIVATION, clients=10, round=ROUND, seed=0)
    fields.update(over)
    if fields["model"] != "lenet5" and "activation" not in over:
        fields["activation"] = None  # only lenet5 has an activation option (--models simplecnn)
    return FleetSpec(**fields)


def rows_to_run() -> tuple[list[dict[str, Any]], list[str]]:
    """The settings of the table: (name, fleet spec, victim, order, ratio)."""
    rows = [
        dict(name="unprotected (plaintext)", spec=spec("plaintext"), victim=0),
        dict(name="blind: everything hidden", spec=spec("plaintext"), victim=0, order="high", ratio=1.0),
        dict(name="unprotected, trained model (tanh, round 5)",
             spec=spec("plaintext", activation="tanh", round=5), victim=0),
        dict(name="sensecrypt, 2-CPU client (alpha 1/16)", spec=spec("sensecrypt", cpu=CPUS), victim=7),
        dict(name="sensecrypt, 1-CPU client (alpha 1/32)", spec=spec("sensecrypt", cpu=CPUS), victim=8),
        dict(name="maskcrypt, ratio 1/32",
             spec=spec("maskcrypt", options=StrategyOptions(he_ratio=SLOW_RATIO)), victim=0),
        dict(name="high-sensitivity-first, ratio 1/32", spec=spec("plaintext"), victim=0,
             order="high", ratio=SLOW_RATIO),
        dict(name="random, ratio 1/32", spec=spec("plaintext"), victim=0, order="random",
             ratio=SLOW_RATIO),
        dict(name="selectiveshield (tau 0.1, rho 0.5, sigma 1, C 1)", spec=spec("selectiveshield"), victim=0),
        dict(name="dp-fedavg (sigma 1, C 1)", spec=spec("dp-fedavg"), victim=0),
        dict(name="dp-fedavg (sigma 0.01, C 1)",
             spec=spec("dp-fedavg", options=StrategyOptions(sigma=0.01)), victim=0),
    ]
    missing = sorted({r["spec"].strategy for r in rows} - set(STRATEGIES.names()))
    return [r for r in rows if r["spec"].strategy in STRATEGIES], missing


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def bench_table(trials: int, settings: AttackSettings, log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    rows, missing = rows_to_run()
    fleets: dict[tuple, Any] = {}
    out = []
    for row in rows:
        key = (row["spec"].strategy, row["spec"].cpu, row["spec"].options.model_dump_json(),
               row["spec"].activation, row["spec"].round)
        if key not in fleets:
            t = time.perf_counter()
            fleets[key] = prepare_fleet(row["spec"])
            acc = fleets[key].accuracy[-1] if fleets[key].accuracy else None
            log(f"  {row['spec'].strategy} fleet ready for round {row['spec'].round} in "
                f"{time.perf_counter() - t:.1f}s (accuracy {_fmt(acc, 3)})")
        fleet = fleets[key]
        pool = fleet.clients[row["victim"]].x_train
        cells = []
        for batch in sorted(set(LABEL_BATCHES) | set(IMAGE_BATCHES)):
            records = []
            t = time.perf_counter()
            for trial in range(trials):
                cap = capture(fleet, [row["victim"]], batch_size=batch, trial=trial,
                              order=row.get("order"), ratio=row.get("ratio"))[0]
                seed = 1000 * trial + batch
                rec: dict[str, Any] = {}
                if batch in LABEL_BATCHES:
                    r = ATTACKS.get("ilrg").run(cap.view, settings=settings, seed=seed)
                    rec, _ = score_reconstruction(cap, r, pool=pool, num_classes=fleet.num_classes)
                if batch in IMAGE_BATCHES:
                    r = ATTACKS.get("inverting").run(cap.view, settings=settings, seed=seed)
                    img, _ = score_reconstruction(cap, r, pool=pool, num_classes=fleet.num_classes)
                    if not rec:
                        rec = {k: img[k] for k in ("he_ratio", "unknown_ratio", "last_layer_hidden", "mi")}
                    rec.update(psnr=img["psnr"], ssim=img["ssim"], iip=img["iip"])
                records.append(rec)
            cell = {"batch": batch, **{m: _mean([r.get(m) for r in records]) for m in METRICS},
                    "seconds": time.perf_counter() - t, "trials": records}
            cells.append(cell)
            log(f"  {row['name']:<48} B={batch:<3} HE {cell['he_ratio']:.3f} LnAcc "
                f"{_fmt(cell['lnacc'])} LeAcc {_fmt(cell['leacc'])} PSNR {_fmt(cell['psnr'], 1)} "
                f"({cell['seconds']:.1f}s)")
        out.append({"name": row["name"], "strategy": row["spec"].strategy, "order": row.get("order"),
                    "victim": row["victim"], "encryption_budget": fleet.budget_of(row["victim"]),
                    "captured_round": row["spec"].round, "activation": row["spec"].activation,
                    "global_accuracy": fleet.accuracy[-1] if fleet.accuracy else None,
                    "cells": cells})
    return {"rows": out, "missing_strategies": missing, "label_batches": list(LABEL_BATCHES),
            "image_batches": list(IMAGE_BATCHES)}


LEAK_BUDGETS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8)
LEAK_IMAGE_BATCHES = (1, 4, 8)
LEAK_LABEL_BATCHES = (8, 30)


def bench_leakage(trials: int, victims: int, settings: AttackSettings, log, model: str = MODEL,  # type: ignore[no-untyped-def]
                  image_attack: str = "inverting", image_batches: tuple[int, ...] = LEAK_IMAGE_BATCHES,
                  budgets: tuple[float, ...] = LEAK_BUDGETS, solver_rows: bool = True,
                  noises: tuple[float, ...] = ()) -> dict[str, Any]:
    """The leakage-aware selection against the App. H orders (see the module docstring)."""
    leak, taylor = StrategyOptions(score="leakage"), StrategyOptions()
    plain_leak, plain = spec("plaintext", model=model, options=leak), spec("plaintext", model=model, options=taylor)
    rows = [dict(name="unprotected", spec=plain, order=None, ratio=None, victims=range(victims)),
            dict(name="blind", spec=plain, order="high", ratio=1.0, victims=range(victims))]
    for ratio in budgets:
        label = f"1/{round(1 / ratio)}"
        rows += [dict(name=f"leakage-first {label}", spec=plain_leak, order="high", ratio=ratio, victims=range(victims)),
                 dict(name=f"taylor-high-first {label}", spec=plain, order="high", ratio=ratio, victims=range(victims)),
                 dict(name=f"random {label}", spec=plain, order="random", ratio=ratio, victims=range(victims))]
        for noise in noises:  # the hybrid at this budget: sensecrypt's noise on the plaintext part
            hybrid = spec("sensecrypt", model=model, options=StrategyOptions(score="leakage", plain_noise=noise))
            rows.append(dict(name=f"leakage-first {label}, plain_noise={noise:g}", spec=hybrid, order="high",
                             ratio=ratio, victims=range(victims)))
    for cpus, victim in (("2-CPU (1/16)", 7), ("1-CPU (1/32)", 8)) if solver_rows else ():
        rows += [dict(name=f"sensecrypt {cpus}, score=leakage", spec=spec("sensecrypt", model=model, cpu=CPUS, options=leak),
                      order=None, ratio=None, victims=[victim]),
                 dict(name=f"sensecrypt {cpus}, score=taylor", spec=spec("sensecrypt", model=model, cpu=CPUS, options=taylor),
                      order=None, ratio=None, victims=[victim])]
    for cpus, victim in (("2-CPU (1/16)", 7), ("1-CPU (1/32)", 8)):
        for noise in noises:  # the hybrid: leakage-first encryption + noise on the plaintext part
            options = StrategyOptions(score="leakage", plain_noise=noise)
            rows.append(dict(name=f"sensecrypt {cpus}, score=leakage, plain_noise={noise:g}",
                             spec=spec("sensecrypt", model=model, cpu=CPUS, options=options),
                             order=None, ratio=None, victims=[victim]))
    fleets: dict[str, Any] = {}
    out = []
    for row in rows:
        key = row["spec"].model_dump_json() if hasattr(row["spec"], "model_dump_json") else repr(row["spec"])
        if key not in fleets:
            fleets[key] = prepare_fleet(row["spec"])
        fleet = fleets[key]
        cells = []
        for batch in sorted(set(image_batches) | set(LEAK_LABEL_BATCHES)):
            records = []
            t = time.perf_counter()
            for victim in row["victims"]:
                pool = fleet.clients[victim].x_train
                for trial in range(trials):
                    cap = capture(fleet, [victim], batch_size=batch, trial=trial, order=row["order"], ratio=row["ratio"])[0]
                    seed = 1000 * trial + batch
                    rec: dict[str, Any] = {"he_ratio": cap.he_ratio}
                    if batch in LEAK_LABEL_BATCHES:
                        r = ATTACKS.get("ilrg").run(cap.view, settings=settings, seed=seed)
                        got, _ = score_reconstruction(cap, r, pool=pool, num_classes=fleet.num_classes)
                        rec.update(lnacc=got["lnacc"], leacc=got["leacc"])
                    if batch in image_batches:
                        r = ATTACKS.get(image_attack).run(cap.view, settings=settings, seed=seed)
                        img, _ = score_reconstruction(cap, r, pool=pool, num_classes=fleet.num_classes)
                        rec.update(psnr=img["psnr"], ssim=img["ssim"], iip=img["iip"])
                    records.append(rec)
            cell = {"batch": batch, **{m: _mean([r.get(m) for r in records]) for m in
                                       ("he_ratio", "psnr", "ssim", "iip", "lnacc", "leacc")},
                    "psnr_max": max((r["psnr"] for r in records if r.get("psnr") is not None), default=None),
                    "seconds": time.perf_counter() - t, "n": len(records)}
            cells.append(cell)
            log(f"  {row['name']:<40} B={batch:<3} HE {cell['he_ratio']:.4f} PSNR {_fmt(cell['psnr'], 1)} "
                f"(max {_fmt(cell['psnr_max'], 1)}) iden {_fmt(cell['iip'])} LnAcc {_fmt(cell['lnacc'])} "
                f"({cell['seconds']:.1f}s)")
        out.append({"name": row["name"], "order": row["order"], "ratio": row["ratio"], "cells": cells})
    return {"rows": out, "model": model, "image_attack": image_attack, "budgets": list(budgets),
            "image_batches": list(image_batches),
            "label_batches": list(LEAK_LABEL_BATCHES), "victims": victims, "trials": trials}


def bench_sweep(trials: int, iterations: int, figures: Path | None) -> dict[str, Any]:
    config = SweepConfig(dataset=DATASET, model=MODEL, activation=ACTIVATION, round=ROUND,
                         trials=trials, iterations=iterations, label_batch=30, image_batch=1)
    prefix = figures / "attacks" if figures else None
    return run_sweep(config, figure_prefix=prefix)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="table,sweep")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--victims", type=int, default=2, help="leakage section: attacked clients per cell")
    parser.add_argument("--models", default=MODEL, help="leakage section: comma-separated models (lenet5,simplecnn)")
    parser.add_argument("--leak-budgets", type=numbers(int, minimum=1), default=None,
                        help="leakage section: budgets as denominators, e.g. 32,8 (default 128,64,32,16,8)")
    parser.add_argument("--image-attack", default="inverting",
                        help="leakage section: inverting, or inverting-search (tries every label of a one-image "
                             "update; B = 1 only, 10x the time)")
    parser.add_argument("--leak-image-batches", type=numbers(int, minimum=1), default="",
                        help="leakage section: batch sizes of the image attack (default 1,4,8; inverting-search: 1); "
                             "models with BatchNorm (simplecnn) need >= 2, e.g. 4,8")
    parser.add_argument("--leak-noise", type=numbers(float, minimum=0), default="",
                        help="leakage section: plain_noise ratios of SenseCrypt hybrid rows (2- and 1-CPU clients), e.g. 0.1,0.3")
    parser.add_argument("--figures", type=Path, default=None, help="write the sweep PNGs here")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "attacks.json")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    result: dict[str, Any] = {
        "setting": {"dataset": DATASET, "model": MODEL, "activation": ACTIVATION,
                    "clients": 10, "captured_round": ROUND, "local_lr": 0.1,
                    "image_attack": "inverting", "label_attack": "ilrg",
                    "iterations": args.iterations, "trials": args.trials},
        "machine": machine(),
    }
    settings = AttackSettings(iterations=args.iterations)
    with torch_threads(1):
        if "table" in sections:
            log("table: strategies x batch sizes")
            result["table"] = bench_table(args.trials, settings, log)
        if "leakage" in sections:
            for model in args.models.split(","):
                log(f"leakage: the leakage-aware selection vs the App. H orders ({model})")
                key = model if args.image_attack == "inverting" else f"{model}/{args.image_attack}"
                batches = LEAK_IMAGE_BATCHES if args.image_attack == "inverting" else (1,)
                if args.leak_image_batches:
                    batches = tuple(args.leak_image_batches)
                result.setdefault("leakage", {})[key] = bench_leakage(
                    args.trials, args.victims, settings, log, model=model, image_attack=args.image_attack,
                    image_batches=batches,
                    budgets=(tuple(1 / b for b in args.leak_budgets) if args.leak_budgets
                             else LEAK_BUDGETS),
                    solver_rows=args.leak_budgets is None, noises=tuple(args.leak_noise))
        if "sweep" in sections:
            log("sweep: SenseCrypt App. H + heterogeneity")
            t = time.perf_counter()
            result["sweep"] = bench_sweep(args.trials, args.iterations, args.figures)
            log(f"  sweep done in {time.perf_counter() - t:.1f}s")
    result["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists() and set(sections) != {"table", "sweep"}:
        previous = json.loads(args.out.read_text())
        for key, value in result.items():
            if key == "leakage" and isinstance(previous.get(key), dict):
                previous[key].update(value)  # one entry per model and image attack
            else:
                previous[key] = value
        result = previous
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
