"""Jobs on a long-running coordinator, devices that come and go, devices that refuse a job.

Real Mosquitto, real OS processes (``Fleet`` with ``serve=True``: the coordinator and the
agents stay up between jobs), jobs submitted over MQTT with :class:`JobClient` (what
``senseshield job submit`` uses).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from senseshield.job import Job, with_shape
from senseshield.runtime.fleet import Fleet, FleetOptions
from senseshield.runtime.jobs import JobClient
from senseshield.simulation import run_simulation


def wait_for(condition, timeout: float = 120.0, what: str = "condition") -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def report_of(record: dict) -> dict:
    return json.loads((Path(record["out"]) / "report.json").read_text())


def test_two_jobs_in_a_row_without_restarting_an_agent_and_a_device_that_refuses(mosquitto, tmp_path):
    """Job 1 (plaintext) then job 2 (Paillier, a new key) on the same agent processes; a
    fourth agent whose data does not fit the jobs declines both, and the jobs go on."""
    bad = tmp_path / "wrong-shape.npz"
    np.savez(bad, x=np.zeros((30, 5), np.float32), y=np.zeros(30, np.int64))
    base = Job(model="linear", partition="iid", clients=3, rounds=2, min_devices=3)
    options = FleetOptions(agents=4, out=tmp_path / "run", broker=mosquitto.url, fleet="jobs", serve=True,
                           min_contributors=1, data=[None, None, None, bad])
    first = with_shape(base.model_copy(update={"strategy": "plaintext", "name": "first"}))
    second = with_shape(base.model_copy(update={"strategy": "paillier-full", "key_bits": 1024, "name": "second"}))
    with Fleet(base, options) as fleet:
        fleet.start()
        with fleet.job_client() as client:
            records = []
            for job in (first, second):
                job_id = client.submit(job)
                records.append(client.follow(job_id, lambda line: None, timeout=240))
            board = client.board()
        alive = {name: proc.poll() for name, proc in fleet.processes.items()}
    assert [r["state"] for r in records] == ["done", "done"], [r["events"][-3:] for r in records]
    assert all(code is None for code in alive.values()), alive  # nobody restarted or exited between jobs
    assert [j["name"] for j in board] == ["first", "second"]
    for record, job in zip(records, (first, second)):
        report = report_of(record)
        sim = run_simulation(job.model_copy(update={"clients": 3}))
        assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
        assert sorted(c["id"] for c in report["clients"]) == ["c000", "c001", "c002"]
        assert "c003" in report["declined"] and "wrong-shape.npz" in report["declined"]["c003"]
        assert any("c003 refused the job" in line for line in record["events"])
    # the second job ran under a new key, announced for it
    log = (tmp_path / "run" / "logs" / "keyserver.log").read_text()
    assert "scheme none" in log and "scheme packed-paillier" not in log and "scheme paillier" in log
    agent_log = (tmp_path / "run" / "logs" / "c000.log").read_text()
    assert agent_log.count("waiting for the next job") == 2


@pytest.mark.slow  # make test-slow: the default suite stays under 8 min on 2 cores
def test_a_device_that_joins_mid_job_takes_part_from_the_next_round(mosquitto, tmp_path):
    """SenseCrypt on two label groups: three devices start the job; the fourth (held with
    SIGSTOP until round 1 is done) joins, is put in the nearest cluster and delivers from
    a later round; the report records the join."""
    job = with_shape(Job(strategy="sensecrypt", model="mlp", partition="categories:2", clients=4, rounds=6,
                         key_bits=1024, min_devices=3, bandwidth=[50, 30], cpu=[24, 8]))
    options = FleetOptions(agents=4, out=tmp_path / "run", broker=mosquitto.url, fleet="late", serve=True,
                           min_contributors=1)
    with Fleet(job, options) as fleet:
        fleet.start()
        late = fleet.processes["c003"]
        wait_for(lambda: "waiting for a job" in (tmp_path / "run" / "logs" / "c003.log").read_text(), 60, "c003 up")
        os.kill(late.pid, signal.SIGSTOP)
        with fleet.job_client() as client:
            job_id = client.submit(job)
            wait_for(lambda: client.record(job_id)["round"] >= 1, 180, "round 1")
            # the others pause (their round waits for them) until the late device is admitted:
            # it first loads its runtime (torch) when it sees the job, which on a busy machine
            # may outlast the job's remaining rounds
            others = [fleet.processes[a] for a in ("c000", "c001", "c002")]
            for p in others:
                os.kill(p.pid, signal.SIGSTOP)
            os.kill(late.pid, signal.SIGCONT)
            try:
                wait_for(lambda: any("c003 admitted to cluster" in line for line in client.record(job_id)["events"]),
                         240, "c003 admitted")
            finally:
                for p in others:
                    os.kill(p.pid, signal.SIGCONT)
            record = client.follow(job_id, lambda line: None, timeout=300)
    assert record["state"] == "done", record["events"][-5:]
    report = report_of(record)
    joined = {r["round"]: r["joined"] for r in report["rounds"] if r["joined"]}
    assert any("c003" in who for who in joined.values()), report["rounds"]
    first = min(r for r, who in joined.items() if "c003" in who)
    delivered = [int(r) for r, rec in next(a for a in report["agents"] if a["id"] == "c003")["rounds"].items()
                 if rec["delivered"]]
    assert delivered and min(delivered) >= first >= 2
    clusters = {c["id"]: c["cluster"] for c in report["clients"]}
    # categories:2 puts shards 0, 2 in one label group and 1, 3 in the other (the simulator's split)
    assert clusters["c003"] == clusters["c001"] != clusters["c000"]
    assert any("c003 admitted to cluster" in line for line in record["events"])


@pytest.mark.slow  # ~16 s; a device lost mid-round stays in the default suite (test_fleet faults)
def test_a_device_that_leaves_and_returns(mosquitto, tmp_path):
    """An agent stopped (SIGTERM: its status goes offline) after round 2 is not sampled
    while it is gone and takes part again once it is back (a new process, same id and data).
    The job has more rounds than the test needs; it is cancelled once the device is back."""
    job = with_shape(Job(strategy="plaintext", model="linear", clients=3, rounds=500, min_devices=3))
    options = FleetOptions(agents=3, out=tmp_path / "run", broker=mosquitto.url, fleet="away", serve=True,
                           min_contributors=1)
    events = lambda client: " | ".join(client.record(job_id)["events"])  # noqa: E731
    with Fleet(job, options) as fleet:
        fleet.start()
        with fleet.job_client() as client:
            job_id = client.submit(job)
            wait_for(lambda: client.record(job_id)["round"] >= 2, 180, "round 2")
            fleet.processes["c001"].send_signal(signal.SIGTERM)
            assert fleet.processes["c001"].wait(60) == 0  # a bound only a hang exceeds
            wait_for(lambda: "left c001" in events(client), 60, "a round without c001")
            gone = client.record(job_id)["round"]
            wait_for(lambda: client.record(job_id)["round"] >= gone + 2, 60, "two rounds without c001")
            fleet.spawn_agent(1)
            wait_for(lambda: "joined c001" in events(client), 120, "c001 back")
            back = client.record(job_id)["round"]
            wait_for(lambda: client.record(job_id)["round"] >= back + 2, 60, "two rounds with c001")
            client.cancel(job_id)
            record = client.follow(job_id, lambda line: None, timeout=120)
    assert record["state"] == "cancelled", record["events"][-5:]
    report = report_of(record)
    left = [r["round"] for r in report["rounds"] if "c001" in r["left"]]
    back = [r["round"] for r in report["rounds"] if "c001" in r["joined"]]
    assert left and back and back[0] > left[0] + 1, report["rounds"]
    rounds = next(a for a in report["agents"] if a["id"] == "c001")["rounds"]
    absent = list(range(left[0], back[0]))
    assert all(str(r) not in rounds for r in absent)  # not sampled while gone (no straggling wait)
    assert any(rec["delivered"] for r, rec in rounds.items() if int(r) >= back[0])
    assert not [s for s in report["straggling_events"] if s["agent"] == "c001" and s["round"] in absent]


def test_job_cli_submit_list_status_cancel_and_bad_files(mosquitto, tmp_path):
    from typer.testing import CliRunner

    from senseshield.cli import app

    job = with_shape(Job(strategy="plaintext", model="linear", clients=2, rounds=500, min_devices=2))
    path = tmp_path / "job.yaml"
    import yaml

    path.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    options = FleetOptions(agents=2, out=tmp_path / "run", broker=mosquitto.url, fleet="cli", serve=True,
                           min_contributors=1)
    runner = CliRunner()
    common = ["--broker", mosquitto.url, "--fleet", "cli"]
    with Fleet(job, options) as fleet:
        fleet.start()
        common += fleet.operator_args
        result = runner.invoke(app, ["job", "submit", str(path), *common])
        assert result.exit_code == 0, result.output
        job_id = result.stdout.strip().splitlines()[-1]
        queued = runner.invoke(app, ["job", "submit", str(path), *common])
        second = queued.stdout.strip().splitlines()[-1]
        with fleet.job_client() as client:
            wait_for(lambda: client.record(job_id)["round"] >= 1, 120, "round 1")
        listing = runner.invoke(app, ["job", "list", *common])
        assert job_id in listing.stdout and "running" in listing.stdout and "queued" in listing.stdout
        assert runner.invoke(app, ["job", "cancel", second, *common]).exit_code == 0
        assert runner.invoke(app, ["job", "cancel", job_id, *common]).exit_code == 0
        with fleet.job_client() as client:
            wait_for(lambda: client.record(job_id)["state"] == "cancelled", 60, "cancelled")
            assert client.record(second)["state"] == "cancelled"
        status = runner.invoke(app, ["job", "status", job_id, *common])
        assert "state cancelled" in status.stdout
        logs = runner.invoke(app, ["job", "logs", job_id, *common])
        assert "round 1/500" in logs.stdout
        # mistakes: one sentence, exit 2, nothing queued
        bad = tmp_path / "bad.yaml"
        for text, needle in (("roundz: 3\n", "unknown key 'roundz'"), ("rounds: 0\n", "rounds=0"),
                             ("model: nowhere.models:net\ninput_shape: [4]\nnum_classes: 3\n", "nowhere")):
            bad.write_text(text)
            result = runner.invoke(app, ["job", "submit", str(bad), *common])
            assert result.exit_code == 2 and needle in result.output, (text, result.output)
            assert "Traceback" not in result.output
        missing = runner.invoke(app, ["job", "status", "j-nope", *common])
        assert missing.exit_code == 2 and "No job 'j-nope'" in missing.output
        with fleet.job_client() as client:
            assert len(client.board()) == 2


def test_job_submit_with_an_operator_the_trust_file_does_not_pin_says_so_at_once(mosquitto, tmp_path, monkeypatch):
    """Issue 23: an operator key the trust file does not pin waited 60 s, then blamed the
    coordinator ("No answer from the coordinator ..."). The coordinator must not act on, or
    answer, an unpinned signer; the client knows from its own trust file and says so at once
    (one sentence, exit 2), before it sends anything."""
    from typer.testing import CliRunner

    from senseshield.cli import app
    from senseshield.development import DEVELOPMENT_ENV
    from senseshield.runtime.identity import Identity, Trust

    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(with_shape(Job(strategy="plaintext", model="linear", clients=2, rounds=1))
                                  .model_dump(mode="json")))
    pinned = Identity.load_or_create("operator", tmp_path / "pinned.key")
    stranger = tmp_path / "stranger.key"
    Identity.load_or_create("operator", stranger)
    coordinator = Identity.generate("coordinator")
    cases = {
        "pins another key for 'operator'": {"operator": (pinned, "operator"), "coordinator": (coordinator, "coordinator")},
        "does not list 'operator'": {"coordinator": (coordinator, "coordinator")},
    }
    monkeypatch.setenv(DEVELOPMENT_ENV, "1")  # hand-made (unsigned) trust files, as in development
    for needle, identities in cases.items():
        trust = Trust.for_identities(identities, fleet="pins").save(tmp_path / "trust.json")
        result = CliRunner().invoke(app, ["job", "submit", str(job), "--broker", mosquitto.url, "--fleet", "pins",
                                          "--identity", str(stranger), "--trust", str(trust)])
        text = " ".join(result.output.split())
        assert result.exit_code == 2, text
        assert f"The trust file of fleet 'pins' {needle}, so the coordinator ignores jobs signed" in text, text
        assert "No answer" not in text and "No online status" not in text and "Traceback" not in text


def test_the_job_lists_metric_column_names_the_jobs_metric():
    """`job list`/`job status` show the job's own metric (a regression job's mse, not an empty
    accuracy column); a book written before the column has only ``accuracy``."""
    from coordinator.jobs import JobBook
    from senseshield.cli.job import _metric

    book = JobBook(None)
    record = book.add(Job(strategy="plaintext", model="linear", rounds=2))
    assert _metric(book.board()[0]) == ""
    book.set(record, metric_name="mse", metric=0.03125)
    assert _metric(book.board()[0]) == "mse 0.03125"
    assert _metric({"accuracy": 0.91234}) == "accuracy 0.912"


FAILING = '''
def train(model, loader, config):
    raise ValueError("the sensor file has NaN labels")


def evaluate(model, loader, config):
    from senseshield.training import builtin_evaluate

    if config.round == 2:
        raise RuntimeError("the evaluation board is unplugged")
    return builtin_evaluate(model, loader, config)
'''


def test_failures_travel_to_the_operator(mosquitto, tmp_path):
    """A job whose training raises on every device ends ``failed`` with the devices' sentence:
    ``job submit --follow`` exits 1 and prints it, ``job status`` and ``job logs`` show it, the
    report names each device's failure. A job whose evaluation raises in round 2 goes on: the
    round's failures are events and in the report, apart from devices that were late."""
    import yaml
    from typer.testing import CliRunner

    from senseshield.cli import app

    (tmp_path / "failing.py").write_text(FAILING)
    base = with_shape(Job(strategy="plaintext", model="linear", clients=2, rounds=3, min_devices=2))
    jobs = {}
    for name, keys in (("trains", {"train": f"{tmp_path / 'failing.py'}:train"}),
                       ("evaluates", {"evaluate": f"{tmp_path / 'failing.py'}:evaluate"})):
        jobs[name] = tmp_path / f"{name}.yaml"
        jobs[name].write_text(yaml.safe_dump({**base.model_dump(mode="json"), "name": name, **keys}))
    options = FleetOptions(agents=2, out=tmp_path / "run", broker=mosquitto.url, fleet="failing", serve=True,
                           min_contributors=1, round_deadline=600)
    runner = CliRunner()
    common = ["--broker", mosquitto.url, "--fleet", "failing"]
    sentence = "the sensor file has NaN labels"
    with Fleet(base, options) as fleet:
        fleet.start()
        common += fleet.operator_args
        followed = runner.invoke(app, ["job", "submit", str(jobs["trains"]), "--follow", *common])
        assert followed.exit_code == 1, followed.output
        assert "round 1: c000 failed its round: Training function" in followed.output and sentence in followed.output
        assert "failed: round 1: no device delivered an update; 2 failed (c000, c001: Training function" in followed.output
        job_id = followed.stdout.strip().splitlines()[0]
        status = runner.invoke(app, ["job", "status", job_id, *common])
        assert "state failed (round 1: no device delivered an update" in status.stdout and sentence in status.stdout
        logs = runner.invoke(app, ["job", "logs", job_id, *common]).stdout
        assert "round 1/3: 0 in, 0 late, 2 failed (c000, c001: Training function" in logs
        second = runner.invoke(app, ["job", "submit", str(jobs["evaluates"]), "--follow", *common])
        assert second.exit_code == 0, second.output
        with fleet.job_client() as client:
            records = [client.record(j["id"]) for j in client.board()]
        alive = {name: proc.poll() for name, proc in fleet.processes.items()}
    failed, done = records
    assert (failed["state"], done["state"]) == ("failed", "done") and all(c is None for c in alive.values()), alive
    report = report_of(failed)
    assert report["state"] == "failed" and sentence in report["reason"]
    assert [(f["round"], f["agent"], f["phase"]) for f in report["failures"]] == [(1, "c000", "round"), (1, "c001", "round")]
    assert report["agents"][0]["rounds"]["1"]["failed"]["round"].endswith(f"raised ValueError ({sentence}).")
    assert report["final_accuracy"] is None and len(report["rounds"]) == 1
    report = report_of(done)
    assert report["state"] == "done" and [r["participants"] for r in report["rounds"]] == [2, 2, 2]
    unplugged = "raised RuntimeError (the evaluation board is unplugged)."
    assert [(f["round"], f["phase"], f["reason"].endswith(unplugged)) for f in report["failures"]] == [
        (2, "evaluation", True)] * 2
    assert sum("failed evaluating the model of the round: Evaluation function" in line and unplugged in line
               for line in done["events"]) == 2
    assert report["final_accuracy"] > 0.3
