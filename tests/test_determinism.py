"""Traces and their first difference; the check command on a real fleet is in test_fleet."""

from __future__ import annotations

import numpy as np
import pytest

from senseshield.determinism import Trace, first_difference, mask_digest
from senseshield.job import Job
from senseshield.simulation import run_simulation


def _trace() -> Trace:
    t = Trace({"c000": 0, "c001": 1}, {"c000": 1.0, "c001": 0.5})
    t.record_round(1, {"c000": "aa", "c001": "bb"}, {0: np.zeros(4), 1: np.ones(4)})
    t.record_round(2, {"c000": "cc", "c001": "dd"}, {0: np.full(4, 0.5), 1: np.ones(4)})
    return t


def test_identical_traces_have_no_difference():
    assert first_difference(_trace(), _trace()) is None


@pytest.mark.parametrize("change, needle", [
    (lambda t: t.clusters.update(c001=0), "client c001: cluster 1 in a, 0 in b"),
    (lambda t: t.budgets.update(c000=0.9), "client c000: encryption budget 1.0 in a, 0.9 in b"),
    (lambda t: t.masks[2].update(c001="ee"), "round 2, client c001: protection mask differs"),
    (lambda t: t.masks[1].pop("c000"), "round 1: updates from"),
    (lambda t: t.models[2][0].__setitem__(3, np.float32(0.25)), "round 2, cluster 0: 1 weight(s) differ, the largest at index 3 by 0.25"),
])
def test_the_first_difference_is_named(change, needle):
    other = _trace()
    change(other)
    difference = first_difference(_trace(), other)
    assert difference is not None and needle in difference, difference


def test_the_earliest_round_is_reported_first():
    other = _trace()
    other.models[2][1][0] = 7.0
    other.masks[1]["c001"] = "xx"
    assert first_difference(_trace(), other).startswith("round 1, client c001")


def test_weights_within_the_tolerance_are_the_same():
    other = _trace()
    other.models[1][0][0] = np.float32(1e-8)
    assert first_difference(_trace(), other, atol=1e-6) is None
    assert first_difference(_trace(), other) is not None


def test_mask_digest_ignores_an_empty_withheld_zone():
    mask = np.array([True, False, True, False])
    assert mask_digest(mask) == mask_digest(mask, np.zeros(4, bool))
    assert mask_digest(mask) != mask_digest(mask, np.array([False, True, False, False]))
    assert mask_digest(mask) != mask_digest(~mask)


def test_the_simulator_repeats_itself_and_training_threads_are_part_of_the_run():
    config = Job(strategy="sensecrypt", partition="categories:2", clients=4, rounds=2,
                              key_bits=1024, bandwidth=[50, 30], cpu=[24, 8])
    a = run_simulation(config, trace=True).trace
    b = run_simulation(config, trace=True).trace
    assert first_difference(a, b) is None
    assert sorted(a.masks[2]) == ["c000", "c001", "c002", "c003"] and len(a.models) == 2
    # more threads in this process do not change a run with train_threads=1
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        c = run_simulation(config, trace=True).trace
    finally:
        torch.set_num_threads(before)
    assert first_difference(a, c) is None


@pytest.mark.slow  # two simulations and a fleet (~35 s); test_fleet checks simulator = fleet by default
def test_check_determinism_command_reports_same_runs(tmp_path):
    from typer.testing import CliRunner

    from senseshield.cli import app

    # dp-fedavg: device noise on every value, replayed from the test-only seed in all three runs
    result = CliRunner().invoke(app, ["check", "determinism", "--strategy", "dp-fedavg", "--model", "linear",
                                      "--agents", "2", "--rounds", "1", "--partition", "iid",
                                      "--out", str(tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.count("same:") == 2, result.output
    assert "device noise replayed from the test-only seed 0" in result.output.replace("\n", " ")
    assert (tmp_path / "report.json").exists()
