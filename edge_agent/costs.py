"""What a device measures of itself when it joins a job: its round costs for calibrated
budgets (:func:`measure_costs`) and the job model's inference latency on onnxruntime
(:func:`warm_inference`, :func:`inference_latency`). No transport; torch, onnxruntime and
the key's tables load when a measurement runs, not when this module is imported."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from senseshield.he.base import ephemeral_exchange
from senseshield.inference import export_onnx, latency, load_session
from senseshield.job import Job, train_config
from senseshield.rounds import LocalData

log = logging.getLogger("senseshield.agent")


def warm_inference(config: Job, input_shape: tuple[int, ...], num_classes: int, initial: np.ndarray, *,
                   fleet: str, threads: int, repeats: int) -> dict[str, float]:
    """Load onnxruntime and measure the run's inference latency (the architecture is the
    run's) on the initial model, exported to a scratch file: the device's applied model
    (``model.onnx``) is still only ever a round's."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "warm-up.onnx"
        export_onnx(config.model, input_shape, num_classes, initial, path, fleet=fleet,
                    cluster=0, round=0, model_args=config.model_args)
        return inference_latency(load_session(path, threads=threads), input_shape, repeats)


def inference_latency(session, input_shape: tuple[int, ...], repeats: int) -> dict[str, float]:  # noqa: ANN001
    """p50 and p95 latency (ms) of ``session`` per batch size (``b1_p50_ms``, ...)."""
    speed = latency(session, input_shape, repeats=repeats, warmup=2)
    return {f"b{b}_{q}_ms": float(v[f"{q}_ms"]) for b, v in speed["batches"].items() for q in ("p50", "p95")}


def measure_costs(config: Job, model, data: LocalData, public, profile: dict) -> dict:  # noqa: ANN001
    """This device's round costs for calibrated budgets (``Hello.profile["measured"]``):
    local training per round (a timed warm epoch x (local epochs + 1 for the sensitivity
    pass)), values encrypted per second with the fleet's key ``public`` (sustained over
    ~0.5 s), and ciphertext bytes per value, with ``spread`` (min/max of the epochs and of
    the encryption calls). The first encryption also builds the key's tables, as
    round 1 would. The coordinator refines these from every round it sees."""
    from edge_agent.probes import measure_encryption
    from senseshield.training import torch_threads, train_local

    import copy

    t0 = time.perf_counter()
    # the bootstrap's time includes one-off costs (first torch calls, its sensitivity
    # pass); a warm epoch on a copy of the model is what a round repeats local_epochs times
    epoch_s = []
    for _ in range(3):
        copied = copy.deepcopy(model)
        with torch_threads(config.train_threads):
            t = time.perf_counter()
            train_local(copied, data.x_train, data.y_train,
                        train_config(config, epochs=1), seed=0)
            epoch_s.append(time.perf_counter() - t)
    train_s = float(np.median(epoch_s)) * (config.local_epochs + 1)  # + ~one epoch for the sensitivity
    measure_encryption(public_key=public, budget_s=0.05, repeats=1, window_s=0)  # builds the key's tables
    # sustained rate: whole blocks for ~0.5 s of wall time (a device sharing its CPU, or a
    # cgroup quota, runs short bursts faster than it can keep up)
    block = max(1, int(public.block_size))
    count = block * max(1, 2048 // block)
    values, positions = np.zeros(count), np.arange(count, dtype=np.int64)
    contributor = public.for_contributor(ephemeral_exchange, b"measuring")  # masked: pads of no round
    done, t, calls = 0, time.perf_counter(), []
    while True:
        start = time.perf_counter()
        vec = contributor.encrypt(values, positions)
        calls.append(count / max(time.perf_counter() - start, 1e-9))
        done += count
        elapsed = time.perf_counter() - t
        if elapsed >= 0.5:
            break
    rate = done / elapsed
    per_value = len(contributor.ciphertext_bytes(vec)) / count
    latency_s = float(profile.get("latency_ms") or 0.0) / 1000.0
    measured = {"train_s": float(train_s), "encrypt_per_s": float(rate),
                "bytes_per_encrypted": float(per_value), "latency_s": latency_s,
                "seconds": time.perf_counter() - t0}
    log.info("measured round costs: %s", {k: round(v, 4) for k, v in measured.items()})
    # probe intervals (the coordinator pools devices that agree within them)
    scale = config.local_epochs + 1
    measured["spread"] = {"train_s": [min(epoch_s) * scale, max(epoch_s) * scale],
                          "encrypt_per_s": [min(min(calls), rate), max(max(calls), rate)]}
    return measured
