"""The fleet runtime end to end: real Mosquitto (or the embedded broker), real OS processes.

Each test starts a key server, a coordinator and a few agents as processes through
:class:`senseshield.runtime.fleet.Fleet`; models are small so a run takes seconds.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from senseshield.determinism import first_difference, fleet_trace
from senseshield.runtime.fleet import Fleet, FleetOptions, fleet_up
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol import encode_frame
from senseshield.runtime.protocol.messages import Hello, Notice, UpdateMessage, from_frame, to_frame
from senseshield.job import Job
from senseshield.simulation import run_simulation
from senseshield.strategies import StrategyOptions
from senseshield.runtime.transport import Link


def wait_for(condition, timeout: float = 120.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def keyserver_models(out: Path, fleet: str) -> dict[int, np.ndarray]:
    """The key server's float64 cluster models (its checkpoint)."""
    with np.load(out / "keys" / f"models-{fleet}.npz") as data:
        meta = json.loads(bytes(data["meta"]).decode())
        return {int(k): data[f"c{k}"].copy() for k in meta["rounds"]}


class Capture:
    """Every payload published in the fleet's topic tree, as a raw-byte log."""

    def __init__(self, url: str, fleet: str) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from senseshield.runtime.transport import parse_broker

        self.payloads: list[tuple[str, bytes]] = []
        host, port = parse_broker(url)
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="capture")
        self.client.on_message = lambda c, u, m: self.payloads.append((m.topic, bytes(m.payload)))
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"ss/v1/{fleet}/#", qos=1)
        self.client.connect(host, port)
        self.client.loop_start()
        time.sleep(0.3)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize(
    "strategy, model, partition, extra",
    [
        # plaintext (~30 s): its sums go through the same code as sensecrypt's plaintext part
        # (covered below); with make test-slow
        pytest.param("plaintext", "mlp", "iid", {}, marks=pytest.mark.slow),
        # per-value Paillier (~45 s): the fuzz test runs it by default, this one with make test-slow
        pytest.param("paillier-full", "linear", "iid", {"key_bits": 1024}, marks=pytest.mark.slow),
        ("sensecrypt", "mlp", "categories:2", {"key_bits": 1024}),
        # every parameter masked through the key server (issue 22): exact, so bit for bit (~45 s;
        # masked-dp below runs the same pads, sums and unmasking by default; make test-slow)
        pytest.param("masked", "mlp", "categories:2", {}, marks=pytest.mark.slow),
        # distributed DP on the masked sums (issue 22 item 7): each agent's noise share is secret
        # on devices, so both replay one test-only noise seed (development mode); equal weights
        ("masked-dp", "mlp", "categories:2", {"options": StrategyOptions(sigma=0.5, clip=0.5), "noise_seed": 7}),
        # sensecrypt over `masked` (issue 22 item 2): each agent masks its own positions, the key
        # server removes each one's pads where its signed mask says and seals the positions
        # fewer than 2 masked (~45 s); nested masks: round plans carry each agent's prefix (make test-slow)
        pytest.param("sensecrypt", "mlp", "categories:2", {"scheme": "masked"}, marks=pytest.mark.slow,
                     id="sensecrypt-masked"),
        pytest.param("sensecrypt", "mlp", "categories:2", {"scheme": "masked", "options": StrategyOptions(masks="nested")},
                     marks=pytest.mark.slow, id="sensecrypt-masked-nested"),
        # the issue-16 hybrid: its plaintext noise is secret on devices, so both replay one
        # test-only noise seed (development mode) to compare bit for bit (make test-slow)
        pytest.param("sensecrypt", "mlp", "categories:2",
                     {"key_bits": 1024, "options": StrategyOptions(score="leakage", plain_noise=0.3), "noise_seed": 99},
                     marks=pytest.mark.slow, id="sensecrypt-hybrid"),
    ],
)
def test_fleet_ends_with_the_simulators_model(mosquitto, tmp_path, strategy, model, partition, extra):
    extra = dict(extra)
    noise_seed = extra.pop("noise_seed", None)
    config = Job(strategy=strategy, model=model, partition=partition, clients=4, rounds=2,
                              bandwidth=[50, 30], cpu=[24, 8], **extra)
    capture = Capture(mosquitto.url, "same")
    report = fleet_up(config, FleetOptions(agents=4, out=tmp_path, broker=mosquitto.url, fleet="same",
                                           round_deadline=120, min_contributors=1, noise_seed=noise_seed), timeout=400)
    capture.stop()
    sim = run_simulation(config, trace=True, noise_seed=noise_seed)
    # same budgets, masks and per-round models, bit for bit (the first difference is named)
    difference = first_difference(sim.trace, fleet_trace(tmp_path), ("simulator", "fleet"))
    assert difference is None, difference
    fleet_models = keyserver_models(tmp_path, "same")
    assert sorted(fleet_models) == sorted(sim.models)
    for k, weights in sim.models.items():
        assert np.array_equal(fleet_models[k], weights), f"cluster {k}: the key server's float64 model differs"
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
    # every per-round figure that is not a measurement of this machine belongs to its round
    # (training metrics included: they travel with the update they describe)
    assert round_differences(sim.rounds, report["rounds"]) == []
    assert [c["cluster"] for c in report["clients"]] == [c.cluster for c in sim.clients]
    # the same privacy figures (None without DP)
    assert (report.get("epsilon"), report.get("epsilon_server")) == (sim.epsilon, sim.epsilon_server)
    assert report["exit_codes"] == {name: 0 for name in report["exit_codes"]}
    # the run's key is named in the report and in every agent's log (issue 25's small traps)
    if strategy != "plaintext":
        key_id = report["key_id"]
        assert key_id and all(f"key {key_id})" in (tmp_path / "logs" / f"c{i:03d}.log").read_text() for i in range(4))
    # per-agent, per-round phase timings and the server's
    phases = report["agents"][0]["rounds"]["1"]["phases"]
    assert {"train", "sensitivity", "mask", "encrypt", "upload", "wait"} <= set(phases)
    assert {"aggregate", "decrypt", "verify"} <= set(report["server"][0]["clusters"]["0"]["timings"])
    # no secret material in any message (the broker saw every payload of the run)
    secrets = sorted((tmp_path / "keys").glob("*.key"))
    assert bool(secrets) == (strategy != "plaintext")
    assert len(capture.payloads) > 10
    identities = sorted((tmp_path / "identities").glob("*.key"))
    assert len(identities) == 4 + 3  # the agents, key server, coordinator and operator
    assert_no_secrets(secrets + identities, b"".join(p for _, p in capture.payloads))


MEASURED = {"seconds", "phase_seconds", "bytes_up", "bytes_down", "notes", "joined", "left", "work"}
"""RoundRecord fields a fleet measures (time, bytes on its wire, events of its devices) or only
a fleet has: every other field of a fleet's round must be the simulator's."""


def round_differences(sim_rounds, fleet_rounds: list[dict]) -> list[str]:  # noqa: ANN001
    """Each (round, field) where a fleet report's round differs from the simulator's (floats to 1e-9)."""
    from senseshield.results import RoundRecord

    assert len(sim_rounds) == len(fleet_rounds)
    out = []
    for sim, fleet in zip(sim_rounds, fleet_rounds):
        fleet = RoundRecord.model_validate(fleet).model_dump()
        for name, want in sim.model_dump().items():
            if name in MEASURED:
                continue
            got = fleet[name]
            if isinstance(want, dict) and isinstance(got, dict) and set(want) == set(got):
                same = all(got[k] == pytest.approx(want[k], abs=1e-9) for k in want)
            elif isinstance(want, float) and isinstance(got, float):
                same = got == pytest.approx(want, abs=1e-9)
            else:
                same = got == want
            if not same:
                out.append(f"round {sim.round} {name}: simulator {want!r}, fleet {got!r}")
    return out


def assert_no_secrets(files: list[Path], blob: bytes) -> None:
    """For Paillier key files (JSON) the primes p and q, in hex, decimal or binary, appear
    nowhere in ``blob``; for other key files no 64-byte window of the file does."""
    for path in files:
        secret = path.read_bytes()
        try:
            fields = json.loads(secret)
        except ValueError:
            for i in range(0, max(len(secret) - 64, 1), 32):
                assert secret[i:i + 64] not in blob, f"{path.name} bytes {i}..{i + 64} were sent"
            continue
        assert {"p", "q"} <= set(fields), sorted(fields)
        for name in ("p", "q"):
            prime = int(fields[name], 16)
            width = (prime.bit_length() + 7) // 8
            for form in (fields[name].encode(), str(prime).encode(),
                         prime.to_bytes(width, "big"), prime.to_bytes(width, "little")):
                assert form not in blob, f"secret prime {name} was sent"

def test_faults_are_rejected_and_a_killed_agent_does_not_delay_its_round(mosquitto, tmp_path):
    """Malformed, oversized, wrong-version, wrong-round and wrong-fleet messages are rejected
    with a logged reason; an agent killed mid-round (its last will says offline) makes the
    round close without it at once, not at the deadline; an agent holding another public key
    id is refused."""
    config = Job(strategy="plaintext", model="linear", clients=3, rounds=3)
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="faults", round_deadline=30,
                           min_contributors=1, extra_agent_args={"c002": ["--kill-at-round", "2"]},
                           extra_coordinator_args=["--max-message-mb", "0.5"])
    notices: list[Notice] = []
    intruder = Link(mosquitto.url, client_id="intruder", fleet="faults",
                    on_frame=lambda t, f: notices.append(from_frame(f)))
    intruder.subscribe("agents/intruder/inbox")
    intruder.start()
    with Fleet(config, options) as fleet:
        fleet.start()
        wait_for(lambda: len(fleet.seen["agents"]) >= 3)
        run_id = _run_id(mosquitto.url, "faults")
        c000 = Identity.load_or_create("c000", fleet.identity_file("c000"))  # a compromised agent's key
        bad = {
            "malformed": b"\x00garbage\xff" * 10,
            "wrong-version": encode_frame(schema="metrics", version=9, fleet="faults", sender="c000", round=1, fields={},
                                          signer=c000),
            "wrong-fleet": encode_frame(schema="status", version=1, fleet="elsewhere", sender="c000", round=0,
                                        fields={"online": True}, signer=c000),
            "wrong-round": to_frame(_update(), fleet="faults", sender="c000", round=99, signer=c000),
            "oversized": to_frame(_update(size=200_000), fleet="faults", sender="c000", round=1, signer=c000),
            "unsigned": to_frame(_update(), fleet="faults", sender="c000", round=1),
        }
        for name, payload in bad.items():
            intruder.publish("agents/c000/update", payload) if name not in ("malformed", "wrong-fleet") else \
                intruder._client.publish("ss/v1/faults/agents/c000/update", payload, qos=1).wait_for_publish(5)
        hello = Hello(run_id=run_id, agent_id="intruder", n_samples=10, bandwidth=1, cpu_speed=1, key_id="not-the-fleet-key")
        intruder.publish("agents/intruder/hello", to_frame(hello, fleet="faults", sender="intruder", round=0,
                                                           signer=Identity.generate("intruder")))
        report = fleet.wait(timeout=300)
    intruder.stop()
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    for reason in ("magic", "version 9", "fleet 'elsewhere'", "round 99", "exceeds",
                   "Unsigned 'update' frame from 'c000'", "'intruder', which is not in the fleet's trust file"):
        assert reason in log, reason
    assert len(report["rounds"]) == 3
    # c002 was killed when round 2's plan arrived: round 2 closed without it as soon as its
    # last will said offline (it used to wait the full 30 s deadline)
    missed = [(s["round"], s["missing"]) for s in report["straggling_events"] if s["agent"] == "c002"]
    assert missed == [(2, "offline")]  # from round 3 on it is known gone: not sampled, not waited for
    assert report["rounds"][2]["left"] == ["c002"]
    # the report counts contributors (updates aggregated), not the agents sampled
    assert [r["participants"] for r in report["rounds"]] == [3, 2, 2]
    r2 = report["rounds"][1]
    assert r2["seconds"] < 15
    assert "round 2 cluster 0: closed without c002 (offline)" in r2["notes"]
    assert "went offline (last will); closing without it" in log
    assert report["rounds"][2]["seconds"] < 15  # known offline: not waited for again
    assert fleet.exit_codes["c002"] == -9
    assert fleet.exit_codes["c000"] == 0
    # the intruder, whose identity is not in the fleet's trust file, is not even heard
    assert "intruder" not in report["refused"] and not notices


@pytest.mark.slow  # ~18 s (make test-slow); tests/test_jobs.py's failures test covers a raising device by default
def test_an_agent_whose_training_raises_is_not_waited_for(mosquitto, tmp_path):
    """c002's training raises in round 2 (fault drill): it tells the coordinator
    (``agents/<id>/failure``), which closes round 2 without it at once instead of waiting for
    the deadline (600 s here: the run could not end within the wait's timeout otherwise);
    the agent stays in the job and contributes again in round 3. A crashed agent (SIGKILL
    mid-round) is seen by its last will: test_faults_are_rejected_and_a_killed_agent_does_not_delay_its_round.
    In the same run c001 loses its round-3 plan and says hello again, as an agent does when a
    broker restart lost the plan (CI saw the coordinator re-send its plans before the agent
    was subscribed again): the hello brings the plan again, and round 3 has all three."""
    config = Job(strategy="plaintext", model="linear", clients=3, rounds=3)
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="fails", round_deadline=600,
                           min_contributors=1, extra_agent_args={"c002": ["--fail-at-round", "2"],
                                                                 "c001": ["--lose-plan-at-round", "3"]})
    with Fleet(config, options) as fleet:
        fleet.start()
        report = fleet.wait(timeout=240)
    assert [(s["round"], s["missing"]) for s in report["straggling_events"] if s["agent"] == "c002"] == [(2, "failed")]
    assert [r["participants"] for r in report["rounds"]] == [3, 2, 3]
    assert "round 2 cluster 0: closed without c002 (failed)" in report["rounds"][1]["notes"]
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "agent c002 failed its round: RuntimeError: fault drill: training raised in round 2" in log
    # named apart from the late ones: in the round line, the report and its events
    assert "round 2/3: 2 in, 0 late, 1 failed (c002: RuntimeError: fault drill: training raised in round 2), 0 out" in log
    assert report["failures"] == [{"round": 2, "agent": "c002", "phase": "round",
                                   "reason": "RuntimeError: fault drill: training raised in round 2"}]
    assert report["state"] == "done" and report["straggling_events"][0]["reason"] == report["failures"][0]["reason"]
    assert fleet.exit_codes["c002"] == 0
    assert "fault drill: dropping the plan of round 3" in (tmp_path / "logs" / "c001.log").read_text()
    assert "round 3 cluster 0: c001 said hello again; re-sending its plan" in log


def test_a_broker_restart_mid_run_is_survived(mosquitto, tmp_path):
    config = Job(strategy="plaintext", model="linear", clients=3, rounds=4)
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="restart", round_deadline=60,
                           min_contributors=1)
    with Fleet(config, options) as fleet:
        fleet.start()
        wait_for(lambda: fleet.seen["rounds"])  # the first round is done
        mosquitto.stop()
        time.sleep(1.0)
        mosquitto.start()
        report = fleet.wait(timeout=300)
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4]
    assert report["final_accuracy"] > 0.5
    sim = run_simulation(config)
    assert report["final_accuracy"] == pytest.approx(sim.final_accuracy, abs=1e-9)
    assert "reconnected" in (tmp_path / "logs" / "coordinator.log").read_text()


@pytest.mark.slow  # ~21 s (make test-slow); the default kill point below resumes a killed coordinator
def test_a_restarted_coordinator_resumes_from_its_checkpoint(mosquitto, tmp_path):
    """A coordinator killed (fault drill) once round 2 has its verdict, before it closes the
    round, and started again with the same command line: it resumes round 2, and the report
    gives that round its own accuracy (the devices' metrics asked for again), its whole time
    since it first started, and a note of the restart (issue 23 item 4)."""
    config = Job(strategy="plaintext", model="linear", clients=3, rounds=4)
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="resume", round_deadline=60,
                           min_contributors=1, extra_coordinator_args=["--kill-before-close", "2"])
    with Fleet(config, options) as fleet:
        fleet.start()
        wait_for(lambda: fleet.processes["coordinator"].poll() is not None, timeout=240)  # the drill fired
        time.sleep(1.0)  # agents and key server see its last will, say so, and keep waiting
        fleet.restart("coordinator")  # the same command line again
        report = fleet.wait(timeout=300)
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4]
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "fault drill: killing myself (SIGKILL) before closing round 2" in log and "resuming run" in log
    for name in ("keyserver", "c000", "c001", "c002"):
        agent_log = (tmp_path / "logs" / f"{name}.log").read_text()
        offline = agent_log.index("coordinator offline since ")
        assert "; waiting for it to come back" in agent_log[offline:], name
        assert agent_log.index("coordinator is back online", offline) > offline, name
    r2 = report["rounds"][1]
    assert any("the coordinator restarted during this round" in n for n in r2["notes"]), r2["notes"]
    assert not any("restarted" in n for r in report["rounds"] if r["round"] != 2 for n in r["notes"])
    assert r2["seconds"] > 1.0  # started before the kill, closed after the restart a second later
    sim = run_simulation(config)
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)


def run_with_kills(mosquitto, tmp_path: Path, config: Job, points: list[int], fleet: str) -> tuple[dict, str]:  # noqa: ANN001
    """``config`` on 3 agents, the coordinator SIGKILLed after the job's ``points``-th inbound
    messages (``--kill-at-message``, counted over restarts) and started again each time with
    the same command line; the report and the coordinator's log."""
    args = [arg for n in points for arg in ("--kill-at-message", str(n))]
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet=fleet, round_deadline=60,
                           min_contributors=1, extra_coordinator_args=args)
    kills = 0
    with Fleet(config, options) as running:
        running.start()
        while True:
            coordinator = running.processes["coordinator"]
            wait_for(lambda: coordinator.poll() is not None, timeout=300)
            if coordinator.returncode != -9 or kills > len(points):  # SIGKILL: the drill fired
                break
            kills += 1
            running.restart("coordinator")  # the same command line again
        report = running.wait(timeout=60)
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    fired = [int(line.split("(kill point ")[1].rstrip(")")) for line in log.splitlines()
             if "fault drill: killing myself (SIGKILL) after message" in line]
    assert fired == sorted(points) and kills == len(points), (fired, kills)
    return report, log


def assert_the_simulators_job(tmp_path: Path, fleet: str, config: Job, report: dict) -> None:
    """The job ended with the simulator's rounds, accuracies and final models (bit for bit)."""
    sim = run_simulation(config)
    assert [r["round"] for r in report["rounds"]] == list(range(1, config.rounds + 1))
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
    models = keyserver_models(tmp_path, fleet)
    assert sorted(models) == sorted(sim.models)
    for k, weights in sim.models.items():
        assert np.array_equal(models[k], weights), f"cluster {k}: the key server's model differs from the simulator's"


# The inbound messages of a plaintext (or masked) job of 3 agents and 3 rounds at its
# coordinator, 33 without a kill: 1-6 the agents' and the key server's statuses, its own
# fleet/config, the key; 7-9 the hellos (the bootstrap: nothing is saved before the fleet is
# planned); 10-14 round 1's updates, its model and verdict; 15-22 round 2's, with the
# metrics of round 1; 23-30 round 3's; 31-33 the metrics of the final models.
KILL_POINTS = [20]  # metrics mid-job (every one of the 33, the bootstrap included: make test-slow)
SLOW_POINTS = [n for n in range(1, 34) if n not in KILL_POINTS]


@pytest.mark.parametrize("point", [
    *KILL_POINTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_POINTS)])
def test_a_coordinator_killed_at_any_message_resumes_to_the_simulators_model(mosquitto, tmp_path, point):
    """The coordinator SIGKILLed right after its ``point``-th inbound message (every one of
    the job's 33 with make test-slow) and started again with the same command line: the job
    ends with the simulator's accuracies and models."""
    config = Job(strategy="plaintext", model="linear", clients=3, rounds=3)
    report, _ = run_with_kills(mosquitto, tmp_path, config, [point], "kills")
    assert_the_simulators_job(tmp_path, "kills", config, report)


@pytest.mark.slow  # make test-slow: two jobs, 9 kills (~3 min on 2 cores)
@pytest.mark.parametrize("model, strategy, points", [("mlp", "masked", [9, 14, 22, 29, 31]),
                                                     ("linear", "plaintext", [8, 19, 33, 47])])
def test_a_coordinator_killed_again_and_again_resumes_to_the_simulators_model(mosquitto, tmp_path, model, strategy,
                                                                            points):
    """Kill points counted over the restarts (``--kill-at-message`` repeated): the first kill
    lands in the bootstrap, the others while restarted coordinators take the job up again or
    run its rounds (a restart adds 6-9 messages: statuses, config, key, hellos again); the
    job still ends as the simulator's."""
    config = Job(strategy=strategy, model=model, clients=3, rounds=3)
    report, _ = run_with_kills(mosquitto, tmp_path, config, points, "again")
    assert_the_simulators_job(tmp_path, "again", config, report)


def test_fleet_up_on_the_embedded_broker(tmp_path):
    from typer.testing import CliRunner

    from senseshield.cli import app

    result = CliRunner().invoke(app, [
        "fleet", "up", "--agents", "3", "--strategy", "plaintext", "--model", "linear", "--rounds", "2",
        "--min-contributors", "1", "--out", str(tmp_path), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["broker"].startswith("embedded")
    assert len(report["rounds"]) == 2 and report["final_accuracy"] > 0.3
    assert "phase" in result.output and "aggregate" in result.output
    assert (tmp_path / "models" / "round-2" / "cluster-0.npy").exists()
    # fleet up ends with the HTML report and says where it is (--report, the default)
    assert f"wrote {tmp_path / 'report.html'}" in result.output.replace("\n", "")
    assert "plots/timeline.png" in (tmp_path / "report.html").read_text()
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0
    # every agent evaluated with onnxruntime and measured its inference latency
    for agent in report["agents"]:
        assert (tmp_path / "agents" / agent["id"] / "model.onnx").exists()
        assert 0 < agent["inference"]["b1_p50_ms"] <= agent["inference"]["b1_p95_ms"]
        assert "b32_p50_ms" in agent["inference"]
    # the run's cluster model exports to ONNX for on-device use
    onnx = tmp_path / "export" / "model.onnx"
    result = CliRunner().invoke(app, ["export", "--run", str(tmp_path), "--cluster", "0", "--out", str(onnx)])
    assert result.exit_code == 0, result.output
    from senseshield.inference import load_session

    session = load_session(onnx)
    classes, scores = session.predict(np.zeros((3, 1, 8, 8), np.float32))
    assert classes.shape == (3,) and scores.shape == (3, 10)


def test_fleet_up_of_a_job_whose_training_raises_everywhere_fails_as_the_simulator_does(tmp_path):
    """Every device's training raises: ``fleet up`` exits 2 with the devices' sentence (the
    simulator's exit and sentence), and the report says ``failed`` and why."""
    from typer.testing import CliRunner

    from senseshield.cli import app

    (tmp_path / "train.py").write_text("def train(model, loader, config):\n    raise ValueError('NaN labels')\n")
    (tmp_path / "job.yaml").write_text(f"model: linear\nstrategy: plaintext\nrounds: 3\ntrain: {tmp_path / 'train.py'}:train\n")
    runner = CliRunner()
    simulated = runner.invoke(app, ["simulate", "--job", str(tmp_path / "job.yaml"), "--clients", "2"])
    fleet = runner.invoke(app, ["fleet", "up", "--job", str(tmp_path / "job.yaml"), "--agents", "2",
                                "--out", str(tmp_path / "out"), "--quiet"])
    said = f"Training function '{tmp_path / 'train.py'}:train' raised ValueError (NaN labels)"
    assert simulated.exit_code == 2 and said in simulated.output, simulated.output
    assert fleet.exit_code == 2, fleet.output
    assert f"error: the job failed: round 1: no device delivered an update; 2 failed (c000, c001: {said})" in " ".join(
        fleet.output.split()), fleet.output
    assert "Traceback" not in fleet.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["state"] == "failed" and said in report["reason"] and len(report["failures"]) == 2


def test_fleet_up_bad_input_is_one_sentence(tmp_path):
    from typer.testing import CliRunner

    from senseshield.cli import app

    runner = CliRunner()
    for args, needle in (
        (["--agents", "0"], "--agents 0 is not allowed"),
        (["--strategy", "nope"], "nope"),
        (["--broker", "http://x"], "is not allowed"),
        (["--set", "tau"], "NAME=VALUE"),
        (["--set", "tau=7"], "tau"),
    ):
        result = runner.invoke(app, ["fleet", "up", *args, "--out", str(tmp_path), "--quiet"])
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output
        assert "Traceback" not in result.output


def test_fleet_up_refuses_a_zero_deadline_and_a_bad_model_before_starting_anything(tmp_path):
    """Issue 23: `--round-deadline 0` ran silently with the job's 120 s, and a job whose model
    does not build was found only after every process had started (55-72 s). Both are one
    sentence now (exit 2), and no process starts (no logs/ folder)."""
    from typer.testing import CliRunner

    from senseshield.cli import app

    bad_model = tmp_path / "bad-model.yaml"
    bad_model.write_text("strategy: plaintext\nmodel: linear\nmodel_args: {depth: 3}\nrounds: 1\n")
    small = ["--agents", "2", "--strategy", "plaintext", "--model", "linear", "--rounds", "1", "--min-contributors", "1"]
    for args, needles in (
        ([*small, "--round-deadline", "0"], ["--round-deadline 0 is not allowed", "more than 0", "120 s"]),
        ([*small, "--round-deadline", "-5"], ["--round-deadline -5 is not allowed"]),
        (["--agents", "2", "--job", str(bad_model), "--min-contributors", "1"], ["'linear'", "depth"]),
    ):
        out = tmp_path / f"run{len(args)}"
        result = CliRunner().invoke(app, ["fleet", "up", *args, "--out", str(out), "--quiet"])
        assert result.exit_code == 2, (args, result.output)
        text = " ".join(result.output.split())
        assert all(n in text for n in needles), (needles, text)
        assert "Traceback" not in result.output
        assert not (out / "logs").exists()  # nothing was started


def _run_id(url: str, fleet: str, timeout: float = 30) -> str:
    got: list[str] = []
    link = Link(url, client_id="peek", fleet=fleet, on_frame=lambda t, f: got.append(f.fields.get("run_id")))
    link.subscribe("fleet/config")
    link.start()
    end = time.monotonic() + timeout
    while not got and time.monotonic() < end:
        time.sleep(0.05)
    link.stop()
    return got[0]


def _update(size: int = 650) -> UpdateMessage:
    from senseshield.runtime.protocol.messages import pack_mask

    mask = np.zeros(size, dtype=bool)
    return UpdateMessage(cluster=0, n_samples=10, size=size, mask=pack_mask(mask), withheld=np.zeros(0, np.uint8),
                         plaintext=np.random.default_rng(0).normal(size=size).astype(np.float32), ciphertext=b"")


def test_an_agent_exits_cleanly_on_sigterm(mosquitto, tmp_path):
    import signal
    import subprocess
    import sys

    statuses: list[bool] = []
    watcher = Link(mosquitto.url, client_id="watcher", fleet="term",
                   on_frame=lambda t, f: statuses.append(from_frame(f).online))
    watcher.subscribe("agents/pi-7/status")
    watcher.start()
    profile = tmp_path / "p.yaml"
    profile.write_text("bandwidth: 10\ncpu_speed: 4\n")
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "join", "--broker", mosquitto.url,
                             "--fleet", "term", "--agent-id", "pi-7", "--profile", str(profile),
                             "--model-dir", str(tmp_path / "m"), "--insecure-dev"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while not statuses and time.monotonic() < end:
        time.sleep(0.05)
    assert statuses == [True]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stdout.read().decode()  # a bound only a hang exceeds (busy machine)
    wait_for(lambda: statuses[-1] is False)  # its goodbye, published before it exits
    watcher.stop()


@pytest.mark.slow  # make test-slow: the default suite stays under 8 min on 2 cores
def test_an_agent_encrypts_at_least_its_own_minimum_whatever_the_budget(mosquitto, tmp_path):
    """Issue 14: c001 (the slow device) joins with --min-he-ratio 0.5; SenseCrypt's planner gives it far less, so
    it raises its own budget (and says so) and encrypts at least half of every update; the
    others keep the planner's budgets and the run goes on."""
    config = Job(strategy="sensecrypt", model="mlp", clients=3, rounds=2, key_bits=1024, bandwidth=[50, 5],
                 cpu=[24, 2])
    report = fleet_up(config, FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="floor",
                                           round_deadline=120, min_contributors=1,
                                           extra_agent_args={"c001": ["--min-he-ratio", "0.5"]}), timeout=300)
    ratios = {c["id"]: c["he_ratio"] for c in report["clients"]}
    budgets = {c["id"]: c["encryption_budget"] for c in report["clients"]}
    assert budgets["c001"] < 0.5 and ratios["c001"] >= 0.5 - 0.02, (budgets, ratios)
    log = (tmp_path / "logs" / "c001.log").read_text()
    assert "is below this device's minimum 0.5000 (--min-he-ratio); encrypting at least the minimum" in log
    assert "topped up to 0.5" in log or "budget" in log
    assert len(report["rounds"]) == 2 and report["exit_codes"] == {n: 0 for n in report["exit_codes"]}
