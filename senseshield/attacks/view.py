"""What an honest-but-curious server observes of one client update: :class:`ServerView`.

The coordinator receives a :class:`~senseshield.engine.aggregation.ProtectedUpdate`: the mask
(which positions are encrypted), the plaintext update outside the mask, a ciphertext it
cannot read, and the client's sample count. It also knows the previous global model (it sent
it), the architecture and the training hyper-parameters it asked for. That is everything
an attack in this package may use; :func:`view_from_update` builds the view from a real
protected update and never touches the ciphertext.

Encrypted positions, and positions a personalising strategy keeps on the device, are
*unknown*: they appear as NaN in :attr:`ServerView.known` and ``True`` in
:attr:`ServerView.unknown`.

For gradient attacks the update of ``local_steps`` full-batch SGD steps with learning rate
``lr`` is ``Δ = −lr · Σ_t g_t``; with one step this is exactly ``g = −Δ / lr``
(:meth:`ServerView.gradient`). With more steps the same formula gives the mean gradient
along the local trajectory, an approximation the attacks inherit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from senseshield.engine.aggregation import ProtectedUpdate
from senseshield.errors import ConfigError
from senseshield.models import build_model
from senseshield.training import layout_of, set_vector

__all__ = ["ServerView", "average_views", "hide", "server_view", "view_from_update"]


@dataclass(frozen=True, eq=False)
class ServerView:
    """The server's view of one client update (see the module docstring).

    ``known``: float64 ``(N,)`` update values, NaN exactly where ``unknown`` is True;
    ``global_vector``: the previous global model (the model the client started from);
    ``model``/``model_options``/``input_shape``/``num_classes``: the architecture, as
    :func:`senseshield.models.build_model` takes it; ``n_samples``: the sample count the
    client reported (the batch size of a one-step update); ``lr`` and ``local_steps``: the
    local SGD settings the server prescribed.
    """

    known: np.ndarray
    unknown: np.ndarray
    model: str
    input_shape: tuple[int, int, int]
    num_classes: int
    global_vector: np.ndarray
    n_samples: int
    lr: float
    local_steps: int = 1
    model_options: dict[str, Any] = field(default_factory=dict)
    client_id: str = ""
    round: int = 0

    def __post_init__(self) -> None:
        known = np.asarray(self.known, dtype=np.float64).ravel()
        unknown = np.asarray(self.unknown)
        if unknown.dtype != np.bool_:
            raise ConfigError(f"unknown must be a boolean array; got dtype {unknown.dtype}.")
        unknown = unknown.ravel()
        glob = np.asarray(self.global_vector, dtype=np.float64).ravel()
        if not (known.size == unknown.size == glob.size):
            raise ConfigError(
                f"known ({known.size}), unknown ({unknown.size}) and global_vector "
                f"({glob.size}) must have one entry per model position."
            )
        if not np.array_equal(np.isnan(known), unknown):
            raise ConfigError(
                "known must be NaN exactly at the unknown positions and finite elsewhere."
            )
        if not np.all(np.isfinite(known[~unknown])) or not np.all(np.isfinite(glob)):
            raise ConfigError("known values and the global vector must be finite.")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr={self.lr!r} is not allowed; it must be a finite number > 0.")
        for name in ("n_samples", "local_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"{name}={value!r} is not allowed; it must be an integer >= 1.")
        object.__setattr__(self, "known", known)
        object.__setattr__(self, "unknown", unknown)
        object.__setattr__(self, "global_vector", glob)
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))

    @property
    def size(self) -> int:
        return int(self.known.size)

    @property
    def unknown_ratio(self) -> float:
        """Share of positions the server cannot read (the HE ratio plus absent positions)."""
        return float(np.count_nonzero(self.unknown)) / self.size if self.size else 0.0

    def gradient(self) -> np.ndarray:
        """``g = −Δ / (lr · local_steps)`` at known positions, NaN elsewhere (float64)."""
        return -self.known / (self.lr * self.local_steps)

    def build_model(self) -> nn.Module:
        """The architecture with the previous global model loaded (what the server holds)."""
        model = build_model(self.model, self.input_shape, self.num_classes, **self.model_options)
        if layout_of(model).size != self.size:
            raise ConfigError(
                f"Model {self.model!r} for inputs {self.input_shape} has {layout_of(model).size} "
                f"positions but the view has {self.size}."
            )
        set_vector(model, self.global_vector)
        return model


def server_view(
    delta: np.ndarray,
    unknown: np.ndarray,
    *,
    global_vector: np.ndarray,
    model: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    n_samples: int,
    lr: float,
    local_steps: int = 1,
    model_options: dict[str, Any] | None = None,
    client_id: str = "",
    round: int = 0,
) -> ServerView:
    """The view of update ``delta`` with the ``unknown`` positions hidden (set to NaN).

    Equal to :func:`view_from_update` of ``protect_update(delta, unknown, key, ...)`` except
    for the float32 rounding of the plaintext part, without paying for the encryption.
    """
    delta = np.asarray(delta, dtype=np.float64).ravel()
    unknown = np.asarray(unknown, dtype=bool).ravel()
    if delta.shape != unknown.shape:
        raise ConfigError(f"delta has {delta.size} values but unknown has {unknown.size}.")
    known = delta.copy()
    known[unknown] = np.nan
    return ServerView(
        known=known,
        unknown=unknown,
        model=model,
        input_shape=input_shape,
        num_classes=num_classes,
        global_vector=global_vector,
        n_samples=n_samples,
        lr=lr,
        local_steps=local_steps,
        model_options=dict(model_options or {}),
        client_id=client_id,
        round=round,
    )


def view_from_update(
    update: ProtectedUpdate,
    *,
    global_vector: np.ndarray,
    model: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    lr: float,
    local_steps: int = 1,
    model_options: dict[str, Any] | None = None,
) -> ServerView:
    """The view of a real protected update: its plaintext part and its sample count.

    The ciphertext is never read: encrypted positions are unknown, and so are withheld
    (personalised) positions, which the client does not send at all.
    """
    known = np.full(update.size, np.nan)
    known[update.plain_positions] = np.asarray(update.plaintext, dtype=np.float64)
    return ServerView(
        known=known,
        unknown=np.isnan(known),
        model=model,
        input_shape=input_shape,
        num_classes=num_classes,
        global_vector=global_vector,
        n_samples=update.n_samples,
        lr=lr,
        local_steps=local_steps,
        model_options=dict(model_options or {}),
        client_id=update.client_id,
        round=update.round,
    )


def hide(view: ServerView, mask: np.ndarray) -> ServerView:
    """``view`` with the ``mask`` positions hidden as well (e.g. another encryption mask)."""
    mask = np.asarray(mask, dtype=bool).ravel()
    if mask.size != view.size:
        raise ConfigError(f"mask has {mask.size} entries; the view has {view.size}.")
    known = view.known.copy()
    known[mask] = np.nan
    return dataclasses.replace(view, known=known, unknown=view.unknown | mask)


def average_views(views: Sequence[ServerView]) -> ServerView:
    """One client's views over several rounds at the same global model, combined as the
    multi-round attacker does: per position, the mean of the values visible in the rounds
    that showed it; unknown where no round did. Fresh zero-mean noise on a fixed update
    averages out as 1/√R; the rest of the first view (model, sample count...) is kept.
    Identical views (an update without fresh noise, sent again) come back as the first one,
    their exact mean.
    """
    views = list(views)
    if not views:
        raise ConfigError("average_views needs at least one view.")
    first = views[0]
    for v in views[1:]:
        if v.size != first.size or not np.array_equal(v.global_vector, first.global_vector):
            raise ConfigError(
                "average_views combines views of one global model; a view of another model "
                f"(or size {v.size} instead of {first.size}) is not allowed."
            )
    if all(np.array_equal(v.unknown, first.unknown) and np.array_equal(v.known, first.known, equal_nan=True)
           for v in views[1:]):
        return first
    seen = np.stack([~v.unknown for v in views])
    total = np.stack([np.where(v.unknown, 0.0, v.known) for v in views]).sum(axis=0)
    count = seen.sum(axis=0)
    unknown = count == 0
    known = np.divide(total, count, out=np.full(first.size, np.nan), where=~unknown)
    return dataclasses.replace(first, known=known, unknown=unknown)
