"""Utility of the leakage-aware selection (issue 16, item 4): SenseCrypt with ``score=taylor``
(its default) and ``score=leakage`` on the README's accuracy setting (digits, MLP, 20 clients,
``categories:4``, SenseCrypt's system-heterogeneity profiles, 10 rounds, seed 0, packed
Paillier), in the same run.

    python benchmarks/bench_leakage_utility.py [--rounds 10] [--key-bits 2048] [--out benchmarks/results/leakage-utility.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from senseshield.job import Job  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield.strategies import StrategyOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/leakage-utility.json")
    args = parser.parse_args()
    rows = []
    for score in ("taylor", "leakage"):
        config = Job(strategy="sensecrypt", scheme="packed-paillier", dataset="digits", model="mlp", clients=20,
                     rounds=args.rounds, partition="categories:4", bandwidth=[50, 45, 40, 35, 30],
                     cpu=[24, 16, 12, 10, 8], key_bits=args.key_bits, options=StrategyOptions(score=score))
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_simulation(config)
        acc = np.array([c.accuracy for c in result.clients])
        rows.append({"score": score, "final_accuracy": result.final_accuracy, "client_accuracy_mean": float(acc.mean()),
                     "client_accuracy_min": float(acc.min()), "clusters": result.num_clusters,
                     "he_ratio_mean": float(np.mean([r.he_ratio_mean for r in result.rounds])),
                     "seconds": time.perf_counter() - t})
        print(json.dumps(rows[-1]), flush=True)
    rows[1]["accuracy_points_vs_taylor"] = 100 * (rows[1]["client_accuracy_mean"] - rows[0]["client_accuracy_mean"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "key_bits": args.key_bits, "rows": rows}, indent=2))
    print(f"leakage vs taylor: {rows[1]['accuracy_points_vs_taylor']:+.2f} points of mean client accuracy")


if __name__ == "__main__":
    main()
