"""A new model applied and evaluated on the device (edge_agent.evaluate): exported to the
device's ONNX file, its metrics on the local test split from onnxruntime's outputs (the same
as the torch model's), and the round's report with the privacy spent."""

from __future__ import annotations

import pytest

from edge_agent.dataspec import DataSpec
from edge_agent.evaluate import apply_model, evaluate, round_metrics
from edge_agent.prepare import prepare
from senseshield.job import Job, initial_model, train_config
from senseshield.runtime.protocol.messages import FleetConfig
from senseshield.training import evaluate_model, set_vector


def test_a_model_is_applied_evaluated_and_reported(tmp_path):
    config = Job(strategy="plaintext", model="linear", clients=4, rounds=1)
    _, initial = initial_model(config, (1, 8, 8), 10)
    msg = FleetConfig(run_id="j-1", config=config.model_dump(mode="json"), input_shape=[1, 8, 8], num_classes=10,
                      round_deadline=30, initial=initial)
    prepared = prepare(msg, DataSpec(shard=(0, 4)), "a1")
    session = apply_model(config, (1, 8, 8), 10, initial, tmp_path / "model.onnx", fleet="f", cluster=0, r=1, threads=1)
    assert (tmp_path / "model.onnx").stat().st_size > 0
    values = evaluate(config, prepared.data, prepared.model, session, initial, 1)
    set_vector(prepared.model, initial)
    in_torch = evaluate_model(prepared.model, prepared.data.x_test, prepared.data.y_test, train_config(config), round=1)
    assert values["accuracy"] == pytest.approx(in_torch["accuracy"])
    metrics = round_metrics(config, 0, values, len(prepared.data.y_test), {"apply": 0.1}, [(1.0, 0.1, 10)],
                            {"b1_p50_ms": 0.2})
    assert metrics.metric == values["accuracy"] and metrics.n_test == len(prepared.data.y_test)
    assert metrics.epsilon is not None and metrics.epsilon > 0 and metrics.dp_history == [(1.0, 0.1, 10)]
    assert round_metrics(config, 0, values, 1, {}, [], {}).epsilon is None
