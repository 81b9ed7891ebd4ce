"""``senseshield trial run TRIAL.yaml --out DIR``: field trials of emulated devices on one machine.

A trial file (:class:`TrialSpec`) lists the fleet (device-class profiles from ``profiles/``
and how many of each, optionally with overridden CPU share, bandwidth or latency), the runs
(strategies, with their options and budget mode) to run in turn on the same fleet and data,
the rounds and the round deadline. The trial:

1. probes what this machine allows (:func:`probe`): on Linux as root, a cgroup CPU limit per
   agent (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``, whichever the cpu controller is
   mounted as) and a network namespace per agent, joined by a veth pair to a bridge on the
   host where the broker listens, with ``tc`` shaping each direction (``netem`` delay and
   rate where the kernel has it, else ``tbf`` rate only: latency is then not emulated). It
   says at the start what it could not do and runs those parts unconfined;
2. starts the broker (Mosquitto when installed, else the embedded one; or ``--broker URL``),
   then for every run a key server, a coordinator and the agents as OS processes through
   :class:`senseshield.runtime.fleet.Fleet` (its ``wrap`` hook puts each agent into its cgroup and
   namespace), and waits for the report;
3. removes everything it created (namespaces, links, the bridge, cgroups, processes) on exit,
   Ctrl-C and SIGTERM included. :func:`cleanup_stale` removes what a killed trial left
   (``senseshield trial cleanup``).

CPU shares are fractions of one core of this machine; a fleet whose shares add up to more
than ``cpu_budget`` cores is slowed down uniformly (``scale``: CPU shares and bandwidths
times ``scale``, latencies divided by it), so every device keeps its relative speed and
the agents do not fight over the cores. Agent-side seconds of the trial are then 1/scale
times a real fleet's.

Output: ``DIR/<run label>/`` (the run's report.json, logs/, models/, and report.html),
``DIR/profiles/`` (each agent's emulated profile), ``DIR/trial.json`` (the comparison) and,
after :func:`senseshield.trials.report.render_trial`, ``DIR/report.html``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from senseshield.profiles import DeviceProfile, load_declared
from senseshield.runtime.broker import MosquittoProcess, mosquitto_binary
from senseshield.errors import ConfigError

log = logging.getLogger("senseshield.trials.trial")

Say = Callable[[str], None]
Progress = Callable[[str, str, int, int], None]  # run label, phase, done, total

TAG_PREFIX = "sst"  # every link, namespace and cgroup a trial creates starts with this
CGROUP_PREFIX = "senseshield-trial-"
SUBNET_PREFIX = "10.213"  # 10.213.X.0/24 per trial, X free on this host
CPU_PERIOD_US = 10_000
"""CFS bandwidth period. The default 100 ms lets a 0.16-share device run a 16 ms burst at full
speed, so short phases (training a small model, a mask solve) would not be slowed at all;
with 10 ms a burst is under 2 ms. Shares below 0.1 get a longer period (the quota floor is 1 ms)."""
TRIAL_SUBDIR = "trials"


PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"  # the repository's device classes

# ---- profiles and trial files ---------------------------------------------------------------


class DeviceClass(DeviceProfile):
    """A device-class profile of ``profiles/``: a :class:`DeviceProfile` whose emulation and
    training fields are all given (what ``senseshield trial run`` needs to emulate it)."""

    cores: int = Field(ge=1)
    clock_mhz: float = Field(gt=0)
    memory_mb: int = Field(ge=1)
    cpu_share: float = Field(gt=0, le=64)
    latency_ms: float = Field(ge=0, le=10_000)
    local_epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1)


def device_class_files(folder: Path | None = None) -> list[Path]:
    """The device-class YAML files of the repository's ``profiles/`` (not its subfolders)."""
    folder = folder or PROFILES_DIR
    return sorted(p for p in folder.glob("*.yaml") if p.stem != "sensecrypt-system-heterogeneity")


def load_device_class(path: Path) -> DeviceClass:
    """Validate one ``profiles/`` file as a :class:`DeviceClass`; ConfigError names the problem."""
    data = yaml.safe_load(Path(path).read_text())
    try:
        return DeviceClass.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the profile"
        raise ConfigError(f"Device class {str(path)!r}: {where} {first.get('msg', 'is not allowed').lower()}.") from None


class FleetEntry(BaseModel):
    """Devices of one class in a trial: ``count`` agents with ``profile`` (NAME or FILE),
    optionally overriding what the profile says."""

    model_config = ConfigDict(extra="forbid")

    profile: str
    count: int = Field(1, ge=1, le=200)
    cpu_share: Optional[float] = Field(None, gt=0, le=64)
    bandwidth: Optional[float] = Field(None, gt=0)
    latency_ms: Optional[float] = Field(None, ge=0, le=10_000)
    cpu_speed: Optional[float] = Field(None, gt=0)
    board: Optional[str] = None  # a label for these devices in reports


class RunSpec(BaseModel):
    """One run of a trial: a strategy with its options (``set``) and budget mode."""

    model_config = ConfigDict(extra="forbid")

    strategy: str
    label: Optional[str] = None
    budget_mode: Optional[str] = None
    scheme: Optional[str] = None
    set: dict[str, Any] = {}

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.strategy + (f"-{self.budget_mode}" if self.budget_mode else "")


class TrialSpec(BaseModel):
    """A trial file (YAML). See ``profiles/trials/`` and ``docs/trials.md``."""

    model_config = ConfigDict(extra="forbid")

    name: str = "trial"
    description: str = ""
    fleet: list[FleetEntry] = Field(min_length=1)
    runs: list[Union[RunSpec, str]] = Field(min_length=1)
    rounds: int = Field(4, ge=1, le=1000)
    deadline: float = Field(120.0, gt=0, description="Round deadline in seconds.")
    join_timeout: float = Field(300.0, gt=0)
    dataset: str = "digits"
    model: str = "mlp"
    partition: str = "iid"
    seed: int = 0
    local_epochs: Optional[int] = Field(None, ge=1)
    batch_size: Optional[int] = Field(None, ge=1)
    lr: float = Field(0.1, gt=0)
    key_bits: int = Field(2048, ge=256)
    scheme: Optional[str] = None
    threads: int = Field(1, ge=1, description="Torch threads per agent.")
    min_contributors: int = Field(2, ge=1)
    broker: str = Field("auto", description="auto | embedded | mosquitto | mqtt://HOST:PORT")
    cpu_budget: float = Field(1.4, gt=0, description="Cores all agents may use together.")
    cpu_weight: float = Field(8.0, ge=1, le=100, description=(
        "CPU weight of the trial's processes relative to a normal process, so background load "
        "does not eat into the emulated devices' shares (the agents stay capped by their quotas)."))
    scale: Union[float, str] = Field("auto", description="auto, or the time scale (0, 1].")

    @field_validator("runs")
    @classmethod
    def _runs(cls, runs: list) -> list[RunSpec]:
        out = [RunSpec(strategy=r) if isinstance(r, str) else r for r in runs]
        names = [r.name for r in out]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"Run label {twice[0]!r} is used twice; give the runs distinct labels.")
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
                raise ConfigError(f"Run label {name!r} is not allowed; use letters, digits, '.', '_' or '-'.")
        return out

    @field_validator("scale")
    @classmethod
    def _scale(cls, value: Union[float, str]) -> Union[float, str]:
        if value == "auto":
            return value
        if isinstance(value, str) or not (0 < float(value) <= 1):
            raise ConfigError(f"scale={value!r} is not allowed; use auto or a number in (0, 1].")
        return float(value)

    @model_validator(mode="after")
    def _size(self) -> "TrialSpec":
        if sum(e.count for e in self.fleet) < 2 and self.min_contributors > 1:
            raise ConfigError("A trial fleet needs at least 2 agents (or min_contributors: 1).")
        return self

    @property
    def run_specs(self) -> list[RunSpec]:
        return [r if isinstance(r, RunSpec) else RunSpec(strategy=r) for r in self.runs]


def load_trial(path: Path | str) -> TrialSpec:
    """Read and validate a trial file; mistakes raise one-sentence :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        candidate = PROFILES_DIR / TRIAL_SUBDIR / f"{path.name}.yaml"
        if path.suffix == "" and candidate.is_file():
            path = candidate
        else:
            raise ConfigError(f"Trial file {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"Trial file {str(path)!r} is not valid YAML ({exc.__class__.__name__}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Trial file {str(path)!r} must be a mapping with at least 'fleet' and 'runs'.")
    try:
        return TrialSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            raise ConfigError(f"Trial file {str(path)!r}: {cause}") from None
        where = ".".join(str(p) for p in first.get("loc", ())) or "the file"
        msg = first.get("msg", "is not allowed").removeprefix("Value error, ").rstrip(".")
        raise ConfigError(f"Trial file {str(path)!r} has {where}={first.get('input')!r}, which is not allowed: "
                          f"{msg[:1].lower() + msg[1:]}.") from None


@dataclass
class AgentPlan:
    """One emulated device of a trial."""

    agent_id: str
    device: str  # profile name (or file)
    profile: DeviceProfile  # as announced (bandwidth scaled to the emulated link)
    cpu_share: float | None  # cores, after scaling (None: not limited)
    bandwidth: float  # MB/s of the emulated link
    latency_ms: float


def plan_agents(spec: TrialSpec) -> tuple[list[AgentPlan], float]:
    """The trial's agents (ids c000, c001, ... in fleet order) and the time scale."""
    from senseshield.runtime.fleet import agent_ids

    entries = []
    for entry in spec.fleet:
        base = load_declared(entry.profile)
        entries.extend([(entry, base)] * entry.count)
    shares = [e.cpu_share if e.cpu_share is not None else b.cpu_share for e, b in entries]
    if spec.scale == "auto":
        known = [s for s in shares if s is not None]
        scale = min(1.0, spec.cpu_budget / sum(known)) if known else 1.0
    else:
        scale = float(spec.scale)
    plans = []
    for agent_id, ((entry, base), share) in zip(agent_ids(len(entries)), zip(entries, shares)):
        bandwidth = (entry.bandwidth if entry.bandwidth is not None else base.bandwidth) * scale
        latency = (entry.latency_ms if entry.latency_ms is not None else (base.latency_ms or 0.0)) / scale
        update = {"bandwidth": bandwidth, "latency_ms": latency,
                  "cpu_share": None if share is None else share * scale}
        if entry.cpu_speed is not None:
            update["cpu_speed"] = entry.cpu_speed
        if entry.board is not None:
            update["board"] = entry.board
        profile = base.model_copy(update=update)
        plans.append(AgentPlan(agent_id, entry.profile, profile, update["cpu_share"], bandwidth, latency))
    return plans, scale


def training_defaults(spec: TrialSpec, plans: list[AgentPlan]) -> tuple[int, int]:
    """local_epochs and batch_size: the trial's, else the profiles' when they agree."""
    out = []
    for name, value, default in (("local_epochs", spec.local_epochs, 2), ("batch_size", spec.batch_size, 16)):
        if value is not None:
            out.append(value)
            continue
        found = {getattr(p.profile, name) for p in plans} - {None}
        if len(found) > 1:
            raise ConfigError(
                f"The fleet's profiles disagree on {name} ({', '.join(map(str, sorted(found)))}); "
                f"set {name} in the trial file."
            )
        out.append(found.pop() if found else default)
    return out[0], out[1]


# ---- what this machine allows ---------------------------------------------------------------


@dataclass
class Capabilities:
    """What :func:`probe` found; ``notes`` say what runs unconfined and why."""

    cgroup: str | None = None  # "v2" | "v1" | None
    cgroup_root: Path | None = None  # where the trial's cgroup goes
    netns: bool = False
    qdisc: str | None = None  # "netem" | "tbf" | None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        cpu = f"cgroup {self.cgroup} CPU limits ({self.cgroup_root})" if self.cgroup else "no CPU limits"
        if self.netns:
            net = "network namespaces + veth + bridge, " + {
                "netem": "tc netem (bandwidth and latency)",
                "tbf": "tc tbf (bandwidth only: this kernel has no netem, latency is not emulated)",
            }.get(self.qdisc or "", "no tc shaping")
        else:
            net = "no network emulation"
        return f"emulation: {cpu}; {net}"

    def as_dict(self) -> dict:
        return {"cgroup": self.cgroup, "cgroup_root": str(self.cgroup_root) if self.cgroup_root else None,
                "netns": self.netns, "qdisc": self.qdisc, "notes": list(self.notes)}


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _cpu_cgroup_mount() -> tuple[str, Path] | None:
    """("v2", dir) when the unified hierarchy has the cpu controller, ("v1", dir) when a v1
    hierarchy has it, else None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    v1 = None
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        where, kind, opts = Path(parts[1]), parts[2], parts[3].split(",")
        if kind == "cgroup2":
            controllers = (where / "cgroup.controllers")
            if controllers.is_file() and "cpu" in controllers.read_text().split():
                return "v2", where
        elif kind == "cgroup" and "cpu" in opts and (where / "cpu.cfs_quota_us").is_file():
            v1 = ("v1", where)
    return v1


def probe(emulate: bool = True) -> Capabilities:
    """What emulation this machine allows: needs Linux, root, the cpu cgroup controller,
    ``ip`` (iproute2) with network namespaces, veth and bridges, and ``tc`` with tbf/netem."""
    caps = Capabilities()
    if not emulate:
        caps.notes.append("emulation switched off (--no-emulation): agents run unconfined")
        return caps
    if platform.system() != "Linux":
        caps.notes.append(f"emulation needs Linux (this is {platform.system()}): agents run unconfined")
        return caps
    if os.geteuid() != 0:
        caps.notes.append("emulation needs root (cgroups, network namespaces, tc): agents run unconfined")
        return caps
    found = _cpu_cgroup_mount()
    if found is None:
        caps.notes.append("no cpu cgroup controller is mounted: agents' CPU is not limited")
    else:
        caps.cgroup, caps.cgroup_root = found
    ip, tc = shutil.which("ip"), shutil.which("tc")
    if ip is None:
        caps.notes.append("`ip` (iproute2) is missing: no network namespaces, agents' links are not shaped")
        return caps
    tag = f"{TAG_PREFIX}{os.getpid()}p"
    ns = f"{TAG_PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}a"])
        _run(["ip", "link", "add", f"{tag}b", "type", "bridge"])
        caps.netns = True
        if tc is None:
            caps.notes.append("`tc` is missing: links are not shaped")
        else:
            for qdisc, args in (("netem", ["netem", "delay", "1ms", "rate", "1mbit"]),
                                ("tbf", ["tbf", "rate", "1mbit", "burst", "8kb", "limit", "64kb"])):
                if _run(["tc", "qdisc", "add", "dev", f"{tag}h", "root", *args], check=False).returncode == 0:
                    caps.qdisc = qdisc
                    break
            if caps.qdisc is None:
                caps.notes.append("tc has neither netem nor tbf here: links are not shaped")
            elif caps.qdisc == "tbf":
                caps.notes.append("this kernel has no sch_netem: bandwidth is shaped (tbf), latency is not emulated")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        caps.notes.append(f"network namespaces are not available ({exc}): agents' links are not shaped")
    finally:
        for args in (["ip", "link", "del", f"{tag}h"], ["ip", "link", "del", f"{tag}b"], ["ip", "netns", "del", ns]):
            _run(args, check=False)
    return caps


# ---- the emulation --------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> str:
    used = _run(["ip", "-4", "-o", "addr"], check=False).stdout
    for x in range(1, 255):
        prefix = f"{SUBNET_PREFIX}.{x}."
        if prefix not in used:
            return f"{SUBNET_PREFIX}.{x}"
    raise RuntimeError(f"no free {SUBNET_PREFIX}.X.0/24 subnet on this host")


class Emulation:
    """The cgroups, namespaces, links and qdiscs of one trial; :meth:`teardown` removes them.

    Names carry this process's pid (``sst<pid>br``, ``sst<pid>h<i>``, netns
    ``sst-<pid>-<agent>``, cgroup ``senseshield-trial-<pid>``) so :func:`cleanup_stale` can
    tell a dead trial's leftovers from a running one's.
    """

    def __init__(self, caps: Capabilities, say: Say | None = None, weight: float = 1.0) -> None:
        self.caps = caps
        self.weight = weight
        self.say = say or (lambda _msg: None)
        self.pid = os.getpid()
        self.bridge = f"{TAG_PREFIX}{self.pid}br"
        self.host_ip: str | None = None
        self.namespaces: dict[str, str] = {}  # agent id -> netns
        self.cgroups: dict[str, Path] = {}  # agent id -> cgroup dir
        self.links: list[str] = []
        self.cgroup_base: Path | None = None
        self.applied: dict[str, dict] = {}  # agent id -> what was applied (for the report)

    @property
    def broker_host(self) -> str:
        return self.host_ip or "127.0.0.1"

    def setup(self, agents: list[AgentPlan]) -> None:
        if self.caps.netns:
            self._network(agents)
        if self.caps.cgroup:
            self._cgroups(agents)
        for a in agents:
            self.applied.setdefault(a.agent_id, {})

    def _network(self, agents: list[AgentPlan]) -> None:
        subnet = _free_subnet()
        self.host_ip = f"{subnet}.1"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.links.append(self.bridge)
        _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, a in enumerate(agents):
            ns = f"{TAG_PREFIX}-{self.pid}-{a.agent_id}"
            host, peer = f"{TAG_PREFIX}{self.pid}h{i}", f"{TAG_PREFIX}{self.pid}a{i}"
            _run(["ip", "netns", "add", ns])
            self.namespaces[a.agent_id] = ns
            _run(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
            self.links.append(host)
            _run(["ip", "link", "set", peer, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", peer, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{subnet}.{10 + i}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", host, "master", self.bridge])
            _run(["ip", "link", "set", host, "up"])
            shaped = {"address": f"{subnet}.{10 + i}"}
            if self.caps.qdisc:
                qdisc = self._qdisc(a.bandwidth, a.latency_ms)
                _run(["tc", "qdisc", "add", "dev", host, "root", *qdisc])  # broker -> agent (download)
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *qdisc])  # upload
                shaped.update(qdisc=" ".join(qdisc), bandwidth_mbps=round(a.bandwidth, 4),
                              latency_ms=round(a.latency_ms, 3) if self.caps.qdisc == "netem" else None)
            self.applied.setdefault(a.agent_id, {}).update(shaped)

    def _qdisc(self, mbps: float, latency_ms: float) -> list[str]:
        rate_bps = max(int(mbps * 8e6), 8000)
        rate = f"{rate_bps}bit"
        if self.caps.qdisc == "netem":
            limit = max(1000, int(rate_bps / 8 / 1000))  # packets: ~1 s of queue
            return ["netem", "delay", f"{latency_ms:.3f}ms", "rate", rate, "limit", str(limit)]
        burst = max(int(rate_bps / 8 / 100), 8192)  # >= rate / HZ and a few MTUs
        limit = max(int(rate_bps / 8), 64 * 1024) + burst  # ~1 s of queue: TCP never sees tail drops
        return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]

    def _cgroups(self, agents: list[AgentPlan]) -> None:
        root = self.caps.cgroup_root
        assert root is not None
        base = root / f"{CGROUP_PREFIX}{self.pid}"
        base.mkdir(exist_ok=True)
        self.cgroup_base = base
        if self.caps.cgroup == "v2":
            (root / "cgroup.subtree_control").write_text("+cpu")
            (base / "cgroup.subtree_control").write_text("+cpu")
            (base / "cpu.weight").write_text(str(int(min(max(100 * self.weight, 1), 10000))))
        else:
            (base / "cpu.shares").write_text(str(int(1024 * self.weight)))
        server = base / "server"  # key server and coordinator: weighted, not limited
        server.mkdir(exist_ok=True)
        self.cgroups["keyserver"] = self.cgroups["coordinator"] = server
        for a in agents:
            if a.cpu_share is None:
                continue
            path = base / a.agent_id
            path.mkdir(exist_ok=True)
            quota, period = set_cpu_quota(path, self.caps.cgroup, a.cpu_share)
            self.cgroups[a.agent_id] = path
            self.applied.setdefault(a.agent_id, {}).update(cpu_quota=f"{quota}/{period} us",
                                                            cpu_share=round(a.cpu_share, 4))

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """:class:`Fleet` hook: an agent's command, run inside its cgroup and namespace."""
        out = list(argv)
        ns = self.namespaces.get(name)
        if ns is not None:
            out = ["ip", "netns", "exec", ns, *out]
        group = self.cgroups.get(name)
        return in_cgroup(group, out) if group is not None else out

    def teardown(self) -> list[str]:
        """Remove everything; returns what could not be removed (empty when clean)."""
        left = []
        for path in set(self.cgroups.values()):
            left += _remove_cgroup(path)
        if self.cgroup_base is not None:
            left += _remove_cgroup(self.cgroup_base)
        for ns in self.namespaces.values():
            _kill_netns_pids(ns)
            if _run(["ip", "netns", "del", ns], check=False).returncode != 0 and ns in _netns_list():
                left.append(f"netns {ns}")
        for link in self.links:
            if _run(["ip", "link", "del", link], check=False).returncode != 0 and link in _link_names():
                left.append(f"link {link}")
        self.cgroups, self.namespaces, self.links, self.cgroup_base = {}, {}, [], None
        return left


def set_cpu_quota(group: Path, version: str, share: float, *, period_us: int = CPU_PERIOD_US) -> tuple[int, int]:
    """Limit cgroup ``group`` (cgroup ``version`` "v1" or "v2") to ``share`` of one CPU: a
    quota per period of at least ``period_us`` (the trials' 10 ms; the kernel's default is
    100 ms; longer when the share is so small that the quota would fall below the kernel's
    1 ms minimum); returns (quota, period) in us."""
    period = max(period_us, int(1000 / share) + 1)
    quota = max(int(round(share * period)), 1000)
    if version == "v2":
        (group / "cpu.max").write_text(f"{quota} {period}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    return quota, period


def in_cgroup(group: Path, argv: list[str]) -> list[str]:
    """``argv`` run inside cgroup ``group``: the shell moves itself into the cgroup, then
    exec's (same pid: signals reach the program)."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]


def _kill_netns_pids(ns: str) -> None:
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _remove_cgroup(path: Path) -> list[str]:
    """rmdir a cgroup (children first), killing what is still inside."""
    if not path.is_dir():
        return []
    left = []
    for child in [p for p in path.iterdir() if p.is_dir()]:
        left += _remove_cgroup(child)
    for attempt in range(50):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            path.rmdir()
            return left
        except OSError:
            time.sleep(0.1)
    return left + [f"cgroup {path}"]


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout if shutil.which("ip") else ""
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout if shutil.which("ip") else ""
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def leftovers(pid: int | None = None) -> list[str]:
    """Trial resources present on this host (of trial ``pid``, or of any trial)."""
    want = r"\d+" if pid is None else str(pid)
    found = [f"netns {n}" for n in _netns_list() if re.fullmatch(rf"{TAG_PREFIX}-({want})-.+", n)]
    found += [f"link {n}" for n in _link_names() if re.fullmatch(rf"{TAG_PREFIX}({want})(br|h\d+|a\d+|[hab]|p[hab])", n)]
    mount = _cpu_cgroup_mount()
    if mount is not None:
        found += [f"cgroup {p}" for p in mount[1].glob(f"{CGROUP_PREFIX}*")
                  if re.fullmatch(rf"{CGROUP_PREFIX}({want})", p.name)]
    return found


def cleanup_stale(say: Say | None = None) -> list[str]:
    """Remove namespaces, links and cgroups of trials whose process is gone; returns them."""
    say = say or (lambda _msg: None)
    if platform.system() != "Linux" or os.geteuid() != 0:
        return []
    removed = []
    for item in leftovers():
        kind, name = item.split(" ", 1)
        match = re.search(r"(\d+)", Path(name).name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if kind == "netns":
            _kill_netns_pids(name)
            _run(["ip", "netns", "del", name], check=False)
        elif kind == "link":
            _run(["ip", "link", "del", name], check=False)
        else:
            _remove_cgroup(Path(name))
        removed.append(item)
        say(f"removed {item} (its trial, pid {match.group(1)}, is gone)")
    return removed


# ---- the broker -----------------------------------------------------------------------------


def _mosquitto_installed() -> bool:
    return mosquitto_binary() is not None


# ---- the trial ------------------------------------------------------------------------------


class _Interrupted(KeyboardInterrupt):
    pass


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def run_summary(label: str, run: RunSpec, report: dict) -> dict:
    """One row of trial.json: straggling, round time, HE ratio, budgets, bytes, accuracy.
    Round-time medians leave out round 1 (it builds the HE tables and warms torch up)."""
    rounds = report.get("rounds", [])
    later = [r for r in rounds if r["round"] > 1] or rounds
    strag = report.get("straggling") or {}
    per_round = {x["round"]: x for x in strag.get("rounds", [])}
    later_ratios = [per_round[r["round"]]["ratio"] for r in later
                    if r["round"] in per_round and per_round[r["round"]]["ratio"] is not None]
    budgets = {c["id"]: round(c["encryption_budget"], 4) for c in report.get("clients", [])}
    he = {c["id"]: round(c["he_ratio"], 4) for c in report.get("clients", [])}
    return {
        "label": label,
        "strategy": report.get("strategy"),
        "budget_mode": (report.get("budgets") or {}).get("mode") or run.budget_mode or "paper",
        "rounds": len(rounds),
        "median_ratio": strag.get("median_ratio"),
        "median_ratio_after_round_1": _median(later_ratios),
        "median_work_ratio": strag.get("median_work_ratio"),
        "median_slowest_s": _median([per_round[r["round"]]["slowest_s"] for r in later if r["round"] in per_round]),
        "median_idle_s": _median([per_round[r["round"]]["idle_s"] for r in later if r["round"] in per_round]),
        "median_round_s": _median([r["seconds"] for r in later]),
        "final_accuracy": report.get("final_accuracy"),
        "he_ratio_mean": round(statistics.mean(he.values()), 4) if he else None,
        "mb_up_per_round": _median([r["bytes_up"] / 1e6 for r in later]),
        "budgets": budgets,
        "he_ratios": he,
        "straggling_events": len(report.get("straggling_events") or []),
        "exit_codes": report.get("exit_codes", {}),
    }


def compare_runs(rows: list[dict]) -> None:
    """Add each run's round time relative to the trial's plaintext run (same fleet, same data)."""
    base = next((r for r in rows if r["strategy"] == "plaintext" and r["median_round_s"]), None)
    for r in rows:
        r["round_s_vs_plaintext"] = (round(r["median_round_s"] / base["median_round_s"], 3)
                                     if base and r["median_round_s"] else None)


def run_trial(
    spec: TrialSpec,
    out: Path,
    *,
    broker: str | None = None,
    emulate: bool = True,
    metrics_port: int | None = None,
    only: list[str] | None = None,
    say: Say | None = None,
    progress: Progress | None = None,
    timeout: float | None = None,
) -> dict:
    """Run every run of ``spec`` in turn on the same emulated fleet; returns trial.json's dict.
    Everything created is removed before it returns or raises (Ctrl-C and SIGTERM included)."""
    from senseshield.runtime.fleet import FleetOptions, fleet_up
    from senseshield.job import Job
    from senseshield.strategies import StrategyOptions

    say = say or (lambda msg: log.info("%s", msg))
    out = Path(out)
    runs = spec.run_specs
    if only:
        unknown = [o for o in only if o not in [r.name for r in runs]]
        if unknown:
            raise ConfigError(f"--only {unknown[0]!r} names no run; runs: {', '.join(r.name for r in runs)}.")
        runs = [r for r in runs if r.name in only]
    plans, scale = plan_agents(spec)
    local_epochs, batch_size = training_defaults(spec, plans)
    configs = {}
    for run in runs:  # validate every run before anything starts
        try:
            sets = dict(run.set)
            if run.budget_mode is not None:
                sets["budget_mode"] = run.budget_mode
            configs[run.name] = Job(
                strategy=run.strategy, rounds=spec.rounds, dataset=spec.dataset, model=spec.model,
                partition=spec.partition, seed=spec.seed, local_epochs=local_epochs, batch_size=batch_size,
                lr=spec.lr, key_bits=spec.key_bits, scheme=run.scheme or spec.scheme, clients=len(plans),
                options=StrategyOptions(**sets),
            )
        except ValidationError as exc:  # the run's options (StrategyOptions)
            first = exc.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            raise ConfigError(str(cause) if isinstance(cause, ConfigError) else
                              f"Run {run.name!r}: {first.get('msg', 'is not allowed')}.") from None
        except ConfigError as exc:  # the job (Job names the key, the value and what is allowed)
            raise ConfigError(f"Run {run.name!r}: {exc}") from None
    broker_kind = broker or spec.broker
    if broker_kind not in ("auto", "embedded", "mosquitto") and not broker_kind.startswith("mqtt://"):
        raise ConfigError(f"broker {broker_kind!r} is not allowed; use auto, embedded, mosquitto or mqtt://HOST:PORT.")
    if broker_kind == "auto":
        broker_kind = "mosquitto" if _mosquitto_installed() else "embedded"

    out.mkdir(parents=True, exist_ok=True)
    caps = probe(emulate)
    if broker_kind.startswith("mqtt://") and caps.netns:
        caps.netns, caps.qdisc = False, None
        caps.notes.append("an external broker is not reachable from the agents' namespaces: links are not shaped")
    say(caps.describe())
    for note in caps.notes:
        say(f"note: {note}")
    if scale < 1:
        say(f"note: the fleet's CPU shares add up to more than cpu_budget={spec.cpu_budget:g} cores: "
            f"emulating at scale {scale:.3f} (shares and bandwidths x{scale:.3f}, latencies /{scale:.3f})")
    removed = cleanup_stale(say)
    if removed:
        say(f"removed {len(removed)} leftover(s) of earlier trials")

    emulation = Emulation(caps, say, weight=spec.cpu_weight)
    if caps.cgroup:
        say(f"the trial's processes get {spec.cpu_weight:g}x a normal process's CPU weight; every agent is "
            f"capped by its share")
    mosquitto: MosquittoProcess | None = None
    previous = {}

    def interrupt(signum, _frame) -> None:  # noqa: ANN001
        raise _Interrupted(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, interrupt)
        except (ValueError, OSError):  # not the main thread
            pass
    try:  # Ctrl-C must clean up even where SIGINT came in ignored (a shell's background job)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass
    rows: list[dict] = []
    trial = {
        "name": spec.name, "description": spec.description, "spec": spec.model_dump(mode="json"),
        "emulation": caps.as_dict(), "scale": scale, "broker": broker_kind,
        "machine": _machine(), "agents": [], "runs": rows, "started_at": time.time(),
    }
    try:
        emulation.setup(plans)
        profiles_dir = out / "profiles"
        profiles_dir.mkdir(exist_ok=True)
        paths = {}
        for a in plans:
            path = profiles_dir / f"{a.agent_id}.yaml"
            path.write_text(yaml.safe_dump(a.profile.model_dump(mode="json", exclude_none=True), sort_keys=False))
            paths[a.agent_id] = path
            trial["agents"].append({"id": a.agent_id, "device": a.device, "board": a.profile.board,
                                    "cpu_share": a.cpu_share, "bandwidth": a.bandwidth, "latency_ms": a.latency_ms,
                                    "cpu_speed": a.profile.cpu_speed, "applied": emulation.applied.get(a.agent_id, {})})
        url = None
        if broker_kind == "mosquitto":
            mosquitto = MosquittoProcess(out / "broker", emulation.broker_host).start()
            url = mosquitto.url
        elif broker_kind.startswith("mqtt://"):
            url = broker_kind

        def wrap(name: str, argv: list[str]) -> list[str]:
            if name == "coordinator" and metrics_port is not None:
                argv = ["env", f"SENSESHIELD_METRICS_PORT={metrics_port}", *argv]
            return emulation.wrap(name, argv)

        for i, run in enumerate(runs, 1):
            label = run.name
            say(f"run {i}/{len(runs)}: {label} ({run.strategy}, {len(plans)} agents, {spec.rounds} rounds)")
            load_before = os.getloadavg()
            options = FleetOptions(
                agents=len(plans), out=out / label, broker=url, fleet=f"trial-{label}",
                round_deadline=spec.deadline, join_timeout=spec.join_timeout,
                min_contributors=spec.min_contributors, threads=spec.threads, wrap=wrap,
                agent_profiles=paths, broker_host=emulation.broker_host,
            )
            started = time.time()

            def fleet_progress(phase: str, done: int, total: int, _label: str = label) -> None:
                if progress:
                    progress(_label, phase, done, total)

            report = fleet_up(configs[label], options, fleet_progress, timeout=timeout)
            row = run_summary(label, run, report)
            row.update(seconds=round(time.time() - started, 2), load_before=list(load_before),
                       load_after=list(os.getloadavg()))
            rows.append(row)
            compare_runs(rows)
            _write(out / "trial.json", trial)
            say(f"  {label}: median straggling ratio {row['median_ratio']}, median round "
                f"{row['median_round_s']} s, HE ratio {row['he_ratio_mean']}, accuracy "
                + (f"{row['final_accuracy']:.3f}" if row["final_accuracy"] is not None else "none reported"))
        trial["finished_at"] = time.time()
        _write(out / "trial.json", trial)
        return trial
    finally:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the cleanup
        try:
            if mosquitto is not None:
                mosquitto.stop()
            left = emulation.teardown()
            if left:
                say(f"warning: could not remove {', '.join(left)}; run `senseshield trial cleanup`")
            trial["cleanup"] = {"left": left}
            if rows or trial.get("finished_at"):
                _write(out / "trial.json", trial)
        finally:
            signal.signal(signal.SIGINT, old)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _write(path: Path, data: dict) -> None:
    from senseshield.runtime.files import write_atomic

    write_atomic(path, json.dumps(data, indent=2), mode=0o644)


def _machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "load_at_start": list(os.getloadavg()),
            "hostname": socket.gethostname()}

