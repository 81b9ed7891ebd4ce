"""The device profiler behind `edge-agent profile`: real files, real benchmarks, real broker."""

from __future__ import annotations

import json
import math

import numpy as np
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from edge_agent.probes import cpu_name, detect_board, load_profile, measure_bandwidth, measure_profile
from edge_agent.profile import profile_command
from senseshield.profiles import (
    DEFAULT_BANDWIDTH_MBPS,
    DEFAULT_CLOCK_GHZ,
    LOOPBACK_BANDWIDTH_MBPS,
    PROFILES_ENV,
    DeviceProfile,
    cpu_speed_of,
    profile_names,
)
from senseshield.errors import ConfigError

XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Test CPU @ 2.70GHz
cpu MHz\t\t: 2700.000

processor\t: 1
model name\t: Intel(R) Xeon(R) Test CPU @ 2.70GHz
cpu MHz\t\t: 2700.000
"""

PI4_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd08

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""

TEGRA = "# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref, EABI: aarch64, DATE: Sat Feb 19 17:05:08 UTC 2022\n"


@pytest.fixture()
def files(tmp_path):
    def write(name: str, data: str | bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    return write


# ---- board detection -------------------------------------------------------------------------


def test_raspberry_pi_from_device_tree_model_with_trailing_nul(files, tmp_path):
    model = files("model", b"Raspberry Pi 4 Model B Rev 1.4\x00")
    cpuinfo = files("cpuinfo", PI4_CPUINFO)
    board = detect_board(device_tree_model=model, tegra_release=tmp_path / "none", cpuinfo=cpuinfo)
    assert board == "Raspberry Pi 4 Model B Rev 1.4"
    assert cpu_name(cpuinfo=cpuinfo) == "Cortex-A72"  # ARM cpuinfo has no "model name"


def test_jetson_from_tegra_release_plus_device_tree_model(files, tmp_path):
    release = files("nv_tegra_release", TEGRA)
    model = files("model", b"NVIDIA Jetson Nano Developer Kit\x00")
    board = detect_board(device_tree_model=model, tegra_release=release, cpuinfo=tmp_path / "none")
    assert board == "Jetson (L4T R32.7.1): NVIDIA Jetson Nano Developer Kit"
    alone = detect_board(device_tree_model=tmp_path / "none", tegra_release=release, cpuinfo=tmp_path / "none")
    assert alone == "Jetson (L4T R32.7.1)"


def test_other_boards_fall_back_to_the_cpu_name(files, tmp_path):
    cpuinfo = files("cpuinfo", XEON_CPUINFO)
    board = detect_board(device_tree_model=tmp_path / "none", tegra_release=tmp_path / "none", cpuinfo=cpuinfo)
    assert board == "Intel(R) Xeon(R) Test CPU @ 2.70GHz"
    # nothing readable at all: platform.processor()/machine(), never empty
    assert detect_board(device_tree_model=tmp_path / "a", tegra_release=tmp_path / "b", cpuinfo=tmp_path / "c")


# ---- YAML profiles ----------------------------------------------------------------------------


def test_yaml_profile_with_only_what_the_coordinator_needs(files):
    path = files("pi4.yaml", "bandwidth: 12.5\ncpu_speed: 6.0\n")
    profile = load_profile(str(path))
    assert (profile.bandwidth, profile.cpu_speed) == (12.5, 6.0)
    assert profile.gflops is None and profile.timings == {}


def test_yaml_profile_by_name_and_derived_numbers(files, tmp_path, monkeypatch):
    files("jetson-nano.yaml", "board: Jetson Nano\ncores: 4\nclock_mhz: 1479\nbandwidth_up_mbps: 8\n")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    assert "jetson-nano" in profile_names()
    profile = load_profile("jetson-nano")
    assert profile.board == "Jetson Nano"
    assert profile.cpu_speed == pytest.approx(1.479 * 4)
    assert profile.bandwidth == 8.0


def test_unknown_profile_name_lists_the_available_ones(files, tmp_path, monkeypatch):
    files("pi5.yaml", "bandwidth: 20\ncpu_speed: 9.6\n")
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=r"Unknown profile 'pi9'; .*one of: auto, .*pi5"):
        load_profile("pi9")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bandwidth: -5\ncpu_speed: 6\n", r"bandwidth=-5, which is not allowed: input should be greater than 0\."),
        ("bandwidth: 5\ncpu_speed: .nan\n", r"cpu_speed=nan, which is not allowed"),
        ("bandwidth: 5\ncpu_speed: 6\nwifi: yes\n", r"unknown field 'wifi'; allowed fields: board, "),
        ("bandwith: 5\ncpu_speed: 6\n", r"unknown field 'bandwith' \(did you mean 'bandwidth'\?\)"),
        ("bandwidth: 5\n", r"lacks 'cpu_speed'"),
        ("bandwidth: [5, 6]\ncpu_speed: 6\n", r"bandwidth=\[5, 6\], which is not allowed"),
        ("- 5\n- 6\n", r"must be a mapping"),
        ("bandwidth: [5\n", r"not valid YAML"),
    ],
)
def test_bad_yaml_profiles_are_one_sentence_config_errors(files, text, message):
    path = files("bad.yaml", text)
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(str(path))
    assert "\n" not in str(info.value) and "'" + str(path) + "'" in str(info.value)


def test_missing_file_and_the_repositorys_fleet_file():
    with pytest.raises(ConfigError, match=r"Profile file '/nonexistent/pi\.yaml' does not exist\."):
        load_profile("/nonexistent/pi.yaml")
    # profiles/ of the repository is searched; its fleet-level file is no device profile
    with pytest.raises(ConfigError, match=r"has unknown field 'cpu'; allowed fields: board, "):
        load_profile("sensecrypt-system-heterogeneity")


def test_profiles_are_frozen_and_cpu_speed_falls_back():
    profile = DeviceProfile(bandwidth=1, cpu_speed=2)
    with pytest.raises(Exception):
        profile.bandwidth = 3  # type: ignore[misc]
    assert cpu_speed_of(None, 4) == DEFAULT_CLOCK_GHZ * 4
    assert cpu_speed_of(2400.0, 4) == pytest.approx(9.6)


# ---- measuring --------------------------------------------------------------------------------


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_quick_profile_measures_positive_numbers_and_times_each_step():
    profile = measure_profile(quick=True)
    for name in ("cores", "physical_cores", "memory_mb", "gflops", "he_encryptions_per_s", "cpu_speed", "bandwidth"):
        assert _positive(getattr(profile, name)), name
    assert profile.he_scheme == "packed-paillier" and profile.he_key_bits == 2048
    assert profile.bandwidth_up_mbps is None and profile.bandwidth == DEFAULT_BANDWIDTH_MBPS
    if profile.clock_mhz is not None:
        assert profile.cpu_speed == pytest.approx(profile.clock_mhz / 1000 * profile.cores)
    steps = {"system", "torch_import", "matmul", "he_keygen", "he_setup", "he_encrypt", "total"}  # torch in a child process
    assert set(profile.timings) == steps
    assert all(math.isfinite(t) and t >= 0 for t in profile.timings.values())
    assert all(profile.timings[s] > 0 for s in ("matmul", "he_keygen", "he_encrypt", "total"))
    assert profile.timings["total"] >= profile.timings["matmul"] + profile.timings["he_encrypt"]


def test_key_bits_are_refused_for_schemes_without_them():
    with pytest.raises(ConfigError, match=r"--key-bits=2048 does not apply to scheme 'ckks'"):
        measure_profile(scheme="ckks", key_bits=2048, quick=True)
    with pytest.raises(ConfigError, match=r"Unknown HE scheme 'rsa'"):
        measure_profile(scheme="rsa", quick=True)


def test_bandwidth_through_a_real_mosquitto(mosquitto):
    result = measure_bandwidth(mosquitto.url, "lab", nbytes=200_000, probes=5, min_seconds=0.03)
    assert _positive(result.mbps) and _positive(result.round_trip_s)
    assert result.frame_bytes > 200_000
    assert result.mbps == pytest.approx(2 * result.frame_bytes / result.round_trip_s / 1e6)
    spread = result.spread
    assert spread.probes == 5 and result.mbps == spread.median and spread.low <= spread.median <= spread.high
    assert result.seconds >= 5 * 0.03  # every probe lasted its minimum duration
    best = measure_bandwidth(mosquitto.url, "lab", nbytes=200_000, probes=2, min_seconds=0.0, best=True)
    assert best.mbps == best.spread.high and best.spread.probes == 2  # the old single short probe


def test_declared_profile_bounds_measured_figures(mosquitto, tmp_path):
    declared = tmp_path / "slow.yaml"
    declared.write_text("bandwidth: 2.5\ncpu_speed: 0.5\nlatency_ms: 20\nlocal_epochs: 2\n")
    profile = load_profile(f"auto:{declared}", broker=mosquitto.url, fleet="lab", quick=True)
    # loopback measures far more than 2.5 MB/s and this machine more than 0.5 GHz x cores
    assert profile.bandwidth_up_mbps > 2.5 and profile.bandwidth == 2.5
    assert profile.cpu_speed == 0.5 and profile.capped == ["bandwidth", "cpu_speed"]
    assert profile.bounds == {"bandwidth": 2.5, "cpu_speed": 0.5} and profile.declared_profile == str(declared)
    assert profile.latency_ms == 20 and profile.local_epochs == 2  # the declared class's defaults
    assert profile.measurements["bandwidth"].probes >= 5  # what was measured stays as measured
    # a generous declaration bounds nothing
    roomy = load_profile("auto:x86", quick=True)
    assert roomy.capped == [] and roomy.cpu_speed <= roomy.bounds["cpu_speed"]
    assert roomy.declared_profile == "x86"


def test_declared_profile_mistakes_are_one_sentence():
    with pytest.raises(ConfigError, match=r"Profile 'auto:' is not allowed; use auto:NAME or auto:FILE.yaml"):
        load_profile("auto:")
    with pytest.raises(ConfigError, match=r"Unknown profile 'pi9'; use a YAML file path or one of: auto, auto:NAME\|FILE"):
        load_profile("auto:pi9")  # refused before anything is measured


def test_bandwidth_without_a_broker_is_a_connection_error(tmp_path):
    from tests.broker import free_port

    with pytest.raises(ConnectionError):
        measure_bandwidth(f"mqtt://127.0.0.1:{free_port()}", nbytes=1000, timeout=0.5)


# ---- `edge-agent profile` ---------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("profile")(profile_command)

    @app.callback()
    def _root() -> None:
        """Throwaway root so that `profile` stays a sub-command."""

    return app


def test_profile_command_prints_json_with_a_measured_bandwidth(mosquitto):
    result = CliRunner().invoke(_app(), ["profile", "--quick", "--broker", mosquitto.url, "--fleet", "lab"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    profile = DeviceProfile.model_validate(data)
    assert profile.bandwidth_up_mbps == profile.bandwidth_down_mbps > 0
    # the broker is on this host: r_i is non-limiting, the probe's figure stays in bandwidth_up_mbps
    assert profile.bandwidth == max(profile.bandwidth_up_mbps, LOOPBACK_BANDWIDTH_MBPS)
    assert profile.he_bytes_per_value > 0
    assert {"matmul", "he_keygen", "he_encrypt", "bandwidth", "total"} <= set(profile.timings)
    summary = data["measurements"]["bandwidth"]
    assert summary["median"] == profile.bandwidth_up_mbps and summary["min"] <= summary["median"] <= summary["max"]
    assert summary["probes"] >= 5 and summary["confidence"] == pytest.approx(1 - 2 * 0.5 ** summary["probes"])
    assert {"gflops", "he_encryptions_per_s"} <= set(data["measurements"])


def test_profile_command_with_a_declared_profile_is_bounded(mosquitto):
    result = CliRunner().invoke(_app(), ["profile", "--quick", "--broker", mosquitto.url, "--declared", "rpi4"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    rpi4 = load_profile("rpi4")
    assert data["bandwidth"] <= rpi4.bandwidth and data["cpu_speed"] <= rpi4.cpu_speed
    assert data["declared_profile"] == "rpi4" and "bandwidth" in data["capped"]


def test_profile_command_refuses_bad_options_in_one_sentence():
    result = CliRunner().invoke(_app(), ["profile", "--quick", "--scheme", "ckks", "--key-bits", "1024"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "error:" in result.stderr and "does not apply to scheme 'ckks'" in result.stderr


@pytest.mark.slow  # ~10 s (make test-slow: the default suite stays under 8 min on 2 cores)
def test_profile_with_the_fleets_model_adds_inference_latency(tmp_path):
    from senseshield.inference import export_onnx
    from senseshield.models import build_model
    from senseshield.training import get_vector

    model = tmp_path / "model.onnx"
    weights = get_vector(build_model("mlp", (1, 8, 8), 10)).astype(np.float64)
    export_onnx("mlp", (1, 8, 8), 10, weights, model, fleet="lab", cluster=0, round=1)
    result = CliRunner().invoke(_app(), ["profile", "--quick", "--model", str(model)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    lat = data["inference_ms"]
    assert 0 < lat["b1_p50_ms"] <= lat["b1_p95_ms"] and 0 < lat["b32_p50_ms"] <= lat["b32_p95_ms"]
    assert data["timings"]["inference"] > 0
