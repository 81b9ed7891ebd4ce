"""The honest cost of the device's own floor under nested masks, and what it saves.

    python benchmarks/bench_nested_floor.py [--rounds 3] [--clients 4] [--out benchmarks/results/nested-floor.json]

Runs the real simulator (digits, the MLP, packed Paillier, SenseCrypt with ``masks=nested``,
min_encryptors 2) with and without the device's floor (each device encrypts the coordinator's
nested prefix UNION its own top blocks, the mask its own solver picks at its budget,
``engine.masks.with_own_blocks``; "without" replays the old behaviour, the prefix alone, by
patching that function out), under
an honest coordinator (equal budgets; one partner at a 1 % budget) and a hostile one (every
device's nested mask is the cluster ranking's least sensitive 5 % of blocks). Reported per
setting: values encrypted per round over all devices, sealed positions per round, blocks the
floor added per round, the share of each device's own round sensitivity its mask covers (mean
and min over device rounds), the share of the blocks its own solver picks (``masks=solver``)
that it encrypts (min over device rounds),
the union-block attacker's recoveries against its chance baseline (``senseshield_checks.union_leak``), and the final accuracy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import senseshield.strategies.sensecrypt as sc  # noqa: E402
from senseshield.engine.masks import block_scores, expand_block_mask  # noqa: E402
from senseshield.job import Job  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield_checks.union_leak import Tally  # noqa: E402

SETTINGS = {
    "equal budgets": {},
    "one slow partner": {"cpu": [8.0, 8.0, 8.0, 0.08], "bandwidth": [100.0, 100.0, 100.0, 1.0]},
}


def one(name: str, extra: dict, *, floor: bool, hostile: bool, rounds: int, clients: int) -> dict:
    tally = Tally()
    seen: list[tuple[float, float, int]] = []  # (own sensitivity covered, own top blocks covered, blocks added)
    original_union, original_plan, original_select = sc.with_own_blocks, sc.SenseCrypt.planned_mask, sc.SenseCrypt.select_mask

    def select(self, context, *, sensitivity, weights):  # noqa: ANN001, ANN202
        choice = original_select(self, context, sensitivity=sensitivity, weights=weights)
        g = np.abs(np.asarray(sensitivity, dtype=np.float64))
        solver = sc.SenseCrypt(self.options.model_copy(update={"masks": "solver"}))
        own = original_select(solver, context, sensitivity=sensitivity, weights=weights).mask
        seen.append((float(np.dot(g, choice.mask) / g.sum()) if g.sum() else 1.0,
                     float(choice.mask[own].mean()) if own.any() else 1.0,
                     int(choice.info.get("own_blocks_added", [0])[0])))
        return choice

    def least_sensitive(self, plan, client_id, members, *, size, block_size=1):  # noqa: ANN001, ANN202
        per_block = block_scores(plan.rankings[plan.cluster_of[client_id]], block_size=block_size)
        worst = np.argsort(per_block, kind="stable")[: max(1, int(0.05 * per_block.size))]
        return expand_block_mask(np.isin(np.arange(per_block.size), worst), block_size=block_size, n=size)

    try:
        sc.SenseCrypt.select_mask = select
        if not floor:
            sc.with_own_blocks = lambda mask, own, scores, **_: (np.asarray(mask, dtype=bool).copy(), 0)
        if hostile:
            sc.SenseCrypt.planned_mask = least_sensitive
        job = Job(strategy="sensecrypt", dataset="digits", model="mlp", clients=clients, rounds=rounds, seed=1,
                  partition="iid", options={"min_encryptors": 2, "masks": "nested"}, **extra)
        result = run_simulation(job, noise_seed=1, observe=tally.observe)
    finally:
        sc.with_own_blocks, sc.SenseCrypt.planned_mask, sc.SenseCrypt.select_mask = original_union, original_plan, original_select
    covered = np.array([s[0] for s in seen])
    top = np.array([s[1] for s in seen])
    return {"setting": name, "coordinator": "hostile (least sensitive 5 %)" if hostile else "honest",
            "floor": floor, "encrypted_per_round": tally.encrypted / rounds,
            "sealed_positions_per_round": float(np.mean([rec.sealed_positions for rec in result.rounds])),
            "blocks_added_per_round": sum(s[2] for s in seen) / rounds,
            "own_sensitivity_covered_mean": float(covered.mean()), "own_sensitivity_covered_min": float(covered.min()),
            "own_solver_blocks_encrypted_min": float(top.min()),
            "recovered_share_of_encrypted": tally.recovered / max(1, tally.encrypted),
            "chance_share_of_encrypted": tally.chance / max(1, tally.encrypted),
            "accuracy": float(result.final_accuracy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/nested-floor.json"))
    a = ap.parse_args()
    rows = []
    for name, extra in SETTINGS.items():
        for hostile in (False, True):
            for floor in (False, True):
                row = one(name, extra, floor=floor, hostile=hostile, rounds=a.rounds, clients=a.clients)
                rows.append(row)
                print(f"{name:16s} {row['coordinator']:28s} floor={'on ' if floor else 'off'}: "
                      f"{row['encrypted_per_round']:.0f} values encrypted/round, sealed {row['sealed_positions_per_round']:.0f}/round, "
                      f"{row['blocks_added_per_round']:.0f} blocks added/round; own sensitivity covered "
                      f"{row['own_sensitivity_covered_mean']:.3f} (min {row['own_sensitivity_covered_min']:.3f}), own solver blocks "
                      f"encrypted min {row['own_solver_blocks_encrypted_min']:.3f}; recovered {row['recovered_share_of_encrypted']:.1%} "
                      f"(chance {row['chance_share_of_encrypted']:.1%}); "
                      f"accuracy {row['accuracy']:.4f}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rounds": a.rounds,
                                 "clients": a.clients, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
