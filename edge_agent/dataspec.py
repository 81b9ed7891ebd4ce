"""Where an edge agent's data comes from (:class:`DataSpec`), parsed from ``edge-agent join``'s
``--data`` and ``--shard`` (one sentence naming a bad value). No transport, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from senseshield.errors import ConfigError


@dataclass(frozen=True)
class DataSpec:
    """Where the agent's data comes from: its own files (``sources``: name -> path or
    ``python:`` loader, see :mod:`senseshield.data.local`), else a built-in dataset,
    optionally one shard of a partition (simulations and controlled trials)."""

    dataset: str | None = None  # None: the run's dataset
    shard: tuple[int, int] | None = None  # (index, count)
    partition: str | None = None  # None: the run's partition
    sources: dict[str, str] = field(default_factory=dict)  # --data [NAME=]PATH
    index: int | None = None  # seed index; default: the shard's, else a hash of the agent id

    @staticmethod
    def parse_sources(items: list[str] | None) -> dict[str, str]:
        """``--data [NAME=]PATH`` values -> {name: path}; an unnamed source is ``default``.
        A path that does not exist is refused here, with its name."""
        sources: dict[str, str] = {}
        for item in items or []:
            name, sep, path = item.partition("=")
            if not sep or item.startswith(("python:", "/", ".")) or "/" in name:
                name, path = "default", item
            name = name.strip()
            if not name.replace("-", "_").isidentifier():
                raise ConfigError(f"--data {item!r} is not allowed; use PATH or NAME=PATH with a name of letters, digits, '-' or '_'.")
            if name in sources:
                raise ConfigError(f"--data names source {name!r} twice; give each source once (NAME=PATH).")
            if not path.startswith("python:") and not Path(path).exists():
                raise ConfigError(f"--data {item!r}: {path!r} does not exist; give a .npz, .csv, image folder or python:module:function.")
            sources[name] = path
        return sources

    @staticmethod
    def parse_shard(text: str | None) -> tuple[int, int] | None:
        if text is None:
            return None
        try:
            i, n = (int(v) for v in text.split("/"))
        except ValueError:
            raise ConfigError(f"--shard {text!r} is not allowed; use I/N with 0 <= I < N, e.g. 3/20.") from None
        if not 0 <= i < n:
            raise ConfigError(f"--shard {text!r} is not allowed; use I/N with 0 <= I < N, e.g. 3/20.")
        return i, n
