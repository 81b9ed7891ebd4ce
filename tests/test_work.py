"""Partial work (senseshield.engine.work) and measured budgets: pure functions, plus the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.engine.budgets import measured_budgets
from senseshield.engine.work import (
    SCORE_SAMPLES,
    device_work,
    step_seconds,
    full_steps,
    local_steps,
    recent_median,
    score_samples,
    step_scale,
)
from senseshield.errors import ConfigError

speeds = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(speeds, st.floats(1.0, 5.0), st.integers(1, 200))
def test_local_steps_fit_the_limit_and_the_quickest_trains_in_full(step, limit, full) -> None:
    s = np.array(step)
    steps = local_steps(step_s=s, other_s=np.zeros_like(s), full=np.full(s.size, full), limit=limit)
    assert np.all((steps >= 1) & (steps <= full))
    assert steps[np.argmin(s)] == full
    fastest = full * s.min()
    over = steps * s > limit * fastest * (1 + 1e-9)
    assert np.all(steps[over] == 1)  # only the one-step floor may exceed the limit
    # a slower device never trains more steps
    order = np.argsort(s, kind="stable")
    assert np.all(np.diff(steps[order]) <= 0)
    # the unit does not matter
    again = local_steps(step_s=s * 7.5, other_s=np.zeros_like(s), full=np.full(s.size, full), limit=limit)
    assert np.array_equal(steps, again)


def test_a_device_twenty_times_slower_trains_a_tenth_of_its_steps() -> None:
    steps = local_steps(step_s=np.array([1.0, 1.0, 20.0]), other_s=np.zeros(3), full=np.array([46, 46, 46]), limit=2.0)
    assert steps.tolist() == [46, 46, 4]
    assert local_steps(step_s=np.array([1.0, 20.0]), other_s=np.zeros(2), full=np.array([46, 46]), limit=None).tolist() == [46, 46]
    # the deadline alone: 0.8 x 10 s leaves 8 s, 2 s of other work, 0.5 s a step -> 12 steps
    assert local_steps(step_s=np.array([0.5]), other_s=np.array([2.0]), full=np.array([40]), limit=None,
                       deadline_s=10.0).tolist() == [12]


def test_a_margin_plans_below_the_limit_but_never_cuts_the_quickest() -> None:
    # quickest round 1 s fixed + 46 x 0.1 s = 5.6 s; limit 2 -> 11.2 s, margin 0.8 -> 8.96 s
    # for the slow device: (8.96 - 2 s fixed) / 0.5 s a step = 13 steps (18 at the limit itself)
    kw = dict(step_s=np.array([0.1, 0.5]), other_s=np.array([1.0, 2.0]), full=np.array([46, 46]))
    assert local_steps(**kw, limit=2.0).tolist() == [46, 18]
    assert local_steps(**kw, limit=2.0, margin=0.8).tolist() == [46, 13]
    # margin x limit below 1 never plans under the quickest device's own round
    assert local_steps(**kw, limit=1.1, margin=0.5).tolist()[0] == 46
    with pytest.raises(ConfigError, match="margin=0 is not allowed"):
        local_steps(**kw, limit=2.0, margin=0)


@pytest.mark.parametrize("kwargs, needle", [
    ({"step_s": [0.0], "other_s": [0.0], "full": [3], "limit": 2.0}, "step_s"),
    ({"step_s": [1.0], "other_s": [0.0], "full": [3], "limit": 0.5}, "straggle limit"),
    ({"step_s": [1.0], "other_s": [0.0], "full": [0], "limit": 2.0}, "full="),
])
def test_local_steps_bad_input_is_one_sentence(kwargs, needle) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=needle):
        local_steps(**{k: np.array(v) for k, v in kwargs.items() if k != "limit"}, limit=kwargs["limit"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 1e3), min_size=1, max_size=30), st.integers(1, 10))
def test_recent_median_lies_within_its_window(values, k) -> None:
    m = recent_median(values, k=k)
    window = values[-k:]
    assert min(window) <= m <= max(window)
    # one wild round among >= 3 does not move it beyond the others' range
    if len(window) >= 3:
        wild = recent_median([*values[:-1], 1e9], k=k)
        assert wild <= max(values[-k:-1])


def test_recent_median_of_nothing_is_none() -> None:
    assert recent_median([], k=3) is None
    assert recent_median([0.0, float("nan")], k=3) is None


def test_full_steps_and_fednova_scale() -> None:
    assert full_steps(360, batch_size=16, epochs=2) == 46
    assert step_scale(46, 46) == 1.0 and step_scale(4, 46) == 11.5
    with pytest.raises(ConfigError, match="steps=0"):
        step_scale(0, 46)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.integers(1, 500), st.integers(1, 128))
def test_partial_work_scores_the_samples_it_trained_on(steps, full, batch) -> None:
    """Full work scores SCORE_SAMPLES; partial work steps x batch, at least a batch, at most
    the cap; more planned steps never score fewer samples."""
    steps = min(steps, full)
    got = score_samples(steps, full, batch_size=batch)
    if steps == full:
        assert got == SCORE_SAMPLES and score_samples(None, full, batch_size=batch) == SCORE_SAMPLES
    else:
        assert got == min(SCORE_SAMPLES, max(batch, steps * batch))
        assert got <= score_samples(min(steps + 1, full), full, batch_size=batch)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(10.0, 1e6), st.floats(0.01, 1e4)), min_size=1, max_size=8),
       st.floats(0.0, 64.0), st.floats(0.1, 10.0))
def test_measured_budgets_properties(rows, nbytes, scale) -> None:
    e, r = np.array(rows).T
    alpha = measured_budgets(encrypt_per_s=e, bandwidth=r, bytes_per_encrypted=nbytes)
    assert np.all((alpha > 0) & (alpha <= 1)) and np.isclose(alpha.max(), 1.0)
    # scaling rates and bandwidth together (units) changes nothing
    assert np.allclose(alpha, measured_budgets(encrypt_per_s=e * scale, bandwidth=r * scale, bytes_per_encrypted=nbytes))
    # a faster link or encryptor never lowers a device's budget relative to the others
    i = 0
    faster = measured_budgets(encrypt_per_s=np.where(np.arange(e.size) == i, e * 2, e), bandwidth=r, bytes_per_encrypted=nbytes)
    assert faster[i] >= alpha[i] * (1 - 1e-12)


def test_measured_budgets_ignore_a_loopback_busy_moment_but_see_a_slow_encryptor() -> None:
    # three identical agents on one host: 84 / 456 / 45 MB/s measured, 41,000 values/s each
    same = measured_budgets(encrypt_per_s=np.full(3, 41_000.0), bandwidth=np.array([84.0, 456.0, 45.0]),
                            bytes_per_encrypted=8.0)
    assert same.max() / same.min() < 1.01
    # the arm64 board: 3,100 values/s against 41,000
    arm = measured_budgets(encrypt_per_s=np.array([41_000.0, 3_100.0]), bandwidth=np.array([84.0, 84.0]),
                           bytes_per_encrypted=8.0)
    assert arm[1] < 0.1


def test_simulated_slow_device_trains_fewer_steps_reported_per_round() -> None:
    from senseshield.job import Job
    from senseshield.simulation import run_simulation
    from senseshield.strategies.base import StrategyOptions

    job = Job(strategy="plaintext", model="linear", partition="iid", clients=3, rounds=2, cpu=[20.0, 20.0, 1.0],
              options=StrategyOptions(straggle_limit=2.0))
    result = run_simulation(job, noise_seed=0)
    work = result.rounds[-1].work
    full = work["c000"]["full_steps"]
    assert work["c000"]["steps"] == work["c001"]["steps"] == full
    assert work["c002"]["steps"] == int(2 * full / 20) < full
    assert work["c002"]["budget"] < work["c000"]["budget"]
    again = run_simulation(job, noise_seed=0)
    assert again.rounds[-1].work == work and again.final_accuracy == result.final_accuracy


def test_step_seconds_separates_the_fixed_part_from_the_steps() -> None:

    # 0.5 s fixed + 0.1 s per step: a 1-step round is not taken for a 0.6 s step
    fixed, per_step = step_seconds([0.6, 2.5, 1.5, 0.6], [1, 20, 10, 1])
    assert fixed == pytest.approx(0.5) and per_step == pytest.approx(0.1)
    assert step_seconds([2.0, 2.2, 1.8], [10, 10, 10]) == (0.0, pytest.approx(0.2))  # one step count: the median ratio
    assert step_seconds([], []) is None and step_seconds([0.0, float("nan")], [3, 3]) is None
    only_last = step_seconds([9.0, 1.0, 2.0], [1, 10, 20], k=2)
    assert only_last == (pytest.approx(0.0), pytest.approx(0.1))
    # under a CPU quota 4 steps and 1 step took about the same periods: the line alone would
    # say ~0.017 s per step (and plan 62 steps: a 25x round); the slope stays >= half the
    # smallest seconds per step, and the fit still does not over-predict the quicker round
    fixed, per_step = step_seconds([0.50, 0.45], [4, 1])
    assert per_step == pytest.approx(0.0625) and fixed + per_step <= 0.45 + 1e-12
    with pytest.raises(ConfigError, match="k=0 is not allowed"):
        step_seconds([1.0], [1], k=0)


def test_device_work_counts_scoring_with_the_steps_and_round_1_until_two_later_rounds():
    # bench_straggle, LeNet-5, the device at 5 % of a CPU: round 2's one step fitted into what
    # was left of a quota period (8 ms; steps take ~60 ms). Planned from round 2 alone, round 3
    # got 16 steps; with round 1 in the window the step costs what rounds 1-2 took together.
    r1 = (1, {"train": 0.303, "sensitivity": 0.199, "encrypt": 0.095}, 4, 0.828)
    r2 = (2, {"train": 0.008, "sensitivity": 0.177, "encrypt": 0.01}, 1, 0.296)
    per_step, other = device_work([r1, r2])
    fixed, step = step_seconds([0.502, 0.185], [4, 1])
    assert per_step == step > 0.06 and 0.0 < fixed < 0.185
    assert other == pytest.approx(0.296 - 0.185 + fixed)  # round 1's other work (its warm-up) left out
    assert device_work([r1])[1] == pytest.approx(0.828 - 0.502 + step_seconds([0.502], [4])[0])
    assert device_work([r2])[0] == pytest.approx(0.185)  # round 2 alone: 3x too cheap a step (with scoring)
    r3 = (3, {"train": 0.25, "sensitivity": 0.15}, 3, 0.6)
    assert device_work([r1, r2, r3]) == device_work([r2, r3])  # two later rounds: round 1 no longer counts
    # without busy_s the other work is mask + noise + encrypt
    assert device_work([(2, {"train": 0.2, "encrypt": 0.05, "mask": 0.01}, 2, None)]) == pytest.approx((0.1, 0.06))
    assert device_work([]) is None and device_work([(2, {"encrypt": 0.1}, 3, 0.5)]) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.001, 5.0), st.floats(0.0, 5.0), st.integers(1, 60), st.floats(0.01, 3.0)),
                min_size=1, max_size=8), st.floats(0.1, 10.0))
def test_device_work_has_no_unit(rows, c):
    rounds = [(i + 1, {"train": t, "sensitivity": s}, n, t + s + b) for i, (t, s, n, b) in enumerate(rows)]
    scaled = [(r, {k: c * v for k, v in ph.items()}, n, c * b) for r, ph, n, b in rounds]
    per_step, other = device_work(rounds)
    assert per_step > 0 and other >= 0
    assert device_work(scaled) == pytest.approx((c * per_step, c * other), rel=1e-6, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.floats(0.0, 2.0), st.integers(1, 100)), min_size=2, max_size=8),
       st.floats(1.0, 4.0), st.floats(0.5, 1.0))
def test_a_device_whose_training_fits_the_slack_trains_in_full_whatever_its_other_work(devices, limit, margin):
    step = np.array([d[0] for d in devices])
    other = np.array([d[1] for d in devices])
    full = np.array([d[2] for d in devices])
    steps = local_steps(step_s=step, other_s=other, full=full, limit=limit, margin=margin)
    quickest = float(np.min(other + full * step))
    slack = max(margin * limit, 1.0) * quickest - quickest
    fits = full * step <= slack * (1 - 1e-9)
    assert np.all(steps[fits] == full[fits])


def test_a_fast_device_with_a_slow_upload_is_not_cut_for_nothing():
    # digits/MLP at 1 epoch, rounds of ~60 ms: c000's other work measured 0.10 s once (one slow
    # upload); its 23 steps take 0.02 s. Planned to 3 steps before, saving 17 ms and accuracy.
    steps = local_steps(step_s=np.array([0.001, 0.001, 0.06]), other_s=np.array([0.10, 0.045, 0.12]),
                        full=np.array([23, 23, 23]), limit=2.0, margin=0.8)
    assert steps.tolist() == [23, 23, 1]
    # ... but a slow device whose other work alone passes the target trains one step, not the
    # slack's worth: at 5 % of a CPU its cheap MLP steps cost whole 100-ms quota periods
    steps = local_steps(step_s=np.array([0.001, 0.001, 0.005]), other_s=np.array([0.05, 0.05, 0.12]),
                        full=np.array([23, 23, 23]), limit=2.0, margin=0.8)
    assert steps.tolist() == [23, 23, 1]


def test_a_cut_devices_step_time_is_not_extrapolated_to_full_work():
    # digits/MLP at 5 % of a CPU (100-ms quota periods): c003's one-step rounds took ~1 ms of
    # training (the step fitted into a period's remainder), so 23 steps looked like 23 ms, within
    # the slack; trained in full they took 0.9 s (a 9x round)
    args = dict(step_s=np.array([0.001, 0.001, 0.001]), other_s=np.array([0.05, 0.05, 0.25]),
                full=np.array([23, 23, 23]), limit=2.0, margin=0.8)
    assert local_steps(**args).tolist() == [23, 23, 23]
    assert local_steps(**args, measured_in_full=np.array([True, True, False])).tolist() == [23, 23, 1]
