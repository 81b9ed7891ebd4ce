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
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from senseshield.profiles import DeviceProfile, load_declared
from senseshield.runtime.broker import MosquittoProcess, mosquitto_binary
from senseshield.errors import ConfigError
from senseshield.trials.emulation import Emulation, Say, cleanup_stale, probe

log = logging.getLogger("senseshield.trials.trial")

Progress = Callable[[str, str, int, int], None]  # run label, phase, done, total

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
    from senseshield.bench.machine import cpu_model

    return {"cpu": cpu_model("unknown"), "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "load_at_start": list(os.getloadavg()),
            "hostname": socket.gethostname()}

