"""What the coordinator recovers from SenseCrypt's union blocks, with and without the k rule.

    python benchmarks/bench_union_leak.py [--rounds 3] [--clients 4] [--out benchmarks/results/union-leak.json]

Runs the real simulator (digits, the MLP, packed Paillier, SenseCrypt's own per-client
masks) and lets ``senseshield_checks.union_leak`` play the coordinator in every cluster
round: from the masks, plaintext parts, sample counts and the published mean it solves each
agent's values at the positions that agent alone encrypted. Reported per setting: the share
of the agents' encrypted values recovered (mean and max over agents and rounds), the share of
union positions left sealed, and the final accuracy. Settings: equal budgets; one agent's
partner at a 1 % budget (declared slow profile); min_encryptors 1 (the papers' rule) vs 2,
and nested masks (``masks=nested``: one cluster ranking, prefixes capped so every block of
the prefixes has two encryptors, plus each agent's own solver mask, whose blocks no other
agent picked are sealed) with min_encryptors 2. ``encrypted_per_round``: values encrypted
per round over all agents (the HE work).
``chance``: the same score for guessing the other agents' plaintext mean (what is left
of the attack when the encryptor's value is not in the mean).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from senseshield.job import Job  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield_checks.union_leak import Tally  # noqa: E402

SETTINGS = {
    "equal budgets": {},
    "one slow partner": {"cpu": [8.0, 8.0, 8.0, 0.08], "bandwidth": [100.0, 100.0, 100.0, 1.0]},
}


def one(name: str, extra: dict, k: int, rounds: int, clients: int, partition: str, masks: str = "solver") -> dict:
    tally = Tally()

    job = Job(strategy="sensecrypt", dataset="digits", model="mlp", clients=clients, rounds=rounds, seed=1,
              partition=partition, options={"min_encryptors": k, "masks": masks}, **extra)
    result = run_simulation(job, noise_seed=1, observe=tally.observe)
    sealed = [rec.sealed_positions for rec in result.rounds]
    enc = max(1, tally.encrypted)
    return {"setting": name, "partition": partition, "min_encryptors": k, "masks": masks,
            "encrypted_per_round": tally.encrypted / rounds, "he_ratio_mean": float(np.mean([rec.he_ratio_mean for rec in result.rounds])),
            "alone_share_of_encrypted": tally.alone / enc,
            "recovered_share_of_encrypted": tally.recovered / enc,
            "chance_share_of_encrypted": tally.chance / enc,
            "sealed_positions_per_round": float(np.mean(sealed)), "accuracy": float(result.final_accuracy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--partition", default="iid")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/union-leak.json"))
    a = ap.parse_args()
    rows = []
    for name, extra in SETTINGS.items():
        for k, masks in ((1, "solver"), (2, "solver"), (2, "nested")):
            row = one(name, extra, k, a.rounds, a.clients, a.partition, masks)
            rows.append(row)
            print(f"{name:18s} k={k} {masks:6s}: {row['encrypted_per_round']:.0f} values encrypted/round; {row['alone_share_of_encrypted']:.1%} of encrypted values in single-encryptor "
                  f"positions; recovered {row['recovered_share_of_encrypted']:.1%} (chance: "
                  f"{row['chance_share_of_encrypted']:.1%}); sealed {row['sealed_positions_per_round']:.0f} "
                  f"positions/round; accuracy {row['accuracy']:.4f}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
