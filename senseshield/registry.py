"""A tiny name -> object registry used for strategies, HE schemes, scores, datasets, models.

Registering instead of branching keeps ``if name == ...`` chains out of the code: a new
strategy is one decorated class in one file.

A registry with an entry-point ``group`` (strategies ``senseshield.strategies``, HE schemes
``senseshield.schemes``, models ``senseshield.models``, training functions
``senseshield.training``) also finds objects that installed packages declare there, e.g. in
a plug-in's ``pyproject.toml``::

    [project.entry-points."senseshield.strategies"]
    my-fedavg = "my_plugin.strategies:MyFedAvg"

They are looked up lazily (:mod:`importlib.metadata`), only for a name that is not built in,
and loaded once; a built-in name always wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Generic, TypeVar

from senseshield.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str, *, group: str | None = None) -> None:
        self.kind = kind
        self.group = group  # entry-point group of installed plug-ins, if any
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` adds the decorated object."""

        def decorate(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered.")
            self._items[name] = obj
            return obj

        return decorate

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        """Return the object registered as ``name`` (built in, else an installed plug-in's
        entry point); unknown names raise :class:`ConfigError`."""
        found = self.find(name)
        if found is None:
            raise ConfigError(
                f"Unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}."
            )
        return found

    def find(self, name: str) -> T | None:
        """The object registered as ``name`` (or an entry point's), else None (for callers
        with their own error)."""
        if name in self._items or not isinstance(name, str):
            return self._items.get(name)  # type: ignore[arg-type]
        ep = self.entry_points().get(name)
        if ep is None:
            return None
        origin = f"entry point '{ep.name} = {ep.value}' (group {self.group!r})"
        try:
            obj = ep.load()
        except Exception as exc:
            from senseshield.callables import describe_exception

            raise ConfigError(
                f"{self.kind.capitalize()} {name!r} from {origin} cannot be loaded: "
                f"{describe_exception(exc)}."
            ) from exc
        if not callable(obj):
            raise ConfigError(
                f"{self.kind.capitalize()} {name!r} from {origin} is an object of type "
                f"{type(obj).__name__}, not a callable."
            )
        self._items[name] = obj
        return obj

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        """Entry points of this registry's group by name (the first by value wins on a clash)."""
        found: dict[str, metadata.EntryPoint] = {}
        if self.group is None:
            return found
        for ep in sorted(metadata.entry_points(group=self.group), key=lambda e: e.value):
            found.setdefault(ep.name, ep)
        return found

    def names(self) -> list[str]:
        """Built-in names and those of installed plug-ins (not loaded)."""
        return sorted(set(self._items) | set(self.entry_points()))

    def items(self) -> list[tuple[str, T]]:
        """Registered objects (plug-ins only once loaded by :meth:`find`)."""
        return sorted(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items or (isinstance(name, str) and name in self.entry_points())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
