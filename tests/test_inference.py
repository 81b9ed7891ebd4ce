"""ONNX export and onnxruntime inference (senseshield.inference): real exports, real sessions."""

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
    OPSET,
    InferenceModel,
    Sidecar,
    export_onnx,
    latency,
    load_session,
    sidecar_path,
)
from senseshield.models import build_model
from senseshield.training import get_vector

DIGITS, MNIST = (1, 8, 8), (1, 28, 28)


def trained_like(name: str, shape: tuple[int, int, int], seed: int = 0) -> torch.nn.Module:
    """A model in eval mode whose BatchNorm statistics are not the defaults (0 mean, 1 var)."""
    torch.manual_seed(seed)
    model = build_model(name, shape, 10)
    model.train()
    with torch.no_grad():
        model(torch.rand(16, *shape) * 2.0)  # moves running_mean / running_var
    return model.eval()


def torch_logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def export(model: torch.nn.Module, name: str, shape, path: Path, **kw) -> Sidecar:
    kw = {"fleet": "plant-a", "cluster": 2, "round": 5, **kw}
    return export_onnx(name, shape, 10, get_vector(model).astype(np.float64), path, **kw)


@pytest.fixture(scope="module")
def digits_mlp(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = trained_like("mlp", DIGITS)
    path = tmp_path_factory.mktemp("mlp") / "model.onnx"
    export(model, "mlp", DIGITS, path)
    return model, path


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("shape", [DIGITS, MNIST], ids=["digits", "mnist"])
@pytest.mark.parametrize("name", ["mlp", "simplecnn", "lenet5"])
def test_parity_torch_vs_onnxruntime(tmp_path, name, shape):
    model = trained_like(name, shape)
    path = tmp_path / "model.onnx"
    sidecar = export(model, name, shape, path)
    session = load_session(path, threads=1)
    rng = np.random.default_rng(0)
    for batch in (1, 7):  # the batch axis is dynamic
        x = rng.random((batch, *shape), dtype=np.float32)
        got = session.logits(x)
        assert got.shape == (batch, 10)
        assert np.max(np.abs(got - torch_logits(model, x))) <= 1e-5
    assert sidecar.opset == OPSET and sidecar.exporter == "torchscript"


def test_dynamo_exporter_parity(tmp_path):
    model = trained_like("simplecnn", DIGITS)
    path = tmp_path / "model.onnx"
    sidecar = export(model, "simplecnn", DIGITS, path, exporter="dynamo")
    assert sidecar.exporter == "dynamo"
    x = np.random.default_rng(1).random((7, *DIGITS), dtype=np.float32)
    got = load_session(path, threads=1).logits(x)
    assert np.max(np.abs(got - torch_logits(model, x))) <= 1e-5


# ----------------------------------------------------------------------------- sidecar


def test_sidecar_describes_the_file_and_export_is_deterministic(tmp_path, digits_mlp):
    model, _ = digits_mlp
    state = torch.random.get_rng_state()
    a = export(model, "mlp", DIGITS, tmp_path / "a.onnx", class_labels=list("abcdefghij"))
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
    b = export(model, "mlp", DIGITS, tmp_path / "b.onnx", class_labels=list("abcdefghij"))
    data = (tmp_path / "a.onnx").read_bytes()
    assert data == (tmp_path / "b.onnx").read_bytes()
    assert a == b
    assert sidecar_path(tmp_path / "a.onnx") == tmp_path / "a.onnx.json"
    on_disk = json.loads((tmp_path / "a.onnx.json").read_text())
    assert on_disk["sha256"] == hashlib.sha256(data).hexdigest() == a.sha256
    assert on_disk["fleet"] == "plant-a" and on_disk["cluster"] == 2 and on_disk["round"] == 5
    assert on_disk["model"] == "mlp" and on_disk["input_shape"] == [1, 8, 8]
    assert on_disk["num_classes"] == 10 and on_disk["opset"] == OPSET
    assert on_disk["class_labels"] == list("abcdefghij")
    assert Sidecar.read(tmp_path / "a.onnx.json") == a


def test_export_refuses_a_vector_of_the_wrong_size(tmp_path):
    with pytest.raises(ConfigError, match="flat vector of 50826 values"):
        export_onnx("mlp", DIGITS, 10, np.zeros(12), tmp_path / "m.onnx",
                    fleet="f", cluster=0, round=0)
    assert not (tmp_path / "m.onnx").exists()


def copy_export(src: Path, dst_dir: Path) -> Path:
    dst = dst_dir / "copy.onnx"
    shutil.copy(src, dst)
    shutil.copy(sidecar_path(src), sidecar_path(dst))
    return dst


def rehash(path: Path) -> None:
    """Make the sidecar agree with whatever bytes are now in ``path``."""
    side = json.loads(sidecar_path(path).read_text())
    side["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    sidecar_path(path).write_text(json.dumps(side))


def test_corrupted_file_is_refused(tmp_path, digits_mlp):
    path = copy_export(digits_mlp[1], tmp_path)
    data = bytearray(path.read_bytes())
    for i in (100, len(data) // 2, len(data) - 10):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupted or does not belong to this sidecar"):
        load_session(path)


@pytest.mark.parametrize("damage", ["truncated", "not-onnx"])
def test_file_that_is_not_onnx_is_refused_even_with_a_matching_hash(tmp_path, digits_mlp, damage):
    path = copy_export(digits_mlp[1], tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"hello, world\n")
    rehash(path)
    with pytest.raises(ConfigError, match="is not a valid ONNX model"):
        load_session(path)


def test_missing_or_mismatched_sidecar_is_refused(tmp_path, digits_mlp):
    model, original = digits_mlp
    path = copy_export(original, tmp_path)
    sidecar_path(path).unlink()
    with pytest.raises(ConfigError, match="has no sidecar"):
        load_session(path)
    # the sidecar of another export (same model, other weights) does not fit
    other = tmp_path / "other.onnx"
    export(trained_like("mlp", DIGITS, seed=3), "mlp", DIGITS, other)
    shutil.copy(sidecar_path(other), sidecar_path(path))
    with pytest.raises(ConfigError, match="does not belong to this sidecar"):
        load_session(path)
    # a sidecar with the right hash but the wrong input shape
    shutil.copy(sidecar_path(original), sidecar_path(path))
    side = json.loads(sidecar_path(path).read_text())
    side["input_shape"] = [1, 28, 28]
    sidecar_path(path).write_text(json.dumps(side))
    with pytest.raises(ConfigError, match="does not match its sidecar"):
        load_session(path)
    sidecar_path(path).write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_session(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_session(tmp_path / "nowhere.onnx")


# ----------------------------------------------------------------------------- predict


def test_predict_accepts_a_sample_or_a_batch_and_names_the_expected_shape(digits_mlp):
    model, path = digits_mlp
    session = load_session(path, threads=1)
    assert isinstance(session, InferenceModel) and session.input_shape == DIGITS
    x = np.random.default_rng(2).random((5, *DIGITS), dtype=np.float32)
    classes, scores = session.predict(x)
    assert classes.shape == (5,) and scores.shape == (5, 10)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(classes, torch_logits(model, x).argmax(axis=1))
    one_class, one_scores = session.predict(x[3])  # no batch axis
    assert one_class.tolist() == [classes[3]] and one_scores.shape == (1, 10)
    for bad in (np.zeros((28, 28)), np.zeros((2, 1, 28, 28)), np.zeros((8, 8)), np.zeros((0, 1, 8, 8))):
        with pytest.raises(ConfigError, match=r"expects one sample of shape \(1, 8, 8\) "
                                              r"or a batch of shape \(N, 1, 8, 8\)"):
            session.predict(bad)


def test_latency_reports_p50_p95_for_both_backends(digits_mlp):
    model, path = digits_mlp
    for target in (model, load_session(path, threads=1)):
        result = latency(target, DIGITS, repeats=3, warmup=1)
        assert result["backend"] in ("torch", "onnxruntime")
        for batch in ("1", "32"):
            stats = result["batches"][batch]
            assert 0 < stats["p50_ms"] <= stats["p95_ms"]


# --------------------------------------------------------------------------------- CLI


def cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("export")(export_command)
    app.command("predict")(predict_command)
    return app


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> tuple[Path, dict[int, torch.nn.Module]]:
    """A fleet run directory: rounds 1, 2 and 10 (numeric, not lexicographic, order matters)."""
    run = tmp_path_factory.mktemp("run")
    (run / "report.json").write_text(json.dumps({
        "model": "lenet5", "fleet": "plant-a", "input_shape": list(DIGITS), "num_classes": 10,
    }))
    models = {}
    for rnd in (1, 2, 10):
        folder = run / "models" / f"round-{rnd}"
        folder.mkdir(parents=True)
        models[rnd] = trained_like("lenet5", DIGITS, seed=rnd)
        for k in (0, 1) if rnd != 10 else (0,):
            np.save(folder / f"cluster-{k}.npy", get_vector(models[rnd]).astype(np.float64))
    return run, models


def test_export_command_picks_the_highest_round(tmp_path, run_dir):
    run, models = run_dir
    out = tmp_path / "exports" / "lenet.onnx"
    result = CliRunner().invoke(cli(), ["export", "--run", str(run), "--cluster", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    session = load_session(out)
    assert (session.sidecar.round, session.sidecar.cluster) == (10, 0)
    assert session.sidecar.fleet == "plant-a" and session.sidecar.model == "lenet5"
    x = np.random.default_rng(3).random((4, *DIGITS), dtype=np.float32)
    assert np.max(np.abs(session.logits(x) - torch_logits(models[10], x))) <= 1e-5

    explicit = tmp_path / "r2.onnx"
    result = CliRunner().invoke(
        cli(), ["export", "--run", str(run), "-k", "1", "--round", "2", "-o", str(explicit)])
    assert result.exit_code == 0, result.output
    assert load_session(explicit).sidecar.round == 2


@pytest.mark.parametrize("args, message", [
    (["--cluster", "1"], "cluster=1 has no model in round 10 of run"),
    (["--cluster", "0", "--round", "3"], "round=3 is not in run"),
])
def test_export_command_names_what_exists(tmp_path, run_dir, args, message):
    run, _ = run_dir
    result = CliRunner().invoke(cli(), ["export", "--run", str(run), *args, "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert ("clusters in that round: 0; cluster 1 is saved in round(s) 1, 2" in result.stderr
            if "cluster=1" in message else "saved rounds: 1, 2, 10." in result.stderr)
    missing = CliRunner().invoke(cli(), ["export", "--run", str(tmp_path / "nope"), "-k", "0", "-o", "m"])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_predict_command_on_npy_and_png(tmp_path, digits_mlp):
    from PIL import Image

    model, path = digits_mlp
    sample = np.random.default_rng(4).random(DIGITS, dtype=np.float32)
    np.save(tmp_path / "x.npy", sample)
    expected = int(torch_logits(model, sample[None]).argmax())
    result = CliRunner().invoke(cli(), ["predict", "--model", str(path), str(tmp_path / "x.npy"),
                                        "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["cluster"] == 2 and payload["round"] == 5
    (pred,) = payload["predictions"]
    assert pred["class"] == expected and len(pred["scores"]) == 10

    # a 32x32 grayscale PNG whose 4x4 blocks average to the sample: box resize gives it back
    pixels = np.kron(np.round(sample[0] * 255), np.ones((4, 4))).astype(np.uint8)
    Image.fromarray(pixels, mode="L").convert("RGB").save(tmp_path / "x.png")
    result = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "x.png"),
                                        "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["predictions"][0]["class"] == expected

    table = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "x.png")])
    assert table.exit_code == 0, table.output
    assert "cluster 2" in table.stdout and "score" in table.stdout

    np.save(tmp_path / "bad.npy", np.zeros((28, 28), dtype=np.float32))
    bad = CliRunner().invoke(cli(), ["predict", "-m", str(path), str(tmp_path / "bad.npy")])
    assert bad.exit_code == 2 and "expects one sample of shape (1, 8, 8)" in bad.stderr


@pytest.mark.parametrize("name,shape", [("lenet5", (1, 28, 28)), ("simplecnn", (1, 8, 8)), ("mlp", (1, 8, 8))])
def test_a_second_export_of_the_same_graph_rewrites_the_weights_into_the_same_bytes(tmp_path, name, shape):
    """After one export of a graph, the next ones only write the new weights into its
    initialisers (25 ms -> ~6 ms for LeNet-5 on an idle core: what a device pays per model it
    applies); the file is byte for byte what a fresh export of those weights writes."""
    import senseshield.onnx_export as onnx_export

    size = get_vector(build_model(name, shape, 10)).size
    rng = np.random.default_rng(0)
    first, second = (rng.normal(0, 0.1, size).astype(np.float32) for _ in range(2))
    onnx_export._TEMPLATES.clear()
    export_onnx(name, shape, 10, first, tmp_path / "a.onnx", fleet="f", cluster=0, round=1)
    cached = export_onnx(name, shape, 10, second, tmp_path / "b.onnx", fleet="f", cluster=0, round=2)
    onnx_export._TEMPLATES.clear()
    fresh = export_onnx(name, shape, 10, second, tmp_path / "c.onnx", fleet="f", cluster=0, round=2)
    assert (tmp_path / "b.onnx").read_bytes() == (tmp_path / "c.onnx").read_bytes()
    assert cached == fresh
    x = np.random.default_rng(1).normal(size=(3, *shape)).astype(np.float32)
    model = build_model(name, shape, 10)
    from senseshield.training import set_vector

    set_vector(model, second)
    model.eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(load_session(tmp_path / "b.onnx").logits(x), expected, rtol=1e-4, atol=1e-5)
