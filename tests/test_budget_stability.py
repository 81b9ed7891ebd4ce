"""Identical agents measuring `--profile auto` on one machine get equal budgets, alone and beside
a CPU hog, and an agent with half a CPU gets a visibly smaller one (real broker, real processes,
the default budget mode: measured). Each test is one join, ~20-30 s on a 2-vCPU machine."""

from __future__ import annotations

import re

import pytest

from senseshield.bench.budgets import cpu_hog, join, join_budgets, spread
from tests.test_measured_rates import _cpu_cgroup  # one check of the cgroup controller


@pytest.mark.slow  # ~15 s; the same beside a CPU hog stays in the default suite
def test_identical_measuring_agents_get_budgets_within_ten_percent(mosquitto, tmp_path):
    budgets = join_budgets(3, tmp_path, broker=mosquitto.url, fleet="stable", timeout=60)
    assert sorted(budgets) == ["c000", "c001", "c002"]
    assert spread(budgets) <= 1.10, budgets
    # every agent measured its bandwidth through the broker (not the declared 10 MB/s default)
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    measured = [float(x) for x in re.findall(r"joined \(\d/3\): \d+ samples, ([\d.]+) MB/s", log)]
    assert len(measured) == 3 and all(m != 10.0 for m in measured), measured


def test_identical_agents_started_beside_a_cpu_hog_get_budgets_within_ten_percent(mosquitto, tmp_path):
    """A busy-looping process pinned to CPU 0 from before the fleet starts until every agent
    has its budget: the agents measure while it spins."""
    with cpu_hog(0) as hog:
        result = join(3, tmp_path, broker=mosquitto.url, fleet="stable-hog", timeout=60, notes=True)
        assert hog.poll() is None  # still spinning when the last budget came
    assert spread(result.budgets) <= 1.10, (result.budgets, result.rates, result.summaries)
    assert result.notes["clusters"]["0"]["mode"] == "measured"  # from the encryption rates they measured


@pytest.mark.skipif(_cpu_cgroup() is None, reason="needs root and a writable cpu cgroup controller")
@pytest.mark.slow  # make test-slow: the default suite stays under 8 min on 2 cores
def test_an_agent_with_half_a_cpu_gets_a_visibly_smaller_budget(mosquitto, tmp_path):
    """c002 runs inside a 50 % cgroup CPU quota from its start (the trials' way of making a
    device 2x slower): it measures half the others' encryption rate and gets about half their
    budget, while the two identical others stay equal."""
    from senseshield.trials.emulation import _remove_cgroup, in_cgroup, quota_group

    group = quota_group(0.5, name="test-half")
    try:
        result = join(3, tmp_path, broker=mosquitto.url, fleet="stable-half", timeout=60,
                      wrap=lambda name, argv: in_cgroup(group, argv) if name == "c002" else argv)
    finally:
        assert _remove_cgroup(group) == []
    budgets, why = result.budgets, (result.budgets, result.rates, result.summaries)
    assert max(budgets["c000"], budgets["c001"]) == 1.0 and spread({a: budgets[a] for a in ("c000", "c001")}) <= 1.10, why
    assert 0.25 <= budgets["c002"] <= 0.6 * min(budgets["c000"], budgets["c001"]), why
