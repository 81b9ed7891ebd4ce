"""Issue 24 measured: can the coordinator replay a device's noise, and what do secret draws cost?

    .venv/bin/python benchmarks/bench_noise_replay.py [--trials 5] [--repeats 30] [--out FILE]

* ``replay``: for each noisy strategy, one device's round on the digits MLP (50,826
  parameters) through the agent's calls, then the coordinator's replay
  (``senseshield_checks.replay``): the draws devices made before issue 24 subtracted from
  what the device sent. ``before``: the device drew them (the old code path); ``after``: the
  device drew from ``DeviceNoise()`` (ChaCha20 keyed from the OS CSPRNG). Figure: relative
  replay error |recovered - clean| / |sent - clean| (1e-8: the noise came off; about 1.41:
  the attacker subtracted someone else's noise), over ``--trials`` devices (indices).
  DP-SGD: the same with Opacus' noise regenerated from its generators, on updates that are
  all noise (gradients clipped to 1e-8, noise std 1) so the clean part is known.
* ``cost``: the time to draw one round's noise for the MLP (50,826 normals), NumPy's PCG64
  seeded from the job vs a fresh ChaCha20 generator, and ``protect_local`` of a dp-fedavg
  round with each source, alternated, ``--repeats`` times each (wall and CPU seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_attacks import machine  # noqa: E402
from senseshield.data import load_dataset  # noqa: E402
from senseshield.data.shards import LocalData  # noqa: E402
from senseshield.device_noise import DeviceNoise  # noqa: E402
from senseshield.engine.csprng import ChaChaGenerator  # noqa: E402
from senseshield.he import generate_keys  # noqa: E402
from senseshield.models import build_model  # noqa: E402
from senseshield.rounds import ClientState, local_update, protect_local  # noqa: E402
from senseshield.strategies import ClientContext, StrategyOptions, build_strategy  # noqa: E402
from senseshield.training import TrainConfig, get_vector  # noqa: E402
from senseshield_checks.replay import (  # noqa: E402
    device_round, dpsgd_noise_delta, old_dpsgd_generators, old_protect_draws,
)

SEED, ROUND = 0, 3
STRATEGIES = {  # name: (strategy, options, scheme)
    "dp-fedavg (sigma 1)": ("dp-fedavg", {"sigma": 1.0, "clip": 0.05}, None),
    "selective-dp (sigma 0.8)": ("selective-dp", {"sigma": 0.8, "clip": 0.05}, None),
    "selectiveshield noise zone (sigma 1)": ("selectiveshield", {"tau": 0.3, "rho": 0.5, "sigma": 1.0, "clip": 0.05}, "ckks-sum"),
    "sensecrypt hybrid (plain_noise 0.3)": ("sensecrypt", {"score": "leakage", "plain_noise": 0.3}, "paillier"),
}


def _data(index: int) -> LocalData:
    dataset = load_dataset("digits", seed=SEED)
    rows, test = slice(100 * index, 100 * index + 100), slice(-50, None)
    return LocalData(dataset.x[rows], dataset.y[rows], dataset.x[test], dataset.y[test])


def replay(trials: int) -> list[dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys = {"ckks-sum": generate_keys("ckks-sum").public_key,
                "paillier": generate_keys("paillier", key_bits=1024).public_key}
    train = TrainConfig(epochs=1, batch_size=16, lr=0.1)
    rows = []
    for label, (name, options, scheme) in STRATEGIES.items():
        errors: dict[str, list[float]] = {"before": [], "after": []}
        for index in range(trials):
            for when in ("before", "after"):
                rng = (old_protect_draws(SEED, ROUND, index) if when == "before"
                       else DeviceNoise().generator("protect", round=ROUND, index=index))
                torch.manual_seed(0)
                run = device_round(build_strategy(name, StrategyOptions(**options)), build_model("mlp", (1, 8, 8), 10),
                                   _data(index), keys[scheme] if scheme else None, seed=SEED, round=ROUND,
                                   index=index, rng=rng, train=train)
                errors[when].append(run.replay(old_protect_draws(SEED, ROUND, index)).relative_error)
        rows.append({"strategy": label, **{k: [min(v), max(v)] for k, v in errors.items()}})
        print(f"{label:40s} before {min(errors['before']):.1e}..{max(errors['before']):.1e}   "
              f"after {min(errors['after']):.3f}..{max(errors['after']):.3f}", flush=True)
    rows.append(_dpsgd(trials))
    return rows


def _dpsgd(trials: int) -> dict[str, Any]:
    """DP-SGD on updates that are all noise: clip 1e-8, sigma 1e8 (noise std 1)."""
    errors: dict[str, list[float]] = {"before": [], "after": []}
    strategy = build_strategy("dpsgd", StrategyOptions(sigma=1e8, clip=1e-8))
    shape = {"batch_size": 16, "lr": 0.1, "std": 1.0}

    class Old(DeviceNoise):
        def torch_generators(self, purpose, *, round, index, count=2):  # noqa: ANN001, ANN201
            return old_dpsgd_generators(SEED, round, index)

    for index in range(trials):
        data = _data(index)
        for when, noise in (("before", Old()), ("after", DeviceNoise())):
            torch.manual_seed(0)
            model = build_model("mlp", (1, 8, 8), 10)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                local = local_update(strategy, model, get_vector(model).astype(np.float64), data,
                                     train=TrainConfig(epochs=1, batch_size=16, lr=0.1),
                                     seed=0, round=ROUND, state=ClientState(), noise=noise, index=index)
            sampling, gaussian = old_dpsgd_generators(SEED, ROUND, index)
            replayed = dpsgd_noise_delta(model, n=data.n_train, **shape, sampling=sampling, noise=gaussian)
            # the update is noise (the clean part is below 1e-7 of it): recovered = update - replay
            errors[when].append(float(np.linalg.norm(local.delta - replayed) / np.linalg.norm(local.delta)))
    print(f"{'dpsgd (Opacus, all-noise update)':40s} before {min(errors['before']):.1e}..{max(errors['before']):.1e}   "
          f"after {min(errors['after']):.3f}..{max(errors['after']):.3f}", flush=True)
    return {"strategy": "dpsgd (Opacus, all-noise update)", **{k: [min(v), max(v)] for k, v in errors.items()}}


def _timed(fn) -> tuple[float, float]:  # noqa: ANN001
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def cost(repeats: int) -> dict[str, Any]:
    size = 50_826
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    strategy = build_strategy("dp-fedavg", StrategyOptions(sigma=1.0, clip=0.05))
    local = local_update(strategy, model, get_vector(model).astype(np.float64), _data(0),
                         train=TrainConfig(epochs=1, batch_size=16, lr=0.1), seed=0, round=1, state=ClientState())
    context = ClientContext("c000", 1, 0, 0.0, None, 1, participants=4, noise_multiplier=1.0)
    sources = {
        "numpy PCG64 from the job seed (old)": lambda: np.random.default_rng([SEED, 3, 1, 0]),
        "ChaCha20 keyed from the OS CSPRNG (new)": ChaChaGenerator.fresh,
    }
    draws: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
    rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
    for _ in range(repeats):  # alternated
        for name, make in sources.items():
            draws[name].append(_timed(lambda: make().standard_normal(size)))
            rounds[name].append(_timed(lambda: protect_local(strategy, context, local, None, n_samples=100, rng=make())))
    train = [_timed(lambda: local_update(strategy, model, get_vector(model).astype(np.float64), _data(0),
                                         train=TrainConfig(epochs=1, batch_size=16, lr=0.1), seed=0, round=1,
                                         state=ClientState())) for _ in range(5)]
    out: dict[str, Any] = {"parameters": size, "repeats": repeats,
                           "local_update_ms": float(np.median([t[0] for t in train]) * 1e3)}
    print(f"context: local_update (1 epoch, 100 samples) {out['local_update_ms']:.1f} ms")
    for name in sources:
        d, r = np.array(draws[name]), np.array(rounds[name])
        out[name] = {"draw_ms": float(np.median(d[:, 0]) * 1e3), "draw_cpu_ms": float(np.median(d[:, 1]) * 1e3),
                     "protect_ms": float(np.median(r[:, 0]) * 1e3), "protect_cpu_ms": float(np.median(r[:, 1]) * 1e3)}
        print(f"{name:42s} draw {out[name]['draw_ms']:.2f} ms (cpu {out[name]['draw_cpu_ms']:.2f})   "
              f"protect_local {out[name]['protect_ms']:.2f} ms (cpu {out[name]['protect_cpu_ms']:.2f})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="Devices (indices) per strategy.")
    parser.add_argument("--repeats", type=int, default=30, help="Alternated timing repeats.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "noise-replay.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"machine": machine(), "replay": replay(args.trials), "cost": cost(args.repeats)}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
