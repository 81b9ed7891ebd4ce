"""Tests of senseshield.models: every model builds and runs on 8x8 and 28x28 inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from senseshield.errors import ConfigError
from senseshield.models import MODELS, build_model

SHAPES = [(1, 8, 8), (1, 28, 28)]


def test_registry() -> None:
    # the built-in models (an installed package's entry points may add more, as a test does)
    assert {"lenet5", "linear", "mlp", "simplecnn"} <= set(MODELS.names())


@pytest.mark.parametrize("name", ["linear", "mlp", "simplecnn", "lenet5"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_shape(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    out = model(torch.rand(5, *shape))
    assert out.shape == (5, 10)
    assert torch.isfinite(out).all()
    out.sum().backward()  # gradients flow to every parameter
    assert all(p.grad is not None for p in model.parameters())


def test_mlp_architecture() -> None:
    model = build_model("mlp", (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 256), (256, 128), (128, 10)]


def test_simplecnn_architecture() -> None:
    model = build_model("simplecnn", (1, 28, 28), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (32, (3, 3), (1, 1)), (64, (3, 3), (1, 1))]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 2
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64 * 7 * 7, 128), (128, 10)]


@pytest.mark.parametrize(("shape", "pad2", "features"), [((1, 28, 28), 0, 400),
                                                         ((1, 8, 8), 2, 64)])
def test_lenet5_architecture(shape: tuple[int, int, int], pad2: int, features: int) -> None:
    model = build_model("lenet5", shape, 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (6, (5, 5), (2, 2)), (16, (5, 5), (pad2, pad2))]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (features, 120), (120, 84), (84, 10)]


@pytest.mark.parametrize(("activation", "cls"), [("relu", nn.ReLU), ("sigmoid", nn.Sigmoid),
                                                 ("tanh", nn.Tanh)])
def test_lenet5_activation(activation: str, cls: type[nn.Module]) -> None:
    model = build_model("lenet5", (1, 8, 8), 3, activation=activation)
    assert sum(isinstance(m, cls) for m in model.modules()) == 4
    assert model(torch.rand(2, 1, 8, 8)).shape == (2, 3)


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(["linear", "mlp", "simplecnn", "lenet5"]), c=st.integers(1, 3),
       h=st.integers(4, 32), w=st.integers(4, 32), classes=st.integers(2, 12))
def test_any_valid_shape_forwards(name: str, c: int, h: int, w: int, classes: int) -> None:
    model = build_model(name, (c, h, w), classes)
    model.eval()
    with torch.no_grad():
        assert model(torch.rand(2, c, h, w)).shape == (2, classes)


@pytest.mark.parametrize("name", ["simplecnn", "lenet5"])
@pytest.mark.parametrize("shape", [(1, 3, 8), (1, 8, 2), (1, 1, 1)])
def test_too_small_input(name: str, shape: tuple[int, int, int]) -> None:
    with pytest.raises(ConfigError, match="too small") as info:
        build_model(name, shape, 10)
    assert str(shape) in str(info.value)


@pytest.mark.parametrize("classes", [0, -3])
def test_bad_num_classes(classes: int) -> None:
    with pytest.raises(ConfigError, match=f"num_classes={classes}"):
        build_model("mlp", (1, 8, 8), classes)


def test_one_output_is_a_classification_job_error_only() -> None:
    """One output builds (a regression's single target); a classification job refuses it."""
    from senseshield.job import job_from_dict

    assert build_model("mlp", (1, 8, 8), 1)(torch.zeros(2, 1, 8, 8)).shape == (2, 1)
    with pytest.raises(ConfigError, match="num_classes=1 is not allowed for task 'classification'"):
        job_from_dict({"num_classes": 1, "input_shape": [4]})


@pytest.mark.parametrize("shape", [(1, 0, 8), (), (1.5, 8), (True, 8), "abc"])
def test_bad_input_shape(shape: object) -> None:
    with pytest.raises(ConfigError, match="input_shape"):
        build_model("mlp", shape, 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["simplecnn", "lenet5"])
@pytest.mark.parametrize("shape", [(8, 8), (1, 8, 8, 1)])
def test_image_models_need_chw(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match=r"input_shape=.*\(C, H, W\)"):
        build_model(name, shape, 10)


@pytest.mark.parametrize("shape", [(8, 8), (12,), (1, 8, 8, 2)])
def test_flat_models_take_any_rank(shape: tuple[int, ...]) -> None:
    for name in ("mlp", "linear"):
        assert build_model(name, shape, 4)(torch.rand(3, *shape)).shape == (3, 4)


def test_unknown_model_and_option() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("resnet18", (1, 8, 8), 10)
    assert all(n in str(info.value) for n in ("resnet18", "mlp", "simplecnn", "lenet5"))
    with pytest.raises(ConfigError, match="relu6"):
        build_model("lenet5", (1, 8, 8), 10, activation="relu6")
    with pytest.raises(ConfigError, match="activation"):
        build_model("mlp", (1, 8, 8), 10, activation="tanh")
