"""What a job learns: its task, loss, metric and optimizer, by name or import path.

A job's ``task`` says what the labels are and how a model is judged:

* ``classification``  labels are class indices ``0..num_classes-1``; the model gives
                      ``(n, num_classes)`` logits; loss ``cross_entropy``; metric
                      ``accuracy`` (top-1).
* ``regression``      targets are real numbers, ``(n,)`` or ``(n, num_classes)`` (here
                      ``num_classes`` is the number of targets, 1 for a single value); the
                      model gives ``(n, num_classes)``; loss ``mse`` (or ``mae``, ``huber``);
                      metric ``mse`` (or ``mae``, ``rmse``; lower is better).
* ``multilabel``      targets are 0/1 of shape ``(n, num_classes)`` (several labels may be
                      on); the model gives one logit per label; loss ``bce`` (sigmoid +
                      binary cross-entropy); metric ``label_accuracy`` (the share of labels
                      right) or ``subset_accuracy`` (every label of a sample right).

``loss`` names a loss of :data:`LOSSES` that fits the task or an import path to a callable
``loss(outputs, targets) -> scalar tensor`` (a ``torch.nn.Module`` class is instantiated).
``optimizer`` names a ``torch.optim`` optimizer of :data:`OPTIMIZERS` or an import path to a
callable ``optimizer(params, lr=..., **optimizer_args) -> torch.optim.Optimizer``.

Everything here that a job names is checked by :func:`check_training` with one sentence
naming the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from senseshield.callables import IMPORT_PATH_FORMS, is_import_path, resolve_import_path
from senseshield.errors import ConfigError
from senseshield.registry import Registry

__all__ = ["LOSSES", "METRICS", "OPTIMIZERS", "TASKS", "Task", "check_training", "make_loss",
           "make_optimizer", "task_metrics"]

Metric = Callable[[np.ndarray, np.ndarray], float]  # (outputs, targets) -> value


@dataclass(frozen=True)
class Task:
    """A kind of learning problem: its default loss and metric, the losses and metrics that
    fit it, and whether a larger metric is better."""

    name: str
    loss: str
    metric: str
    losses: tuple[str, ...]
    metrics: tuple[str, ...]
    higher_is_better: bool
    min_outputs: int  # smallest num_classes the task allows


TASKS: Registry[Task] = Registry("task")
TASKS.add("classification", Task("classification", "cross_entropy", "accuracy",
                                 ("cross_entropy",), ("accuracy",), True, 2))
TASKS.add("regression", Task("regression", "mse", "mse", ("mse", "mae", "huber"),
                             ("mse", "mae", "rmse"), False, 1))
TASKS.add("multilabel", Task("multilabel", "bce", "label_accuracy", ("bce",),
                             ("label_accuracy", "subset_accuracy"), True, 1))


def _targets(outputs: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.asarray(y, dtype=np.float64).reshape(np.shape(outputs))


def _accuracy(outputs: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(outputs, axis=1) == np.asarray(y)))


def _mse(outputs: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((np.asarray(outputs, dtype=np.float64) - _targets(outputs, y)) ** 2))


def _mae(outputs: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(outputs, dtype=np.float64) - _targets(outputs, y))))


def _label_hits(outputs: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (np.asarray(outputs) > 0) == (_targets(outputs, y) > 0.5)  # logit > 0: sigmoid > 0.5


#: Metrics by name: ``metric(outputs, targets) -> float`` over a whole test set.
METRICS: Registry[Metric] = Registry("metric")
METRICS.add("accuracy", _accuracy)
METRICS.add("mse", _mse)
METRICS.add("mae", _mae)
METRICS.add("rmse", lambda o, y: float(np.sqrt(_mse(o, y))))
METRICS.add("label_accuracy", lambda o, y: float(np.mean(_label_hits(o, y))))
METRICS.add("subset_accuracy", lambda o, y: float(np.mean(np.all(_label_hits(o, y), axis=1))))


def task_metrics(task: str, outputs: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Every metric of ``task`` on a test set (``outputs``: the model's, numpy); {} when empty."""
    if len(y) == 0:
        return {}
    return {name: METRICS.get(name)(outputs, y) for name in TASKS.get(task).metrics}


def _loss_factory(name: str) -> Callable[[], Any]:
    from torch import nn

    return {"cross_entropy": nn.CrossEntropyLoss, "mse": nn.MSELoss, "mae": nn.L1Loss,
            "huber": nn.HuberLoss, "bce": nn.BCEWithLogitsLoss}[name]


#: Built-in losses by name (each fits the tasks that list it).
LOSSES: tuple[str, ...] = ("bce", "cross_entropy", "huber", "mae", "mse")

#: Built-in optimizers by name: the ``torch.optim`` class of that name.
OPTIMIZERS: dict[str, str] = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop",
                              "adagrad": "Adagrad"}


def _task(task: str) -> Task:
    return TASKS.get(task)


def check_training(*, task: str, loss: str | None, metric: str | None, optimizer: str,
                   custom_evaluate: bool, num_classes: int | None = None) -> None:
    """Refuse a job whose task, loss, metric, optimizer or outputs do not go together (names
    only: import paths are resolved where the training runs)."""
    spec = _task(task)
    if loss is not None and not is_import_path(loss):
        if loss not in LOSSES:
            raise ConfigError(
                f"Unknown loss {loss!r}; choose one of: {', '.join(LOSSES)}, or give an import path "
                f"{IMPORT_PATH_FORMS}.")
        if loss not in spec.losses:
            raise ConfigError(
                f"loss={loss!r} does not fit task {task!r}; it takes {', '.join(spec.losses)} or an "
                f"import path.")
    if metric is not None and not custom_evaluate and metric not in spec.metrics:
        raise ConfigError(
            f"metric={metric!r} is not a metric of task {task!r}; choose one of: "
            f"{', '.join(spec.metrics)} (or return it from your own evaluate function).")
    if not is_import_path(optimizer) and optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"Unknown optimizer {optimizer!r}; choose one of: {', '.join(sorted(OPTIMIZERS))}, or "
            f"give an import path {IMPORT_PATH_FORMS}.")
    if num_classes is not None and num_classes < spec.min_outputs:
        raise ConfigError(
            f"num_classes={num_classes} is not allowed for task {task!r}; it needs at least "
            f"{spec.min_outputs}.")


def make_loss(task: str, loss: str | None) -> Callable[..., Any]:
    """The loss function of a job: ``loss(outputs, targets) -> scalar tensor``."""
    name = loss or _task(task).loss
    if not is_import_path(name):
        return _loss_factory(name)()
    fn = resolve_import_path(name, what="loss")
    if isinstance(fn, type):
        try:
            return fn()
        except Exception as exc:
            from senseshield.callables import describe_exception

            raise ConfigError(f"Loss {name!r} cannot be built without arguments: {describe_exception(exc)}.") from exc
    return fn


def make_optimizer(name: str, params: Any, *, lr: float, args: Mapping[str, Any]) -> Any:
    """The optimizer a job names over ``params`` with learning rate ``lr`` and ``args``."""
    import torch

    if is_import_path(name):
        factory: Any = resolve_import_path(name, what="optimizer")
    else:
        factory = getattr(torch.optim, OPTIMIZERS[name])
    try:
        optimizer = factory(params, lr=lr, **dict(args))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"Optimizer {name!r} does not accept optimizer_args {dict(args)!r}: {str(exc).splitlines()[0]}."
        ) from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"Optimizer {name!r} gave a {type(optimizer).__name__}, not a torch.optim.Optimizer.")
    return optimizer
