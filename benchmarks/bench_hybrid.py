"""Hybrid HE + DP strategies side by side (issue 3): accuracy, epsilon, zones, bytes, time.

    .venv/bin/python benchmarks/bench_hybrid.py [--rounds 10] [--clients 20] [--dataset digits]
                                                [--seeds 0,1,2] [--quick] [--threads 1]
                                                [--out benchmarks/results/hybrid.json]

Setting: ``--dataset`` (digits by default), ``--clients`` clients, partition
``dirichlet:0.5``, the MLP, ``--rounds`` rounds, simulator defaults for local training
(2 epochs, batch 16, lr 0.1), one seed for the main table (the first of ``--seeds``).
Every run that uses DP is calibrated to epsilon = 1 at delta = 1e-5 (``target_epsilon``:
Opacus' ``get_noise_multiplier`` over the run's DP releases), clip C = 1.

HE schemes: SelectiveShield and the Alt-FL methods use their default, CKKS (TenSEAL).
MaskCrypt and FedML-HE default to per-value Paillier (~8 ms per value at 2048 bits here,
hours per round for 5k encrypted values x 20 clients); they run on CKKS too (``--he-scheme``),
which is what both papers use, so every HE strategy shares one scheme. CKKS aggregation is
exact to ~1e-6, so the HE choice changes time and bytes, not accuracy.

Runs:
* ``selectiveshield`` over tau x rho (3 x 3 grid);
* ``plaintext``, ``maskcrypt``, ``fedml-he`` (he_ratio 0.1), ``dp-fedavg``, ``dpsgd``;
* ``selective-dp`` (dp_ratio 0.1) and "full-coverage DP" = ``selective-dp`` with
  dp_ratio 1.0 (every coordinate noised), same epsilon;
* ``alt-pi``, ``alt-si-dp``, ``alt-si-he``, ``alt-mp`` (eta = he_ratio 0.1, rho_syn/rho_tot 1/2);
* a run that raises ``ConfigError`` (e.g. training diverges under DP noise) is recorded with
  the error sentence, then retried ONCE with a documented remedy as a separate row:
  user-level DP (noise on the update, std C*sigma per coordinate whatever the learning
  rate) -> smaller clip C (``--remedy-clip``, 1e-3: the largest power of ten for which
  C*sigma*sqrt(rounds) stays below the MLP's initial weight bounds 1/sqrt(fan_in));
  record-level DP-SGD -> learning rate / 10;
* the claims, on every seed of ``--seeds`` and at every clip of ``--claim-clips`` (both
  sides of a comparison at the same C and epsilon): SelectiveShield (best cell of the
  seed-0 grid) vs DP-FedAvg and MaskCrypt; Selective-DP vs full-coverage DP;
* ``--cross-check DATASET``: the claim rows again on another dataset (first seed, C = 1
  and the remedy clip), e.g. mnist5k.

Prints one line per run while it goes, Markdown tables at the end, and writes the JSON
(rewritten after every run, so an interrupted benchmark keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from senseshield.bench.machine import cpu_model  # noqa: E402
from senseshield.errors import ConfigError  # noqa: E402
from senseshield.job import Job  # noqa: E402
from senseshield.results import PHASES, RunResult  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield.strategies import STRATEGIES, StrategyOptions  # noqa: E402

PARTITION = "dirichlet:0.5"
EPSILON, DELTA = 1.0, 1e-5
TAUS = (0.05, 0.1, 0.2)
RHOS = (0.3, 0.5, 0.7)
HE_RATIO = 0.1
BASELINES = ("plaintext", "maskcrypt", "fedml-he", "dp-fedavg", "dpsgd", "selective-dp")
ALT = ("alt-pi", "alt-si-dp", "alt-si-he", "alt-mp")
SELECTIVE_DP_CLAIM = (0.04, 0.06)  # Selective-DP's claimed margin over full-coverage DP


def machine() -> dict[str, Any]:
    model = cpu_model("unknown")
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_at_start": load}


# ---- one run ------------------------------------------------------------------------------
SS = "selectiveshield tau={tau:g} rho={rho:g}"
DPF = "dp-fedavg"
SEL = "selective-dp (dp_ratio 0.1)"
FULL = "full-coverage DP = selective-dp dp_ratio=1.0"
MC = "maskcrypt"


class Spec(dict):
    """A labelled run: strategy, dataset, scheme, seed, option and config overrides."""


def spec(label: str, strategy: str, *, group: str, seed: int, dataset: str, scheme: str | None = None,
         options: dict | None = None, config: dict | None = None, remedy_of: str | None = None) -> Spec:
    return Spec(label=label, strategy=strategy, group=group, seed=seed, dataset=dataset, scheme=scheme,
                options=dict(options or {}), config=dict(config or {}), remedy_of=remedy_of)


def clip_suffix(clip: float, args: argparse.Namespace) -> str:
    if clip == 1.0:
        return ""
    return f" [remedy: clip C={clip:g}]" if clip == args.remedy_clip else f" [clip C={clip:g}]"


def build_config(s: Spec, args: argparse.Namespace) -> Job:
    strategy = STRATEGIES.get(s["strategy"])
    opts: dict[str, Any] = {"he_ratio": HE_RATIO, "delta": DELTA}
    if strategy.dp_level is not None:
        opts["target_epsilon"] = EPSILON
    opts.update(s["options"])
    fields: dict[str, Any] = dict(strategy=s["strategy"], scheme=s["scheme"], dataset=s["dataset"],
                                  model="mlp", clients=args.clients, rounds=args.rounds,
                                  partition=PARTITION, seed=s["seed"])
    fields.update(s["config"])
    return Job(**fields, options=StrategyOptions(**opts))


def summarise(result: RunResult) -> dict[str, Any]:
    rounds = result.rounds
    zones = [r.zone_ratios for r in rounds if r.zone_ratios]
    notes: list[str] = []
    for r in rounds:
        for note in r.notes:
            if note not in notes:
                notes.append(note)
    clients = np.array([c.accuracy for c in result.clients])
    return {
        "final_accuracy": result.final_accuracy,
        "client_accuracy_mean": float(clients.mean()),
        "client_accuracy_min": float(clients.min()),
        "accuracy_by_round": [r.accuracy for r in rounds],
        "best_accuracy": max(r.accuracy for r in rounds),
        "epsilon": result.epsilon,
        "delta": result.delta,
        "noise_multiplier": result.noise_multiplier,
        "synthetic_epsilon": result.synthetic_epsilon,
        "zone_ratios": ({k: float(np.mean([z[k] for z in zones])) for k in zones[0]} if zones else None),
        "zone_ratios_by_round": [r.zone_ratios for r in rounds] if zones else None,
        "he_ratio_mean": float(np.mean([r.he_ratio_mean for r in rounds])),
        "round_types": [r.round_type for r in rounds] if any(r.round_type for r in rounds) else None,
        "mb_up_per_round": float(np.mean([r.bytes_up for r in rounds]) / 1e6),
        "mb_down_per_round": float(np.mean([r.bytes_down for r in rounds]) / 1e6),
        "phase_seconds_per_round": {p: float(np.mean([r.phase_seconds.get(p, 0.0) for r in rounds]))
                                    for p in PHASES},
        "seconds_per_round": float(np.mean([r.seconds for r in rounds])),
        "seconds_total": result.seconds_total,
        "num_params": result.num_params,
        "scheme": result.scheme,
        "notes": notes,
    }


def execute(s: Spec, args: argparse.Namespace) -> dict[str, Any]:
    config = build_config(s, args)
    row: dict[str, Any] = {k: s[k] for k in ("label", "strategy", "group", "dataset", "seed", "remedy_of")}
    o = config.options
    row["settings"] = {"scheme": config.scheme, "lr": config.lr, "clip": o.clip, "tau": o.tau, "rho": o.rho,
                       "he_ratio": o.he_ratio, "dp_ratio": o.dp_ratio, "target_epsilon": o.target_epsilon,
                       "delta": o.delta, "rho_syn": o.rho_syn, "rho_tot": o.rho_tot,
                       "local_epochs": config.local_epochs, "batch_size": config.batch_size}
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_simulation(config)
    except ConfigError as exc:
        row.update(status="error", error=str(exc), seconds_total=time.perf_counter() - t)
        return row
    except Exception as exc:  # a bug: keep the benchmark going, report it, exit 1 at the end
        row.update(status="bug", error=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc(limit=6), seconds_total=time.perf_counter() - t)
        return row
    row.update(status="ok", **summarise(result))
    if result.strategy == "selective-dp" and o.dp_ratio < 1.0:
        row["notes"].append("epsilon covers the noised (masked) coordinates only; the rest are sent unchanged")
    if result.strategy == "alt-pi":
        row["notes"].append("epsilon covers the DP-SGD rounds; S-HE rounds send 90% of the update unnoised")
    if result.synthetic_epsilon is not None:
        row["notes"].append(f"synthetic data is ({result.synthetic_epsilon:.2f}, {DELTA:g})-DP on top of epsilon")
    acc = row["accuracy_by_round"]
    if row["final_accuracy"] < 0.2:
        row["notes"].append("at chance level (10 classes): the DP noise swamps the update")
    elif acc[-1] < max(acc) - 0.1:
        row["notes"].append(f"unstable: best round {max(acc):.3f}, last {acc[-1]:.3f}")
    return row


def remedy(s: Spec, args: argparse.Namespace) -> Spec | None:
    """The one documented remedy for a run that raised ConfigError (None: no DP, no remedy)."""
    level = STRATEGIES.get(s["strategy"]).dp_level
    common = dict(group=s["group"], seed=s["seed"], dataset=s["dataset"], scheme=s["scheme"], remedy_of=s["label"])
    if level == "user":
        return spec(s["label"] + clip_suffix(args.remedy_clip, args), s["strategy"],
                    options=dict(s["options"], clip=args.remedy_clip), config=s["config"], **common)
    if level == "record":
        lr = s["config"].get("lr", 0.1) / 10
        return spec(f"{s['label']} [remedy: lr={lr:g}]", s["strategy"], options=s["options"],
                    config=dict(s["config"], lr=lr), **common)
    return None


# ---- the plan ---------------------------------------------------------------------------
def main_specs(args: argparse.Namespace) -> list[Spec]:
    seed, ds = args.seeds[0], args.dataset
    out = []
    for tau in args.taus:
        for rho in args.rhos:
            out.append(spec(SS.format(tau=tau, rho=rho), "selectiveshield", group="grid", seed=seed, dataset=ds,
                            options={"tau": tau, "rho": rho}))
    for name in BASELINES:
        scheme = args.he_scheme if name in ("maskcrypt", "fedml-he") else None
        out.append(spec(SEL if name == "selective-dp" else name, name, group="baseline", seed=seed, dataset=ds,
                        scheme=scheme))
    out.append(spec(FULL, "selective-dp", group="baseline", seed=seed, dataset=ds, options={"dp_ratio": 1.0}))
    for name in ALT:
        out.append(spec(name, name, group="alt-fl", seed=seed, dataset=ds))
    return out


def find(rows: list[dict], label: str, seed: int, dataset: str) -> dict | None:
    for r in rows:
        if r["label"] == label and r["seed"] == seed and r["dataset"] == dataset:
            return r
    return None


def usable(rows: list[dict], label: str, seed: int, dataset: str) -> dict | None:
    """The row of ``label``, or its remedy row if it raised; None if neither completed."""
    r = find(rows, label, seed, dataset)
    if r is not None and r["status"] == "ok":
        return r
    for x in rows:
        if x["remedy_of"] == label and x["seed"] == seed and x["dataset"] == dataset and x["status"] == "ok":
            return x
    return None


def run_all(specs: list[Spec], args: argparse.Namespace, rows: list[dict], log, save) -> None:  # type: ignore[no-untyped-def]
    queue = list(specs)
    i = 0
    while queue:
        s = queue.pop(0)
        if find(rows, s["label"], s["seed"], s["dataset"]) is not None:
            continue  # already measured (e.g. a remedy row the claims also ask for)
        i += 1
        log(f"[{i}/{i + len(queue)}] {s['label']} ({s['dataset']}, seed {s['seed']}) ...")
        row = execute(s, args)
        rows.append(row)
        if row["status"] == "ok":
            eps = "-" if row["epsilon"] is None else f"{row['epsilon']:.2f}"
            z = row["zone_ratios"]
            zones = "" if z is None else f" zones enc/pers/noise {z['enc']:.3f}/{z['pers']:.3f}/{z['noise']:.3f}"
            log(f"      acc {row['final_accuracy']:.3f} (clients {row['client_accuracy_mean']:.3f}) eps {eps}"
                f"{zones} up {row['mb_up_per_round']:.2f} MB/round {row['seconds_total']:.1f}s")
        else:
            log(f"      {row['status'].upper()}: {row['error']} ({row['seconds_total']:.1f}s)")
            if row["status"] == "error" and s["remedy_of"] is None:
                fix = remedy(s, args)
                if fix is not None:
                    queue.insert(0, fix)
        save()


def best_cell(rows: list[dict], args: argparse.Namespace) -> dict | None:
    """The SelectiveShield grid cell with the best final accuracy (seed 0, or its remedy row)."""
    cells = []
    for tau in args.taus:
        for rho in args.rhos:
            r = usable(rows, SS.format(tau=tau, rho=rho), args.seeds[0], args.dataset)
            if r is not None:
                cells.append((r["final_accuracy"], tau, rho, r["settings"]["clip"]))
    if not cells:
        return None
    acc, tau, rho, clip = max(cells)
    return {"tau": tau, "rho": rho, "clip_of_best": clip, "final_accuracy": acc,
            "selected_on": f"{args.dataset}, seed {args.seeds[0]} (optimistic for SelectiveShield)"}


def claim_specs(args: argparse.Namespace, *, dataset: str, seeds: list[int], clips: list[float],
                cell: dict | None, group: str) -> list[Spec]:
    """Rows the claims need, per seed: maskcrypt, and per clip C: SelectiveShield (best cell),
    DP-FedAvg, Selective-DP and full-coverage DP. C = 1 first, so a run that raises gets its
    remedy row; the other clips are a sweep (no remedy)."""
    out: list[Spec] = []
    for seed in seeds:
        out.append(spec(MC, "maskcrypt", group=group, seed=seed, dataset=dataset, scheme=args.he_scheme))
        for clip in clips:
            sfx = clip_suffix(clip, args)
            tag = None if clip == 1.0 else "(claim clip sweep)"
            rows = [(DPF, "dp-fedavg", {}), (SEL, "selective-dp", {}), (FULL, "selective-dp", {"dp_ratio": 1.0})]
            if cell is not None:
                rows.insert(0, (SS.format(tau=cell["tau"], rho=cell["rho"]), "selectiveshield",
                                {"tau": cell["tau"], "rho": cell["rho"]}))
            for base, name, opts in rows:
                out.append(spec(base + sfx, name, group=group, seed=seed, dataset=dataset,
                                options=dict(opts, clip=clip), remedy_of=tag))
    return out


def _acc(rows: list[dict], label: str, seeds: list[int], dataset: str) -> dict[str, Any]:
    vals, errors = [], []
    for seed in seeds:
        r = find(rows, label, seed, dataset)
        if r is None:
            continue
        if r["status"] == "ok":
            vals.append(r["final_accuracy"])
        else:
            errors.append(f"seed {seed}: {r['error']}")
    complete = len(vals) == len(seeds)
    return {"label": label, "accuracy_per_seed": vals, "mean": float(np.mean(vals)) if complete else None,
            "std": float(np.std(vals)) if complete and len(vals) > 1 else None, "errors": errors}


def _best(items: list[tuple[float, dict]]) -> tuple[float | None, dict | None]:
    ok = [(c, a) for c, a in items if a["mean"] is not None]
    if not ok:
        return None, None
    return max(ok, key=lambda x: x[1]["mean"])


def evaluate_claims(rows: list[dict], args: argparse.Namespace, *, dataset: str, seeds: list[int],
                    clips: list[float], cell: dict | None) -> dict[str, Any]:
    out: dict[str, Any] = {"dataset": dataset, "seeds": seeds, "clips": clips, "selectiveshield_cell": cell}
    fmt = lambda a: "diverged" if a is None or a["mean"] is None else f"{a['mean']:.3f}"  # noqa: E731
    mc = _acc(rows, MC, seeds, dataset)
    # (1) SelectiveShield >= DP-FedAvg and >= MaskCrypt
    c1: dict[str, Any] = {"claim": "SelectiveShield at or above DP-FedAvg and MaskCrypt accuracy (epsilon = 1)",
                          "maskcrypt": mc, "by_clip": []}
    if cell is None:
        c1.update(holds=None, verdict="not testable: no SelectiveShield run completed")
    else:
        ss_items, dp_items = [], []
        for clip in clips:
            sfx = clip_suffix(clip, args)
            ss = _acc(rows, SS.format(tau=cell["tau"], rho=cell["rho"]) + sfx, seeds, dataset)
            dp = _acc(rows, DPF + sfx, seeds, dataset)
            ss_items.append((clip, ss))
            dp_items.append((clip, dp))
            c1["by_clip"].append({"clip": clip, "selectiveshield": ss, "dp_fedavg": dp})
        ss_c, ss = _best(ss_items)
        dp_c, dp = _best(dp_items)
        if ss is None:
            c1.update(holds=False, verdict="DOES NOT HOLD: SelectiveShield diverged at every clip tried")
        else:
            vs_dp = dp is None or ss["mean"] >= dp["mean"]
            vs_mc = mc["mean"] is not None and ss["mean"] >= mc["mean"]
            word = "HOLDS" if vs_dp and vs_mc else "HOLDS ONLY vs DP-FedAvg" if vs_dp else \
                "HOLDS ONLY vs MaskCrypt" if vs_mc else "DOES NOT HOLD"
            c1.update(best_clip_selectiveshield=ss_c, best_clip_dp_fedavg=dp_c, above_dp_fedavg=vs_dp,
                      above_maskcrypt=vs_mc, holds=bool(vs_dp and vs_mc),
                      gap_to_maskcrypt_points=None if mc["mean"] is None else 100 * (ss["mean"] - mc["mean"]))
            c1["verdict"] = (
                f"{word}: SelectiveShield (tau={cell['tau']:g}, rho={cell['rho']:g}, best C={ss_c:g}) {fmt(ss)} vs "
                f"DP-FedAvg (best C={'-' if dp_c is None else f'{dp_c:g}'}) {fmt(dp)} and MaskCrypt {fmt(mc)}; "
                f"mean final accuracy over {len(seeds)} seed(s)."
            )
    out["selectiveshield_vs_baselines"] = c1
    # (2) Selective-DP 4-6 points above full-coverage DP at equal epsilon
    c2: dict[str, Any] = {"claim": "Selective-DP 4-6 points above full-coverage DP at equal epsilon", "by_clip": []}
    sel_items, full_items, parts = [], [], []
    for clip in clips:
        sfx = clip_suffix(clip, args)
        sel = _acc(rows, SEL + sfx, seeds, dataset)
        full = _acc(rows, FULL + sfx, seeds, dataset)
        sel_items.append((clip, sel))
        full_items.append((clip, full))
        gap = None if sel["mean"] is None or full["mean"] is None else 100 * (sel["mean"] - full["mean"])
        c2["by_clip"].append({"clip": clip, "selective_dp": sel, "full_coverage": full, "gap_points": gap,
                              "uniform_full_coverage_dp_fedavg": _acc(rows, DPF + sfx, seeds, dataset)})
        parts.append(f"C={clip:g}: {fmt(sel)} vs {fmt(full)}" + ("" if gap is None else f" ({gap:+.1f} pts)"))
    sel_c, sel = _best(sel_items)
    full_c, full = _best(full_items)
    if sel is None:
        c2.update(holds=False, verdict="DOES NOT HOLD: Selective-DP diverged at every clip tried")
    else:
        gap = 100 * (sel["mean"] - (full["mean"] if full is not None else 0.1))
        lo, hi = (100 * x for x in SELECTIVE_DP_CLAIM)
        word = ("HOLDS (gap within 4-6 points)" if lo <= gap <= hi else
                "direction holds, gap LARGER than 4-6 points" if gap > hi else
                "direction holds, gap SMALLER than 4 points" if gap > 0 else "DOES NOT HOLD")
        c2.update(best_clip_selective=sel_c, best_clip_full=full_c, gap_points_best_vs_best=gap,
                  holds=bool(lo <= gap <= hi), direction_holds=gap > 0)
        c2["verdict"] = (f"{word}: each at its best C, Selective-DP (C={sel_c:g}) {fmt(sel)} vs full-coverage DP "
                         f"(C={'-' if full_c is None else f'{full_c:g}'}) {fmt(full)} = {gap:+.1f} points; "
                         f"per C (selective vs full): " + "; ".join(parts) + ".")
    out["selective_dp_vs_full_coverage"] = c2
    return out


# ---- tables -----------------------------------------------------------------------------
def table_main(rows: list[dict], args: argparse.Namespace) -> str:
    head = ("| run | final acc. | client mean | epsilon | M_enc / M_pers / M_noise | MB up / down per round "
            "| s per round | total s | notes |\n| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |\n")
    lines = []
    for r in rows:
        if r["group"] not in ("grid", "baseline", "alt-fl"):
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']} | | | | | | {r['seconds_total']:.0f} | {r['error']} |")
            continue
        z = r["zone_ratios"]
        zones = "-" if z is None else f"{z['enc']:.3f} / {z['pers']:.3f} / {z['noise']:.3f}"
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        lines.append(f"| {r['label']} | {r['final_accuracy']:.3f} | {r['client_accuracy_mean']:.3f} | {eps} | {zones} "
                     f"| {r['mb_up_per_round']:.2f} / {r['mb_down_per_round']:.2f} | {r['seconds_per_round']:.1f} "
                     f"| {r['seconds_total']:.0f} | {'; '.join(r['notes'][:3])} |")
    return head + "\n".join(lines) + "\n"


def table_phases(rows: list[dict]) -> str:
    head = "| run | " + " | ".join(PHASES) + " |\n| --- |" + " ---: |" * len(PHASES) + "\n"
    lines = []
    for r in rows:
        if r["group"] not in ("grid", "baseline", "alt-fl") or r["status"] != "ok":
            continue
        ph = r["phase_seconds_per_round"]
        lines.append(f"| {r['label']} | " + " | ".join(f"{ph[p]:.3f}" for p in PHASES) + " |")
    return head + "\n".join(lines) + "\n"


def table_grid(rows: list[dict], args: argparse.Namespace) -> str:
    seed, ds = args.seeds[0], args.dataset
    head = "| tau \\ rho | " + " | ".join(f"{r:g}" for r in args.rhos) + " |\n| --- |" + " --- |" * len(args.rhos) + "\n"
    lines = []
    for tau in args.taus:
        cells = []
        for rho in args.rhos:
            label = SS.format(tau=tau, rho=rho)
            r, fix = find(rows, label, seed, ds), usable(rows, label, seed, ds)
            if r is None:
                cells.append("-")
            elif fix is None:
                cells.append("diverged")
            else:
                z = fix["zone_ratios"]
                pre = "" if fix is r else f"diverged at C=1; C={fix['settings']['clip']:g}: "
                cells.append(f"{pre}{fix['final_accuracy']:.3f} ({z['enc']:.1%} / {z['pers']:.1%} / {z['noise']:.1%})")
        lines.append(f"| {tau:g} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def table_claims(claims: dict) -> str:
    def cell(a: dict) -> str:
        if a["mean"] is None:
            return "diverged" if a["errors"] else "-"
        return f"{a['mean']:.3f}" + ("" if a["std"] is None else f" ± {a['std']:.3f}")

    c1, c2 = claims["selectiveshield_vs_baselines"], claims["selective_dp_vs_full_coverage"]
    cellname = "-" if claims["selectiveshield_cell"] is None else \
        f"SelectiveShield tau={claims['selectiveshield_cell']['tau']:g} rho={claims['selectiveshield_cell']['rho']:g}"
    lines = [f"| clip C | {cellname} | DP-FedAvg | Selective-DP (10%) | full-coverage DP | gap (points) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a, b in zip(c1["by_clip"] or [None] * len(c2["by_clip"]), c2["by_clip"]):
        gap = "-" if b["gap_points"] is None else f"{b['gap_points']:+.1f}"
        ss = "-" if a is None else cell(a["selectiveshield"])
        dp = cell(b["uniform_full_coverage_dp_fedavg"])
        lines.append(f"| {b['clip']:g} | {ss} | {dp} | {cell(b['selective_dp'])} | {cell(b['full_coverage'])} | {gap} |")
    text = "\n".join(lines) + f"\n\nMaskCrypt (no DP, he_ratio 0.1): {cell(c1['maskcrypt'])}\n\n"
    text += f"* Claim 1 ({c1['claim']}): {c1['verdict']}\n"
    text += f"* Claim 2 ({c2['claim']}): {c2['verdict']}\n"
    return text


# ---- main -------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--dataset", default="digits", help="digits | mnist5k | idx:<dir> | synthetic")
    p.add_argument("--seeds", default="0,1,2", help="first seed: main table; all of them: the claim rows")
    p.add_argument("--he-scheme", default="ckks", help="scheme of maskcrypt and fedml-he (their per-value paillier default is far too slow)")
    p.add_argument("--remedy-clip", type=float, default=1e-3, help="clip C of the remedy row of a diverged user-level DP run")
    p.add_argument("--claim-clips", default="1,0.1,0.01,0.001", help="clip C values of the claim rows (equal C for both sides)")
    p.add_argument("--cross-check", default="", help="also run the claim rows (first seed, C = 1 and the remedy clip) on this dataset, e.g. mnist5k")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared machine)")
    p.add_argument("--quick", action="store_true", help="smoke test: 6 clients, 2 rounds, one grid cell, one seed, C in {1, remedy}")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hybrid.json")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    args.claim_clips = sorted(set(_floats(args.claim_clips)) | {1.0, args.remedy_clip}, reverse=True)
    args.taus, args.rhos = TAUS, RHOS
    if args.quick:
        args.clients, args.rounds, args.seeds = 6, 2, args.seeds[:1]
        args.taus, args.rhos = (0.1,), (0.5,)
        args.claim_clips = [1.0, args.remedy_clip]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    rows: list[dict] = []
    report: dict[str, Any] = {
        "benchmark": "hybrid",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_hybrid.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "setting": {"dataset": args.dataset, "model": "mlp", "clients": args.clients, "rounds": args.rounds,
                    "partition": PARTITION, "seeds": args.seeds, "main_seed": args.seeds[0],
                    "target_epsilon": EPSILON, "delta": DELTA, "clip": 1.0, "remedy_clip": args.remedy_clip,
                    "remedy_record_level": "lr / 10", "claim_clips": args.claim_clips,
                    "local_epochs": 2, "batch_size": 16, "lr": 0.1, "he_ratio": HE_RATIO,
                    "he_scheme_maskcrypt_fedml_he": args.he_scheme, "taus": list(args.taus), "rhos": list(args.rhos),
                    "cross_check": args.cross_check or None, "quick": args.quick},
        "runs": rows,
    }

    def save() -> None:
        report["seconds_total"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    log(f"main table: {args.dataset}, {args.clients} clients, {PARTITION}, {args.rounds} rounds, seed {args.seeds[0]}")
    run_all(main_specs(args), args, rows, log, save)
    cell = best_cell(rows, args)
    log(f"claims: seeds {args.seeds}, clips {args.claim_clips}, SelectiveShield cell {cell}")
    run_all(claim_specs(args, dataset=args.dataset, seeds=args.seeds, clips=args.claim_clips, cell=cell,
                        group="claims"), args, rows, log, save)
    report["claims"] = evaluate_claims(rows, args, dataset=args.dataset, seeds=args.seeds, clips=args.claim_clips,
                                       cell=cell)
    save()
    if args.cross_check:
        ds, seeds, clips = args.cross_check, args.seeds[:1], [1.0, args.remedy_clip]
        log(f"cross-check of the claims on {ds}: seed {seeds[0]}, clips {clips}")
        specs = [spec("plaintext", "plaintext", group="cross-check", seed=seeds[0], dataset=ds)]
        specs += claim_specs(args, dataset=ds, seeds=seeds, clips=clips, cell=cell, group="cross-check")
        run_all(specs, args, rows, log, save)
        report["cross_check"] = evaluate_claims(rows, args, dataset=ds, seeds=seeds, clips=clips, cell=cell)
        pt = find(rows, "plaintext", seeds[0], ds)
        report["cross_check"]["plaintext"] = None if pt is None or pt["status"] != "ok" else pt["final_accuracy"]
        save()

    main_rows = [r for r in rows if r["dataset"] == args.dataset]
    text = [f"## Hybrid HE + DP: {args.dataset}, {args.clients} clients, {PARTITION}, {args.rounds} rounds, "
            f"epsilon {EPSILON:g} (delta {DELTA:g}) where DP applies, seed {args.seeds[0]}\n",
            table_main(main_rows, args), "\n### SelectiveShield grid: final accuracy (M_enc / M_pers / M_noise)\n",
            table_grid(rows, args), "\n### Mean seconds per phase per round\n", table_phases(main_rows),
            f"\n### Claims ({args.dataset}, mean over seeds {', '.join(map(str, args.seeds))}, equal epsilon {EPSILON:g})\n",
            table_claims(report["claims"])]
    if "cross_check" in report:
        cc = report["cross_check"]
        text += [f"\n### Cross-check on {cc['dataset']} (seed {cc['seeds'][0]}, plaintext "
                 f"{'-' if cc['plaintext'] is None else format(cc['plaintext'], '.3f')})\n", table_claims(cc)]
    print("\n".join(text))
    log(f"wrote {args.out} ({len(rows)} runs, {time.perf_counter() - started:.0f}s)")
    return 1 if any(r["status"] == "bug" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
