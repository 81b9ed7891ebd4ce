"""Operator-signed jobs (issue 22 item 3): `senseshield job sign`, the coordinator's check of a
signed job file, and a coordinator whose job the key server refuses failing at once with the
key server's sentence (real Mosquitto, real processes). The key server's own checks are in
tests/test_keyserver.py (test_only_a_job_an_operator_signed_is_served)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import yaml
from typer.testing import CliRunner

from senseshield.cli.main import app
from senseshield.development import DEVELOPMENT_ENV
from senseshield.errors import ConfigError
from senseshield.job import Job, with_shape
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.jobsig import open_signed_job

ROOT = Path(__file__).resolve().parents[1]
FLEET = "signed"


def _fleet(tmp_path: Path) -> tuple[Path, dict[str, Identity]]:
    """Identities for the key server, the coordinator and the operator (who signs the trust file)."""
    ids = {n: Identity.load_or_create(n, tmp_path / "ids" / f"{n}.key") for n in ("keyserver", "coordinator", "operator")}
    trust = Trust({n: i.principal(n) for n, i in ids.items()}, fleet=FLEET).sign(ids["operator"], 1)
    return trust.save(tmp_path / "trust.json"), ids


def _job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"strategy": "plaintext", "model": "linear", "rounds": 1, "min_devices": 1}))
    return path


def test_job_sign_writes_the_operators_signed_job_and_refuses_with_one_sentence(tmp_path):
    trust, ids = _fleet(tmp_path)
    job = _job_file(tmp_path)
    run = CliRunner().invoke
    ok = run(app, ["job", "sign", str(job), "--identity", str(tmp_path / "ids" / "operator.key"), "--fleet", FLEET,
                   "--out", str(tmp_path / "job.signed"), "--trust", str(trust)])
    assert ok.exit_code == 0, ok.output
    operator, signed = open_signed_job((tmp_path / "job.signed").read_bytes(), Trust.load(trust, fleet=FLEET), fleet=FLEET)
    assert operator == "operator" and signed == with_shape(Job(strategy="plaintext", model="linear", rounds=1, min_devices=1))
    stranger = tmp_path / "ids" / "stranger.key"
    Identity.load_or_create("operator", stranger)
    for argv, said in [
        (["--identity", str(stranger), "--trust", str(trust), "--fleet", FLEET], "not its pinned key"),
        (["--identity", str(tmp_path / "ids" / "coordinator.key"), "--name", "coordinator"], "is not an operator's identity"),
        (["--identity", str(tmp_path / "ids" / "none.key")], "is not a file"),
        (["--identity", str(tmp_path / "ids" / "operator.key"), "--fleet", "other", "--trust", str(trust)], "fleet"),
    ]:
        bad = run(app, ["job", "sign", str(job), "--out", str(tmp_path / "bad.signed"), *argv])
        assert bad.exit_code == 2 and said in bad.output and "Traceback" not in bad.output, (argv, bad.output)
        assert not (tmp_path / "bad.signed").exists()


@pytest.mark.slow  # ~13 s on a loaded 2-core machine (the coordinator preloads torch, sklearn, opacus)
def test_a_coordinator_fails_a_refused_job_at_once_with_the_key_servers_sentence(mosquitto, tmp_path):
    """In process, both real services: an unsigned job (the coordinator's own --strategy
    flags) fails with the key server's refusal, not after a wait for the key or devices."""
    from coordinator.service import Coordinator
    from keyserver.service import KeyServer

    trust, ids = _fleet(tmp_path)
    pinned = Trust.load(trust, fleet=FLEET)
    keyserver = KeyServer(mosquitto.url, fleet=FLEET, key_dir=tmp_path / "keys", identity=ids["keyserver"],
                          trust=Trust.load(trust, fleet=FLEET))
    thread = threading.Thread(target=keyserver.run, daemon=True)
    thread.start()
    coordinator = Coordinator(mosquitto.url, fleet=FLEET, once=True, identity=ids["coordinator"], trust=pinned,
                              join_timeout=600)
    record = coordinator.submit(with_shape(Job(strategy="plaintext", model="linear", rounds=1, min_devices=1)))
    try:
        with pytest.raises(ConfigError) as refused:
            coordinator.serve()
    finally:
        keyserver.stopping.set()
        thread.join(10)
    assert str(refused.value).startswith(f"Job {record.id} is refused: it carries no job signed by an operator")
    assert coordinator.book.get(record.id).state != "done"


@pytest.mark.slow  # two coordinator processes and a key server (~24 s on 2 cores)
def test_a_job_the_key_server_refuses_fails_at_once_with_its_sentence(mosquitto, tmp_path):
    """A key server with a trust file (no development mode) and `coordinator serve --job
    job.yaml --once` (unsigned): the coordinator exits 1 with the key server's refusal, without
    waiting for devices; a signed job of an identity the trust file does not pin is refused by
    the coordinator before it starts."""
    trust, _ = _fleet(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if k != DEVELOPMENT_ENV}, "PYTHONPATH": str(ROOT)}
    common = ["--broker", mosquitto.url, "--fleet", FLEET, "--trust", str(trust)]
    keyserver = subprocess.Popen(
        [sys.executable, "-m", "keyserver.cli", "serve", *common, "--key-dir", str(tmp_path / "keys"),
         "--identity", str(tmp_path / "ids" / "keyserver.key")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    coordinator = [sys.executable, "-m", "coordinator.cli", "serve", *common, "--once", "--state-dir",
                   str(tmp_path / "state"), "--identity", str(tmp_path / "ids" / "coordinator.key")]
    try:
        t = time.monotonic()
        unsigned = subprocess.run([*coordinator, "--job", str(_job_file(tmp_path))], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=240)
        said = unsigned.stdout + unsigned.stderr
        assert unsigned.returncode == 2, said
        assert "is refused: it carries no job signed by an operator of fleet 'signed'" in said and "Traceback" not in said
        assert "No public key" not in said and time.monotonic() - t < 120
        # a job signed by an operator identity this fleet does not pin
        Identity.load_or_create("operator", tmp_path / "stranger" / "operator.key")
        signed = CliRunner().invoke(app, ["job", "sign", str(_job_file(tmp_path)), "--identity",
                                          str(tmp_path / "stranger" / "operator.key"), "--fleet", FLEET,
                                          "--out", str(tmp_path / "stranger.signed")])
        assert signed.exit_code == 0, signed.output
        stranger = subprocess.run([*coordinator, "--job", str(tmp_path / "stranger.signed")], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=240)
        said = stranger.stdout + stranger.stderr
        assert stranger.returncode == 2 and "stranger.signed' is not allowed" in said and "not its pinned key" in said, said
    finally:
        keyserver.terminate()
        keyserver.communicate(timeout=60)
