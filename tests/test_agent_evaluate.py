"""A new model applied and evaluated on the device (edge_agent.evaluate): exported to the
device's ONNX file, its metrics on the local test split from onnxruntime's outputs (the same
as the torch model's), and the round's report with the privacy spent."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_agent.dataspec import DataSpec
from edge_agent.evaluate import apply_and_evaluate, apply_model, evaluate, round_metrics
from edge_agent.prepare import prepare
from senseshield.job import Job, initial_model, train_config
from senseshield.runtime.protocol.messages import FleetConfig
from senseshield.training import evaluate_model, set_vector
from tests.test_fleet import wait_for


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


def _device(config: Job):  # noqa: ANN202
    _, initial = initial_model(config, (1, 8, 8), 10)
    msg = FleetConfig(run_id="j-1", config=config.model_dump(mode="json"), input_shape=[1, 8, 8], num_classes=10,
                      round_deadline=30, initial=initial)
    return initial, prepare(msg, DataSpec(shard=(0, 4)), "a1")


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_applying_in_steps_gives_what_applying_at_once_gives(tmp_path, chunk):
    config = Job(strategy="plaintext", model="linear", clients=4, rounds=1)
    initial, prepared = _device(config)
    weights = initial + 0.01
    steps = apply_and_evaluate(config, (1, 8, 8), 10, weights, tmp_path / "model.onnx", data=prepared.data,
                               model=prepared.model, fleet="f", cluster=0, r=1, threads=1, chunk=chunk)
    next(steps)  # the export is the first step: the device's model file is written
    assert (tmp_path / "model.onnx").stat().st_size > 0
    yields = 1
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            applied = done.value
            break
    n = len(prepared.data.y_test)
    assert yields == 2 + -(-n // chunk) - 1  # export | session | every chunk of the test split
    session = apply_model(config, (1, 8, 8), 10, weights, tmp_path / "again.onnx", fleet="f", cluster=0, r=1,
                          threads=1)
    assert applied.values == pytest.approx(evaluate(config, prepared.data, prepared.model, session, weights, 1))
    assert applied.apply_s > 0 and applied.evaluate_s > 0


def test_a_waiting_round_plan_sets_a_models_evaluation_aside(mosquitto, tmp_path):
    """A round plan that arrives while a model is applied is taken at the next step boundary;
    the model's remaining steps run when the device waits again, and the job's last model
    replaces one in progress."""
    from edge_agent.service import EdgeAgent, RunState
    from senseshield.runtime.protocol.messages import RoundPlan, from_frame
    from senseshield.runtime.transport import Link

    config = Job(strategy="plaintext", model="linear", clients=4, rounds=3)
    initial, prepared = _device(config)
    sent: list = []
    peer = Link(mosquitto.url, client_id="coordinator", fleet="ev", on_frame=lambda t, f: sent.append(f))
    peer.subscribe("agents/+/metrics")
    peer.start()
    agent = EdgeAgent(mosquitto.url, fleet="ev", agent_id="a1", bandwidth=1, cpu_speed=1, model_dir=tmp_path / "m")
    agent.start([])
    try:
        run = RunState("j-1", config, initial, (1, 8, 8), 10, data=prepared.data, model=prepared.model, cluster=0)
        run.models[0], run.done_rounds = (1, initial + 0.01), {1, 2}
        agent.run = run
        plan = RoundPlan(cluster=0, encryption_budget=0.0, deadline=time.time() + 60, block_size=1,
                         size=initial.size, model_round=2, shared_mask=np.zeros(0, np.uint8))
        agent.plans.append((3, plan))
        agent._evaluate_new_model()  # full work: every model applied and evaluated in one go
        assert agent.applying is None and run.evaluated == 1
        wait_for(lambda: len(sent) == 1, timeout=30)
        sent.clear()
        run.sent_metrics.clear()
        run.evaluated, run.partial = -1, True  # now the coordinator cuts this device's steps
        agent._evaluate_new_model()  # round 3 is waiting: model 1 gets one step (its export)
        agent._evaluate_new_model()
        assert agent.applying is not None and agent.applying.r == 1
        assert (tmp_path / "m" / "model.onnx").is_file() and run.evaluated == -1
        agent.plans.clear()
        run.models[0] = (2, initial + 0.02)  # a newer model, not the last: model 1 is finished first
        agent._evaluate_new_model()
        assert agent.applying is None and run.evaluated == 1 and "apply" in run.timings[1]
        run.done_rounds.add(3)
        agent.plans.append((4, plan))
        agent._evaluate_new_model()
        assert agent.applying is not None and agent.applying.r == 2
        run.models[0] = (3, initial + 0.03)  # the job's last model replaces model 2 at once
        agent.plans.clear()
        agent._evaluate_new_model()
        assert agent.applying is None and run.evaluated == 3 and "apply" not in run.timings.get(2, {})
        wait_for(lambda: len(sent) == 2, timeout=30)
        assert [from_frame(f).metric for f in sent] == pytest.approx([run.sent_metrics[1].metric, run.sent_metrics[3].metric])
        assert [f.round for f in sent] == [1, 3] and sorted(run.sent_metrics) == [1, 3]
    finally:
        agent.stop()
        peer.stop()
