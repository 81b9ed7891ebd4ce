"""`senseshield report`: report.json -> report.html with PNG plots; straggling figures; Prometheus."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from senseshield.cli import app
from senseshield.trials.report import agent_segments, render_any, straggling_summary

FIXTURES = Path(__file__).parent / "fixtures"


def _agent(agent_id: str, rounds: dict) -> dict:
    return {"id": agent_id, "rounds": {
        str(r): {"cluster": k, "delivered": True, "timestamps": {"start_at": s, "update_received": e}}
        for r, (k, s, e) in rounds.items()}}


def test_straggling_summary_by_hand() -> None:
    # round 1: a busy 1 s, b 3 s (ratio 3); a waits 2 s for b. round 2: two clusters.
    agents = [
        _agent("a", {1: (0, 10.0, 11.0), 2: (0, 20.0, 21.0)}),
        _agent("b", {1: (0, 10.0, 13.0), 2: (1, 20.0, 22.0)}),
        _agent("c", {2: (1, 20.5, 21.0)}),
    ]
    s = straggling_summary(agents)
    r1, r2 = s["rounds"]
    assert (r1["slowest_s"], r1["fastest_s"], r1["ratio"], r1["idle_s"]) == (3.0, 1.0, 3.0, 2.0)
    assert (r1["slowest_agent"], r1["fastest_agent"]) == ("b", "a")
    # round 2: busy a 1, b 2, c 0.5 -> ratio 4; idle only inside cluster 1: c waits 1 s for b
    assert (r2["ratio"], r2["idle_s"]) == (4.0, 1.0)
    assert r2["clusters"]["1"]["ratio"] == 4.0 and r2["clusters"]["0"]["idle_s"] == 0.0
    assert s["median_ratio"] == 3.5
    assert straggling_summary([])["median_ratio"] is None
    # a negotiating strategy: the fast agent's wait for the consensus mask is idle, not work
    # (a: busy 2 s of which 1.2 s waiting for the mask; b: busy 3 s, 0.2 s waiting)
    agents[0]["rounds"]["1"]["timestamps"]["update_received"] = 12.0
    agents[0]["rounds"]["1"]["phases"] = {"negotiate": 1.2}
    agents[1]["rounds"]["1"]["phases"] = {"negotiate": 0.2}
    s = straggling_summary(agents)
    r1 = s["rounds"][0]
    # busy 2 vs 3: ratio 1.5; work 2 - 1.0 vs 3: 3.0; idle: a waits 1 s after delivery + 1 s for the mask
    assert (r1["ratio"], r1["work_ratio"], r1["idle_s"]) == (1.5, 3.0, 2.0)
    assert s["median_work_ratio"] == 3.5
    # an agent that did not deliver is not counted
    agents[0]["rounds"]["1"]["delivered"] = False
    assert straggling_summary(agents)["rounds"][0]["agents"] == 1


def test_report_renders_from_a_saved_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "report-sensecrypt", run)
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report.html").read_text()
    for title in ("Straggling per round", "Agents", "Timeline", "Budgets and HE ratios", "Accuracy", "Bytes"):
        assert title in page
    for name in ("timeline", "straggling", "budgets", "accuracy", "bytes"):
        png = run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f'src="plots/{name}.png"' in page
    report = json.loads((run / "report.json").read_text())
    # every agent round became Gantt bars, and the server's aggregate/decrypt too
    bars = agent_segments(report)
    assert {b[0] for b in bars} >= {a["id"] for a in report["agents"]} | {"key server (cluster 0)"}
    assert {"train", "encrypt", "upload", "decrypt", "aggregate"} <= {b[2] for b in bars}
    assert all(end >= start for *_, start, end in bars)


def test_report_of_an_older_report_recomputes_straggling(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    report = json.loads((FIXTURES / "report-sensecrypt" / "report.json").read_text())
    report["straggling"] = report.pop("straggling_events")  # the list of events, as before
    (run / "report.json").write_text(json.dumps(report))
    render_any(run)
    assert (run / "plots" / "straggling.png").exists()
    assert "Straggling per round" in (run / "report.html").read_text()


def test_trial_report_compares_runs(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "report-sensecrypt", tmp_path / "sensecrypt-calibrated")
    trial = {
        "name": "t", "description": "d", "scale": 1.0, "broker": "mosquitto",
        "machine": {"cpu": "x", "cores": 2, "load_at_start": [0, 0, 0]},
        "emulation": {"cgroup": "v1", "netns": True, "qdisc": "tbf", "notes": ["latency is not emulated"]},
        "agents": [{"id": "c000", "device": "x86", "cpu_share": 0.5, "bandwidth": 1.0, "latency_ms": 0,
                    "cpu_speed": 24, "applied": {"cpu_quota": "50000/100000 us"}}],
        "runs": [{"label": "sensecrypt-calibrated", "strategy": "sensecrypt", "budget_mode": "calibrated",
                  "median_ratio": 1.2, "median_ratio_after_round_1": 1.1, "median_round_s": 2.0,
                  "round_s_vs_plaintext": None, "median_idle_s": 0.1, "he_ratio_mean": 0.5,
                  "mb_up_per_round": 1.0, "final_accuracy": 0.9, "straggling_events": 0,
                  "budgets": {"c000": 1.0}}],
    }
    (tmp_path / "trial.json").write_text(json.dumps(trial))
    page = render_any(tmp_path)
    html = Path(page).read_text()
    assert "sensecrypt-calibrated/report.html" in html and "latency is not emulated" in html
    assert (tmp_path / "comparison.png").exists()
    assert (tmp_path / "sensecrypt-calibrated" / "report.html").exists()


def test_report_bad_directory_is_one_sentence(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "neither report.json nor trial.json" in result.output and "Traceback" not in result.output


def test_prometheus_endpoint_of_the_coordinator() -> None:
    from coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics(0)  # the default address: localhost only (issue 14)
    assert metrics.server_handle.server_address[0] == "127.0.0.1"
    try:
        metrics.agent_round("c000", 1, {"train": 0.5, "encrypt": 1.25, "plan_received_at": 1e9, "bytes_down": 9.0})
        record = {"seconds": 3.5, "clusters": {0: {"timings": {"aggregate": 0.1, "decrypt": 0.9}}}}
        metrics.round_done(1, record, agents={"c000": {"bytes_up": 1000, "plan_sent": 10.0, "update_received": 12.5}},
                           straggling=[{"round": 1, "agent": "c001", "missing": "update"},
                                       {"round": 1, "agent": "c002", "missing": "failed"}], online=3, joined=3)
        metrics.straggling({"ratio": 1.4, "idle_s": 0.7, "slowest_agent": "c001", "slowest_s": 2.0}, 1.3)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    for line in ('senseshield_agent_phase_seconds{agent="c000",phase="encrypt"} 1.25',
                 'senseshield_server_phase_seconds{cluster="0",phase="decrypt"} 0.9',
                 "senseshield_round 1.0", "senseshield_round_seconds 3.5", "senseshield_straggling_ratio 1.4",
                 'senseshield_slowest_agent_seconds{agent="c001"} 2.0', 'senseshield_agent_bytes_up_total{agent="c000"} 1000.0',
                 "senseshield_straggling_median_ratio 1.3", "senseshield_straggling_events 2.0",
                 'senseshield_agent_bytes_down_total{agent="c000"} 9.0', 'senseshield_agent_round_seconds{agent="c000"} 2.5',
                 'senseshield_agent_last_round{agent="c000"} 1.0',
                 'senseshield_agent_straggling_total{agent="c002",missing="failed"} 1.0'):
        assert line in text, line
    assert "plan_received_at" not in text and 'phase="bytes_down"' not in text
