"""deploy/ansible checked for real.

ansible-lint (production profile) and a syntax check; then the whole playbook applied to
localhost into a sandbox (inventory/sandbox: five hosts, each rooted in its own directory,
connection local, no systemd), a second apply that must change nothing (`make test-slow`),
and the rendered
fleet started from the rendered launchers: Mosquitto with its TLS listener, password file
and ACL, the key server, the long-running coordinator and two agents with their own
credentials and a model package installed by the play; the operator submits two jobs
(submit-job.yml, then `senseshield job submit --follow`) that both complete on the same
agents. The broker refuses what the ACL forbids (another agent's topics, job submission by
anyone but the operator, a wrong password, anonymous or plain connections), a rotated
credential replaces the old one, and bad inventories fail before anything changes, naming
the host and the variable.

The sandbox has one site, "north" (docs/sites.md): its own Mosquitto (TLS, its device's
credential and ACL) bridged to the hub's over TLS as user bridge-north, rendered from the
topic list of senseshield/runtime/sites.py, and its aggregator (`coordinator serve --site
north`); agent-b joins the site's broker, agent-a the hub's. The jobs run with agent-b's
updates folded by the site aggregator into partial sums.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.cli.top import scrape
from senseshield.errors import ConfigError
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.jobs import JobClient
from senseshield.runtime.sites import bridge_topics
from senseshield.runtime.transport import PREFIX, Link, check_security, parse_broker
from tests.broker import free_port, mosquitto_binary

ANSIBLE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "ansible"
BIN = Path(sys.executable).parent
FLEET = "sandbox"
AGENTS = ("agent-a", "agent-b")  # rpi4 and jetson_orin in inventory/sandbox
SITE, SITE_HOST = "north", "sandbox-site-north"  # inventory/sandbox's one site; agent-b is there
HUB_USERS = ("keyserver", "coordinator", "operator", "agent-a", f"bridge-{SITE}")  # the hub broker's password file
SITE_USERS = ("agent-b", f"site-{SITE}")  # the site broker's

pytestmark = [
    pytest.mark.skipif(
        not (BIN / "ansible-playbook").exists(),
        reason="ansible-core is not installed; `make test` installs it with the dev extras",
    ),
    pytest.mark.xdist_group("ansible"),  # one worker builds the sandbox once (make test: --dist loadgroup)
]


def ansible_env() -> dict[str, str]:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"), NO_COLOR="1")
    env.pop("VIRTUAL_ENV", None)
    return env


def port_pair() -> int:
    """A free port whose successor is free too: the hub's broker and site north's (inventory/sandbox
    puts the site's broker on the hub's port + 1)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def playbook(root: Path, *extra: str, inventories: tuple[str, ...] = ("inventory/sandbox",),
             port: int | None = None) -> subprocess.CompletedProcess:
    argv = [str(BIN / "ansible-playbook"), "site.yml", "-e", f"senseshield_sandbox_root={root}"]
    for inventory in inventories:
        argv += ["-i", inventory]
    if port is not None:
        argv += ["-e", f"senseshield_broker_port={port}"]
    return subprocess.run([*argv, *extra], cwd=ANSIBLE_DIR, env=ansible_env(), capture_output=True,
                          text=True, timeout=600)


MODEL_PACKAGE = {  # a model package for the fleet (edge_agent_model_packages): a wheel built here
    "ssdemo/__init__.py": "",
    "ssdemo/models.py": (
        "from math import prod\n\nfrom torch import nn\n\n\n"
        "def tiny(input_shape, num_classes, hidden=16):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(prod(input_shape), hidden), nn.ReLU(),\n"
        "                         nn.Linear(hidden, num_classes))\n"
    ),
    "ssdemo-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: ssdemo\nVersion: 0.1\n",
    "ssdemo-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}


def model_wheel(directory: Path) -> Path:
    """The wheel of MODEL_PACKAGE (model ``ssdemo.models:tiny``), with its RECORD."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "ssdemo-0.1-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in MODEL_PACKAGE.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
            zf.writestr(name, data)
        zf.writestr("ssdemo-0.1.dist-info/RECORD", "\n".join([*record, "ssdemo-0.1.dist-info/RECORD,,"]) + "\n")
    return wheel


def recap(output: str) -> dict[str, dict[str, int]]:
    """The PLAY RECAP: host -> {ok, changed, failed, ...}."""
    hosts: dict[str, dict[str, int]] = {}
    for line in output.split("PLAY RECAP", 1)[-1].splitlines():
        m = re.match(r"^(\S+)\s+:\s+(.*)$", line.strip())
        if m:
            hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


@dataclass
class Sandbox:
    root: Path
    port: int
    seconds: dict[str, float]
    first: subprocess.CompletedProcess
    packages: list[str]  # the extra vars of the first apply (the model package, the metrics ports)
    metrics: dict[str, int]  # the Prometheus ports of the coordinator and the key server
    broker: subprocess.Popen | None = None
    site_broker: subprocess.Popen | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    @property
    def site_port(self) -> int:
        return self.port + 1

    @property
    def site_url(self) -> str:
        return f"mqtts://127.0.0.1:{self.site_port}"

    @property
    def ca(self) -> Path:
        return self.root / "pki" / "ca.crt"

    def password(self, user: str) -> str:
        return (self.root / "pki" / "credentials" / user).read_text().strip()

    def launcher(self, host: str, name: str) -> Path:
        return self.root / host / "opt" / "senseshield" / "bin" / name

    def spawn(self, host: str, name: str, log: str) -> subprocess.Popen:
        (self.root / "logs").mkdir(exist_ok=True)
        with (self.root / "logs" / log).open("ab") as out:
            proc = subprocess.Popen([str(self.launcher(host, name))], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.processes.append(proc)
        return proc


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The playbook applied to a fresh sandbox; the rendered brokers (the hub's and site north's,
    bridged) run for the module."""
    mosquitto_binary()  # the tests need mosquitto and mosquitto_passwd (`make test` installs them)
    root = tmp_path_factory.mktemp("fleet")
    port = port_pair()
    metrics = {"coordinator": free_port(), "keyserver": free_port()}
    packages = ["-e", json.dumps({"edge_agent_model_packages": [str(model_wheel(root / "packages"))],
                                  "coordinator_metrics_port": metrics["coordinator"],
                                  "keyserver_metrics_port": metrics["keyserver"]})]
    began = time.monotonic()
    first = playbook(root, *packages, port=port)
    seconds = {"from_zero": time.monotonic() - began}
    assert first.returncode == 0, tail(first)
    (root / "timings.json").write_text(json.dumps(seconds))
    print(f"\nprovisioning the sandbox: from zero {seconds['from_zero']:.1f} s")
    box = Sandbox(root, port, seconds, first, packages, metrics)
    box.broker = box.spawn("sandbox-broker", "senseshield-mosquitto", "broker.log")
    box.site_broker = box.spawn(SITE_HOST, "senseshield-mosquitto", "site-broker.log")
    for proc, log, at in [(box.broker, "broker.log", port), (box.site_broker, "site-broker.log", box.site_port)]:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, (root / "logs" / log).read_text()[-2000:]
            try:
                with socket.create_connection(("127.0.0.1", at), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"the rendered broker of {log} did not listen"
                time.sleep(0.1)
    deadline = time.monotonic() + 15  # the site's bridge logs in at the hub
    while f"u'bridge-{SITE}'" not in (root / "logs" / "broker.log").read_text(errors="replace"):
        assert time.monotonic() < deadline, (root / "logs" / "site-broker.log").read_text()[-2000:]
        time.sleep(0.1)
    yield box
    for proc in box.processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in box.processes:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- static checks -----------------------------------------------------------------------------


def test_ansible_lint_passes_the_production_profile():
    proc = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--profile", "production"], cwd=ANSIBLE_DIR,
                          env=ansible_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, tail(proc)
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


@pytest.mark.parametrize("inventory", ["inventory/example", "inventory/sandbox"])
def test_playbook_syntax(inventory):
    proc = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, "site.yml"],
                          cwd=ANSIBLE_DIR, env=ansible_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, tail(proc)


# -- the sandbox -------------------------------------------------------------------------------


HOSTS = {"sandbox-broker", "sandbox-keyserver", "sandbox-coordinator", SITE_HOST, *AGENTS}


def test_sandbox_is_provisioned(sandbox):
    first = recap(sandbox.first.stdout)
    assert set(first) == HOSTS
    assert all(first[h]["changed"] > 0 and first[h]["failed"] == 0 for h in HOSTS), first

    root = sandbox.root
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(root / "sandbox-keyserver/var/lib/senseshield/keyserver") == 0o700
    assert mode(root / "sandbox-broker/etc/mosquitto/senseshield/server.key") == 0o600
    for host, name in [("sandbox-keyserver", "keyserver"), ("sandbox-coordinator", "coordinator"),
                       (SITE_HOST, "site-aggregator"), *[(a, "edge-agent") for a in AGENTS]]:
        assert mode(root / host / f"etc/senseshield/{name}.password") == 0o400
        assert (root / host / "etc/senseshield/ca.crt").read_bytes() == sandbox.ca.read_bytes()
        assert (root / host / f"etc/systemd/system/senseshield-{name}.service").is_file()
    # every agent got its class's profile and a launcher with TLS and its own credential
    assert (root / "agent-a/etc/senseshield/profile.yaml").read_text() == \
        (ANSIBLE_DIR.parents[1] / "profiles/rpi4.yaml").read_text()
    assert (root / "agent-b/etc/senseshield/profile.yaml").read_text() == \
        (ANSIBLE_DIR.parents[1] / "profiles/jetson-orin-nano.yaml").read_text()
    launcher = sandbox.launcher("agent-a", "senseshield-edge-agent").read_text()
    for flag in (f"--broker {sandbox.url}", "--username agent-a", "--password-file", "--ca-file", "--profile",
                 "--device-class rpi4", "--label site=sandbox", "--shard 0/2"):
        assert flag in launcher
    assert "--once" not in launcher
    # the coordinator is long-running and starts without a job (none configured)
    coordinator = sandbox.launcher("sandbox-coordinator", "senseshield-coordinator").read_text()
    for flag in ("--state-dir", "--out", "--username coordinator", "--ca-file"):
        assert flag in coordinator
    assert "--once" not in coordinator and "--job" not in coordinator
    # the Prometheus endpoints the inventory turned on (coordinator_metrics_port, keyserver_metrics_port),
    # on the host only (the default address)
    keyserver = sandbox.launcher("sandbox-keyserver", "senseshield-keyserver").read_text()
    assert f"--metrics-port {sandbox.metrics['coordinator']} --metrics-host 127.0.0.1" in coordinator
    assert f"--metrics-port {sandbox.metrics['keyserver']} --metrics-host 127.0.0.1" in keyserver
    assert "--metrics-port" not in launcher  # an agent has none
    for host, name in [("sandbox-coordinator", "coordinator"), ("agent-a", "edge-agent")]:
        assert "Restart=always" in (root / host / f"etc/systemd/system/senseshield-{name}.service").read_text()
    # agent-b is at site north: it joins the site's broker, agent-a the hub's
    assert f"--broker {sandbox.site_url}" in sandbox.launcher("agent-b", "senseshield-edge-agent").read_text()
    # one hashed credential per MQTT user of each broker, and no password in any rendered file
    # (but the bridge's own, in its 0600 configuration) or in the output
    for host, users in [("sandbox-broker", HUB_USERS), (SITE_HOST, SITE_USERS)]:
        passwd = (root / host / "etc/mosquitto/senseshield/passwd").read_text().splitlines()
        assert [line.split(":")[0] for line in passwd] == list(users), host
    bridge = root / SITE_HOST / "etc/mosquitto/conf.d/senseshield-bridge.conf"
    assert mode(bridge) == 0o600
    assert f"remote_password {sandbox.password(f'bridge-{SITE}')}\n" in bridge.read_text()
    secrets = [sandbox.password(u) for u in (*HUB_USERS, *SITE_USERS)]
    rendered = [p for p in root.rglob("*") if p.is_file() and (
        p.parent.name == "bin" and p.parent.parent.name == "senseshield"  # the launchers
        or p.suffix in (".service", ".conf") or p.name in ("acl", "passwd"))]
    assert len(rendered) >= 10
    for secret in secrets:
        assert len(secret) >= 32
        assert secret not in sandbox.first.stdout
        for path in rendered:
            if path != bridge:
                assert secret not in path.read_text(errors="replace"), path


IDENTITY_FILES = {  # each host principal's identity key on its host (the roles' defaults)
    "keyserver": "sandbox-keyserver/var/lib/senseshield/keyserver/identity.key",
    "coordinator": "sandbox-coordinator/var/lib/senseshield/coordinator/identity/coordinator.key",
    **{a: f"{a}/var/lib/senseshield/agent/identity/agent.key" for a in AGENTS},
    f"site-{SITE}": f"{SITE_HOST}/var/lib/senseshield/site/identity/site.key",
}


def test_each_identity_is_made_on_its_host_and_only_the_operators_stays_on_the_controller(sandbox):
    root = sandbox.root
    pki = root / "pki"
    # the controller holds one secret identity, the operator's (it signs the trust file and jobs)
    assert sorted(p.name for p in (pki / "identities").glob("*.key")) == ["operator.key"]
    trust = Trust.load(pki / "trust.json", fleet=FLEET)
    assert set(trust.principals) == {"operator", *IDENTITY_FILES}
    operator = Identity.load_or_create("operator", pki / "identities" / "operator.key")
    assert trust.signer_fingerprint == operator.fingerprint
    # no file on the controller's side holds a host's secret seed
    controller_files = [p.read_bytes() for p in pki.rglob("*") if p.is_file()]
    for name, path in IDENTITY_FILES.items():
        key = root / path
        assert key.stat().st_mode & 0o777 == 0o600, key
        assert key.parent.stat().st_mode & 0o777 == 0o700, key.parent
        seed = key.read_bytes()
        assert not any(seed in data for data in controller_files), name
        host = path.split("/", 1)[0]
        assert trust.principals[name].sign == Identity.load_or_create(name, key).sign_key, name
        # every host got the same signed trust file
        assert (root / host / "etc/senseshield/trust.json").read_bytes() == (pki / "trust.json").read_bytes()


def write_job(path: Path, **fields) -> Path:
    path.write_text(json.dumps(fields))  # JSON is YAML
    return path


def test_the_rendered_fleet_runs_submitted_jobs_over_tls(sandbox, tmp_path):
    """The coordinator and the agents run as services (no --once): the operator submits a
    job with submit-job.yml and a second one with `senseshield job submit --follow`; both
    complete on the same agent processes, the first with the model package the play installed.
    agent-b joins through site north's broker: the site aggregator folds its updates and sends
    the coordinator a partial sum each round."""
    out = sandbox.root / "sandbox-coordinator/var/lib/senseshield/coordinator/run/jobs"
    keyserver = sandbox.spawn("sandbox-keyserver", "senseshield-keyserver", "keyserver.log")
    coordinator = sandbox.spawn("sandbox-coordinator", "senseshield-coordinator", "coordinator.log")
    site = sandbox.spawn(SITE_HOST, "senseshield-site-aggregator", f"site-{SITE}.log")
    agents = [sandbox.spawn(a, "senseshield-edge-agent", f"{a}.log") for a in AGENTS]
    services = [keyserver, coordinator, *agents, site]
    operator = {"ca_file": sandbox.ca, "username": "operator", "password": sandbox.password("operator"),
                "identity": Identity.load_or_create("operator", sandbox.root / "pki/identities/operator.key"),
                "trust": Trust.load(sandbox.root / "pki/trust.json", fleet=FLEET)}
    logs = lambda: {p.stem: p.read_text(errors="replace") for p in (sandbox.root / "logs").glob("*.log")}  # noqa: E731
    digits = {"dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10, "strategy": "masked",
              "min_devices": 2, "round_deadline": 60}
    try:
        # job 1: the play, from the controller, as the operator; its model comes from the package
        first = write_job(tmp_path / "first.yaml", name="sandbox-package", model="ssdemo.models:tiny",
                          model_args={"hidden": 8}, rounds=2, **digits)
        proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", "inventory/sandbox", "submit-job.yml",
                               "-e", f"senseshield_sandbox_root={sandbox.root}", "-e", f"senseshield_broker_port={sandbox.port}",
                               "-e", f"job_file={first}"], cwd=ANSIBLE_DIR, env=ansible_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, tail(proc)
        first_id = re.search(r"job (j-[0-9a-f]+) submitted", proc.stdout).group(1)
        with JobClient(sandbox.url, fleet=FLEET, **operator) as client:
            record = client.follow(first_id, lambda line: None, timeout=300)
        assert record["state"] == "done", (record, logs()["coordinator"][-2000:])
        # job 2 on the same agents (none restarted): the CLI with --follow, selecting by label
        second = write_job(tmp_path / "second.yaml", name="sandbox-labels", model="linear", rounds=1,
                           select={"labels": {"site": "sandbox"}, "device_class": ["rpi4", "jetson-orin-nano"]}, **digits)
        proc = subprocess.run([str(BIN / "senseshield"), "job", "submit", str(second), "--broker", sandbox.url,
                               "--fleet", FLEET, "--ca-file", str(sandbox.ca), "--username", "operator",
                               "--password-file", str(sandbox.root / "pki/credentials/operator"), "--follow",
                               "--identity", str(sandbox.root / "pki/identities/operator.key"),
                               "--trust", str(sandbox.root / "pki/trust.json")],
                              capture_output=True, text=True, timeout=300, env=ansible_env())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs()["coordinator"][-2000:]
        second_id = proc.stdout.split()[0]
        assert [p.poll() for p in services] == [None] * len(services), "a service exited"
        # the services' Prometheus endpoints, as the roles rendered them (a Prometheus server or
        # `senseshield fleet top` reads them while the fleet runs)
        coordinator_metrics = scrape(f"http://127.0.0.1:{sandbox.metrics['coordinator']}/metrics")
        keyserver_metrics = scrape(f"http://127.0.0.1:{sandbox.metrics['keyserver']}/metrics", "key server")
    finally:
        # stop the services so that later tests may use their users (the broker takes the
        # username as client id: two clients would take turns); the coordinator first, so that
        # the key server sees it go offline
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(60)
        deadline = time.monotonic() + 10
        while "coordinator offline since" not in logs().get("keyserver", "") and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in services:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in services]
    text = logs()
    assert codes[1:] == [0, 0, 0, 0], {name: text[name][-1500:] for name in ("coordinator", *AGENTS, f"site-{SITE}")}
    # every service ran with the fleet's trust file (no trust on first use), keys made once on the controller
    assert not [name for name, log in text.items() if "no --trust file" in log or "on first use" in log]
    trust = json.loads((sandbox.root / "pki/trust.json").read_text())
    assert sorted(trust["principals"]) == sorted(["keyserver", "coordinator", "operator", *AGENTS, f"site-{SITE}"])
    reports = {job_id: json.loads((out / job_id / "report.json").read_text()) for job_id in (first_id, second_id)}
    assert [r["round"] for r in reports[first_id]["rounds"]] == [1, 2]
    assert reports[first_id]["rounds"][-1]["accuracy"] > 0.5
    assert [r["round"] for r in reports[second_id]["rounds"]] == [1]
    for report in reports.values():
        # the agents joined with their device class's profile (rpi4: 5 MB/s, Jetson Orin Nano: 8 MB/s)
        assert {c["id"]: c["bandwidth"] for c in report["clients"]} == {"agent-a": 5.0, "agent-b": 8.0}
        assert not report["rejected_messages"]
    # the endpoints saw both jobs: the devices with their budgets, every round decrypted (masked: one
    # cluster; 2 rounds, then 1)
    def got(metrics: dict, metric: str, /, **labels: str) -> float | None:
        return next((v for have, v in metrics.get(metric, []) if have == labels), None)

    assert got(coordinator_metrics, "senseshield_jobs", state="done") == 2
    assert got(coordinator_metrics, "senseshield_devices_online") == 2
    assert {have["agent"] for have, _ in coordinator_metrics["senseshield_agent_budget"]} == set(AGENTS)
    assert [(have["job"], have["state"]) for have, v in coordinator_metrics["senseshield_job_info"] if v] == \
        [(second_id, "done")]
    assert got(keyserver_metrics, "senseshield_keyserver_aggregates_total", result="accepted") == 3
    assert got(keyserver_metrics, "senseshield_keyserver_decrypt_seconds_count") == 3
    # the ACL lets the status topics through: the key server saw the coordinator's offline
    assert "keyserver: coordinator offline since" in text["keyserver"]
    # each process logged in with its own user over the TLS listener of its broker: agent-b and
    # the site aggregator at site north's, the site's bridge at the hub's
    for user in HUB_USERS:
        assert f"u'{user}'" in text["broker"], user
    for user in SITE_USERS:
        assert f"u'{user}'" in text["site-broker"] and f"u'{user}'" not in text["broker"], user
    # the site aggregator folded agent-b's update of every round (3) into a partial sum of its own
    partials = re.findall(r"round (\d+) cluster 0: sent the partial sum of 1 update\(s\)", text[f"site-{SITE}"])
    assert len(partials) >= 3, text[f"site-{SITE}"][-2000:]


# -- the broker's ACL and authentication --------------------------------------------------------


class Client:
    """A paho MQTT 5 client over TLS that records deliveries, PUBACK and SUBACK codes."""

    def __init__(self, box: Sandbox, user: str | None, password: str | None, *, port: int | None = None) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.acks: dict[int, str] = {}
        self.suback: dict[int, list[str]] = {}
        self.connack: queue.Queue = queue.Queue()
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"test-{user}",
                                  protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(box.ca))
        if user is not None:
            self.client.username_pw_set(user, password)
        self.client.on_connect = lambda c, u, f, rc, p: self.connack.put(rc)
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.client.on_publish = lambda c, u, mid, rc, p: self.acks.__setitem__(mid, str(rc))
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.suback.__setitem__(mid, [str(r) for r in rcs])
        self.client.connect("127.0.0.1", port or box.port)
        self.client.loop_start()

    def connected(self) -> str:
        return str(self.connack.get(timeout=10))

    def subscribe(self, topic: str) -> list[str]:
        _, mid = self.client.subscribe(topic, qos=1)
        deadline = time.monotonic() + 10
        while mid not in self.suback:
            assert time.monotonic() < deadline, "no SUBACK"
            time.sleep(0.02)
        return self.suback[mid]

    def publish(self, topic: str, payload: bytes) -> str:
        info = self.client.publish(topic, payload, qos=1)
        info.wait_for_publish(10)
        deadline = time.monotonic() + 5
        while info.mid not in self.acks and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.acks.get(info.mid, "no PUBACK")

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_an_agent_cannot_use_another_agents_topics(sandbox):
    t = f"ss/v1/{FLEET}"
    watcher = Client(sandbox, "coordinator", sandbox.password("coordinator"))
    agent_a = Client(sandbox, "agent-a", sandbox.password("agent-a"))
    try:
        assert watcher.connected() == "Success" and agent_a.connected() == "Success"
        assert watcher.subscribe(f"{t}/agents/#") == ["Granted QoS 1"]
        # agent-a speaking as agent-b: the broker refuses the PUBACK and never delivers it
        assert agent_a.publish(f"{t}/agents/agent-b/update", b"spoofed by agent-a") == "Not authorized"
        assert agent_a.publish(f"{t}/keyserver/requests", b"not for agents") == "Not authorized"
        assert agent_a.publish(f"{t}/fleet/config", b"not for agents") == "Not authorized"
        # its own topics work (and arrive after anything published before them)
        assert agent_a.publish(f"{t}/agents/agent-a/update", b"mine") == "Success"
        seen: list[tuple[str, bytes]] = []
        while (f"{t}/agents/agent-a/update", b"mine") not in seen:
            seen.append(watcher.messages.get(timeout=10))  # retained statuses come first
        time.sleep(0.3)
        while not watcher.messages.empty():
            seen.append(watcher.messages.get())
        assert not [m for m in seen if m[0].endswith("/update") and m[1] != b"mine"], seen
        # it reads its own inbox and the fleet's public topics, never another agent's inbox
        # (mosquitto 2.0 grants the subscription but delivers nothing the ACL does not allow)
        for topic in ("agents/agent-b/inbox", "agents/agent-a/inbox", "clusters/7/model"):
            agent_a.subscribe(f"{t}/{topic}")
        keyserver = Client(sandbox, "keyserver", sandbox.password("keyserver"))
        assert keyserver.connected() == "Success"
        assert watcher.publish(f"{t}/agents/agent-b/inbox", b"for agent-b") == "Success"
        assert keyserver.publish(f"{t}/clusters/7/model", b"a model") == "Success"
        assert watcher.publish(f"{t}/agents/agent-a/inbox", b"for agent-a") == "Success"
        keyserver.stop()
        got = []
        while len(got) < 2:
            got.append(agent_a.messages.get(timeout=10)[0])
        time.sleep(0.3)
        while not agent_a.messages.empty():
            got.append(agent_a.messages.get()[0])
        assert sorted(got) == [f"{t}/agents/agent-a/inbox", f"{t}/clusters/7/model"]
    finally:
        watcher.stop()
        agent_a.stop()


def test_only_the_operator_submits_jobs(sandbox):
    t = f"ss/v1/{FLEET}"
    coordinator = Client(sandbox, "coordinator", sandbox.password("coordinator"))
    agent_a = Client(sandbox, "agent-a", sandbox.password("agent-a"))
    operator = Client(sandbox, "operator", sandbox.password("operator"))
    try:
        assert {coordinator.connected(), agent_a.connected(), operator.connected()} == {"Success"}
        for topic in ("jobs/submit", "jobs/cancel"):
            coordinator.subscribe(f"{t}/{topic}")
            assert agent_a.publish(f"{t}/{topic}", b"from agent-a") == "Not authorized"
            assert operator.publish(f"{t}/{topic}", b"from the operator") == "Success"
            assert coordinator.messages.get(timeout=10) == (f"{t}/{topic}", b"from the operator")
        time.sleep(0.3)
        assert coordinator.messages.empty()  # nothing from agent-a arrived
        # the operator speaks for no service and no device
        for topic in ("fleet/config", "jobs/board", "agents/agent-a/update", "keyserver/requests"):
            assert operator.publish(f"{t}/{topic}", b"forged") == "Not authorized", topic
        # it reads the coordinator's board and answers
        operator.subscribe(f"{t}/jobs/board")
        operator.subscribe(f"{t}/jobs/replies/#")
        assert coordinator.publish(f"{t}/jobs/board", b"board") == "Success"
        assert coordinator.publish(f"{t}/jobs/replies/r1", b"reply") == "Success"
        got: list[tuple[str, bytes]] = []
        while not {(f"{t}/jobs/board", b"board"), (f"{t}/jobs/replies/r1", b"reply")} <= set(got):
            got.append(operator.messages.get(timeout=10))  # the retained board of earlier tests may come first
    finally:
        for client in (coordinator, agent_a, operator):
            client.stop()


def test_the_sites_bridge_and_aggregator_are_rendered_from_the_one_topic_list(sandbox):
    """Site north's bridge carries exactly the topics of senseshield/runtime/sites.py over TLS as
    bridge-north; the hub's ACL gives that user exactly those (out: write, in: read); the site's
    ACL gives its aggregator its topics; the aggregator runs `coordinator serve --site north` on
    the site's broker with its own identity and credential."""
    root, t = sandbox.root, f"ss/v1/{FLEET}"
    topics = bridge_topics(FLEET, SITE, PREFIX)
    bridge = (root / SITE_HOST / "etc/mosquitto/conf.d/senseshield-bridge.conf").read_text().splitlines()
    assert [tuple(line.split()[1:3]) for line in bridge if line.startswith("topic ")] == topics
    assert not [line for line in bridge if line.startswith("topic ") and "/update" in line]
    for line in (f"connection site-{SITE}", f"address 127.0.0.1:{sandbox.port}", f"remote_username bridge-{SITE}",
                 f"bridge_cafile {root / SITE_HOST}/etc/mosquitto/senseshield/ca.crt", "bridge_insecure false"):
        assert line in bridge, line

    def acl(host: str) -> dict[str, list[str]]:
        users: dict[str, list[str]] = {}
        for line in (root / host / "etc/mosquitto/senseshield/acl").read_text().splitlines():
            if line.startswith("user "):
                users[line.split()[1]] = []
            elif line.startswith("topic "):
                users[list(users)[-1]].append(line)
        return users

    hub, site = acl("sandbox-broker"), acl(SITE_HOST)
    assert sorted(hub) == sorted(HUB_USERS) and sorted(site) == sorted(SITE_USERS)
    assert hub[f"bridge-{SITE}"] == [f"topic {'write' if d == 'out' else 'read'} {p}" for p, d in topics]
    assert f"topic read {t}/sites/+/partial" in hub["coordinator"]
    assert f"topic write {t}/sites/{SITE}/partial" in site[f"site-{SITE}"]
    # a device's ACL is the same wherever it joins
    assert site["agent-b"] == [line.replace("agent-a", "agent-b") for line in hub["agent-a"]]
    launcher = sandbox.launcher(SITE_HOST, "senseshield-site-aggregator").read_text()
    for flag in (f"serve --site {SITE} --broker {sandbox.site_url} --fleet {FLEET}", f"--username site-{SITE}",
                 f"--identity {root / SITE_HOST}/var/lib/senseshield/site/identity/site.key",
                 f"--trust {root / SITE_HOST}/etc/senseshield/trust.json", "--password-file", "--ca-file"):
        assert flag in launcher, flag
    assert "Restart=always" in (root / SITE_HOST / "etc/systemd/system/senseshield-site-aggregator.service").read_text()


def test_the_sites_bridge_carries_what_the_hub_needs_and_never_an_update(sandbox):
    """Live, through the rendered brokers: agent-b's hello crosses to the hub, its update does
    not; the site aggregator's partial sum does; the coordinator's word to agent-b reaches it at
    its site."""
    t = f"ss/v1/{FLEET}"
    watcher = Client(sandbox, "coordinator", sandbox.password("coordinator"))
    agent_b = Client(sandbox, "agent-b", sandbox.password("agent-b"), port=sandbox.site_port)
    aggregator = Client(sandbox, f"site-{SITE}", sandbox.password(f"site-{SITE}"), port=sandbox.site_port)
    try:
        assert {watcher.connected(), agent_b.connected(), aggregator.connected()} == {"Success"}
        watcher.subscribe(f"{t}/agents/agent-b/#")
        watcher.subscribe(f"{t}/sites/#")
        agent_b.subscribe(f"{t}/agents/agent-b/inbox")
        time.sleep(0.5)  # the subscriptions settle
        # nobody at the site takes the update, not even the bridge (the site aggregator, which
        # would, is not running): MQTT 5's "No matching subscribers"
        assert agent_b.publish(f"{t}/agents/agent-b/update", b"an update") == "No matching subscribers"
        assert agent_b.publish(f"{t}/agents/agent-b/hello", b"a hello") == "Success"
        assert aggregator.publish(f"{t}/sites/{SITE}/partial", b"a partial sum") == "Success"
        assert aggregator.publish(f"{t}/sites/south/partial", b"another site's") == "Not authorized"
        got: list[tuple[str, bytes]] = []
        while not {(f"{t}/agents/agent-b/hello", b"a hello"), (f"{t}/sites/{SITE}/partial", b"a partial sum")} <= set(got):
            got.append(watcher.messages.get(timeout=10))
        time.sleep(0.5)
        while not watcher.messages.empty():
            got.append(watcher.messages.get())
        assert not [m for m in got if m[0].endswith("/update") or m[1] == b"another site's"], got
        assert watcher.publish(f"{t}/agents/agent-b/inbox", b"a plan") == "Success"
        assert agent_b.messages.get(timeout=10) == (f"{t}/agents/agent-b/inbox", b"a plan")
    finally:
        for client in (watcher, agent_b, aggregator):
            client.stop()


def connects(url: str, *, timeout: float = 10.0, **security) -> None:
    """Connect a Link as the services do (ConnectionError when refused), then disconnect."""
    link = Link(url, client_id="probe", fleet=FLEET, on_frame=lambda t, f: None, **security)
    link.start(timeout=timeout)
    link.stop()


def test_the_broker_refuses_wrong_credentials_anonymous_and_plain_connections(sandbox):
    # another agent's password, a wrong one, an unknown user
    for user, password in [("agent-a", sandbox.password("agent-b")), ("agent-a", "wrong"), ("nobody", "x")]:
        with pytest.raises(ConnectionError, match="refused the connection"):
            connects(sandbox.url, ca_file=sandbox.ca, username=user, password=password)
    anonymous = Client(sandbox, None, None)
    try:
        assert anonymous.connected() != "Success"
    finally:
        anonymous.stop()
    # a CA that did not sign the broker's certificate, and plain MQTT on the TLS port
    system_cas = Path("/etc/ssl/certs/ca-certificates.crt")
    if system_cas.is_file():
        with pytest.raises(ConnectionError, match="TLS"):
            connects(sandbox.url, timeout=2, ca_file=system_cas, username="agent-a",
                     password=sandbox.password("agent-a"))
    with pytest.raises(ConnectionError):
        connects(f"mqtt://127.0.0.1:{sandbox.port}", timeout=2, username="agent-a",
                 password=sandbox.password("agent-a"))
    # the right credential over TLS works, at the device's own broker only: agent-a at the hub's,
    # agent-b at its site's (each broker knows its own devices)
    connects(sandbox.url, ca_file=sandbox.ca, username="agent-a", password=sandbox.password("agent-a"))
    connects(sandbox.site_url, ca_file=sandbox.ca, username="agent-b", password=sandbox.password("agent-b"))
    for url, user in [(sandbox.url, "agent-b"), (sandbox.site_url, "agent-a"), (sandbox.site_url, "operator")]:
        with pytest.raises(ConnectionError, match="refused the connection"):
            connects(url, ca_file=sandbox.ca, username=user, password=sandbox.password(user))


@pytest.mark.slow  # one more playbook run (50-75 s on 2 shared cores)
def test_a_second_apply_changes_nothing(sandbox):
    began = time.monotonic()
    second = playbook(sandbox.root, *sandbox.packages, port=sandbox.port)
    print(f"\nthe second apply: {time.monotonic() - began:.1f} s")
    assert second.returncode == 0, tail(second)
    result = recap(second.stdout)
    assert set(result) == HOSTS
    assert {h: (r["changed"], r["failed"]) for h, r in result.items()} == {h: (0, 0) for h in HOSTS}, tail(second)
    for user in ("keyserver", "coordinator", "operator", *AGENTS):
        assert sandbox.password(user) not in second.stdout


@pytest.mark.slow  # one more playbook run (~55 s on 2 shared cores)
def test_a_rotated_credential_replaces_the_old_one(sandbox):
    # agent-b is at site north: its credential lives on the site's broker
    old = sandbox.password("agent-b")
    proc = playbook(sandbox.root, "--limit", f"{SITE_HOST},agent-b", "-e", "senseshield_rotate_credentials=agent-b",
                    port=sandbox.port)
    assert proc.returncode == 0, tail(proc)
    changed = {h: r["changed"] for h, r in recap(proc.stdout).items()}
    assert changed[SITE_HOST] > 0 and changed["agent-b"] > 0, changed
    new = sandbox.password("agent-b")
    assert new != old
    assert (sandbox.root / "agent-b/etc/senseshield/edge-agent.password").read_text().strip() == new
    sandbox.site_broker.send_signal(signal.SIGHUP)  # what `systemctl reload mosquitto` does
    time.sleep(0.5)

    with pytest.raises(ConnectionError, match="refused"):
        connects(sandbox.site_url, ca_file=sandbox.ca, username="agent-b", password=old)
    connects(sandbox.site_url, ca_file=sandbox.ca, username="agent-b", password=new)
    # agent-a's credential is untouched
    connects(sandbox.url, ca_file=sandbox.ca, username="agent-a", password=sandbox.password("agent-a"))


# -- bad input ---------------------------------------------------------------------------------

BAD_INVENTORIES = {
    "no-profile": ("all:\n  children:\n    edge_agents:\n      hosts:\n        agent-x: {}\n",
                   r"Host agent-x: edge_agent_profile is not set"),
    "unknown-profile": ("all:\n  children:\n    edge_agents:\n      hosts:\n        agent-y: {edge_agent_profile: rpi9}\n",
                        r"Host agent-y: edge_agent_profile 'rpi9' names no profile: .*rpi9\.yaml does not exist"),
    # the key server and the coordinator on one machine: refused (senseshield_allow_colocated_keyserver)
    "colocated": ("all:\n  hosts:\n    sandbox-keyserver: {ansible_host: 10.0.0.5}\n"
                  "    sandbox-coordinator: {ansible_host: 10.0.0.5}\n",
                  r"The key server \(sandbox-keyserver\) and the coordinator \(sandbox-coordinator\) are on one host; "
                  r".* senseshield_allow_colocated_keyserver: true"),
    "metrics-port": ("all:\n  hosts:\n    sandbox-coordinator: {coordinator_metrics_port: 99999}\n",
                     r"Host sandbox-coordinator: coordinator_metrics_port 99999 is not a port; give a port in 1\.\.65535"),
    # sites: a site host without its name, a bad name, a name two hosts claim, a device at a site
    # that has no host, a device named like a site aggregator
    "site-without-name": ("all:\n  children:\n    sites:\n      hosts:\n        gw-x: {}\n",
                          r"Host gw-x: site_name is not set; a host of the group 'sites' runs one site's broker"),
    "bad-site-name": ("all:\n  children:\n    sites:\n      hosts:\n        gw-y: {site_name: 'south pole'}\n",
                      r"Host gw-y: site_name 'south pole' is not a site's name; .* 1-32 letters, digits or '-'"),
    "long-site-name": ("all:\n  children:\n    sites:\n      hosts:\n        gw-l: {site_name: " + "s" * 33 + "}\n",
                       r"Host gw-l: site_name 's{33}' is not a site's name"),
    "dashes-site-name": ("all:\n  children:\n    sites:\n      hosts:\n        gw-d: {site_name: '---'}\n",
                         r"Host gw-d: site_name '---' is not a site's name"),
    "same-site-twice": ("all:\n  children:\n    sites:\n      hosts:\n        gw-z: {site_name: north}\n",
                        r"Host (gw-z|sandbox-site-north): site_name 'north' must name one host of the group 'sites' "
                        r"\(it names 2\)"),
    "unknown-site": ("all:\n  hosts:\n    agent-a: {edge_agent_site: south}\n",
                     r"Host agent-a: edge_agent_site 'south' names no site: no host of the group 'sites' has "
                     r"site_name 'south' \(the sites: north\)"),
    "agent-named-site": ("all:\n  children:\n    rpi4:\n      hosts:\n        site-east: {}\n",
                         r"Host site-east: the inventory name is the agent id .* no name beginning with 'site-'"),
}


# a host's senseshield_python as the first play reads it (Python version, then glibc): JetPack
# 4.6, Raspberry Pi OS Bullseye; and an interpreter that does not exist
OLD_HOSTS = {
    "jetpack-4.6": ("3 6", "glibc 2.27",
                    r"Host agent-a: \S+ is Python 3\.6 on glibc 2\.27, and SenseShield needs Python 3\.10 or newer "
                    r"\(senseshield_python\) on glibc 2\.28 or newer .*JetPack 4\.6 \(Ubuntu 18\.04, the original Jetson "
                    r"Nano's last\).*docs/pi\.md#boards"),
    "bullseye": ("3 9", "glibc 2.31", r"Host agent-a: \S+ is Python 3\.9 on glibc 2\.31, and SenseShield needs"),
    "no-python": (None, None, r"Host agent-a: \S+/no-such-python does not run, and SenseShield needs Python 3\.10"),
}


@pytest.mark.parametrize("case", [*BAD_INVENTORIES, "missing-ca", *OLD_HOSTS])
def test_bad_input_fails_early_naming_the_host_and_the_variable(tmp_path, case):
    root = tmp_path / "fleet"
    extra: list[str] = []
    inventories = ("inventory/sandbox",)
    if case == "missing-ca":
        extra = ["-e", "senseshield_ca_create=false", "-e", f"senseshield_ca_cert={tmp_path}/no-such-ca.crt"]
        expected = rf"Host [\w-]+: senseshield_ca_cert '{re.escape(str(tmp_path))}/no-such-ca.crt' does not exist"
    elif case in OLD_HOSTS:  # agent-a's interpreter reports an old Python and glibc (or is missing)
        version, glibc, expected = OLD_HOSTS[case]
        python = tmp_path / ("python3" if version else "no-such-python")
        if version:
            python.write_text(f"#!/bin/sh\nprintf '%s\\n' '{version}' '{glibc}'\n")
            python.chmod(0o755)
        (tmp_path / "extra.yml").write_text(f"all:\n  hosts:\n    agent-a: {{senseshield_python: {python}}}\n")
        inventories = ("inventory/sandbox", str(tmp_path / "extra.yml"))
    else:
        text, expected = BAD_INVENTORIES[case]
        (tmp_path / "extra.yml").write_text(text)
        inventories = ("inventory/sandbox", str(tmp_path / "extra.yml"))
    proc = playbook(root, *extra, inventories=inventories, port=free_port())
    out = re.sub(r"\s+", " ", proc.stdout + proc.stderr)
    assert proc.returncode != 0
    assert re.search(expected, out), out[-3000:]
    assert not root.exists(), "the play changed something before failing"  # no PKI, no host directory


def test_client_side_tls_mistakes_are_one_sentence(tmp_path):
    assert parse_broker("mqtts://broker.lab") == ("broker.lab", 8883)
    assert parse_broker("mqtts://10.0.0.2:8884") == ("10.0.0.2", 8884)
    with pytest.raises(ConfigError, match="uses TLS but no CA file"):
        check_security("mqtts://broker.lab")
    with pytest.raises(ConfigError, match="does not exist"):
        check_security("mqtts://broker.lab", ca_file=tmp_path / "ca.crt")
    with pytest.raises(ConfigError, match="not a TLS URL"):
        check_security("mqtt://broker.lab", ca_file=__file__)
    with pytest.raises(ConfigError, match="without a username"):
        check_security("mqtt://broker.lab", password="x")
    (tmp_path / "bad.crt").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM CA certificate"):
        Link("mqtts://broker.lab", client_id="x", fleet="f", on_frame=lambda t, f: None, ca_file=tmp_path / "bad.crt")
    # the CLI: exit 2 and one sentence, before any connection
    from typer.testing import CliRunner

    from edge_agent.cli import app

    (tmp_path / "empty").write_text("")
    for args, sentence in [
        (["--broker", "mqtts://127.0.0.1:1"], "uses TLS but no CA file"),
        (["--broker", "mqtt://127.0.0.1:1", "--username", "a", "--password-file", str(tmp_path / "empty")], "is empty"),
        (["--broker", "mqtt://127.0.0.1:1", "--password-file", __file__], "needs --username"),
    ]:
        result = CliRunner().invoke(app, ["join", *args])
        assert result.exit_code == 2, result.output
        assert sentence in " ".join(result.output.split()), result.output
