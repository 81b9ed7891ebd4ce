"""``senseshield check determinism``: the same run twice in the simulator and once on a fleet.

Prints what it compared and the first difference (round, client, budget, mask, weight) or
that the three runs are the same; exits 1 when they differ (a broken promise is a bug), 2 on
a user mistake. Devices draw their privacy noise from secret OS entropy, so the three runs
replay one test-only noise seed (the agents run in development mode for it,
:mod:`senseshield.device_noise`); everything else is compared as a real fleet runs it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli import run as _run
from senseshield.cli.common import console, fail, out, progress_bar
from senseshield.errors import ConfigError

check_app = typer.Typer(help="Checks of the project's promises on this machine.", no_args_is_help=True)


@check_app.command("determinism")
def determinism(
    strategy: _run.Strategy = defaults.STRATEGY,
    agents: Annotated[int, typer.Option(help="Clients in the simulator, agent processes in the fleet.")] = 4,
    rounds: Annotated[int, typer.Option(help="Federated rounds (2 here, not 5: a quick check).")] = 2,
    dataset: _run.Dataset = defaults.DATASET,
    model: _run.Model = defaults.MODEL,
    partition: Annotated[str, typer.Option(help="iid | dirichlet:ALPHA | categories:K (categories:2 here: two clusters to check).")] = "categories:2",
    seed: _run.Seed = defaults.SEED,
    key_bits: Annotated[int, typer.Option(help="Paillier modulus bits (1024 here, not 2048: a quick check).")] = 1024,
    train_threads: _run.TrainThreads = defaults.TRAIN_THREADS,
    set_: _run.Sets = None,
    broker: Annotated[Optional[str], typer.Option(help="MQTT broker for the fleet run (default: the embedded one).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Keep the fleet run here (default: a temporary directory).")] = None,
    noise_seed: Annotated[int, typer.Option(help="Test-only seed all three runs replay their device noise from (a real fleet's is secret).")] = 0,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run one strategy twice in the simulator and once as a local fleet (real processes)
    with the same seed and the same test-only device-noise seed; print what was compared and
    the first difference (round, client, budget, mask, weight)."""
    import warnings

    from senseshield.determinism import describe, first_difference, fleet_trace
    from senseshield.runtime.fleet import FleetOptions, fleet_up
    from senseshield.he import SCHEMES
    from senseshield.job import effective_scheme
    from senseshield.simulation import run_simulation
    from senseshield.strategies import build_strategy

    if agents < 1:
        fail(f"--agents {agents} is not allowed; use 1 or more.")
    if noise_seed < 0:
        fail(f"--noise-seed {noise_seed} is not allowed; use 0 or more.")
    config = _run.build_run_config(
        strategy=strategy, rounds=rounds, dataset=dataset, model=model, partition=partition, seed=seed,
        local_epochs=defaults.LOCAL_EPOCHS, batch_size=defaults.BATCH_SIZE, lr=defaults.LR, scheme=None, key_bits=key_bits, clients=agents, sets=set_,
        train_threads=train_threads,
    )
    scheme = effective_scheme(config, build_strategy(config.strategy, config.options))
    # CKKS encryption adds noise: weights agree to ~1e-8, masks and budgets exactly
    atol = 1e-6 if scheme is not None and not SCHEMES.get(scheme).exact else 0.0
    warnings.filterwarnings("ignore", message=".*insecure.*")
    with tempfile.TemporaryDirectory(prefix="senseshield-check-") as tmp:
        run_dir = out_dir or Path(tmp)
        with progress_bar(quiet) as bar:
            task = bar.add_task(f"{strategy}: simulator, simulator, fleet", total=3)
            first = run_simulation(config, trace=True, noise_seed=noise_seed)
            bar.advance(task)
            second = run_simulation(config, trace=True, noise_seed=noise_seed)
            bar.advance(task)
            try:
                fleet_up(config, FleetOptions(agents=agents, out=run_dir, broker=broker, fleet="determinism",
                                              round_deadline=120, min_contributors=1, noise_seed=noise_seed),
                         timeout=900)
            except ConfigError as exc:
                bar.stop()
                fail(str(exc))
            bar.advance(task)
        fleet = fleet_trace(run_dir)
    assert first.trace is not None and second.trace is not None
    checks = (("simulator run 1", "simulator run 2", first.trace, second.trace),
              ("simulator", "fleet", first.trace, fleet))
    out.print(f"compared: clusters, encryption budgets, every round's protection masks and cluster models; "
              f"device noise replayed from the test-only seed {noise_seed} in all three runs (agents in "
              "development mode); a real fleet's device noise is secret and is not compared")
    broken = False
    for x, y, a, b in checks:
        diff = first_difference(a, b, (x, y), atol=atol)
        if diff is None:
            tolerance = "bit for bit" if atol == 0 else f"weights within {atol:g}"
            out.print(f"[green]same[/]: {x} and {y} ({describe(a)}; budgets, masks and models {tolerance})")
        else:
            broken = True
            out.print(f"[red]differ[/]: {x} vs {y}: {diff}")
    if broken:
        console.print("the runs differ; see docs/decisions.md (determinism) for what is promised")
        raise typer.Exit(1)
