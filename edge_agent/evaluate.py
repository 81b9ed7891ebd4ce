"""A new model of the device's cluster applied and evaluated (no transport): exported to
ONNX and loaded into onnxruntime (:func:`apply_model`, what the device runs for inference),
the job's metrics on the device's test split (:func:`evaluate`), and the round's
:class:`Metrics` report (:func:`round_metrics`). torch and onnxruntime load when a model is
applied, not when this module is imported."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from senseshield.accounting import Accountant
from senseshield.inference import export_onnx, load_session
from senseshield.job import Job, train_config
from senseshield.rounds import LocalData
from senseshield.runtime.protocol.messages import Metrics


def apply_model(config: Job, input_shape: tuple[int, ...], num_classes: int, weights: np.ndarray, path: Path, *,
                fleet: str, cluster: int, r: int, threads: int):  # noqa: ANN201
    """``weights`` exported to ``path`` (the device's applied model) and loaded into onnxruntime."""
    export_onnx(config.model, input_shape, num_classes, weights, path,
                fleet=fleet, cluster=cluster, round=r,
                model_args=config.model_args)
    return load_session(path, threads=threads)


def evaluate(config: Job, data: LocalData, model, session, weights: np.ndarray, r: int) -> dict[str, float]:  # noqa: ANN001
    """The job's metrics of ``weights`` on the device's test split: the built-in evaluation
    on onnxruntime's outputs (what the device runs for inference), or the job's own
    evaluation function on the torch model."""
    from senseshield.training import evaluate_model, output_metrics, set_vector, torch_threads

    train = train_config(config)
    if config.evaluate is None:
        return output_metrics(session.logits(data.x_test), data.y_test, train)
    set_vector(model, weights)
    with torch_threads(config.train_threads):
        return evaluate_model(model, data.x_test, data.y_test, train, round=r)


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
