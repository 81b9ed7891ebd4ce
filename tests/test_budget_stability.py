"""Identical agents measuring `--profile auto` on one machine get equal budgets (real broker, real processes)."""

from __future__ import annotations

import re

from senseshield.bench.budgets import join_budgets, spread


def test_identical_measuring_agents_get_budgets_within_ten_percent(mosquitto, tmp_path):
    budgets = join_budgets(3, tmp_path, broker=mosquitto.url, fleet="stable", timeout=60)
    assert sorted(budgets) == ["c000", "c001", "c002"]
    assert spread(budgets) <= 1.10, budgets
    # every agent measured its bandwidth through the broker (not the declared 10 MB/s default)
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    measured = [float(x) for x in re.findall(r"joined \(\d/3\): \d+ samples, ([\d.]+) MB/s", log)]
    assert len(measured) == 3 and all(m != 10.0 for m in measured), measured
