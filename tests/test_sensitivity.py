"""Sensitivity scores against direct computations (pure engine)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from senseshield.engine.params import ParamLayout
from senseshield.engine.sensitivity import (
    SCORES,
    ScoreInputs,
    fisher_sensitivity,
    grad_delta_sensitivity,
    taylor_sensitivity,
)
from senseshield.errors import ConfigError
from senseshield.models import build_model
from senseshield.training import get_vector, layout_of, per_sample_gradients, score_inputs

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@given(arrays(np.float64, 12, elements=finite), arrays(np.float64, 12, elements=finite))
def test_taylor_is_abs_product(w, g):
    np.testing.assert_array_equal(taylor_sensitivity(weights=w, grad=g), np.abs(w * g))


@given(arrays(np.float64, 9, elements=finite), arrays(np.float64, 9, elements=finite))
def test_grad_delta_is_product_of_magnitudes(g, d):
    np.testing.assert_array_equal(grad_delta_sensitivity(grad=g, delta=d), np.abs(g) * np.abs(d))


@settings(max_examples=50)
@given(arrays(np.float64, 10, elements=st.floats(0, 100)))
def test_fisher_min_max_per_layer(grad_sq):
    layout = ParamLayout.from_shapes([("a", (4,), True), ("b", (6,), True)])
    out = fisher_sensitivity(grad_sq=grad_sq, layout=layout)
    for part in layout.layer_slices():
        layer = grad_sq[part]
        if layer.max() > layer.min():
            expected = (layer - layer.min()) / (layer.max() - layer.min())
            np.testing.assert_allclose(out[part], expected)
            assert out[part].min() == 0.0 and out[part].max() == pytest.approx(1.0)
        else:
            assert np.all(out[part] == 0.0)


def test_taylor_matches_zero_out_loss_change_to_first_order():
    """Eq. 1 vs eq. 2: zeroing a small-weight parameter changes the loss by ≈ |w g|."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    x = torch.rand(32, 1, 8, 8).numpy()
    y = torch.randint(0, 10, (32,)).numpy()
    inputs = score_inputs(model, x, y, needs=frozenset())
    gamma = SCORES.get("taylor")(inputs)
    loss = lambda: float(torch.nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y)).detach())  # noqa: E731
    base = loss()
    first = next(model.parameters())
    k = int(np.argmax(gamma[: first.numel()]))
    flat = first.data.view(-1)
    old = float(flat[k])
    flat[k] = 0.0
    changed = loss()
    flat[k] = old
    assert abs(base - changed) == pytest.approx(gamma[k], rel=0.2)


def test_score_needs_are_checked():
    layout = ParamLayout.from_shapes([("a", (3,), True)])
    inputs = ScoreInputs(weights=np.ones(3), grad=np.ones(3), layout=layout)
    with pytest.raises(ConfigError, match="grad_sq"):
        SCORES.get("fisher")(inputs)
    with pytest.raises(ConfigError, match="Unknown sensitivity score 'nope'"):
        SCORES.get("nope")


def test_per_sample_gradients_average_to_mean_gradient():
    torch.manual_seed(1)
    model = build_model("simplecnn", (1, 8, 8), 10)
    x = torch.rand(10, 1, 8, 8).numpy()
    y = torch.randint(0, 10, (10,)).numpy()
    mats = np.concatenate([m for m, _ in per_sample_gradients(model, x, y, chunk=4)])
    inputs = score_inputs(model, x, y, needs=frozenset({"grad_sq"}))
    np.testing.assert_allclose(mats.mean(axis=0), inputs.grad, atol=1e-6)
    np.testing.assert_allclose((mats**2).mean(axis=0), inputs.grad_sq, atol=1e-8)
    assert mats.shape == (10, layout_of(model).size)
    assert get_vector(model).size == layout_of(model).size


# -- the leakage-aware selection (issue 16) ------------------------------------------------

def _layout_of(name: str) -> ParamLayout:
    from senseshield.training import layout_of

    shape = (1, 28, 28) if name == "lenet5" else (1, 8, 8)
    return layout_of(build_model(name, input_shape=shape, num_classes=10))


@pytest.mark.parametrize("name, first, last", [("lenet5", 6 * 25 + 6, 84 * 10 + 10), ("mlp", None, None)])
def test_edge_layers_are_the_first_and_last_module_with_their_bias(name, first, last):
    from senseshield.engine.sensitivity import edge_layers

    layout = _layout_of(name)
    f, o = edge_layers(layout)
    trainable = [s for s in layout.segments if s.trainable]
    assert [x.start for x in f][0] == trainable[0].offset and [x.stop for x in o][-1] == trainable[-1].stop
    assert len(f) == 2 and len(o) == 2  # weight and bias of each
    if first is not None:
        assert sum(x.stop - x.start for x in f) == first and sum(x.stop - x.start for x in o) == last


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fraction=st.floats(0.001, 0.3))
def test_the_budget_covers_the_leaky_tensors_first_in_equal_shares_then_follows_taylor(seed, fraction):
    from senseshield.engine.sensitivity import leakage_aware_sensitivity, leakage_tiers

    layout = _layout_of("lenet5")
    rng = np.random.default_rng(seed)
    w, g = rng.normal(size=layout.size), rng.normal(size=layout.size) * rng.lognormal(size=layout.size)
    score = leakage_aware_sensitivity(weights=w, grad=g, layout=layout)
    assert np.array_equal(score, leakage_aware_sensitivity(weights=w, grad=g, layout=layout))
    assert np.all((score > 0) & (score <= 2)) and np.unique(score[score <= 1]).size == np.count_nonzero(score <= 1)
    tiers = [np.r_[tuple(np.arange(s.start, s.stop) for s in group)] for group in leakage_tiers(layout)]
    assert len(tiers) == 3 and sum(t.size for t in tiers) == 6 * 25 + 6 + 84 * 10 + 10 + 16 + 120 + 84
    first = np.zeros(layout.size, dtype=bool)
    for t in tiers:
        first[t] = True
    k = max(1, int(fraction * layout.size))
    top = np.zeros(layout.size, dtype=bool)
    top[np.argsort(-score, kind="stable")[:k]] = True
    if k <= first.sum():
        assert not np.any(top & ~first)
        shares = [top[t].mean() for t in tiers]  # the same fraction of each group, up to rounding
        assert max(shares) - min(shares) <= 1.0 / min(t.size for t in tiers) + 1e-12
        for t in tiers:  # inside a group, by |gradient|
            chosen, left = np.abs(g[t][top[t]]), np.abs(g[t][~top[t]])
            if chosen.size and left.size:
                assert chosen.min() >= left.max()
    else:
        assert np.all(top[first])
        taylor = np.abs(w * g)
        chosen, left = taylor[~first & top], taylor[~first & ~top]
        if chosen.size and left.size:
            assert chosen.min() >= left.max()


def test_a_strategy_takes_a_registered_score_by_option_and_refuses_others():
    from senseshield.strategies import StrategyOptions, build_strategy

    assert build_strategy("sensecrypt", StrategyOptions(score="leakage")).score_name == "leakage"
    assert build_strategy("sensecrypt").score_name == "taylor"
    with pytest.raises(ValueError, match="score=.nope. is not allowed; choose one of: fisher, grad_delta, leakage, taylor"):
        StrategyOptions(score="nope")
