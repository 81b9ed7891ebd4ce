"""A new model of the device's cluster applied and evaluated (no transport): exported to
ONNX and loaded into onnxruntime (:func:`apply_model`, what the device runs for inference),
the job's metrics on the device's test split (:func:`evaluate`), both in steps of a few ms of
CPU that a round can preempt (:func:`apply_and_evaluate`), and the round's :class:`Metrics`
report (:func:`round_metrics`). torch and onnxruntime load when a model is applied, not when
this module is imported."""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from senseshield.accounting import Accountant
from senseshield.inference import export_onnx, load_session
from senseshield.job import Job, train_config
from senseshield.rounds import LocalData
from senseshield.runtime.protocol.messages import Metrics


def apply_model(config: Job, input_shape: tuple[int, ...], num_classes: int, weights: np.ndarray, path: Path, *,
                fleet: str, cluster: int, r: int, threads: int):  # noqa: ANN201
    """``weights`` exported to ``path`` (the device's applied model) and loaded into onnxruntime."""
    return _run(_apply_steps(config, input_shape, num_classes, weights, path, fleet=fleet, cluster=cluster, r=r,
                             threads=threads))


def _apply_steps(config: Job, input_shape: tuple[int, ...], num_classes: int, weights: np.ndarray, path: Path, *,
                 fleet: str, cluster: int, r: int, threads: int) -> Generator[None, None, Any]:
    """:func:`apply_model`, yielding between the export and the onnxruntime session."""
    export_onnx(config.model, input_shape, num_classes, weights, path, fleet=fleet, cluster=cluster, round=r,
                model_args=config.model_args)
    yield
    return load_session(path, threads=threads)


EVAL_CHUNK = 64
"""Test samples per step of the built-in evaluation (:func:`apply_and_evaluate`): ~3.5 ms of
one x86 core for LeNet-5, under the 5 ms a 5 % CPU quota grants per 100 ms period."""


def evaluate(config: Job, data: LocalData, model, session, weights: np.ndarray, r: int) -> dict[str, float]:  # noqa: ANN001
    """The job's metrics of ``weights`` on the device's test split: the built-in evaluation
    on onnxruntime's outputs (what the device runs for inference), or the job's own
    evaluation function on the torch model."""
    return _run(_evaluate_steps(config, data, model, session, weights, r, EVAL_CHUNK))


def _run(steps: Generator[None, None, Any]) -> Any:
    """What a step generator returns, its steps run back to back."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _evaluate_steps(config: Job, data: LocalData, model, session, weights: np.ndarray, r: int,  # noqa: ANN001
                    chunk: int) -> Generator[None, None, dict[str, float]]:
    """:func:`evaluate`, yielding after every ``chunk`` test samples of the built-in
    evaluation (the job's own evaluation function is one step)."""
    from senseshield.training import evaluate_model, output_metrics, set_vector, torch_threads

    train = train_config(config)
    if config.evaluate is None:
        outputs = []
        for i in range(0, len(data.x_test), chunk):
            if outputs:
                yield
            outputs.append(session.logits(data.x_test[i:i + chunk]))
        return output_metrics(np.concatenate(outputs), data.y_test, train) if outputs else {}
    set_vector(model, weights)
    with torch_threads(config.train_threads):
        return evaluate_model(model, data.x_test, data.y_test, train, round=r)


@dataclass
class Applied:
    """A model applied and evaluated by :func:`apply_and_evaluate`: its onnxruntime session,
    its metrics, and the seconds its apply and evaluation steps took (the waits between
    steps left out)."""

    session: Any
    values: dict[str, float]
    apply_s: float
    evaluate_s: float


def apply_and_evaluate(config: Job, input_shape: tuple[int, ...], num_classes: int, weights: np.ndarray, path: Path,
                       *, data: LocalData, model, fleet: str, cluster: int, r: int, threads: int,  # noqa: ANN001
                       chunk: int = EVAL_CHUNK) -> Generator[None, None, Applied]:
    """:func:`apply_model` then :func:`evaluate`, in steps of a few ms of CPU (the export, the
    onnxruntime session, every ``chunk`` test samples), yielding between steps. The agent
    runs it while it waits for a round and sets it aside at a step boundary when a round plan
    arrives: on a device under a CPU quota the whole of it spans several of the quota's
    periods (LeNet-5 at 5 % of a core: 0.3-0.7 s), which a round would otherwise start late by."""
    session, apply_s = yield from _timed(_apply_steps(config, input_shape, num_classes, weights, path, fleet=fleet,
                                                      cluster=cluster, r=r, threads=threads))
    yield
    values, evaluate_s = yield from _timed(_evaluate_steps(config, data, model, session, weights, r, chunk))
    return Applied(session, values, apply_s, evaluate_s)


def _timed(steps: Generator[None, None, Any]) -> Generator[None, None, tuple[Any, float]]:
    """``steps`` passed through, returning (its value, the seconds its steps took)."""
    spent = 0.0
    while True:
        t = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            return done.value, spent + time.perf_counter() - t
        spent += time.perf_counter() - t
        yield


def round_metrics(config: Job, cluster: int, values: dict[str, float], n_test: int, timings: dict[str, float],
                  dp_history: list, inference: dict[str, float]) -> Metrics:
    """The round's report: the job's metric and all ``values``, the phase ``timings``, the
    device's privacy spent so far (epsilon at the job's delta over ``dp_history``) and the
    model's inference latency."""
    epsilon = None
    if dp_history:
        epsilon = Accountant(dp_history).epsilon(config.options.delta)
    return Metrics(
        cluster=cluster, metric=values.get(train_config(config).metric_name, 0.0), metrics=values,
        n_test=n_test,
        timings={k: float(v) for k, v in timings.items()}, epsilon=epsilon,
        dp_history=[tuple(h) for h in dp_history], inference=inference,
    )
