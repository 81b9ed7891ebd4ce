"""A second, independent attack as a check on the project's own (issue 16, item 3).

    nice -n 15 .venv/bin/python benchmarks/bench_dlg.py [--sections agreement,protected,layers]
        [--trials 2] [--victims 2] [--batches 1,4] [--budgets 64,32,16,8] [--noises 0.1,0.3] [--steps 100]
        [--iterations 600] [--project-attack inverting] [--model M --activation A] [--out FILE]

DLG (``senseshield_checks.dlg``: Zhu et al. 2019, L-BFGS on the Euclidean gradient
distance, soft label optimised jointly, written apart from ``senseshield.attacks``) against
the project's Inverting Gradients (``senseshield.attacks``, ``--project-attack``), on the
same captured updates: mnist5k (28x28), 10 IID clients, the first round captured (the model
at its initialisation), one SGD step (lr 0.1) on a batch of B of the client's samples,
per-value masks; the server sees the plaintext outside the mask.

* ``agreement``: the unprotected one-image update of the project's LeNet-5 (sigmoid, the
  model of ``bench_attacks.py``; and ReLU) and of the DLG paper's sigmoid LeNet
  (``senseshield_checks.dlg:dlg_lenet``). The two attacks agree when both reach 25 dB
  (mean PSNR) on the same model; only then do their protected figures on that model count.
* ``layers``: the adaptive attacker against the hybrid: DLG given one layer's visible
  gradient at a time (where the noise-to-signal ratio is lowest), on SenseCrypt's 1-CPU
  client with ``score=leakage``, without noise and with each ``--noises`` ratio, B = 1.
* ``protected``: on the DLG LeNet (where they agree; ``--model``/``--activation`` pick
  another model, e.g. ``--model lenet5 --activation sigmoid``): unprotected, blind (everything
  hidden) and ``1/budget`` of the update encrypted, chosen Taylor-sensitivity-first
  ("high"), at random, and leakage-first (``score=leakage``, when registered); plus
  SenseCrypt's own masks for its 2- and 1-CPU clients (budgets 1/16 and 1/32 in a fleet of
  32..1 CPUs) with the Taylor and the leakage score. ``--noises R,...`` adds the hybrid
  (``plain_noise=R``: noise of R times the plaintext part's norm on that part) at every
  budget and for both SenseCrypt clients. PSNR, SSIM and identified share (IIP:
  the reconstruction's nearest neighbour in the client's data is its true input) for both
  attacks, for each batch size of ``--batches``; ``--victims`` clients x ``--trials``
  batches per cell.

"Stopped" (the issue's target) marks a cell whose PSNR is within 3 dB of the same attack's
blind row and where nothing was identified.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from senseshield.attacks import ATTACKS, AttackSettings  # noqa: E402
from senseshield.attacks.base import torch_threads  # noqa: E402
from senseshield.attacks.capture import Capture, Fleet, FleetSpec, capture, prepare_fleet  # noqa: E402
from senseshield.attacks.metrics import (  # noqa: E402
    identifiability_precision,
    match_reconstructions,
    psnr,
    ssim,
)
from senseshield.attacks.view import hide  # noqa: E402
from senseshield.engine.sensitivity import SCORES  # noqa: E402
from senseshield.training import layout_of  # noqa: E402
from senseshield.strategies import StrategyOptions  # noqa: E402
from senseshield_checks.dlg import DLG_LENET, DLGSettings, dlg  # noqa: E402
from arglists import numbers  # noqa: E402
from bench_attacks import CPUS, _fmt, machine  # noqa: E402  (the same SenseCrypt fleet of 32..1 CPUs)

DATASET, ROUND, CLIENTS = "mnist5k", 1, 10
AGREEMENT_MODELS = (("lenet5", "sigmoid"), ("lenet5", "relu"), (DLG_LENET, None))
THRESHOLD_DB = 25.0
MODEL_NAMES = {DLG_LENET: "DLG LeNet (sigmoid)"}


def spec(strategy: str, model: str, activation: str | None, **over: Any) -> FleetSpec:
    fields: dict[str, Any] = dict(strategy=strategy, dataset=DATASET, model=model,
                                  activation=activation, clients=CLIENTS, round=ROUND, seed=0)
    fields.update(over)
    return FleetSpec(**fields)


def model_label(model: str, activation: str | None) -> str:
    return MODEL_NAMES.get(model, model + (f" ({activation})" if activation else ""))


def score(images: np.ndarray, cap: Capture, pool: np.ndarray) -> dict[str, float]:
    """PSNR, SSIM and IIP of a batch of reconstructions, paired with the truth by minimum MSE."""
    order = match_reconstructions(images, cap.x)
    return {"psnr": float(np.mean(np.minimum(psnr(images, cap.x[order]), 100.0))),
            "ssim": float(np.mean(ssim(images, cap.x[order]))),
            "iip": identifiability_precision(images, cap.indices[order], pool),
            "order": order}


def attack_cap(cap: Capture, pool: np.ndarray, seed: int, dlg_settings: DLGSettings,
               project_attack: str, ig_settings: AttackSettings) -> dict[str, Any]:
    """Both attacks on one captured update; metrics of each."""
    t = time.perf_counter()
    d = dlg(cap.view, settings=dlg_settings, seed=seed)
    got = score(d.images, cap, pool)
    labels_right = float(np.mean(d.labels == cap.y[got.pop("order")]))
    row: dict[str, Any] = {"he_ratio": cap.he_ratio,
                           "dlg": {**got, "label": labels_right, "distance": d.distance,
                                   "evaluations": d.evaluations, "seconds": time.perf_counter() - t}}
    t = time.perf_counter()
    r = ATTACKS.get(project_attack).run(cap.view, settings=ig_settings, seed=seed)
    got = score(r.images, cap, pool)
    got.pop("order")
    row["project"] = {**got, "seconds": time.perf_counter() - t}
    return row


def cell(fleet: Fleet, victims: list[int], trials: int, batch: int, order: str | None,
         ratio: float | None, args: argparse.Namespace, dlg_settings: DLGSettings,
         ig_settings: AttackSettings) -> dict[str, Any]:
    records = []
    t = time.perf_counter()
    for v in victims:
        pool = fleet.clients[v].x_train
        for trial in range(trials):
            cap = capture(fleet, [v], batch_size=batch, trial=trial, order=order, ratio=ratio)[0]
            records.append(attack_cap(cap, pool, 1000 * trial + 10 * v + batch, dlg_settings,
                                      args.project_attack, ig_settings))
    out: dict[str, Any] = {"batch": batch, "n": len(records), "seconds": time.perf_counter() - t,
                           "he_ratio": float(np.mean([r["he_ratio"] for r in records]))}
    for who in ("dlg", "project"):
        keys = ("psnr", "ssim", "iip") + (("label",) if who == "dlg" else ())
        out[who] = {k: float(np.mean([r[who][k] for r in records])) for k in keys}
        out[who]["psnr_min"] = float(min(r[who]["psnr"] for r in records))
        out[who]["psnr_max"] = float(max(r[who]["psnr"] for r in records))
        out[who]["seconds"] = float(np.mean([r[who]["seconds"] for r in records]))
    out["trials"] = records
    return out


def bench_agreement(args: argparse.Namespace, dlg_settings: DLGSettings, ig_settings: AttackSettings,
                    log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    rows = []
    for model, activation in AGREEMENT_MODELS:
        fleet = prepare_fleet(spec("plaintext", model, activation))
        c = cell(fleet, list(range(args.victims)), args.trials, 1, None, None, args, dlg_settings, ig_settings)
        agree = c["dlg"]["psnr"] >= THRESHOLD_DB and c["project"]["psnr"] >= THRESHOLD_DB
        rows.append({"model": model, "activation": activation, "label": model_label(model, activation),
                     "num_params": fleet.num_params, "agree": agree, **c})
        log(f"  {model_label(model, activation):<22} {fleet.num_params:>6} params  DLG {_fmt(c['dlg']['psnr'], 1)} dB "
            f"(min {_fmt(c['dlg']['psnr_min'], 1)}, IIP {_fmt(c['dlg']['iip'])})  {args.project_attack} "
            f"{_fmt(c['project']['psnr'], 1)} dB (min {_fmt(c['project']['psnr_min'], 1)}, IIP "
            f"{_fmt(c['project']['iip'])})  agree: {'yes' if agree else 'no'}  ({c['seconds']:.0f}s)")
    return {"threshold_db": THRESHOLD_DB, "rows": rows}


def protected_rows(budgets: list[int], noises: list[float] = ()) -> list[dict[str, Any]]:
    taylor = StrategyOptions()
    leak = StrategyOptions(score="leakage") if "leakage" in SCORES else None
    rows: list[dict[str, Any]] = [
        dict(name="unprotected", strategy="plaintext", options=taylor, order=None, ratio=None),
        dict(name="blind (all hidden)", strategy="plaintext", options=taylor, order="high", ratio=1.0),
    ]
    for b in budgets:
        rows.append(dict(name=f"Taylor-high-first 1/{b}", strategy="plaintext", options=taylor, order="high", ratio=1 / b))
        rows.append(dict(name=f"random 1/{b}", strategy="plaintext", options=taylor, order="random", ratio=1 / b))
        if leak is not None:
            rows.append(dict(name=f"leakage-first 1/{b}", strategy="plaintext", options=leak, order="high", ratio=1 / b))
        for noise in noises:  # the hybrid at a fixed budget: sensecrypt's noise on the plaintext part
            options = StrategyOptions(score="leakage" if leak is not None else None, plain_noise=noise)
            rows.append(dict(name=f"{'leakage' if leak is not None else 'Taylor-high'}-first 1/{b}, plain_noise={noise:g}",
                             strategy="sensecrypt", options=options, order="high", ratio=1 / b))
    for cpus, victim in (("2-CPU (1/16)", 7), ("1-CPU (1/32)", 8)):
        for name, options in (("taylor", taylor), ("leakage", leak)):
            if options is not None:
                rows.append(dict(name=f"SenseCrypt {cpus}, score={name}", strategy="sensecrypt", options=options,
                                 order=None, ratio=None, victims=[victim], cpu=CPUS))
        for noise in noises:  # the hybrid: leakage-first encryption + noise on the plaintext part
            options = StrategyOptions(score="leakage" if leak is not None else None, plain_noise=noise)
            rows.append(dict(name=f"SenseCrypt {cpus}, score={options.score or 'taylor'}, plain_noise={noise:g}",
                             strategy="sensecrypt", options=options, order=None, ratio=None, victims=[victim], cpu=CPUS))
    return rows


def bench_protected(args: argparse.Namespace, dlg_settings: DLGSettings, ig_settings: AttackSettings,
                    log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    fleets: dict[str, Fleet] = {}
    out = []
    for row in protected_rows(args.budgets, args.noises):
        over = {"options": row["options"]}
        if "cpu" in row:
            over["cpu"] = row["cpu"]
        s = spec(row["strategy"], args.model, args.activation, **over)
        key = repr(s)
        if key not in fleets:
            fleets[key] = prepare_fleet(s)
        fleet = fleets[key]
        victims = row.get("victims", list(range(args.victims)))
        cells = []
        for batch in args.batches:
            c = cell(fleet, victims, args.trials, batch, row["order"], row["ratio"], args, dlg_settings, ig_settings)
            cells.append(c)
            log(f"  {row['name']:<36} B={batch} HE {c['he_ratio']:.4f}  DLG {_fmt(c['dlg']['psnr'], 1)} dB "
                f"SSIM {_fmt(c['dlg']['ssim'])} IIP {_fmt(c['dlg']['iip'])} label {_fmt(c['dlg']['label'])}  "
                f"{args.project_attack} {_fmt(c['project']['psnr'], 1)} dB SSIM {_fmt(c['project']['ssim'])} "
                f"IIP {_fmt(c['project']['iip'])}  ({c['seconds']:.0f}s)")
        out.append({"name": row["name"], "strategy": row["strategy"], "score": row["options"].score or "taylor",
                    "order": row["order"], "ratio": row["ratio"], "victims": victims, "cells": cells})
    blind = next(r for r in out if r["name"].startswith("blind"))
    for r in out:
        for c, b in zip(r["cells"], blind["cells"]):
            for who in ("dlg", "project"):
                c[who]["stopped"] = bool(c[who]["psnr"] <= b[who]["psnr"] + 3.0 and c[who]["iip"] == 0.0)
    base = next(r for r in out if r["name"] == "unprotected")["cells"][0]
    counts = base["batch"] == 1 and min(base["dlg"]["psnr"], base["project"]["psnr"]) >= THRESHOLD_DB
    if not counts:
        log(f"  the attacks do not both reach {THRESHOLD_DB:g} dB on the unprotected B = 1 update: the "
            "protected figures above do not count")
    return {"model": args.model, "activation": args.activation, "label": model_label(args.model, args.activation),
            "num_params": next(iter(fleets.values())).num_params,
            "baseline_agrees": counts, "rows": out}


def bench_layers(args: argparse.Namespace, dlg_settings: DLGSettings, log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The adaptive attacker: DLG on one layer's visible gradient at a time (it matches only
    where the signal-to-noise ratio is highest), on SenseCrypt's 1-CPU client (1/32,
    score=leakage) with no noise and with each ``--noises`` ratio, B = 1."""
    rows = []
    for noise in [0.0, *args.noises]:
        options = StrategyOptions(score="leakage" if "leakage" in SCORES else None, plain_noise=noise)
        fleet = prepare_fleet(spec("sensecrypt", args.model, args.activation, options=options, cpu=CPUS))
        victim = 8
        pool = fleet.clients[victim].x_train
        for trial in range(args.trials):
            cap = capture(fleet, [victim], batch_size=1, trial=trial)[0]
            modules: dict[str, list[slice]] = {}
            for seg in layout_of(cap.view.build_model()).segments:
                if seg.trainable:
                    modules.setdefault(seg.name.rsplit(".", 1)[0], []).append(slice(seg.offset, seg.stop))
            for module in [None, *modules]:
                hide_mask = np.zeros(cap.view.size, bool)
                if module is not None:
                    hide_mask[:] = True
                    for sl in modules[module]:
                        hide_mask[sl] = False
                view = hide(cap.view, hide_mask)
                d = dlg(view, settings=dlg_settings, seed=1000 * trial + victim)
                got = score(d.images, cap, pool)
                rows.append({"noise": noise, "layer": module or "all", "trial": trial,
                             "psnr": got["psnr"], "iip": got["iip"]})
                log(f"  plain_noise={noise:<5g} DLG on {module or 'all layers':<10} {got['psnr']:5.1f} dB "
                    f"identified {got['iip']:.2f}")
    return {"victim": "SenseCrypt 1-CPU (1/32)", "rows": rows}


def markdown(result: dict[str, Any], project_attack: str) -> str:
    """The tables of docs/results.md and docs/attacks.md."""
    lines = []
    if "agreement" in result:
        lines += ["| model (unprotected, B = 1) | parameters | DLG PSNR dB (min) / SSIM / identified | "
                  f"{project_attack} PSNR dB (min) / SSIM / identified | agree (both ≥ 25 dB) |",
                  "|---|---:|---|---|---|"]
        for r in result["agreement"]["rows"]:
            d, p = r["dlg"], r["project"]
            lines.append(f"| {r['label']} | {r['num_params']:,} | {d['psnr']:.1f} ({d['psnr_min']:.1f}) / "
                         f"{d['ssim']:.2f} / {d['iip']:.2f} | {p['psnr']:.1f} ({p['psnr_min']:.1f}) / "
                         f"{p['ssim']:.2f} / {p['iip']:.2f} | {'yes' if r['agree'] else 'no'} |")
        lines.append("")
    if "protected" in result:
        rows = result["protected"]["rows"]
        batches = [c["batch"] for c in rows[0]["cells"]]
        head = "| selection | HE |" + "".join(
            f" B={b} DLG dB / SSIM / iden. | B={b} {project_attack} dB / SSIM / iden. |" for b in batches)
        lines += [head, "|---|---:|" + "---|---|" * len(batches)]
        for r in rows:
            cells = "".join(
                f" {_cell(c['dlg'])} | {_cell(c['project'])} |" for c in r["cells"])
            lines.append(f"| {r['name']} | {r['cells'][0]['he_ratio']:.3f} |{cells}")
    return "\n".join(lines)


def _cell(m: dict[str, Any]) -> str:
    text = f"{m['psnr']:.1f} / {m['ssim']:.2f} / {m['iip']:.2f}"
    return f"**{text}**" if m.get("stopped") else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="agreement,protected")
    parser.add_argument("--trials", type=int, default=2, help="batches per victim and cell")
    parser.add_argument("--victims", type=int, default=2, help="attacked clients per cell")
    parser.add_argument("--batches", type=numbers(int, minimum=1), default="1,4",
                        help="batch sizes of the protected section")
    parser.add_argument("--budgets", type=numbers(int, minimum=1), default="64,32,16,8",
                        help="encrypted fractions as denominators")
    parser.add_argument("--model", default=DLG_LENET,
                        help="protected section: the attacked model (default: the DLG LeNet; lenet5 for the "
                             "project's benchmark model, where the two attacks do not agree)")
    parser.add_argument("--activation", default=None, help="protected section: lenet5's activation (sigmoid, relu)")
    parser.add_argument("--noises", type=numbers(float, minimum=0), default="",
                        help="protected section: plain_noise ratios of the SenseCrypt hybrid rows, e.g. 0.3,1,3")
    parser.add_argument("--steps", type=int, default=100, help="DLG's L-BFGS steps")
    parser.add_argument("--iterations", type=int, default=600, help="the project attack's iterations")
    parser.add_argument("--project-attack", default="inverting",
                        help="the senseshield.attacks image attack to compare (inverting, inverting-search, idlg)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/dlg.json (dlg-MODEL.json with --model)")
    args = parser.parse_args()
    if not args.batches or not args.budgets:
        parser.error("--batches and --budgets need at least one value each, e.g. 1,4")
    if args.out is None:
        tag = "" if args.model == DLG_LENET else "-" + "-".join(filter(None, (args.model, args.activation)))
        args.out = ROOT / "benchmarks" / "results" / f"dlg{tag}.json"
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - {"agreement", "protected", "layers"})
    if unknown:
        raise SystemExit(f"error: --sections {','.join(unknown)} is not allowed; choose from agreement, protected, layers.")
    if args.project_attack not in ATTACKS or not ATTACKS.get(args.project_attack).reconstructs_images:
        images = [n for n, a in ATTACKS.items() if a.reconstructs_images]
        raise SystemExit(f"error: --project-attack {args.project_attack!r} is not allowed; choose one of: "
                         f"{', '.join(images)}.")
    if args.trials < 1 or args.victims < 1:
        raise SystemExit("error: --trials and --victims must be integers >= 1.")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    dlg_settings = DLGSettings(steps=args.steps)
    ig_settings = AttackSettings(iterations=args.iterations)
    result: dict[str, Any] = {
        "setting": {"dataset": DATASET, "clients": CLIENTS, "captured_round": ROUND, "local_lr": 0.1,
                    "dlg_steps": args.steps, "project_attack": args.project_attack,
                    "project_iterations": args.iterations, "trials": args.trials, "victims": args.victims,
                    "batches": args.batches, "budgets": args.budgets},
        "machine": machine(),
    }
    with torch_threads(1):
        if "agreement" in sections:
            log("agreement: both attacks on unprotected one-image updates")
            result["agreement"] = bench_agreement(args, dlg_settings, ig_settings, log)
        if "protected" in sections:
            log(f"protected: selections x budgets on {model_label(args.model, args.activation)}")
            result["protected"] = bench_protected(args, dlg_settings, ig_settings, log)
        if "layers" in sections:
            log(f"layers: DLG on one layer at a time, SenseCrypt's 1-CPU client ({model_label(args.model, args.activation)})")
            result["layers"] = bench_layers(args, dlg_settings, log)
    result["seconds"] = time.perf_counter() - started
    print()
    print(markdown(result, args.project_attack))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
