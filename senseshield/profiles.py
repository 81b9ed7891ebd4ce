"""Device profiles, the library's part: what a device declares or measured about itself
(:class:`DeviceProfile`, :class:`ProbeSummary`), the named profiles of ``profiles/`` and
profile files (:func:`read_profile`, :func:`load_declared`), and a measured profile bounded by
a declared one (:func:`bound_profile`). Measuring a device (its CPU, encryption rate and
bandwidth) is the agent's: :mod:`edge_agent.probes`."""

from __future__ import annotations

import difflib
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from senseshield.engine.measurements import Spread
from senseshield.errors import ConfigError

DEFAULT_BANDWIDTH_MBPS = 10.0
"""Declared r_i (MB/s) when the bandwidth is not measured (~80 Mbit/s, a decent Wi-Fi link)."""
LOOPBACK_BANDWIDTH_MBPS = 1000.0
"""r_i (MB/s) of an agent whose broker is on its own host (loopback): no network limits it, and
probes through a local broker measure how busy the host is, not a link (the measured figure
stays in ``bandwidth_up_mbps``)."""
DEFAULT_CLOCK_GHZ = 1.5
"""Clock assumed per core when it cannot be read (a Raspberry Pi 4's 1.5 GHz)."""

PROFILES_ENV = "SENSESHIELD_PROFILES"
"""Extra profile directories (``os.pathsep``-separated), searched before the built-in ones."""


class ProbeSummary(BaseModel):
    """Several probes of one figure (:func:`senseshield.engine.measurements.summarise`):
    ``figure`` says which statistic the profile reports (``median``, or ``max`` for the
    encryption rate: the best burst); ``[min, max]`` covers the true median with
    ``confidence``, and the coordinator treats devices whose ``[min, max]`` overlap as equal."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    median: float = Field(ge=0)
    min: float = Field(ge=0)
    max: float = Field(ge=0)
    q1: float = Field(ge=0)
    q3: float = Field(ge=0)
    probes: int = Field(ge=1)
    rel_iqr: float = Field(ge=0, description="(q3 - q1) / median.")
    confidence: float = Field(ge=0, le=1, description="1 - 2 x 0.5^probes: coverage of [min, max] for the median.")
    figure: Literal["median", "max"] = Field("median", description="The statistic the profile reports as the figure.")

    @classmethod
    def of(cls, spread: Spread, figure: str = "median") -> "ProbeSummary":
        return cls.model_validate({**spread.as_dict(), "figure": figure})


BOUNDED_FIELDS = ("bandwidth", "cpu_speed")
"""The figures a declared profile bounds (``--profile auto:NAME``): r_i and v_i, the budget inputs."""


class DeviceProfile(BaseModel):
    """One device's facts and measurements; ``bandwidth`` and ``cpu_speed`` feed the coordinator.

    Measured profiles fill every field except the bandwidths without a broker; a YAML profile
    (an emulated device class) may give only ``bandwidth`` and ``cpu_speed``, the rest is None.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    board: str = Field("unknown", description="Raspberry Pi / Jetson model, else the CPU name.")
    cpu_name: str = Field("unknown", description="CPU model ('model name', or the ARM core).")
    cores: Optional[int] = Field(None, ge=1, description="Logical CPUs.")
    physical_cores: Optional[int] = Field(None, ge=1, description="Physical cores.")
    clock_mhz: Optional[float] = Field(
        None, gt=0, description="Maximum (else current) CPU clock in MHz; None if unreadable."
    )
    memory_mb: Optional[int] = Field(None, ge=1, description="Total RAM in MiB.")
    gflops: Optional[float] = Field(
        None, gt=0, description="float32 matmul GFLOP/s with torch (best of a few n x n products, 2n^3 flops)."
    )
    he_scheme: Optional[str] = Field(None, description="HE scheme the encryption rate was measured with.")
    he_key_bits: Optional[int] = Field(
        None, gt=0, description="Key size of he_scheme in bits; None for schemes without key_bits (CKKS)."
    )
    he_encryptions_per_s: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Plaintext values encrypted per second with he_scheme at he_key_bits (the best of "
            "bursts spread over about a second, per CPU-second of the encrypting thread times the "
            "cgroup's CPU share); for packed schemes (packed Paillier, CKKS) this counts values, "
            "not ciphertexts."
        ),
    )
    he_bytes_per_value: Optional[float] = Field(
        None, gt=0, description="Ciphertext bytes on the wire per encrypted value with he_scheme at he_key_bits."
    )
    bandwidth_up_mbps: Optional[float] = Field(
        None, gt=0, description="Measured MB/s through the broker; None unless measured."
    )
    bandwidth_down_mbps: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Measured MB/s from the broker; None unless measured. One round trip cannot tell "
            "the directions apart, so it equals bandwidth_up_mbps."
        ),
    )
    cpu_speed: float = Field(
        gt=0,
        description=(
            f"v_i for the coordinator, GHz x cores: clock_mhz / 1000 * cores, or "
            f"{DEFAULT_CLOCK_GHZ:g} GHz x cores when the clock is unknown."
        ),
    )
    bandwidth: float = Field(
        gt=0,
        description=(
            f"r_i for the coordinator, MB/s: bandwidth_up_mbps if measured (at least "
            f"{LOOPBACK_BANDWIDTH_MBPS:g}, non-limiting, when the broker is on this host), else the "
            f"declared default {DEFAULT_BANDWIDTH_MBPS:g}."
        ),
    )
    cpu_share: Optional[float] = Field(
        None,
        gt=0,
        le=64,
        description=(
            "Emulation: the device's single-thread speed as a fraction of one core of the "
            "reference machine (a cgroup CPU limit in `senseshield trial run`)."
        ),
    )
    latency_ms: Optional[float] = Field(
        None, ge=0, le=10_000, description="Emulation: one-way network latency of the device's link in ms."
    )
    local_epochs: Optional[int] = Field(None, ge=1, description="Default local epochs per round for this device class.")
    batch_size: Optional[int] = Field(None, ge=1, description="Default local minibatch size for this device class.")
    min_he_ratio: Optional[float] = Field(
        None, ge=0, le=1,
        description="Least fraction of its parameters this device encrypts in a job that encrypts "
                    "(edge-agent join --min-he-ratio overrides; None: 0, no floor).",
    )
    inference_ms: Optional[dict[str, float]] = Field(
        None,
        description="onnxruntime latency of the fleet's model (with --model): p50/p95 ms at batch 1 and 32.",
    )
    timings: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Seconds each measurement took (and 'total')."
    )
    measurements: dict[str, ProbeSummary] = Field(
        default_factory=dict,
        description=(
            "Probe summaries of the measured figures (bandwidth in MB/s, gflops, "
            "he_encryptions_per_s): median, min, max, quartiles, probe count, confidence, "
            "and which statistic is the figure (the median; the max for he_encryptions_per_s)."
        ),
    )
    declared_profile: Optional[str] = Field(
        None, description="The declared profile (NAME or FILE of --profile auto:SPEC) that bounds the measured figures."
    )
    bounds: dict[str, float] = Field(
        default_factory=dict,
        description=f"Declared upper bounds of {' and '.join(BOUNDED_FIELDS)}: a measured figure never exceeds them.",
    )
    capped: list[str] = Field(default_factory=list, description="Measured figures lowered to their declared bound.")

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        """A YAML profile may give clock_mhz and cores instead of cpu_speed, and a measured
        bandwidth_up_mbps instead of bandwidth."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        clock, cores = data.get("clock_mhz"), data.get("cores")
        if "cpu_speed" not in data and _number(clock) and _number(cores):
            data["cpu_speed"] = cpu_speed_of(float(clock), int(cores))
        if "bandwidth" not in data and _number(data.get("bandwidth_up_mbps")):
            data["bandwidth"] = float(data["bandwidth_up_mbps"])
        return data


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def cpu_speed_of(clock_mhz: float | None, cores: int) -> float:
    """v_i in GHz x cores; :data:`DEFAULT_CLOCK_GHZ` per core when ``clock_mhz`` is None."""
    ghz = DEFAULT_CLOCK_GHZ if clock_mhz is None else clock_mhz / 1000.0
    return ghz * cores


def bound_profile(measured: DeviceProfile, declared: DeviceProfile, source: str) -> DeviceProfile:
    """``measured`` bounded by the ``declared`` profile (read from ``source``): each of
    :data:`BOUNDED_FIELDS` is at most the declared value (``capped`` lists the lowered ones),
    and what only a declared device class carries (``cpu_share``, ``latency_ms``,
    ``local_epochs``, ``batch_size``) is taken from it. The probe summaries stay as measured;
    ``bounds`` records the caps so the coordinator bounds the intervals alike."""
    bounds = {name: float(getattr(declared, name)) for name in BOUNDED_FIELDS}
    update: dict[str, Any] = {name: min(float(getattr(measured, name)), cap) for name, cap in bounds.items()}
    capped = [name for name, cap in bounds.items() if float(getattr(measured, name)) > cap]
    for name in ("cpu_share", "latency_ms", "local_epochs", "batch_size"):
        if getattr(measured, name) is None:
            update[name] = getattr(declared, name)
    return measured.model_copy(update={**update, "declared_profile": source, "bounds": bounds, "capped": capped})


def profile_dirs() -> list[Path]:
    """Where profile NAMEs are looked up, in order: ``$SENSESHIELD_PROFILES`` entries, the
    repository's ``profiles/`` (source checkouts and editable installs), and
    ``<sys.prefix>/share/senseshield/profiles`` (installed data files). Only existing ones."""
    candidates = [Path(p) for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p]
    candidates.append(Path(__file__).resolve().parent.parent / "profiles")
    candidates.append(Path(sys.prefix) / "share" / "senseshield" / "profiles")
    seen: list[Path] = []
    for path in candidates:
        if path.is_dir() and path not in seen:
            seen.append(path)
    return seen


def profile_names() -> list[str]:
    """NAMEs :func:`load_profile` accepts (``*.yaml`` stems of :func:`profile_dirs`)."""
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.yaml")})


def _sentence(exc: ValidationError, source: str) -> str:
    """One sentence for the most telling error: unknown fields, then bad values, then missing."""
    rank = {"extra_forbidden": 0, "missing": 2}
    first = min(exc.errors(), key=lambda e: rank.get(e.get("type", ""), 1))
    where = ".".join(str(p) for p in first.get("loc", ())) or "the profile"
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(where, DeviceProfile.model_fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (
            f"Profile {source} has unknown field {where!r}{hint}; allowed fields: "
            f"{', '.join(DeviceProfile.model_fields)}."
        )
    if kind == "missing":
        return (
            f"Profile {source} lacks {where!r}; a profile needs bandwidth (r_i, MB/s) and "
            "cpu_speed (v_i, GHz x cores), or clock_mhz and cores instead of cpu_speed."
        )
    msg = first.get("msg", "is not allowed").removeprefix("Value error, ").rstrip(".")
    msg = msg[:1].lower() + msg[1:]
    return f"Profile {source} has {where}={first.get('input')!r}, which is not allowed: {msg}."


def read_profile(path: Path | str) -> DeviceProfile:
    """A :class:`DeviceProfile` from a YAML (or JSON) file; ConfigError naming the problem."""
    import yaml

    path = Path(path)
    source = repr(str(path))
    if not path.is_file():
        raise ConfigError(f"Profile file {source} does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Profile file {source} is not valid YAML ({exc.__class__.__name__}).") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"Profile file {source} must be a mapping with at least 'bandwidth' and 'cpu_speed'."
        )
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_sentence(exc, source)) from None


MEASURE = "auto"


def is_measured(spec: str) -> bool:
    """Whether a ``--profile`` spec measures this device: ``auto`` or ``auto:NAME|FILE``."""
    return spec == MEASURE or spec.startswith(MEASURE + ":")


def load_declared(spec: str) -> DeviceProfile:
    """A declared profile: a path (contains a ``/`` or ends in ``.yaml``/``.yml``/``.json``)
    -> :func:`read_profile`; a NAME -> ``NAME.yaml`` in :func:`profile_dirs`. Unknown names
    raise ConfigError listing the available ones (``auto`` measures the device: only an agent
    can, :func:`edge_agent.probes.load_profile`)."""
    if "/" in spec or os.sep in spec or spec.endswith((".yaml", ".yml", ".json")):
        return read_profile(spec)
    for directory in profile_dirs():
        candidate = directory / f"{spec}.yaml"
        if candidate.is_file():
            return read_profile(candidate)
    names = profile_names()
    choices = ", ".join(["auto", "auto:NAME|FILE", *names])
    raise ConfigError(
        f"Unknown profile {spec!r}; use a YAML file path or one of: {choices}."
    )
