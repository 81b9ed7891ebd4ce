"""SenseShield: federated learning for fleets of small edge devices.

The front door for code (the command lines use the same objects)::

    import senseshield as ss

    job = ss.load_job("examples/har/job.yaml")            # or ss.Job(strategy=..., model=..., ...)
    devices = [ss.load_local_data(p, input_shape=job.input_shape, num_classes=job.num_classes)
               for p in ["har-data/device-0.npz", "har-data/device-1.npz"]]
    result = ss.simulate(job, devices=devices)             # in this process: real training and HE
    report = ss.run_local_fleet(job, agents=2, data=[...], out="har-run")  # OS processes here
    job_id = ss.submit(job, broker="mqtt://coordinator-host:1883", fleet="lab")  # a running fleet

Public names are the ones in ``__all__``; everything else is private by convention.
Sub-packages, for the curious: ``engine`` (the pure privacy engine), ``he`` (HE schemes),
``strategies``, ``data``, ``models``, ``runtime`` (MQTT, services, fleets), ``trials``,
``cli``. See docs/architecture.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute): imported on first use, so `import senseshield` stays light
_EXPORTS = {
    "Job": ("senseshield.job", "Job"),
    "Selection": ("senseshield.job", "Selection"),
    "load_job": ("senseshield.job", "load_job"),
    "StrategyOptions": ("senseshield.strategies", "StrategyOptions"),
    "STRATEGIES": ("senseshield.strategies", "STRATEGIES"),
    "SCHEMES": ("senseshield.he", "SCHEMES"),
    "MODELS": ("senseshield.models", "MODELS"),
    "build_model": ("senseshield.models", "build_model"),
    "model_with_weights": ("senseshield.models", "model_with_weights"),
    "LocalData": ("senseshield.data.shards", "LocalData"),
    "load_local_data": ("senseshield.data.local", "load_local_data"),
    "RunResult": ("senseshield.results", "RunResult"),
    "ConfigError": ("senseshield.errors", "ConfigError"),
    "JobClient": ("senseshield.runtime.jobs", "JobClient"),
}

__all__ = ["__version__", "simulate", "run_local_fleet", "submit", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'senseshield' has no attribute {name!r}")


def simulate(job: Any, *, devices: Any = None, trace: bool = False, noise_seed: int | None = None) -> Any:
    """Run ``job`` in this process (real training, encryption and DP accounting); ``devices``:
    one :class:`LocalData` per client (else shards of ``job.dataset``); ``noise_seed``: replay
    the clients' privacy noise from it (reproducible; default: fresh OS entropy, as devices
    draw it). Returns a :class:`RunResult` (``result.models``: the final model of every cluster as
    a flat vector; ``result.final_model(k)``: cluster ``k``'s as a ready ``torch.nn.Module``)."""
    from senseshield.simulation import run_simulation

    return run_simulation(job, devices=devices, trace=trace, noise_seed=noise_seed)


def run_local_fleet(job: Any, *, agents: int, out: Any, data: Any = None, broker: str | None = None,
                    timeout: float | None = None) -> dict:
    """Run ``job`` on a fleet of OS processes on this machine (an embedded broker unless
    ``broker``; key server, coordinator, ``agents`` edge agents with shard i/N or ``data[i]``),
    as ``senseshield fleet up`` does; returns ``report.json`` as a dict."""
    from pathlib import Path

    from senseshield.runtime.fleet import FleetOptions, fleet_up

    files = [Path(d) if d is not None else None for d in data] if data is not None else None
    return fleet_up(job, FleetOptions(agents=agents, out=Path(out), broker=broker, data=files), timeout=timeout)


def submit(job: Any, *, broker: str, fleet: str = "default", **security: Any) -> str:
    """Queue ``job`` on the running coordinator of ``fleet`` (``senseshield job submit``);
    returns the job id. ``security``: ``ca_file``, ``username``, ``password`` for a secured broker."""
    from senseshield.runtime.jobs import JobClient

    with JobClient(broker, fleet=fleet, **security) as client:
        return client.submit(job)
