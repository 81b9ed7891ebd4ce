"""The project's own training on this machine: senseshield.simulate of a small MLP job.

Run by deploy/pi/prove_arm64.sh (with AGENT=1) under emulation and on x86: plaintext
strategy, the built-in MLP on the built-in digits data, 3 clients, 2 rounds, seed 3,
train_threads 2. Writes the final metric and the global model to a JSON file.

    python simulate_check.py OUT.json
"""

import json
import platform
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

from senseshield import Job, simulate  # noqa: E402

job = Job(strategy="plaintext", model="mlp", clients=3, rounds=2, seed=3, train_threads=2)
result = simulate(job)
seconds = time.perf_counter() - t0
model = [float(v) for v in result.models[0]]
json.dump(
    {"machine": platform.machine(), "torch": torch.__version__, "seconds": round(seconds, 1),
     "metric": result.metric_name, "final": result.final_metric,
     "rounds": [r.metric for r in result.rounds], "model": model},
    open(sys.argv[1], "w"),
)
print(f"{platform.machine()} torch {torch.__version__}: {result.metric_name} per round "
      f"{[round(r.metric, 4) for r in result.rounds]}, {len(model)} weights, {seconds:.0f} s")
