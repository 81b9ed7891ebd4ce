"""Measured figures that a busy neighbour does not move and a CPU quota does (cgroup files,
a real quota on a real process), and measured budgets refreshed between rounds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_agent.probes import cpu_limit, cpu_share, is_loopback

pytestmark = pytest.mark.filterwarnings("ignore::senseshield.he.paillier.InsecureKeyWarning")


def _files(tmp_path: Path, cgroup: str, mounts: str) -> dict[str, Path]:
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mounts").write_text(mounts)
    return {"cgroup_file": tmp_path / "cgroup", "mounts": tmp_path / "mounts"}


def test_cpu_limit_reads_the_least_quota_along_the_cgroup_path_v1_and_v2(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "fleet" / "pi").mkdir(parents=True)
    for where, quota in ((v1, "-1"), (v1 / "fleet", "150000"), (v1 / "fleet" / "pi", "5000")):
        (where / "cpu.cfs_quota_us").write_text(quota + "\n")
        (where / "cpu.cfs_period_us").write_text("100000\n")
    files = _files(tmp_path, "2:cpuacct:/\n1:cpu:/fleet/pi\n0::/\n",
                   f"cgroup {v1} cgroup rw,relatime,cpu 0 0\n")
    assert cpu_limit(**files) == pytest.approx(0.05)
    (v1 / "fleet" / "pi" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit(**files) == pytest.approx(1.5)  # the parent's limit holds for its children

    v2 = tmp_path / "v2"
    (v2 / "box").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "box" / "cpu.max").write_text("20000 100000\n")
    files = _files(tmp_path / "v2", "0::/box\n", f"cgroup2 {v2} cgroup2 rw 0 0\n")
    assert cpu_limit(**files) == pytest.approx(0.2)
    (v2 / "box" / "cpu.max").write_text("max 100000\n")
    assert cpu_limit(**files) is None  # unlimited
    assert cpu_share(2, limit=0.2) == 0.2 and cpu_share(2, limit=8.0) == 2.0


def test_a_broker_on_this_host_is_loopback():
    assert is_loopback("mqtt://127.0.0.1:1883") and is_loopback("localhost") and is_loopback("mqtt://[::1]:1883")
    assert not is_loopback("mqtt://10.0.0.2") and not is_loopback("broker.example.org") and not is_loopback(None)


def _cpu_cgroup() -> tuple[str, Path] | None:
    from senseshield.trials.emulation import _cpu_cgroup_mount

    found = _cpu_cgroup_mount()
    return found if os.geteuid() == 0 and found is not None and os.access(found[1], os.W_OK) else None


@pytest.mark.skipif(_cpu_cgroup() is None, reason="needs root and a writable cpu cgroup controller")
@pytest.mark.slow  # make test-slow: the default suite stays under 8 min on 2 cores
def test_a_cpu_quota_lowers_the_measured_encryption_rate_a_busy_neighbour_does_not(tmp_path):
    """The same measurement in three processes: alone, next to two busy-looping processes (a
    neighbour's hog on this 2-core machine), and inside a real 10 % cgroup CPU quota."""
    from senseshield.trials.emulation import set_cpu_quota

    version, root = _cpu_cgroup()
    group = root / f"senseshield-test-{os.getpid()}"
    group.mkdir()
    try:
        assert set_cpu_quota(group, version, 0.10, period_us=100_000) == (10_000, 100_000)
        from senseshield.he import SCHEMES

        import pickle

        key = tmp_path / "key.pkl"
        key.write_bytes(pickle.dumps(SCHEMES.get("packed-paillier").generate(key_bits=1024).public_key))
        script = textwrap.dedent(f"""
            import pickle, sys
            from pathlib import Path
            from edge_agent.probes import measure_encryption
            public = pickle.loads(Path({str(key)!r}).read_bytes())
            measure_encryption(public_key=public, budget_s=0.05)  # imports and tables, outside the quota
            if sys.argv[1] == "quota":
                Path({str(group / "cgroup.procs")!r}).write_text(str(__import__("os").getpid()))
            print(measure_encryption(public_key=public, budget_s=0.2).encryptions_per_s)
        """)

        def rate(mode: str) -> float:
            out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})
            assert out.returncode == 0, out.stderr
            return float(out.stdout.split()[-1])

        alone = rate("alone")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            busy = rate("busy")
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        limited = rate("quota")
    finally:
        group.rmdir()
    assert 0.67 < busy / alone < 1.5, (alone, busy)  # CPU time: the hogs take wall time, not ours
    assert 5 < alone / limited < 20, (alone, limited)  # a 10 % quota: about a tenth


def test_measured_mode_rebudgets_from_round_rates_and_paper_mode_keeps_its_budgets():
    from dataclasses import replace

    from senseshield.strategies import StrategyOptions, build_strategy
    from senseshield.strategies.base import BootstrapReport, EncryptionRate

    rng = np.random.default_rng(0)
    reports = [BootstrapReport(f"c{i}", 100, 1000.0, 8.0, np.abs(rng.normal(size=66)),
                               encryption=EncryptionRate(40_000.0, "packed-paillier/2048", 7.76)) for i in range(3)]
    one = {r.client_id: 0 for r in reports}
    strategy = build_strategy("sensecrypt", StrategyOptions())
    budgets, notes = strategy.budgets_for(reports, one, size=66, block_size=66)
    assert budgets == {"c0": 1.0, "c1": 1.0, "c2": 1.0} and notes["0"]["mode"] == "measured"
    # the rounds showed c2 20x slower (a CPU quota): its budget follows
    seen = [*reports[:2], replace(reports[2], encryption=replace(reports[2].encryption, per_s=2_000.0))]
    budgets, notes = strategy.rebudget(seen, one, size=66, block_size=66)
    assert budgets["c0"] == budgets["c1"] == 1.0 and 0.04 < budgets["c2"] < 0.06
    assert notes["mode"] == "measured" and notes["clusters"]["0"]["encrypt_per_s"]["c2"] == 2000.0
    paper = build_strategy("sensecrypt", StrategyOptions(budget_mode="paper"))
    assert paper.rebudget(seen, one, size=66, block_size=66) is None


@pytest.mark.skipif(_cpu_cgroup() is None, reason="needs root and a writable cpu cgroup controller")
@pytest.mark.slow  # make test-slow: a real fleet, one agent under a CPU quota
def test_a_device_under_a_cpu_quota_gets_a_smaller_budget_and_fewer_local_steps(tmp_path):
    """A real fleet (embedded broker, agents measuring at join), c002 inside a 5 % cgroup CPU
    quota from its start, the trials' way: it measures the slower encryption rate and gets the
    smaller budget, and with ``straggle_limit=2`` it trains fewer local steps (plans from its
    rounds' timings) while the others train in full. The straggling figure itself is measured
    by benchmarks/bench_straggle.py, not asserted here (it is a timing)."""
    from senseshield.job import Job
    from senseshield.runtime.fleet import FleetOptions, agent_ids, fleet_up
    from senseshield.strategies.base import StrategyOptions
    from senseshield.trials.emulation import in_cgroup, quota_group

    group = quota_group(0.05, name="test-steps")
    try:
        job = Job(strategy="sensecrypt", model="mlp", dataset="digits", partition="iid", clients=3, rounds=5,
                  key_bits=1024, seed=0, options=StrategyOptions(straggle_limit=2.0))
        options = FleetOptions(agents=3, out=tmp_path, round_deadline=300, join_timeout=600,
                               wrap=lambda name, argv: in_cgroup(group, argv) if name == "c002" else argv,
                               agent_profiles={a: Path("auto") for a in agent_ids(3)})
        report = fleet_up(job, options, timeout=1200)
    finally:
        from senseshield.trials.emulation import _remove_cgroup

        assert _remove_cgroup(group) == []
    budgets = {c["id"]: c["encryption_budget"] for c in report["clients"]}
    assert budgets["c002"] < 0.5 * min(budgets["c000"], budgets["c001"]), budgets
    work = {r["round"]: r["work"] for r in report["rounds"]}
    assert all(w[a]["steps"] == w[a]["full_steps"] for w in work.values() for a in ("c000", "c001")), work
    assert all(work[r]["c002"]["steps"] < work[r]["c002"]["full_steps"] for r in range(2, 6)), work
    assert report["straggling"]["median_ratio"] is not None
    assert report["final_accuracy"] > 0.8


def test_the_encryption_rate_is_the_best_of_bursts_spread_over_the_window():
    """measure_encryption times ``repeats`` bursts of one length, one per slot of
    ``window_s / repeats`` (it sleeps until each slot; here a fake sleep records the slots
    instead), and reports the best burst's rate; the profile's summary says so."""
    import time

    from edge_agent.probes import ProbeSummary, measure_encryption
    from senseshield.errors import ConfigError
    from senseshield.he import SCHEMES

    public = SCHEMES.get("packed-paillier").generate(key_bits=1024).public_key
    slots: list[float] = []

    def sleep(seconds: float) -> None:
        slots.append(time.perf_counter() + seconds)

    he = measure_encryption(public_key=public, budget_s=0.04, repeats=6, window_s=60.0, sleep=sleep)
    assert he.spread.probes == 6 and he.encryptions_per_s == he.spread.high >= he.spread.median
    assert len(slots) == 5  # the first burst starts at once
    np.testing.assert_allclose(np.diff(slots), 10.0, atol=0.05)  # one burst per 60 s / 6
    assert ProbeSummary.of(he.spread, "max").figure == "max" and ProbeSummary.of(he.spread).figure == "median"
    with pytest.raises(ConfigError, match="repeats=0"):
        measure_encryption(public_key=public, repeats=0)
