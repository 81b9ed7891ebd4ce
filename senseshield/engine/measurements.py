"""Robust figures from noisy probes, and which devices' figures agree (budget inputs).

A device's bandwidth, CPU and encryption rate are measured with several probes
(:func:`summarise`): the median is the figure, and ``[min, max]`` of ``n`` probes is a
distribution-free confidence interval for the true median with coverage
``1 - 2 * 0.5**n`` (94 % for 5 probes) -- the chance that all probes fall on one side of
it. Devices whose intervals overlap (each widened by a relative ``tolerance``) cannot be
told apart by their measurements: :func:`agreeing_groups` puts them in one group and
:func:`pool_agreeing` gives every member the group's median, so identical devices get
identical figures however the probes scattered.

Pure functions over numpy arrays: no I/O, numeric parameters keyword-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from senseshield.errors import ConfigError

__all__ = ["Spread", "agreeing_groups", "pool_agreeing", "summarise"]


@dataclass(frozen=True)
class Spread:
    """Summary of ``probes`` samples of one figure (see :func:`summarise`)."""

    median: float
    low: float  # min of the probes
    high: float  # max of the probes
    q1: float  # 25th percentile (linear interpolation)
    q3: float  # 75th percentile
    probes: int

    @property
    def rel_iqr(self) -> float:
        """(q3 - q1) / median: the relative spread of the middle half of the probes."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else math.inf

    @property
    def confidence(self) -> float:
        """Coverage of ``[low, high]`` as an interval for the true median: 1 - 2 * 0.5**n."""
        return 1.0 - 2.0 * 0.5**self.probes

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.low, "max": self.high, "q1": self.q1, "q3": self.q3,
                "probes": self.probes, "rel_iqr": self.rel_iqr, "confidence": self.confidence}


def summarise(samples: np.ndarray) -> Spread:
    """Median, min, max and quartiles of ``samples`` (finite values >= 0, at least one).

    ConfigError names the first bad sample.
    """
    try:
        x = np.asarray(samples, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ConfigError(f"samples must be numbers; got {samples!r}.") from None
    if x.size == 0:
        raise ConfigError("No samples to summarise; a measurement needs at least one probe.")
    bad = np.flatnonzero(~(np.isfinite(x) & (x >= 0)))
    if bad.size:
        raise ConfigError(f"samples[{int(bad[0])}]={float(x[bad[0]])!r} is not allowed; probes must be finite and >= 0.")
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return Spread(float(med), float(x.min()), float(x.max()), float(q1), float(q3), int(x.size))


def _bounds(values: np.ndarray, low: np.ndarray, high: np.ndarray, tolerance: float | np.ndarray) -> tuple[np.ndarray, ...]:
    v = np.asarray(values, dtype=np.float64)
    lo = np.asarray(low, dtype=np.float64)
    hi = np.asarray(high, dtype=np.float64)
    if v.ndim != 1 or lo.shape != v.shape or hi.shape != v.shape:
        raise ConfigError(
            f"values, low and high need one entry per device; got shapes {v.shape}, {lo.shape}, {hi.shape}."
        )
    try:
        tol = np.broadcast_to(np.asarray(tolerance, dtype=np.float64), v.shape)
    except (TypeError, ValueError):
        raise ConfigError(f"tolerance={tolerance!r} is not allowed; give one number >= 0, or one per device.") from None
    if not np.all(np.isfinite(tol) & (tol >= 0)):
        raise ConfigError(f"tolerance={tolerance!r} is not allowed; it must be finite and >= 0.")
    ok = np.isfinite(v) & np.isfinite(lo) & np.isfinite(hi) & (lo > 0) & (lo <= v) & (v <= hi)
    bad = np.flatnonzero(~ok)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"Device {i} has value {float(v[i])!r} with interval [{float(lo[i])!r}, {float(hi[i])!r}]; "
            "values must be finite and > 0 and lie in their interval."
        )
    return v, lo / (1.0 + tol), hi * (1.0 + tol)


def agreeing_groups(
    values: np.ndarray, *, low: np.ndarray, high: np.ndarray, tolerance: float | np.ndarray = 0.0
) -> np.ndarray:
    """Group label per device: devices are joined when their intervals
    ``[low / (1 + tolerance), high * (1 + tolerance)]`` overlap (``tolerance``: one number,
    or one per device), and groups are the connected
    components of that relation (a chain of overlapping intervals is one group). Labels are
    0, 1, ... in increasing order of the groups' lowest bound. Give ``low = high = values``
    for exact figures (they join only what their own interval touches).
    """
    v, lo, hi = _bounds(values, low, high, tolerance)
    labels = np.empty(v.size, dtype=np.int64)
    if v.size == 0:
        return labels
    order = np.lexsort((hi, lo))
    label, reach = 0, hi[order[0]]
    for i in order:  # sweep by lower bound: a gap before an interval starts a new group
        if lo[i] > reach:
            label += 1
            reach = hi[i]
        reach = max(reach, hi[i])
        labels[i] = label
    return labels


def pool_agreeing(
    values: np.ndarray, *, low: np.ndarray, high: np.ndarray, tolerance: float | np.ndarray = 0.0
) -> np.ndarray:
    """``values`` with every device's value replaced by the median of its group's values
    (:func:`agreeing_groups`): devices the measurements cannot tell apart get one figure.
    A device alone in its group keeps its value."""
    v = np.asarray(values, dtype=np.float64)
    labels = agreeing_groups(v, low=low, high=high, tolerance=tolerance)
    out = v.copy()
    for g in np.unique(labels):
        members = labels == g
        out[members] = float(np.median(v[members]))
    return out
