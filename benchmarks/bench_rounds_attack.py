"""The coordinator as the attacker, over rounds (issue 22): what it holds of one client's
updates after R = 1, 16 and 64 rounds, combined and attacked.

    nice -n 10 .venv/bin/python benchmarks/bench_rounds_attack.py [--rounds 1,16,64]
        [--budgets 8,32,64] [--noise 0.3] [--victims 2] [--jobs 2] [--batch 1] [--steps 100]
        [--iterations 600] [--project-attack inverting-search|none] [--no-dlg] [--rows masked,hybrid]
        [--model M --activation A]
        [--out FILE]

The setting of ``bench_dlg.py`` (mnist5k, 10 IID clients, the first round captured, one SGD
step with lr 0.1 on a batch of ``--batch`` of the client's samples, per-value masks; by
default the DLG paper's LeNet, the model on which DLG and the project's Inverting Gradients
agree). The attacker's best case for averaging: the victim holds **the same batch in every
round and the global model stays put** (an active coordinator can simply send the same
model again; an honest one sees it move, which makes the rounds' updates differ): every
round's update is the same step, only its fresh client-side noise differs
(:func:`senseshield.attacks.capture.capture` with ``draw=r``). The coordinator averages, per
position, the values it could read in the R rounds
(:func:`senseshield.attacks.view.average_views`) and attacks the mean as one update.

Rows (what the coordinator holds of one client's update each round):

* ``unprotected`` and ``blind`` (everything hidden): the ceiling and the floor, one update;
* ``masked``: the 64-bit words of the update masked through the key server (the real
  :mod:`senseshield.he.masked` scheme, a fresh pad per round as the round context changes),
  read as if they were the fixed-point update (``decode``: its best use of the bytes);
* ``SenseCrypt k>=2 1/b``: ``min_encryptors=2`` and ``score=leakage``, ``1/b`` of the update
  encrypted leakage-first; the coordinator sees the plaintext outside that mask (with k >= 2
  a position only this client encrypted is never decrypted, so nothing else of it);
* ``hybrid 1/b``: the same with ``plain_noise`` (``--noise``) on that plaintext.

Both attacks run on every combined observation: DLG (``senseshield_checks.dlg``, written
apart from the engine: the verdict) and the project's ``--project-attack``. PSNR and
identified share (the reconstruction's nearest neighbour in the client's data is its true
input), ``--victims`` clients x one batch each per cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
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
from senseshield.attacks.capture import Capture, Fleet, capture, prepare_fleet  # noqa: E402
from senseshield.attacks.view import ServerView, average_views  # noqa: E402
from senseshield.engine.aggregation import protect_update  # noqa: E402
from senseshield.he import generate_keys  # noqa: E402
from senseshield.he.base import round_context  # noqa: E402
from senseshield.he.masked import decode  # noqa: E402
from senseshield.runtime.identity import Identity  # noqa: E402
from senseshield.strategies import StrategyOptions  # noqa: E402
from senseshield_checks.dlg import DLG_LENET, DLGSettings, dlg  # noqa: E402
from arglists import numbers  # noqa: E402
from bench_attacks import machine  # noqa: E402
from bench_dlg import DATASET, model_label, score, spec  # noqa: E402


def rows(budgets: list[int], noise: float) -> list[dict[str, Any]]:
    """The rows of the table: strategy, options and the fixed-order mask of each."""
    sealed = StrategyOptions(score="leakage", min_encryptors=2)
    out: list[dict[str, Any]] = [
        dict(name="unprotected", strategy="plaintext", options=StrategyOptions(), order=None, ratio=None),
        dict(name="blind (all hidden)", strategy="plaintext", options=StrategyOptions(), order="high", ratio=1.0),
        dict(name="masked", strategy="plaintext", options=StrategyOptions(), order=None, ratio=None, masked=True),
    ]
    for b in budgets:
        out.append(dict(name=f"SenseCrypt k>=2 1/{b}", strategy="sensecrypt", options=sealed, order="high", ratio=1 / b))
    for b in budgets:
        out.append(dict(name=f"hybrid 1/{b}, plain_noise={noise:g}", strategy="sensecrypt",
                        options=sealed.model_copy(update={"plain_noise": noise}), order="high", ratio=1 / b))
    return out


def masked_views(cap: Capture, rounds: int) -> list[ServerView]:
    """What the coordinator holds of ``cap``'s update masked through the key server in
    ``rounds`` rounds (fresh pads each: the round context changes), as values."""
    secret = generate_keys("masked")
    agent = Identity.generate(cap.view.client_id or "victim")
    delta = cap.view.known  # the unprotected capture: everything known
    everything = np.ones(delta.size, dtype=bool)
    out = []
    for r in range(1, rounds + 1):
        key = secret.public_key.for_contributor(agent.exchange, round_context("bench", "rounds", r, 0))
        update = protect_update(delta, everything, key, client_id=cap.view.client_id, round=r, cluster=0,
                                n_samples=cap.view.n_samples)
        assert update.plaintext.size == 0  # nothing of it in the clear
        words = decode(update.ciphertext.payload)
        out.append(dataclasses.replace(cap.view, known=words, unknown=np.zeros(delta.size, dtype=bool)))
    return out


def views_over_rounds(fleet: Fleet, row: dict[str, Any], victim: int, batch: int, rounds: int) -> tuple[Capture, list[ServerView]]:
    """The victim's first capture (the ground truth) and what the coordinator holds of it in
    each of ``rounds`` rounds: the same batch and model, fresh client-side noise."""
    caps = [capture(fleet, [victim], batch_size=batch, trial=0, order=row["order"], ratio=row["ratio"], draw=d)[0]
            for d in range(1 if row.get("masked") else rounds)]
    if row.get("masked"):
        return caps[0], masked_views(caps[0], rounds)
    return caps[0], [c.view for c in caps]


def attackers(args: argparse.Namespace) -> tuple[str, ...]:
    """``dlg`` (the verdict) unless ``--no-dlg``, and ``project`` unless ``--project-attack none``."""
    return (() if args.no_dlg else ("dlg",)) + (() if args.project_attack == "none" else ("project",))


def attack(view: ServerView, cap: Capture, pool: np.ndarray, seed: int, dlg_settings: DLGSettings | None,
           project_attack: str | None, ig_settings: AttackSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if dlg_settings is not None:
        t = time.perf_counter()
        got = score(dlg(view, settings=dlg_settings, seed=seed).images, cap, pool)
        got.pop("order")
        out["dlg"] = {**got, "seconds": time.perf_counter() - t}
    if project_attack:
        t = time.perf_counter()
        got = score(ATTACKS.get(project_attack).run(view, settings=ig_settings, seed=seed).images, cap, pool)
        got.pop("order")
        out["project"] = {**got, "seconds": time.perf_counter() - t}
    return out


def rounds_of(row: dict[str, Any], rounds: list[int]) -> list[int]:
    """The reference rows (unprotected, blind) are one update; the others every R."""
    return [1] if row["strategy"] == "plaintext" and not row.get("masked") else rounds


def victim_records(args: argparse.Namespace, victim: int) -> list[dict[int, dict[str, Any]]]:
    """Every row's attack records for one victim, per R (one process per victim)."""
    dlg_settings = None if args.no_dlg else DLGSettings(steps=args.steps)
    ig_settings = AttackSettings(iterations=args.iterations)
    project = None if args.project_attack == "none" else args.project_attack
    fleets: dict[str, Fleet] = {}
    out = []
    with torch_threads(1):
        for row in selected_rows(args):
            s = spec(row["strategy"], args.model, args.activation, options=row["options"])
            if repr(s) not in fleets:
                fleets[repr(s)] = prepare_fleet(s)
            fleet = fleets[repr(s)]
            rounds = rounds_of(row, args.rounds)
            t = time.perf_counter()
            cap, views = views_over_rounds(fleet, row, victim, args.batch, max(rounds))
            pool = fleet.clients[victim].x_train
            done: dict[str, dict[str, Any]] = {}  # the same observation gets the same attack
            records: dict[int, dict[str, Any]] = {}
            for r in rounds:
                combined = average_views(views[:r])
                key = hashlib.sha256(combined.known.tobytes()).hexdigest()
                if key not in done:
                    done[key] = attack(combined, cap, pool, 1000 + 10 * victim + args.batch, dlg_settings, project,
                                       ig_settings)
                records[r] = {"victim": victim, "rounds": r, "visible": float(np.mean(~combined.unknown)),
                              "he_ratio": cap.he_ratio, **done[key]}
                names = {"dlg": "DLG", "project": project}
                print(f"  victim {victim} {row['name']:<32} R={r:<3}" + "".join(
                    f"  {names[w]} {records[r][w]['psnr']:5.1f} dB identified {records[r][w]['iip']:.2f}"
                    for w in attackers(args)) + f"  ({time.perf_counter() - t:.0f}s)", flush=True)
            out.append(records)
    return out


def selected_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of ``--rows`` (name prefixes), with the unprotected and blind references."""
    return [r for r in rows(args.budgets, args.noise)
            if not args.rows or r["strategy"] == "plaintext" and not r.get("masked")
            or any(r["name"].startswith(p) for p in args.rows)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    who_all = attackers(args)
    victims = list(range(args.victims))
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(victims))) as workers:
            per_victim = workers.starmap(victim_records, [(args, v) for v in victims])
    else:
        per_victim = [victim_records(args, v) for v in victims]
    out = []
    for i, row in enumerate(selected_rows(args)):
        summary = []
        for r in rounds_of(row, args.rounds):
            rec = [pv[i][r] for pv in per_victim]
            cell: dict[str, Any] = {"rounds": r, "n": len(rec), "he_ratio": float(np.mean([x["he_ratio"] for x in rec]))}
            for who in who_all:
                cell[who] = {k: float(np.mean([x[who][k] for x in rec])) for k in ("psnr", "ssim", "iip", "seconds")}
                cell[who]["psnr_min"] = float(min(x[who]["psnr"] for x in rec))
            cell["trials"] = rec
            summary.append(cell)
        out.append({"name": row["name"], "strategy": row["strategy"], "ratio": row["ratio"],
                    "options": row["options"].model_dump(exclude_defaults=True), "cells": summary})
    blind = next(r for r in out if r["name"].startswith("blind"))["cells"][0]
    for r in out:
        for c in r["cells"]:
            for who in who_all:
                c[who]["stopped"] = bool(c[who]["psnr"] <= blind[who]["psnr"] + 3.0 and c[who]["iip"] == 0.0)
    return {"rows": out}


def markdown(result: dict[str, Any], rounds: list[int], who: tuple[str, ...], project: str | None) -> str:
    """The table of docs/attacks.md: DLG and/or the project attack, PSNR dB / identified per R."""
    names = {"dlg": "DLG", "project": project}
    head = "| coordinator holds | HE |" + "".join(f" R={r} {names[w]} |" for r in rounds for w in who)
    lines = [head, "|---|---:|" + "---|" * (len(rounds) * len(who))]
    for row in result["rows"]:
        by_r = {c["rounds"]: c for c in row["cells"]}
        if set(by_r) == {1}:  # a reference row (one update) shows under the first column
            by_r = {rounds[0]: by_r[1]}
        cells = ""
        for r in rounds:
            for w in who:
                c = by_r.get(r)
                if c is None:
                    cells += " – |"
                    continue
                text = f"{c[w]['psnr']:.1f} / {c[w]['iip']:.2f}"
                cells += f" **{text}** |" if c[w]["stopped"] else f" {text} |"
        he = row["cells"][0]["he_ratio"]
        lines.append(f"| {row['name']} | {he:.3f} |{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=numbers(int, minimum=1), default="1,16,64",
                        help="numbers of rounds the coordinator combines")
    parser.add_argument("--budgets", type=numbers(int, minimum=1), default="8,32,64",
                        help="encrypted fractions as denominators")
    parser.add_argument("--noise", type=float, default=0.3, help="plain_noise of the hybrid rows")
    parser.add_argument("--victims", type=int, default=2, help="attacked clients (one batch each) per cell")
    parser.add_argument("--jobs", type=int, default=1, help="processes (one victim each at a time)")
    parser.add_argument("--batch", type=int, default=1, help="the batch every round's update is taken on")
    parser.add_argument("--steps", type=int, default=100, help="DLG's L-BFGS steps")
    parser.add_argument("--iterations", type=int, default=600, help="the project attack's iterations")
    parser.add_argument("--project-attack", default="inverting-search",
                        help="the senseshield.attacks image attack run beside DLG, or none")
    parser.add_argument("--no-dlg", action="store_true",
                        help="skip DLG (it does not count on lenet5, where it stalls on unprotected updates)")
    parser.add_argument("--rows", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=[],
                        help="only the rows whose names start with these (e.g. masked,hybrid); "
                             "unprotected and blind always run")
    parser.add_argument("--model", default=DLG_LENET, help="default: the DLG LeNet (lenet5 with --activation sigmoid)")
    parser.add_argument("--activation", default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/rounds-attack.json (rounds-attack-MODEL.json with --model)")
    args = parser.parse_args()
    if not args.rounds or not args.budgets:
        parser.error("--rounds and --budgets need at least one value each, e.g. 1,16,64")
    if args.victims < 1 or args.batch < 1 or not args.noise >= 0:
        parser.error(f"--victims {args.victims}, --batch {args.batch}, --noise {args.noise} are not allowed; "
                     "victims and batch must be >= 1, noise >= 0.")
    if args.project_attack != "none" and (args.project_attack not in ATTACKS
                                          or not ATTACKS.get(args.project_attack).reconstructs_images):
        images = [n for n, a in ATTACKS.items() if a.reconstructs_images]
        parser.error(f"--project-attack {args.project_attack!r} is not allowed; choose one of: {', '.join(images)}, none.")
    if not attackers(args):
        parser.error("--no-dlg with --project-attack none leaves no attack; keep one of them.")
    args.rounds = sorted(set(args.rounds))
    if args.out is None:
        tag = "" if args.model == DLG_LENET else "-" + "-".join(filter(None, (args.model, args.activation)))
        args.out = ROOT / "benchmarks" / "results" / f"rounds-attack{tag}.json"
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    project = None if args.project_attack == "none" else args.project_attack
    log(f"the coordinator over R = {args.rounds} rounds, {model_label(args.model, args.activation)}, B = {args.batch}")
    result: dict[str, Any] = {
        "setting": {"dataset": DATASET, "model": args.model, "activation": args.activation, "batch": args.batch,
                    "victims": args.victims, "rounds": args.rounds, "budgets": args.budgets, "noise": args.noise,
                    "dlg_steps": None if args.no_dlg else args.steps, "project_attack": project, "project_iterations": args.iterations,
                    "same_batch_and_model_every_round": True},
        "machine": machine(),
    }
    result.update(run(args))
    result["seconds"] = time.perf_counter() - started
    print()
    print(markdown(result, args.rounds, attackers(args), project))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
