"""Models: Python callables that return a ``torch.nn.Module``, named by the job.

A job names its model in one of three ways, resolved by :func:`resolve_model` in this order:

1. a built-in name registered in :data:`MODELS` (``mlp``, ``linear``, ``simplecnn``,
   ``lenet5``);
2. a name registered by an installed package under the entry-point group
   ``senseshield.models`` (looked up lazily with :mod:`importlib.metadata`, only when the
   name is not built in);
3. an import path: ``package.module:callable`` or ``path/to/file.py:callable``
   (see :mod:`senseshield.callables`).

:func:`build_model` calls the callable with the job's ``model_args`` as keywords, plus
``input_shape`` (a tuple of any rank: ``(C, L)``, ``(C, H, W)``, ``(F,)``) and
``num_classes`` when its signature has parameters of those names (or ``**kwargs``), then
checks the result with :func:`check_model`: it must be an ``nn.Module`` that maps a batch of
shape ``(2, *input_shape)`` to ``(2, num_classes)`` logits. Initialisation uses torch's
global RNG: call ``torch.manual_seed`` first for reproducible weights (the check itself does
not draw from it). The built-in models are ``nn.Sequential`` so ``state_dict`` names are
stable (``"0.weight"``, ...); the flat parameter layout of :mod:`senseshield.engine.params`
works with any module, in ``state_dict`` order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from senseshield.callables import call_with_job, describe_exception, resolve_named
from senseshield.errors import ConfigError
from senseshield.registry import Registry
from senseshield.shapes import check_input_shape, check_num_classes

__all__ = [
    "ENTRY_POINT_GROUP",
    "MODELS",
    "build_model",
    "check_model",
    "check_weights",
    "model_names",
    "model_with_weights",
    "num_values",
    "resolve_model",
]

#: A builder takes ``input_shape``, ``num_classes`` (if it wants them) and its own keyword
#: arguments, and returns a module.
ModelBuilder = Callable[..., nn.Module]

#: The entry-point group through which installed packages register models.
ENTRY_POINT_GROUP = "senseshield.models"

#: Built-in model builders by name (and, lazily, those of installed packages).
MODELS: Registry[ModelBuilder] = Registry("model", group=ENTRY_POINT_GROUP)


def model_names() -> list[str]:
    """Every model name a job can use: the built-ins and those of installed packages."""
    return MODELS.names()


def resolve_model(name: str) -> ModelBuilder:
    """The callable a job's ``model`` names: built-in, entry point or import path."""
    return resolve_named(name, MODELS, what="model")


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *,
    model_args: Mapping[str, Any] | None = None, **options: Any,
) -> nn.Module:
    """Build the model ``name`` for inputs of ``input_shape`` and ``num_classes`` classes.

    ``model_args`` (and, for older callers, ``**options``) are the model's own keywords,
    e.g. lenet5's ``activation``. Unknown names, bad shapes, ``num_classes < 2``, arguments
    the model does not take, a callable that fails or returns something else than a module
    that fits the job raise :class:`ConfigError`.
    """
    builder = resolve_model(name)
    shape = check_input_shape(input_shape)
    classes = check_num_classes(num_classes, minimum=1)  # the job checks its task's minimum
    if model_args is not None and not isinstance(model_args, Mapping):
        raise ConfigError(
            f"model_args={model_args!r} is not allowed; it must be a mapping of keyword "
            f"arguments."
        )
    args = dict(model_args or {})
    both = sorted(set(args) & set(options))
    if both:
        raise ConfigError(f"Model argument(s) {both} are given twice (model_args and options).")
    args.update(options)
    bad = [k for k in args if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ConfigError(f"model_args keys {bad!r} are not allowed; they must be identifiers.")
    model = call_with_job(builder, name, {"input_shape": shape, "num_classes": classes}, args,
                          what="model")
    check_model(model, shape, classes, name=name)
    return model


def num_values(model: nn.Module) -> int:
    """How many values the flat vector of ``model`` has: every floating-point tensor of its
    ``state_dict`` (:mod:`senseshield.engine.params`)."""
    return sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())


def check_weights(weights: Any, expected: int, what: str) -> np.ndarray:
    """``weights`` as a float64 flat vector of ``expected`` finite values; :class:`ConfigError`
    naming ``what`` they are for otherwise."""
    try:
        vector = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"weights for {what} are not an array of numbers.") from None
    if vector.ndim != 1 or vector.size != expected:
        raise ConfigError(
            f"weights of shape {vector.shape} do not fit {what}; it needs a flat vector "
            f"of {expected} values."
        )
    if not np.all(np.isfinite(vector)):
        raise ConfigError(f"weights for {what} contain NaN or infinite values.")
    return vector


def model_with_weights(
    name: str, input_shape: tuple[int, ...], num_classes: int, weights: Any, *,
    model_args: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Model ``name`` (built as :func:`build_model` builds it, with ``model_args``) holding
    ``weights``, a flat vector in the layout of :func:`senseshield.training.get_vector` (a
    run's final model, ``result.models[k]``, or a fleet's ``models/round-R/cluster-K.npy``),
    in eval mode, ready to predict. Weights that do not fit the architecture (a vector of
    another size, e.g. ``model_args`` forgotten) or are not finite raise :class:`ConfigError`
    naming the size needed. The caller's torch RNG state is left untouched."""
    from senseshield.training import set_vector

    with torch.random.fork_rng(devices=[]):  # building draws initial weights, replaced below
        torch.manual_seed(0)
        model = build_model(name, input_shape, num_classes, model_args=model_args)
    what = f"model {name!r} on input shape {tuple(input_shape)} with {num_classes} classes"
    set_vector(model, check_weights(weights, num_values(model), what))
    return model.eval()


def check_model(model: Any, input_shape: tuple[int, ...], num_classes: int, *,
                name: str = "model") -> None:
    """Refuse a ``model`` that is not an ``nn.Module`` mapping ``(2, *input_shape)`` zeros to
    ``(2, num_classes)`` outputs.

    The forward pass runs in eval mode without gradients and with torch's RNG state forked,
    so it changes neither BatchNorm statistics nor the caller's random stream; each
    module's training flag is restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"Model {name!r} returned a {type(model).__name__}, not a torch.nn.Module."
        )
    batch = (2, *input_shape)
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(torch.zeros(batch))
    except Exception as exc:
        raise ConfigError(
            f"Model {name!r} fails on a batch of zeros of shape {batch} (the job's "
            f"input_shape {tuple(input_shape)}): {describe_exception(exc)}."
        ) from exc
    finally:
        for module, training in modes:
            module.training = training
    found = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if found != (2, num_classes):
        raise ConfigError(
            f"Model {name!r} gives output {found} for a batch of shape {batch}; the job has "
            f"num_classes={num_classes}, so it must give a tensor of shape (2, {num_classes})."
        )


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(
            f"input_shape={tuple(input_shape)} is not allowed for model {name!r}; it needs "
            f"images of shape (C, H, W)."
        )
    return input_shape  # type: ignore[return-value]


def _too_small(name: str, shape: tuple[int, int, int], minimum: int) -> ConfigError:
    return ConfigError(
        f"input_shape={shape} is too small for model {name!r}; "
        f"height and width must be at least {minimum}."
    )


@MODELS.register("mlp")
def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The SelectiveShield MLP: flatten -> 256 -> ReLU -> 128 -> ReLU -> classes.

    The fully connected network of the SelectiveShield paper (sensitivity-guided selective
    homomorphic encryption for FL); it accepts inputs of any shape.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(int(np.prod(input_shape)), 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


@MODELS.register("linear")
def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression: flatten -> classes (650 parameters on 8x8 digits).

    The smallest model: for the weakest devices, and for tests that must encrypt every
    parameter with per-value Paillier in seconds.
    """
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))


@MODELS.register("simplecnn")
def simplecnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small two-block CNN: [Conv3x3(pad 1) -> BatchNorm -> ReLU -> MaxPool2]x2 (32, 64
    channels), then Linear(-> 128) -> ReLU -> Linear(-> classes).

    The common "simple CNN" of FL benchmarks (after the two-conv-layer MNIST CNN of McMahan
    et al., 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", here with 3x3 kernels and BatchNorm). The flattened size is computed from the
    input: 64 * (H // 4) * (W // 4); needs H, W >= 4.
    """
    c, h, w = _image_shape("simplecnn", input_shape)
    if min(h, w) < 4:
        raise _too_small("simplecnn", input_shape, 4)

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(c, 32),
        *block(32, 64),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


@MODELS.register("lenet5")
def lenet5(
    input_shape: tuple[int, ...], num_classes: int, *, activation: str = "relu"
) -> nn.Module:
    """LeNet-5 (LeCun et al., 1998, "Gradient-based learning applied to document
    recognition"), in its usual modern form.

    Conv 6@5x5 (pad 2) -> act -> MaxPool2 -> Conv 16@5x5 -> act -> MaxPool2 -> FC 120 ->
    act -> FC 84 -> act -> FC classes. Differences from the original: max pooling instead
    of trainable subsampling, a plain linear output layer instead of RBF units, and
    ``activation`` ("relu" by default, or "sigmoid"/"tanh"; tanh is closest to the
    original). On inputs smaller than 16x16 (e.g. 8x8 digits) the second convolution also
    uses padding 2 so that the feature map does not vanish; 28x28 gives the classic
    16x5x5 = 400 features. Needs H, W >= 4.
    """
    if activation not in _ACTIVATIONS:
        raise ConfigError(
            f"activation={activation!r} is not allowed for 'lenet5'; choose one of: "
            f"{', '.join(sorted(_ACTIVATIONS))}."
        )
    act = _ACTIVATIONS[activation]
    c, h, w = _image_shape("lenet5", input_shape)
    if min(h, w) < 4:
        raise _too_small("lenet5", input_shape, 4)
    pad2 = 2 if min(h, w) < 16 else 0
    # conv1 keeps the size; pool halves; conv2 removes 4 - 2*pad2; pool halves.
    fh, fw = ((h // 2) - 4 + 2 * pad2) // 2, ((w // 2) - 4 + 2 * pad2) // 2
    return nn.Sequential(
        nn.Conv2d(c, 6, 5, padding=2),
        act(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=pad2),
        act(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * fh * fw, 120),
        act(),
        nn.Linear(120, 84),
        act(),
        nn.Linear(84, num_classes),
    )
