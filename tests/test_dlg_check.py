"""The independent DLG (senseshield_checks.dlg): it recovers a digit from an unprotected
update, matches only what the server can read, and gets nothing from a blind one.

The setting: the DLG paper's sigmoid LeNet at its initialisation on scikit-learn's 8x8
digits (8,026 parameters), captured by the project's own capture code (one SGD step,
lr 0.1, one image), the update the project's attacks are measured on.
"""

import numpy as np
import pytest
import torch

from senseshield.attacks.base import torch_threads
from senseshield.attacks.capture import FleetSpec, capture, prepare_fleet
from senseshield.attacks.metrics import identifiability_precision, psnr
from senseshield.attacks.view import hide
from senseshield.errors import ConfigError
from senseshield.models import build_model
from senseshield.training import layout_of
from senseshield_checks.dlg import DLG_LENET, DLGSettings, _Target, dlg, dlg_lenet


@pytest.fixture(scope="module")
def fleet():
    with torch_threads(1):
        return prepare_fleet(FleetSpec(strategy="plaintext", dataset="digits", model=DLG_LENET,
                                       clients=4, round=1, seed=0))


def one_image(fleet, trial=0):
    with torch_threads(1):
        return capture(fleet, [0], batch_size=1, trial=trial)[0]


def test_dlg_recovers_a_digit_from_an_unprotected_update(fleet):
    cap = one_image(fleet)
    with torch_threads(1):
        rec = dlg(cap.view, settings=DLGSettings(steps=50), seed=0)
    assert rec.known == cap.view.size
    assert psnr(rec.images, cap.x)[0] >= 40.0
    assert identifiability_precision(rec.images, cap.indices, fleet.clients[0].x_train) == 1.0
    assert rec.labels.tolist() == cap.y.tolist()  # the soft label converged to the true one
    assert rec.images.dtype == np.float32 and rec.images.min() >= 0 and rec.images.max() <= 1


def test_dlg_gets_nothing_from_a_blind_update(fleet):
    cap = one_image(fleet)
    blind = hide(cap.view, np.ones(cap.view.size, dtype=bool))
    rec = dlg(blind, settings=DLGSettings(steps=50), seed=0)
    assert rec.known == 0 and np.isnan(rec.distance) and rec.evaluations == 0
    assert psnr(rec.images, cap.x)[0] < 10.0


@pytest.mark.parametrize("hidden_share", [0.0, 0.3, 0.9])
def test_the_distance_reads_only_visible_coordinates_in_layout_order(fleet, hidden_share):
    """At the true input and (nearly) hard true label the masked distance vanishes, whatever
    is hidden; hidden values are NaN in the view, so one misplaced index would make it NaN
    or large. Another digit is far (the gradient is dominated by the label, so "far" is
    relative: 1e-6 against below 1e-12)."""
    cap = one_image(fleet)
    rng = np.random.default_rng(7)
    view = hide(cap.view, rng.random(cap.view.size) < hidden_share)
    target = _Target(view)
    assert target.known == int((~view.unknown).sum())
    x = torch.as_tensor(cap.x, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.as_tensor(cap.y), view.num_classes).double() * 60.0
    assert target.distance(x, y).item() < 1e-12
    other = fleet.clients[0].x_train[fleet.clients[0].y_train != cap.y[0]][:1]
    assert target.distance(torch.as_tensor(other, dtype=torch.float64), y).item() > 1e-8


def test_the_dlg_lenet_is_the_papers_and_a_valid_project_model():
    model = build_model(DLG_LENET, (1, 28, 28), 10)
    assert layout_of(model).size == 13_426  # 12x7x7 features into the one FC layer
    assert [type(m).__name__ for m in model][:6] == ["Conv2d", "Sigmoid"] * 3
    assert [m.stride for m in model if isinstance(m, torch.nn.Conv2d)] == [(2, 2), (2, 2), (1, 1)]
    assert build_model(DLG_LENET, (3, 32, 32), 100)(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    with pytest.raises(ConfigError, match="needs images"):
        dlg_lenet((64,), 10)


@pytest.mark.parametrize(
    "field, value, message",
    [("steps", 0, "steps=0"), ("restarts", 1.5, "restarts=1.5"), ("stop", -1.0, "stop=-1.0"),
     ("evaluations", True, "evaluations=True")],
)
def test_bad_settings_are_refused_in_one_sentence(field, value, message):
    with pytest.raises(ConfigError, match=message):
        DLGSettings(**{field: value})


def test_dlg_shares_no_attack_code_with_the_project():
    """Independence: the check imports the server's view, the parameter layout and errors
    from senseshield, and no matching loss, optimiser or label rule of senseshield.attacks."""
    import ast
    import senseshield_checks.dlg as module

    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    ours = {m for m in imported if m and m.startswith("senseshield")}
    assert ours == {"senseshield.attacks.view", "senseshield.errors", "senseshield.training"}


def test_nothing_in_senseshield_imports_the_checks():
    from pathlib import Path

    import senseshield

    root = Path(senseshield.__file__).parent
    users = [p for p in root.rglob("*.py") if "senseshield_checks" in p.read_text(encoding="utf-8")]
    assert users == []
