"""Field trials: device-class profiles, trial files, emulated devices (cgroups, network
namespaces, tc) and their cleanup.

The emulation tests need Linux and root (cgroups, `ip netns`, `tc`); elsewhere they are
skipped with the reason the trial itself gives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

# trials own cgroups, namespaces and links: never two at a time (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("trials")

from edge_agent.probes import load_profile
from senseshield.cli import app
from senseshield.errors import ConfigError
from senseshield.trials.emulation import Capabilities, Emulation, cleanup_stale, leftovers, probe
from senseshield.trials.trial import (
    DeviceClass,
    device_class_files,
    load_device_class,
    load_trial,
    plan_agents,
    run_trial,
    training_defaults,
)

REPO = Path(__file__).resolve().parent.parent
CLASSES = ("rpi4", "rpi5", "jetson-nano", "jetson-orin-nano", "x86")


# ---- profiles and trial files -------------------------------------------------------------------


@pytest.mark.parametrize("name", CLASSES)
def test_device_class_profiles_validate(name: str) -> None:
    path = REPO / "profiles" / f"{name}.yaml"
    device = load_device_class(path)
    assert isinstance(device, DeviceClass)
    agent = load_profile(name)  # what `edge-agent join --profile NAME` reads
    assert agent.cpu_speed == pytest.approx(device.clock_mhz / 1000 * device.cores)
    assert 0 < agent.cpu_share <= 1.0 and agent.bandwidth > 0 and agent.latency_ms >= 0
    assert agent.local_epochs >= 1 and agent.batch_size >= 1
    assert "sbc-bench" in path.read_text() or name == "x86"  # the shares cite their source


def test_every_device_class_file_is_checked_and_ordered_by_speed() -> None:
    names = {p.stem for p in device_class_files()}
    assert names == set(CLASSES)
    share = {n: load_profile(n).cpu_share for n in CLASSES}
    assert share["jetson-nano"] < share["rpi4"] < share["jetson-orin-nano"] < share["rpi5"] < share["x86"]


def test_a_device_class_missing_an_emulation_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pi.yaml"
    path.write_text("board: x\ncores: 4\nclock_mhz: 1500\nmemory_mb: 1024\nbandwidth: 5\n"
                    "latency_ms: 3\nlocal_epochs: 1\nbatch_size: 8\n")
    with pytest.raises(ConfigError, match=r"cpu_share field required"):
        load_device_class(path)


def test_example_trials_validate() -> None:
    het = load_trial(REPO / "profiles" / "trials" / "sensecrypt-system-heterogeneity.yaml")
    plans, scale = plan_agents(het)
    assert scale == 1.0
    assert [round(p.cpu_share, 2) for p in plans] == [0.48, 0.32, 0.24, 0.20, 0.16]
    assert [p.bandwidth for p in plans] == [1.0, 0.9, 0.8, 0.7, 0.6]
    assert [p.profile.cpu_speed for p in plans] == [24, 16, 12, 10, 8]
    assert [r.name for r in het.run_specs] == ["maskcrypt", "sensecrypt-paper", "sensecrypt-calibrated", "plaintext"]
    mixed = load_trial("mixed-pi-jetson")  # a name is looked up in profiles/trials/
    plans, scale = plan_agents(mixed)
    assert len(plans) == 5 and 0 < scale < 1
    assert sum(p.cpu_share for p in plans) == pytest.approx(mixed.cpu_budget)
    rpi4 = load_profile("rpi4")
    assert plans[0].bandwidth == pytest.approx(rpi4.bandwidth * scale)
    assert plans[0].latency_ms == pytest.approx(rpi4.latency_ms / scale)
    assert training_defaults(mixed, plans) == (1, 16)


def test_profiles_that_disagree_need_explicit_training_defaults(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("fleet: [{profile: rpi4}, {profile: rpi5}]\nruns: [plaintext]\n")
    spec = load_trial(path)
    with pytest.raises(ConfigError, match=r"disagree on local_epochs \(1, 2\); set local_epochs"):
        training_defaults(spec, plan_agents(spec)[0])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [plaintext]\nwifi: 1\n", "wifi"),
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [plaintext, plaintext]\n", "used twice"),
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [plaintext]\nscale: 3\n", "scale=3"),
        ("fleet: [{profile: rpi4}]\nruns: [plaintext]\n", "at least 2 agents"),
        ("fleet: [{profile: pi9, count: 2}]\nruns: [plaintext]\n", "Unknown profile 'pi9'"),
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [{strategy: nope}]\nlocal_epochs: 1\n", "nope"),
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [{strategy: sensecrypt, budget_mode: fast}]\n", "budget_mode='fast'"),
        ("fleet: [{profile: rpi4, count: 2}]\nruns: [plaintext]\nbroker: amqp://x\n", "broker 'amqp://x'"),
        ("- 1\n", "must be a mapping"),
    ],
)
def test_bad_trials_are_one_sentence(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["trial", "run", str(path), "--out", str(tmp_path / "out"), "--quiet",
                                      "--no-emulation"])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_without_emulation_the_trial_says_so() -> None:
    caps = probe(emulate=False)
    assert caps.cgroup is None and not caps.netns
    assert "unconfined" in caps.notes[0] and "no CPU limits" in caps.describe()


def test_not_root_means_unconfined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    caps = probe()
    assert not caps.netns and caps.cgroup is None
    assert "needs root" in caps.notes[0] or "needs Linux" in caps.notes[0]


def test_wrap_puts_an_agent_into_its_cgroup_and_namespace(tmp_path: Path) -> None:
    emulation = Emulation(Capabilities())
    emulation.namespaces["c001"] = "sst-1-c001"
    emulation.cgroups["c001"] = tmp_path
    argv = emulation.wrap("c001", ["python", "-m", "edge_agent.cli", "join"])
    assert argv[:3] == ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"']
    assert argv[3:] == [str(tmp_path), "ip", "netns", "exec", "sst-1-c001", "python", "-m", "edge_agent.cli", "join"]
    assert emulation.wrap("c000", ["x"]) == ["x"]


# ---- emulation (root) ---------------------------------------------------------------------------


def _emulation_or_skip() -> Capabilities:
    caps = probe()
    if not (caps.cgroup and caps.netns and caps.qdisc):
        pytest.skip("device emulation is not available here: " + "; ".join(caps.notes or [caps.describe()]))
    return caps


TWO_AGENTS = """name: two-agents
rounds: 2
deadline: 60
model: mlp
local_epochs: 6
batch_size: 16
min_contributors: 1
scale: 1.0
fleet:
  - {profile: x86, board: fast, cpu_share: 1.0, bandwidth: 20, latency_ms: 0}
  - {profile: x86, board: slow, cpu_share: 0.25, bandwidth: 0.25, latency_ms: 0}
runs: [plaintext]
"""


@pytest.mark.slow  # make test-slow: the default suite stays under 8 min on 2 cores
def test_a_throttled_agent_is_measurably_slower_and_nothing_is_left_behind(tmp_path: Path) -> None:
    _emulation_or_skip()
    path = tmp_path / "two.yaml"
    path.write_text(TWO_AGENTS)
    said: list[str] = []
    trial = run_trial(load_trial(path), tmp_path / "out", say=said.append, timeout=300)
    assert any(s.startswith("emulation: cgroup") for s in said)
    fast, slow = trial["agents"]
    assert fast["applied"]["cpu_quota"] == "10000/10000 us" and slow["applied"]["cpu_quota"] == "2500/10000 us"
    assert "rate 2000000bit" in slow["applied"]["qdisc"]
    import json

    report = json.loads((tmp_path / "out" / "plaintext" / "report.json").read_text())
    rounds = {a["id"]: a["rounds"] for a in report["agents"]}
    # round 2 (round 1 warms torch up): a quarter of a core trains slower, 0.25 MB/s uploads slower
    f, s = rounds["c000"]["2"], rounds["c001"]["2"]
    assert s["phases"]["train"] > 1.8 * f["phases"]["train"], (s["phases"], f["phases"])
    assert s["phases"]["upload"] > 0.5  # 210 kB at 0.25 MB/s: ~0.84 s
    assert s["phases"]["upload"] > 10 * f["phases"]["upload"]
    assert s["busy_s"] > 3 * f["busy_s"]
    assert report["straggling"]["rounds"][1]["slowest_agent"] == "c001"
    assert trial["runs"][0]["median_ratio"] > 3
    assert trial["cleanup"] == {"left": []}
    assert leftovers(os.getpid()) == []


def test_ctrl_c_removes_everything(tmp_path: Path) -> None:
    _emulation_or_skip()
    path = tmp_path / "two.yaml"
    path.write_text(TWO_AGENTS.replace("rounds: 2", "rounds: 50"))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "senseshield.cli", "trial", "run", str(path), "--out", str(out),
                             "--quiet", "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def agents() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(out) in part for part in (p.info["cmdline"] or [])) and "edge_agent.cli" in p.info["cmdline"]:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return found

    end = time.monotonic() + 120
    while time.monotonic() < end and len(agents()) < 2:
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.3)
    assert len(leftovers(proc.pid)) >= 5  # 2 namespaces, bridge + 2 veths, cgroup
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=90)[0].decode()
    assert proc.returncode == 130, output
    assert "everything it started was removed" in output
    assert leftovers(proc.pid) == []
    time.sleep(0.5)
    assert agents() == []


def test_stale_leftovers_of_a_dead_trial_are_removed() -> None:
    caps = _emulation_or_skip()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a "trial" that died
    pid = dead.pid
    subprocess.run(["ip", "netns", "add", f"sst-{pid}-c000"], check=True)
    subprocess.run(["ip", "link", "add", f"sst{pid}br", "type", "bridge"], check=True)
    (caps.cgroup_root / f"senseshield-trial-{pid}" / "c000").mkdir(parents=True)
    try:
        assert len(leftovers(pid)) == 3
        removed = cleanup_stale()
        assert {r.split()[0] for r in removed if str(pid) in r} == {"netns", "link", "cgroup"}
        assert leftovers(pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"sst-{pid}-c000"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"sst{pid}br"], capture_output=True)
