"""The matmul probes of the device profile (:func:`edge_agent.probes.measure_gflops`), in a
module that imports only torch: the agent runs them in a child process
(:func:`edge_agent.probes.measure_gflops_apart`), which should load nothing else."""

from __future__ import annotations

import time


def gflops_probes(n: int, probes: int, min_seconds: float, cpu_limit: float | None = None) -> list[float]:
    """GFLOP/s of each of ``probes`` probes of ``n x n`` float32 torch matmuls (2 n^3 flops
    each), each probe repeating products for at least ``min_seconds`` of wall time, after one
    warm-up. A probe's figure is its flops per CPU-second of this process times the CPUs
    torch's threads may use (``min(threads, cpu_limit)``; ``cpu_limit``: CPUs this process's
    cgroup allows, :func:`edge_agent.probes.cpu_limit`, None = unlimited): another process
    busy on the same cores takes wall time, not this process's CPU time, so it does not lower
    the figure; a CPU quota does."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator, dtype=torch.float32)
    b = torch.randn(n, n, generator=generator, dtype=torch.float32)
    torch.mm(a, b)
    threads = float(torch.get_num_threads())
    share = threads if cpu_limit is None else min(threads, float(cpu_limit))

    def probe() -> float:
        done, start, cpu = 0, time.perf_counter(), time.process_time()
        while True:
            torch.mm(a, b)
            done += 1
            if time.perf_counter() - start >= min_seconds:
                spent = time.process_time() - cpu
                return 2.0 * n**3 * done / max(spent, 1e-9) / 1e9 * share

    return [probe() for _ in range(probes)]
