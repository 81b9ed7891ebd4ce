"""``senseshield compare``: several strategies, same data, partition and seed, one table.

Writes ``<out>/compare.json`` (every run's full simulate JSON plus a summary row per
strategy), ``<out>/compare.md`` (Markdown table) and ``<out>/compare.png`` (accuracy per
round). ``run_compare`` is the library entry point; the typer command wraps it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from senseshield import defaults
from senseshield.cli import run as _run
from senseshield.errors import ConfigError


def summary_row(result) -> dict:  # type: ignore[no-untyped-def]
    rounds = result.rounds
    zones = [r.zone_ratios for r in rounds if r.zone_ratios]
    mean_zone = {k: sum(z[k] for z in zones) / len(zones) for k in zones[0]} if zones else None
    return {
        "strategy": result.strategy,
        "final_accuracy": result.final_accuracy,
        "epsilon": result.epsilon,
        "epsilon_server": result.epsilon_server,
        "epsilon_pld": result.epsilon_pld,
        "epsilon_server_pld": result.epsilon_server_pld,
        "delta": result.delta,
        "noise_multiplier": result.noise_multiplier,
        "he_ratio_mean": sum(r.he_ratio_mean for r in rounds) / len(rounds),
        "zone_ratios": mean_zone,
        "bytes_up_per_round": sum(r.bytes_up for r in rounds) / len(rounds),
        "seconds_per_round": sum(r.seconds for r in rounds) / len(rounds),
        "phase_seconds": {k: sum(r.phase_seconds.get(k, 0.0) for r in rounds) for k in rounds[0].phase_seconds},
        "accuracy_per_round": [r.accuracy for r in rounds],
    }


def markdown_table(rows: list[dict]) -> str:
    head = "| strategy | final acc. | ε (observer / server) | M_enc / M_pers / M_noise | HE ratio | MB up / round | s / round |\n"
    head += "| --- | ---: | ---: | --- | ---: | ---: | ---: |\n"
    lines = []
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f} / {r.get('epsilon_server') or r['epsilon']:.2f}"
        z = r["zone_ratios"]
        zones = "-" if z is None else f"{z['enc']:.3f} / {z['pers']:.3f} / {z['noise']:.3f}"
        lines.append(
            f"| {r['strategy']} | {r['final_accuracy']:.3f} | {eps} | {zones} | {r['he_ratio_mean']:.3f} "
            f"| {r['bytes_up_per_round'] / 1e6:.2f} | {r['seconds_per_round']:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    from senseshield.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        acc = r["accuracy_per_round"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["strategy"])
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_compare(strategies: list[str], base, out_dir: Path, progress=None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Run each strategy with ``base`` (a Job) changed only in its strategy."""
    from senseshield.simulation import run_simulation

    if not strategies:
        raise ConfigError("Give at least one strategy to compare, e.g. --strategies plaintext,dp-fedavg.")
    configs = [base.model_copy(update={"strategy": s}) for s in strategies]
    for c in configs:  # validate every name before the first (long) run
        type(base).model_validate(c.model_dump())
    results = []
    for i, config in enumerate(configs):
        results.append(run_simulation(config))
        if progress:
            progress(config.strategy, i + 1, len(configs))
    rows = [summary_row(r) for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(
        json.dumps({"summary": rows, "runs": [r.model_dump(mode="json") for r in results]}, indent=2)
    )
    (out_dir / "compare.md").write_text(markdown_table(rows))
    plot(rows, out_dir / "compare.png")
    return rows


def compare(
    strategies: Annotated[str, typer.Option(help="Comma-separated strategy names.")] = "plaintext,dp-fedavg,selective-dp,selectiveshield",
    dataset: _run.Dataset = defaults.DATASET,
    model: _run.Model = defaults.MODEL,
    clients: _run.Clients = defaults.CLIENTS,
    rounds: _run.Rounds = defaults.ROUNDS,
    local_epochs: _run.LocalEpochs = defaults.LOCAL_EPOCHS,
    batch_size: _run.BatchSize = defaults.BATCH_SIZE,
    lr: _run.LearningRate = defaults.LR,
    partition: Annotated[str, typer.Option(help="iid | dirichlet:ALPHA | categories:K (dirichlet:0.5 here, unlike simulate's iid: differences between strategies show on non-IID data).")] = "dirichlet:0.5",
    seed: _run.Seed = defaults.SEED,
    he_ratio: Annotated[float, typer.Option(help="Encrypted fraction (maskcrypt, fedml-he, Alt-FL eta).")] = 0.1,
    tau: Annotated[float, typer.Option(help="SelectiveShield tau.")] = 0.1,
    rho: Annotated[float, typer.Option(help="SelectiveShield rho.")] = 0.5,
    clip: Annotated[float, typer.Option(help="DP clipping norm C.")] = 1.0,
    sigma: Annotated[float, typer.Option(help="DP noise multiplier.")] = 1.0,
    target_epsilon: Annotated[Optional[float], typer.Option(help="Calibrate every DP run to this epsilon.")] = None,
    delta: Annotated[float, typer.Option(help="DP delta.")] = 1e-5,
    key_bits: _run.KeyBits = defaults.KEY_BITS,
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for compare.json/.md/.png.")] = Path("compare-run"),
) -> None:
    """Run several strategies on the same data, partition and seed; write JSON, Markdown, PNG."""
    from pydantic import ValidationError

    from senseshield.cli.common import fail as _fail
    from senseshield.cli.common import out
    from senseshield.cli.common import flag_sentence as _flag_sentence
    from senseshield.job import Job
    from senseshield.strategies import StrategyOptions

    names = [s.strip() for s in strategies.split(",") if s.strip()]
    try:
        options = StrategyOptions(he_ratio=he_ratio, tau=tau, rho=rho, clip=clip, sigma=sigma, target_epsilon=target_epsilon, delta=delta)
        base = Job(
            strategy=names[0] if names else "plaintext", dataset=dataset, model=model, clients=clients, rounds=rounds,
            local_epochs=local_epochs, batch_size=batch_size, lr=lr, partition=partition, seed=seed,
            key_bits=key_bits, options=options,
        )
        rows = run_compare(names, base, out_dir)
    except (ValidationError, ConfigError) as exc:
        _fail(_flag_sentence(exc))
    out.print(markdown_table(rows))
    out.print(f"wrote {out_dir}/compare.json, compare.md, compare.png")
