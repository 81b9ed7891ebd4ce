"""Distributed DP on masked sums (masked-dp, issue 22 item 7) measured in the simulator.

    .venv/bin/python benchmarks/bench_masked_dp.py [--clients 20] [--rounds 3] [--repeats 4]
        [--epsilons 1,4,8] [--seeds 3,4] [--out benchmarks/results/masked-dp.json]

1. Round time: the MLP (50,826 parameters) on digits, ``--clients`` clients, ``--rounds``
   rounds, plaintext vs masked vs masked-dp (sigma 1, clip 0.3), runs alternated
   ``--repeats`` times; per strategy the median round's wall seconds (training and evaluation
   included, as a round costs), and the seconds per round of the protection phases (mask +
   noise + encrypt + aggregate + decrypt; the noise phase alone beside it), the whole run's
   CPU seconds, and one device's noise step on the MLP's update (fastest of 30: the machine
   is shared, and a round's wall time moves with the neighbours' load).
2. Accuracy at a target epsilon: masked-dp and dp-fedavg calibrated (Opacus RDP, delta 1e-5,
   q = 1) to each of ``--epsilons`` over the run, the same clip 0.3; final accuracy, mean over
   ``--seeds`` (device-noise seeds); masked (no DP) beside them. Epsilon against the key
   server (and the coordinator) and against readers of the published model, and the figure
   if the key server colluded with the coordinator (each update seen with its own share,
   sigma / sqrt(m)). One row at q = 0.5 shows the readers' sampling amplification, which the
   key server, knowing who contributed, does not give.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arglists import numbers  # noqa: E402
from bench_attacks import machine  # noqa: E402
import numpy as np  # noqa: E402

from senseshield.accounting import Accountant  # noqa: E402
from senseshield.engine.csprng import ChaChaGenerator  # noqa: E402
from senseshield.engine.dp import distributed_noise  # noqa: E402
from senseshield.job import Job  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402
from senseshield.strategies import StrategyOptions  # noqa: E402

CLIP = 0.3
DELTA = 1e-5
PROTECT = ("mask", "noise", "encrypt", "aggregate", "decrypt")


def _job(strategy: str, clients: int, rounds: int, **options: Any) -> Job:
    return Job(strategy=strategy, model="mlp", dataset="digits", clients=clients, rounds=rounds,
               options=StrategyOptions(clip=CLIP, delta=DELTA, **options))


def round_times(clients: int, rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list] = {s: [] for s in ("plaintext", "masked", "masked-dp")}
    cpu: dict[str, list[float]] = {s: [] for s in runs}
    for rep in range(repeats):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for strategy in order:
            t = time.process_time()
            result = run_simulation(_job(strategy, clients, rounds, sigma=1.0), noise_seed=rep)
            cpu[strategy].append(time.process_time() - t)
            runs[strategy].extend(result.rounds)
    out = {}
    for strategy, records in runs.items():
        out[strategy] = {
            "round_s": statistics.median(r.seconds for r in records),
            "protect_s": statistics.median(sum(r.phase_seconds[p] for p in PROTECT) for r in records),
            "noise_s": statistics.median(r.phase_seconds["noise"] for r in records),
            "run_cpu_s": min(cpu[strategy]),  # the whole run (bootstrap, rounds, evaluation), least of the repeats
            "rounds": len(records),
        }
    return out


def noise_step(size: int, clients: int, repeats: int = 30) -> float:
    """Seconds one device spends on its noise share (clip + ChaCha20 Gaussian draws) for a
    ``size``-parameter update, the fastest of ``repeats`` (the machine is shared)."""
    update = np.random.default_rng(0).normal(0.0, 0.01, size)
    best = math.inf
    for _ in range(repeats):
        rng = ChaChaGenerator.fresh()
        t = time.perf_counter()
        distributed_noise(update, clip=CLIP, sigma=1.0, shares=clients, rng=rng)
        best = min(best, time.perf_counter() - t)
    return best


def collusion_epsilon(sigma: float, shares: int, rounds: int) -> float:
    """Epsilon if the key server and the coordinator collude: each update unmasked alone,
    carrying its own share (sigma / sqrt(shares)), one release per round (q = 1)."""
    acc = Accountant()
    acc.step(noise_multiplier=sigma / math.sqrt(shares), sample_rate=1.0, steps=rounds)
    return acc.epsilon(DELTA)


def accuracy(clients: int, rounds: int, epsilons: list[float], seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    settings = [(e, 1.0) for e in epsilons] + [(epsilons[len(epsilons) // 2], 0.5)]
    for strategy in ("masked",):
        accs = [run_simulation(_job(strategy, clients, rounds), noise_seed=s).final_accuracy for s in seeds]
        rows.append({"strategy": strategy, "target_epsilon": None, "sample_rate": 1.0, "accuracy": statistics.mean(accs)})
    for target, q in settings:
        for strategy in ("masked-dp", "dp-fedavg"):
            results = [run_simulation(_job(strategy, clients, rounds, target_epsilon=target, sample_rate=q), noise_seed=s)
                       for s in seeds]
            first = results[0]
            row = {"strategy": strategy, "target_epsilon": target, "sample_rate": q,
                   "accuracy": statistics.mean(r.final_accuracy for r in results),
                   "sigma": first.noise_multiplier, "epsilon_readers": first.epsilon,
                   "epsilon_key_server": first.epsilon_server, "server_rounds": first.server_rounds}
            if strategy == "masked-dp" and q == 1.0:
                row["epsilon_if_collusion"] = collusion_epsilon(first.noise_multiplier, clients, rounds)
            rows.append(row)
            print(f"  {strategy:9s} target eps {target:g} q {q:g}: sigma {row['sigma']:.2f}, accuracy {row['accuracy']:.3f}, "
                  f"eps readers {row['epsilon_readers']:.2f}, key server {row['epsilon_key_server']:.2f}"
                  + (f", if key server + coordinator collude {row['epsilon_if_collusion']:.0f}"
                     if "epsilon_if_collusion" in row else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--epsilons", type=numbers(float, minimum=0.01), default="1,4,8")
    parser.add_argument("--seeds", type=numbers(int, minimum=0), default="3,4")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "masked-dp.json")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)  # Opacus: "optimal order is the largest alpha" at q < 1
    started = time.time()
    print(f"round time: MLP on digits, {args.clients} clients, {args.rounds} rounds x {args.repeats} alternated runs")
    times = round_times(args.clients, args.rounds, args.repeats)
    base = times["plaintext"]["round_s"]
    for strategy, row in times.items():
        print(f"  {strategy:9s} round {row['round_s']:.3f} s ({row['round_s'] / base:.2f}x plaintext); protection "
              f"phases {row['protect_s']:.3f} s, of which noise {row['noise_s']:.3f} s "
              f"({1e3 * row['noise_s'] / args.clients:.1f} ms per client); whole run {row['run_cpu_s']:.1f} CPU s", flush=True)
    noise_s = noise_step(50_826, args.clients)
    print(f"  one device's noise share on the MLP's 50,826 parameters: {1e3 * noise_s:.2f} ms (fastest of 30)", flush=True)
    print(f"accuracy: MLP on digits, {args.clients} clients, {args.rounds} rounds, clip {CLIP}, delta {DELTA:g}, "
          f"seeds {args.seeds}")
    rows = accuracy(args.clients, args.rounds, args.epsilons, args.seeds)
    print(f"  masked (no DP): accuracy {rows[0]['accuracy']:.3f}")
    result = {"machine": machine(), "clients": args.clients, "rounds": args.rounds, "clip": CLIP, "delta": DELTA,
              "seeds": args.seeds, "round_times": times, "noise_share_s": noise_s, "accuracy": rows, "seconds": time.time() - started}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
