"""The torch side of a client: flat model vectors, local training, evaluation, scoring inputs.

Plain training is deterministic for a given seed (CPU, fixed generators); DP-SGD's sampling
and noise come from the generators its caller passes (secret on a device). The privacy
engine never imports torch; this module turns models into the arrays it works on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from senseshield.engine.params import ParamLayout
from senseshield.engine.sensitivity import ScoreInputs
from senseshield.errors import ConfigError
from senseshield.registry import Registry

#: Training and evaluation functions a job can name (``train:``/``evaluate:``); installed
#: packages add theirs under the entry-point group ``senseshield.training``.
TRAINING: Registry[Callable[..., dict]] = Registry("training function", group="senseshield.training")


def layout_of(model: nn.Module) -> ParamLayout:
    """Flat layout of the floating-point entries of ``model.state_dict()``."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    shapes = [
        (name, tuple(t.shape), name in trainable)
        for name, t in model.state_dict().items()
        if t.is_floating_point()
    ]
    return ParamLayout.from_shapes(shapes)


def get_vector(model: nn.Module) -> np.ndarray:
    """The model's floating-point state as one float32 vector (layout order)."""
    parts = [t.detach().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()]
    return torch.cat(parts).to(torch.float32).numpy().copy()


def set_vector(model: nn.Module, vector: np.ndarray) -> None:
    """Load a flat vector produced by :func:`get_vector` (same architecture) into ``model``."""
    vector = torch.as_tensor(np.asarray(vector, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_floating_point():
                continue
            size = tensor.numel()
            tensor.copy_(vector[offset : offset + size].view_as(tensor))
            offset += size
    if offset != vector.numel():
        raise ValueError(f"Vector has {vector.numel()} values; the model has {offset}.")


@dataclass(frozen=True)
class TrainConfig:
    """Local training hyper-parameters (FedAvg's E, B, η), what is learnt (task, loss,
    optimizer, the training and evaluation functions, :mod:`senseshield.tasks`), and the
    torch threads they run on.

    ``threads`` is part of the determinism contract: a threaded CPU kernel splits its
    reductions by thread count (measured on an AMD EPYC: 1 vs 2 threads moved an MLP's
    weights by 4e-8, enough to flip a value across a 15-bit packing step), so a client's
    training and scoring always run on exactly this many threads, in the simulator and on
    a device alike (:func:`torch_threads`).
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    threads: int = 1
    max_steps: int | None = None  # partial work: stop after this many minibatch steps (None: all)
    task: str = "classification"
    loss: str | None = None  # None: the task's (cross_entropy, mse, bce)
    metric: str | None = None  # None: the task's (accuracy, mse, label_accuracy)
    optimizer: str = "sgd"
    optimizer_args: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs
    train: str | None = None  # None: the built-in loop (builtin_train)
    evaluate: str | None = None  # None: the task's metrics on the model's outputs

    @property
    def metric_name(self) -> str:
        from senseshield.tasks import TASKS

        return self.metric or TASKS.get(self.task).metric


@dataclass
class RoundConfig:
    """What a training or evaluation function gets besides the model and the data loader
    (the contract of :func:`builtin_train`): the job's hyper-parameters for this round, the
    optimizer over the model's parameters and the loss, ready to use.

    Use ``optimizer`` and ``loss`` rather than building your own: under DP-SGD, ``optimizer``
    is Opacus' private wrapper of the job's optimizer, which clips and noises every step.
    """

    epochs: int
    batch_size: int
    lr: float
    round: int
    seed: int
    task: str
    metric: str
    optimizer: Any  # torch.optim.Optimizer (None when evaluating)
    loss: Callable[..., Any]
    n_samples: int
    dpsgd: bool = False
    max_steps: int | None = None  # partial work: stop after this many minibatch steps (None: all)


class BatchLoader:
    """A device's data as minibatches of tensors ``(x, y)``: iterating it again gives a new
    epoch, shuffled by its seeded generator (``shuffle``), in batches of ``batch_size``.

    ``len(loader)`` is the number of batches of an epoch. Batches of one sample are skipped
    when ``skip_single`` (BatchNorm cannot train on them).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int | None = None,
                 shuffle: bool = True, skip_single: bool = False) -> None:
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.skip_single = skip_single
        self.generator = torch.Generator().manual_seed(seed if seed is not None else 0)

    def __len__(self) -> int:
        return -(-len(self.y) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.y)
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        for start in range(0, n, self.batch_size):
            idx = order[start : start + self.batch_size]
            if idx.numel() < 2 and self.skip_single:
                continue
            yield self.x[idx], self.y[idx]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on exactly ``n`` torch intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if previous != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


def builtin_train(model: nn.Module, loader: Any, config: RoundConfig) -> dict[str, float]:
    """The built-in training function: ``config.epochs`` passes over ``loader`` with
    ``config.optimizer`` and ``config.loss``; returns ``{"loss": mean loss of the last epoch}``.

    It is also the contract of a training function a job names (``train:``): called as
    ``train(model, loader, config)`` with the model to train in place, the device's data
    loader (:class:`BatchLoader`, or Opacus' Poisson loader under DP-SGD) and the round's
    :class:`RoundConfig`; it returns a dict of float metrics (reported per round and client).
    """
    model.train()
    last, steps = 0.0, 0
    for _ in range(config.epochs):
        total, batches = 0.0, 0
        for xb, yb in loader:
            if config.max_steps is not None and steps >= config.max_steps:
                break
            steps += 1
            config.optimizer.zero_grad()
            loss = config.loss(model(xb), yb)
            loss.backward()
            config.optimizer.step()
            total += float(loss.detach())
            batches += 1
        if batches or config.max_steps is None:
            last = total / max(batches, 1)
    return {"loss": last}


def builtin_evaluate(model: nn.Module, loader: Any, config: RoundConfig) -> dict[str, float]:
    """The built-in evaluation: every metric of the job's task on the model's outputs over
    the test set (:func:`senseshield.tasks.task_metrics`). A job's own ``evaluate`` function
    is called the same way and returns a dict of floats holding at least the job's metric."""
    from senseshield.tasks import task_metrics

    model.eval()
    with torch.no_grad():
        outputs = model(loader.x).numpy() if len(loader.y) else np.zeros((0,))
    return task_metrics(config.task, outputs, loader.y.numpy())


def _round_config(config: TrainConfig, model: nn.Module | None, *, seed: int, round: int, n: int,
                  optimizer: Any = None, dpsgd: bool = False) -> RoundConfig:
    from senseshield.tasks import make_loss, make_optimizer

    if optimizer is None and model is not None:
        optimizer = make_optimizer(config.optimizer, model.parameters(), lr=config.lr,
                                   args=_optimizer_args(config))
    return RoundConfig(config.epochs, config.batch_size, config.lr, round, seed, config.task,
                       config.metric_name, optimizer, make_loss(config.task, config.loss), n, dpsgd,
                       config.max_steps)


def _optimizer_args(config: TrainConfig) -> dict[str, Any]:
    args = dict(config.optimizer_args)
    if config.optimizer == "sgd" and config.momentum and "momentum" not in args:
        args["momentum"] = config.momentum
    return args


def training_function(name: str | None, *, evaluate: bool = False) -> Callable[..., dict]:
    """The ``train`` (or ``evaluate``) function a job names: the built-in one for None, else
    a registered name (:data:`TRAINING`, or an installed package's entry point in group
    ``senseshield.training``) or an import path. A function that cannot be called as
    ``fn(model, loader, config)`` is refused with one sentence."""
    import inspect

    from senseshield.callables import resolve_named

    if name is None:
        return builtin_evaluate if evaluate else builtin_train
    what = "evaluation function" if evaluate else "training function"
    fn = resolve_named(name, TRAINING, what=what)
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ConfigError(
            f"{what.capitalize()} {name!r} has the signature {_signature(fn)}; it must take "
            f"(model, loader, config) and return a dict of metrics."
        ) from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    return fn


def _signature(fn: Any) -> str:
    import inspect

    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def _metrics(out: Any, name: str | None, *, what: str) -> dict[str, float]:
    if out is None:
        return {}
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise ConfigError(
            f"{what.capitalize()} {name!r} returned a {type(out).__name__}; it must return a dict "
            f"of metric names to numbers (or None).")
    try:
        values = {k: float(v) for k, v in out.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{what.capitalize()} {name!r} returned metrics {sorted(out)} that are not "
                          f"all numbers; give floats.") from None
    return values


def fit(model: nn.Module, x: np.ndarray, y: np.ndarray, config: TrainConfig, *, seed: int,
        round: int = 0) -> dict[str, float]:
    """Train ``model`` in place on (x, y) with the job's training function; its metrics.

    The batches are shuffled by ``seed`` (deterministic); the built-in function with the
    default SGD and the task's loss is plain minibatch SGD."""
    loader = BatchLoader(x, y, config.batch_size, seed=seed, skip_single=_has_batchnorm(model))
    fn = training_function(config.train)
    ctx = _round_config(config, model, seed=seed, round=round, n=len(y))
    return _call(fn, config.train, model, loader, ctx, what="training function")


def _call(fn: Callable[..., Any], name: str | None, model: nn.Module, loader: Any, ctx: RoundConfig, *,
          what: str) -> dict[str, float]:
    if name is None:
        return fn(model, loader, ctx)
    from senseshield.callables import describe_exception

    try:
        out = fn(model, loader, ctx)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{what.capitalize()} {name!r} raised {describe_exception(exc)}.") from exc
    return _metrics(out, name, what=what)


def train_local(
    model: nn.Module, x: np.ndarray, y: np.ndarray, config: TrainConfig, *, seed: int, round: int = 0,
) -> float:
    """Run the job's training on (x, y) (:func:`fit`); returns the mean loss of the last
    epoch when the training function reports one (else 0.0)."""
    return float(fit(model, x, y, config, seed=seed, round=round).get("loss", 0.0))


def evaluate_model(model: nn.Module, x: np.ndarray, y: np.ndarray, config: TrainConfig, *,
                   round: int = 0) -> dict[str, float]:
    """The job's evaluation of ``model`` on a test set: a dict holding at least the job's
    metric (``config.metric_name``); {} on an empty set."""
    if len(y) == 0:
        return {}
    fn = training_function(config.evaluate, evaluate=True)
    loader = BatchLoader(x, y, config.batch_size, shuffle=False)
    ctx = _round_config(config, None, seed=0, round=round, n=len(y))
    out = _call(fn, config.evaluate, model, loader, ctx, what="evaluation function")
    return _with_metric(out, config)


def _with_metric(out: dict[str, float], config: TrainConfig) -> dict[str, float]:
    if config.metric_name not in out:
        raise ConfigError(
            f"Evaluation function {config.evaluate or 'built-in'!r} returned {sorted(out)}; the job's "
            f"metric {config.metric_name!r} must be among them.")
    return out


def output_metrics(outputs: np.ndarray, y: np.ndarray, config: TrainConfig) -> dict[str, float]:
    """The built-in evaluation from a model's outputs computed elsewhere (onnxruntime on a
    device); the same figures as :func:`evaluate_model` up to float32 rounding."""
    from senseshield.tasks import task_metrics

    return _with_metric(task_metrics(config.task, outputs, y), config) if len(y) else {}


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of ``model`` on (x, y); 0.0 on an empty set."""
    if len(y) == 0:
        return 0.0
    model.eval()
    with torch.no_grad():
        pred = model(torch.as_tensor(x)).argmax(dim=1).numpy()
    return float(np.mean(pred == np.asarray(y)))


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _grad_vector(model: nn.Module, grads: dict[str, torch.Tensor], layout: ParamLayout) -> np.ndarray:
    """Place parameter gradients into the flat layout (zeros for buffers)."""
    out = np.zeros(layout.size, dtype=np.float64)
    for segment in layout.segments:
        g = grads.get(segment.name)
        if g is not None:
            out[segment.offset : segment.stop] = g.detach().reshape(-1).double().numpy()
    return out


def mean_gradient(model: nn.Module, x: np.ndarray, y: np.ndarray, *, loss: Callable | None = None) -> np.ndarray:
    """∇_W L(W) averaged over (x, y), in eval mode (BatchNorm uses running statistics);
    ``loss``: the job's (default cross-entropy)."""
    loss_of = loss or nn.functional.cross_entropy
    layout = layout_of(model)
    model.eval()
    model.zero_grad()
    value = loss_of(model(torch.as_tensor(x)), torch.as_tensor(y))
    value.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return _grad_vector(model, grads, layout)


def per_sample_gradients(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, chunk: int = 64, loss: Callable | None = None
):
    """Yield (per-sample gradient matrix [b, D] float64, b) in chunks, via torch.func.vmap."""
    layout = layout_of(model)
    model.eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_of(out, yi.unsqueeze(0))

    loss_of = loss or nn.functional.cross_entropy
    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    xs, ys = torch.as_tensor(x), torch.as_tensor(y)
    for start in range(0, len(xs), chunk):
        grads = per_sample(params, xs[start : start + chunk], ys[start : start + chunk])
        b = len(xs[start : start + chunk])
        mat = np.zeros((b, layout.size), dtype=np.float64)
        for segment in layout.segments:
            g = grads.get(segment.name)
            if g is not None:
                mat[:, segment.offset : segment.stop] = g.reshape(b, -1).double().numpy()
        yield mat, b


def score_inputs(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    needs: frozenset[str],
    delta: np.ndarray | None = None,
    max_samples: int = 256,  # senseshield.engine.work.SCORE_SAMPLES
    loss: Callable | None = None,
) -> ScoreInputs:
    """Compute what the sensitivity scores need, only what ``needs`` asks for.

    The gradient (of ``loss``, the job's; default cross-entropy) is taken over at most
    ``max_samples`` local samples (the first ones; the caller shuffles), which bounds the
    cost on large local datasets.
    """
    x, y = x[:max_samples], y[:max_samples]
    layout = layout_of(model)
    weights = get_vector(model).astype(np.float64)
    g = mean_gradient(model, x, y, loss=loss)
    grad_sq = None
    if "grad_sq" in needs:
        acc = np.zeros(layout.size, dtype=np.float64)
        for mat, _ in per_sample_gradients(model, x, y, loss=loss):
            acc += np.sum(mat**2, axis=0)
        grad_sq = acc / max(len(y), 1)
    return ScoreInputs(weights=weights, grad=g, layout=layout, grad_sq=grad_sq, delta=delta)


def private_sketch_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, *, norm: float,
                       loss: Callable | None = None) -> np.ndarray:
    """Σ_j G · unit(sketch(|W ⊙ g_j|)) over samples j: the DP input of SenseCrypt Alg. 2.

    Per-sample Taylor sensitivity (eq. 2 for one sample), summed per output unit
    (:func:`~senseshield.engine.clustering.output_unit_sketch`), scaled to L2 norm ``norm``
    per sample; the caller adds Gaussian noise (``noisy_mean``).
    """
    from senseshield.engine.clustering import output_unit_sketch, scale_rows

    layout = layout_of(model)
    weights = get_vector(model).astype(np.float64)
    total = None
    for mat, _ in per_sample_gradients(model, x, y, loss=loss):
        part = scale_rows(output_unit_sketch(np.abs(mat * weights), layout), norm=norm).sum(axis=0)
        total = part if total is None else total + part
    assert total is not None
    return total


def train_dpsgd(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    config: TrainConfig,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    history: list | None = None,
    sampling_generator: torch.Generator | None = None,
    noise_generator: torch.Generator | None = None,
    round: int = 0,
) -> tuple[float, list]:
    """Record-level DP-SGD (Abadi et al. 2016) on (x, y) through Opacus' PrivacyEngine.

    Poisson-sampled batches of expected size ``config.batch_size``, per-sample clipping to
    ``max_grad_norm``, Gaussian noise ``noise_multiplier · max_grad_norm``. The trained
    weights are copied back into ``model`` (which Opacus never wraps). ``history`` is the
    client's RDP accountant history so far; the extended history is returned with the
    mean loss of the last epoch.

    ``sampling_generator`` draws the Poisson batches and ``noise_generator`` the gradient noise;
    both must be secret for the guarantee to hold against the server (a device passes the ones
    of :meth:`senseshield.device_noise.DeviceNoise.torch_generators`); None seeds each with 63
    bits from the OS CSPRNG.

    The job's optimizer is built and wrapped by Opacus, then the job's training function
    (built-in or its own) runs with the private model, Opacus' loader and that wrapped
    optimizer; a function that changes the model without stepping it is refused.
    """
    import copy
    import secrets
    import warnings

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    if _has_batchnorm(model):
        raise ValueError("DP-SGD needs a model without BatchNorm (use mlp, linear or lenet5).")
    if sampling_generator is None:
        sampling_generator = torch.Generator().manual_seed(secrets.randbits(63))
    if noise_generator is None:
        noise_generator = torch.Generator().manual_seed(secrets.randbits(63))
    work = copy.deepcopy(model)
    work.train()
    from senseshield.tasks import make_optimizer

    optimizer = make_optimizer(config.optimizer, work.parameters(), lr=config.lr, args=_optimizer_args(config))
    loader = DataLoader(
        TensorDataset(torch.as_tensor(x), torch.as_tensor(y)),
        batch_size=min(config.batch_size, len(y)),
        shuffle=True,
        generator=sampling_generator,  # Opacus' Poisson sampler draws from the loader's generator
    )
    engine = PrivacyEngine(accountant="rdp")
    engine.accountant.history = list(history or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, loader = engine.make_private(
            module=work,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=True,
            noise_generator=noise_generator,
        )
    steps = _StepCounter(optimizer)
    before = get_vector(private._module)
    ctx = _round_config(config, None, seed=0, round=round, n=len(y), optimizer=optimizer, dpsgd=True)
    fn = training_function(config.train)
    refusal = None
    try:
        out = _call(fn, config.train, private, _NonEmpty(loader), ctx, what="training function")
    except ConfigError as exc:  # Opacus notices a function that never steps its optimizer
        if steps.count or config.train is None:
            raise
        refusal, out = exc, {}
    steps.restore()
    if refusal is not None or (steps.count == 0 and not np.array_equal(before, get_vector(private._module))):
        raise ConfigError(
            f"Training function {config.train!r} changed the model without config.optimizer.step(), "
            f"so DP-SGD cannot make it private; step the optimizer it is given (Opacus wraps it to "
            f"clip and noise every step) instead of one of its own.") from refusal
    last = float(out.get("loss", 0.0))
    model.load_state_dict(private._module.state_dict())
    return last, list(engine.accountant.history)


class _NonEmpty:
    """Opacus' Poisson loader without its empty batches (a batch of no sample trains nothing)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return (batch for batch in self.loader if len(batch[1]))


class _StepCounter:
    """Counts ``optimizer.step()`` calls (a training function that DP-SGD wraps must make them)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer, self.count = optimizer, 0
        step = optimizer.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return step(*args, **kwargs)

        optimizer.step = counted

    def restore(self) -> None:
        del self.optimizer.step


def dpsgd_sample_rate(n_samples: int, batch_size: int) -> float:
    """Opacus' Poisson rate for a DataLoader of ``n_samples`` with ``batch_size``."""
    return 1.0 / max(1, int(np.ceil(n_samples / min(batch_size, n_samples))))
