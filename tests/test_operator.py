"""Operator experience: --version everywhere, one default per option, an agent that says
what it waits for, nothing written into the home directory without saying so.

Real processes and a real Mosquitto broker; the fleet here is 2 agents, plaintext, a
linear model and 2 rounds (about 30 s).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import senseshield
from senseshield import defaults

PROGRAMS = {"senseshield": "senseshield.cli", "coordinator": "coordinator.cli", "keyserver": "keyserver.cli",
            "edge-agent": "edge_agent.cli"}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_command_line_prints_the_one_version(program):
    version = importlib.metadata.version("senseshield")
    assert version == senseshield.__version__  # pyproject reads it from senseshield.__version__
    done = subprocess.run([sys.executable, "-m", PROGRAMS[program], "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{program} {version}"


def _options() -> dict[str, list[tuple[str, object]]]:
    """Every option of every command of the four programs: ``--name -> [(command, default)]``."""
    from typer.main import get_command

    table: dict[str, list[tuple[str, object]]] = {}

    def walk(cmd, path: str) -> None:  # noqa: ANN001
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
        if not hasattr(cmd, "commands"):
            for p in cmd.params:
                if p.param_type_name == "option":
                    table.setdefault(p.opts[0], []).append((path, p.default))

    for program, module in PROGRAMS.items():
        app = importlib.import_module("senseshield.cli.main" if program == "senseshield" else module).app
        walk(get_command(app), program)
    return table


# (command, option) whose default differs on purpose; each says why in its --help
DIFFERENT_ON_PURPOSE = {
    ("senseshield check determinism", "--rounds"),  # a quick check: 2 rounds
    ("senseshield check determinism", "--key-bits"),  # a quick check: 1024 bits
    ("senseshield check determinism", "--partition"),  # two planted clusters
    ("senseshield check determinism", "--agents"),
    ("senseshield compare", "--partition"),  # strategies differ on non-IID data
    ("senseshield attack sweep", "--model"),  # SenseCrypt App. H's setting (LeNet-5, 10 clients, 1 epoch)
    ("senseshield attack sweep", "--clients"),
    ("senseshield attack sweep", "--local-epochs"),
    ("senseshield attack sweep", "--bandwidth"),  # one bandwidth, not a list
    ("senseshield attack sweep", "--round"),
    ("senseshield bench he", "--clients"),  # clients per aggregate, not a fleet
    ("edge-agent profile", "--scheme"),  # the scheme it times
}


def test_one_default_per_option_across_commands():
    """An option that several commands share has one default (None means "from elsewhere":
    the job's, the embedded broker, the machine's cores), except the few listed on purpose;
    the job options' defaults are Job's."""
    from senseshield.job import Job

    table = _options()
    for option, uses in table.items():
        if option == "--out":  # where results go: one rule, not one value (below)
            continue
        values = {repr(d) for cmd, d in uses if d is not None and (cmd, option) not in DIFFERENT_ON_PURPOSE}
        assert len(values) <= 1, f"{option} has defaults {values} in {uses}"
    assert {c for c, d in table["--fleet"]} >= {"senseshield fleet up", "coordinator serve", "keyserver serve",
                                                 "edge-agent join", "senseshield job submit"}
    assert {d for c, d in table["--fleet"]} == {defaults.FLEET} == {"default"}
    assert {d for c, d in table["--rounds"] if d is not None and "check" not in c} == {Job().rounds} == {5}
    assert {d for c, d in table["--broker"] if d is not None} == {defaults.BROKER}
    assert all(d is None for c, d in table["--threads"])  # every core, shared among a fleet's agents
    # --out DIR defaults to ./<command>-run; --out FILE is written only when given (the attacks
    # excepted: their result is the file)
    for cmd, default in table["--out"]:
        if default is not None and not str(default).endswith(".json"):
            assert str(default) == f"{cmd.split()[1]}-run", (cmd, default)
    for flag, value in defaults.JOB_FLAGS.items():
        assert Job.model_fields[flag].default == value, flag


def test_a_long_wait_is_said_once_and_a_short_one_not_at_all(mosquitto, caplog):
    """``Service.wait_until(..., waiting=...)`` logs one line when a wait lasts longer than
    WAIT_NOTE_S, not one per loop, and nothing for a short wait."""
    from senseshield.runtime.service import WAIT_NOTE_S, Service

    service = Service(mosquitto.url, fleet="patience", client_id="waiter", logger=logging.getLogger("waiter"))
    service.start([])
    try:
        for delay, lines in ((0.3, 0), (WAIT_NOTE_S + 1.5, 1)):
            caplog.clear()
            flag = threading.Event()
            threading.Timer(delay, flag.set).start()
            with caplog.at_level(logging.INFO, logger="waiter"):
                assert service.wait_until(flag.is_set, 30, waiting="the flag (a timer sets it)")
            said = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
            assert said == ["waiting for the flag (a timer sets it)"] * lines, (delay, said)
    finally:
        service.stop()


@pytest.mark.slow  # a fleet whose key server starts late (~35 s on 2 cores)
def test_agents_say_what_they_wait_for_and_nothing_lands_in_home_unsaid(mosquitto, tmp_path, monkeypatch):
    """A key server that starts 3 s after the agents: each agent says once that it waits for the job's
    key, and why. The fleet's processes write nothing into $HOME (onnxruntime's telemetry
    is off); `senseshield report` names the folders matplotlib creates there."""
    from senseshield.job import Job
    from senseshield.runtime.fleet import FleetOptions, fleet_up

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "ORT_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)

    run = tmp_path / "run"
    # the key server starts 3 s after both agents are connected and waiting for a job
    gate = f'until grep -qs "waiting for a job" {run}/logs/c000.log && grep -qs "waiting for a job" {run}/logs/c001.log; do sleep 0.2; done; sleep 3; exec "$@"'

    def late_keyserver(name: str, argv: list[str]) -> list[str]:
        return ["sh", "-c", gate, "sh", *argv] if name == "keyserver" else argv

    config = Job(strategy="plaintext", model="linear", rounds=2)
    options = FleetOptions(agents=2, out=run, broker=mosquitto.url, fleet="waits", round_deadline=60, wrap=late_keyserver)
    fleet_up(config, options, timeout=120)
    for agent in ("c000", "c001"):
        log = (run / "logs" / f"{agent}.log").read_text()
        key = [line for line in log.splitlines() if "the key server's public key for this job" in line]
        assert len(key) == 1, log
        assert re.search(r"waiting for job \S+: the key server's public key for this job \(updates are encrypted", key[0])
        # no wait is said twice (one line per wait, not per loop)
        waits = [line.split(" INFO ", 1)[1] for line in log.splitlines() if " INFO waiting for " in line]
        assert len(waits) == len(set(waits)), waits
    assert not any(home.iterdir()), sorted(str(p) for p in home.rglob("*"))  # e.g. onnxruntime's device id

    done = subprocess.run([sys.executable, "-m", "senseshield.cli", "report", str(run)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {run / 'report.html'}" in done.stderr.replace("\n", "")
    created = sorted(p for p in home.rglob("*") if p.is_dir() and p.parent in (home / ".cache", home / ".config"))
    assert created, "matplotlib wrote nothing in the home directory; this test no longer tests anything"
    said = done.stderr.replace("\n", "")
    for folder in created:
        assert str(folder) in said, (folder, done.stderr)
    assert {p.parent for p in home.rglob("*") if p.is_file()} <= set(created)
    # matplotlib's folders exist now: nothing new to say
    again = subprocess.run([sys.executable, "-c", "from senseshield.plotting import pyplot; pyplot()"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "matplotlib" not in again.stderr, again.stderr
