"""Utility of the leakage-aware selection (issue 16, item 4): SenseCrypt with ``score=taylor``
(its default) and ``score=leakage`` on docs/results.md's accuracy setting (digits, MLP, 20 clients,
``categories:4``, SenseCrypt's system-heterogeneity profiles, 10 rounds, seed 0, packed
Paillier), in the same run; ``--noises`` adds the hybrid (``score=leakage`` with
``plain_noise`` = each ratio: noise on the plaintext part).

    python benchmarks/bench_leakage_utility.py [--rounds 10] [--key-bits 2048] [--noises 0.3,1]
        [--dataset digits --model mlp --clients 20 --partition categories:4]
        [--out benchmarks/results/leakage-utility.json]
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from arglists import numbers  # noqa: E402
from senseshield.job import Job  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield.strategies import StrategyOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--partition", default="categories:4")
    parser.add_argument("--cpus", type=numbers(float, minimum=0), default="24,16,12,10,8",
                        help="the clients' CPU counts, cycled (bench_attacks' slow fleet: 32,24,16,12,10,8,4,2,1,1)")
    parser.add_argument("--noises", type=numbers(float, minimum=0), default="", help="plain_noise ratios of hybrid rows, e.g. 0.3,1")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/leakage-utility.json")
    args = parser.parse_args()
    noises, cpus = args.noises, args.cpus
    rows = []
    for score, noise in [("taylor", 0.0), ("leakage", 0.0), *(("leakage", n) for n in noises)]:
        config = Job(strategy="sensecrypt", scheme="packed-paillier", dataset=args.dataset, model=args.model,
                     clients=args.clients, rounds=args.rounds, partition=args.partition,
                     bandwidth=[50, 45, 40, 35, 30], cpu=cpus, key_bits=args.key_bits,
                     options=StrategyOptions(score=score, plain_noise=noise))
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_simulation(config)
        acc = np.array([c.accuracy for c in result.clients])
        rows.append({"score": score, "plain_noise": noise, "final_accuracy": result.final_accuracy, "client_accuracy_mean": float(acc.mean()),
                     "client_accuracy_min": float(acc.min()), "clusters": result.num_clusters,
                     "he_ratio_mean": float(np.mean([r.he_ratio_mean for r in result.rounds])),
                     "seconds": time.perf_counter() - t})
        print(json.dumps(rows[-1]), flush=True)
    for row in rows[1:]:
        row["accuracy_points_vs_taylor"] = 100 * (row["client_accuracy_mean"] - rows[0]["client_accuracy_mean"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "key_bits": args.key_bits, "dataset": args.dataset,
                                        "model": args.model, "clients": args.clients, "partition": args.partition, "cpus": cpus,
                                        "rows": rows}, indent=2))
    for row in rows[1:]:
        print(f"leakage, plain_noise {row['plain_noise']:g} vs taylor: {row['accuracy_points_vs_taylor']:+.2f} "
              "points of mean client accuracy")


if __name__ == "__main__":
    main()
