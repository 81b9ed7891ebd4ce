"""What a device can do, measured in a couple of seconds: the hardware probes behind `--profile
auto` and `edge-agent profile` (the profile's model and files: :mod:`senseshield.profiles`).

The coordinator needs two numbers per agent (SenseCrypt sec. 3.2, sent in ``Hello``):

* ``cpu_speed`` -- v_i, GHz x cores: ``clock_mhz / 1000 * cores``, or
  :data:`DEFAULT_CLOCK_GHZ` x cores when the clock cannot be read;
* ``bandwidth`` -- r_i, MB/s (10^6 bytes per second): the measured up bandwidth through the
  broker (:func:`measure_bandwidth`), else the declared :data:`DEFAULT_BANDWIDTH_MBPS`.

Every measured figure is the median of several probes of a minimum duration each, except
the encryption rate, which is the best of short bursts spread over about a second
(:func:`measure_encryption`); ``measurements`` keeps min/median/max, quartiles, the probe
count, the confidence of ``[min, max]`` as an interval for the median and which statistic
is the figure (the coordinator treats devices whose intervals overlap as equal,
:func:`senseshield.engine.measurements.pool_agreeing`). With
``--profile auto:NAME`` (or ``auto:FILE``) the measured r_i and v_i are bounded by the declared
profile: a measured figure never exceeds the declared one (:func:`bound_profile`).

:func:`measure_profile` also records what the device is (board, CPU, cores, memory) and two
microbenchmarks that explain its round times: float32 matmul GFLOP/s with torch and values
encrypted per second with the fleet's HE scheme and key size. Every measurement reports how
long it took in ``timings`` (seconds). At join (``quick``) the whole profile took 7.7-7.9 s
for three agents starting together on a 2-vCPU x86: torch's import in the matmul child
(~3 s), the key's tables (~0.6 s) and the encryption bursts (1.2 s of wall time, ~0.17 s of
CPU); key generation is random and can take longer on small boards.

:func:`load_profile` turns ``--profile`` specs into a :class:`DeviceProfile`: ``"auto"``
measures, a path reads a YAML file, a NAME reads ``NAME.yaml`` from the profile directories
(:func:`profile_dirs`: ``$SENSESHIELD_PROFILES``, the repository's ``profiles/``, then
``<prefix>/share/senseshield/profiles``). A YAML profile needs only ``bandwidth`` and
``cpu_speed`` (or what derives them: ``clock_mhz`` and ``cores``, ``bandwidth_up_mbps``);
any other :class:`DeviceProfile` field is optional. Mistakes raise :class:`ConfigError`.
The device classes in ``profiles/`` (rpi4, rpi5, jetson-nano, jetson-orin-nano, x86) also
carry what ``senseshield trial run`` needs to emulate them (``cpu_share``, ``latency_ms``)
and per-class training defaults (``local_epochs``, ``batch_size``); see ``profiles/README.md``.

Usage::

    profile = measure_profile(quick=True)                    # this device
    profile = load_profile("pi4")                            # profiles/pi4.yaml
    hello = Hello(..., bandwidth=profile.bandwidth, cpu_speed=profile.cpu_speed,
                  profile=profile.model_dump())
"""

from __future__ import annotations

import math
import os
import platform
import queue
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from senseshield import defaults
from senseshield.engine.measurements import Spread, summarise
from senseshield.errors import ConfigError
from senseshield.profiles import (  # noqa: F401 (the profile's models and files: re-exported for the agent's callers)
    BOUNDED_FIELDS,
    DEFAULT_BANDWIDTH_MBPS,
    DEFAULT_CLOCK_GHZ,
    LOOPBACK_BANDWIDTH_MBPS,
    MEASURE,
    PROFILES_ENV,
    DeviceProfile,
    ProbeSummary,
    bound_profile,
    cpu_speed_of,
    is_measured,
    load_declared,
    profile_dirs,
    profile_names,
    read_profile,
)

DEFAULT_SCHEME = "packed-paillier"

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
TEGRA_RELEASE = Path("/etc/nv_tegra_release")
CPUINFO = Path("/proc/cpuinfo")


PROBE_SCHEMA = "bandwidth-probe"

# (implementer, part) from /proc/cpuinfo on ARM, which has no "model name" line.
ARM_PARTS = {
    ("0x41", "0xb76"): "ARM1176", ("0x41", "0xc07"): "Cortex-A7",
    ("0x41", "0xd03"): "Cortex-A53", ("0x41", "0xd04"): "Cortex-A35",
    ("0x41", "0xd05"): "Cortex-A55", ("0x41", "0xd07"): "Cortex-A57",
    ("0x41", "0xd08"): "Cortex-A72", ("0x41", "0xd09"): "Cortex-A73",
    ("0x41", "0xd0a"): "Cortex-A75", ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1", ("0x41", "0xd0d"): "Cortex-A77",
    ("0x41", "0xd41"): "Cortex-A78", ("0x41", "0xd42"): "Cortex-A78AE",
    ("0x41", "0xd4b"): "Cortex-A78C", ("0x4e", "0x004"): "NVIDIA Carmel",
}


# ---- what the device is ----------------------------------------------------------------------


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _cpuinfo_fields(cpuinfo: Path) -> dict[str, str]:
    """First value of every key in /proc/cpuinfo (keys lower-cased)."""
    fields: dict[str, str] = {}
    for line in (_read_text(cpuinfo) or "").splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if sep and key and key not in fields:
            fields[key] = value.strip()
    return fields


def cpu_name(*, cpuinfo: Path = CPUINFO) -> str:
    """``model name`` of /proc/cpuinfo, else the ARM core from its implementer/part codes,
    else :func:`platform.processor` / :func:`platform.machine`."""
    fields = _cpuinfo_fields(cpuinfo)
    if fields.get("model name"):
        return fields["model name"]
    part = ARM_PARTS.get((fields.get("cpu implementer", "").lower(), fields.get("cpu part", "").lower()))
    if part:
        return part
    return platform.processor() or platform.machine() or "unknown"


def _tegra_release(text: str) -> str:
    """``# R32 (release), REVISION: 7.1, ...`` -> ``R32.7.1`` (the text itself if unparsable)."""
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    if match:
        return f"R{match.group(1)}.{match.group(2)}"
    return text.strip().lstrip("# ").split(",")[0] or "unknown"


def detect_board(
    *,
    device_tree_model: Path = DEVICE_TREE_MODEL,
    tegra_release: Path = TEGRA_RELEASE,
    cpuinfo: Path = CPUINFO,
) -> str:
    """The board: ``"Jetson (L4T R32.7.1): <device-tree model>"`` on a Jetson, the device-tree
    model (``"Raspberry Pi 4 Model B Rev 1.4"``, trailing NUL stripped) on a Raspberry Pi or
    another device-tree board, else the CPU name (:func:`cpu_name`)."""
    raw_model = _read_text(device_tree_model)
    model = raw_model.replace("\x00", "").strip() if raw_model is not None else ""
    release = _read_text(tegra_release)
    if release is not None:
        board = f"Jetson (L4T {_tegra_release(release)})"
        return f"{board}: {model}" if model else board
    if model:
        return model
    return cpu_name(cpuinfo=cpuinfo)


def clock_mhz(*, cpuinfo: Path = CPUINFO) -> float | None:
    """Maximum CPU clock (psutil, cpufreq), else the current one, else the largest
    ``cpu MHz`` of /proc/cpuinfo; None if none is known."""
    import psutil

    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, RuntimeError):
        freq = None
    if freq is not None:
        for value in (freq.max, freq.current):
            if value and value > 0:
                return float(value)
    speeds = []
    for line in (_read_text(cpuinfo) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "cpu mhz":
            try:
                speeds.append(float(value))
            except ValueError:
                pass
    speeds = [s for s in speeds if s > 0 and math.isfinite(s)]
    return max(speeds) if speeds else None


def _cgroup_dirs(cgroup_file: Path, mounts: Path) -> list[tuple[str, Path, str]]:
    """(version, mount point, this process's path in it) of the hierarchies holding the cpu
    controller: cgroup v2 (``0::/path``) and a v1 hierarchy with ``cpu``."""
    points: dict[str, Path] = {}
    for line in (_read_text(mounts) or "").splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup2":
            points.setdefault("v2", Path(parts[1]))
        elif len(parts) >= 4 and parts[2] == "cgroup" and "cpu" in parts[3].split(","):
            points.setdefault("v1", Path(parts[1]))
    out = []
    for line in (_read_text(cgroup_file) or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "" and "v2" in points:
            out.append(("v2", points["v2"], path))
        elif "cpu" in controllers.split(",") and "v1" in points:
            out.append(("v1", points["v1"], path))
    return out


def _quota(version: str, where: Path) -> float | None:
    """CPUs one cgroup directory allows (quota / period), None when unlimited or unreadable."""
    try:
        if version == "v2":
            fields = (_read_text(where / "cpu.max") or "").split()
            if len(fields) != 2 or fields[0] == "max":
                return None
            quota, period = float(fields[0]), float(fields[1])
        else:
            quota = float((_read_text(where / "cpu.cfs_quota_us") or "-1").strip())
            period = float((_read_text(where / "cpu.cfs_period_us") or "0").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_limit(*, cgroup_file: Path = Path("/proc/self/cgroup"), mounts: Path = Path("/proc/self/mounts")) -> float | None:
    """CPUs this process's cgroup allows: the least quota / period along its cgroup path (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), from the process's own
    cgroup up to the root; None when nothing limits it or the cgroup files are not visible
    (e.g. inside ``ip netns exec``, which mounts a fresh /sys)."""
    limits = []
    for version, root, path in _cgroup_dirs(cgroup_file, mounts):
        where = root / path.lstrip("/")
        if not where.is_dir():  # a cgroup namespace: the mount's root is our own cgroup
            where = root
        while True:
            limit = _quota(version, where)
            if limit is not None:
                limits.append(limit)
            if where == root or root not in where.parents:
                break
            where = where.parent
    return min(limits) if limits else None


def cpu_share(threads: int = 1, *, limit: float | None = None) -> float:
    """CPUs ``threads`` busy threads of this process can have: ``min(threads, cpu_limit())``.
    A measured rate per CPU-second times this is what the device sustains: a neighbour's CPU
    hog (it takes wall time, not CPU time) does not lower it, this cgroup's quota does."""
    limit = cpu_limit() if limit is None else limit
    return float(threads) if limit is None else min(float(threads), limit)


# ---- microbenchmarks ---------------------------------------------------------------------------


def measure_gflops(n: int = 512, probes: int = 5, min_seconds: float = 0.05) -> Spread:
    """float32 GFLOP/s of ``n x n`` torch matmuls (2 n^3 flops each) with torch's default
    thread count: after one warm-up product, ``probes`` probes, each repeating products for
    at least ``min_seconds`` (and at least one). Returns the :class:`~senseshield.engine.measurements.Spread` of the probes (the
    profile's ``gflops`` is the median). Runs in this process (it imports torch);
    :func:`measure_gflops_apart` runs it in a child process.

    A probe's figure is its flops per CPU-second of this process times the CPUs torch's
    threads may use (:func:`cpu_share`): another process busy on the same cores takes wall
    time, not this process's CPU time, so it does not lower the figure; a cgroup CPU quota does.
    """
    from edge_agent.matmul import gflops_probes

    if n < 1 or probes < 1 or not min_seconds >= 0:
        raise ConfigError(f"Matmul n={n}, probes={probes}, min_seconds={min_seconds} is not allowed; "
                          "n and probes must be >= 1, min_seconds >= 0.")
    return summarise(gflops_probes(n, probes, min_seconds, cpu_limit()))


_GFLOPS_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
imported = time.perf_counter() - start
from edge_agent.matmul import gflops_probes
print(json.dumps({"probes": gflops_probes(*json.loads(sys.argv[1])), "import_s": imported,
                  "torch": torch.__version__}))
"""


def measure_gflops_apart(n: int = 512, probes: int = 5, min_seconds: float = 0.05,
                         timeout: float = 600.0) -> tuple[Spread, float]:
    """:func:`measure_gflops` in a child Python process, and the seconds the child took to
    import torch. The agent measures its device before it is online and loads torch only
    when a job needs it, so an idle agent does not hold torch's ~300 MB; and a torch that
    dies on this CPU (SIGILL on a Cortex-A72/A57 with a torch built for newer cores) stops
    the child, not the agent, which says so in one sentence (:class:`ConfigError`)."""
    import json
    import signal
    import subprocess

    if n < 1 or probes < 1 or not min_seconds >= 0:
        raise ConfigError(f"Matmul n={n}, probes={probes}, min_seconds={min_seconds} is not allowed; "
                          "n and probes must be >= 1, min_seconds >= 0.")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run([sys.executable, "-c", _GFLOPS_CHILD, json.dumps([n, probes, min_seconds, cpu_limit()])],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"The matmul benchmark (torch) did not finish within {timeout:g} s; "
                          "declare a profile instead (--profile NAME).") from None
    if done.returncode != 0:
        if done.returncode < 0:
            name = signal.Signals(-done.returncode).name
            raise ConfigError(
                f"torch died with {name} in a matrix multiply on this CPU ({platform.machine()}); on a "
                "Raspberry Pi 4 or Jetson Nano (Cortex-A72/A57) install torch 2.9.1 (docs/pi.md).")
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"The matmul benchmark (torch) failed: {last}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return summarise(result["probes"]), float(result["import_s"])


@dataclass(frozen=True)
class HEMeasurement:
    """Result of :func:`measure_encryption`; times in seconds."""

    scheme: str
    key_bits: int | None
    encryptions_per_s: float  # plaintext values per second
    keygen_s: float  # 0 when a public key was given
    setup_s: float  # the first encryption (builds tables such as packed Paillier's fixed-base table)
    encrypt_s: float  # the timed encryptions (CPU seconds)
    spread: Spread | None = None  # values/s of the bursts (encryptions_per_s is the best)
    bytes_per_value: float | None = None  # ciphertext bytes on the wire per value


def resolve_key_bits(scheme: str, key_bits: int | None) -> int | None:
    """``key_bits`` checked against ``scheme``: its default when None; ConfigError if the scheme
    has no ``key_bits`` parameter."""
    from senseshield.he import SCHEMES

    params = SCHEMES.get(scheme).info().params
    if "key_bits" not in params:
        if key_bits is not None:
            sized = [n for n, s in SCHEMES.items() if "key_bits" in s.info().params]
            raise ConfigError(
                f"--key-bits={key_bits} does not apply to scheme {scheme!r}; only "
                f"{', '.join(sized)} take a key size."
            )
        return None
    return int(params["key_bits"]) if key_bits is None else key_bits


def measure_encryption(
    scheme: str = DEFAULT_SCHEME,
    key_bits: int | None = None,
    *,
    public_key: Any = None,
    budget_s: float = 0.3,
    repeats: int = 12,
    window_s: float | None = None,
    max_values: int = 1 << 16,
    sleep: Callable[[float], None] = time.sleep,
) -> HEMeasurement:
    """Plaintext values encrypted per second with ``scheme`` at ``key_bits`` (scheme default
    when None), or with ``public_key`` (e.g. the fleet's, which skips key generation).

    The key is generated once (``keygen_s``); one warm-up encryption of one block
    (``setup_s``); then vectors of whole blocks, doubling in length while twice the time of
    one encryption fits in ``budget_s / repeats``; then ``repeats`` encryptions of that
    length (bursts), spread evenly over ``window_s`` seconds of wall time (default
    ``8 x budget_s``; the thread sleeps between them). A burst's time is this thread's CPU
    time over the share of a CPU the process's cgroup allows (:func:`cpu_share`): a
    neighbour's CPU hog does not lower the rate, a CPU quota does. The rate is the best
    burst's values/second (``spread`` summarises them all): CPU time still grows when the
    hardware under the thread is shared (the other hardware thread of an SMT core, other
    guests of a VM's host) -- on a shared 2-vCPU VM bursts of one process took 1.5x as long
    in spells lasting from a fraction of a second to a few seconds -- and nothing makes a
    burst faster than the device is, so the best of bursts spread over a second or more is
    the figure identical devices agree on. Values are counted, not ciphertexts, so per-value
    schemes and packed ones (66 values per packed-Paillier ciphertext, thousands per CKKS
    ciphertext) compare.
    """
    from senseshield.he import SCHEMES

    if not (budget_s > 0 and repeats >= 1 and (window_s is None or window_s >= 0) and max_values >= 1):
        raise ConfigError(f"Encryption benchmark budget_s={budget_s}, repeats={repeats}, window_s={window_s} is not "
                          "allowed; budget_s must be > 0, repeats >= 1, window_s >= 0.")
    keygen_s = 0.0
    if public_key is None:
        key_bits = resolve_key_bits(scheme, key_bits)
        params = {} if key_bits is None else {"key_bits": key_bits}
        start = time.perf_counter()
        public_key = SCHEMES.get(scheme).generate(**params).public_key
        keygen_s = time.perf_counter() - start
    else:
        scheme = public_key.scheme
        key_bits = getattr(public_key, "key_bits", None)
    from senseshield.he.base import ephemeral_exchange

    public_key = public_key.for_contributor(ephemeral_exchange, b"measuring")  # masked: pads of no round
    rng = np.random.default_rng(0)
    n = max(1, int(public_key.block_size))

    sent: list[float] = []

    share = cpu_share(1)  # encryption runs on this thread

    def encrypt(count: int) -> float:
        """Seconds of this thread's CPU the encryption of ``count`` values takes, over the
        share of a CPU this process may have (a neighbour's load does not count, a quota does)."""
        values = rng.uniform(-0.5, 0.5, count)
        start = time.thread_time()
        vector = public_key.encrypt(values, np.arange(count, dtype=np.int64))
        elapsed = (time.thread_time() - start) / share
        sent[:] = [len(public_key.ciphertext_bytes(vector)) / count]
        return elapsed

    setup_s = encrypt(n)
    spent = 0.0
    while 2 * n <= max_values:
        elapsed = encrypt(n)
        spent += elapsed
        if 2 * elapsed >= budget_s / repeats:  # twice as long would overrun the budget
            break
        n *= 2
    window = 8.0 * budget_s if window_s is None else float(window_s)
    rates: list[float] = []
    began = time.perf_counter()
    for i in range(repeats):
        wait = began + i * window / repeats - time.perf_counter()
        if wait > 0:
            sleep(wait)
        elapsed = encrypt(n)
        spent += elapsed
        rates.append(n / max(elapsed, 1e-9))
    spread = summarise(rates)
    return HEMeasurement(scheme, key_bits, spread.high, keygen_s, setup_s, spent, spread, sent[0])


@dataclass(frozen=True)
class BandwidthMeasurement:
    """Result of :func:`measure_bandwidth`."""

    mbps: float  # MB/s (10^6 bytes) each way, assuming a symmetric link: the probes' median
    round_trip_s: float  # round trip of one probe frame at ``mbps``
    frame_bytes: int  # probe frame size on the wire (payload + envelope header)
    seconds: float  # how long the whole measurement took (connect included)
    spread: Spread | None = None  # MB/s of every probe


@dataclass(frozen=True)
class ProbePlan:
    """How :func:`measure_bandwidth` probes: ``probes`` probes of ``nbytes`` frames, each
    repeating round trips for at least ``min_seconds``; the figure is the probes' median,
    or their best with ``best`` (the single short probe SenseShield used before, kept for
    ``benchmarks/bench_budgets.py``'s before/after)."""

    nbytes: int
    probes: int
    min_seconds: float
    best: bool = False


PROBE_PLANS: dict[str, dict[bool, ProbePlan]] = {  # name -> quick -> plan
    "robust": {True: ProbePlan(250_000, 5, 0.08), False: ProbePlan(1_000_000, 7, 0.2)},
    "single": {True: ProbePlan(250_000, 2, 0.0, best=True), False: ProbePlan(1_000_000, 3, 0.0, best=True)},
}
"""Bandwidth probe plans by name (``edge-agent join/profile --probe``); ``robust`` is the default."""


def probe_plan(name: str, *, quick: bool) -> ProbePlan:
    if name not in PROBE_PLANS:
        raise ConfigError(f"--probe {name!r} is not allowed; use one of: {', '.join(PROBE_PLANS)}.")
    return PROBE_PLANS[name][quick]


def measure_bandwidth(
    broker: str,
    fleet: str = defaults.FLEET,
    *,
    nbytes: int = 1_000_000,
    probes: int = 5,
    min_seconds: float = 0.1,
    best: bool = False,
    timeout: float = 10.0,
    link_factory: Callable[..., Any] | None = None,
) -> BandwidthMeasurement:
    """MB/s through ``broker``: publish ``nbytes`` probe frames on ``ss/v1/<fleet>/probe/<id>``,
    which the same client subscribes to, and time until each comes back.

    A frame crosses the device's link twice (up to the broker, then down), and the broker
    forwards it only once it has it whole, so ``k`` round trips of ``L`` bytes taking ``t``
    seconds give ``2 k L / t`` MB/s per direction, latency included. A round trip cannot
    separate up from down: the profile reports the same number for both (on loopback it
    measures the broker and the MQTT stack, not a network). After a small warm-up frame,
    ``probes`` probes each repeat round trips for at least ``min_seconds`` (at least one);
    the figure is the median probe (``best``: the fastest), ``spread`` has them all.
    ``link_factory`` builds the :class:`senseshield.runtime.transport.Link` (default ``Link``; e.g.
    ``functools.partial(Link, ...)`` for other link options). Raises
    :class:`ConnectionError` when the broker is unreachable or does not echo in time.
    """
    from senseshield.runtime.protocol import encode_frame
    from senseshield.runtime.transport import Link

    if nbytes < 1 or probes < 1 or not min_seconds >= 0:
        raise ConfigError(f"Bandwidth probes of {nbytes} bytes x {probes} (min {min_seconds} s) are not allowed; "
                          "bytes and probes must be >= 1, the minimum duration >= 0.")
    began = time.perf_counter()
    client_id = f"profile-{secrets.token_hex(4)}"
    suffix = f"probe/{client_id}"
    echoes: queue.Queue[int] = queue.Queue()

    def on_frame(_topic: str, frame: Any) -> None:
        if frame.schema == PROBE_SCHEMA and frame.sender == client_id:
            echoes.put(int(frame.fields.get("seq", -1)))

    link = (link_factory or Link)(broker, client_id=client_id, fleet=fleet, on_frame=on_frame)
    link.subscribe(suffix)
    link.start(timeout=timeout)
    seq = 0
    try:

        def round_trip(data: bytes) -> tuple[float, int]:
            nonlocal seq
            seq += 1
            frame = encode_frame(
                schema=PROBE_SCHEMA, version=1, fleet=fleet, sender=client_id, round=0,
                fields={"seq": seq}, sections={"data": data},
            )
            start = time.perf_counter()
            link.publish(suffix, frame, timeout=timeout)
            deadline = start + timeout
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise ConnectionError(
                        f"Broker {broker} did not echo a {len(frame):,}-byte probe within {timeout:g} s."
                    )
                try:
                    if echoes.get(timeout=left) == seq:
                        break
                except queue.Empty:
                    pass
            return time.perf_counter() - start, len(frame)

        round_trip(b"")
        payload = os.urandom(nbytes)
        rates, size = [], 0
        for _ in range(probes):
            done, spent = 0, 0.0
            while done == 0 or spent < min_seconds:
                elapsed, size = round_trip(payload)
                done, spent = done + 1, spent + elapsed
            rates.append(2 * size * done / max(spent, 1e-9) / 1e6)
    finally:
        link.stop()
    spread = summarise(rates)
    mbps = spread.high if best else spread.median
    return BandwidthMeasurement(mbps, 2 * size / (mbps * 1e6), size, time.perf_counter() - began, spread)


# ---- the profile ----------------------------------------------------------------------------


def measure_profile(
    *,
    scheme: str = DEFAULT_SCHEME,
    key_bits: int | None = None,
    broker: str | None = None,
    fleet: str = defaults.FLEET,
    quick: bool = False,
    mqtt: str = "5",
    public_key: Any = None,
    probe: str = "robust",
    device_tree_model: Path = DEVICE_TREE_MODEL,
    tegra_release: Path = TEGRA_RELEASE,
    cpuinfo: Path = CPUINFO,
) -> DeviceProfile:
    """Profile this device: facts, matmul GFLOP/s, HE encryptions/s and, with ``broker``,
    the bandwidth through it (:func:`measure_bandwidth`).

    ``key_bits`` defaults to the scheme's (2048 for the Paillier schemes); ``public_key``
    (the fleet's) replaces key generation. ``quick`` shrinks every benchmark (256 x 256
    matmuls, 0.15 s of encryption CPU in bursts spread over 1.2 s, 250 kB probe frames) for joins,
    tests and impatient users.
    ``probe`` names the bandwidth plan (:data:`PROBE_PLANS`: ``robust``, the median of several
    probes of a minimum duration, or ``single``, the old best-of-two short probe). Every
    figure comes from several probes (the encryption rate: the best of 12 bursts,
    :func:`measure_encryption`); ``measurements`` holds their summaries.
    The bandwidth is measured first, so an unreachable broker fails fast. Timings:
    ``bandwidth`` (with a broker), ``system``, ``matmul``, ``he_keygen``, ``he_setup``,
    ``he_encrypt`` and ``total``, in seconds.
    """
    import psutil

    began = time.perf_counter()
    if public_key is None:
        key_bits = resolve_key_bits(scheme, key_bits)  # fail before any measurement
    if broker is not None:
        from senseshield.runtime.transport import parse_broker, topic

        parse_broker(broker)
        topic(fleet, "probe")
    plan = probe_plan(probe, quick=quick)
    timings: dict[str, float] = {}
    summaries: dict[str, ProbeSummary] = {}

    up = None
    if broker is not None:  # first: an unreachable broker fails before the benchmarks run
        from functools import partial

        from senseshield.runtime.transport import Link

        bw = measure_bandwidth(broker, fleet, nbytes=plan.nbytes, probes=plan.probes, min_seconds=plan.min_seconds,
                               best=plan.best, link_factory=partial(Link, protocol=mqtt))
        timings["bandwidth"] = bw.seconds
        up = bw.mbps
        summaries["bandwidth"] = ProbeSummary.of(bw.spread)

    start = time.perf_counter()
    cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    facts: dict[str, Any] = {
        "board": detect_board(device_tree_model=device_tree_model, tegra_release=tegra_release, cpuinfo=cpuinfo),
        "cpu_name": cpu_name(cpuinfo=cpuinfo),
        "cores": cores,
        "physical_cores": psutil.cpu_count(logical=False) or cores,
        "clock_mhz": clock_mhz(cpuinfo=cpuinfo),
        "memory_mb": max(1, psutil.virtual_memory().total >> 20),
    }
    timings["system"] = time.perf_counter() - start

    start = time.perf_counter()
    gflops, timings["torch_import"] = measure_gflops_apart(*((256, 5, 0.02) if quick else (512, 5, 0.05)))
    timings["matmul"] = time.perf_counter() - start - timings["torch_import"]  # the child's start and probes
    summaries["gflops"] = ProbeSummary.of(gflops)

    he = measure_encryption(scheme, key_bits, public_key=public_key, budget_s=0.15 if quick else 0.3)
    timings.update(he_keygen=he.keygen_s, he_setup=he.setup_s, he_encrypt=he.encrypt_s)
    summaries["he_encryptions_per_s"] = ProbeSummary.of(he.spread, "max")

    timings["total"] = time.perf_counter() - began
    bandwidth = DEFAULT_BANDWIDTH_MBPS if up is None else up
    if up is not None and is_loopback(broker):
        bandwidth = max(up, LOOPBACK_BANDWIDTH_MBPS)
    return DeviceProfile(
        **facts,
        gflops=gflops.median,
        he_scheme=he.scheme,
        he_key_bits=he.key_bits,
        he_encryptions_per_s=he.encryptions_per_s,
        he_bytes_per_value=he.bytes_per_value,
        bandwidth_up_mbps=up,
        bandwidth_down_mbps=up,
        cpu_speed=cpu_speed_of(facts["clock_mhz"], cores),
        bandwidth=bandwidth,
        timings=timings,
        measurements=summaries,
    )


def is_loopback(broker: str | None) -> bool:
    """Whether ``broker`` is on this host (localhost, 127.0.0.0/8, ::1)."""
    import ipaddress

    if broker is None:
        return False
    from senseshield.runtime.transport import parse_broker

    host = parse_broker(broker)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_profile(spec: str, **measure: Any) -> DeviceProfile:
    """``"auto"`` -> :func:`measure_profile` (with ``measure`` as its keyword arguments);
    ``"auto:NAME"`` / ``"auto:FILE"`` -> measured, then bounded by that declared profile
    (:func:`bound_profile`: a measured bandwidth or CPU speed never exceeds the declared one);
    anything else is a declared profile (:func:`senseshield.profiles.load_declared`)."""
    if spec == MEASURE:
        return measure_profile(**measure)
    if is_measured(spec):
        source = spec[len(MEASURE) + 1:]
        if not source or is_measured(source):
            raise ConfigError(f"Profile {spec!r} is not allowed; use auto:NAME or auto:FILE.yaml to bound "
                              "the measured figures by a declared profile.")
        declared = load_declared(source)  # read first: a bad name fails before measuring
        return bound_profile(measure_profile(**measure), declared, source)
    return load_declared(spec)
