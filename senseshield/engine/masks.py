"""SenseCrypt per-client encryption-mask solver (sec. 3.3, eqs. 4-9) and mask helpers.

Problem (one client, sensitivities ``γ ∈ R^N_{>=0}``, budget ``alpha``, mask ``x ∈ {0,1}^N``)::

    min f1(x) = Σ_k x_k                      (eq. 4, HE overhead)
    max f2(x) = Σ_k x_k γ_k                  (eq. 5, protected sensitivity)
    s.t. Σ_k x_k <= K = ⌊alpha N⌋            (eq. 6, budget: no straggling)
         Σ_k x_k γ_k / Σ_k γ_k >= L          (eq. 7, security), L = 1 - C e^{-B alpha}
         I(W; (1 - x) ⊙ W) <= eta_MI         (eq. 8, leakage; optional)

The objectives are normalised as in the paper, ``f̄ = (f - f_min) / (f_max - f_min)``, i.e.
``f̄1 = Σx / N`` and ``f̄2 = Σxγ / Σγ``, and scalarised (eq. 9 and the text after it)::

    min  g(x) = β1 f̄1(x) - β2 f̄2(x) = Σ_k x_k (β1 / N - β2 γ_k / Σγ),   β1, β2 > 0.

**Why a top-k prefix is optimal (eqs. 4-7).** Rank the positions by sensitivity,
descending, ties by lower index first (the *canonical order*; ``T(k)`` = sum of the first
``k``). Every item has unit weight in the budget, so the budget only sees the count
``k = Σx``. For a fixed ``k``, ``g = β1 k / N - β2 f2 / Σγ`` is minimised, and the security
share ``f2 / Σγ`` maximised, by the same mask: the ``k`` most sensitive positions (exchange
argument: swapping a chosen item for a more sensitive unchosen one never lowers ``f2``).
So if any mask of size ``k`` is feasible, the top-``k`` prefix is, and it is the best of its
size. Along prefixes ``g(k + 1) - g(k) = β1 / N - β2 γ_(k+1) / Σγ`` is non-decreasing in ``k``
(``γ_(k)`` is non-increasing), so ``g`` is convex in ``k`` with (smallest) minimiser
``p = #{k : γ_k / Σγ > β1 / (β2 N)}`` (the items of negative scalarised cost). The feasible
counts form the interval ``[m, K]`` with ``m`` the smallest ``k`` with ``T(k) / Σγ >= L``
(``T`` is non-decreasing). Hence the optimum is the prefix of length::

    k* = clamp(p, m, K) = min(max(p, m), K)      (feasible iff m <= K).

This is also the LP-relaxation solution the paper refers to: the greedy LP optimum takes
the first ``p`` items and, if ``T(p) < L Σγ``, a fractional part of item ``m``; rounding that
item up gives ``m``, which is integral-optimal by the convexity above. Ties (equal
sensitivities, or items of exactly zero cost) leave the objective unchanged; we pick the
smallest optimal ``k`` and the lowest indices among equal sensitivities.

**The MI constraint (eq. 8)** is not linear and not part of the LP. On the fixed histogram
binning of :mod:`senseshield.engine.mutual_info`, MI is *provably* non-increasing as the
masked set grows (see that module), so along canonical prefixes the MI-feasible counts are
an interval ``[k_MI, N]`` (``MI(N) = 0 <= eta_MI``). If the prefix ``k*`` leaks too much,
the solver searches the prefixes beyond ``k*`` for ``k_MI`` (a radix search that evaluates
the MI curve at bucket boundaries, exact by monotonicity) and, if ``k_MI <= K``, takes it
and verifies the MI of the final mask directly. The claim we make (and test by brute
force): **the solver returns the canonical top-sensitivity prefix of length**
``max(clamp(p, m, K), k_MI)``, **i.e. the best prefix (scalarised objective, ties to fewer
positions) satisfying all of eqs. 6-8**; when the MI constraint is not binding this is the
exact optimum over all ``2^N`` masks. A non-prefix mask might meet eq. 8 with fewer
positions; we do not search for one (it would protect less sensitivity), so with eq. 8
binding ``feasible=False`` means "no top-sensitivity prefix within the budget is feasible".

**Infeasibility.** The budget is the hard constraint (it prevents straggling); security and
MI are best effort, as the paper implies. If ``m > K`` or ``k_MI > K`` the solver encrypts
the top ``K`` (the full budget), sets ``feasible=False`` and ``violations`` says, per
violated constraint, how many positions it would need and by how much the budget falls
short. **All-zero sensitivity:** ``Σγ = 0`` makes the share in eq. 7 ``0/0``; we treat the
security constraint as met with ``k = 0`` (no position carries sensitivity) and report a
security level of 1.0; the MI constraint, if enabled, still applies.

**Floating point.** Eq. 7 is checked as ``T(k) >= L Σγ - SECURITY_RTOL · Σγ`` so that
summation order cannot make ``L = 1`` (``C = 0``) unreachable; ``K`` uses :func:`budget_count`.

**Blocks.** The solver is generic over any non-negative score vector: to choose whole
blocks (packed HE) pass :func:`block_scores` and expand the result with
:func:`expand_block_mask`; then ``N`` is the number of blocks, ``K = ⌊alpha · #blocks⌋`` and
eq. 8 needs one weight per block (e.g. the block mean) or ``eta_mi=None``.

**Cost.** ``O(N)`` expected, no sort: ``p`` by one comparison pass; ``m`` and the top-``k``
thresholds by radix selection (bincounts over the high bits of the float64 patterns, which
order non-negative floats; only the bucket holding the answer is refined); masks by a value
threshold with ties by index; the MI search by the same radix scheme on MI curves. We do not
use ``np.partition``/``np.argpartition``: numpy's SIMD quickselect takes 15-60 ms on 1e6
values when half or more are equal (zero sensitivities of buffers and dead units are
common), against ~1.5 ms otherwise; radix selection gets faster with duplicates. See
``benchmarks/bench_masks.py``: for N = 1e6 on one core, ~10 ms without eq. 8 and 20-45 ms
with it (np.argsort alone: ~30 ms on the same machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from senseshield.engine.mutual_info import (
    DEFAULT_BINS,
    _edges_of,
    bin_indices,
    mi_from_counts,
    prefix_masked_counts,
)
from senseshield.errors import ConfigError

__all__ = [
    "DEFAULT_B",
    "DEFAULT_C",
    "DEFAULT_ETA_MI",
    "SECURITY_RTOL",
    "MaskSolution",
    "block_scores",
    "budget_count",
    "expand_block_mask",
    "nested_block_masks",
    "required_security",
    "scalarised_objective",
    "security_met",
    "solve_mask",
    "top_fraction_mask",
    "top_k_mask",
]

#: Security-level constants of eq. 7: the paper's CIFAR10 setting (FMNIST: C=0.7, B=1.3;
#: App. F recommends B=1.5, C=0.3 for a client with alpha=0.1).
DEFAULT_C = 0.5
DEFAULT_B = 2.0
#: MI threshold of eq. 8 (paper sec. 4.1), in bits on the 16-bin histogram (<= 4 bits).
DEFAULT_ETA_MI = 2.0
#: Relative slack of the security check: ``T(k) >= (L - SECURITY_RTOL) Σγ``.
SECURITY_RTOL = 1e-12

_BUDGET_RTOL = 1e-13  # ⌊alpha N⌋ forgives float artefacts such as 0.29 * 100 = 28.999...
_SMALL = 2048  # below this many candidates, sort instead of selecting further
_RADIX_BITS = 11  # MI search: at most 2**11 + 1 buckets per level (MI curve per bucket)


# --------------------------------------------------------------------------- validation


def _number(name: str, value: float, allowed: str, ok: Callable[[float], bool]) -> float:
    if isinstance(value, np.generic):
        value = value.item()  # message shows 1.5, not np.float64(1.5)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not allowed; it must be {allowed}.") from None
    if isinstance(value, bool) or not math.isfinite(x) or not ok(x):
        raise ConfigError(f"{name}={value!r} is not allowed; it must be {allowed}.")
    return x


def _alpha(alpha: float, name: str = "alpha") -> float:
    return _number(name, alpha, "a finite number in [0, 1]", lambda x: 0.0 <= x <= 1.0)


def _score_vector(name: str, values: np.ndarray, *, non_negative: bool) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a 1-D array of numbers.") from None
    if arr.ndim != 1:
        raise ConfigError(
            f"{name} must be a 1-D array (one value per position); got shape {arr.shape}."
        )
    ok = np.isfinite(arr).all() and (not non_negative or arr.size == 0 or arr.min() >= 0)
    if not ok:
        bad = ~np.isfinite(arr)
        if non_negative:
            bad |= arr < 0
        i = int(np.flatnonzero(bad)[0])
        allowed = "finite and >= 0" if non_negative else "finite"
        raise ConfigError(
            f"{name}[{i}]={float(arr[i])!r} is not allowed; every value must be {allowed}."
        )
    if np.signbit(arr).any():  # -0.0 would order below +0.0 in the radix keys: make it +0.0
        arr = arr + 0.0
    return arr


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed; it must be an integer >= 1.")
    return int(value)


# --------------------------------------------------------------------------- small formulas


def budget_count(*, alpha: float, n: int) -> int:
    """Eq. 6 budget ``K = ⌊alpha N⌋`` (positions a client may encrypt without straggling).

    The floor forgives a relative float error of 1e-13, so ``alpha=0.29, n=100`` gives 29
    (``0.29 * 100 == 28.999999999999996`` in binary floating point).
    """
    a = _alpha(alpha)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"n={n!r} is not allowed; it must be an integer >= 0.")
    return min(int(n), int(math.floor(a * int(n) * (1.0 + _BUDGET_RTOL))))


def required_security(*, alpha: float, c: float = DEFAULT_C, b: float = DEFAULT_B) -> float:
    """Security level of eq. 7: ``L = 1 - C e^{-B alpha}``, the share of Σγ to encrypt."""
    a = _alpha(alpha)
    cc = _number("c", c, "a finite number >= 0", lambda x: x >= 0)
    bb = _number("b", b, "a finite number >= 0", lambda x: x >= 0)
    return 1.0 - cc * math.exp(-bb * a)


def security_met(*, covered: float, total: float, level: float) -> bool:
    """Eq. 7 as the solver checks it: ``covered >= level · total - SECURITY_RTOL · total``.

    ``total == 0`` (all-zero sensitivity) counts as met.
    """
    if total == 0:
        return True
    return covered >= level * total - SECURITY_RTOL * total


def scalarised_objective(
    mask: np.ndarray, sensitivity: np.ndarray, *, beta1: float = 1.0, beta2: float = 1.0
) -> float:
    """Scalarised eqs. 4-5: ``β1 Σx / N - β2 Σxγ / Σγ`` (second term 0 if Σγ = 0)."""
    g = np.asarray(sensitivity, dtype=np.float64)
    x = np.asarray(mask, dtype=bool)
    if g.size == 0:
        return 0.0
    total = float(g.sum())
    share = float(np.dot(g, x)) / total if total > 0 else 0.0
    return beta1 * int(np.count_nonzero(x)) / g.size - beta2 * share


# --------------------------------------------------------------------------- selection helpers


def _mask_from_threshold(values: np.ndarray, k: int, t: float) -> np.ndarray:
    """The canonical top-``k`` mask given that the ``k``-th largest value is ``t``."""
    mask = values > t
    missing = k - int(np.count_nonzero(mask))
    if missing > 0:
        mask[np.flatnonzero(values == t)[:missing]] = True
    return mask


def _keys(values: np.ndarray) -> np.ndarray:
    """int64 keys with the order of the float64 ``values`` (which must contain no ``-0.0``).

    Non-negative floats already compare like their bit patterns (a free view); negative ones
    get their 63 low bits flipped. The map is its own inverse (see :func:`_value_of`).
    """
    bits = values.view(np.int64)
    if values.size == 0 or values.min() >= 0:
        return bits
    return bits ^ ((bits >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))


def _value_of(key: int) -> float:
    k = np.array([key], dtype=np.int64)
    if key < 0:
        k ^= np.int64(0x7FFFFFFFFFFFFFFF)
    return float(k.view(np.float64)[0])


def _radix_level(
    keys: np.ndarray, radix_bits: int | None = None, span: tuple[int, int] | None = None
) -> tuple[np.ndarray, int] | None:
    """Bucket ``keys`` by their high bits: bucket 0 holds the largest keys, equal keys share
    a bucket; at most ``2**radix_bits + 1`` buckets (default: about ``size / 16``, between
    2**8 and 2**16). ``span`` is ``(min, max)`` of the keys if known. ``None`` if all keys
    are equal."""
    kmin, kmax = span if span is not None else (int(keys.min()), int(keys.max()))
    if kmin == kmax:
        return None
    if radix_bits is None:
        radix_bits = min(max(keys.size.bit_length() - 4, 8), 16)
    shift = max(0, (kmax - kmin).bit_length() - radix_bits)
    top = kmax >> shift
    return top - (keys >> shift), top - (kmin >> shift) + 1


class _Selector:
    """Radix selection over one float64 vector (no ``-0.0``), first level computed once.

    A level buckets the candidates by the high bits of their order-preserving int64 keys
    (:func:`_radix_level`); a bincount and a cumulative sum locate the bucket holding the
    wanted rank or mass, and only that bucket is refined: ``O(N)`` per query, no sort.
    Unlike ``np.partition`` (whose SIMD quickselect takes 15-60 ms on 1e6 values when half
    or more of them are equal, e.g. the zero sensitivities of buffers, against ~1.5 ms
    otherwise) duplicates make it faster, not slower.
    """

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.keys = _keys(values)
        self._level: tuple[np.ndarray, int] | None = None
        self._counts: np.ndarray | None = None
        self._mass: np.ndarray | None = None
        if self.keys.size > _SMALL:
            self._level = _radix_level(
                self.keys, span=(int(self.keys.min()), int(self.keys.max()))
            )

    def kth_largest(self, k: int) -> float:
        """The ``k``-th largest value, ``1 <= k <= size``."""
        cand = self.keys
        level = self._level
        if level is not None and self._counts is None:
            self._counts = np.cumsum(np.bincount(level[0], minlength=level[1]))
        cum = self._counts
        while cand.size > _SMALL:
            if level is None:  # all equal
                return _value_of(int(cand[0]))
            bucket, nbk = level
            assert cum is not None
            q = int(np.searchsorted(cum, k, side="left"))
            if q:
                k -= int(cum[q - 1])
            cand = cand[np.flatnonzero(bucket == q)]
            if cand.size > _SMALL:
                level = _radix_level(cand)
                if level is not None:
                    cum = np.cumsum(np.bincount(level[0], minlength=level[1]))
        return _value_of(int(np.sort(cand)[cand.size - k]))

    def top_k(self, k: int) -> np.ndarray:
        """Canonical top-``k`` mask (largest values, ties by lower index)."""
        n = self.values.size
        if k <= 0:
            return np.zeros(n, dtype=bool)
        if k >= n:
            return np.ones(n, dtype=bool)
        return _mask_from_threshold(self.values, k, self.kth_largest(k))

    def count_to_reach(self, need: float) -> tuple[int, float] | None:
        """Smallest ``j`` whose top-``j`` sum of the (non-negative) values reaches ``need``
        (> 0), with the ``j``-th largest value; ``None`` if the whole sum falls short."""
        keys, vals = self.keys, self.values
        level = self._level
        if level is not None and self._mass is None:
            self._mass = np.cumsum(np.bincount(level[0], weights=vals, minlength=level[1]))
        mass = self._mass
        taken = 0
        while keys.size > _SMALL:
            if level is None:  # all candidates equal v: need ⌈need / v⌉ of them
                v = float(vals[0])
                j = math.ceil(need / v) if v > 0 else keys.size + 1
                while j > 1 and (j - 1) * v >= need:
                    j -= 1
                while j <= keys.size and j * v < need:
                    j += 1
                return (taken + j, v) if j <= keys.size else None
            bucket, nbk = level
            assert mass is not None
            q = int(np.searchsorted(mass, need, side="left"))
            if q >= nbk:
                return None
            if q:
                need -= float(mass[q - 1])
                taken += int(np.count_nonzero(bucket < q))
            inside = np.flatnonzero(bucket == q)
            keys, vals = keys[inside], vals[inside]
            if keys.size > _SMALL:
                level = _radix_level(keys)
                if level is not None:
                    mass = np.cumsum(np.bincount(level[0], weights=vals, minlength=level[1]))
        ordered = np.sort(vals)[::-1]
        i = int(np.searchsorted(np.cumsum(ordered), need, side="left"))
        if i >= ordered.size:
            return None
        return taken + i + 1, float(ordered[i])


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Canonical top-``k`` mask (largest values, ties by lower index) in ``O(N)``."""
    return _Selector(values).top_k(k)


class _MIContext:
    """Binning of the weights, fixed for one solve: MI of any mask from its masked bincount."""

    def __init__(self, weights: np.ndarray, bins: int, mask: np.ndarray) -> None:
        edges = _edges_of(weights, bins)  # weights already validated
        self.bins = bins
        self.idx = bin_indices(weights, edges)
        self.zero_bin = int(bin_indices(np.zeros(1), edges)[0])
        joint = np.bincount(self.idx * 2 + mask, minlength=2 * bins).reshape(bins, 2)
        self.weight_counts = joint.sum(axis=1)
        self.initial_counts = joint[:, 1]  # masked counts of ``mask``

    def masked_counts(self, mask: np.ndarray) -> np.ndarray:
        joint = np.bincount(self.idx * 2 + mask, minlength=2 * self.bins)
        return joint.reshape(self.bins, 2)[:, 1]

    def mi(self, masked_counts: np.ndarray) -> float | np.ndarray:
        return mi_from_counts(self.weight_counts, masked_counts, zero_bin=self.zero_bin)

    def first_prefix_below(
        self, g: np.ndarray, mask: np.ndarray, lo_counts: np.ndarray, eta: float
    ) -> int:
        """Smallest ``k`` whose canonical top-``k`` mask has MI <= eta, given that the
        canonical prefix ``mask`` (of length ``lo``) has MI > eta. Exists: MI(N) = 0.

        Radix search over the canonical order of the unmasked positions. A level buckets
        the candidates by the high bits of their float64 pattern (monotone for values >= 0;
        bucket 0 = largest values; equal values share a bucket), or by position when all
        candidates are tied (ties go lowest index first). One bincount of ``(bucket, W-bin)``
        and a cumulative sum give the masked counts of every bucket boundary, hence the MI
        curve at all boundaries at once (MI is monotone, see ``mutual_info``); the first
        boundary with MI <= eta fixes the bucket holding the answer, and the next level
        looks only inside it. Each level is ``O(#candidates)``, the first one runs on the
        full arrays without gathers; the last few thousand candidates are sorted.
        """
        lo = int(np.count_nonzero(mask))
        seg: np.ndarray | None = None  # candidate positions; None = all positions not in mask
        while seg is None or seg.size > _SMALL:
            vals = g if seg is None else g[seg]
            bins_of = self.idx if seg is None else self.idx[seg]
            bits = vals.view(np.int64)
            kmin, kmax = int(bits.min()), int(bits.max())
            if kmin == kmax and seg is not None:
                # All tied: the canonical order is by position, i.e. the order of ``seg``;
                # bisect it in contiguous chunks.
                shift = max(0, (seg.size - 1).bit_length() - _RADIX_BITS)
                chunk = np.arange(seg.size, dtype=np.int64) >> shift
                nbk = int(chunk[-1]) + 1
                joint = np.bincount(chunk * self.bins + bins_of, minlength=nbk * self.bins)
                cum = np.cumsum(joint.reshape(nbk, self.bins), axis=0)
                curve = np.atleast_1d(self.mi(lo_counts + cum))
                q = int(np.argmax(curve <= eta))
                if q > 0:
                    lo += q << shift
                    lo_counts = lo_counts + cum[q - 1]
                seg = seg[q << shift : (q + 1) << shift]
                continue
            if kmin == kmax:  # all tied and nothing selected yet: chunk by position
                m = vals.size
                nbk = min(m, 1 << _RADIX_BITS)
                bucket = np.arange(m, dtype=np.int64) * nbk // m
            else:
                bucket, nbk = _radix_level(bits, _RADIX_BITS, (kmin, kmax))  # type: ignore[misc]
            if seg is None:
                # Already masked positions are out of the search: count them apart (key
                # arithmetic instead of a boolean scatter, which mispredicts on random masks).
                keys = (bucket * 2 + mask) * self.bins + bins_of
                joint = np.bincount(keys, minlength=2 * nbk * self.bins)
                joint = joint.reshape(nbk, 2, self.bins)[:, 0, :]
            else:
                joint = np.bincount(bucket * self.bins + bins_of, minlength=nbk * self.bins)
                joint = joint.reshape(nbk, self.bins)
            cum = np.cumsum(joint, axis=0)
            curve = np.atleast_1d(self.mi(lo_counts + cum))
            q = int(np.argmax(curve <= eta))  # exists: the last boundary masks everything
            if q > 0:
                lo += int(cum[q - 1].sum())
                lo_counts = lo_counts + cum[q - 1]
            if seg is None:
                seg = np.flatnonzero((bucket == q) & ~mask)
            else:
                seg = seg[np.flatnonzero(bucket == q)]
        vals = g[seg]
        ordered = seg[np.lexsort((seg, -vals))]
        steps = np.arange(1, ordered.size + 1)
        counts = lo_counts + prefix_masked_counts(self.idx[ordered], steps, bins=self.bins)
        curve = np.atleast_1d(self.mi(counts))
        ok = np.flatnonzero(curve <= eta)
        return lo + (int(ok[0]) + 1 if ok.size else ordered.size)


# --------------------------------------------------------------------------- solver


@dataclass(frozen=True)
class MaskSolution:
    """Result of :func:`solve_mask`.

    ``mask`` (bool, ``True`` = encrypt), ``count = Σx``, ``he_ratio = count / N``,
    ``security_level`` = share of Σγ covered (1.0 if Σγ = 0), ``required_security`` =
    ``1 - C e^{-B alpha}``, ``budget`` = ``K``, ``mutual_information`` of the returned mask
    in bits (``None`` if eq. 8 was disabled), ``objective`` = scalarised value,
    ``feasible`` and one-sentence ``violations`` (empty when feasible).
    """

    mask: np.ndarray
    count: int
    he_ratio: float
    security_level: float
    required_security: float
    budget: int
    mutual_information: float | None
    objective: float
    feasible: bool
    violations: list[str] = field(default_factory=list)


def solve_mask(
    sensitivity: np.ndarray,
    *,
    alpha: float,
    weights: np.ndarray | None = None,
    c: float = DEFAULT_C,
    b: float = DEFAULT_B,
    eta_mi: float | None = DEFAULT_ETA_MI,
    beta1: float = 1.0,
    beta2: float = 1.0,
    bins: int = DEFAULT_BINS,
    unit: str = "parameters",
) -> MaskSolution:
    """SenseCrypt mask of one client: SenseCrypt eqs. 4-9 (see the module docstring).

    ``sensitivity`` is ``γ`` (1-D, finite, >= 0; eq. 2 scores or block sums), ``alpha`` the
    client's budget from :func:`senseshield.engine.budgets.encryption_budgets`, ``weights``
    the flat weights ``W`` for eq. 8 (same length; required unless ``eta_mi=None``), ``c``
    and ``b`` the constants of eq. 7, ``eta_mi`` the threshold of eq. 8 in bits on ``bins``
    histogram bins (``None`` disables eq. 8), ``beta1``/``beta2`` > 0 the scalarisation
    weights, ``unit`` the word used in violation messages ("parameters", "blocks").

    Returns the canonical top-sensitivity prefix of length ``max(clamp(p, m, K), k_MI)``
    when that is ``<= K``; otherwise the top ``K`` with ``feasible=False`` and violations.
    Bad input raises :class:`ConfigError`.
    """
    g = _score_vector("sensitivity", sensitivity, non_negative=True)
    a = _alpha(alpha)
    level = required_security(alpha=a, c=c, b=b)
    b1 = _number("beta1", beta1, "a finite number > 0", lambda x: x > 0)
    b2 = _number("beta2", beta2, "a finite number > 0", lambda x: x > 0)
    eta = None
    if eta_mi is not None:
        eta = _number("eta_mi", eta_mi, "None or a finite number >= 0 (bits)", lambda x: x >= 0)
    bins = _positive_int("bins", bins)
    n = g.size
    w = None
    if eta is not None:
        if weights is None:
            raise ConfigError(
                "weights=None is not allowed while eta_mi is set; pass the flat weights for "
                "the MI constraint (eq. 8) or eta_mi=None to disable it."
            )
        w = _score_vector("weights", weights, non_negative=False)
        if w.size != n:
            raise ConfigError(
                f"weights has {w.size} entries but sensitivity has {n}; they must match."
            )
    budget = budget_count(alpha=a, n=n)
    if n == 0:
        return MaskSolution(
            mask=np.zeros(0, dtype=bool), count=0, he_ratio=0.0, security_level=1.0,
            required_security=level, budget=0, mutual_information=None if eta is None else 0.0,
            objective=0.0, feasible=True, violations=[],
        )

    with np.errstate(over="ignore"):
        total = float(g.sum())
    if not math.isfinite(total):  # finite values whose sum overflows: the problem is scale-free
        g = g / float(g.max())
        total = float(g.sum())

    violations: list[str] = []
    top_budget: np.ndarray | None = None  # canonical top-K mask, computed when needed
    selector: _Selector | None = None  # radix selection over g, built when needed

    # ---- eqs. 4-7: k* = clamp(p, m, K) --------------------------------------------------
    if total == 0:
        mask, security_ok = np.zeros(n, dtype=bool), True
    else:
        above = g > (b1 / b2) * total / n  # negative scalarised cost
        p = int(np.count_nonzero(above))
        target = level * total - SECURITY_RTOL * total
        covered_p = float(np.dot(g, above))
        if covered_p >= target and p <= budget:  # m <= p <= K: k* = p, the mask is `above`
            mask, security_ok, needed = above, True, p
        else:
            selector = _Selector(g)
            found = selector.count_to_reach(target) if target > 0 else (0, 0.0)
            needed = None if found is None else found[0]  # m
            security_ok = needed is not None and needed <= budget
            if security_ok and covered_p >= target:  # m <= K < p: k* = K
                mask = top_budget = selector.top_k(budget)
            elif security_ok:  # p < m <= K: k* = m
                assert found is not None
                mask = _mask_from_threshold(g, found[0], found[1])
            else:  # m > K: encrypt the full budget
                mask = top_budget = selector.top_k(budget)
        if not security_ok:
            violations.append(_security_message(needed, budget, n, level, a, unit))

    # ---- eq. 8: smallest prefix >= k* with MI <= eta --------------------------------------
    mutual_information: float | None = None
    if eta is not None:
        assert w is not None
        ctx = _MIContext(w, bins, mask)
        mutual_information = float(ctx.mi(ctx.initial_counts))
        if mutual_information > eta:
            needed_mi = ctx.first_prefix_below(g, mask, ctx.initial_counts, eta)
            if selector is None:
                selector = _Selector(g)
            if security_ok and needed_mi <= budget:
                mask = selector.top_k(needed_mi)
                mutual_information = float(ctx.mi(ctx.masked_counts(mask)))  # verify the pick
            if mutual_information > eta:
                if top_budget is None:
                    top_budget = selector.top_k(budget)
                if mask is not top_budget:
                    mask = top_budget
                    mutual_information = float(ctx.mi(ctx.masked_counts(mask)))
                if mutual_information > eta:
                    violations.append(
                        _mi_message(needed_mi, budget, n, eta, mutual_information, a, unit, bins)
                    )

    count = int(np.count_nonzero(mask))
    covered = float(np.dot(g, mask)) if total > 0 else 0.0
    return MaskSolution(
        mask=mask,
        count=count,
        he_ratio=count / n,
        security_level=covered / total if total > 0 else 1.0,
        required_security=level,
        budget=budget,
        mutual_information=mutual_information,
        objective=b1 * count / n - (b2 * covered / total if total > 0 else 0.0),
        feasible=not violations,
        violations=violations,
    )


def _security_message(
    needed: int | None, budget: int, n: int, level: float, alpha: float, unit: str
) -> str:
    if needed is None:
        return (
            f"security constraint (eq. 7) cannot be met even by encrypting all {n:,} {unit} "
            f"(required share {level:.4g}); the budget allows {budget:,} (alpha={alpha:g})."
        )
    return (
        f"security constraint (eq. 7) needs {needed:,} {unit} (ratio {needed / n:.3g}) to cover "
        f"{level:.4g} of the total sensitivity but the budget allows {budget:,} "
        f"(alpha={alpha:g}); short by {needed - budget:,}."
    )


def _mi_message(
    needed: int, budget: int, n: int, eta: float, mi_at_budget: float, alpha: float, unit: str,
    bins: int,
) -> str:
    return (
        f"MI constraint (eq. 8) needs {needed:,} {unit} (ratio {needed / n:.3g}) to bring "
        f"I(W; (1-X)*W) to <= {eta:g} bits ({bins} bins) but the budget allows {budget:,} "
        f"(alpha={alpha:g}), which leaves {mi_at_budget:.3f} bits; short by {needed - budget:,}."
    )


# --------------------------------------------------------------------------- mask helpers


def top_k_mask(scores: np.ndarray, *, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` highest ``scores`` (finite, any sign); ties: lower index first.

    ``O(N)``: radix selection of the ``k``-th largest value, then a threshold.
    """
    s = _score_vector("scores", scores, non_negative=False)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= s.size:
        raise ConfigError(f"k={k!r} is not allowed; it must be an integer in [0, {s.size}].")
    return _top_k(s, int(k))


def top_fraction_mask(scores: np.ndarray, *, ratio: float) -> np.ndarray:
    """Boolean mask of exactly ``⌊ratio · N⌋`` highest ``scores`` (see :func:`budget_count`).

    Ties are broken deterministically, lower index first. ``ratio`` must be in ``[0, 1]``.
    """
    r = _alpha(ratio, "ratio")
    s = _score_vector("scores", scores, non_negative=False)
    return _top_k(s, budget_count(alpha=r, n=s.size))


def block_scores(scores: np.ndarray, *, block_size: int) -> np.ndarray:
    """Sum of ``scores`` per block of ``block_size`` consecutive positions (last block partial).

    Feed the result to :func:`solve_mask` to choose whole blocks (packed HE); ``N`` is then
    the number of blocks ``⌈len(scores) / block_size⌉``.
    """
    size = _positive_int("block_size", block_size)
    s = _score_vector("scores", scores, non_negative=False)
    if s.size == 0:
        return np.zeros(0)
    return np.add.reduceat(s, np.arange(0, s.size, size))


def expand_block_mask(block_mask: np.ndarray, *, block_size: int, n: int) -> np.ndarray:
    """Per-position mask of length ``n`` from a per-block mask (inverse of the block layout)."""
    size = _positive_int("block_size", block_size)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"n={n!r} is not allowed; it must be an integer >= 0.")
    bm = np.asarray(block_mask)
    if bm.dtype != np.bool_ or bm.ndim != 1:
        raise ConfigError("block_mask must be a 1-D boolean array (one entry per block).")
    blocks = -(-int(n) // size)
    if bm.size != blocks:
        raise ConfigError(
            f"block_mask has {bm.size} entries but n={n} with block_size={size} makes "
            f"{blocks} blocks."
        )
    return np.repeat(bm, size)[: int(n)]


def solve_block_mask(
    sensitivity: np.ndarray,
    *,
    block_size: int,
    alpha: float,
    weights: np.ndarray | None = None,
    c: float = DEFAULT_C,
    b: float = DEFAULT_B,
    eta_mi: float | None = DEFAULT_ETA_MI,
    bins: int = DEFAULT_BINS,
) -> MaskSolution:
    """:func:`solve_mask` at block granularity, for packed HE (one ciphertext per block).

    Eqs. 4-7 are solved on block sensitivities (:func:`block_scores`, N = number of blocks,
    budget ⌊α·blocks⌋); the returned mask is expanded to parameters. Eq. 8 is a property of
    the parameters, so it is checked on the expanded mask: while MI exceeds ``eta_mi`` the
    prefix of most sensitive blocks grows (bisection; MI is non-increasing as positions are
    added, see ``senseshield.engine.mutual_info``) up to the block budget. ``he_ratio`` and
    ``count`` are in parameters; ``budget`` is in blocks.
    """
    block_size = _positive_int("block_size", block_size)
    g = _score_vector("sensitivity", sensitivity, non_negative=True)
    n = g.size
    if block_size == 1:
        return solve_mask(g, alpha=alpha, weights=weights, c=c, b=b, eta_mi=eta_mi, bins=bins)
    per_block = block_scores(g, block_size=block_size)
    solution = solve_mask(per_block, alpha=alpha, c=c, b=b, eta_mi=None, unit="blocks")
    block_mask = solution.mask
    violations = list(solution.violations)
    mutual_information = None
    if eta_mi is not None:
        if weights is None or np.asarray(weights).size != n:
            raise ConfigError("weights of the same length as sensitivity are required while eta_mi is set.")
        from senseshield.engine.mutual_info import masked_mutual_information

        w = np.asarray(weights, dtype=np.float64)

        def mi_of(mask_blocks: np.ndarray) -> float:
            return masked_mutual_information(
                w, expand_block_mask(mask_blocks, block_size=block_size, n=n), bins=bins
            )

        mutual_information = mi_of(block_mask)
        if mutual_information > eta_mi:
            order = np.argsort(-per_block, kind="stable")
            low, high = int(block_mask.sum()), solution.budget
            top = lambda k: np.isin(np.arange(per_block.size), order[:k])  # noqa: E731
            if mi_of(top(high)) > eta_mi:
                block_mask = top(high)
                mutual_information = mi_of(block_mask)
                violations.append(
                    f"MI constraint (eq. 8) is not met within the budget of {high:,} blocks "
                    f"(alpha={alpha:.3g}): MI is {mutual_information:.3g} bits > {eta_mi:g}."
                )
            else:
                while low < high:
                    mid = (low + high) // 2
                    if mi_of(top(mid)) <= eta_mi:
                        high = mid
                    else:
                        low = mid + 1
                block_mask = top(high)
                mutual_information = mi_of(block_mask)
    mask = expand_block_mask(block_mask, block_size=block_size, n=n)
    count = int(mask.sum())
    total = float(g.sum())
    covered = float(np.dot(g, mask)) if total > 0 else 0.0
    return MaskSolution(
        mask=mask,
        count=count,
        he_ratio=count / n if n else 0.0,
        security_level=covered / total if total > 0 else 1.0,
        required_security=solution.required_security,
        budget=solution.budget,
        mutual_information=mutual_information,
        objective=solution.objective,
        feasible=not violations,
        violations=violations,
    )


def nested_block_masks(
    scores: np.ndarray,
    alphas: "list[float] | tuple[float, ...]",
    *,
    block_size: int,
    min_encryptors: int = 2,
    c: float = DEFAULT_C,
    b: float = DEFAULT_B,
) -> list[np.ndarray]:
    """Nested masks of one cluster: every member encrypts a prefix of the same
    ranking, so every encrypted block has at least ``min_encryptors`` encryptors.

    ``scores`` is the cluster's agreed sensitivity (one value per position, >= 0), ``alphas``
    the members' budgets. Member ``i`` encrypts the ``n_i`` most sensitive blocks of that one
    ranking (block sums, ties lower index first: the canonical order of :func:`solve_mask`),
    with ``n_i`` the count :func:`solve_block_mask` picks on ``scores`` at ``alphas[i]`` (eqs.
    4-7; eq. 8 needs a member's own weights and is left out), at least one block for a
    positive budget (the coordinator's floor). Prefixes of one order are nested, so block
    ``j`` has as many encryptors as there are members with ``n_i > rank(j)``; the
    ``min_encryptors - 1`` largest counts are capped at the ``min_encryptors``-th largest, so
    no block is encrypted by fewer (none is sealed, no encryption is wasted). With fewer
    members than ``min_encryptors``, or fewer than that many with a positive budget, the
    counts stay as solved (the blocks fewer encrypt are then sealed by the k rule: a device
    with a budget is never asked to encrypt nothing). Returns one per-position mask per
    member, in ``alphas`` order.
    """
    k = _positive_int("min_encryptors", min_encryptors)
    size = _positive_int("block_size", block_size)
    g = _score_vector("scores", scores, non_negative=True)
    per_block = block_scores(g, block_size=size)
    counts = [
        max(int(solve_mask(per_block, alpha=a, c=c, b=b, eta_mi=None, unit="blocks").count), int(a > 0))
        for a in alphas
    ]
    if len(counts) >= k and per_block.size:
        cap = sorted(counts, reverse=True)[k - 1]
        if cap > 0:
            counts = [min(n, cap) for n in counts]
    selector = _Selector(per_block) if per_block.size else None
    out = []
    for n in counts:
        blocks = selector.top_k(n) if selector is not None else np.zeros(0, dtype=bool)
        out.append(expand_block_mask(np.asarray(blocks, dtype=bool), block_size=size, n=g.size))
    return out


def with_own_blocks(
    mask: np.ndarray,
    own: np.ndarray,
    scores: np.ndarray,
    *,
    alpha: float,
    floor: float = 0.0,
    block_size: int = 1,
) -> tuple[np.ndarray, int]:
    """``mask`` (chosen by someone else: the coordinator's nested prefix) united with the
    device's own protection, and how many blocks that added.

    The device's own protection is ``own`` (the mask its solver picks on its own sensitivity
    at its budget ``alpha``, a prefix of its own ranking of block sums), raised to its
    ``floor`` (``--min-he-ratio``: its most sensitive blocks until that fraction of the
    positions, as :func:`top_up_mask` adds them to an empty mask), and at least its most
    sensitive block for a positive ``alpha``. It is a set, not a fraction: whatever ``mask``
    says, those blocks are encrypted, so a mask can add to a device's protection but never
    replace it (a mask of its least sensitive blocks still leaves its most sensitive ones
    encrypted). ``mask`` is never shrunk; the result is ``mask | protection`` exactly.
    """
    m = np.asarray(mask)
    o = np.asarray(own)
    for name, v in (("mask", m), ("own", o)):
        if v.dtype != np.bool_ or v.ndim != 1:
            raise ConfigError(f"{name} must be a 1-D boolean array (one entry per position).")
    a = _alpha(alpha)
    size = _positive_int("block_size", block_size)
    g = _score_vector("scores", scores, non_negative=True)
    if not m.size == o.size == g.size:
        raise ConfigError(f"mask, own and scores have {m.size}, {o.size} and {g.size} entries; they must match.")
    protection = o | top_up_mask(np.zeros(g.size, dtype=bool), g, fraction=floor, block_size=size)
    if a > 0 and g.size and not protection.any():  # the most sensitive block, ties lower index first
        top = int(np.argmax(block_scores(g, block_size=size)))
        protection[top * size:(top + 1) * size] = True
    added = protection & ~m
    if not added.any():
        return m.copy(), 0
    blocks = int(np.count_nonzero(np.logical_or.reduceat(added, np.arange(0, g.size, size))))
    return m | protection, blocks


def top_fraction_block_mask(scores: np.ndarray, *, ratio: float, block_size: int) -> np.ndarray:
    """:func:`top_fraction_mask` over block sums, expanded to positions (block-aligned)."""
    s = np.asarray(scores, dtype=np.float64)
    if block_size == 1:
        return top_fraction_mask(s, ratio=ratio)
    blocks = top_fraction_mask(block_scores(s, block_size=block_size), ratio=ratio)
    return expand_block_mask(blocks, block_size=block_size, n=s.size)


def top_up_mask(mask: np.ndarray, scores: np.ndarray, *, fraction: float, block_size: int = 1,
                exclude: np.ndarray | None = None) -> np.ndarray:
    """``mask`` plus the highest-scoring whole blocks it lacks, until at least ``fraction`` of
    the positions are selected (a device's own minimum protection, ``--min-he-ratio``).

    Blocks are ``[k * block_size, (k + 1) * block_size)`` (the last one partial); a block
    overlapping ``exclude`` (positions never sent) or already selected is not added. Blocks are
    added in decreasing block score (ties: lower index first), one at a time, so removing the
    last one added would leave the mask below ``fraction``. If every allowed block is taken and
    the fraction is still not reached, that is returned (the caller checks). ``mask`` itself
    is returned unchanged when it already reaches ``fraction``.
    """
    m = np.asarray(mask, dtype=bool)
    r = _alpha(fraction, "fraction")
    n = m.size
    if n == 0 or m.sum() >= r * n:
        return m
    size = _positive_int("block_size", block_size)
    s = _score_vector("scores", scores, non_negative=False)
    if s.size != n:
        raise ConfigError(f"scores has {s.size} entries; the mask has {n}.")
    starts = np.arange(0, n, size)
    taken = np.logical_or.reduceat(m, starts)
    blocked = taken.copy()
    if exclude is not None:
        ex = np.asarray(exclude, dtype=bool)
        if ex.size != n:
            raise ConfigError(f"exclude has {ex.size} entries; the mask has {n}.")
        blocked |= np.logical_or.reduceat(ex, starts)
    order = np.lexsort((np.arange(starts.size), -np.add.reduceat(s, starts)))
    out = m.copy()
    need = int(np.ceil(r * n - 1e-9)) - int(out.sum())
    for b in order:
        if need <= 0:
            break
        if blocked[b]:
            continue
        lo, hi = int(starts[b]), min(int(starts[b]) + size, n)
        out[lo:hi] = True
        need -= hi - lo
    return out
