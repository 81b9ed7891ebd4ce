"""Per-client encryption budgets (SenseCrypt sec. 3.2) and the Gaussian-mechanism noise scale.

Two budget modes:

* :func:`encryption_budgets` -- the paper's max-abs formula over bandwidth and CPU speed;
* :func:`calibrated_budgets` -- predicts every device's round time from its measured
  training time, encryption rate and bandwidth, and picks the budgets so that the predicted
  round times line up (at the time the quickest device needs with budget 1, or under the
  deadline).

:func:`measured_budgets` gives budgets from measured encryption rates and bandwidths, and
:func:`snap_budgets` puts budgets on a geometric grid anchored at 1, so that devices whose
budgets differ by less than the grid's tolerance near the top get the same one.

Pure functions over numpy arrays: no I/O, numeric parameters keyword-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from senseshield.errors import ConfigError

__all__ = [
    "CalibratedBudgets",
    "calibrated_budgets",
    "encryption_budgets",
    "measured_budgets",
    "predicted_round_seconds",
    "sigma_for_epsilon",
    "snap_budgets",
]


def _positive_finite_vector(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as a 1-D float64 array whose entries are all finite and > 0."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a 1-D array of numbers; got {values!r}.") from None
    if arr.ndim != 1:
        raise ConfigError(
            f"{name} must be a 1-D array (one value per client); got shape {arr.shape}."
        )
    bad = np.flatnonzero(~(np.isfinite(arr) & (arr > 0)))
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"{name}[{i}]={float(arr[i])!r} is not allowed; "
            "every value must be finite and > 0."
        )
    return arr


def encryption_budgets(*, bandwidth: np.ndarray, cpu_speed: np.ndarray) -> np.ndarray:
    """Encryption budget ``alpha_i`` of every client of one cluster (SenseCrypt sec. 3.2).

    Max-absolute scaling puts bandwidth ``r`` and CPU speed ``v`` on the same scale,
    the capability of a client is its bottleneck resource, and the capabilities are scaled
    again so that the most capable client gets 1::

        r̄_i = r_i / max_j |r_j|,   v̄_i = v_i / max_j |v_j|,
        c_i = min(r̄_i, v̄_i),
        alpha_i = c_i / max_j |c_j|            (alpha_i ∈ (0, 1], max_i alpha_i = 1)

    ``alpha_i`` is the fraction of the model a client can encrypt without straggling;
    the mask solver turns it into ``⌊alpha_i N⌋`` encrypted positions (eq. 6). The maxima
    run over the clients of *one cluster*: call this once per cluster.

    Both arrays must have the same non-zero length and only finite values > 0; otherwise
    :class:`ConfigError` names the offending index and value. The result is invariant to
    multiplying ``bandwidth`` or ``cpu_speed`` by a positive constant (units do not matter).
    """
    r = _positive_finite_vector("bandwidth", bandwidth)
    v = _positive_finite_vector("cpu_speed", cpu_speed)
    if r.size == 0:
        raise ConfigError("bandwidth and cpu_speed are empty; give one value per client (>= 1).")
    if r.size != v.size:
        raise ConfigError(
            f"bandwidth has {r.size} values but cpu_speed has {v.size}; "
            "both need one value per client."
        )
    capability = np.minimum(r / np.max(np.abs(r)), v / np.max(np.abs(v)))
    return capability / np.max(np.abs(capability))


def measured_budgets(*, encrypt_per_s: np.ndarray, bandwidth: np.ndarray, bytes_per_encrypted: float) -> np.ndarray:
    """Encryption budgets from what the devices measured: values each one encrypts and
    sends per second, relative to the most capable device of the cluster::

        c_i = 1 / (1 / e_i + b / (r_i 10^6)),   alpha_i = c_i / max_j c_j

    ``e_i`` values encrypted per second (measured with the fleet's scheme), ``r_i`` MB/s up,
    ``b`` bytes on the wire per encrypted value. Unlike the paper's ``min(r̄_i, v̄_i)`` the
    two costs add up as they do in a round, so a link far faster than the device can fill
    (every agent on one host: loopback at 45 or 456 MB/s against ~8 bytes per value at
    40,000 values/s) does not decide the budget: a busy moment in the bandwidth probe moves
    alpha by at most ``b e / (r 10^6)``. Invariant to scaling ``e`` (with ``r`` and ``b``
    alike); identical figures give identical budgets. ConfigError names a bad input.
    """
    rate = _positive_finite_vector("encrypt_per_s", encrypt_per_s)
    r = _positive_finite_vector("bandwidth", bandwidth)
    if rate.size == 0 or rate.size != r.size:
        raise ConfigError(f"encrypt_per_s has {rate.size} values and bandwidth {r.size}; both need one per device (>= 1).")
    if not (isinstance(bytes_per_encrypted, (int, float, np.floating)) and math.isfinite(bytes_per_encrypted)
            and bytes_per_encrypted >= 0):
        raise ConfigError(f"bytes_per_encrypted={bytes_per_encrypted!r} is not allowed; it must be a finite number >= 0.")
    seconds = 1.0 / rate + float(bytes_per_encrypted) / (r * 1e6)
    capability = 1.0 / seconds
    return capability / capability.max()


def snap_budgets(alphas: np.ndarray, *, tolerance: float) -> np.ndarray:
    """Budgets snapped to the geometric grid ``1, s^-1, s^-2, ...`` with ``s = (1 + tolerance)^2``:
    every budget goes to the grid level nearest to it in ratio (log distance; halfway between
    two levels, the larger one)::

        k_i = round(log(1 / alpha_i) / log s),   snapped_i = s^(-k_i)

    so a budget moves by at most a factor ``1 + tolerance``, a device whose budget is within
    ``1 + tolerance`` of 1 (the cluster's most capable device) gets 1, and budgets that differ
    by less than that near the top are made equal. Order is kept (a larger budget never snaps
    below a smaller one) and a device at half the top's budget gets about half (``s^-k``
    nearest to 0.5). ``tolerance`` 0 returns the budgets unchanged.

    ``alphas`` must be finite and lie in (0, 1]; ``tolerance`` finite and >= 0; otherwise
    :class:`ConfigError`.
    """
    a = _positive_finite_vector("alphas", alphas)
    if np.any(a > 1):
        i = int(np.flatnonzero(a > 1)[0])
        raise ConfigError(f"alphas[{i}]={float(a[i])!r} is not allowed; budgets lie in (0, 1].")
    if not (isinstance(tolerance, (int, float, np.floating)) and not isinstance(tolerance, bool)
            and math.isfinite(tolerance) and tolerance >= 0):
        raise ConfigError(f"tolerance={tolerance!r} is not allowed; it must be a finite number >= 0.")
    if tolerance == 0:
        return a.copy()
    step = 2.0 * math.log1p(float(tolerance))  # log s
    k = np.ceil(np.log(1.0 / a) / step - 0.5)  # nearest k; a tie goes to the smaller k (larger budget)
    return np.exp(-k * step)


@dataclass(frozen=True)
class CalibratedBudgets:
    """Result of :func:`calibrated_budgets` (arrays have one value per device, in input order)."""

    alphas: np.ndarray  # the budgets, in [floor, 1]
    target_s: float  # T: the predicted round time the budgets line up at
    predicted_s: np.ndarray  # t_i(alpha_i), the predicted round time of every device
    full_s: np.ndarray  # t_i(1): every device's predicted round time with budget 1
    deadline_capped: bool  # T was lowered to headroom x deadline


def _fraction_table(fraction: np.ndarray | None, n: int, grid: np.ndarray) -> np.ndarray:
    """Encrypted fraction f_i(alpha) on ``grid``: alpha itself, or ``fraction`` (one row per
    device, sampled at ``linspace(0, 1, columns)``) interpolated and made non-decreasing."""
    if fraction is None:
        return np.broadcast_to(grid, (n, grid.size))
    try:
        table = np.asarray(fraction, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("fraction must be an array of numbers, one row per device.") from None
    if table.ndim != 2 or table.shape[0] != n or table.shape[1] < 2:
        raise ConfigError(
            f"fraction must have shape (devices, >= 2 budget samples) = ({n}, G); got {table.shape}."
        )
    if not np.all(np.isfinite(table)) or table.min() < 0 or table.max() > 1:
        raise ConfigError("fraction values must be finite and lie in [0, 1] (encrypted share of the model).")
    samples = np.linspace(0.0, 1.0, table.shape[1])
    rows = np.stack([np.interp(grid, samples, row) for row in table])
    return np.maximum.accumulate(rows, axis=1)


def predicted_round_seconds(
    alpha: np.ndarray,
    *,
    fixed_s: np.ndarray,
    encrypt_per_s: np.ndarray,
    bandwidth: np.ndarray,
    size: int,
    bytes_per_encrypted: float,
    bytes_per_plain: float = 4.0,
    fraction: np.ndarray | None = None,
) -> np.ndarray:
    """Predicted seconds from model received to update delivered, per device, at budget ``alpha``::

        t_i(a) = fixed_i + N f_i(a) / enc_i + N (f_i(a) b_enc + (1 - f_i(a)) b_plain) / (r_i 10^6)

    ``fixed_s`` is what does not depend on the budget (training, sensitivity, latency);
    ``encrypt_per_s`` values encrypted per second; ``bandwidth`` r_i in MB/s (10^6 bytes);
    ``f_i`` the encrypted fraction a budget leads to (``fraction``, see
    :func:`calibrated_budgets`; default f(a) = a). Inputs are checked as in
    :func:`calibrated_budgets`.
    """
    fixed, rate, r = _cost_inputs(fixed_s, encrypt_per_s, bandwidth)
    a = np.asarray(alpha, dtype=np.float64)
    if a.shape != fixed.shape or not np.all((a >= 0) & (a <= 1)):
        raise ConfigError(f"alpha must hold one budget in [0, 1] per device ({fixed.size}); got {alpha!r}.")
    n_params = _size(size)
    b_enc, b_plain = _bytes(bytes_per_encrypted, bytes_per_plain)
    table = _fraction_table(fraction, fixed.size, np.linspace(0.0, 1.0, 1001))
    f = np.array([np.interp(a[i], np.linspace(0.0, 1.0, 1001), table[i]) for i in range(fixed.size)])
    return _seconds(f, fixed, rate, r, n_params, b_enc, b_plain)


def _cost_inputs(fixed_s, encrypt_per_s, bandwidth):  # noqa: ANN001, ANN202
    fixed = np.asarray(fixed_s, dtype=np.float64) if np.ndim(fixed_s) else None
    if fixed is None or fixed.ndim != 1 or not np.all(np.isfinite(fixed)) or np.any(fixed < 0):
        raise ConfigError(f"fixed_s must be a 1-D array of finite seconds >= 0 (one per device); got {fixed_s!r}.")
    rate = _positive_finite_vector("encrypt_per_s", encrypt_per_s)
    r = _positive_finite_vector("bandwidth", bandwidth)
    if fixed.size == 0:
        raise ConfigError("No devices: give one value per device (>= 1).")
    if not (fixed.size == rate.size == r.size):
        raise ConfigError(
            f"fixed_s, encrypt_per_s and bandwidth have {fixed.size}, {rate.size} and {r.size} "
            "values; each needs one value per device."
        )
    return fixed, rate, r


def _size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ConfigError(f"size={size!r} is not allowed; the model needs at least 1 parameter.")
    return int(size)


def _bytes(bytes_per_encrypted: float, bytes_per_plain: float) -> tuple[float, float]:
    for name, value in (("bytes_per_encrypted", bytes_per_encrypted), ("bytes_per_plain", bytes_per_plain)):
        if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}={value!r} is not allowed; it must be a finite number >= 0.")
    return float(bytes_per_encrypted), float(bytes_per_plain)


def _seconds(f, fixed, rate, r, n, b_enc, b_plain):  # noqa: ANN001, ANN202
    """t(f) for fractions ``f`` broadcast against the per-device columns."""
    f = np.asarray(f, dtype=np.float64)
    shape = (-1,) + (1,) * (f.ndim - 1)
    fixed, rate, r = fixed.reshape(shape), rate.reshape(shape), r.reshape(shape)
    return fixed + n * f / rate + n * (f * b_enc + (1.0 - f) * b_plain) / (r * 1e6)


def calibrated_budgets(
    *,
    fixed_s: np.ndarray,
    encrypt_per_s: np.ndarray,
    bandwidth: np.ndarray,
    size: int,
    bytes_per_encrypted: float,
    bytes_per_plain: float = 4.0,
    fraction: np.ndarray | None = None,
    deadline_s: float | None = None,
    headroom: float = 0.8,
    floor: float = 0.0,
    resolution: int = 2000,
    slack: float = 0.0,
) -> CalibratedBudgets:
    """Budgets that make the devices' predicted round times line up.

    Every device's round time at budget ``a`` is predicted by :func:`predicted_round_seconds`
    (``fraction[i]`` samples the encrypted fraction f_i at ``linspace(0, 1, G)``: what the
    mask solver encrypts under budget a, which can be less than a when the security
    constraint is met earlier; default f(a) = a). The target is

        T = min( min_i t_i(1),  headroom x deadline_s )

    -- the time of the device that is quickest with budget 1 (it gets 1, as the fastest
    device does under the paper's max-abs formula), lowered to ``headroom`` x the round
    deadline when that is shorter -- and every device gets the largest budget a_i in
    [0, 1] with t_i(a_i) <= T (found on a grid of ``resolution`` steps, then interpolated),
    at least ``floor``. A device whose budget-independent work alone exceeds T gets
    ``floor``: it straggles whatever it encrypts, and ``predicted_s`` says by how much.
    ``slack`` (>= 0) lets every device take ``T x (1 + slack)`` instead of T: devices whose
    predicted times agree within the measurements' tolerance are treated as equal (near the
    top of a flat time curve a 5 % longer prediction would otherwise cost a third of the budget).

    Raises :class:`ConfigError` naming a bad input (lengths differ, a rate or bandwidth
    not finite and > 0, ``headroom`` outside (0, 1], ``floor`` outside [0, 1]).
    """
    fixed, rate, r = _cost_inputs(fixed_s, encrypt_per_s, bandwidth)
    n_params = _size(size)
    b_enc, b_plain = _bytes(bytes_per_encrypted, bytes_per_plain)
    if not (isinstance(headroom, (int, float)) and 0 < headroom <= 1):
        raise ConfigError(f"headroom={headroom!r} is not allowed; it must lie in (0, 1].")
    if not (isinstance(floor, (int, float)) and 0 <= floor <= 1):
        raise ConfigError(f"floor={floor!r} is not allowed; it must lie in [0, 1].")
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ConfigError(f"deadline_s={deadline_s!r} is not allowed; it must be a finite number of seconds > 0.")
    if not isinstance(resolution, int) or resolution < 10:
        raise ConfigError(f"resolution={resolution!r} is not allowed; use an integer >= 10.")
    if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise ConfigError(f"slack={slack!r} is not allowed; it must be a finite number >= 0.")
    grid = np.linspace(0.0, 1.0, resolution + 1)
    table = _fraction_table(fraction, fixed.size, grid)
    times = np.maximum.accumulate(_seconds(table, fixed, rate, r, n_params, b_enc, b_plain), axis=1)
    full = times[:, -1]
    target = float(full.min())
    capped = False
    if deadline_s is not None and headroom * deadline_s < target:
        target, capped = float(headroom * deadline_s), True
    alphas = np.empty(fixed.size)
    limit = target * (1 + slack)
    for i, row in enumerate(times):
        ok = np.flatnonzero(row <= limit * (1 + 1e-12))
        if ok.size == 0:
            alphas[i] = floor
            continue
        k = int(ok[-1])
        if k == grid.size - 1:
            alphas[i] = 1.0
            continue
        # interpolate between grid[k] (feasible) and grid[k + 1] (not) to hit T
        lo, hi = row[k], row[k + 1]
        step = 0.0 if hi <= lo else (limit - lo) / (hi - lo)
        alphas[i] = max(floor, float(grid[k] + min(max(step, 0.0), 1.0) * (grid[1] - grid[0])))
    predicted = np.array([
        np.interp(alphas[i], grid, times[i]) for i in range(fixed.size)
    ])
    return CalibratedBudgets(alphas, target, predicted, full, capped)


def sigma_for_epsilon(*, epsilon: float, delta: float) -> float:
    """Noise multiplier of the classic Gaussian mechanism (SenseCrypt App. G)::

        sigma = sqrt(2 ln(1.25 / delta)) / epsilon

    Adding ``N(0, sigma^2 G^2)`` to a vector of l2-sensitivity ``G`` is (epsilon, delta)-DP.
    Caveat: the classic analysis (Dwork & Roth, Thm. A.1) proves this only for
    ``epsilon < 1``; the paper also uses it at ``epsilon = 1`` and so do we, but for
    ``epsilon >= 1`` the guarantee is not established (the analytic Gaussian mechanism
    would be the rigorous choice there).

    ``epsilon`` must be finite and > 0, ``0 < delta < 1``; otherwise :class:`ConfigError`.
    """
    try:
        eps = float(epsilon)
        dlt = float(delta)
    except (TypeError, ValueError):
        raise ConfigError(
            f"epsilon={epsilon!r} and delta={delta!r} must both be numbers."
        ) from None
    if not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"epsilon={epsilon!r} is not allowed; it must be a finite number > 0.")
    if not (0.0 < dlt < 1.0):
        raise ConfigError(f"delta={delta!r} is not allowed; it must lie strictly between 0 and 1.")
    return math.sqrt(2.0 * math.log(1.25 / dlt)) / eps
