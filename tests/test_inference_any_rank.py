"""On-device inference beyond images: 1-D signals, tabular rows and models with model_args.

Real exports (torch -> ONNX), real onnxruntime sessions, real CLI invocations; the models are
the worked example's 1-D CNN (examples/har/har.py), the built-in MLP on tabular rows and a
user's file-path model that takes model_args.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from senseshield.errors import ConfigError
from senseshield.cli.inference import export_command, predict_command
from senseshield.inference import (
    Sidecar,
    export_onnx,
    latency,
    load_session,
    sidecar_path,
)
from senseshield.models import build_model
from senseshield.training import get_vector

HAR = f"{Path(__file__).resolve().parents[1] / 'examples' / 'har' / 'har.py'}:har_cnn"
SIGNAL, TABULAR = (3, 64), (20,)

#: A user's tabular model in a file, with its own keyword arguments (model_args).
USER = '''
from torch import nn

def tabular_net(input_shape, num_classes, hidden=32, depth=1):
    (features,) = input_shape
    layers, width = [], features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.Tanh()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, num_classes))
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user") / "tabular.py"
    path.write_text(USER)
    return f"{path}:tabular_net"


def trained_like(name: str, shape: tuple[int, ...], classes: int, args: dict | None = None,
                 seed: int = 0) -> torch.nn.Module:
    """A model in eval mode whose BatchNorm statistics are not the defaults (0 mean, 1 var)."""
    torch.manual_seed(seed)
    model = build_model(name, shape, classes, model_args=args)
    model.train()
    with torch.no_grad():
        model(torch.rand(16, *shape) * 2.0 + 0.5)  # moves running_mean / running_var
    return model.eval()


def torch_logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def export(model, name, shape, classes, path: Path, args: dict | None = None, **kw) -> Sidecar:
    kw = {"fleet": "plant-a", "cluster": 1, "round": 3, **kw}
    return export_onnx(name, shape, classes, get_vector(model).astype(np.float64), path,
                       model_args=args, **kw)


def one_sentence(message: str) -> bool:
    """Ends with a full stop and has no other sentence end (an ellipsis "ab12... " is not one)."""
    return message.endswith(".") and "\n" not in message \
        and ". " not in message.replace("... ", " ")


#: name (None: the user's file), input shape, classes, model_args
CASES = {
    "har_cnn-1d": (HAR, SIGNAL, 6, None),
    "har_cnn-1d-channels8": (HAR, SIGNAL, 6, {"channels": 8}),
    "mlp-tabular": ("mlp", TABULAR, 4, None),
    "user-tabular-args": (None, TABULAR, 3, {"hidden": 12, "depth": 2}),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, user_file) -> dict[str, tuple[torch.nn.Module, Path, tuple]]:
    out = {}
    for key, (name, shape, classes, args) in CASES.items():
        name = name or user_file
        model = trained_like(name, shape, classes, args)
        path = tmp_path_factory.mktemp(key) / "model.onnx"
        export(model, name, shape, classes, path, args)
        out[key] = (model, path, (name, shape, classes, args))
    return out


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("key", list(CASES))
def test_parity_and_sidecar_for_any_rank_and_model_args(exported, key):
    model, path, (name, shape, classes, args) = exported[key]
    session = load_session(path, threads=1)
    assert session.input_shape == shape
    side = json.loads(sidecar_path(path).read_text())
    assert side["input_shape"] == list(shape) and side["model"] == name
    assert side["model_args"] == (args or {}) and "model_options" not in side
    assert Sidecar.read(sidecar_path(path)) == session.sidecar
    rng = np.random.default_rng(0)
    for batch in (1, 7):  # the batch axis is dynamic
        x = rng.random((batch, *shape), dtype=np.float32) * 2.0
        got = session.logits(x)
        assert got.shape == (batch, classes)
        assert np.max(np.abs(got - torch_logits(model, x))) <= 1e-5
    classes_, scores = session.predict(x[2])  # one sample, no batch axis
    assert classes_.tolist() == [int(torch_logits(model, x[2:3]).argmax())]
    assert scores.shape == (1, classes)


def test_model_args_rebuild_the_trained_architecture(tmp_path, exported):
    model, _, (name, shape, classes, args) = exported["har_cnn-1d-channels8"]
    weights = get_vector(model).astype(np.float64)
    # without the model_args the default architecture (16 channels) does not fit the weights
    with pytest.raises(ConfigError, match=r"flat vector of 1782 values") as err:
        export_onnx(name, shape, classes, weights, tmp_path / "m.onnx", fleet="f", cluster=0, round=0)
    assert one_sentence(str(err.value)) and not (tmp_path / "m.onnx").exists()
    # what is recorded is what was built; arguments that are not JSON values are refused
    for bad in ({"channels": object()}, {"channels": float("nan")}, ["channels", 8]):
        with pytest.raises(ConfigError, match="model_args=") as err:
            export_onnx(name, shape, classes, weights, tmp_path / "b.onnx", model_args=bad,
                        fleet="f", cluster=0, round=0)
        assert one_sentence(str(err.value))


def test_dynamo_exporter_parity_on_a_1d_cnn(tmp_path, exported):
    model, _, (name, shape, classes, args) = exported["har_cnn-1d-channels8"]
    side = export(model, name, shape, classes, tmp_path / "d.onnx", args, exporter="dynamo")
    assert side.exporter == "dynamo"
    x = np.random.default_rng(1).random((7, *shape), dtype=np.float32)
    got = load_session(tmp_path / "d.onnx", threads=1).logits(x)
    assert np.max(np.abs(got - torch_logits(model, x))) <= 1e-5


# -------------------------------------------------------------------------- refusals


def copy_export(src: Path, dst_dir: Path, stem: str = "copy") -> Path:
    dst = dst_dir / f"{stem}.onnx"
    shutil.copy(src, dst)
    shutil.copy(sidecar_path(src), sidecar_path(dst))
    return dst


def edit_sidecar(path: Path, **changes) -> None:
    side = json.loads(sidecar_path(path).read_text())
    side.update(changes)
    sidecar_path(path).write_text(json.dumps(side))


def refused(path: Path, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as err:
        load_session(path)
    assert one_sentence(str(err.value)), str(err.value)


@pytest.mark.parametrize("key, wrong_shapes", [
    ("har_cnn-1d", ([3, 32], [64, 3], [3, 64, 1], [192])),
    ("mlp-tabular", ([21], [1, 20], [20, 1])),
])
def test_corrupted_or_mismatched_files_are_refused(tmp_path, exported, key, wrong_shapes):
    _, original, _ = exported[key]
    path = copy_export(original, tmp_path)
    data = bytearray(path.read_bytes())
    for i in (100, len(data) // 2, len(data) - 10):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    refused(path, "corrupted or does not belong to this sidecar")

    # the sidecar of another export (other rank, other model) does not fit
    other = "mlp-tabular" if key == "har_cnn-1d" else "har_cnn-1d"
    path = copy_export(original, tmp_path)
    shutil.copy(sidecar_path(exported[other][1]), sidecar_path(path))
    refused(path, "does not belong to this sidecar")

    # the right hash, but a sidecar that declares another shape (same or other rank)
    for shape in wrong_shapes:
        shutil.copy(sidecar_path(original), sidecar_path(path))
        edit_sidecar(path, input_shape=shape)
        refused(path, "does not match its sidecar")

    # sidecars that cannot be right whatever the file
    for changes, pattern in (
        ({"input_shape": []}, "input_shape=\\[\\]; it must be a non-empty list"),
        ({"input_shape": [3, 0]}, "input_shape=\\[3, 0\\]; it must be a non-empty list"),
        ({"model_args": [1]}, "model_args=\\[1\\]; it must be a JSON object"),
        ({"model_options": {}}, "has both model_args and model_options"),
    ):
        shutil.copy(sidecar_path(original), sidecar_path(path))
        edit_sidecar(path, **changes)
        refused(path, pattern)


def test_sidecar_with_the_older_model_options_name_is_read(tmp_path, exported):
    _, original, (_, _, _, args) = exported["user-tabular-args"]
    path = copy_export(original, tmp_path)
    side = json.loads(sidecar_path(path).read_text())
    side["model_options"] = side.pop("model_args")
    sidecar_path(path).write_text(json.dumps(side))
    assert load_session(path).sidecar.model_args == args


@pytest.mark.parametrize("key, bad_inputs, expected", [
    ("har_cnn-1d", [(64, 3), (2, 3, 32), (3, 64, 1), (0, 3, 64), (192,), (2, 1, 3, 64)],
     r"it expects one sample of shape \(3, 64\) or a batch of shape \(N, 3, 64\)\.$"),
    ("mlp-tabular", [(21,), (2, 21), (20, 1), (0, 20), (2, 2, 20), ()],
     r"it expects one sample of shape \(20,\) or a batch of shape \(N, 20\)\.$"),
])
def test_wrong_shape_inputs_name_the_expected_shape(exported, key, bad_inputs, expected):
    session = load_session(exported[key][1], threads=1)
    for shape in bad_inputs:
        with pytest.raises(ConfigError, match=expected) as err:
            session.predict(np.zeros(shape, dtype=np.float32))
        assert f"Input of shape {shape}" in str(err.value) and one_sentence(str(err.value))
    with pytest.raises(ConfigError, match="Input is not an array of numbers") as err:
        session.predict([["a"]])
    assert one_sentence(str(err.value))


# --------------------------------------------------------------------------- latency


@pytest.mark.parametrize("key", ["har_cnn-1d", "mlp-tabular"])
def test_latency_for_any_rank(exported, key):
    model, path, (_, shape, _, _) = exported[key]
    session = load_session(path, threads=1)
    for target in (model, session):
        result = latency(target, shape, repeats=3, warmup=1, batch_sizes=(1, 7))
        assert result["input_shape"] == list(shape)
        for batch in ("1", "7"):
            assert 0 < result["batches"][batch]["p50_ms"] <= result["batches"][batch]["p95_ms"]
    wrong = (3, 32) if len(shape) == 2 else (21,)
    with pytest.raises(ConfigError, match=r"the model expects") as err:
        latency(session, wrong, repeats=1)
    assert one_sentence(str(err.value))
    with pytest.raises(ConfigError, match=r"input_shape=\(0,\) is not allowed"):
        latency(model, (0,), repeats=1)


# ---------------------------------------------------------------------------------- CLI


def cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("export")(export_command)
    app.command("predict")(predict_command)
    return app


@pytest.mark.parametrize("key", ["har_cnn-1d", "mlp-tabular"])
def test_predict_command_on_signals_and_tabular_rows(tmp_path, exported, key):
    from PIL import Image

    model, path, (_, shape, classes, _) = exported[key]
    batch = np.random.default_rng(5).random((5, *shape), dtype=np.float32)
    expected = torch_logits(model, batch).argmax(axis=1).tolist()
    for name, array, want in (("one.npy", batch[1], expected[1:2]), ("batch.npy", batch, expected)):
        np.save(tmp_path / name, array)
        result = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / name), "--json"])
        assert result.exit_code == 0, result.output
        preds = json.loads(result.stdout)["predictions"]
        assert [p["class"] for p in preds] == want and len(preds[0]["scores"]) == classes
    table = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "batch.npy")])
    assert table.exit_code == 0 and "cluster 1" in table.stdout

    # images are for (C, H, W) models only: say so, with the shape to use instead
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(tmp_path / "x.png")
    text = ", ".join(map(str, shape))
    result = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    assert "only models with image inputs (C, H, W) also accept images" in message
    assert f"pass a .npy array of shape {shape} or (N, {text})." in message

    np.save(tmp_path / "bad.npy", np.zeros((2, shape[0] + 1), dtype=np.float32))
    bad = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "bad.npy")])
    assert bad.exit_code == 2 and "Traceback" not in bad.stderr
    assert f"it expects one sample of shape {shape}" in " ".join(bad.stderr.split())


@pytest.fixture()
def har_run(tmp_path, exported) -> tuple[Path, torch.nn.Module]:
    """A fleet run directory of har_cnn with model_args in the report's job config."""
    model, _, (name, shape, classes, args) = exported["har_cnn-1d-channels8"]
    run = tmp_path / "run"
    (run / "models" / "round-4").mkdir(parents=True)
    np.save(run / "models" / "round-4" / "cluster-0.npy", get_vector(model).astype(np.float64))
    (run / "report.json").write_text(json.dumps({
        "model": name, "fleet": "plant-b", "input_shape": list(shape), "num_classes": classes,
        "config": {"model": name, "model_args": args, "seed": 0},
    }))
    return run, model


def test_export_command_takes_model_args_from_the_runs_job(tmp_path, har_run):
    run, model = har_run
    out = tmp_path / "har.onnx"
    result = CliRunner().invoke(cli(), ["export", "--run", str(run), "-k", "0", "-o", str(out)])
    assert result.exit_code == 0, result.output
    session = load_session(out)
    assert session.sidecar.model_args == {"channels": 8} and session.input_shape == SIGNAL
    assert (session.sidecar.fleet, session.sidecar.round) == ("plant-b", 4)
    x = np.random.default_rng(6).random((7, *SIGNAL), dtype=np.float32)
    assert np.max(np.abs(session.logits(x) - torch_logits(model, x))) <= 1e-5
    assert hashlib.sha256(out.read_bytes()).hexdigest() == session.sidecar.sha256


@pytest.mark.parametrize("config, message", [
    ({"model_args": [8]}, "model_args=[8] is not allowed; it must be a mapping"),
    ("job", "config='job'; it must be a JSON object"),
    ({"seed": 0}, "flat vector of 1782 values"),  # a job without model_args: default 16 channels
])
def test_export_command_refuses_a_bad_job_config(tmp_path, har_run, config, message):
    run, _ = har_run
    report = json.loads((run / "report.json").read_text())
    report["config"] = config
    (run / "report.json").write_text(json.dumps(report))
    result = CliRunner().invoke(cli(), ["export", "--run", str(run), "-k", "0", "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert message in " ".join(result.stderr.split())
