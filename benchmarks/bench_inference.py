"""Benchmark of on-device inference: torch vs onnxruntime forward latency.

Run (single-threaded by default, like an edge device's one spare core)::

    .venv/bin/python benchmarks/bench_inference.py [--threads 1] [--repeats 300] [--out PATH]

For ``mlp``, ``simplecnn`` and ``lenet5`` on the ``digits`` (1x8x8) and ``mnist`` (1x28x28)
input shapes, exports the model with :func:`senseshield.inference.export_onnx`, opens it
with :func:`~senseshield.inference.load_session`, and measures with
:func:`~senseshield.inference.latency` the p50/p95 wall time of one forward pass at batch 1
(per sample) and batch 32, in torch (eval, ``inference_mode``) and onnxruntime (CPU), both
with ``--threads`` threads. Writes ``benchmarks/results/inference.json`` and prints a
Markdown table. Timings on a shared machine are noisy; compare ratios rather than absolute
milliseconds.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

try:
    import senseshield.inference as inference
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import senseshield.inference as inference

onnxruntime = inference.onnxruntime()  # telemetry off: nothing written in the home directory
import torch  # noqa: E402

from senseshield.bench.machine import cpu_model  # noqa: E402
from senseshield.models import build_model  # noqa: E402
from senseshield.training import get_vector  # noqa: E402

MODELS = ("mlp", "simplecnn", "lenet5")
SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28)}
RESULTS = Path(__file__).resolve().parent / "results" / "inference.json"


def _cpu_name() -> str:
    return cpu_model(platform.processor() or "unknown")


def benchmark(threads: int, repeats: int) -> list[dict]:
    """One row per (model, input shape): torch and onnxruntime latency dicts."""
    torch.set_num_threads(threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape_name, shape in SHAPES.items():
            for name in MODELS:
                torch.manual_seed(0)
                model = build_model(name, shape, 10).eval()
                path = Path(tmp) / f"{name}-{shape_name}.onnx"
                inference.export_onnx(name, shape, 10, get_vector(model), path,
                                      fleet="bench", cluster=0, round=0)
                session = inference.load_session(path, threads=threads)
                rows.append({
                    "model": name,
                    "input": shape_name,
                    "input_shape": list(shape),
                    "params": int(get_vector(model).size),
                    "onnx_bytes": path.stat().st_size,
                    "torch": inference.latency(model, shape, repeats=repeats),
                    "onnxruntime": inference.latency(session, shape, repeats=repeats),
                })
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| model | input | backend | b1 p50 ms | b1 p95 ms | b32 p50 ms | b32 p95 ms "
            "| b32 ms/sample | b1 speed-up |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t1 = r["torch"]["batches"]["1"]["p50_ms"]
        for backend in ("torch", "onnxruntime"):
            b = r[backend]["batches"]
            speedup = f"{t1 / b['1']['p50_ms']:.1f}x" if backend == "onnxruntime" else ""
            lines.append(
                f"| {r['model']} | {r['input']} | {backend} | {b['1']['p50_ms']:.3f} | "
                f"{b['1']['p95_ms']:.3f} | {b['32']['p50_ms']:.3f} | {b['32']['p95_ms']:.3f} | "
                f"{b['32']['p50_per_sample_ms']:.4f} | {speedup} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads")
    parser.add_argument("--repeats", type=int, default=300, help="timed runs per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    args = parser.parse_args()
    rows = benchmark(args.threads, args.repeats)
    result = {
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "opset": inference.OPSET,
        "threads": args.threads,
        "repeats": args.repeats,
        "note": "wall-clock p50/p95 of one forward pass on a shared machine; noisy",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, opset "
          f"{inference.OPSET}, {args.threads} thread(s), {args.repeats} repeats; "
          f"speed-up = torch b1 p50 / onnxruntime b1 p50\n")
    print(markdown(rows))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
