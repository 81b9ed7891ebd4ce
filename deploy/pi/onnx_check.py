"""The agent's evaluation path alone, step by step: export the MLP to ONNX (torch), open it
with onnxruntime, run it. Used to find which step of an arm64 agent's round died.

    python onnx_check.py DIR [THREADS]
"""

import sys
import time
from pathlib import Path

import numpy as np


def step(name, fn):
    t = time.perf_counter()
    print(f"{name} ...", flush=True)
    out = fn()
    print(f"{name}: ok ({time.perf_counter() - t:.1f} s)", flush=True)
    return out


out = Path(sys.argv[1])
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
out.mkdir(parents=True, exist_ok=True)
import torch  # noqa: E402

from senseshield.inference import export_onnx, latency, load_session  # noqa: E402
from senseshield.job import Job, build_job_model, with_shape  # noqa: E402

torch.set_num_threads(threads)
job = with_shape(Job(model="mlp"))
model = build_job_model(job, tuple(job.input_shape), job.num_classes)
weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]).astype(np.float32)
path = out / "model.onnx"
step("export_onnx", lambda: export_onnx(job.model, job.input_shape, job.num_classes, weights, path,
                                         fleet="check", cluster=0, round=1))
session = step("load_session", lambda: load_session(path, threads=threads))
x = np.random.default_rng(0).standard_normal((32, *job.input_shape)).astype(np.float32)
step("logits", lambda: session.logits(x))
step("latency", lambda: latency(session, job.input_shape, repeats=5, warmup=1))
print("all steps ran")
