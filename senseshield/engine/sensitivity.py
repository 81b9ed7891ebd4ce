"""Per-parameter sensitivity scores, registered by name in :data:`SCORES`.

Each score is a pure function of arrays that the trainer computes on the client
(``senseshield.training.score_inputs``). A :class:`Score` declares which inputs it needs so
that the trainer computes only those (per-sample squared gradients cost more than one
backward pass).

=============  ===========================================  =================================
name           formula                                      source
=============  ===========================================  =================================
``taylor``     Γ = |W ⊙ ∇L(W)|                              SenseCrypt eq. 2 (first-order
                                                            Taylor of the zero-out loss change)
``fisher``     F_j = E[(∂ log p(y|x,θ)/∂θ_j)²], then        SelectiveShield eqs. 12-13
               per-layer min-max normalised to [0, 1]
``grad_delta`` s = |∇L(W)| · |ΔW|                           Selective-DP eq. 7
=============  ===========================================  =================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from senseshield.engine.params import ParamLayout
from senseshield.errors import ConfigError
from senseshield.registry import Registry


@dataclass(frozen=True)
class ScoreInputs:
    """What a client can compute about its local model for scoring.

    ``weights``: the flat local model W_i after training; ``grad``: the mean gradient of the
    loss over the client's data at W_i; ``grad_sq``: the mean of per-sample squared
    gradients (empirical Fisher diagonal), or None when not computed; ``delta``: the local
    update W_i − W_global, or None; ``layout``: the flat layout (layers).
    """

    weights: np.ndarray
    grad: np.ndarray
    layout: ParamLayout
    grad_sq: np.ndarray | None = None
    delta: np.ndarray | None = None


@dataclass(frozen=True)
class Score:
    """A registered sensitivity score: ``needs`` names the optional inputs it reads."""

    name: str
    needs: frozenset[str]
    function: Callable[[ScoreInputs], np.ndarray]
    description: str

    def __call__(self, inputs: ScoreInputs) -> np.ndarray:
        for need in self.needs:
            if getattr(inputs, need) is None:
                raise ConfigError(f"Sensitivity score {self.name!r} needs {need!r}, which is missing.")
        out = self.function(inputs)
        if not np.all(np.isfinite(out)):
            raise ValueError(f"Sensitivity score {self.name!r} produced a non-finite value.")
        return out


SCORES: Registry[Score] = Registry("sensitivity score")


def taylor_sensitivity(*, weights: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """SenseCrypt eq. 2: Γ(w) ≈ |wᵀ ∇_W L(W)|, taken per parameter: Γ_k = |w_k · g_k|.

    The first-order Taylor estimate of the loss change when parameter k is zeroed out
    (Optimal Brain Damage style; derivation in SenseCrypt App. M).
    """
    weights = np.asarray(weights, dtype=np.float64)
    grad = np.asarray(grad, dtype=np.float64)
    _same_shape(weights, grad, "weights", "grad")
    return np.abs(weights * grad)


def fisher_sensitivity(*, grad_sq: np.ndarray, layout: ParamLayout) -> np.ndarray:
    """SelectiveShield eqs. 12-13: diagonal Fisher, min-max normalised per layer.

    Eq. 12: I(θ_j) = (1/|D|) Σ_{(x,y)∈D} (∂ log p(y|x;θ) / ∂θ_j)², the mean of per-sample
    squared gradients (``grad_sq``). Eq. 13: Ĩ_j = (I_j − I_min^l) / (I_max^l − I_min^l)
    within each layer l (here: each tensor of the layout). A constant layer (max = min, e.g.
    BatchNorm running statistics with no gradient) normalises to 0.
    """
    grad_sq = np.asarray(grad_sq, dtype=np.float64)
    if grad_sq.shape != (layout.size,):
        raise ValueError(f"grad_sq has shape {grad_sq.shape}; the layout needs ({layout.size},).")
    out = np.zeros_like(grad_sq)
    for part in layout.layer_slices():
        layer = grad_sq[part]
        low, high = float(layer.min()), float(layer.max())
        if high > low:
            out[part] = (layer - low) / (high - low)
    return out


def grad_delta_sensitivity(*, grad: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Selective-DP eq. 7: s_i = G_i · U_i with G = |∂L/∂w| (eq. 6) and U = |Δw|.

    High where a parameter both moved in this round and still drives the loss.
    """
    grad = np.asarray(grad, dtype=np.float64)
    delta = np.asarray(delta, dtype=np.float64)
    _same_shape(grad, delta, "grad", "delta")
    return np.abs(grad) * np.abs(delta)


def edge_layers(layout: ParamLayout) -> tuple[list[slice], list[slice]]:
    """The input layer's and the output layer's tensors (weight and bias): the first and the
    last trainable module, by the ``state_dict`` name's prefix (``conv1.weight`` and
    ``conv1.bias`` are one module)."""
    trainable = [s for s in layout.segments if s.trainable]
    if not trainable:
        return [], []

    def module(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else name

    first, last = module(trainable[0].name), module(trainable[-1].name)
    return ([slice(s.offset, s.stop) for s in trainable if module(s.name) == first],
            [slice(s.offset, s.stop) for s in trainable if module(s.name) == last and last != first])


def _ranks(values: np.ndarray) -> np.ndarray:
    """Percentile ranks in (0, 1]: 1 for the largest value, ties broken by position."""
    order = np.argsort(values, kind="stable")
    out = np.empty(values.size, dtype=np.float64)
    out[order] = np.arange(1, values.size + 1) / values.size
    return out


def leakage_tiers(layout: ParamLayout) -> list[list[slice]]:
    """The tensors :func:`leakage_aware_sensitivity` covers first: the input layer, the output
    layer, and every other layer's bias."""
    first, last = edge_layers(layout)
    biases = [slice(s.offset, s.stop) for s in layout.segments
              if s.trainable and s.name.endswith(".bias") and slice(s.offset, s.stop) not in (*first, *last)]
    return [group for group in (first, last, biases) if group]


def leakage_aware_sensitivity(*, weights: np.ndarray, grad: np.ndarray, layout: ParamLayout) -> np.ndarray:
    """Taylor sensitivity, with the budget spent first where gradient inversion gets its signal.

    Which attacks, and why: iLRG (label restoration) reads the labels from the output layer's
    gradient, and one-image reconstructions (inverting gradients, DLG) are anchored by the
    input layer, whose weight gradient is the input itself weighted by the back-propagated
    error (for a fully connected first layer, x = dW[i, :] / db[i] exactly; for a
    convolution, every patch of the image). The same ratio gives any fully connected layer's
    input from its bias gradient, so every bias is covered too (a few hundred values). These
    tensors carry the largest gradients relative to their weights, yet score low on Taylor
    sensitivity |w * g| because their weights are small (input layer, biases) or few (output
    layer). So their entries rank first here, each group by its own |g| (what a
    gradient-matching attacker matches), as percentile ranks in 1..2 that interleave the
    groups: a budget smaller than all of them takes the same fraction of each, the most
    informative entries first. The rest of the model follows by Taylor sensitivity (ranks
    in 0..1). The split between the two parts follows from the budget alone: these tensors
    first, up to their size (LeNet-5: 1,242 of 61,706 values, 2 %), then SenseCrypt's
    order. Scale-free, so the mask solver's constraints see ranks, not magnitudes. Measured
    in ``benchmarks/bench_attacks.py --sections leakage``: it stops most one-image
    reconstructions where Taylor order does not, not all (docs/results.md, docs/attacks.md)."""
    weights = np.asarray(weights, dtype=np.float64)
    grad = np.asarray(grad, dtype=np.float64)
    _same_shape(weights, grad, "weights", "grad")
    if layout.size != grad.size:
        raise ValueError(f"The layout covers {layout.size} parameters; the gradient has {grad.size}.")
    out = _ranks(np.abs(weights * grad))
    for group in leakage_tiers(layout):
        idx = np.concatenate([np.arange(s.start, s.stop) for s in group])
        out[idx] = 1.0 + _ranks(np.abs(grad[idx]))
    return out


def _same_shape(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {a.shape} but {name_b} has shape {b.shape}.")


SCORES.add(
    "taylor",
    Score(
        "taylor",
        frozenset(),
        lambda s: taylor_sensitivity(weights=s.weights, grad=s.grad),
        "|w * dL/dw| (SenseCrypt eq. 2)",
    ),
)
SCORES.add(
    "fisher",
    Score(
        "fisher",
        frozenset({"grad_sq"}),
        lambda s: fisher_sensitivity(grad_sq=s.grad_sq, layout=s.layout),  # type: ignore[arg-type]
        "diagonal Fisher, per-layer min-max (SelectiveShield eqs. 12-13)",
    ),
)
SCORES.add(
    "grad_delta",
    Score(
        "grad_delta",
        frozenset({"delta"}),
        lambda s: grad_delta_sensitivity(grad=s.grad, delta=s.delta),  # type: ignore[arg-type]
        "|g| * |dw| (Selective-DP eq. 7)",
    ),
)
SCORES.add(
    "leakage",
    Score(
        "leakage",
        frozenset(),
        lambda s: leakage_aware_sensitivity(weights=s.weights, grad=s.grad, layout=s.layout),
        "input and output layers first (by |dL/dw|), then |w * dL/dw|: answers gradient inversion and iLRG",
    ),
)
