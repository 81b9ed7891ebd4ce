"""What a device measures of itself when it joins (edge_agent.costs): its round costs for
calibrated budgets, with the key it will encrypt with, and the job model's inference latency."""

from __future__ import annotations

from edge_agent.costs import measure_costs, warm_inference
from edge_agent.dataspec import DataSpec
from edge_agent.prepare import prepare
from senseshield.job import Job, initial_model, key_pair
from senseshield.runtime.protocol.messages import FleetConfig


def _prepared():
    config = Job(strategy="sensecrypt", model="linear", clients=4, rounds=1, local_epochs=2)
    _, initial = initial_model(config, (1, 8, 8), 10)
    msg = FleetConfig(run_id="j-1", config=config.model_dump(mode="json"), input_shape=[1, 8, 8],
                      num_classes=10, round_deadline=30, initial=initial)
    return prepare(msg, DataSpec(shard=(0, 4)), "a1"), initial


def test_round_costs_are_measured_with_the_fleets_key():
    prepared, _ = _prepared()
    public, _ = key_pair("masked", 0)
    measured = measure_costs(prepared.config, prepared.model, prepared.data, public, {"latency_ms": 20})
    assert measured["latency_s"] == 0.02 and measured["seconds"] >= 0.5  # the sustained encryption rate
    assert measured["train_s"] > 0 and measured["encrypt_per_s"] > 0 and measured["bytes_per_encrypted"] > 0
    low, high = measured["spread"]["train_s"]
    assert low <= measured["train_s"] <= high  # the median epoch x (2 local epochs + 1)
    low, high = measured["spread"]["encrypt_per_s"]
    assert low <= measured["encrypt_per_s"] <= high


def test_the_jobs_inference_latency_per_batch_size():
    prepared, initial = _prepared()
    speed = warm_inference(prepared.config, (1, 8, 8), 10, initial, fleet="f", threads=1, repeats=3)
    assert speed and all(v > 0 for v in speed.values())
    assert {k.split("_", 1)[1] for k in speed} == {"p50_ms", "p95_ms"} and "b1_p50_ms" in speed
