"""Tests of bring-your-own models: import paths, entry points, model_args, check_model."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from senseshield.errors import ConfigError
from senseshield.models import MODELS, build_model, check_model, model_names, resolve_model
from senseshield.training import get_vector

USER = '''
import torch
from torch import nn

def tiny(input_shape, num_classes, hidden=4):
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

def fixed(num_classes):  # takes no input_shape: works for 12 input values only
    return nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))

def everything(**kwargs):
    global SEEN
    SEEN = dict(kwargs)
    return fixed(kwargs["num_classes"])

class Factory:
    @staticmethod
    def build(input_shape, num_classes):
        return tiny(input_shape, num_classes)

def broken(input_shape, num_classes):
    raise RuntimeError("weights file missing")

def not_module(input_shape, num_classes):
    return [1, 2]

def too_many(input_shape, num_classes):
    return tiny(input_shape, num_classes + 1)

def bad_forward(input_shape, num_classes):
    return nn.Linear(5, num_classes)

def tuple_out(input_shape, num_classes):
    class T(nn.Module):
        def forward(self, x):
            return x, x
    return T()

NOT_CALLABLE = 3
'''


def one_sentence(exc: BaseException, *names: str) -> str:
    msg = str(exc)
    assert isinstance(exc, ConfigError)
    assert "\n" not in msg and "Traceback" not in msg and msg.endswith(".")
    for name in names:
        assert name in msg, (name, msg)
    return msg


def refuse(name: str, *names: str, shape: tuple[int, ...] = (3, 4), classes: int = 3,
           **args: object) -> str:
    with pytest.raises(ConfigError) as info:
        build_model(name, shape, classes, model_args=args or None)
    return one_sentence(info.value, *names)


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "user_models.py"
    path.write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


# --- built-ins unchanged --------------------------------------------------------------------

#: (name, input_shape) -> (values in the flat vector, sha256[:16] of its float32 bytes) for
#: torch.manual_seed(0) and 10 classes, computed with senseshield/models.py of commit 4b0c993
#: (before models became callables) under torch 2.13.0 CPU.
BEFORE = {
    ("mlp", (1, 8, 8)): (50826, "b6cab628df169a4d"),
    ("linear", (1, 8, 8)): (650, "c242cd9487845ff7"),
    ("simplecnn", (1, 28, 28)): (422026, "db46cec6f439a842"),
    ("lenet5", (1, 8, 8)): (21386, "f2ab759d50a32a5b"),
    ("lenet5", (3, 32, 32)): (83126, "c54c519beace702c"),
}


@pytest.mark.parametrize(("name", "shape"), list(BEFORE))
def test_builtins_same_weights_as_before(name: str, shape: tuple[int, int, int]) -> None:
    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"digests were taken under torch 2.13, this is {torch.__version__}")
    torch.manual_seed(0)
    vector = get_vector(build_model(name, shape, 10)).astype(np.float32)
    assert (vector.size, hashlib.sha256(vector.tobytes()).hexdigest()[:16]) == BEFORE[name, shape]


@pytest.mark.parametrize(("name", "shape"), list(BEFORE))
def test_build_model_draws_like_the_bare_builder(name: str, shape: tuple[int, int, int]) -> None:
    """The signature inspection and the forward check draw nothing from torch's RNG."""
    torch.manual_seed(5)
    bare = get_vector(MODELS.get(name)(shape, 10))
    after_bare = torch.rand(3)
    torch.manual_seed(5)
    built = get_vector(build_model(name, shape, 10))
    np.testing.assert_array_equal(built, bare)
    assert torch.equal(torch.rand(3), after_bare)


def test_check_model_leaves_state_alone() -> None:
    torch.manual_seed(0)
    model = build_model("simplecnn", (1, 8, 8), 4)
    model.train()
    model[1].eval()  # a submodule deliberately in eval mode keeps its own flag
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check_model(model, (1, 8, 8), 4, name="simplecnn")
    assert model.training and not model[1].training and model[5].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# --- import paths and model_args ------------------------------------------------------------


def test_import_path_forms_and_model_args(user_module: Path) -> None:
    torch.manual_seed(1)
    a = build_model("user_models:tiny", (3, 4), 5, model_args={"hidden": 7})
    assert a[1].out_features == 7 and a(torch.rand(4, 3, 4)).shape == (4, 5)
    torch.manual_seed(1)
    b = build_model(f"{user_module}:tiny", (3, 4), 5, model_args={"hidden": 7})
    np.testing.assert_array_equal(get_vector(a), get_vector(b))  # same seed, same weights
    assert build_model("user_models:Factory.build", (12,), 2)(torch.rand(1, 12)).shape == (1, 2)
    assert build_model("user_models:fixed", (2, 6), 3)(torch.rand(1, 2, 6)).shape == (1, 3)
    build_model("user_models:everything", (4, 3), 3, model_args={"extra": "yes"})
    import user_models  # noqa: PLC0415 - the module the fixture put on sys.path

    assert user_models.SEEN == {"extra": "yes", "input_shape": (4, 3), "num_classes": 3}


def test_relative_file_path(user_module: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_module.parent)
    model = build_model("./user_models.py:tiny", (2, 2), 2)
    assert isinstance(model, nn.Sequential) and resolve_model("./user_models.py:tiny").__name__ == "tiny"


def test_builtin_lenet5_options_both_ways() -> None:
    a = build_model("lenet5", (1, 8, 8), 3, model_args={"activation": "tanh"})
    b = build_model("lenet5", (1, 8, 8), 3, activation="tanh")
    assert sum(isinstance(m, nn.Tanh) for m in a.modules()) == 4
    assert sum(isinstance(m, nn.Tanh) for m in b.modules()) == 4
    with pytest.raises(ConfigError, match="twice"):
        build_model("lenet5", (1, 8, 8), 3, model_args={"activation": "tanh"}, activation="relu")


# --- refusals -------------------------------------------------------------------------------


def test_refusals(user_module: Path) -> None:
    msg = refuse("resnet18", "'resnet18'", "package.module:callable", "file.py:callable")
    assert all(name in msg for name in MODELS.names())
    refuse("no_such_pkg.models:net", "'no_such_pkg.models'", "no_such_pkg", "not installed")
    refuse("user_models:absent", "'user_models:absent'", "no attribute 'absent'")
    refuse("user_models:NOT_CALLABLE", "'user_models:NOT_CALLABLE'", "type int", "not a callable")
    refuse("user_models:broken", "'user_models:broken'", "RuntimeError", "weights file missing")
    refuse("user_models:not_module", "'user_models:not_module'", "list", "torch.nn.Module")
    refuse("user_models:too_many", "'user_models:too_many'", "(2, 4)", "num_classes=3",
           "(2, 3)")
    refuse("user_models:bad_forward", "'user_models:bad_forward'", "(2, 3, 4)", "RuntimeError")
    refuse("user_models:tuple_out", "'user_models:tuple_out'", "tuple", "(2, 3)")
    refuse("user_models:tiny", "'user_models:tiny'", "'width'", "hidden", width=3)
    refuse("user_models:tiny", "input_shape", "come from the job", input_shape=(1,))
    refuse(str(user_module.parent / "missing.py") + ":tiny", "missing.py", "does not exist")
    broken_file = user_module.parent / "broken_file.py"
    broken_file.write_text("def f(:\n")
    refuse(f"{broken_file}:f", "broken_file.py", "SyntaxError")
    refuse("mlp", "input_shape", shape=(0, 4))
    refuse("mlp", "num_classes=0", classes=0)
    refuse("simplecnn", "'simplecnn'", "(C, H, W)", shape=(3, 64))
    refuse("", "''")


# --- entry points (a real dist-info on sys.path, found by importlib.metadata) ---------------


def install_dist(root: Path, entry_points: str) -> None:
    """A minimal installed distribution: its dist-info with METADATA and entry_points.txt."""
    info = root / "acme_models-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points).lstrip())
    (root / "acme_models.py").write_text(USER)


def test_entry_point_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_dist(tmp_path, """
        [senseshield.models]
        acme-tiny = acme_models:tiny
        acme-gone = acme_models:vanished
        mlp = acme_models:fixed
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"acme-tiny", "acme-gone", "mlp", "lenet5"} <= set(model_names())
    model = build_model("acme-tiny", (3, 4), 3, model_args={"hidden": 6})
    assert model[1].out_features == 6
    # a built-in name cannot be taken over by a package
    assert resolve_model("mlp") is MODELS.get("mlp")
    refuse("acme-gone", "'acme-gone'", "acme_models:vanished", "senseshield.models")
    msg = refuse("acme-nope", "'acme-nope'")
    assert "acme-tiny" in msg  # the unknown-name sentence lists the installed ones too


# --- the worked example's model -------------------------------------------------------------


def test_har_cnn_example() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "har" / "har.py"
    torch.manual_seed(0)
    model = build_model(f"{example}:har_cnn", (3, 64), 6, model_args={"channels": 8})
    assert model(torch.rand(5, 3, 64)).shape == (5, 6)
    refuse(f"{example}:har_cnn", "har.py", "ValueError", "(C, L)", shape=(3, 8, 8), classes=6)


def test_har_worked_example_learns(tmp_path: Path) -> None:
    """make_data.py (a real process) -> one .npz per device -> har_cnn learns each locally."""
    import subprocess
    import sys

    from senseshield.data.local import describe_data, load_local_data
    from senseshield.training import TrainConfig, evaluate, torch_threads, train_local

    root = Path(__file__).resolve().parents[1] / "examples" / "har"
    subprocess.run([sys.executable, str(root / "make_data.py"), "--devices", "3", "--out",
                    str(tmp_path), "--seed", "0"], check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"device-{i}.npz" for i in range(3)]
    accuracies, majorities, mixes = [], [], []
    for i in range(3):
        data = load_local_data(tmp_path / f"device-{i}.npz", input_shape=(3, 64), num_classes=6)
        summary = describe_data(data)
        assert (summary.n_train, summary.n_test) == (240, 60)
        mixes.append(summary.train_counts)
        torch.manual_seed(0)
        model = build_model(f"{root / 'har.py'}:har_cnn", (3, 64), 6)
        with torch_threads(1):
            train_local(model, data.x_train, data.y_train, TrainConfig(3, 16, 0.05), seed=i)
        accuracies.append(evaluate(model, data.x_test, data.y_test))
        majorities.append(np.bincount(data.y_test).max() / len(data.y_test))
    assert len({tuple(sorted(m.items())) for m in mixes}) == 3  # non-IID: every mix differs
    assert min(a - m for a, m in zip(accuracies, majorities)) > 0.25, (accuracies, majorities)
    assert np.mean(accuracies) > 0.85, accuracies
