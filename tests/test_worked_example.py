"""The worked example of docs/your-model-and-data.md, end to end.

A 1-D CNN (``examples/har/har.py:har_cnn``) on synthetic accelerometer windows, one ``.npz``
per device written by ``examples/har/make_data.py`` (run as a process), SenseCrypt with
packed Paillier 2048 as in ``examples/har/job.yaml`` (shrunk to 3 devices, 3 rounds, 120
windows per device so each test takes well under a minute):

* through ``senseshield fleet up --job --data`` (embedded broker, every role an OS process);
* through separate processes on a real Mosquitto: ``keyserver serve``, ``coordinator serve``
  (no job), ``edge-agent join --data FILE`` per device, then ``senseshield job submit
  --follow``;
* with devices whose data does not fit the job (wrong shape, labels outside the classes,
  NaN): they decline it with one sentence naming their file, and the job goes on (slow: seven
  processes); through ``fleet up``, which waits for every device it starts, a device that
  declines stops the run at once with that sentence.

Both fleet paths must give exactly the simulator's accuracies for the same files
(``run_simulation(job, devices=...)``): agent ``i`` runs with ``--index i``, the seed index
of the simulator's client ``i`` (without ``--index`` an agent seeds from a hash of its id,
which is right for a real fleet but is no simulator client), and with the simulator's
bandwidth and CPU figures as its declared profile (a measured profile gives other budgets,
hence other masks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from senseshield.data.local import load_local_data
from senseshield.inference import load_session
from senseshield.job import Job, job_shape, load_job
from senseshield.simulation import run_simulation

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "har"
BIN = Path(sys.executable).parent
DEVICES, ROUNDS, WINDOWS = 3, 3, 120


def shrunk_job(tmp: Path, **changes: object) -> tuple[Path, Job]:
    """A copy of examples/har/job.yaml with fewer rounds and devices (and ``changes``)."""
    data = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    data.update({"rounds": ROUNDS, "min_devices": DEVICES, **changes})
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, load_job(path)


@pytest.fixture(scope="module")
def har(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The example's data (make_data.py as a process), its job, and the simulator's run of them."""
    tmp = tmp_path_factory.mktemp("har")
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--devices", str(DEVICES), "--out", str(tmp / "data"),
                    "--windows", str(WINDOWS), "--seed", "0"], check=True, capture_output=True, timeout=60)
    files = sorted((tmp / "data").glob("device-*.npz"))
    assert [f.name for f in files] == [f"device-{i}.npz" for i in range(DEVICES)]
    _, job = shrunk_job(tmp)
    job = job.model_copy(update={"clients": DEVICES})
    shape, classes = job_shape(job)
    devices = [load_local_data(f, input_shape=shape, num_classes=classes, test_fraction=job.test_fraction, seed=job.seed)
               for f in files]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the job names its model by a path from the repository root
        sim = run_simulation(job, devices=devices)
    pooled = np.concatenate([d.y_test for d in devices])
    return {"files": files, "job": job, "sim": sim, "devices": devices,
            "majority": float(np.bincount(pooled).max() / pooled.size)}


def check_learned(report: dict, har: dict) -> None:
    """Every round ran, the accuracy is the simulator's to 1e-9 and clearly above chance."""
    sim = har["sim"]
    assert [r["round"] for r in report["rounds"]] == list(range(1, ROUNDS + 1))
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
    # chance is 1/6; always answering the pooled majority class scores har["majority"] (0.37 here)
    assert report["final_accuracy"] > max(0.6, har["majority"] + 0.2), report["final_accuracy"]
    assert report["strategy"] == "sensecrypt" and report["scheme"] == "packed-paillier"
    assert report["config"]["model"] == "examples/har/har.py:har_cnn"
    assert sorted(c["id"] for c in report["clients"]) == [f"c{i:03d}" for i in range(DEVICES)]


@pytest.mark.slow  # the same worked example runs through separate processes below (make test-slow for both)
def test_worked_example_through_fleet_up(har: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`senseshield fleet up --job job.yaml --data 'DIR/device-*.npz'` (embedded broker)."""
    from typer.testing import CliRunner

    from senseshield.cli import app

    monkeypatch.chdir(ROOT)
    job_path, _ = shrunk_job(tmp_path)
    out = tmp_path / "run"
    pattern = str(har["files"][0].parent / "device-*.npz")
    result = CliRunner().invoke(app, ["fleet", "up", "--job", str(job_path), "--data", pattern, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "final accuracy" in result.output
    report = json.loads((out / "report.json").read_text())
    check_learned(report, har)
    assert report["exit_codes"] == {name: 0 for name in ["keyserver", "coordinator", "c000", "c001", "c002"]}
    assert report["declined"] == {}
    # every agent exported its model; the ONNX file predicts its own device's test windows
    for i, device in enumerate(har["devices"]):
        model = out / "agents" / f"c{i:03d}" / "model.onnx"
        sidecar = json.loads(model.with_name("model.onnx.json").read_text())
        assert sidecar["input_shape"] == [3, 64] and sidecar["model_args"] == {"channels": 16}, sidecar
        classes, _ = load_session(model).predict(device.x_test)
        own_majority = np.bincount(device.y_test).max() / device.y_test.size
        assert np.mean(classes == device.y_test) > own_majority, (model, np.mean(classes == device.y_test))


class Processes:
    """OS processes of one fleet on the test's Mosquitto, each logging to DIR/logs/<name>.log."""

    def __init__(self, broker: str, fleet: str, out: Path) -> None:
        self.common = ["--broker", broker, "--fleet", fleet]
        self.out = out
        (out / "logs").mkdir(parents=True)
        self.procs: dict[str, subprocess.Popen] = {}
        # COLUMNS: rich must not wrap the lines `job submit --follow` prints
        # PYTHONFAULTHANDLER: a process that does not stop dumps its threads into its log (SIGABRT)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="400", PYTHONFAULTHANDLER="1")

    def start(self, name: str, command: str, *args: str) -> None:
        log = (self.out / "logs" / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen([str(BIN / command), *args, *self.common], stdout=log,
                                            stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)

    def services(self) -> None:
        # the quick start of docs/operating-a-fleet.md: development mode, no trust file
        self.start("keyserver", "keyserver", "serve", "--key-dir", str(self.out / "keys"), "--insecure-dev")
        self.start("coordinator", "coordinator", "serve", "--state-dir", str(self.out / "state"),
                   "--out", str(self.out / "out"), "--insecure-dev")

    def wait_for(self, name: str, text: str, timeout: float = 180) -> None:
        """Until ``name``'s log shows ``text`` (the start order of docs/operating-a-fleet.md:
        a job is submitted to a coordinator that is up)."""
        end = time.monotonic() + timeout
        while text not in self.log(name):
            assert self.procs[name].poll() is None, self.log(name)[-2000:]
            assert time.monotonic() < end, f"{name} did not log {text!r} within {timeout:g} s"
            time.sleep(0.2)

    def agent(self, agent_id: str, data: Path, index: int | None = None, profile: dict | None = None) -> None:
        args = ["join", "--agent-id", agent_id, "--data", str(data), "--threads", "1",
                "--model-dir", str(self.out / "agents" / agent_id), "--insecure-dev"]
        if index is not None:
            args += ["--index", str(index)]
        if profile is not None:
            path = self.out / f"{agent_id}.yaml"
            path.write_text(yaml.safe_dump(profile))
            args += ["--profile", str(path)]
        self.start(agent_id, "edge-agent", *args)

    def submit(self, job_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "senseshield"), "job", "submit", str(job_path), "--follow", *self.common],
                              capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=timeout)

    def alive(self) -> dict[str, int | None]:
        return {name: p.poll() for name, p in self.procs.items()}

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process still running (agents first); their exit codes (each waited
        for up to 120 s: a bound only a hang exceeds, then SIGABRT dumps its threads)."""
        for name in sorted(self.procs, key=lambda n: n in ("coordinator", "keyserver")):
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                codes[name] = proc.wait()
        return codes

    def log(self, name: str) -> str:
        return (self.out / "logs" / f"{name}.log").read_text(errors="replace")


def job_report(submitted: subprocess.CompletedProcess, out: Path) -> tuple[str, dict]:
    job_id = next(line for line in submitted.stdout.splitlines() if line.startswith("j-"))
    return job_id, json.loads((out / "out" / "jobs" / job_id / "report.json").read_text())


def test_worked_example_through_separate_processes(har: dict, mosquitto, tmp_path: Path) -> None:  # noqa: ANN001
    """keyserver serve, coordinator serve (no job), three `edge-agent join --data FILE`,
    then `senseshield job submit job.yaml --follow`; every process exits 0 on SIGTERM."""
    job_path, _ = shrunk_job(tmp_path)
    fleet = Processes(mosquitto.url, "har", tmp_path / "fleet")
    clients = {c.id: c for c in har["sim"].clients}
    try:
        fleet.services()
        for i, data in enumerate(har["files"]):
            sim_client = clients[f"c{i:03d}"]
            fleet.agent(f"c{i:03d}", data, index=i,
                        profile={"bandwidth": sim_client.bandwidth, "cpu_speed": sim_client.cpu_speed})
        fleet.wait_for("coordinator", "waiting for `senseshield job submit`")
        submitted = fleet.submit(job_path)
        alive = fleet.alive()
    finally:
        codes = fleet.stop()
    assert submitted.returncode == 0, (submitted.stdout, submitted.stderr, fleet.log("coordinator")[-2000:])
    assert all(code is None for code in alive.values()), alive  # the services and agents stay up after the job
    assert codes == {name: 0 for name in fleet.procs}, codes
    lines = submitted.stdout.splitlines()
    for r in range(1, ROUNDS + 1):
        assert any(f" round {r}/{ROUNDS}: 3 in, 0 late, 0 out; " in line for line in lines), lines
    job_id, report = job_report(submitted, tmp_path / "fleet")
    check_learned(report, har)
    assert f"report: {tmp_path / 'fleet' / 'out' / 'jobs' / job_id}/report.json" in submitted.stdout + submitted.stderr
    for i in range(DEVICES):
        assert (tmp_path / "fleet" / "agents" / f"c{i:03d}" / "model.onnx").is_file()
        assert "waiting for the next job" in fleet.log(f"c{i:03d}")


BAD_DATA = {  # name -> (how the file is spoiled, what its refusal must say)
    "wrong-shape": (lambda d: d.update(x=d["x"][:, :, :32]), "shape"),
    "labels-out": (lambda d: d.update(y=np.where(np.arange(d["y"].size) == 7, 6, d["y"])), "outside"),
    "nan": (lambda d: d["x"].__setitem__((3, 1, 5), np.nan), "non-finite"),
}


@pytest.mark.slow  # 7 OS processes: ~70 s on a loaded 2-core machine, mostly imports and exits
def test_devices_whose_data_does_not_fit_decline_and_the_job_goes_on(har: dict, mosquitto, tmp_path: Path) -> None:  # noqa: ANN001
    """Two good devices and three whose file does not fit the job (no --index: real devices
    seed from their id): each bad one declines with one sentence naming its file, stays up
    for the next job, and the job runs on the two others."""
    job_path, _ = shrunk_job(tmp_path, min_devices=2, rounds=2)
    fleet = Processes(mosquitto.url, "mixed", tmp_path / "fleet")
    bad_files = {}
    for name, (spoil, _) in BAD_DATA.items():
        arrays = {k: v.copy() for k, v in np.load(har["files"][0]).items()}
        spoil(arrays)
        bad_files[name] = tmp_path / f"{name}.npz"
        np.savez(bad_files[name], **arrays)
    try:
        fleet.services()
        for i in range(2):
            fleet.agent(f"watch-{i}", har["files"][i])
        for name, path in bad_files.items():
            fleet.agent(name, path)
        fleet.wait_for("coordinator", "waiting for `senseshield job submit`")
        submitted = fleet.submit(job_path)
        alive = fleet.alive()
    finally:
        codes = fleet.stop()
    assert submitted.returncode == 0, (submitted.stdout, submitted.stderr, fleet.log("coordinator")[-2000:])
    assert all(code is None for code in alive.values()), alive
    assert codes == {name: 0 for name in fleet.procs}, codes
    _, report = job_report(submitted, tmp_path / "fleet")
    assert sorted(c["id"] for c in report["clients"]) == ["watch-0", "watch-1"]
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert report["final_accuracy"] > har["majority"], report["final_accuracy"]
    assert sorted(report["declined"]) == sorted(BAD_DATA)
    for name, (_, needle) in BAD_DATA.items():
        reason = report["declined"][name]
        assert str(bad_files[name]) in reason and needle in reason, reason
        assert "\n" not in reason and reason.endswith(".") and "Traceback" not in fleet.log(name), reason
        assert any(f"{name} refused the job" in line for line in submitted.stdout.splitlines())


def test_fleet_up_stops_with_one_sentence_when_a_device_declines(har: dict, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet up` waits for every agent it starts, so a device that declines (here: NaN in its
    file) would keep the job waiting until the join timeout (300 s); it stops at once instead,
    naming the agent and the file, with every process stopped."""
    from typer.testing import CliRunner

    from senseshield.cli import app

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "400")
    job_path, _ = shrunk_job(tmp_path, min_devices=2)
    data = tmp_path / "data"
    data.mkdir()
    arrays = {k: v.copy() for k, v in np.load(har["files"][1]).items()}
    BAD_DATA["nan"][0](arrays)
    np.savez(data / "device-1.npz", **arrays)
    (data / "device-0.npz").write_bytes(har["files"][0].read_bytes())
    started = time.monotonic()
    result = CliRunner().invoke(app, ["fleet", "up", "--job", str(job_path), "--data", str(data / "device-*.npz"),
                                      "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert time.monotonic() - started < 150  # not the 300 s join timeout
    message = " ".join(result.output.split())
    assert "Agent c001 declined the job, and fleet up waits for all 2 agents" in message, message
    assert str(data / "device-1.npz") in message and "non-finite" in message and "Traceback" not in result.output
    leftovers = [p for p in psutil.Process().children(recursive=True) if "--fleet local" in " ".join(p.cmdline())]
    assert not leftovers, leftovers
