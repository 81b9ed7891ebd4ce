"""A new job checked against this device and made ready to join (:func:`prepare`): the job's
config, strategy, the device's data for it (its own source, or a shard of a built-in
dataset) and the job's model, checked to be the run's. No transport; torch loads when a
job is prepared, not when this module is imported."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_agent.dataspec import DataSpec
from senseshield.data import load_dataset
from senseshield.data.local import describe_data, load_local_data
from senseshield.data.shards import shards
from senseshield.errors import ConfigError
from senseshield.extras import require
from senseshield.job import Job, announced_run, device_index, initial_model, opacus_use
from senseshield.rounds import LocalData
from senseshield.runtime.protocol.messages import FleetConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("senseshield.agent")


@dataclass(frozen=True)
class PreparedRun:
    """A checked ``fleet/config``: what joining it needs (built before anything changes)."""

    msg: FleetConfig
    config: Job
    strategy: object
    data: LocalData
    model: torch.nn.Module
    index: int
    count: int


def prepare(msg: FleetConfig, spec: DataSpec, agent_id: str, *, rebuild_initial: bool = False) -> PreparedRun:
    """Check a new run's config against this device (config fields, strategy, the local
    dataset's shapes, the model's size) and load its data; ProtocolError/ConfigError.
    ``rebuild_initial``: the initial model must be the one the job's seed builds here (a
    signed job whose operator could not build its model signs no initial digest; the
    device checks the coordinator's initial model itself)."""
    from senseshield.he.base import model_digest
    from senseshield.training import layout_of

    config, strategy, _ = announced_run(msg.config)
    why = opacus_use(config, strategy)
    if why is not None:  # `pip install senseshield` alone has no Opacus: decline, saying what to install
        require(("opacus",), f"This job ({why})")
    if config.data is not None or spec.sources:
        data = own_data(config, msg, spec)
        index, count = spec.index if spec.index is not None else device_index(agent_id), 1
    else:
        data, index, count = shard_data(config, msg, spec)
    model, initial = initial_model(config, tuple(msg.input_shape), msg.num_classes)
    if layout_of(model).size != msg.initial.size:
        raise ConfigError(f"The run's model {config.model!r} has {msg.initial.size} parameters; here it has {layout_of(model).size}; versions differ.")
    if rebuild_initial and model_digest(initial) != model_digest(msg.initial):
        raise ConfigError(f"The run's initial model is not the one the signed job's seed {config.seed} builds for "
                          f"model {config.model!r} here; a coordinator cannot move the model a job starts from.")
    return PreparedRun(msg, config, strategy, data, model, index, count)


def own_data(config: Job, msg: FleetConfig, spec: DataSpec) -> LocalData:
    """The device's own data source the job uses, loaded and checked against the job."""
    sources = spec.sources
    name = config.data
    if name is None:
        if len(sources) != 1:
            raise ConfigError(f"The job names no data source and this device has {len(sources)} "
                              f"({', '.join(sorted(sources))}); the job must set data: NAME.")
        name = next(iter(sources))
    if name not in sources:
        have = ", ".join(sorted(sources)) or "none"
        raise ConfigError(f"The job uses data source {name!r}; this device has {have} (edge-agent join --data {name}=PATH).")
    data = load_local_data(sources[name], config, input_shape=msg.input_shape, num_classes=msg.num_classes)
    log.info("data %s (%s): %s", name, sources[name], describe_data(data).line())
    return data


def shard_data(config: Job, msg: FleetConfig, spec: DataSpec) -> tuple[LocalData, int, int]:
    """Shard I/N of a built-in dataset (simulations and controlled trials)."""
    index, count = spec.shard if spec.shard is not None else (0, 1)
    local_config = config.model_copy(update={
        "dataset": spec.dataset or config.dataset,
        "clients": count,
        "partition": spec.partition or (config.partition if spec.shard is not None else "iid"),
    })
    dataset = load_dataset(local_config.dataset, seed=config.seed)
    if tuple(dataset.input_shape) != tuple(msg.input_shape) or dataset.num_classes != msg.num_classes:
        raise ConfigError(
            f"Dataset {local_config.dataset!r} has inputs {tuple(dataset.input_shape)} and "
            f"{dataset.num_classes} classes; the run's model needs {tuple(msg.input_shape)} and {msg.num_classes}."
        )
    return shards(local_config, dataset)[index].data, (spec.index if spec.index is not None else index), count
