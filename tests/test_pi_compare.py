"""deploy/pi/compare.py: the tolerance the arm64 fleet proof holds a masked fleet to."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "deploy" / "pi" / "compare.py"
_spec = importlib.util.spec_from_file_location("pi_compare", _PATH)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def test_one_differing_agent_of_three_equal_ones_moves_the_mean_by_a_third_of_a_step():
    weights = {"c000": 479, "c001": 479, "c002": 479}
    clusters = {"c000": 0, "c001": 0, "c002": 0}
    tol = compare.masked_round_tolerance(15, weights, clusters, ["c000"], float_atol=0.0, largest=0.0)
    assert tol == pytest.approx(2.0 ** -15 / 3)  # 1.0173e-5: what the 32-bit ring's fleet showed
    tol64 = compare.masked_round_tolerance(24, weights, clusters, ["c000"], float_atol=1e-6, largest=1.5)
    assert tol64 == pytest.approx((2.0 ** -24 + 1e-6) / 3 + 2 * float(np.spacing(np.float32(1.5))))


def test_the_worst_cluster_counts_and_server_lr_scales():
    weights = {"a": 100, "b": 300, "c": 50, "d": 50}
    clusters = {"a": 0, "b": 0, "c": 1, "d": 1}
    # a is a quarter of cluster 0, c half of cluster 1
    tol = compare.masked_round_tolerance(15, weights, clusters, ["a", "c"], float_atol=0.0, largest=0.0,
                                         server_lr=2.0)
    assert tol == pytest.approx(2.0 * 0.5 * 2.0 ** -15)
    assert compare.masked_round_tolerance(15, weights, clusters, [], float_atol=0.0, largest=0.0) < 1e-30


def test_max_differences_per_key():
    ref = {"logits0": [1.0, 2.0], "grads": [0.0], "params": [1.0], "logits1": [3.0], "loss0": 2.0, "loss1": 1.0}
    other = dict(ref, logits0=[1.0, 2.5], loss1=1.25)
    d = compare.max_differences(ref, other)
    assert d["logits0"] == 0.5 and d["loss1"] == 0.25 and d["grads"] == 0.0
