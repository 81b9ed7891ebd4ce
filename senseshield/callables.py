"""User code named by an import path, and calling it with the job's keywords.

Shared by the models (``senseshield.models``) and the Python data loaders
(``senseshield.data.local``), so that both accept the same two forms:

* ``package.module:attr``      a module importable from ``sys.path`` (``attr`` may be dotted,
                               e.g. ``mypkg.nets:Factory.build``);
* ``path/to/file.py:attr``     a Python file, relative to the current directory or absolute;
                               it is loaded once per resolved path as its own module, with
                               its folder first on ``sys.path`` while it loads, so its
                               top-level imports find the modules beside it (as
                               ``python file.py`` would).

Every failure is a :class:`ConfigError` of one sentence that names the path and says what
went wrong (the user's exception message included); the original exception is chained as
``__cause__`` for debugging.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from senseshield.errors import ConfigError

__all__ = [
    "IMPORT_PATH_FORMS",
    "call_with_job",
    "describe_exception",
    "is_import_path",
    "resolve_import_path",
    "resolve_named",
]

#: How an import path is spelled, for error messages.
IMPORT_PATH_FORMS = "'package.module:callable' or 'path/to/file.py:callable'"


def is_import_path(spec: str) -> bool:
    """True when ``spec`` has the ``module:attr`` form (a registered name has no colon)."""
    return isinstance(spec, str) and ":" in spec


def describe_exception(exc: BaseException) -> str:
    """``"KeyError ('x')"``: the exception's type and the first line of its message."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__} ({message[0]})" if message else type(exc).__name__


def _load_file(path_text: str, spec: str) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{spec!r} names the file {path_text!r}, which does not exist "
            f"(relative paths are taken from {str(Path.cwd())!r})."
        )
    resolved = path.resolve()
    name = "senseshield_user_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    with _LOADING:
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, resolved)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError(f"{spec!r} names {path_text!r}, which Python cannot load as a module.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            with _folder_on_path(resolved.parent):
                loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ConfigError(
                f"Loading {path_text!r} for {spec!r} failed: {describe_exception(exc)}."
            ) from exc
        return module


# sys.path is the process's: one file loads at a time (re-entrant: a file may load another)
_LOADING = threading.RLock()


@contextmanager
def _folder_on_path(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a file of it loads, as ``python file.py`` has it
    there: the file's own imports find the modules beside it. Taken off afterwards (unless it
    was there before), so it shadows nothing for the rest of the process."""
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()  # a helper written just before the load is seen
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _load_module(module_name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and (module_name + ".").startswith(missing + "."):
            raise ConfigError(
                f"Module {module_name!r} of {spec!r} cannot be imported ({missing!r} is not "
                f"installed or not on sys.path); give {IMPORT_PATH_FORMS}."
            ) from exc
        raise ConfigError(
            f"Importing module {module_name!r} of {spec!r} failed: {describe_exception(exc)}."
        ) from exc


def resolve_import_path(spec: str, *, what: str, label: str | None = None
                        ) -> Callable[..., Any]:
    """The callable named by ``spec`` (``module:attr`` or ``file.py:attr``).

    ``what`` says what the callable is for (``"model"``, ``"data loader"``) in messages;
    ``label`` is how the user wrote it, if not ``spec`` (e.g. with a ``python:`` prefix).
    """
    where, _, attr = spec.rpartition(":")
    spec = label or spec
    if not where or not attr:
        raise ConfigError(
            f"{what.capitalize()} {spec!r} is not an import path; give {IMPORT_PATH_FORMS}."
        )
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _load_file(where, spec) if is_file else _load_module(where, spec)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{what.capitalize()} {spec!r}: {where!r} has no attribute {attr!r}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"{what.capitalize()} {spec!r} is an object of type {type(obj).__name__}, not a "
            f"callable."
        )
    return obj


def call_with_job(
    fn: Callable[..., Any], spec: str, job: Mapping[str, Any], args: Mapping[str, Any], *,
    what: str,
) -> Any:
    """Call ``fn(**args, **job_keywords)`` and turn anything it raises into a ConfigError.

    ``job`` holds the values the job supplies (``input_shape``, ``num_classes``); each is
    passed only when ``fn``'s signature has a parameter of that name or ``**kwargs``. A
    keyword in ``args`` that also comes from the job is refused.
    """
    clash = sorted(set(args) & set(job))
    if clash:
        raise ConfigError(
            f"Arguments {clash} of {what} {spec!r} come from the job and cannot be set "
            f"in its arguments."
        )
    try:
        params = dict(inspect.signature(fn).parameters)
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):  # some builtins have no signature: pass everything
        params, takes_all = {}, True
    keywords = [n for n, p in params.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in job]
    unknown = [] if takes_all else sorted(set(args) - set(keywords))
    if unknown:
        raise ConfigError(
            f"{what.capitalize()} {spec!r} does not accept argument(s) {unknown}; it accepts: "
            f"{', '.join(keywords) or 'none'}."
        )
    passed = {k: v for k, v in job.items() if takes_all or k in params}
    try:
        return fn(**args, **passed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{what.capitalize()} {spec!r} raised {describe_exception(exc)} when called with "
            f"arguments {sorted({**args, **passed})}."
        ) from exc


def resolve_named(name: Any, registry: Any, *, what: str) -> Callable[..., Any]:
    """What a job names by a registered name (built in or an installed package's entry
    point, see :class:`senseshield.registry.Registry`) or an import path; ConfigError
    naming the allowed names otherwise. ``what`` (``"model"``, ``"training function"``) is
    used in messages."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{what.capitalize()} {name!r} is not allowed; give a registered name "
            f"({', '.join(registry.names())}) or an import path {IMPORT_PATH_FORMS}."
        )
    found = registry.find(name)
    if found is not None:
        return found
    if is_import_path(name):
        return resolve_import_path(name, what=what)
    raise ConfigError(
        f"Unknown {what} {name!r}; choose one of: {', '.join(registry.names())}, or give an "
        f"import path {IMPORT_PATH_FORMS}."
    )
