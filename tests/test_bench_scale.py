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


@pytest.mark.parametrize("strategy", ["sensecrypt", pytest.param("masked", marks=pytest.mark.slow),
                                      pytest.param("plaintext", marks=pytest.mark.slow)])
def test_six_generated_agents_are_all_counted_in_verified_aggregates(mosquitto, tmp_path, strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 1024-bit test key
        row = run_scale(6, strategy, rounds=2, key_bits=1024, out=tmp_path / "run", broker_url=mosquitto.url,
                        timeout=120)
    assert row["every_update_counted"] and row["updates_sent"] == 12 and not row["loadgen_errors"]
    assert row["clusters"] >= 1
    if strategy == "sensecrypt":  # the key server really verified and decrypted
        assert 0 < row["he_ratio"] < 1 and row["decrypt_s"] > 0 and row["verify_s"] > 0
    if strategy == "masked":  # every agent masked with its own pads, and the key server unmasked them
        assert row["he_ratio"] == 1.0 and row["decrypt_s"] > 0
    assert row["coordinator_cpu_s"] > 0 and row["keyserver_cpu_s"] > 0
    assert row["coordinator_peak_rss_mb"] > 0 and row["keyserver_peak_rss_mb"] > 0 and row["broker_mb"] > 0
    line = markdown_table([row | {"round_ratio_to_plaintext": 1.0}]).splitlines()[-1]
    assert line.startswith(f"| 6 | {strategy} | ") and line.endswith("| yes |")
