"""The coordinator's report (coordinator.report) from a hand-made job state (JobState), no broker: the
metric is the agents' test metrics weighted by test samples, agents' timestamps move onto the
coordinator's clock by their estimated offset, busy time and straggling follow, and the
operator's round line says what happened."""

from __future__ import annotations

import pytest

from coordinator.report import clock_offsets, report, report_json, round_failure, round_line, round_records, straggling_now
from coordinator.roster import AgentInfo
from coordinator.state import JobState
from senseshield.accounting import Accountant
from senseshield.job import Job
from senseshield.results import RoundTally
from senseshield.runtime.protocol.messages import Hello, Metrics
from senseshield.strategies import FleetPlan


def _view() -> JobState:
    job = Job(strategy="plaintext", model="linear", clients=2, rounds=2, min_devices=2)
    tally = RoundTally()
    for a, n in (("a0", 500), ("a1", 700)):
        tally.add_update(a, {"train": 1.0}, 0.0, n, {})
    record = {"round": 1, "tally": tally, "joined": [], "left": ["a2"], "seconds": 2.0, "participants": 2,
              "sampled": 2, "user_epsilon": None, "user_epsilon_server": None, "started_at": 100.0,
              "finished_at": 102.0,
              "clusters": {0: {"members": ["a0", "a1"], "updates": ["a0", "a1"], "straggled": [], "accepted": True,
                               "reason": "", "refused": {}, "timings": {"aggregate": 0.1, "decrypt": 0.2},
                               "timestamps": {}}}}
    # a0's clock is 0.2 s ahead: the plan took 0.5 s down on its clock, its hello 0.1 s up
    metrics = {
        ("a0", 1): Metrics(cluster=0, metric=0.8, n_test=10, timings={
            "plan_frame_sent_at": 100.0, "plan_received_at": 100.5, "ready_at": 100.6, "train": 1.0}),
        ("a1", 1): Metrics(cluster=0, metric=0.6, n_test=30, timings={
            "plan_frame_sent_at": 100.0, "plan_received_at": 100.3, "ready_at": 100.4, "train": 0.5}),
    }
    agent_rounds = {a: {1: {"cluster": 0, "plan_sent": 100.0, "budget": 1.0, "steps": 5, "full_steps": 5,
                            "update_received": end, "he_ratio": 0.0, "bytes_up": 600, "mask_sha256": "m",
                            "agent_timings": {"train": 1.0}}}
                    for a, end in (("a0", 102.0), ("a1", 101.0))}
    agents = {a: AgentInfo(Hello(run_id="j-1", agent_id=a, n_samples=100, bandwidth=2.0, cpu_speed=1.0, index=i),
                           online=a == "a0")
              for i, a in enumerate(["a0", "a1"])}
    return JobState(
        run_id="j-1", config=job, size=10, input_shape=[4], num_classes=2, round_deadline=30.0,
        plan=FleetPlan({"a0": 0, "a1": 0}, {"a0": 1.0, "a1": 1.0}), agents=agents, records=[record],
        metrics=metrics, agent_rounds=agent_rounds, uplink_delays={"a0": [0.1]}, user_accountant=Accountant(),
        participations={}, started=99.0, straggling=[],
    )


def test_a_report_from_a_hand_made_state():
    view = _view()
    # a1 has no uplink sample: one clock assumed (no figure, 0.0)
    assert clock_offsets(view.metrics, view.uplink_delays) == {"a0": 0.2}
    result = report(view, fleet="f", rejected=["bad frame"], rejected_total=3)
    assert result.rounds[0].accuracy == pytest.approx(0.65)  # (0.8 * 10 + 0.6 * 30) / 40
    assert result.final_accuracy == pytest.approx(0.65) and result.rounds[0].left == ["a2"]
    assert result.rounds[0].bytes_up == 1200 and result.rounds[0].participants == 2
    a0, a1 = result.agents
    assert (a0["online"], a1["online"]) == (True, False) and a0["clock_offset_s"] == 0.2
    r0 = a0["rounds"]["1"]
    assert r0["timestamps"]["start_at"] == pytest.approx(100.4)  # ready_at on the coordinator's clock
    assert r0["busy_s"] == pytest.approx(1.6) and a1["rounds"]["1"]["busy_s"] == pytest.approx(0.6)
    assert r0["delivered"] and r0["metric"] == 0.8 and r0["phases"] == {"train": 1.0}
    last = result.straggling["rounds"][-1]
    assert (last["slowest_agent"], last["fastest_agent"]) == ("a0", "a1")
    assert last["ratio"] == pytest.approx(1.6 / 0.6, abs=1e-3)
    assert straggling_now(view)[0] == last
    assert [c.accuracy for c in result.clients] == [0.8, 0.6]
    assert result.server[0]["clusters"]["0"]["timings"]["decrypt"] == 0.2
    assert (result.rejected_messages, result.rejected_total) == (["bad frame"], 3)
    assert result.epsilon is None and result.key_id is None
    result.model_validate(result.model_dump(mode="json"))  # what result.json holds reads back
    # report.json's object: the same as a full dump, in field order, without copying the large lists
    written = report_json(result)
    assert written == result.model_dump(mode="json") and list(written) == list(result.model_dump(mode="json"))
    assert written["agents"] is result.agents


def test_the_round_line():
    view = _view()
    line, value = round_line(view.records[0], rounds=2, out=1, metrics=view.metrics, metric_name="accuracy")
    assert line == "round 1/2: 2 in, 0 late, 1 out, left a2; accuracy 0.65 (round 1); 2.0 s"
    assert value == pytest.approx(0.65)
    line, value = round_line(view.records[0], rounds=2, out=0, metrics={}, metric_name="mse")
    assert line == "round 1/2: 2 in, 0 late, 0 out, left a2; mse pending; 2.0 s" and value is None


def test_each_round_has_the_training_metrics_of_its_own_updates():
    """Training metrics travel with the update they describe: round r's record holds those of
    round r's updates, even when the device's evaluation of round r's model arrives later, and
    a device without an update in a round keeps its latest (as the simulator keeps them)."""
    view = _view()
    view.agent_rounds["a0"][1]["training"] = {"training_loss": 2.0}
    view.agent_rounds["a1"][1]["training"] = {"training_loss": 4.0}
    second = dict(view.records[0], round=2)
    view.records.append(second)
    view.agent_rounds["a0"][2] = {"cluster": 0, "training": {"training_loss": 1.0}}
    view.agent_rounds["a1"][2] = {"cluster": 0}  # no update in round 2
    first, then = round_records(view)
    assert first.metrics["training_loss"] == pytest.approx((2.0 * 10 + 4.0 * 30) / 40)
    assert then.metrics["training_loss"] == pytest.approx((1.0 * 10 + 4.0 * 30) / 40)
    result = report(view, fleet="f")
    assert result.clients[0].metrics["training_loss"] == 1.0 and result.agents[0]["rounds"]["2"]["training"] == {
        "training_loss": 1.0}


def test_the_round_line_names_who_failed_and_why_apart_from_the_late():
    view = _view()
    rec = dict(view.records[0])
    rec["clusters"] = {0: dict(rec["clusters"][0], members=["a0", "a1", "a2", "a3", "a4"], updates=["a0"],
                               straggled=["a1", "a2", "a3", "a4"],
                               failed={"a1": "ValueError: NaN labels.", "a2": "ValueError: NaN labels.",
                                       "a3": "OSError: disk full."})}
    line, _ = round_line(rec, rounds=2, out=0, metrics=view.metrics, metric_name="accuracy")
    assert line.startswith("round 1/2: 1 in, 1 late, 3 failed (a1, a2: ValueError: NaN labels; a3: OSError: disk full), 0 out")
    assert round_failure(rec) is None  # a0 delivered: the job goes on
    rec["clusters"][0]["updates"] = []
    assert round_failure(rec) == ("round 1: no device delivered an update; 3 failed (a1, a2: ValueError: NaN labels; "
                                  "a3: OSError: disk full)")
    rec["clusters"][0]["failed"] = {}
    assert round_failure(rec) is None  # only late: the devices may come back
