"""A client's share of a built-in data set: the simulator's clients and ``--shard I/N`` agents.

:func:`shards` partitions a :class:`~senseshield.data.Dataset` for a job exactly as the
simulator does (partition, per-client train/test split, device profiles by rank within a
category), so an agent holding shard ``i/N`` trains on the simulator's client ``i`` data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from senseshield.data.datasets import Dataset
from senseshield.data.partition import partition_dataset, split_train_test


@dataclass(frozen=True)
class LocalData:
    """A device's data: its training set and its own test split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return len(self.y_train)


@dataclass
class Shard:
    """Client ``index``'s share: its id, category (label group), data and device profile."""

    id: str
    index: int
    category: int | None
    data: LocalData
    bandwidth: float
    cpu_speed: float


def _profile_values(values: list[float] | None, ranks: list[int]) -> list[float]:
    if values is None:
        return [1.0] * len(ranks)
    return [float(values[r % len(values)]) for r in ranks]


def shards(config, dataset: Dataset) -> list[Shard]:  # config: senseshield.job.Job
    """Partition the data, split each client's share into local train/test, attach profiles."""
    part = partition_dataset(dataset.y, config.clients, config.partition, seed=config.seed)
    groups = part.groups
    # rank of each client inside its category: the paper assigns 50,45,...,30 MBps and
    # 24,16,...,8 CPUs to the 5 clients of every category.
    ranks: list[int] = []
    seen: dict[int, int] = {}
    for i in range(config.clients):
        g = int(groups[i]) if groups is not None else 0
        ranks.append(seen.get(g, 0))
        seen[g] = seen.get(g, 0) + 1
    bandwidth = _profile_values(config.bandwidth, ranks)
    cpu = _profile_values(config.cpu, ranks)
    clients: list[Shard] = []
    for i, idx in enumerate(part.indices):
        train, test = split_train_test(idx, test_fraction=config.test_fraction, seed=config.seed + i)
        clients.append(
            Shard(
                id=f"c{i:03d}",
                index=i,
                category=int(groups[i]) if groups is not None else None,
                data=LocalData(dataset.x[train], dataset.y[train], dataset.x[test], dataset.y[test]),
                bandwidth=bandwidth[i],
                cpu_speed=cpu[i],
            )
        )
    return clients


def device_shards(config, devices) -> list[Shard]:  # config: Job; devices: Sequence[LocalData]
    """One client per device data set (bring-your-own data in the simulator): client ``i``
    holds ``devices[i]`` and the ``i``-th bandwidth/CPU value of the job (cycled)."""
    ranks = list(range(len(devices)))
    bandwidth = _profile_values(config.bandwidth, ranks)
    cpu = _profile_values(config.cpu, ranks)
    return [Shard(id=f"c{i:03d}", index=i, category=None, data=data, bandwidth=bandwidth[i], cpu_speed=cpu[i])
            for i, data in enumerate(devices)]
