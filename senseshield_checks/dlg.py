"""Deep Leakage from Gradients (Zhu, Liu and Han, NeurIPS 2019), written from the paper.

A second gradient-inversion attack, independent of ``senseshield.attacks``, to check the
project's own figures (issue 16, item 3). DLG (the paper's Algorithm 1):

1. draw a dummy input ``x'`` and a dummy label ``y'`` from N(0, 1);
2. the dummy gradient is ``∇W' = ∂ℓ(F(x', W), softmax(y')) / ∂W`` with ``ℓ`` the
   cross-entropy against the soft label ``softmax(y')``, averaged over the batch as the
   client's loss is;
3. minimise the Euclidean distance ``D = ‖∇W' − ∇W‖²`` over ``x'`` and ``y'`` jointly with
   L-BFGS; the dummy input converges to the training input and ``softmax(y')`` to its label.

Against a selectively encrypted update the server knows ``∇W`` only outside the mask, so
``D`` sums over the visible coordinates only: an encrypted coordinate neither helps nor
misleads (its term is absent). The label is optimised, never read from the output layer,
so hiding the output layer does not misdirect DLG the way it misdirects an attack that
takes iDLG's analytic label.

Where this follows the paper and where it does not:

* the algorithm, the N(0, 1) starts, the soft label, the Euclidean distance and L-BFGS
  (history 100, at most 20 evaluations per step, as ``torch.optim.LBFGS`` in the authors'
  code) are the paper's;
* ``D`` is divided by the constant ``‖∇W‖²`` of the visible coordinates, and the attack runs
  in float64 with L-BFGS's own stopping tolerances off: the minimiser is the same, but the
  gradients of a trained or small model are tiny and float32 plus torch's default
  tolerances stop L-BFGS before it starts;
* L-BFGS takes strong-Wolfe line searches (the authors' code takes unit steps without line
  search, which diverged on 2 of 3 digits here);
* the result is clipped to the pixel range [0, 1] for scoring (the paper shows raw
  dummies); ``restarts`` > 1 keeps the start with the lowest final ``D`` (the paper: one).

The model: the paper attacks its own LeNet, sigmoid activations (the attack needs a
twice-differentiable model), three 5x5 convolutions with 12 channels (strides 2, 2, 1) and
one fully connected layer, no pooling: :func:`dlg_lenet`, usable as the fleet's model by its
import path ``senseshield_checks.dlg:dlg_lenet``. On the project's LeNet-5 (max pooling,
three fully connected layers; sigmoid or ReLU) L-BFGS DLG stalls far below 25 dB: the
gradient energy of its convolutions is 1e-8 of the total, so ``D`` is matched long before
the input is (``benchmarks/bench_dlg.py --sections agreement`` measures it).

What is shared with ``senseshield.attacks``: only what defines the target, i.e. the
server's view (:class:`senseshield.attacks.view.ServerView`: the visible update, the
global model it was computed at, the learning rate, the reported sample count) and the
project's flat parameter layout (:func:`senseshield.training.layout_of`) to split the
update into tensors. No matching loss, optimiser, label rule or prior of the project's
attacks is used. Scoring (PSNR, SSIM, identifiability) is shared in the benchmark so that
the two attacks' figures are comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from senseshield.attacks.view import ServerView
from senseshield.errors import ConfigError
from senseshield.training import layout_of

__all__ = ["DLG_LENET", "DLGResult", "DLGSettings", "dlg", "dlg_lenet"]

#: The import path that names :func:`dlg_lenet` as a fleet's model.
DLG_LENET = "senseshield_checks.dlg:dlg_lenet"


def dlg_lenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The LeNet of the DLG paper and its code: Conv 12@5x5 (pad 2, stride 2) -> sigmoid ->
    Conv 12@5x5 (pad 2, stride 2) -> sigmoid -> Conv 12@5x5 (pad 2) -> sigmoid -> FC classes.

    28x28 inputs give 12x7x7 = 588 features (13,426 parameters with 10 classes), 8x8 digits
    12x2x2. torch's default initialisation (the paper's code re-draws weights from
    U(-0.5, 0.5); the fleet here trains the model it builds).
    """
    if len(input_shape) != 3:
        raise ConfigError(
            f"input_shape={tuple(input_shape)} is not allowed for dlg_lenet; it needs images "
            "of shape (C, H, W)."
        )
    c, h, w = (int(d) for d in input_shape)
    fh, fw = (h + 3) // 4, (w + 3) // 4  # two stride-2 convolutions with padding 2, kernel 5
    return nn.Sequential(
        nn.Conv2d(c, 12, 5, padding=2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2, stride=1),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(12 * fh * fw, num_classes),
    )


@dataclass(frozen=True)
class DLGSettings:
    """``steps``: L-BFGS steps (each at most ``evaluations`` gradient evaluations, plus line
    searches); ``history``: L-BFGS memory; ``restarts``: N(0, 1) starts, the lowest final
    distance kept; ``stop``: relative distance at which the match counts as exact (about
    1e-12 is a reconstruction above 60 dB on the DLG LeNet)."""

    steps: int = 100
    evaluations: int = 20
    history: int = 100
    restarts: int = 1
    stop: float = 1e-12

    def __post_init__(self) -> None:
        for name in ("steps", "evaluations", "history", "restarts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} is not allowed; it must be an integer >= 1.")
        if not (isinstance(self.stop, (int, float)) and math.isfinite(self.stop) and self.stop >= 0):
            raise ConfigError(f"stop={self.stop!r} is not allowed; it must be a finite number >= 0.")


@dataclass
class DLGResult:
    """``images``: ``(B, C, H, W)`` float32 in [0, 1]; ``labels``: the argmax of each soft
    label; ``distance``: the final ``D / ‖∇W‖²`` (NaN when nothing was visible);
    ``known``: visible gradient coordinates; ``evaluations``: gradient evaluations used."""

    images: np.ndarray
    labels: np.ndarray
    soft_labels: np.ndarray
    distance: float
    known: int
    evaluations: int


class _Target:
    """The observed gradient ``g = −Δ / (lr · steps)`` per parameter tensor, with the
    indicator of its visible coordinates, and the server's model in float64."""

    def __init__(self, view: ServerView) -> None:
        self.model = view.build_model().double()
        self.model.train()  # the client's mode (no dropout or BatchNorm in the DLG LeNet)
        g = view.gradient()
        segments = {s.name: s for s in layout_of(self.model).segments}
        self.params: list[nn.Parameter] = []
        self.targets: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        for name, p in self.model.named_parameters():
            p.requires_grad_(False)
            seg = segments[name]
            part = g[seg.offset : seg.stop].reshape(seg.shape)
            visible = np.isfinite(part)
            if visible.any():
                p.requires_grad_(True)
                self.params.append(p)
                self.targets.append(torch.as_tensor(np.where(visible, part, 0.0)))
                self.masks.append(torch.as_tensor(visible, dtype=torch.float64))
        self.known = int(sum(int(m.sum()) for m in self.masks))
        self.energy = float(sum(float((t * t).sum()) for t in self.targets))

    def distance(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Σ_visible (∇W' − ∇W)² / Σ_visible ∇W²`` for dummy input ``x``, soft label ``y``."""
        out = self.model(x)
        loss = torch.mean(torch.sum(-torch.softmax(y, dim=-1) * torch.log_softmax(out, dim=-1), dim=-1))
        grads = torch.autograd.grad(loss, self.params, create_graph=True)
        d = sum(((a - t) ** 2 * m).sum() for a, t, m in zip(grads, self.targets, self.masks))
        return d / self.energy


def dlg(view: ServerView, *, settings: DLGSettings | None = None, seed: int = 0) -> DLGResult:
    """Reconstruct the ``view.n_samples`` inputs behind ``view`` (see the module docstring)."""
    settings = settings or DLGSettings()
    target = _Target(view)
    shape = (view.n_samples, *view.input_shape)
    best: DLGResult | None = None
    for restart in range(settings.restarts):
        gen = torch.Generator().manual_seed(int(seed) * 1009 + restart)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        y = torch.randn((view.n_samples, view.num_classes), generator=gen, dtype=torch.float64)
        if target.known == 0 or target.energy == 0:  # blind: nothing to match
            result = _result(x, y, math.nan, target.known, 0)
        else:
            result = _minimise(target, x, y, settings)
        if best is None or (math.isfinite(result.distance) and not result.distance >= best.distance):
            best = result
    assert best is not None
    return best


def _minimise(target: _Target, x: torch.Tensor, y: torch.Tensor, settings: DLGSettings) -> DLGResult:
    x.requires_grad_(True)
    y.requires_grad_(True)
    opt = torch.optim.LBFGS(
        [x, y], lr=1.0, max_iter=settings.evaluations, history_size=settings.history,
        tolerance_grad=0.0, tolerance_change=0.0, line_search_fn="strong_wolfe",
    )
    evaluations = 0

    def closure() -> torch.Tensor:
        nonlocal evaluations
        evaluations += 1
        opt.zero_grad()
        d = target.distance(x, y)
        x.grad, y.grad = torch.autograd.grad(d, [x, y])
        return d.detach()

    good = (x.detach().clone(), y.detach().clone(), math.inf)
    for _ in range(settings.steps):
        opt.step(closure)
        d = _value(target, x, y)
        if not (math.isfinite(d) and torch.isfinite(x).all() and torch.isfinite(y).all()):
            break  # diverged: keep the last finite point
        good = (x.detach().clone(), y.detach().clone(), d)
        if d <= settings.stop:
            break
    gx, gy, gd = good
    if not math.isfinite(gd):
        gd = _value(target, gx, gy)
    return _result(gx, gy, gd, target.known, evaluations)


def _value(target: _Target, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.enable_grad():
        return float(target.distance(x.detach(), y.detach()).detach())


def _result(x: torch.Tensor, y: torch.Tensor, distance: float, known: int, evaluations: int) -> DLGResult:
    soft = torch.softmax(y.detach(), dim=-1).numpy()
    return DLGResult(
        images=x.detach().clamp(0.0, 1.0).numpy().astype(np.float32),
        labels=soft.argmax(axis=1),
        soft_labels=soft,
        distance=float(distance),
        known=known,
        evaluations=evaluations,
    )
