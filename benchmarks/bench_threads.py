"""Would a thread pool speed up the coordinator's folding or its signature checks? (issue 22 item 5)

    .venv/bin/python benchmarks/bench_threads.py [--frame-bytes 413000] [--products 20000]

Measures, with 1 and with 2 threads doing the same work side by side: Ed25519 verification
of an update-sized frame (``cryptography``, what ``Trust.verify`` calls for every frame) and
4096-bit modular products (gmpy2, what packed Paillier's ``PackedAccumulator`` does per
ciphertext block), the latter with and without gmpy2's ``allow_release_gil``. Prints
operations per second, CPU ms per operation and cpu/wall; ``parallel`` is two threads'
cpu/wall over one thread's: about 2 means they ran in parallel, about 1 that the GIL
serialised them (a ratio, so it holds on a busy machine, where cpu/wall itself is below 1).
docs/decisions.md quotes the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

import gmpy2
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def side_by_side(work, threads: int) -> tuple[float, float]:  # noqa: ANN001
    """(wall s, cpu s) of ``threads`` threads each running ``work()``."""
    ts = [threading.Thread(target=work) for _ in range(threads)]
    t, c = time.perf_counter(), time.process_time()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frame-bytes", type=int, default=413_000, help="frame size (default: a masked MLP update, 8-byte ring)")
    ap.add_argument("--verifies", type=int, default=200, help="verifications per thread")
    ap.add_argument("--products", type=int, default=20_000, help="modular products per thread")
    a = ap.parse_args()
    key = Ed25519PrivateKey.generate()
    public, message = key.public_key(), os.urandom(a.frame_bytes)
    signature = key.sign(message)

    def verify() -> None:
        for _ in range(a.verifies):
            public.verify(signature, message)

    rng = random.Random(0)
    modulus = gmpy2.mpz(rng.getrandbits(4096)) | 1
    terms = [gmpy2.mpz(rng.getrandbits(4096)) % modulus for _ in range(1000)]

    def fold(release: bool) -> None:
        gmpy2.get_context().allow_release_gil = release  # the context is per thread
        acc = gmpy2.mpz(1)
        for i in range(a.products):
            acc = acc * terms[i % len(terms)] % modulus

    print(f"{'work':46s} {'threads':>7s} {'ops/s':>12s} {'ms/op (cpu)':>12s} {'cpu/wall':>9s} {'parallel':>9s}")
    rows = [(f"Ed25519 verify, {a.frame_bytes:,}-byte frame", verify, a.verifies)]
    for release in (False, True):
        rows.append((f"4096-bit product mod n^2, release_gil={release}", lambda r=release: fold(r), a.products))
    for name, work, n in rows:
        one = None
        for threads in (1, 2):
            wall, cpu = side_by_side(work, threads)
            one = one or cpu / wall
            print(f"{name:46s} {threads:7d} {threads * n / wall:12,.0f} {cpu / (threads * n) * 1e3:12.4f} "
                  f"{cpu / wall:9.2f} {cpu / wall / one:9.2f}")


if __name__ == "__main__":
    main()
