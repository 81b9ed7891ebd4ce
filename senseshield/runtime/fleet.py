"""``senseshield fleet up``: a whole fleet on this machine, every role its own OS process.

The launcher starts (1) an embedded MQTT broker in this process unless ``--broker`` names
one, (2) ``keyserver serve``, (3) ``coordinator serve --out DIR`` and (4) N ``edge-agent
join`` processes, each with shard i/N of the dataset and its own device profile (written
to ``DIR/profiles/<id>.yaml``: bandwidth and CPU speed, cycled within each category as the
simulator does). It watches the fleet over MQTT as a read-only observer for the progress
bar, waits for the coordinator to write ``DIR/report.json``, then stops everything.
Each process logs to ``DIR/logs/<role>.log``.

Hooks for launchers built on this one (``senseshield trial run``): ``FleetOptions.wrap``
rewrites a process's command line before it starts (e.g. to run an agent inside a cgroup
and a network namespace), ``agent_profiles`` gives agents their own profile files, and
``broker_host`` is the address the embedded broker listens on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from senseshield import defaults
from senseshield.data import load_dataset
from senseshield.device_noise import DEVELOPMENT_ENV
from senseshield.errors import STORAGE_EXIT, ConfigError, StorageError
from senseshield.data.shards import device_shards, shards
from senseshield.job import Job, check_job, with_shape
from senseshield.runtime.files import write_atomic
from senseshield.runtime.identity import Identity, Trust, check_frame
from senseshield.runtime.jobsig import sign_job
from senseshield.runtime.keyfiles import secure_dir
from senseshield.runtime.sites import SITE_PREFIX
from senseshield.runtime.service import writable_dir

Progress = Callable[[str, int, int], None]


@dataclass
class FleetOptions:
    agents: int
    out: Path
    broker: str | None = None  # None: embedded broker
    fleet: str = defaults.FLEET
    round_deadline: float | None = None  # None: the job's
    join_timeout: float = 300.0
    min_contributors: int = defaults.MIN_CONTRIBUTORS
    # threads per agent for inference and encryption (training: the job's train_threads);
    # None: the machine's cores shared among the agents (defaults.shared_threads)
    threads: int | None = None
    log_level: str = "info"
    extra_agent_args: dict[str, list[str]] = field(default_factory=dict)  # agent id -> more flags
    extra_coordinator_args: list[str] = field(default_factory=list)
    extra_keyserver_args: list[str] = field(default_factory=list)
    # hooks: (process name, argv) -> argv to run instead ("keyserver", "coordinator", agent ids)
    wrap: Callable[[str, list[str]], list[str]] | None = None
    agent_profiles: dict[str, Path] | None = None  # agent id -> profile file (default: generated)
    broker_host: str = "127.0.0.1"  # where the embedded broker listens (and clients connect)
    data: list[Path | None] | None = None  # agent i's own data file data[i] (None: shard i/N)
    serve: bool = False  # long-running: no job at start (submit with JobClient); agents stay between jobs
    # test only: the agents replay their privacy noise from this seed (development mode), so the
    # fleet ends with the model of run_simulation(config, noise_seed=...); None: secret noise
    noise_seed: int | None = None
    # sites: name -> the indexes of the agents there; each site gets a Mosquitto bridged to the
    # fleet's broker (then a Mosquitto too) and a site aggregator; the other agents use the hub's
    sites: dict[str, list[int]] = field(default_factory=dict)


def _python(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def agent_ids(n: int) -> list[str]:
    """``c000``, ``c001``, ...: the simulator's client ids, so reports line up."""
    return [f"c{i:03d}" for i in range(n)]


def job_file(config: Job, options: "FleetOptions", path: Path, operator: Identity) -> Path:
    """Write the job ``coordinator serve --job`` runs, signed by ``operator`` (``path``, as
    ``senseshield job sign`` writes it; a readable copy beside it, ``.yaml``): ``config`` for
    ``options.agents`` devices (its ``min_devices``), the fleet's round deadline, and the
    model's input shape and classes (from the built-in dataset unless the job gives them)."""
    deadline = options.round_deadline if options.round_deadline is not None else config.round_deadline
    job = with_shape(config.model_copy(update={
        "clients": options.agents, "min_devices": options.agents, "round_deadline": deadline,
    }))
    # the job is no secret: the coordinator forwards the signed frame to the key server and the agents
    write_atomic(path.with_suffix(".yaml"), yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), mode=0o644)
    return write_atomic(path, sign_job(job, operator, fleet=options.fleet), mode=0o644)


class Fleet:
    """The processes of one local fleet; use as a context manager so they always stop."""

    def __init__(self, config: Job, options: FleetOptions, progress: Progress | None = None) -> None:
        if options.agents < 1:
            raise ConfigError(f"--agents {options.agents} is not allowed; a fleet needs at least 1 agent.")
        if options.data is not None and len(options.data) != options.agents:
            raise ConfigError(f"--data gives {len(options.data)} file(s) for {options.agents} agents; give one per agent.")
        if options.round_deadline is not None and not options.round_deadline > 0:
            raise ConfigError(f"--round-deadline {options.round_deadline:g} is not allowed; give the seconds a round "
                              f"waits for updates, more than 0 (or leave it out: the job's, {config.round_deadline:g} s).")
        self.config = config.model_copy(update={"clients": options.agents})
        if not options.serve:  # the job's model, built as the coordinator will, before any process starts
            check_job(with_shape(self.config))
        self.options = options
        self.threads = options.threads or defaults.shared_threads(options.agents)
        self.progress = progress
        self.out = writable_dir(options.out, "--out")
        self.broker = None
        self.url = options.broker
        self.mqtt = "5"
        self.processes: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.observer = None
        self.hub = None  # the fleet's own Mosquitto (sites without --broker)
        self.site_brokers: dict = {}  # site -> its MosquittoProcess
        self.agent_broker: dict[int, str] = {}  # agent index -> its site's broker (default: the hub's)
        self.started = time.time()

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(grace=15.0 if exc_type is None else 0.0)  # interrupted: do not wait for agents

    def start(self) -> None:
        (self.out / "logs").mkdir(exist_ok=True)
        for stale in (self.out / "report.json", self.out / "state"):
            if stale.is_file():
                stale.unlink()
            elif stale.is_dir():
                shutil.rmtree(stale)
        if self.url is None and self.options.sites:  # a Mosquitto hub: the sites' Mosquittos bridge to it
            from senseshield.runtime.broker import MosquittoProcess

            self.hub = MosquittoProcess(self.out / "broker", self.options.broker_host).start()
            self.url = self.hub.url
        if self.url is None:
            from senseshield.runtime.broker import EmbeddedBroker

            import logging

            # amqtt logs every probe and disconnect at ERROR; the fleet's own logs say what matters
            logging.getLogger("amqtt").setLevel(logging.CRITICAL)
            self.broker = EmbeddedBroker(host=self.options.broker_host).start()
            self.url, self.mqtt = self.broker.url, EmbeddedBroker.protocol
        self._make_identities()
        self._start_observer()  # first: an unreachable broker stops the launch before any process
        common = ["--broker", self.url, "--fleet", self.options.fleet, "--mqtt", self.mqtt,
                  "--log-level", self.options.log_level, "--trust", str(self.trust_file)]
        self._spawn("keyserver", [*_python("keyserver.cli"), "serve", *common, "--key-dir", str(self.out / "keys"),
                                  "--identity", str(self.identity_file("keyserver")),
                                  "--min-contributors", str(self.options.min_contributors),
                                  # the local fleet runs the job's own k (a job file may ask for the papers' 1)
                                  "--min-encryptors", str(self.config.options.min_encryptors),
                                  # a local fleet's operator runs the coordinator too: CKKS jobs are
                                  # decrypted (a key server started by hand refuses them)
                                  "--allow-unverifiable",
                                  *self.options.extra_keyserver_args])
        once = [] if self.options.serve else [
            "--job", str(job_file(self.config, self.options, self.out / "job.signed", self.identities["operator"][0])),
            "--once",
            "--join-timeout", str(self.options.join_timeout)]
        self._spawn("coordinator", [
            *_python("coordinator.cli"), "serve", *common, *once, "--out", str(self.out),
            "--state-dir", str(self.out / "state"), "--identity", str(self.identity_file("coordinator")),
            *self.options.extra_coordinator_args,
        ])
        self.common = common
        self._start_sites()
        self.profiles = self._profiles()
        for i in range(self.options.agents):
            self.spawn_agent(i)

    def _start_sites(self) -> None:
        """Each site's Mosquitto, bridged to the hub's broker, and its aggregator."""
        from senseshield.runtime.broker import MosquittoProcess
        from senseshield.runtime.sites import mosquitto_bridge, site_name
        from senseshield.runtime.transport import PREFIX, parse_broker

        self.agent_broker: dict[int, str] = {}
        host, port = parse_broker(self.url)
        for site, members in self.options.sites.items():
            try:
                site_name(site)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            bridge = mosquitto_bridge(hub_host=host, hub_port=port, fleet=self.options.fleet, site=site, prefix=PREFIX)
            broker = MosquittoProcess(self.out / "sites" / site, self.options.broker_host, extra=bridge).start()
            self.site_brokers[site] = broker
            self._spawn(f"{SITE_PREFIX}{site}", [
                *_python("coordinator.cli"), "serve", "--site", site, *self._common(broker.url),
                "--identity", str(self.identity_file(f"{SITE_PREFIX}{site}"))])
            for i in members:
                if not 0 <= i < self.options.agents:
                    raise ConfigError(f"Site {site!r} lists agent {i}; the fleet has agents 0..{self.options.agents - 1}.")
                self.agent_broker[i] = broker.url

    def _common(self, broker: str) -> list[str]:
        """The flags every process of the fleet shares, on ``broker``."""
        return ["--broker", broker, *self.common[2:]]

    def spawn_agent(self, i: int) -> str:
        """Start agent ``i`` (again): shard i/N or data file i, its profile, its model folder."""
        agent, data = agent_ids(self.options.agents)[i], self.options.data or [None] * self.options.agents
        sharded = [j for j, d in enumerate(data) if d is None]  # the agents that share the built-in dataset
        own = data[i]
        source = (["--data", str(own), "--index", str(i)] if own is not None
                  else ["--shard", f"{sharded.index(i)}/{len(sharded)}"])
        self._spawn(agent, [
            *_python("edge_agent.cli"), "join", *self._common(self.agent_broker.get(i, self.url)), "--agent-id", agent, "--profile", str(self.profiles[i]),
            *source, "--threads", str(self.threads), *([] if self.options.serve else ["--once"]),
            *([] if self.options.noise_seed is None else ["--dev-noise-seed", str(self.options.noise_seed)]),
            # the operator's one job on its own agents: a plaintext run (a trial's baseline) is
            # taken despite the profiles' floors (a long-running fleet's agents still decline)
            *(["--allow-plaintext"] if not self.options.serve and self._plaintext_job() else []),
            "--model-dir", str(self.out / "agents" / agent), "--identity", str(self.identity_file(agent)),
            *self.options.extra_agent_args.get(agent, []),
        ])
        return agent

    def _plaintext_job(self) -> bool:
        from senseshield.job import effective_scheme
        from senseshield.strategies import build_strategy

        return effective_scheme(self.config, build_strategy(self.config.strategy, self.config.options)) is None

    def identity_file(self, name: str) -> Path:
        return self.out / "identities" / f"{name}.key"

    def _make_identities(self) -> None:
        """One identity per process (and one for the operator who submits jobs), and the
        fleet's trust file pinning their public keys: ``OUT/identities/``, ``OUT/trust.json``."""
        names = {"keyserver": "keyserver", "coordinator": "coordinator", "operator": "operator",
                 **{f"{SITE_PREFIX}{site}": "site" for site in self.options.sites},
                 **{a: "agent" for a in agent_ids(self.options.agents)}}
        secure_dir(self.identity_file("operator").parent, "--identity")  # once, not once per identity
        self.identities = {n: (Identity.load_or_create(n, self.identity_file(n), checked=True), role)
                           for n, role in names.items()}
        self.trust = Trust.for_identities(self.identities, fleet=self.options.fleet)
        # numbered and signed by the fleet's operator, as services require (docs/security.md)
        self.trust.sign(self.identities["operator"][0], serial=Trust.next_serial(self.out / "trust.json", self.options.fleet))
        self.trust_file = self.trust.save(self.out / "trust.json")

    @property
    def operator_args(self) -> list[str]:
        """The flags of `senseshield job ...` for this fleet's operator identity and trust."""
        return ["--identity", str(self.identity_file("operator")), "--trust", str(self.trust_file)]

    def job_client(self, **kwargs):  # noqa: ANN003, ANN201
        """A :class:`~senseshield.runtime.jobs.JobClient` speaking as this fleet's operator."""
        from senseshield.runtime.jobs import JobClient

        return JobClient(self.url, fleet=self.options.fleet, protocol=self.mqtt, identity=self.identities["operator"][0],
                         trust=self.trust, **kwargs)

    def _profiles(self) -> list[Path]:
        """One profile file per agent with the simulator's bandwidth and CPU speed for it
        (or the files of ``options.agent_profiles``)."""
        if self.options.data and all(d is not None for d in self.options.data):
            clients = device_shards(self.config, [None] * self.options.agents)
        else:
            clients = shards(self.config, load_dataset(self.config.dataset, seed=self.config.seed))
        self.categories = {c.id: c.category for c in clients}
        given = self.options.agent_profiles
        if given is not None:
            missing = [a for a in agent_ids(self.options.agents) if a not in given]
            if missing:
                raise ConfigError(f"No profile file for agent(s) {', '.join(missing)}.")
            return [Path(given[a]) for a in agent_ids(self.options.agents)]
        folder = self.out / "profiles"
        folder.mkdir(exist_ok=True)
        paths = []
        for client in clients:
            path = folder / f"{client.id}.yaml"
            path.write_text(yaml.safe_dump({"bandwidth": client.bandwidth, "cpu_speed": client.cpu_speed,
                                            "board": "emulated (fleet up)"}))
            paths.append(path)
        self.categories = {c.id: c.category for c in clients}
        return paths

    def restart(self, name: str) -> None:
        """SIGKILL a process and start it again with the same command line (fault tests)."""
        proc = self.processes[name]
        proc.kill()
        proc.wait()
        self._spawn(name, self.argv[name])

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        if self.options.wrap is not None:
            argv = self.options.wrap(name, list(argv))
        log = (self.out / "logs" / f"{name}.log").open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads))
        if self.options.noise_seed is not None:
            env[DEVELOPMENT_ENV] = "1"  # the agents accept --dev-noise-seed only in development mode
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def _start_observer(self) -> None:
        """A read-only MQTT client that counts finished cluster rounds for the progress bar."""
        from senseshield.runtime.protocol.messages import AggregateResult, Decline, Hello, from_frame
        from senseshield.runtime.transport import Link

        self.seen = {"agents": set(), "rounds": set(), "declined": {}}

        def on_frame(topic: str, frame) -> None:  # noqa: ANN001
            check_frame(self.trust, frame)
            msg = from_frame(frame)
            if isinstance(msg, Hello):
                self.seen["agents"].add(msg.agent_id)
            elif isinstance(msg, AggregateResult):
                self.seen["rounds"].add(frame.round)
            elif (isinstance(msg, Decline) and msg.selected and topic.endswith(f"agents/{frame.sender}/decline")
                  and frame.sender not in self.seen["agents"]):  # one that said hello takes part (as the coordinator rules)
                self.seen["declined"].setdefault(frame.sender, msg.reason)

        self.observer = Link(self.url, client_id="fleet-up-observer", fleet=self.options.fleet,
                             on_frame=on_frame, protocol=self.mqtt)
        self.observer.subscribe("agents/+/hello")
        self.observer.subscribe("agents/+/decline")
        self.observer.subscribe("keyserver/results")
        try:
            self.observer.start(timeout=5.0)
        except ConnectionError:
            self.observer = None
            raise ConfigError(f"Broker {self.url} did not accept a connection within 5 s; start it, or leave out "
                              "--broker to use the embedded broker.") from None

    def wait(self, timeout: float | None = None) -> dict:
        """Wait for the coordinator to finish; returns the report (ConfigError if the coordinator
        failed; a job that failed is a report whose ``state`` is ``failed``, with its ``reason``)."""
        coordinator = self.processes["coordinator"]
        end = None if timeout is None else time.monotonic() + timeout
        while coordinator.poll() is None:
            if end is not None and time.monotonic() > end:
                raise ConfigError(f"The fleet did not finish within {timeout:g} s; see {self.out / 'logs'}.")
            declined = sorted(self.seen["declined"].items())
            if declined and not self.options.serve:  # the job waits for every agent: it would never start
                name, reason = declined[0]
                raise ConfigError(f"Agent {name} declined the job, and fleet up waits for all {self.options.agents} "
                                  f"agents it starts: {reason.rstrip('.')}; fix or leave out that device's data.")
            agents = {n: p for n, p in self.processes.items() if n.startswith("c")}
            if agents and all(p.poll() not in (None, 0) for p in agents.values()):
                name = sorted(agents)[0]
                tail = (self.out / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()[-2:]
                raise ConfigError(f"Every agent exited before the job ended ({name}: exit {agents[name].returncode}: "
                                  f"{' / '.join(tail)}); see {self.out / 'logs'}.")
            if self.progress:
                self.progress("join", len(self.seen["agents"]), self.options.agents)
                self.progress("round", max(self.seen["rounds"], default=0), self.config.rounds)
            time.sleep(0.2)
        if self.progress:
            self.progress("round", max(self.seen["rounds"], default=0), self.config.rounds)
        report = self.out / "report.json"
        if coordinator.returncode == STORAGE_EXIT:  # it could not write --out or --state-dir: its last line says which
            log = (self.out / "logs" / "coordinator.log").read_text(errors="replace")
            said = [line for line in log.splitlines() if "Cannot write" in line][-1:] or ["Cannot write its files"]
            sentence = said[0][said[0].index("Cannot write"):].split("; the coordinator stopped")[0]
            raise StorageError(f"The coordinator stopped: {sentence}")
        failed = coordinator.returncode == 1 and report.exists()  # the job failed: its report says why
        if (coordinator.returncode != 0 and not failed) or not report.exists():
            tail = (self.out / "logs" / "coordinator.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise ConfigError(f"The coordinator failed (exit {coordinator.returncode}): {' / '.join(tail)}")
        data = json.loads(report.read_text())
        self._augment(data)
        write_atomic(report, json.dumps(data, indent=2), mode=0o644)
        return data

    def _augment(self, data: dict) -> None:
        """What only the launcher knows: planted categories (ARI) and the processes' exits."""
        from sklearn.metrics import adjusted_rand_score

        for client in data["clients"]:
            client["category"] = self.categories.get(client["id"])
        cats = [c["category"] for c in data["clients"]]
        if cats and all(c is not None for c in cats):
            data["cluster_ari"] = float(adjusted_rand_score(cats, [c["cluster"] for c in data["clients"]]))
        data["broker"] = "embedded (amqtt, MQTT 3.1.1)" if self.broker is not None else self.url

    def stop(self, grace: float = 15.0, term_timeout: float = 120.0) -> dict[str, int | None]:
        """Agents exit by themselves when the run is done (``grace`` s for that); anything left
        gets SIGTERM and is waited for, SIGKILL only for one still running after
        ``term_timeout`` s (a hang: a service exits within about 2 s of SIGTERM, later on a
        busy machine, and a stop that kills it would make its exit code a matter of speed)."""
        end = time.monotonic() + grace
        for name, proc in self.processes.items():
            if name.startswith("c") and not self.options.serve:  # long-running agents never exit by themselves
                try:
                    proc.wait(max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + term_timeout
        for proc in self.processes.values():
            try:
                proc.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.observer is not None:
            self.observer.stop()
            self.observer = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        for broker in [*self.site_brokers.values(), *([self.hub] if self.hub is not None else [])]:
            broker.stop()
        self.site_brokers, self.hub = {}, None
        self.exit_codes = {name: proc.returncode for name, proc in self.processes.items()}
        return self.exit_codes

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault tests)."""
        self.processes[name].kill()


def data_label(files: list) -> str:
    """How a run on per-device files is titled: ``a.csv, b.csv`` (or ``a.csv ... f.csv (6 files)``)."""
    names = [Path(f).name for f in files]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} files)"


def fleet_up(config: Job, options: FleetOptions, progress: Progress | None = None,
             timeout: float | None = None) -> dict:
    """Start a local fleet, run ``config`` on it, stop it; returns the report."""
    with Fleet(config, options, progress) as fleet:
        fleet.start()
        report = fleet.wait(timeout)
    report["exit_codes"] = fleet.stop()
    if options.data and all(d is not None for d in options.data):  # the devices' own data, not the job's dataset
        report["dataset"], report["partition"] = data_label(options.data), "devices"
    write_atomic(Path(options.out) / "report.json", json.dumps(report, indent=2), mode=0o644)
    return report
