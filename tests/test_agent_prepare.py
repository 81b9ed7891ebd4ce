"""A job checked against this device and made ready to join (edge_agent.prepare): the shard
or the device's own source the job uses, the job's model; a job the device cannot take is
refused with one sentence naming what does not fit."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.dataspec import DataSpec
from edge_agent.prepare import prepare
from senseshield.errors import ConfigError
from senseshield.job import Job, initial_model
from senseshield.runtime.protocol.messages import FleetConfig

def _msg(**over) -> FleetConfig:
    config = Job(strategy="plaintext", model="linear", clients=4, rounds=1)
    _, initial = initial_model(config, (1, 8, 8), 10)
    good = FleetConfig(run_id="j-1", config=config.model_dump(mode="json"), input_shape=[1, 8, 8],
                       num_classes=10, round_deadline=30, initial=initial)
    return good.model_copy(update=over)

def test_a_shard_of_the_jobs_dataset_and_the_jobs_model():
    msg = _msg()
    whole = prepare(msg, DataSpec(), "a1")
    shard = prepare(msg, DataSpec(shard=(2, 4)), "a1")
    assert (whole.index, whole.count, shard.index, shard.count) == (0, 1, 2, 4)
    assert 0 < shard.data.n_train < whole.data.n_train
    assert whole.config.strategy == "plaintext" and whole.model is not shard.model
    assert np.array_equal(shard.data.x_train, prepare(msg, DataSpec(shard=(2, 4)), "a1").data.x_train)

def test_a_job_this_device_cannot_take_is_refused_in_one_sentence():
    cases = {
        "has inputs (1, 8, 8) and 10 classes; the run's model needs (3, 32, 32)": (_msg(input_shape=[3, 32, 32]), DataSpec()),
        "parameters; here it has": (_msg(initial=_msg().initial[:-1]), DataSpec()),
        "The job uses data source 'field'; this device has none": (
            _msg(config={**_msg().config, "data": "field"}), DataSpec()),
    }
    for needle, (msg, spec) in cases.items():
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            prepare(msg, spec, "a1")
