"""Secure by default (issue 23, item 2): services need a signed trust file, a newer one
revokes the older, an agent with a floor declines plaintext jobs, secrets are written only
in a directory nobody else can write, never through a planted link."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from senseshield.development import DEVELOPMENT_ENV
from senseshield.errors import ConfigError
from senseshield.job import Job, with_shape
from senseshield.runtime.fleet import Fleet, FleetOptions
from senseshield.runtime.identity import Identity, Trust, TrustHistory, admit_trust
from senseshield.runtime.keyfiles import write_secret
from senseshield.strategies import build_strategy

ROOT = Path(__file__).resolve().parents[1]


def _production_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != DEVELOPMENT_ENV}


def _signed_trust(tmp_path: Path, admin: Identity, serial: int, *names: str) -> Path:
    members = {n: Identity.load_or_create(n, tmp_path / "ids" / f"{n}.key") for n in names}
    trust = Trust({n: i.principal("coordinator" if n == "coordinator" else "agent") for n, i in members.items()},
                  fleet="sec").sign(admin, serial)
    return trust.save(tmp_path / f"trust-{serial}.json")


def test_services_without_a_trust_file_refuse_to_start(tmp_path):
    """Each service, started as an operator would by hand, stops with one sentence (exit 2)
    naming --trust, where a trust file comes from, and the development flag."""
    nowhere = "mqtt://127.0.0.1:1"
    commands = {
        "keyserver": ["keyserver.cli", "serve", "--key-dir", str(tmp_path / "keys")],
        "coordinator": ["coordinator.cli", "serve", "--state-dir", str(tmp_path / "state")],
        "agent": ["edge_agent.cli", "join", "--agent-id", "pi-1", "--profile", "rpi4", "--model-dir", str(tmp_path / "a")],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", *argv, "--broker", nowhere], cwd=ROOT, env=_production_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, argv in commands.items()}
    for name, proc in procs.items():
        output = proc.communicate(timeout=240)[0]
        assert proc.returncode == 2, (name, output)
        assert "--trust is missing" in output and "senseshield identity build" in output, (name, output)
        assert "--insecure-dev" in output and "Traceback" not in output, (name, output)


def test_a_trust_file_is_signed_and_a_newer_serial_revokes_the_older(tmp_path):
    admin = Identity.generate("operator")
    old = _signed_trust(tmp_path, admin, 1, "coordinator", "pi-1")
    new = _signed_trust(tmp_path, admin, 2, "coordinator", "pi-1", "pi-2")
    history = tmp_path / "seen" / "trust-seen.json"
    assert admit_trust(old, fleet="sec", history=history).serial == 1
    assert admit_trust(new, fleet="sec", history=history).serial == 2
    with pytest.raises(ConfigError, match="has serial 1, older than serial 2 this service has seen"):
        admit_trust(old, fleet="sec", history=history)
    # changed after signing: refused by every process, seen or not
    data = json.loads(new.read_text())
    data["principals"]["pi-3"] = data["principals"].pop("pi-2")
    (tmp_path / "tampered.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="does not verify"):
        Trust.load(tmp_path / "tampered.json", fleet="sec")
    # another administrator's file, even with a higher serial, is not the pinned one
    other = _signed_trust(tmp_path / "o", Identity.generate("operator"), 3, "coordinator")
    with pytest.raises(ConfigError, match="not the administrator key"):
        TrustHistory(history).admit(Trust.load(other, fleet="sec"), "other")
    # an unsigned (hand-made) file only in development mode
    Trust({}, fleet="sec").save(tmp_path / "plain.json")
    with pytest.raises(ConfigError, match="has no serial and administrator signature"):
        admit_trust(tmp_path / "plain.json", fleet="sec", history=history)


def test_a_coordinator_refuses_a_revoked_trust_file_after_seeing_a_newer_one(mosquitto, tmp_path):
    """Real processes: a coordinator started with serial 2 comes online; started again with
    serial 1 it stops with one sentence."""
    admin = Identity.generate("operator")
    newer = _signed_trust(tmp_path, admin, 2, "coordinator")
    older = _signed_trust(tmp_path, admin, 1, "coordinator")
    argv = [sys.executable, "-m", "coordinator.cli", "serve", "--broker", mosquitto.url, "--fleet", "sec",
            "--state-dir", str(tmp_path / "state"), "--identity", str(tmp_path / "ids" / "coordinator.key")]
    proc = subprocess.Popen([*argv, "--trust", str(newer)], cwd=ROOT, env=_production_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = tmp_path / "ids" / "trust-seen.json"
    lines = []
    for line in proc.stdout:  # its own log, until it connects: its SIGTERM handler is in place by then
        lines.append(line)
        if "connecting to" in line:
            break
    proc.send_signal(signal.SIGTERM)
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and json.loads(seen.read_text())["sec"]["serial"] == 2, output
    again = subprocess.run([*argv, "--trust", str(older)], cwd=ROOT, env=_production_env(), capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "has serial 1, older than serial 2" in again.stdout + again.stderr
    assert "Traceback" not in again.stdout + again.stderr


@pytest.mark.slow  # ~11 s; the floor itself is checked without a broker (tests/test_agent_round.py)
def test_an_agent_with_a_floor_declines_a_plaintext_job(mosquitto, tmp_path):
    """c001 joins with --min-he-ratio 0.2 (as Ansible's profiles set it) and nothing else: it
    declines the plaintext job in one sentence, seen by `job submit --follow` and in the
    report's declined; c000 runs it."""
    job = with_shape(Job(strategy="plaintext", model="linear", clients=1, rounds=1, min_devices=1, name="plain"))
    options = FleetOptions(agents=2, out=tmp_path / "run", broker=mosquitto.url, fleet="floor", serve=True,
                           min_contributors=1, extra_agent_args={"c001": ["--min-he-ratio", "0.2"]})
    with Fleet(job, options) as fleet:
        fleet.start()
        with fleet.job_client() as client:
            record = client.follow(client.submit(job), lambda line: None, timeout=240)
    assert record["state"] == "done", record["events"][-3:]
    report = json.loads((Path(record["out"]) / "report.json").read_text())
    sentence = "encrypts nothing and this device encrypts at least 0.2 of its parameters (--min-he-ratio"
    assert sentence in report["declined"]["c001"]
    assert any("c001 refused the job" in line and sentence in line for line in record["events"])
    assert [c["id"] for c in report["clients"]] == ["c000"]


def test_the_coordinator_floor_of_each_strategy():
    """What the coordinator requires of an update (Strategy.encryption_floor): everything
    for the whole-model strategies, nothing for plaintext, at least a block otherwise."""
    floor = {n: build_strategy(n).encryption_floor(1 / 3, size=1000, block_size=10)
             for n in ("masked", "paillier-full", "plaintext", "sensecrypt")}
    assert floor == {"masked": 1.0, "paillier-full": 1.0, "plaintext": 0.0, "sensecrypt": 0.01}
    assert build_strategy("sensecrypt").encryption_floor(0.0, size=1000, block_size=10) == 0.0


def test_a_secret_is_never_written_through_a_planted_link_or_in_a_shared_directory(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    bait = tmp_path / "stolen"
    bait.write_bytes(b"")
    for name in (".key.tmp", ".identity.key.tmp", "identity.key.tmp"):  # what an attacker guesses
        (keys / name).symlink_to(bait)
    write_secret(keys / "identity.key", b"s" * 32)
    assert bait.read_bytes() == b"" and (keys / "identity.key").read_bytes() == b"s" * 32
    assert oct((keys / "identity.key").stat().st_mode & 0o777) == "0o600"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the "once world-writable key directory": anyone could swap files in it
    with pytest.raises(ConfigError, match="mode 777, which others can write"):
        write_secret(shared / "identity.key", b"s" * 32)
    assert not (shared / "identity.key").exists()
