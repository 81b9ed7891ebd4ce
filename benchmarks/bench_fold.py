"""The coordinator's fold of packed-Paillier updates: the sample weight as an exponent at the
coordinator (before) vs folded in by the encryptor (issue 22 item 5).

    python benchmarks/bench_fold.py [--updates 12] [--repeats 5] [--key-bits 2048]
        [--out benchmarks/results/fold.json]

The MLP (50,826 parameters), half of it encrypted (whole blocks), sample weights 400-500 as
digits devices have; each repeat folds the same updates both ways, alternated, into a
running aggregate (``StreamingAggregate``, what the coordinator does as updates arrive),
with wall and CPU seconds per update; the two aggregates decrypt to the same integers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from senseshield.bench.machine import cpu_model as _cpu_model  # noqa: E402
from senseshield.engine.aggregation import ProtectedUpdate, StreamingAggregate  # noqa: E402
from senseshield.he import generate_keys  # noqa: E402

SIZE = 50_826


def updates(public, n: int, *, folded: bool) -> list[ProtectedUpdate]:  # noqa: ANN001
    B = public.block_size
    mask = np.zeros(SIZE, bool)
    mask[: (SIZE // 2) // B * B] = True
    pos = np.flatnonzero(mask)
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        delta = rng.normal(size=SIZE) * 0.01
        w = 400 + 9 * i
        cipher = public.encrypt(delta[pos], pos, weight=w) if folded else public.encrypt(delta[pos], pos)
        out.append(ProtectedUpdate(f"c{i}", 1, 0, w, SIZE, mask, cipher, delta[~mask].astype(np.float32)))
    return out


class Unfolding:
    """The key as before: the coordinator raises each ciphertext to its weight."""

    def __init__(self, public) -> None:  # noqa: ANN001
        self.public = public

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.public, name)

    prefolds_weight = False


def fold(public, ups: list[ProtectedUpdate]):  # noqa: ANN001, ANN201
    agg = StreamingAggregate(public, size=SIZE, round=1, cluster=0)
    wall, cpu = time.perf_counter(), time.process_time()
    for u in ups:
        agg.add(u)
    return agg, (time.perf_counter() - wall) / len(ups), (time.process_time() - cpu) / len(ups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fold.json")
    a = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        secret = generate_keys("packed-paillier", key_bits=a.key_bits)
    public = secret.public_key
    plain, folded = updates(public, a.updates, folded=False), updates(public, a.updates, folded=True)
    rows = {"exponent at the coordinator": [], "folded by the encryptor": []}
    for _ in range(a.repeats):
        agg_e, wall_e, cpu_e = fold(Unfolding(public), plain)
        agg_f, wall_f, cpu_f = fold(public, folded)
        rows["exponent at the coordinator"].append((wall_e, cpu_e))
        rows["folded by the encryptor"].append((wall_f, cpu_f))
    pos = np.flatnonzero(plain[0].mask)
    same = np.array_equal(secret.decrypt_integers(agg_e.accumulator.result(pos)),
                          secret.decrypt_integers(agg_f.accumulator.result(pos)))
    summary = {name: {"wall_ms_per_update": 1000 * statistics.median(w for w, _ in v),
                      "cpu_ms_per_update": 1000 * statistics.median(c for _, c in v)} for name, v in rows.items()}
    ratio = summary["exponent at the coordinator"]["wall_ms_per_update"] / summary["folded by the encryptor"]["wall_ms_per_update"]
    result = {"benchmark": "fold", "date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "key_bits": a.key_bits,
              "blocks_per_update": len(folded[0].ciphertext.payload.ciphertexts), "updates": a.updates,
              "repeats": a.repeats, "summary": summary, "speedup": ratio, "same_aggregate": bool(same)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    for name, v in summary.items():
        print(f"{name:30s} {v['wall_ms_per_update']:7.2f} ms/update wall, {v['cpu_ms_per_update']:7.2f} ms CPU")
    print(f"speedup {ratio:.1f}x; the same aggregate: {same}")


if __name__ == "__main__":
    main()
