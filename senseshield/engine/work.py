"""Local work that fits the round (partial work) and robust per-device speeds.

A device whose full local training would make it straggle trains fewer local steps
(FedProx's "partial work", FedNova's heterogeneous local steps). Three pure pieces:

* :func:`recent_median` -- a device's figure from its last ``k`` rounds (median: one busy
  round does not move it);
* :func:`step_seconds` -- a device's seconds per local step and the training time that does
  not shrink with the steps, from its last rounds;
* :func:`device_work` -- both of a device's figures for the planner, from its delivered
  rounds' timings (which rounds, which phases);
* :func:`local_steps` -- how many local steps each device trains so that its predicted round
  time stays within ``limit`` x the quickest device's full round (and under a deadline);
* :func:`step_scale` -- FedNova's normalisation of a device's update for the aggregate.

How partial updates are weighted. By default a partial update is sent as trained and keeps
its sample-count weight ``n_i`` (FedProx's gamma-inexact local solutions, Li et al. 2020):
a device never counts by its speed -- a fast device gets no more weight than its data, and a
slow one no less -- only the slow device's step is shorter. That is not FedNova's exact
correction: on non-IID data a device doing a tenth of the steps moves the model less per round
(FedNova's "objective inconsistency"), bounded here because only devices beyond the straggle
limit are cut and they keep their whole data weight. FedNova's normalisation
(``options.partial_fednova``, :func:`step_scale`) removes that in expectation but extrapolates
a few early steps by ``full / steps``: measured on digits/MLP with one device 20x slower it
diverged (accuracy 0.70 after 20 rounds against 0.97 waiting for everyone; sent as trained:
0.96), so it is opt-in.

Why FedNova's normalisation is unbiased (Wang et al. 2020, eq. 6 with tau_eff = tau):
a device that ran ``s_i`` of the ``tau`` planned steps sends ``delta_i * tau / s_i`` (its
*normalised* update ``delta_i / s_i``, the mean step it took, times the planned step count)
and keeps its sample-count weight ``n_i``. The server's weighted mean
``sum_i n_i (tau / s_i) delta_i / sum_i n_i`` is then ``tau`` times the ``n_i``-weighted mean
of the devices' average steps: every device counts by its data, not by how many steps it
managed, so the model is not pulled towards fast devices (plain FedAvg over partial updates
would weight device i by ``n_i s_i``). With everyone at ``s_i = tau`` the scale is exactly 1
and the round is FedAvg, bit for bit. FedNova's other choice, ``tau_eff = sum_i p_i s_i``,
only rescales the server step; ``tau_eff = tau`` needs no server-side change (the blind
aggregation and the key server are untouched).

Pure functions over numpy arrays: no I/O, numeric parameters keyword-only.
"""

from __future__ import annotations

import math

import numpy as np

from senseshield.errors import ConfigError

__all__ = ["device_work", "full_steps", "local_steps", "recent_median", "step_scale", "step_seconds"]


def recent_median(values, *, k: int = 5) -> float | None:  # noqa: ANN001
    """Median of the last ``k`` finite values > 0 of ``values`` (oldest first); None if
    there are none. One slow (or fast) round among ``k`` never moves it past its neighbours:
    it lies between the smallest and the largest of the window."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k={k!r} is not allowed; the window needs at least 1 round.")
    kept = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not kept:
        return None
    return float(np.median(kept[-k:]))


def step_seconds(train_s, steps, *, k: int = 5) -> tuple[float, float] | None:  # noqa: ANN001
    """``(fixed, per_step)`` seconds of a device's local training from its last ``k`` rounds
    (oldest first; rounds with a train time or step count not > 0 are left out): ``train =
    fixed + steps x per_step``. With two or more distinct step counts in the window, the
    least-squares line (a device trained 1 step in one round and 20 in another: the 1-step
    round's time is mostly the fixed part, not one slow step); its intercept is clipped to
    [0, min train] and the slope then refitted, and never taken below half the smallest
    train / steps of the window (an upper bound of the true per-step time): under a CPU
    quota, 4 steps and 1 step can take the same 100-ms periods, the line then puts the whole
    round into the fixed part, and the planner gave that device 62 steps (a 25x round,
    bench_straggle with LeNet-5). With one step count (or a slope <= 0): fixed 0 and the
    median of train / steps. None without a usable round."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k={k!r} is not allowed; the window needs at least 1 round.")
    pairs = [(float(t), float(s)) for t, s in zip(train_s, steps)
             if isinstance(t, (int, float)) and isinstance(s, (int, float)) and math.isfinite(t) and t > 0 and s > 0]
    pairs = pairs[-k:]
    if not pairs:
        return None
    t = np.array([p[0] for p in pairs])
    n = np.array([p[1] for p in pairs])
    if np.unique(n).size >= 2:
        slope, intercept = np.polyfit(n, t, 1)
        if slope > 1e-9 * float(np.max(t)) / float(np.max(n)):  # not a flat line's rounding noise (unit-free)
            fixed = float(min(max(intercept, 0.0), t.min()))
            per_step = float(np.sum((t - fixed) * n) / np.sum(n * n))  # least squares through (0, fixed)
            per_step = max(per_step, 0.5 * float(np.min(t / n)))
            fixed = float(min(fixed, max(t.min() - n[np.argmin(t)] * per_step, 0.0)))
            if per_step > 0:
                return fixed, per_step
    return 0.0, float(np.median(t / n))


SCALED_PHASES = ("train", "sensitivity")
"""The phases of a device's round that grow with its local steps: training, and scoring
sensitivity (a partial round scores the samples it trained on, :func:`score_samples`)."""


def device_work(rounds, *, k: int = 5) -> tuple[float, float] | None:  # noqa: ANN001
    """``(per_step, other)`` seconds of a device for :func:`local_steps`, from its delivered
    rounds ``[(round, phases, steps, busy_s)]`` (oldest first; ``phases``: the agent's phase
    seconds, ``busy_s``: plan in hand to update received, None if unknown): per step and the
    fixed part (:func:`step_seconds`) of the work that grows with the steps
    (:data:`SCALED_PHASES`), and the median of what the round took beyond it plus that fixed
    part. Round 1 (it warms torch up) counts in the steps' fit until two later rounds are there,
    in the other work only while there is no later round: a single later
    round under a CPU quota can fit its one step into what is left of a 100-ms period (8 ms
    where steps take 60 ms), and planned from it alone the next round got 16 steps (a 7x
    round, bench_straggle with LeNet-5). None without a usable round."""
    # (round, seconds that grow with the steps, steps, the phases, busy_s) of the usable rounds
    usable = [(r, t, n, ph, b) for r, ph, n, b in rounds
              if n and (t := sum(ph.get(x, 0.0) for x in SCALED_PHASES)) > 0]
    if sum(1 for r, *_ in usable if r > 1) >= 2:
        usable = [x for x in usable if x[0] > 1]
    usable = usable[-k:]
    fit = step_seconds([t for _, t, *_ in usable], [n for _, _, n, *_ in usable], k=k)
    if fit is None:
        return None
    later = any(r > 1 for r, *_ in usable)  # round 1's other work is its warm-up's: left out when it can be
    beyond = [b - t if b is not None else sum(ph.get(x, 0.0) for x in ("mask", "noise", "encrypt"))
              for r, t, _, ph, b in usable if r > 1 or not later]
    return fit[1], (recent_median(beyond, k=k) or 0.0) + fit[0]


def full_steps(n_samples: int, *, batch_size: int, epochs: int) -> int:
    """Local steps of full work: ``epochs x ceil(n_samples / batch_size)`` minibatches."""
    for name, value in (("n_samples", n_samples), ("batch_size", batch_size), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name}={value!r} is not allowed; it must be an integer >= 1.")
    return int(epochs) * -(-int(n_samples) // int(batch_size))


SCORE_SAMPLES = 256  # the most local samples a round's sensitivity score reads


def score_samples(steps: int | None, full: int, *, batch_size: int, cap: int = SCORE_SAMPLES) -> int:
    """How many local samples the round's sensitivity score reads
    (:func:`senseshield.training.score_inputs`): ``cap`` for full work; under partial work
    (``steps`` < ``full``) as many as the round trained on, ``steps x batch_size`` (at least
    one batch, at most ``cap``). The score is a gradient pass over those samples, so a device
    planned to train less also scores less: on a device 20x slower, scoring 256 samples cost
    12x its one planned step (LeNet-5, bench_straggle)."""
    if steps is None or steps >= full:
        return int(cap)
    return int(min(cap, max(batch_size, int(steps) * int(batch_size))))


def local_steps(
    *,
    step_s: np.ndarray,
    other_s: np.ndarray,
    full: np.ndarray,
    limit: float | None,
    deadline_s: float | None = None,
    headroom: float = 0.8,
    margin: float = 1.0,
    min_steps: int = 1,
    measured_in_full: np.ndarray | None = None,
) -> np.ndarray:
    """Local steps per device so that no device's predicted round is much longer than the
    quickest one's.

    Device i's round with ``s`` steps is predicted as ``other_s[i] + s * step_s[i]`` (seconds
    per step and the work that does not shrink with the steps: encryption, upload, ...;
    any common unit). The target is

        T = min( max(margin x limit, 1) x min_i (other_s[i] + full[i] step_s[i]),  headroom x deadline_s )

    (a term is left out when ``limit`` or ``deadline_s`` is None; no term: everyone trains
    ``full``). Device i trains ``floor((T - other_s[i]) / step_s[i])`` steps, clipped to
    ``[min(min_steps, full[i]), full[i]]``, and in full when its whole training fits in the
    target's slack over the quickest device's full round (``full[i] step_s[i] <= T -
    quickest``): if its other work alone passes ``T``, fewer cheap steps would not make its
    round much shorter. That rule needs ``step_s[i]`` measured at full work
    (``measured_in_full[i]``, default all True): a device's seconds per step measured on one or
    two steps do not extrapolate under a CPU quota (one MLP step fits into what is left of a
    100-ms period; 23 of them took 0.9 s, a 9x round). ``margin`` (in (0, 1]) plans below the limit when the times are measured: a
    round's straggling compares its slowest device's round to that round's quickest, and both
    vary from round to round around the medians the prediction uses (1: the declared speeds
    of the simulator, exact). The quickest device always trains in full when
    ``limit >= 1`` and the deadline allows it; steps never grow when a device gets slower;
    scaling every time by one factor changes nothing (without a deadline).
    ConfigError names a bad input.
    """
    step = np.asarray(step_s, dtype=np.float64)
    other = np.asarray(other_s, dtype=np.float64)
    planned = np.asarray(full)
    if step.ndim != 1 or step.size == 0 or other.shape != step.shape or planned.shape != step.shape:
        raise ConfigError(f"step_s, other_s and full need one value per device; got shapes "
                          f"{step.shape}, {other.shape} and {planned.shape}.")
    if not np.all(np.isfinite(step) & (step > 0)):
        raise ConfigError(f"step_s={step_s!r} is not allowed; seconds per step must be finite and > 0.")
    if not np.all(np.isfinite(other) & (other >= 0)):
        raise ConfigError(f"other_s={other_s!r} is not allowed; seconds must be finite and >= 0.")
    if not (np.issubdtype(planned.dtype, np.integer) and np.all(planned >= 1)):
        raise ConfigError(f"full={full!r} is not allowed; full work is an integer number of steps >= 1.")
    if limit is not None and not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit >= 1):
        raise ConfigError(f"straggle limit {limit!r} is not allowed; it must be a number >= 1 (or None: off).")
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ConfigError(f"deadline_s={deadline_s!r} is not allowed; it must be a finite number of seconds > 0.")
    if not (isinstance(headroom, (int, float)) and 0 < headroom <= 1):
        raise ConfigError(f"headroom={headroom!r} is not allowed; it must lie in (0, 1].")
    if not (isinstance(margin, (int, float)) and 0 < margin <= 1):
        raise ConfigError(f"margin={margin!r} is not allowed; it must lie in (0, 1].")
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        raise ConfigError(f"min_steps={min_steps!r} is not allowed; it must be an integer >= 1.")
    planned = planned.astype(np.int64)
    targets = []
    quickest = float(np.min(other + planned * step))
    if limit is not None:
        targets.append(max(float(margin) * float(limit), 1.0) * quickest)
    if deadline_s is not None:
        targets.append(headroom * float(deadline_s))
    if not targets:
        return planned.copy()
    target = min(targets)
    fit = np.floor((target - other) / step * (1 + 1e-12))
    # a device whose whole training fits in what the target leaves over the quickest round
    # trains in full: if its other work alone passes the target (one slow upload of a fast
    # device), fewer cheap steps would not make it quicker, only cost accuracy (digits/MLP,
    # rounds of 60 ms: a fast device was planned 3 of 23 steps). Not more than that: a slow
    # device given the slack's worth of steps paid in whole 100-ms quota periods (straggling 4.5)
    cheap = planned * step <= max(target - quickest, 0.0)
    if measured_in_full is not None:
        cheap &= np.asarray(measured_in_full, dtype=bool)
    fit[cheap] = planned[cheap]
    return np.clip(fit, np.minimum(min_steps, planned), planned).astype(np.int64)


def step_scale(steps: int, full: int) -> float:
    """FedNova's factor for a device that trained ``steps`` of ``full`` planned steps:
    ``full / steps`` (1.0 for full work); see the module docstring for why this keeps the
    aggregate unbiased."""
    if isinstance(steps, bool) or isinstance(full, bool) or not (1 <= int(steps) <= int(full)):
        raise ConfigError(f"steps={steps!r} of full={full!r} is not allowed; 1 <= steps <= full.")
    return float(full) / float(steps)
