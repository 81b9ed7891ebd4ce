"""The command lines: ``senseshield`` (:mod:`.main`) and what its sub-commands share.

``common`` (consoles, one-sentence errors, progress bars), ``run`` (the options that define
a run, shared with ``coordinator serve``), ``attack``, ``compare``, ``check``, ``top`` (``fleet top``). The role
commands (``edge-agent``, ``coordinator``, ``keyserver``) live in their role packages.
"""

from senseshield.cli.main import app, main

__all__ = ["app", "main"]
