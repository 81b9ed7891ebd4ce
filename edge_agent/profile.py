"""``edge-agent profile``: measure this device (:mod:`edge_agent.probes`) or read a declared
profile, and print it (optionally with the inference latency of an exported model)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.errors import ConfigError
from senseshield.profiles import MEASURE, DeviceProfile
from edge_agent.probes import DEFAULT_SCHEME, load_profile


def with_inference_latency(profile: DeviceProfile, model: Path, *, repeats: int) -> DeviceProfile:
    """``profile`` plus the onnxruntime latency of ``model`` (p50/p95 per sample and per batch of 32)."""
    import time

    from senseshield.inference import latency, load_session

    t = time.perf_counter()
    session = load_session(model, threads=profile.cores)
    result = latency(session, session.input_shape, repeats=repeats)
    numbers = {f"b{b}_{q}_ms": float(v[f"{q}_ms"]) for b, v in result["batches"].items() for q in ("p50", "p95")}
    timings = dict(profile.timings, inference=time.perf_counter() - t)
    return profile.model_copy(update={"inference_ms": numbers, "timings": timings})


def profile_command(
    scheme: Annotated[
        str, typer.Option(help="HE scheme to time, the fleet's (see `senseshield schemes`).")
    ] = DEFAULT_SCHEME,
    key_bits: Annotated[
        Optional[int],
        typer.Option(help="Key size in bits for the Paillier schemes (default: the scheme's, 2048)."),
    ] = None,
    broker: Annotated[
        Optional[str],
        typer.Option(help="mqtt://HOST[:PORT] to measure bandwidth through (default: not measured)."),
    ] = None,
    fleet: Annotated[str, typer.Option(help="Fleet whose topic tree carries the bandwidth probe.")] = defaults.FLEET,
    quick: Annotated[bool, typer.Option("--quick", help="Shorter benchmarks (smaller matmul, fewer encryptions, smaller probe).")] = False,
    model: Annotated[
        Optional[Path],
        typer.Option(help="The fleet's ONNX model (`senseshield export`): also measure its inference latency."),
    ] = None,
    declared: Annotated[
        Optional[str],
        typer.Option(help="Declared profile NAME or FILE.yaml bounding the measured bandwidth and CPU speed (as `join --profile auto:NAME`)."),
    ] = None,
    probe: Annotated[str, typer.Option(help="Bandwidth probe plan: robust (median of several probes) | single (the old best-of-two).", hidden=True)] = "robust",
) -> None:
    """Measure this device and print its profile as JSON on stdout.

    Board, CPU, cores, clock and memory; float32 matmul GFLOP/s (torch); values encrypted per
    second with the fleet's HE scheme and key size; with --broker, MB/s through the broker
    (reported for up and down alike). Every figure is the median of several probes, except the
    encryption rate: the best of 12 bursts spread over 2.4 s; `measurements` gives min/median/max,
    quartiles, probe count, confidence and which statistic is the figure. `cpu_speed`
    (GHz x cores) and `bandwidth` (MB/s) are the v_i and r_i the coordinator uses, at most
    the --declared profile's; `timings` says how long each measurement took in seconds.
    """
    from senseshield.cli.common import console, fail

    try:
        console.print(f"Profiling this device ({scheme}{', quick' if quick else ''})...", highlight=False)
        spec = MEASURE if declared is None else f"{MEASURE}:{declared}"
        profile = load_profile(spec, scheme=scheme, key_bits=key_bits, broker=broker, fleet=fleet, quick=quick,
                               probe=probe)
        if model is not None:
            profile = with_inference_latency(profile, model, repeats=30 if quick else 200)
    except ConfigError as exc:
        fail(str(exc))
    except ConnectionError as exc:
        fail(str(exc))
    typer.echo(profile.model_dump_json(indent=2))
