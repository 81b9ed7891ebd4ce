"""The one development switch: what a test machine may do that a fleet must not.

Development mode is on when the process runs with ``SENSESHIELD_DEVELOPMENT=1`` or a service
was started with ``--insecure-dev`` (which sets the variable for the process, so every check
below sees the same answer). It allows, and only it allows:

* a service (``keyserver serve``, ``coordinator serve``, ``edge-agent join``) or ``job ...``
  without ``--trust``: every sender's key is then trusted on first use, so whoever speaks
  first is believed (docs/security.md);
* a trust file without a serial and an administrator's signature (hand-made in a test);
* an agent's ``--dev-noise-seed`` (replayable privacy noise, :mod:`senseshield.device_noise`).

Everything else is the same in both modes. ``senseshield fleet up`` and ``deploy/ansible``
provision signed trust files and never need it.
"""

from __future__ import annotations

import os

DEVELOPMENT_ENV = "SENSESHIELD_DEVELOPMENT"
DEV_FLAG = "--insecure-dev"


def development_mode() -> bool:
    """True when this process runs in development mode (``SENSESHIELD_DEVELOPMENT=1``)."""
    return os.environ.get(DEVELOPMENT_ENV, "").strip() == "1"


def enable() -> None:
    """Turn development mode on for this process (the ``--insecure-dev`` flag)."""
    os.environ[DEVELOPMENT_ENV] = "1"


def how_to_allow() -> str:
    """The end of a refusal sentence: how a test machine turns development mode on."""
    return f"on a development machine only, {DEV_FLAG} (or {DEVELOPMENT_ENV}=1)"
