"""What a device's pad log costs (edge_agent.padlog): its size after N rounds and the time of
one record (append + fsync) beside the masking of one MLP update (50,826 parameters) it
guards, on this machine's disk.

    python benchmarks/bench_padlog.py [--rounds 1000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from edge_agent.padlog import PadLog, slot_of
from senseshield.he import SCHEMES
from senseshield.he.base import round_context
from senseshield.runtime.identity import Identity

SIZE = 50_826  # the digits MLP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=None, help="Where the log is written (default: a temporary folder).")
    args = parser.parse_args()
    public = SCHEMES.get("masked").generate().public_key
    agent = Identity.generate("a")
    values, positions = np.random.default_rng(0).normal(size=SIZE) * 0.01, np.arange(SIZE)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        log = PadLog(Path(tmp) / "pads-used.log")
        record_s, mask_s = [], []
        for r in range(1, args.rounds + 1):
            context = round_context("bench", "j-0123456789abcdef", r, 0, "0" * 64)
            t = time.perf_counter()
            vector = public.for_contributor(agent.exchange, context, ring_bits=32).encrypt(values, positions)
            mask_s.append(time.perf_counter() - t)
            cipher = np.asarray(vector.payload).tobytes()
            t = time.perf_counter()
            assert log.refusal(slot_of("bench", "j-0123456789abcdef", r, "a"), context, cipher) is None
            log.record(slot_of("bench", "j-0123456789abcdef", r, "a"), context, cipher)
            record_s.append(time.perf_counter() - t)
        size = (Path(tmp) / "pads-used.log").stat().st_size
        t = time.perf_counter()
        PadLog(Path(tmp) / "pads-used.log")
        load_s = time.perf_counter() - t
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "rounds": args.rounds, "bytes": size, "bytes_per_round": size / args.rounds,
        "record_ms_median": 1e3 * statistics.median(record_s), "record_ms_p95": 1e3 * float(np.percentile(record_s, 95)),
        "mask_ms_median": 1e3 * statistics.median(mask_s), "load_ms": 1e3 * load_s,
    }
    result["record_over_mask"] = result["record_ms_median"] / result["mask_ms_median"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
