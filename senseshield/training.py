"""The torch side of a client: flat model vectors, local training, evaluation, scoring inputs.

Plain training is deterministic for a given seed (CPU, fixed generators); DP-SGD's sampling
and noise come from the generators its caller passes (secret on a device). The privacy
engine never imports torch; this module turns models into the arrays it works on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from senseshield.engine.params import ParamLayout
from senseshield.engine.sensitivity import ScoreInputs


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
    """Local training hyper-parameters (FedAvg's E, B, η) and the torch threads they run on.

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


def train_local(
    model: nn.Module, x: np.ndarray, y: np.ndarray, config: TrainConfig, *, seed: int
) -> float:
    """Run ``config.epochs`` of minibatch SGD on (x, y), or only the first ``config.max_steps``
    minibatch steps of them (partial work); returns the mean loss of the last epoch run."""
    generator = torch.Generator().manual_seed(seed)
    xs = torch.as_tensor(x)
    ys = torch.as_tensor(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    last, steps = 0.0, 0
    for _ in range(config.epochs):
        order = torch.randperm(len(xs), generator=generator)
        total, batches = 0.0, 0
        for start in range(0, len(xs), config.batch_size):
            if config.max_steps is not None and steps >= config.max_steps:
                break
            steps += 1
            idx = order[start : start + config.batch_size]
            if idx.numel() < 2 and _has_batchnorm(model):
                continue  # BatchNorm cannot train on a batch of one
            optimizer.zero_grad()
            loss = loss_fn(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            batches += 1
        if batches or config.max_steps is None:
            last = total / max(batches, 1)
    return last


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


def mean_gradient(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∇_W L(W) averaged over (x, y), in eval mode (BatchNorm uses running statistics)."""
    layout = layout_of(model)
    model.eval()
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y))
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return _grad_vector(model, grads, layout)


def per_sample_gradients(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, chunk: int = 64
):
    """Yield (per-sample gradient matrix [b, D] float64, b) in chunks, via torch.func.vmap."""
    layout = layout_of(model)
    model.eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

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
    max_samples: int = 256,
) -> ScoreInputs:
    """Compute what the sensitivity scores need, only what ``needs`` asks for.

    The gradient is taken over at most ``max_samples`` local samples (the first ones; the
    caller shuffles), which bounds the cost on large local datasets.
    """
    x, y = x[:max_samples], y[:max_samples]
    layout = layout_of(model)
    weights = get_vector(model).astype(np.float64)
    g = mean_gradient(model, x, y)
    grad_sq = None
    if "grad_sq" in needs:
        acc = np.zeros(layout.size, dtype=np.float64)
        for mat, _ in per_sample_gradients(model, x, y):
            acc += np.sum(mat**2, axis=0)
        grad_sq = acc / max(len(y), 1)
    return ScoreInputs(weights=weights, grad=g, layout=layout, grad_sq=grad_sq, delta=delta)


def private_sketch_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, *, norm: float) -> np.ndarray:
    """Σ_j G · unit(sketch(|W ⊙ g_j|)) over samples j: the DP input of SenseCrypt Alg. 2.

    Per-sample Taylor sensitivity (eq. 2 for one sample), summed per output unit
    (:func:`~senseshield.engine.clustering.output_unit_sketch`), scaled to L2 norm ``norm``
    per sample; the caller adds Gaussian noise (``noisy_mean``).
    """
    from senseshield.engine.clustering import output_unit_sketch, scale_rows

    layout = layout_of(model)
    weights = get_vector(model).astype(np.float64)
    total = None
    for mat, _ in per_sample_gradients(model, x, y):
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
    optimizer = torch.optim.SGD(work.parameters(), lr=config.lr, momentum=config.momentum)
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
    loss_fn = nn.CrossEntropyLoss()
    last = 0.0
    for _ in range(config.epochs):
        total, batches = 0.0, 0
        for xb, yb in loader:
            if len(yb) == 0:
                continue
            optimizer.zero_grad()
            loss = loss_fn(private(xb), yb)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            batches += 1
        last = total / max(batches, 1)
    model.load_state_dict(private._module.state_dict())
    return last, list(engine.accountant.history)


def dpsgd_sample_rate(n_samples: int, batch_size: int) -> float:
    """Opacus' Poisson rate for a DataLoader of ``n_samples`` with ``batch_size``."""
    return 1.0 / max(1, int(np.ceil(n_samples / min(batch_size, n_samples))))
