"""The matmul probes of the device profile (:func:`edge_agent.profile.measure_gflops`), in a
module that imports only torch: the agent runs them in a child process
(:func:`edge_agent.profile.measure_gflops_apart`), which should load nothing else."""

from __future__ import annotations

import time


def gflops_probes(n: int, probes: int, min_seconds: float) -> list[float]:
    """GFLOP/s of each of ``probes`` probes of ``n x n`` float32 torch matmuls (2 n^3 flops
    each), each probe repeating products for at least ``min_seconds``, after one warm-up."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator, dtype=torch.float32)
    b = torch.randn(n, n, generator=generator, dtype=torch.float32)
    torch.mm(a, b)

    def probe() -> float:
        done, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            done += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return 2.0 * n**3 * done / max(elapsed, 1e-9) / 1e9

    return [probe() for _ in range(probes)]
