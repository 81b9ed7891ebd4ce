"""The masked scheme measured (issue 22): parameters per second at each step, bytes per parameter.

    .venv/bin/python benchmarks/bench_masked.py [--sizes 50826,1000000] [--rings 32,64] [--contributors 6]
        [--repeats 7] [--out benchmarks/results/masked.json]

Each size is measured in each ring (``ring_bits``: 32, 4 bytes per parameter, values in
[-1, 1]; 64, 8 bytes); the updates are N(0, 0.01), inside both rings' range.

One core (numpy and OpenSSL single-threaded). For each model size: an agent masks its
update (pads from ChaCha20 + fixed-point encoding, ``encrypt``), the coordinator folds
``--contributors`` masked updates into its running sum (``accumulator.add``, weighted), the
key server removes their pads (``decrypt``, which regenerates every contributor's pads).
Figures: parameters per second per step (the key server's per contributor), and end to end
for one contribution (mask + fold + unmask of one contributor): ``size / (t_mask + t_fold +
t_unmask / contributors)``; best of ``--repeats``. Bytes per parameter on the wire: masked
and 2048-bit packed Paillier (the MLP's full update; per-value Paillier is 512).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arglists import numbers  # noqa: E402
from bench_attacks import machine  # noqa: E402
from bench_trust import _best as best  # noqa: E402  (the fastest of n calls)
from senseshield.he import generate_keys  # noqa: E402
from senseshield.he.base import CipherPart, round_context  # noqa: E402
from senseshield.runtime.identity import Identity  # noqa: E402


def measure(size: int, contributors: int, repeats: int, ring_bits: int = 64) -> dict[str, Any]:
    secret = generate_keys("masked")
    public = secret.public_key
    agents = [Identity.generate(f"c{i:03d}") for i in range(contributors)]
    context = round_context("bench", "job", 1, 0)
    rng = np.random.default_rng(0)
    positions = np.arange(size)
    updates = [rng.normal(0, 0.01, size) for _ in range(contributors)]
    keys = [public.for_contributor(a.exchange, context, ring_bits=ring_bits) for a in agents]
    t_mask = best(lambda: keys[0].encrypt(updates[0], positions), repeats)
    vectors = [k.encrypt(u, positions) for k, u in zip(keys, updates)]
    weights = [100 + i for i in range(contributors)]

    def fold() -> Any:
        acc = public.accumulator(size)
        for v, w in zip(vectors, weights):
            acc.add(CipherPart(v, w))
        return acc.result(positions)

    t_fold = best(fold, repeats) / contributors
    aggregate = fold()
    secret.bind_contributions(aggregate, [(a.box_key, w) for a, w in zip(agents, weights)], context)
    t_unmask = best(lambda: secret.decrypt(aggregate), repeats)
    got = secret.decrypt(aggregate)
    expected = sum(w * u for w, u in zip(weights, updates))
    wire = len(public.ciphertext_bytes(vectors[0]))
    return {
        "size": size, "ring_bits": ring_bits, "contributors": contributors,
        "mask_params_per_s": size / t_mask,
        "fold_params_per_s": size / t_fold,
        "unmask_params_per_s_per_contributor": size * contributors / t_unmask,
        "end_to_end_params_per_s": size / (t_mask + t_fold + t_unmask / contributors),
        "bytes_per_param": wire / size,
        "max_error": float(np.max(np.abs(got - expected))),
    }


def packed_bytes_per_param(size: int) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        public = generate_keys("packed-paillier", key_bits=2048).public_key
    vector = public.encrypt(np.random.default_rng(0).uniform(-0.1, 0.1, size), np.arange(size))
    return len(public.ciphertext_bytes(vector)) / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=numbers(int, minimum=1), default="50826,1000000")
    parser.add_argument("--rings", type=numbers(int, minimum=32), default="32,64")
    parser.add_argument("--contributors", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "masked.json")
    args = parser.parse_args()
    rows = []
    for size, bits in [(size, bits) for size in args.sizes for bits in args.rings]:
        row = measure(size, args.contributors, args.repeats, bits)
        rows.append(row)
        print(f"{size:>9,d} params, {bits}-bit ring: mask {row['mask_params_per_s'] / 1e6:6.1f} M/s, "
              f"fold {row['fold_params_per_s'] / 1e6:6.1f} M/s, "
              f"unmask {row['unmask_params_per_s_per_contributor'] / 1e6:6.1f} M/s per contributor, end to end "
              f"{row['end_to_end_params_per_s'] / 1e6:6.1f} M/s; {row['bytes_per_param']:.3f} B/param; "
              f"max error {row['max_error']:.1e}", flush=True)
    packed = packed_bytes_per_param(50_826)
    print(f"packed Paillier (2048-bit, MLP update): {packed:.2f} B/param")
    result = {"machine": machine(), "rows": rows, "packed_paillier_bytes_per_param": packed}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
