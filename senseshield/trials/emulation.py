"""What a field trial can emulate on this machine, and the emulation itself: a cgroup CPU
limit and a network namespace per agent, shaped with ``tc`` (:func:`probe`,
:class:`Emulation`), and the removal of what a killed trial left (:func:`leftovers`,
:func:`cleanup_stale`). :mod:`senseshield.trials.trial` runs trials on it.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from senseshield.errors import ConfigError
from senseshield.processes import running

if TYPE_CHECKING:
    from senseshield.trials.trial import AgentPlan

Say = Callable[[str], None]

TAG_PREFIX = "sst"  # every link, namespace and cgroup a trial creates starts with this
CGROUP_PREFIX = "senseshield-trial-"
SUBNET_PREFIX = "10.213"  # 10.213.X.0/24 per trial, X free on this host
CPU_PERIOD_US = 10_000
"""CFS bandwidth period. The default 100 ms lets a 0.16-share device run a 16 ms burst at full
speed, so short phases (training a small model, a mask solve) would not be slowed at all;
with 10 ms a burst is under 2 ms. Shares below 0.1 get a longer period (the quota floor is 1 ms)."""


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


def quota_group(share: float, *, period_us: int = 100_000, name: str = "bench") -> Path:
    """A new cgroup ``senseshield-NAME-<pid>`` holding ``share`` of one CPU per ``period_us``
    (default: the kernel's 100 ms; the trials use 10 ms, :data:`CPU_PERIOD_US`), for a
    process made that much slower (:func:`in_cgroup`; :func:`_remove_cgroup` removes it).
    ConfigError without root and a writable cpu cgroup controller."""
    found = _cpu_cgroup_mount()
    if os.geteuid() != 0 or found is None or not os.access(found[1], os.W_OK):
        raise ConfigError("A CPU quota needs root and a writable cpu cgroup controller (cgroup v1 cpu or v2 cpu.max).")
    version, root = found
    group = root / f"senseshield-{name}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    set_cpu_quota(group, version, share, period_us=period_us)
    return group


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
        if match is None or running(int(match.group(1))):
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
