"""Options that define a run, shared by `coordinator serve` and `senseshield fleet up`.

The main knobs are flags; every other strategy option is ``--set NAME=VALUE`` (repeatable),
validated by :class:`~senseshield.strategies.StrategyOptions` (``senseshield strategies
--options`` lists them), so the fleet commands do not repeat simulate's forty flags.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from senseshield.cli.common import fail, flag_sentence
from senseshield.errors import ConfigError

PASSWORD_ENV = "SENSESHIELD_MQTT_PASSWORD"
"""Environment variable with the MQTT password, used when ``--password-file`` is not given."""

Strategy = Annotated[str, typer.Option(help="Strategy name (see `senseshield strategies`).")]
Clients = Annotated[int, typer.Option(help="Number of simulated clients.")]
Rounds = Annotated[int, typer.Option(help="Federated rounds.")]
Dataset = Annotated[str, typer.Option(help="digits | mnist5k | idx:<dir> | synthetic (fleet agents with --dataset/--data may override theirs).")]
Model = Annotated[str, typer.Option(help="mlp | simplecnn | lenet5 | linear, or a model's import path or registered name.")]
Partition = Annotated[str, typer.Option(help="iid | dirichlet:ALPHA | categories:K (how shards are cut).")]
Seed = Annotated[int, typer.Option(help="Seed; the same seed gives the same result (the simulator's, on a fleet).")]
LocalEpochs = Annotated[int, typer.Option(help="Local epochs per round.")]
BatchSize = Annotated[int, typer.Option(help="Local minibatch size.")]
LearningRate = Annotated[float, typer.Option(help="Local SGD learning rate.")]
Scheme = Annotated[Optional[str], typer.Option(help="HE scheme override (see `senseshield schemes`); default: the strategy's.")]
KeyBits = Annotated[int, typer.Option(help="Paillier modulus bits (below 2048 warns).")]
TrainThreads = Annotated[int, typer.Option(help="Torch threads of every client's training and scoring (part of the run: the same seed and train threads on the same CPU give the same model).")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", help="Strategy option NAME=VALUE, repeatable (e.g. --set he_ratio=0.2).")]
Broker = Annotated[str, typer.Option(help="MQTT broker, mqtt://HOST[:PORT], or mqtts://HOST[:PORT] for TLS (with --ca-file).")]
Fleet = Annotated[str, typer.Option(help="Fleet name (the topic tree ss/v1/<fleet>/...).")]
Mqtt = Annotated[str, typer.Option("--mqtt", help="MQTT protocol version: 5, or 3.1.1 for brokers without 5.")]
Report = Annotated[bool, typer.Option("--report/--no-report", help="Render DIR/report.html (plots) at the end.")]
MinContributors = Annotated[int, typer.Option(help="The key server refuses aggregates with fewer distinct contributors.")]
LogLevel = Annotated[str, typer.Option(help="debug | info | warning | error.")]
Threads = Annotated[Optional[int], typer.Option(help="Threads of this process for inference, encryption and decryption (default: every core; `fleet up`: the cores shared among its agents).")]
# a secured broker (mqtts://, per-device credentials; deploy/ansible sets these up)
CaFile = Annotated[Optional[Path], typer.Option("--ca-file", help="CA certificate (PEM) that signed the broker's certificate; required by mqtts:// URLs.")]
Username = Annotated[Optional[str], typer.Option("--username", help="MQTT username (this device's credential).")]
PasswordFile = Annotated[Optional[Path], typer.Option("--password-file", help=f"File holding the MQTT password (first line); or set ${PASSWORD_ENV}; the password itself never goes on the command line.")]
IdentityFile = Annotated[Optional[Path], typer.Option("--identity", help="This process's identity key (Ed25519 signing + X25519 box, 0600; created if missing). Its public half goes in the fleet's trust file.")]
TrustFile = Annotated[Optional[Path], typer.Option("--trust", help="The fleet's signed trust file (name -> role and public keys; `senseshield identity build`): frames from anyone else, or not signed by the pinned key, are rejected. Required unless --insecure-dev.")]
InsecureDev = Annotated[bool, typer.Option("--insecure-dev", help="Development only: run without --trust (every key trusted on first use), with an unsigned trust file or --dev-noise-seed; the same as SENSESHIELD_DEVELOPMENT=1.")]


def identity_and_trust(name: str, identity: Path | None, default: Path, trust: Path | None, fleet: str,  # noqa: ANN201
                       *, required: bool = True):
    """Load (or create) this process's identity and admit the fleet's trust file (None: trust
    on first use, development mode only; :func:`~senseshield.runtime.identity.admit_trust`).
    The serials seen are kept beside the identity key."""
    from senseshield.runtime.identity import TRUST_HISTORY, Identity, admit_trust

    path = identity or default
    me = Identity.load_or_create(name, path)
    return me, admit_trust(trust, fleet=fleet, history=Path(path).parent / TRUST_HISTORY, required=required)


def development(insecure_dev: bool) -> None:
    """``--insecure-dev`` given: development mode for this process (:mod:`senseshield.development`)."""
    if insecure_dev:
        from senseshield.development import enable

        enable()
        logging.getLogger("senseshield").warning("--insecure-dev: development mode (no trust file needed; never on a fleet)")


def parse_sets(sets: list[str] | None) -> dict[str, object]:
    """``["tau=0.2", "eta_mi=none"]`` -> ``{"tau": 0.2, "eta_mi": None}`` (YAML scalars)."""
    import yaml

    options: dict[str, object] = {}
    for item in sets or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(f"--set {item!r} is not allowed; use NAME=VALUE, e.g. --set he_ratio=0.2.")
        text = value.strip()
        options[name.strip().replace("-", "_")] = None if text.lower() in ("none", "null") else yaml.safe_load(text)
    return options


def build_run_config(
    *, strategy: str, rounds: int, dataset: str, model: str, partition: str, seed: int,
    local_epochs: int, batch_size: int, lr: float, scheme: str | None, key_bits: int,
    clients: int, sets: list[str] | None, bandwidth: list[float] | None = None, cpu: list[float] | None = None,
    train_threads: int = 1,
):  # -> Job
    """The run's :class:`Job`; user mistakes end in one sentence (exit 2)."""
    from senseshield.job import Job
    from senseshield.strategies import StrategyOptions

    try:
        options = StrategyOptions(**parse_sets(sets))
        return Job(
            strategy=strategy, rounds=rounds, dataset=dataset, model=model, partition=partition,
            seed=seed, local_epochs=local_epochs, batch_size=batch_size, lr=lr, scheme=scheme,
            key_bits=key_bits, clients=clients, bandwidth=bandwidth, cpu=cpu, options=options,
            train_threads=train_threads,
        )
    except (ValidationError, ConfigError) as exc:
        fail(flag_sentence(exc))


JobFile = Annotated[Optional[Path], typer.Option("--job", help="A job file (YAML/TOML; docs/your-model-and-data.md): it defines the run, and the run flags are ignored.")]
DataFiles = Annotated[Optional[list[str]], typer.Option("--data", help="Each device's own data: files or glob patterns (e.g. 'har-data/device-*.npz'), one device per file, sorted; repeatable.")]


def data_files(items: list[str] | None) -> list[Path] | None:
    """``--data`` values (paths or glob patterns) -> the sorted files, one per device."""
    import glob

    if not items:
        return None
    files: list[Path] = []
    for item in items:
        found = sorted(glob.glob(item)) if any(c in item for c in "*?[") else ([item] if Path(item).exists() else [])
        # a CSV's sidecar (device-2.csv.yaml) describes its CSV; it is not a device of its own
        found = [f for f in found if not (f.endswith((".csv.yaml", ".csv.yml")) and Path(f[: f.rindex(".")]).is_file())]
        if not found:
            fail(f"--data {item!r} matches no file; give paths or glob patterns of the devices' data files.")
        files += [Path(f) for f in found]
    return files


def load_job_option(path: Path):  # -> senseshield.job.Job
    """The ``--job`` file; a mistake ends in one sentence naming the key (exit 2)."""
    from senseshield.job import load_job

    try:
        return load_job(path)
    except ConfigError as exc:
        fail(str(exc))


def check_mqtt(version: str) -> str:
    if version not in ("5", "3.1.1"):
        fail(f"--mqtt {version!r} is not allowed; use 5 or 3.1.1.")
    return version


def mqtt_security(
    broker: str, *, ca_file: Path | None, username: str | None, password_file: Path | None,
) -> dict[str, object]:
    """Keyword arguments of :meth:`senseshield.runtime.transport.Link.secure` from the CLI options.

    The password comes from ``password_file`` (its first line, so it never shows in ``ps``)
    or else from ``$SENSESHIELD_MQTT_PASSWORD``. Mistakes (a TLS URL without a CA file, a
    missing or empty password file, a password without a username) end in one sentence (exit 2).
    """
    import os

    from senseshield.runtime.transport import check_security

    password: str | None = None
    if password_file is not None:
        try:
            text = password_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--password-file {str(password_file)!r} cannot be read ({exc.__class__.__name__}); "
                 "give a readable file holding the password.")
        lines = text.splitlines()
        password = lines[0] if lines else ""
        if not password:
            fail(f"--password-file {str(password_file)!r} is empty; its first line must be the password.")
        if username is None:
            fail("--password-file needs --username NAME (the credential's user).")
    elif os.environ.get(PASSWORD_ENV):
        password = os.environ[PASSWORD_ENV]
        if username is None:
            fail(f"${PASSWORD_ENV} is set but --username is not; give --username NAME or unset it.")
    security = {"ca_file": ca_file, "username": username, "password": password}
    try:
        check_security(broker, **security)
    except ConfigError as exc:
        fail(str(exc))
    return {k: v for k, v in security.items() if v is not None}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged, not the stream it was
    created with (a command run in-process, e.g. by a test's CliRunner, must not leave a
    handler bound to a stream that is closed afterwards)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - StreamHandler.__init__ sets it
        pass


def starting(what: str, name: str, broker: str, fleet: str) -> None:
    """A service's first log line, said before it loads its runtime (seconds on a busy or
    small machine), so whoever started it sees at once that it runs."""
    import logging
    import os

    logging.getLogger("senseshield.start").info("%s %s starting (pid %d): fleet %r, broker %s; loading the runtime",
                                                 what, name, os.getpid(), fleet, broker)


def setup_logging(level: str, role: str, file: Path | None = None) -> None:
    """Log lines with time, role and level on stderr (and to ``file``)."""
    value = getattr(logging, level.upper(), None)
    if not isinstance(value, int):
        fail(f"--log-level {level!r} is not allowed; use debug, info, warning or error.")
    handlers: list[logging.Handler] = [_StderrHandler()]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file))
    logging.basicConfig(
        level=value, handlers=handlers, force=True,
        format=f"%(asctime)s.%(msecs)03d {role} %(levelname)s %(message)s", datefmt="%H:%M:%S",
    )
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    # Python warnings (an insecure test key, a library's notice) become one log line with the
    # warning's own sentence, not a source path and a line of code on stderr
    warnings_log = logging.getLogger("senseshield.warnings")

    def _show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        warnings_log.warning("%s: %s", category.__name__, message)

    warnings.showwarning = _show
