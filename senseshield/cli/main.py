"""``senseshield``: the researcher's command line.

Exit codes: 0 success; 2 a user mistake (unknown name, bad value, missing file), printed
as one sentence without a traceback; 1 an unexpected internal error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from senseshield.errors import ConfigError, SenseShieldError, StorageError

app = typer.Typer(
    help="SenseShield: federated learning with sensitivity-guided selective HE and DP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
from senseshield import defaults  # noqa: E402
from senseshield.cli.common import version_option  # noqa: E402


@app.callback()
def _root(version: Annotated[bool, version_option("senseshield")] = False) -> None:
    """SenseShield: federated learning with sensitivity-guided selective HE and DP."""


from senseshield.cli.attack import attack_app  # noqa: E402

app.add_typer(attack_app, name="attack")
from senseshield.cli.check import check_app  # noqa: E402
from senseshield.cli.job import job_app  # noqa: E402

app.add_typer(check_app, name="check")
app.add_typer(job_app, name="job")
from senseshield.cli.trust import identity_app  # noqa: E402

app.add_typer(identity_app, name="identity")
from senseshield.cli import run as _run  # noqa: E402
from senseshield.cli.common import console, out  # noqa: E402
from senseshield.cli.common import fail as _fail  # noqa: E402
from senseshield.cli.common import phase_progress, progress_bar, storage_stop  # noqa: E402
from senseshield.cli.common import flag_sentence as _flag_sentence  # noqa: E402


def _floats(text: Optional[str], flag: str) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{flag} {text!r} is not a comma-separated list of numbers, e.g. 50,45,40.")
    return None


def _profile_file(path: Path) -> dict[str, list[float]]:
    import yaml

    if not path.is_file():
        _fail(f"Profile file {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        _fail(f"Profile file {str(path)!r} is not valid YAML/JSON ({exc.__class__.__name__}).")
    if not isinstance(data, dict) or not set(data) <= {"bandwidth", "cpu"}:
        _fail(f"Profile file {str(path)!r} must be a mapping with keys 'bandwidth' and/or 'cpu'.")
    return {k: [float(x) for x in v] for k, v in data.items()}


@app.command()
def strategies() -> None:
    """List the registered strategies."""
    from senseshield.strategies import STRATEGIES

    table = Table("strategy", "HE scheme", "summary")
    for name, cls in STRATEGIES.items():
        table.add_row(name, cls.scheme or "-", cls.summary)
    out.print(table)


@app.command()
def schemes() -> None:
    """List the registered homomorphic-encryption schemes."""
    from senseshield.he import SCHEMES

    table = Table("scheme", "per-client masks", "description")
    for name, cls in SCHEMES.items():
        ragged = "yes" if cls.ragged_masks else "with per-client-mask strategies" if cls.ragged_capable else "no (shared mask)"
        table.add_row(name, ragged, cls.description)
    out.print(table)


@app.command()
def simulate(
    strategy: _run.Strategy = defaults.STRATEGY,
    dataset: _run.Dataset = defaults.DATASET,
    model: _run.Model = defaults.MODEL,
    clients: _run.Clients = defaults.CLIENTS,
    rounds: _run.Rounds = defaults.ROUNDS,
    local_epochs: _run.LocalEpochs = defaults.LOCAL_EPOCHS,
    batch_size: _run.BatchSize = defaults.BATCH_SIZE,
    lr: _run.LearningRate = defaults.LR,
    partition: _run.Partition = defaults.PARTITION,
    seed: _run.Seed = defaults.SEED,
    bandwidth: Annotated[Optional[str], typer.Option(help="Client bandwidths r_i (MB/s), comma-separated, cycled within each category.")] = None,
    cpu: Annotated[Optional[str], typer.Option(help="Client CPU speeds v_i (GHz x cores), comma-separated, cycled within each category.")] = None,
    profile_file: Annotated[Optional[Path], typer.Option(help="YAML/JSON with `bandwidth:` and `cpu:` lists (instead of the flags).")] = None,
    he_ratio: Annotated[float, typer.Option(help="Encrypted fraction for maskcrypt / fedml-he.")] = 0.1,
    security_c: Annotated[float, typer.Option(help="C in the security level 1 - C exp(-B alpha).")] = 0.5,
    security_b: Annotated[float, typer.Option(help="B in the security level 1 - C exp(-B alpha).")] = 2.0,
    eta_mi: Annotated[float, typer.Option(help="Mutual-information bound in bits (SenseCrypt eq. 8).")] = 2.0,
    no_mi: Annotated[bool, typer.Option("--no-mi", help="Disable the mutual-information constraint.")] = False,
    cluster_epsilon: Annotated[Optional[float], typer.Option(help="DP epsilon of the clustering vectors (default: no noise).")] = None,
    key_bits: _run.KeyBits = defaults.KEY_BITS,
    scheme: _run.Scheme = None,
    train_threads: _run.TrainThreads = defaults.TRAIN_THREADS,
    tau: Annotated[float, typer.Option(help="SelectiveShield Fisher threshold tau in [0, 1].")] = 0.1,
    rho: Annotated[float, typer.Option(help="SelectiveShield consensus threshold rho in [0, 1].")] = 0.5,
    clip: Annotated[float, typer.Option(help="DP clipping norm C (update or per-sample).")] = 1.0,
    sigma: Annotated[float, typer.Option(help="DP noise multiplier sigma (>= 0); ignored with --target-epsilon.")] = 1.0,
    target_epsilon: Annotated[Optional[float], typer.Option(help="Calibrate sigma (Opacus) so the run spends this epsilon.")] = None,
    delta: Annotated[float, typer.Option(help="DP delta.")] = 1e-5,
    sample_rate: Annotated[float, typer.Option(help="Poisson client sampling rate q in (0, 1].")] = 1.0,
    dp_quorum: Annotated[float, typer.Option(help="masked-dp: agents size their noise shares for this fraction of a round's participants (the guarantee at sigma holds while at least that many contribute), in (0, 1].")] = 1.0,
    server_lr: Annotated[float, typer.Option(help="Server learning rate eta_g (1 = FedAvg).")] = 1.0,
    dp_ratio: Annotated[float, typer.Option(help="Selective-DP: fraction of coordinates noised (top-k of |g|*|dw|).")] = 0.1,
    budget_skew: Annotated[float, typer.Option(help="Selective-DP: most sensitive coordinate gets (1+skew) x noise.")] = 1.0,
    rho_syn: Annotated[int, typer.Option(help="Alt-FL: secondary (synthetic/DP) rounds per period.")] = 1,
    rho_tot: Annotated[int, typer.Option(help="Alt-FL: period of the interleaving schedule.")] = 2,
    synthetic_epsilon: Annotated[float, typer.Option(help="Alt-FL: epsilon of the DP synthetic-data provider.")] = 1.0,
    score: Annotated[Optional[str], typer.Option(help="Clients' sensitivity score: taylor | fisher | grad_delta | leakage (input/output layers and biases first; docs/attacks.md). Default: the strategy's.")] = None,
    plain_noise: Annotated[float, typer.Option(help="SenseCrypt hybrid: Gaussian noise of this times the plaintext part's norm on that part (against image reconstruction; not DP; docs/attacks.md). 0 = off.")] = 0.0,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write the result JSON here.")] = None,
    job_file: _run.JobFile = None,
    data: _run.DataFiles = None,
    noise_seed: Annotated[Optional[int], typer.Option(help="Replay the clients' privacy noise from this seed (reproducible runs; a fleet's noise is secret). Default: fresh OS entropy, as on devices.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run a strategy in one process with real training and real encryption (a job file
    and each device's own data with --job/--data)."""
    if noise_seed is not None and noise_seed < 0:
        _fail(f"--noise-seed {noise_seed} is not allowed; use 0 or more.")
    from senseshield.job import Job
    from senseshield.simulation import run_simulation
    from senseshield.strategies import StrategyOptions

    profiles = _profile_file(profile_file) if profile_file else {}
    try:
        options = StrategyOptions(
            he_ratio=he_ratio,
            security_c=security_c,
            security_b=security_b,
            eta_mi=None if no_mi else eta_mi,
            cluster_epsilon=cluster_epsilon,
            tau=tau,
            rho=rho,
            clip=clip,
            sigma=sigma,
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            dp_quorum=dp_quorum,
            server_lr=server_lr,
            dp_ratio=dp_ratio,
            budget_skew=budget_skew,
            rho_syn=rho_syn,
            rho_tot=rho_tot,
            synthetic_epsilon=synthetic_epsilon,
            score=score,
            plain_noise=plain_noise,
        )
        config = Job(
            strategy=strategy,
            dataset=dataset,
            model=model,
            clients=clients,
            rounds=rounds,
            local_epochs=local_epochs,
            batch_size=batch_size,
            lr=lr,
            partition=partition,
            seed=seed,
            bandwidth=_floats(bandwidth, "--bandwidth") or profiles.get("bandwidth"),
            cpu=_floats(cpu, "--cpu") or profiles.get("cpu"),
            key_bits=key_bits,
            scheme=scheme,
            train_threads=train_threads,
            options=options,
        )
    except (ValidationError, ConfigError) as exc:
        _fail(_flag_sentence(exc))

    if job_file is not None:
        config = _run.load_job_option(job_file)
    devices = None
    files = _run.data_files(data)
    if files:
        from senseshield.data.local import load_local_data
        from senseshield.job import job_shape

        try:
            shape, classes = job_shape(config)
            devices = [load_local_data(f, config, input_shape=shape, num_classes=classes) for f in files]
        except ConfigError as exc:
            _fail(str(exc))
    with progress_bar(quiet) as bar:
        progress = phase_progress(bar, config.strategy)

        try:
            result = run_simulation(config, progress=progress, devices=devices, noise_seed=noise_seed)
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
    _print_summary(result)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result.model_dump(mode="json"), indent=2))
        console.print(f"wrote {out_file}")


def _print_summary(result) -> None:  # type: ignore[no-untyped-def]
    from senseshield.results import metric_line, privacy_line

    scheme = escape(f" [{result.scheme}]") if result.scheme else ""
    table = Table(title=f"{result.strategy}{scheme} on {result.dataset}/{result.model}, {result.partition}")
    for col in ("round", result.metric_name, "HE ratio", "union ratio", "MB up", "MB down", "seconds"):
        table.add_column(col, justify="right")
    for r in result.rounds:
        value = (r.metric if r.metric is not None else r.accuracy) if r.metrics else None  # None: no device reported
        table.add_row(
            str(r.round),
            f"{value:.4g}" if value is not None else "-",
            f"{r.he_ratio_mean:.3f}",
            f"{r.union_ratio_mean:.3f}",
            f"{r.bytes_up / 1e6:.2f}",
            f"{r.bytes_down / 1e6:.2f}",
            f"{r.seconds:.1f}",
        )
    out.print(table)
    infeasible = sum(r.infeasible_masks for r in result.rounds)
    if infeasible:
        first = next(v for r in result.rounds for v in r.violations)
        out.print(
            f"[yellow]{infeasible} client mask(s) could not meet every constraint and encrypted "
            f"their full budget instead; e.g. {first}[/]"
        )
    ari = f", ARI vs planted categories {result.cluster_ari:.2f}" if result.cluster_ari is not None else ""
    out.print(
        f"{metric_line(result.model_dump())}; {result.num_clusters} cluster(s){ari}; "
        f"{result.num_params} parameters; {result.seconds_total:.1f} s"
    )
    privacy = privacy_line(result.model_dump())
    if privacy is not None:
        out.print(escape(privacy))


from senseshield.cli.compare import compare as _compare  # noqa: E402

app.command(name="compare")(_compare)


bench_app = typer.Typer(help="Benchmarks measured on this machine.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("he")
def bench_he(
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write the result JSON here.")] = None,
    params: Annotated[int, typer.Option(help="Parameters encrypted per client for the fast schemes.")] = 65536,
    clients: Annotated[int, typer.Option(help="Clients added per aggregate.")] = 8,
    key_bits: Annotated[int, typer.Option(help="Paillier modulus bits (same for phe and packed).")] = 2048,
    phe_params: Annotated[int, typer.Option(help="Parameters for stock phe (it is ~1,000x slower).")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the random values.")] = 0,
) -> None:
    """Stock phe vs packed Paillier (with and without the pool) vs CKKS, one run, same key size."""
    from senseshield.bench.he import render_he_table, run_he_bench

    for name, value in (("--params", params), ("--clients", clients), ("--phe-params", phe_params)):
        if value < 1:
            _fail(f"{name}={value} is not allowed; it must be at least 1.")
    with progress_bar(transient=True) as bar:
        task = bar.add_task("bench he", total=None)

        def progress(*args: object) -> None:
            bar.update(task, description=f"bench he: {args[0]}")

        try:
            result = run_he_bench(
                params=params, clients=clients, key_bits=key_bits, seed=seed,
                phe_params=phe_params, progress=progress,
            )
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
    out.print(render_he_table(result))
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {out_file}")


from senseshield.cli.inference import export_command as _export  # noqa: E402

app.command(name="export")(_export)

fleet_app = typer.Typer(help="Run a fleet of real processes on this machine; watch a fleet live.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
from senseshield.cli.top import top as _top  # noqa: E402

fleet_app.command("top")(_top)


@fleet_app.command("bridge")
def fleet_bridge(
    site: Annotated[str, typer.Option(help="The site's name (letters, digits, '-'); its aggregator is `coordinator serve --site NAME`.")],
    hub: Annotated[str, typer.Option(help="The hub's broker, HOST:PORT, as the site's Mosquitto reaches it.")],
    fleet: _run.Fleet = defaults.FLEET,
    protocol: Annotated[str, typer.Option(help="MQTT version of the bridge: mqttv311 or mqttv50.")] = "mqttv311",
) -> None:
    """Print the Mosquitto bridge of a site's broker to the hub's: every topic the site's
    devices and aggregator need, never the devices' updates (add TLS and credentials for a
    real uplink; the Ansible role renders them)."""
    from senseshield.runtime.sites import mosquitto_bridge, site_name
    from senseshield.runtime.transport import PREFIX, parse_broker

    try:
        site_name(site)
        host, port = parse_broker(hub)
    except (ValueError, ConfigError) as exc:
        _fail(str(exc))
    if protocol not in ("mqttv311", "mqttv50"):
        _fail(f"--protocol {protocol!r} is not allowed; use mqttv311 or mqttv50.")
    typer.echo(mosquitto_bridge(hub_host=host, hub_port=port, fleet=fleet, site=site, prefix=PREFIX, protocol=protocol),
               nl=False)



@fleet_app.command("up")
def fleet_up(
    agents: Annotated[Optional[int], typer.Option(help="Edge agents to start, each one OS process with shard i/N (default 6, or one per --data file).")] = None,
    job_file: _run.JobFile = None,
    data: _run.DataFiles = None,
    strategy: _run.Strategy = defaults.STRATEGY,
    rounds: _run.Rounds = defaults.ROUNDS,
    dataset: _run.Dataset = defaults.DATASET,
    model: _run.Model = defaults.MODEL,
    partition: _run.Partition = defaults.PARTITION,
    seed: _run.Seed = defaults.SEED,
    local_epochs: _run.LocalEpochs = defaults.LOCAL_EPOCHS,
    batch_size: _run.BatchSize = defaults.BATCH_SIZE,
    lr: _run.LearningRate = defaults.LR,
    scheme: _run.Scheme = None,
    key_bits: _run.KeyBits = defaults.KEY_BITS,
    train_threads: _run.TrainThreads = defaults.TRAIN_THREADS,
    set_: _run.Sets = None,
    profile_file: Annotated[Optional[Path], typer.Option(help="YAML with `bandwidth:` and `cpu:` lists, cycled within each category (as in simulate).")] = None,
    broker: Annotated[Optional[str], typer.Option(help="Use this MQTT broker (mqtt://HOST[:PORT], MQTT 5) instead of the embedded one.")] = None,
    fleet: _run.Fleet = defaults.FLEET,
    round_deadline: Annotated[Optional[float], typer.Option(help="Seconds a round waits for updates (default: the job's, 120).")] = None,
    min_contributors: _run.MinContributors = defaults.MIN_CONTRIBUTORS,
    threads: _run.Threads = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for report.json, models/, logs/, keys/.")] = Path("fleet-run"),
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve the coordinator's Prometheus metrics on this port (watch it with `senseshield fleet top`).")] = None,
    keyserver_metrics_port: Annotated[Optional[int], typer.Option(help="Serve the key server's Prometheus metrics on this port.")] = None,
    sites: Annotated[int, typer.Option(help="Spread the agents over this many sites (site1, site2, ...; round robin): each site gets its own Mosquitto bridged to the hub's and a site aggregator that folds its devices' updates (needs Mosquitto; 0: every agent on the hub's broker).")] = 0,
    html: _run.Report = True,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Start a broker (embedded unless --broker), the key server, the coordinator and N agents
    as OS processes; run the job; write DIR/report.json and DIR/report.html; print a summary."""
    from senseshield.runtime.fleet import FleetOptions
    from senseshield.runtime.fleet import fleet_up as _fleet_up

    files = _run.data_files(data)
    agents = agents if agents is not None else (len(files) if files else 6)
    if agents < 1:
        _fail(f"--agents {agents} is not allowed; a fleet needs at least 1 agent.")
    if files and len(files) != agents:
        _fail(f"--data gives {len(files)} file(s) for --agents {agents}; give one file per agent.")
    profiles = _profile_file(profile_file) if profile_file else {}
    if job_file is not None:
        config = _run.load_job_option(job_file).model_copy(update={"clients": agents})
    else:
        config = _run.build_run_config(
            strategy=strategy, rounds=rounds, dataset=dataset, model=model, partition=partition, seed=seed,
            local_epochs=local_epochs, batch_size=batch_size, lr=lr, scheme=scheme, key_bits=key_bits,
            clients=agents, sets=set_, bandwidth=profiles.get("bandwidth"), cpu=profiles.get("cpu"),
            train_threads=train_threads,
        )
    if broker is not None:
        from senseshield.runtime.transport import parse_broker

        try:
            parse_broker(broker)
        except ConfigError as exc:
            _fail(str(exc))
    for flag, port in (("--metrics-port", metrics_port), ("--keyserver-metrics-port", keyserver_metrics_port)):
        if port is not None and not 0 < port < 65536:
            _fail(f"{flag} {port} is not allowed; use a port in 1..65535.")

    def wrap(name: str, argv: list[str]) -> list[str]:
        if name == "coordinator" and metrics_port is not None:
            return ["env", f"SENSESHIELD_METRICS_PORT={metrics_port}", *argv]
        if name == "keyserver" and keyserver_metrics_port is not None:
            return ["env", f"SENSESHIELD_KEYSERVER_METRICS_PORT={keyserver_metrics_port}", *argv]
        return argv

    if threads is not None and threads < 1:
        _fail(f"--threads {threads} is not allowed; use 1 or more.")
    if not 0 <= sites <= agents:
        _fail(f"--sites {sites} is not allowed; use 0 (no sites) up to the number of agents ({agents}).")
    options = FleetOptions(agents=agents, out=out_dir, broker=broker, fleet=fleet, round_deadline=round_deadline,
                           min_contributors=min_contributors, threads=threads, wrap=wrap, data=files,
                           sites={f"site{s + 1}": list(range(s, agents, sites)) for s in range(sites)})
    with progress_bar(quiet) as bar:
        progress = phase_progress(bar, "fleet")

        import signal

        def _terminated(signum, frame):  # noqa: ANN001 - SIGTERM stops the fleet as Ctrl-C does
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _terminated)
        try:
            report = _fleet_up(config, options, progress)
        except StorageError as exc:
            bar.stop()
            storage_stop(exc, "fleet up", f"free space or fix {out_dir} and run it again")
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
        except KeyboardInterrupt:
            bar.stop()
            console.print("fleet up stopped; every process it started was stopped too")
            raise typer.Exit(130)
    from senseshield.results import RunResult

    _print_summary(RunResult.model_validate(report))
    _print_phases(report)
    console.print(f"wrote {out_dir / 'report.json'} (logs in {out_dir / 'logs'})")
    if html:
        _render(out_dir)
    if report.get("state", "done") != "done":  # a job that failed exits as the simulator does
        _fail(f"the job {report['state']}: {report.get('reason') or 'see the coordinator log'}")


def _render(run_dir: Path) -> None:
    """Render ``run_dir``'s report.json or trial.json into report.html; say where it is."""
    from senseshield.trials.report import render_any

    try:
        page = render_any(run_dir)
    except ConfigError as exc:
        _fail(str(exc))
    console.print(f"wrote {page}")


def _print_phases(report: dict) -> None:
    """Mean seconds per agent and round of each phase, plus the server's; what devices said
    failed; straggling."""
    import numpy as np

    from senseshield.results import failed_phrase

    phases = ("train", "sensitivity", "mask", "noise", "encrypt", "receipt", "serialize", "upload", "wait")
    values: dict[str, list[float]] = {p: [] for p in phases}
    for agent in report["agents"]:
        for rec in agent["rounds"].values():
            for p in phases:
                if p in rec["phases"]:
                    values[p].append(rec["phases"][p])
    server = {"aggregate": [], "verify": [], "decrypt": []}
    for rec in report["server"]:
        for c in rec["clusters"].values():
            for p in server:
                if p in c["timings"]:
                    server[p].append(c["timings"][p])
    table = Table(title="phase seconds (mean per agent and round; server per cluster and round)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("where")
    for name in phases:
        if values[name]:
            table.add_row(name, f"{np.mean(values[name]):.3f}", "agent")
    for name, vals in server.items():
        if vals:
            table.add_row(name, f"{np.mean(vals):.3f}", "coordinator" if name == "aggregate" else "key server")
    if table.row_count:
        out.print(table)
    by_round: dict[tuple[int, str], dict[str, str]] = {}
    for f in report.get("failures") or []:  # what devices said failed, apart from devices that were late
        by_round.setdefault((f["round"], f["phase"]), {})[f["agent"]] = f["reason"]
    for (r, phase), failed in sorted(by_round.items())[:5]:
        out.print(f"[red]round {r}{' (evaluation)' if phase == 'evaluation' else ''}: {escape(failed_phrase(failed))}[/]",
                  highlight=False, soft_wrap=True)
    events = [s for s in report.get("straggling_events") or [] if s.get("missing") != "failed"]
    if events:
        out.print(f"[yellow]{len(events)} straggling event(s): "
                  + ", ".join(f"round {s['round']} {s['agent']}" for s in events[:5]) + "[/]")
    median = (report.get("straggling") or {}).get("median_ratio")
    if median is not None:
        out.print(f"straggling: median slowest/fastest agent time {median:.2f} "
                  f"(median idle {report['straggling']['median_idle_s']:.2f} s per round)")


trial_app = typer.Typer(help="Field trials: emulated devices (CPU limits, shaped links) on this machine.",
                        no_args_is_help=True)
app.add_typer(trial_app, name="trial")


@trial_app.command("run")
def trial_run(
    trial_file: Annotated[Path, typer.Argument(help="Trial YAML (see profiles/trials/), or the name of one there.",
                                               metavar="TRIAL.yaml")],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for trial.json, report.html and one folder per run.")] = Path("trial-run"),
    broker: Annotated[Optional[str], typer.Option(help="auto | embedded | mosquitto | mqtt://HOST:PORT (default: the trial file's).")] = None,
    only: Annotated[Optional[str], typer.Option(help="Run only these runs (comma-separated labels).")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Override the trial file's rounds.")] = None,
    no_emulation: Annotated[bool, typer.Option("--no-emulation", help="Run the agents unconfined (no cgroups, namespaces or tc).")] = False,
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve the coordinator's Prometheus metrics on this port.")] = None,
    html: _run.Report = True,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run a trial: broker, key server, coordinator and emulated agents as OS processes, every
    run of the trial file in turn on the same fleet and data; write DIR/trial.json."""
    from senseshield.trials.trial import load_trial, run_trial

    try:
        spec = load_trial(trial_file)
        if rounds is not None:
            if rounds < 1:
                raise ConfigError(f"--rounds {rounds} is not allowed; use 1 or more.")
            spec = spec.model_copy(update={"rounds": rounds})
        if metrics_port is not None and not 0 < metrics_port < 65536:
            raise ConfigError(f"--metrics-port {metrics_port} is not allowed; use a port in 1..65535.")
    except ConfigError as exc:
        _fail(str(exc))
    chosen = [o.strip() for o in only.split(",")] if only else None
    names = [r.name for r in spec.run_specs if chosen is None or r.name in chosen]
    console.print(f"trial {spec.name}: {sum(e.count for e in spec.fleet)} agents, runs {', '.join(names)}",
                  highlight=False)
    with progress_bar(quiet) as bar:
        tasks: dict[tuple[str, str], int] = {}

        def progress(label: str, phase: str, done: int, total: int) -> None:
            if (label, phase) not in tasks:
                tasks[(label, phase)] = bar.add_task(f"{label} {phase}", total=total)
            bar.update(tasks[(label, phase)], completed=done)

        def say(message: str) -> None:
            bar.console.print(message, highlight=False, soft_wrap=True)

        try:
            trial = run_trial(spec, out_dir, broker=broker, emulate=not no_emulation, metrics_port=metrics_port,
                              only=chosen,
                              say=say, progress=progress)
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
        except KeyboardInterrupt:
            bar.stop()
            console.print("trial interrupted; everything it started was removed")
            raise typer.Exit(130)
    _print_trial(trial)
    console.print(f"wrote {out_dir / 'trial.json'}")
    if html:
        _render(out_dir)


@trial_app.command("cleanup")
def trial_cleanup() -> None:
    """Remove network namespaces, links and cgroups left by trials that were killed."""
    from senseshield.trials.emulation import cleanup_stale, leftovers

    removed = cleanup_stale(lambda m: console.print(m, highlight=False))
    still = leftovers()
    console.print(f"removed {len(removed)} leftover(s); {len(still)} belong to running trials")


def _print_trial(trial: dict) -> None:
    table = Table(title=f"trial {trial['name']} ({trial['machine']['cpu']}, {trial['machine']['cores']} cores, "
                        f"scale {trial['scale']:.3g})")
    for col in ("run", "budget", "straggling ratio", "work ratio", "round s", "x plaintext", "HE ratio",
                "MB up", "final acc."):
        table.add_column(col, justify="right" if col not in ("run", "budget") else "left")

    def num(value, fmt: str) -> str:  # noqa: ANN001
        return "-" if value is None else format(value, fmt)

    for r in trial["runs"]:
        table.add_row(r["label"], r["budget_mode"] if r["strategy"] == "sensecrypt" else "-",
                      num(r["median_ratio"], ".2f"), num(r.get("median_work_ratio"), ".2f"),
                      num(r["median_round_s"], ".2f"),
                      num(r.get("round_s_vs_plaintext"), ".2f"), num(r["he_ratio_mean"], ".3f"),
                      num(r["mb_up_per_round"], ".2f"), num(r["final_accuracy"], ".3f"))
    out.print(table)
    out.print("medians over the rounds; round s leaves out round 1 (warm-up); work ratio leaves out the wait "
              "for a consensus mask; MB up per round, all agents")


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (report.json) or a trial directory (trial.json).",
                                            metavar="DIR")],
) -> None:
    """Render DIR/report.json (or a trial's DIR/trial.json) into DIR/report.html with PNG plots."""
    _render(run_dir)


def main() -> None:
    """Console entry point: user mistakes exit 2 with one sentence, no traceback."""
    from senseshield.extras import missing_sentence

    try:
        app()
    except (ConfigError, SenseShieldError) as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except ModuleNotFoundError as exc:  # a package of an extra this install lacks (senseshield.extras)
        sentence = missing_sentence(exc, prefer="lab")  # this command is the operator's (lab) tool
        if sentence is None:
            raise
        console.print(f"[bold red]error:[/] {escape(sentence)}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
