"""Foundation benchmarks: mask solver, sensitivity cost, accuracy of the strategies.

    .venv/bin/python benchmarks/bench_foundation.py [--sections masks,sensitivity,accuracy]
                                                    [--rounds 10] [--out FILE.json]

* ``masks``: the SenseCrypt mask solver on 1,000,000 parameters, one core (``taskset -c 0``
  when available), median ms, against ``np.argsort`` of the same vector in the same run.
* ``sensitivity``: cost of each sensitivity score relative to one forward+backward pass
  over the same samples, per model (digits, 256 samples, median of 7).
* ``accuracy``: digits, 20 clients, ``categories:4``, the SenseCrypt system-heterogeneity
  profiles (50..30 MB/s, 24..8 CPUs per category), every strategy; per-client accuracy on
  each client's own test split, HE ratio, bytes and seconds per round. HE strategies run on
  the packed Paillier scheme (2048-bit key): per-value ``phe`` at 2048 bits costs ~8 ms per
  parameter here, ~30 min per round for SenseCrypt on the 50k-parameter MLP. Per-value
  aggregation is exact to 2^-40, so accuracies on per-value Paillier equal plaintext FedAvg
  with the same masks (tested); its time per round is extrapolated from its measured rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from senseshield.bench.machine import cpu_model  # noqa: E402


def machine() -> dict:
    model = cpu_model("unknown")
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def bench_masks() -> dict:
    """Run bench_masks on one core in a child process (single-threaded BLAS)."""
    code = (
        "import json, bench_masks; print(json.dumps(bench_masks.benchmark_solver()))"
    )
    cmd = [sys.executable, "-c", code]
    if _has_taskset():
        cmd = ["taskset", "-c", "0", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{ROOT / 'benchmarks'}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def bench_sensitivity(repeats: int = 25) -> list[dict]:
    import torch

    from senseshield.data import load_dataset
    from senseshield.engine.sensitivity import SCORES
    from senseshield.models import build_model
    from senseshield.training import get_vector, score_inputs

    ds = load_dataset("digits")
    x, y = ds.x[:256], ds.y[:256]
    rows = []
    for name in ("linear", "mlp", "simplecnn", "lenet5"):
        torch.manual_seed(0)
        model = build_model(name, ds.input_shape, ds.num_classes)
        xt, yt = torch.as_tensor(x), torch.as_tensor(y)

        def backward() -> None:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(xt), yt).backward()

        delta = np.zeros(get_vector(model).size)

        def score(score_name: str):
            s = SCORES.get(score_name)
            return lambda: s(score_inputs(model, x, y, needs=s.needs, delta=delta))

        t_back = _median(backward, repeats)
        row = {"model": name, "params": int(delta.size), "backward_ms": t_back * 1e3}
        for score_name in ("taylor", "grad_delta", "fisher"):
            t = _median(score(score_name), repeats)
            row[f"{score_name}_ms"] = t * 1e3
            row[f"{score_name}_vs_backward"] = t / t_back
        rows.append(row)
    return rows


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def phe_rate(key_bits: int = 2048, count: int = 200) -> float:
    """Measured per-value Paillier (stock phe) encryptions per second."""
    from senseshield.he import generate_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pk = generate_keys("paillier", key_bits=key_bits).public_key
    values = np.random.default_rng(0).normal(size=count) * 0.01
    t = time.perf_counter()
    pk.encrypt(values, np.arange(count))
    return count / (time.perf_counter() - t)


def bench_accuracy(rounds: int) -> dict:
    from senseshield.job import Job
    from senseshield.simulation import run_simulation
    from senseshield.strategies import StrategyOptions

    runs = [
        ("plaintext", None),
        ("paillier-full", "packed-paillier"),
        ("maskcrypt", "packed-paillier"),
        ("fedml-he", "packed-paillier"),
        ("sensecrypt", "packed-paillier"),
    ]
    rate = phe_rate()
    rows = []
    for strategy, scheme in runs:
        config = Job(
            strategy=strategy,
            scheme=scheme,
            dataset="digits",
            model="mlp",
            clients=20,
            rounds=rounds,
            partition="categories:4",
            bandwidth=[50, 45, 40, 35, 30],
            cpu=[24, 16, 12, 10, 8],
            options=StrategyOptions(he_ratio=0.1),
        )
        print(f"  running {strategy} ...", file=sys.stderr, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_simulation(config)
        acc = np.array([c.accuracy for c in result.clients])
        he = float(np.mean([r.he_ratio_mean for r in result.rounds]))
        rows.append(
            {
                "strategy": strategy,
                "scheme": scheme,
                "final_accuracy": result.final_accuracy,
                "client_accuracy_mean": float(acc.mean()),
                "client_accuracy_min": float(acc.min()),
                "client_accuracy_max": float(acc.max()),
                "accuracy_by_round": [r.accuracy for r in result.rounds],
                "clusters": result.num_clusters,
                "cluster_ari": result.cluster_ari,
                "he_ratio_mean": he,
                "union_ratio_mean": float(np.mean([r.union_ratio_mean for r in result.rounds])),
                "mb_up_per_round": float(np.mean([r.bytes_up for r in result.rounds]) / 1e6),
                "mb_down_per_round": float(np.mean([r.bytes_down for r in result.rounds]) / 1e6),
                "seconds_per_round": float(np.mean([r.seconds for r in result.rounds])),
                "encrypt_seconds_per_round": float(
                    np.mean([r.phase_seconds["encrypt"] for r in result.rounds])
                ),
                "per_value_phe_encrypt_seconds_per_round_extrapolated": he
                * result.num_params
                * len(result.clients)
                / rate,
                "per_value_phe_mb_up_per_round": he * result.num_params * len(result.clients) * 512 / 1e6,
            }
        )
    return {"phe_encryptions_per_s_2048": rate, "rounds": rounds, "runs": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="masks,sensitivity,accuracy")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/foundation.json")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    report: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    if "masks" in sections:
        print("mask solver ...", file=sys.stderr, flush=True)
        report["masks"] = bench_masks()
    if "sensitivity" in sections:
        print("sensitivity ...", file=sys.stderr, flush=True)
        report["sensitivity"] = bench_sensitivity()
    if "accuracy" in sections:
        print("accuracy ...", file=sys.stderr, flush=True)
        report["accuracy"] = bench_accuracy(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
