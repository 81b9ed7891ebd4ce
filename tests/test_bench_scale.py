"""The scale benchmark's load generator against the real key server, coordinator and
Mosquitto: six agents speaking the real protocol (signed frames, sealed challenges, receipts
with fingerprints) get every update counted and a complete summary."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest

from bench_scale import markdown_table, run_scale  # noqa: E402


@pytest.mark.parametrize("strategy, processes", [("sensecrypt", 2), pytest.param("masked", 1, marks=pytest.mark.slow),
                                                 pytest.param("plaintext", 1, marks=pytest.mark.slow)])
def test_six_generated_agents_are_all_counted_in_verified_aggregates(mosquitto, tmp_path, strategy, processes):
    """Six agents from one load-generator process, or from two (three agents each, their own
    links): every update counted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 1024-bit test key
        row = run_scale(6, strategy, rounds=2, key_bits=1024, out=tmp_path / "run", broker_url=mosquitto.url,
                        timeout=120, processes=processes)
    assert row["every_update_counted"] and row["updates_sent"] == 12 and not row["loadgen_errors"], row
    assert row["loadgen_processes"] == processes and row["loadgen_cpu_s"] > 0
    assert row["clusters"] >= 1
    if strategy == "sensecrypt":  # the key server really verified and decrypted
        assert 0 < row["he_ratio"] < 1 and row["decrypt_s"] > 0 and row["verify_s"] > 0
    if strategy == "masked":  # every agent masked with its own pads, and the key server unmasked them
        assert row["he_ratio"] == 1.0 and row["decrypt_s"] > 0
    assert row["coordinator_cpu_s"] > 0 and row["keyserver_cpu_s"] > 0
    assert row["coordinator_peak_rss_mb"] > 0 and row["keyserver_peak_rss_mb"] > 0 and row["broker_mb"] > 0
    line = markdown_table([row | {"round_ratio_to_plaintext": 1.0}]).splitlines()[-1]
    assert line.startswith(f"| 6 | 0 | {strategy} | ") and line.endswith("| yes |")


@pytest.mark.slow  # ~45 s: the queue squeeze, then the job to its end (make test-slow)
def test_devices_re_send_what_a_full_broker_queue_dropped(tmp_path, monkeypatch):
    """A broker whose queue toward the coordinator holds 5 messages beyond 1 in flight, and a
    coordinator paused (SIGSTOP) while the fleet of 20 says hello: Mosquitto drops hellos for
    the coordinator, which never sees them (and drops more of what it is sent at once later,
    e.g. a round's updates). The job needs every device, so it starts only because the
    devices re-send their hellos until acknowledged; then every update sent is counted. (The
    load generator's own link takes 65,535 in flight, so the broker drops nothing for it.) The
    agents' backoff is shortened to keep the test short."""
    import bench_scale
    from contextlib import contextmanager
    import os
    import signal

    from tests.broker import Mosquitto

    monkeypatch.setattr(bench_scale, "repeat_delays", lambda kind, round_deadline: (1.0, 4.0))
    broker = Mosquitto(tmp_path / "broker", max_queued_messages=5, max_inflight_messages=1).start()

    @contextmanager
    def paused(fleet):  # noqa: ANN001
        coordinator = fleet.processes["coordinator"]
        os.kill(coordinator.pid, signal.SIGSTOP)
        try:
            yield  # every hello published (the broker acknowledged each): its queue overflowed
        finally:
            os.kill(coordinator.pid, signal.SIGCONT)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = run_scale(20, "plaintext", rounds=2, key_bits=1024, out=tmp_path / "run", broker_url=broker.url,
                            timeout=240, broker=broker, around_join=paused)
    finally:
        broker.stop()
    print(row["broker_dropped_for"], row["repeats"], f"{row['seconds']:.1f} s")
    assert "coordinator" in row["broker_dropped_for"] and "loadgen" not in row["broker_dropped_for"]
    assert row["repeats"]["hello"] > 0
    assert row["every_update_counted"] and row["updates_sent"] == 40 and not row["loadgen_errors"]


@pytest.mark.slow  # ~20 s (make test-slow); tests/test_sites.py runs a fleet over sites by default
def test_generated_agents_over_two_sites_are_counted_and_their_updates_stay_there(mosquitto, tmp_path):
    """Eight generated agents over two bridged sites (a site aggregator each): every update is
    counted in the verified aggregate, and what crosses into the hub's broker per round is
    the sites' partial sums, a fraction of the eight updates it carries without sites."""
    rows = {sites: run_scale(8, "masked", rounds=2, out=tmp_path / f"run-{sites}", broker_url=mosquitto.url,
                             timeout=180, model="mlp", sites=sites) for sites in (0, 2)}
    for sites, row in rows.items():
        assert row["every_update_counted"] and row["updates_sent"] == 16 and not row["loadgen_errors"], (sites, row)
    assert rows[2]["site_peak_rss_mb"] > 0 and rows[0]["site_peak_rss_mb"] == 0
    assert rows[2]["hub_in_mb_per_round"] < rows[0]["hub_in_mb_per_round"] / 2, rows
