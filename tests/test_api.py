"""The Python API's front door: a Job's refusals are ConfigError sentences, and a run's final
model comes back as a ready torch module (result.final_model, senseshield.model_with_weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import senseshield as ss
from senseshield import ConfigError, Job


@pytest.mark.parametrize("keys, words", [
    ({"rounds": 0}, ["rounds=0 is not allowed", "greater than or equal to 1"]),
    ({"lr": "fast"}, ["lr='fast' is not allowed", "number"]),
    ({"roundz": 3}, ["unknown key 'roundz'", "allowed:", "rounds"]),
    ({"strategy": "nope"}, ["Unknown strategy 'nope'", "plaintext"]),
    ({"options": {"he_ratio": 2}}, ["options.he_ratio=2 is not allowed", "less than or equal to 1"]),
    ({"task": "regression", "num_classes": 1, "metric": "accuracy"}, ["metric='accuracy'", "mse"]),
    ({"model_args": {"1x": 2}}, ["model_args", "identifiers"]),
])
def test_job_refuses_with_one_config_error_sentence(keys, words) -> None:
    with pytest.raises(ConfigError) as info:
        Job(**keys)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "\n" not in message and "validation error" not in message and "pydantic" not in message
    assert isinstance(info.value, ValueError)  # `except ValueError` code keeps working


def test_a_job_file_and_job_say_the_same_sentence(tmp_path) -> None:
    """One function words both (job.validation_reason): the file only adds its name."""
    path = tmp_path / "job.yaml"
    path.write_text("rounds: 0\n")
    with pytest.raises(ConfigError) as direct:
        Job(rounds=0)
    with pytest.raises(ConfigError) as from_file:
        ss.load_job(path)
    assert str(from_file.value) == f"Job file {str(path)!r}: {direct.value}"


def test_the_commands_still_name_the_flag() -> None:
    from senseshield.cli.common import flag_sentence

    with pytest.raises(ConfigError) as info:
        Job(clients=0)
    assert flag_sentence(info.value).startswith("--clients=0 is not allowed")
    assert flag_sentence(ConfigError("Unknown model 'x'.")) == "Unknown model 'x'."


@pytest.fixture(scope="module")
def digits_run():
    job = Job(strategy="plaintext", model="mlp", dataset="digits", clients=4, rounds=2, seed=4)
    return job, ss.simulate(job)


def test_final_model_gives_the_reports_final_accuracy(digits_run) -> None:
    """The rebuilt module, on the simulator's test splits (every client's), gives exactly the
    final accuracy the run reported (a test-size weighted mean over the clients)."""
    from senseshield.data import load_dataset
    from senseshield.simulation import build_clients

    job, result = digits_run
    model = result.final_model(cluster=0)
    assert isinstance(model, torch.nn.Module) and not model.training
    clients = build_clients(job, load_dataset(job.dataset, seed=job.seed))
    x = np.concatenate([c.data.x_test for c in clients])
    y = np.concatenate([c.data.y_test for c in clients])
    with torch.no_grad():
        predicted = model(torch.as_tensor(x)).argmax(dim=1).numpy()
    assert len(y) == sum(c.n_test for c in result.clients)
    assert float(np.mean(predicted == y)) == pytest.approx(result.final_accuracy, abs=1e-12)
    assert result.final_accuracy > 0.5  # it learnt: not a fresh model that happens to agree


def test_final_model_leaves_the_callers_random_stream_and_the_result_alone(digits_run) -> None:
    _, result = digits_run
    before = result.models[0].copy()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    model = result.final_model()
    assert torch.equal(torch.rand(3), expected)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # the module is the caller's to change
    assert np.array_equal(result.models[0], before)


def test_final_model_refuses_a_cluster_the_run_does_not_have(digits_run) -> None:
    _, result = digits_run
    for bad in (3, -1, True, "0"):
        with pytest.raises(ConfigError, match=rf"cluster={bad!r} is not allowed; this run has cluster\(s\) 0\."):
            result.final_model(bad)
    empty = ss.RunResult.model_validate(result.model_dump())  # read back from JSON: no models
    with pytest.raises(ConfigError, match="holds no models"):
        empty.final_model()


def test_model_with_weights_is_the_same_module_and_refuses_weights_that_do_not_fit(digits_run) -> None:
    job, result = digits_run
    rebuilt = ss.model_with_weights("mlp", (1, 8, 8), 10, result.models[0])
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), result.final_model()(x))
    with pytest.raises(ConfigError, match=r"weights of shape \(10,\) do not fit model 'mlp' .* a flat vector of "):
        ss.model_with_weights("mlp", (1, 8, 8), 10, np.zeros(10))
    with pytest.raises(ConfigError, match="NaN or infinite"):
        ss.model_with_weights("mlp", (1, 8, 8), 10, np.full(result.models[0].size, np.nan))


def test_final_model_uses_the_jobs_model_args(tmp_path) -> None:
    """A file-path model with model_args, on a device's own data: rebuilt as the job built it."""
    module = tmp_path / "nets.py"
    module.write_text(
        "from torch import nn\n"
        "def net(input_shape, num_classes, hidden=4):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], hidden), nn.ReLU(),\n"
        "                         nn.Linear(hidden, num_classes))\n")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 5)).astype(np.float32)
    path = tmp_path / "device.npz"
    np.savez(path, x=x, y=(x[:, 0] > 0).astype(np.int64))
    job = Job(strategy="plaintext", model=f"{module}:net", model_args={"hidden": 7}, input_shape=[5],
              num_classes=2, rounds=1, seed=2)
    data = ss.load_local_data(path, job)
    result = ss.simulate(job, devices=[data])
    model = result.final_model()
    assert model[1].out_features == 7
    with torch.no_grad():
        accuracy = float(np.mean(model(torch.as_tensor(data.x_test)).argmax(1).numpy() == data.y_test))
    assert accuracy == pytest.approx(result.final_accuracy, abs=1e-12)


def test_a_fleet_config_that_is_no_job_is_a_protocol_error_naming_the_field() -> None:
    """Services read a job from fleet/config through Job(...) too: still one ProtocolError
    naming the field (not the ConfigError a caller gets)."""
    from senseshield.errors import ProtocolError
    from senseshield.job import announced_run

    with pytest.raises(ProtocolError,
                       match=r"^fleet/config field 'strategy': value error, unknown strategy 'nope'"):
        announced_run({"strategy": "nope"})
    with pytest.raises(ProtocolError,
                       match=r"^fleet/config field 'rounds': input should be greater than or equal to 1\.$"):
        announced_run({"rounds": 0})
    with pytest.raises(ProtocolError, match=r"^fleet/config does not describe a run: Scheme 'ckks' needs"):
        announced_run({"strategy": "sensecrypt", "scheme": "ckks"})
