"""What every `senseshield` sub-command shares: consoles, one-sentence errors, progress bars.

User mistakes end with :func:`fail`: one sentence on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

from typing import Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from senseshield.errors import STORAGE_EXIT, ConfigError, StorageError

console = Console(stderr=True)  # progress, errors, notes
out = Console()  # results


def fail(message: str) -> None:
    """Print ``error: <message>`` on stderr and exit with code 2 (``message`` as written: its
    brackets, e.g. ``senseshield[dp]``, are not markup)."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def storage_stop(exc: StorageError, service: str, then: str) -> None:
    """A service that could not write a file: one sentence naming the path, the OS reason
    and what happens next, in the service's log (stderr when it has none), and exit code 74
    (no traceback)."""
    import logging

    line = f"{exc}; {service} stopped (exit {STORAGE_EXIT}): {then}."
    if logging.getLogger().handlers:  # a service: setup_logging
        logging.getLogger().error("%s", line)
    else:
        console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(STORAGE_EXIT)


def validation_sentence(exc: ValidationError) -> str:
    """The first pydantic error as one sentence naming the flag, the value and the rule."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # already one sentence naming value and choices
        return str(cause)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "options") or "value"
    where = where.replace("_", "-")
    msg = first.get("msg", "is not allowed").removeprefix("Value error, ")
    return f"--{where}={first.get('input')!r} is not allowed: {msg.rstrip('.')}."


def flag_sentence(exc: ConfigError | ValidationError) -> str:
    """What a command says of a bad value given by flags: :func:`validation_sentence` (the
    flag's spelling, ``--clients=0``) of a ``ValidationError``, also when it is the cause of
    the ``ConfigError`` a :class:`~senseshield.job.Job` raises; else the error's sentence."""
    cause = exc if isinstance(exc, ValidationError) else exc.__cause__
    return validation_sentence(cause) if isinstance(cause, ValidationError) else str(exc)


def version_option(program: str) -> Any:
    """The ``--version`` option of ``program``'s top level: prints ``PROGRAM VERSION`` (the
    package's one version, ``senseshield.__version__``) and exits 0."""

    def show(value: bool) -> None:
        if value:
            from senseshield import __version__

            out.print(f"{program} {__version__}", highlight=False)
            raise typer.Exit()

    return typer.Option("--version", callback=show, is_eager=True, help="Print the version and exit.")


def numbers(
    text: Optional[str], flag: str, kind: type = float, example: str = "0.1,0.2"
) -> Optional[list[Any]]:
    """Parse a comma-separated list of numbers given to ``flag`` (None stays None)."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        fail(f"{flag} {text!r} is not a comma-separated list of {noun}, e.g. {example}.")
    return None


def phase_progress(bar: Progress, label: str = ""):  # -> Callable[[str, int, int], None]
    """A ``progress(phase, done, total)`` callback that keeps one task per phase on ``bar``."""
    tasks: dict[str, int] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(f"{label} {phase}".strip(), total=total)
        bar.update(tasks[phase], completed=done)

    return progress


def progress_bar(quiet: bool = False, *, transient: bool = False) -> Progress:
    """The project's progress bar (description, bar, done/total, elapsed) on stderr."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, disable=quiet, transient=transient)
