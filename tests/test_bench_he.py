"""A small, fast run of ``run_he_bench``: JSON field names, positive rates, the rich table."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from senseshield.bench import render_he_table, run_he_bench
from senseshield.errors import ConfigError

FIELDS = {
    "name",
    "encrypt_params_per_s",
    "aggregate_params_per_s",
    "decrypt_params_per_s",
    "bytes_per_param",
    "speedup_vs_phe",
}
NAMES = ["phe", "packed-paillier", "packed-paillier+pool", "packed-paillier (standard key)", "ckks", "ckks-sum"]


@pytest.fixture(scope="module")
def result() -> dict:
    messages: list[str] = []
    out = run_he_bench(
        params=300, clients=2, key_bits=512, seed=1, phe_params=5, window_bits=4,
        progress=messages.append,
    )
    assert messages and all(isinstance(m, str) for m in messages)
    return out


def test_json_structure(result: dict) -> None:
    json.loads(json.dumps(result))  # JSON-ready
    assert [s["name"] for s in result["schemes"]] == NAMES
    for entry in result["schemes"]:
        assert FIELDS <= set(entry)
        for field in FIELDS - {"name", "speedup_vs_phe"}:
            assert math.isfinite(entry[field]) and entry[field] > 0, (entry["name"], field)
        assert set(entry["speedup_vs_phe"]) == {"encrypt", "aggregate", "decrypt", "bytes"}
        assert all(v > 0 for v in entry["speedup_vs_phe"].values())
    phe = result["schemes"][0]
    assert all(v == pytest.approx(1.0) for v in phe["speedup_vs_phe"].values())
    assert result["config"]["params"] == 300 and result["config"]["phe_params"] == 5
    assert result["machine"]["cpu_model"]
    assert {t["name"] for t in result["targets"]} >= {"packed_encrypt_speedup"}


def test_packed_results_are_exact_and_compact(result: dict) -> None:
    by_name = {s["name"]: s for s in result["schemes"]}
    packed = by_name["packed-paillier"]
    assert packed["details"]["exact_sum_of_quantised"] is True
    standard = by_name["packed-paillier (standard key)"]
    assert standard["details"]["exact_sum_of_quantised"] is True
    assert (packed["details"]["structure"], standard["details"]["structure"]) == ("subgroup", "standard")
    assert packed["bytes_per_param"] < by_name["phe"]["bytes_per_param"] / 10
    assert by_name["packed-paillier+pool"]["details"]["pool_misses"] == 0
    assert by_name["ckks-sum"]["details"]["max_abs_error_of_mean"] < 1e-6


def test_rich_table_renders(result: dict) -> None:
    buffer = io.StringIO()
    Console(file=buffer, width=160).print(render_he_table(result))
    text = buffer.getvalue()
    for name in NAMES:
        assert name in text


def test_arguments_are_validated() -> None:
    with pytest.raises(ConfigError):
        run_he_bench(params=0)
    with pytest.raises(ConfigError):
        run_he_bench(key_bits=256)
