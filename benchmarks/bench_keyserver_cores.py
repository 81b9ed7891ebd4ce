"""The key server's unmasking on 1 and more cores: seconds to remove N contributors' pads from
one masked aggregate of the MLP (50,826 parameters, the 32-bit ring a masked job picks), with
the pads regenerated on one process or spread over ``--threads`` processes
(``MaskedSecretKey.decrypt``), wall and CPU seconds (this process and its workers), alternated
in the same run; the unmasked sums are checked equal.

    python benchmarks/bench_keyserver_cores.py [--agents 1000,10000] [--threads 1,2] [--repeats 3]
        [--out benchmarks/results/keyserver-cores.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from senseshield.bench.machine import cpu_model  # noqa: E402
from senseshield.he import SCHEMES  # noqa: E402
from senseshield.he.base import EncryptedVector, round_context  # noqa: E402
from senseshield.runtime.identity import Identity  # noqa: E402

SIZE = 50_826  # the digits MLP


def cpu_seconds() -> float:
    """CPU seconds of this process and of the live pad workers (read from /proc)."""
    from senseshield.he import masked

    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    for pool in masked._POOLS.values():
        for pid in list(getattr(pool, "_processes", {}) or {}):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def aggregate(secret, n: int, context: bytes, rng) -> tuple[np.ndarray, list]:  # noqa: ANN001
    """Σ of n agents' masked updates (each masks its own values with its own pads), and the
    (box key, weight) of each, as a coordinator would send them."""
    positions = np.arange(SIZE)
    total = np.zeros(SIZE, dtype=np.uint32)
    named = []
    for i in range(n):
        agent = Identity.generate(f"a{i:05d}")
        part = secret.public_key.for_contributor(agent.exchange, context, ring_bits=32).encrypt(
            rng.uniform(-0.05, 0.05, SIZE), positions)
        total += np.asarray(part.payload)
        named.append((agent.box_key, 1))
    return total, named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="1000,10000")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "keyserver-cores.json")
    args = parser.parse_args()
    secret = SCHEMES.get("masked").generate()
    context = round_context("bench", "j-0123456789abcdef", 1, 0, "0" * 64)
    rng = np.random.default_rng(0)
    rows = []
    for n in [int(x) for x in args.agents.split(",")]:
        t = time.perf_counter()
        words, named = aggregate(secret, n, context, rng)
        print(f"N={n}: {n} agents masked their updates in {time.perf_counter() - t:.1f} s", flush=True)
        threads = [int(x) for x in args.threads.split(",")]
        seconds = {k: [] for k in threads}
        cpu = {k: [] for k in threads}
        sums = {}
        for k in threads:  # warm: a pool's processes start once per key server
            vector = EncryptedVector("masked", secret.public_key.key_id, np.arange(SIZE), words.copy(), words.nbytes)
            secret.bind_contributions(vector, named, context)
            secret.decrypt(vector, threads=k)
        for _ in range(args.repeats):
            for k in threads:  # alternated
                vector = EncryptedVector("masked", secret.public_key.key_id, np.arange(SIZE), words.copy(), words.nbytes)
                secret.bind_contributions(vector, named, context)
                c, t = cpu_seconds(), time.perf_counter()
                sums[k] = secret.decrypt(vector, threads=k)
                seconds[k].append(time.perf_counter() - t)
                cpu[k].append(cpu_seconds() - c)
        assert all(sums[k].tobytes() == sums[threads[0]].tobytes() for k in threads)
        base = statistics.median(seconds[threads[0]])
        for k in threads:
            row = {"agents": n, "threads": k, "unmask_s": round(statistics.median(seconds[k]), 3),
                   "cpu_s": round(statistics.median(cpu[k]), 3), "speedup": round(base / statistics.median(seconds[k]), 2),
                   "model": "mlp", "parameters": SIZE, "ring_bits": 32, "cores": os.cpu_count(), "cpu": cpu_model(),
                   "python": platform.python_version()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
