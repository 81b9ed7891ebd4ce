"""``senseshield attack``: privacy measured by attacking what the server sees.

``senseshield attack [OPTIONS]`` trains a fleet with a strategy to the captured round,
captures the server's view of the victims' updates, attacks them and writes the metrics
(per trial and averaged) as JSON plus a PNG (true vs reconstructed images; true vs
restored label counts for iLRG).

``senseshield attack sweep [OPTIONS]`` runs SenseCrypt's App. H experiment (encryption
ratio 0..0.8, high-sensitivity-first / random / low-sensitivity-first) and the
extreme-heterogeneity check, with one plot of LeAcc, LnAcc, MI and PSNR against the ratio.

User mistakes print one sentence naming the value and what is allowed, and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError
from rich.table import Table

from senseshield.errors import ConfigError

attack_app = typer.Typer(
    help="Attack what an honest-but-curious server sees (iDLG, Inverting Gradients, iLRG).",
    add_completion=False,
    pretty_exceptions_enable=False,
)
from senseshield.cli.common import console, out  # noqa: E402
from senseshield.cli.common import fail as _fail  # noqa: E402
from senseshield.cli.common import numbers as _numbers  # noqa: E402
from senseshield.cli.common import phase_progress  # noqa: E402
from senseshield.cli.common import progress_bar as _progress  # noqa: E402
from senseshield.cli.common import validation_sentence as _validation_sentence  # noqa: E402



def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@attack_app.callback(invoke_without_command=True)
def attack(
    ctx: typer.Context,
    attack_name: Annotated[str, typer.Option("--attack", help="idlg | inverting | ilrg.")] = "ilrg",
    strategy: Annotated[str, typer.Option(help="Strategy whose masks protect the updates (see `senseshield strategies`).")] = "sensecrypt",
    he_ratio: Annotated[float, typer.Option(help="Encrypted fraction: for maskcrypt / fedml-he, and for --order.")] = 0.1,
    order: Annotated[Optional[str], typer.Option(help="high | random | low: encrypt the --he-ratio fraction in this order of the strategy's sensitivity instead of the strategy's own mask.")] = None,
    dataset: Annotated[str, typer.Option(help="digits | mnist5k | idx:<dir> | synthetic.")] = "digits",
    model: Annotated[str, typer.Option(help="mlp | simplecnn | lenet5 | linear.")] = "lenet5",
    activation: Annotated[Optional[str], typer.Option(help="lenet5 activation: sigmoid (default here), tanh, relu.")] = None,
    clients: Annotated[int, typer.Option(help="Number of clients.")] = 10,
    partition: Annotated[str, typer.Option(help="iid | dirichlet:ALPHA | categories:K.")] = "iid",
    round_: Annotated[int, typer.Option("--round", help="Captured round; rounds before it are trained (FedAvg).")] = 2,
    local_epochs: Annotated[int, typer.Option(help="Local epochs in the trained rounds.")] = 1,
    train_batch_size: Annotated[int, typer.Option(help="Local minibatch size in the trained rounds.")] = 16,
    lr: Annotated[float, typer.Option(help="Local SGD learning rate (the server knows it).")] = 0.1,
    batch_size: Annotated[int, typer.Option(help="Samples behind each attacked update (one local step).")] = 8,
    trials: Annotated[int, typer.Option(help="Attacked batches per victim.")] = 3,
    victims: Annotated[str, typer.Option(help="Attacked clients (indices), comma-separated.")] = "0",
    bandwidth: Annotated[Optional[str], typer.Option(help="Client bandwidths r_i (MB/s) by client index, comma-separated, cycled.")] = None,
    cpu: Annotated[Optional[str], typer.Option(help="Client CPU speeds v_i by client index, comma-separated, cycled.")] = None,
    security_c: Annotated[float, typer.Option(help="C in the security level 1 - C exp(-B alpha).")] = 0.5,
    security_b: Annotated[float, typer.Option(help="B in the security level 1 - C exp(-B alpha).")] = 2.0,
    eta_mi: Annotated[float, typer.Option(help="Mutual-information bound in bits (SenseCrypt eq. 8).")] = 2.0,
    score: Annotated[Optional[str], typer.Option(help="Clients' sensitivity score (taylor | fisher | grad_delta | leakage); it also orders --order. Default: the strategy's.")] = None,
    no_mi: Annotated[bool, typer.Option("--no-mi", help="Disable the mutual-information constraint.")] = False,
    iterations: Annotated[int, typer.Option(help="Optimiser steps of iDLG / Inverting Gradients.")] = 600,
    restarts: Annotated[int, typer.Option(help="Random restarts of iDLG / Inverting Gradients.")] = 1,
    attack_lr: Annotated[float, typer.Option(help="Step size of the attack's optimiser.")] = 0.3,
    tv: Annotated[float, typer.Option(help="Total-variation weight of Inverting Gradients.")] = 0.0,
    optimizer: Annotated[str, typer.Option(help="adam (signed, boxed) | lbfgs (iDLG as published).")] = "adam",
    seed: Annotated[int, typer.Option(help="Seed; the same seed gives the same result.")] = 0,
    out_file: Annotated[Path, typer.Option("--out", help="Result JSON; the PNG goes next to it (same name, .png).")] = Path("attack-result.json"),
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Attack the server's view of chosen clients' updates and write the metrics."""
    if ctx.invoked_subcommand is not None:
        return
    from senseshield.attacks.experiment import AttackConfig, run_attack_experiment
    from senseshield.strategies import StrategyOptions

    try:
        config = AttackConfig(
            attack=attack_name,
            strategy=strategy,
            order=order,
            dataset=dataset,
            model=model,
            activation=activation,
            clients=clients,
            partition=partition,
            round=round_,
            local_epochs=local_epochs,
            train_batch_size=train_batch_size,
            lr=lr,
            batch_size=batch_size,
            trials=trials,
            victims=_numbers(victims, "--victims", int, "0,3"),
            bandwidth=_numbers(bandwidth, "--bandwidth", float, "50,45,40"),
            cpu=_numbers(cpu, "--cpu", float, "32,16,1"),
            options=StrategyOptions(
                he_ratio=he_ratio,
                security_c=security_c,
                security_b=security_b,
                eta_mi=None if no_mi else eta_mi,
                score=score,
            ),
            iterations=iterations,
            restarts=restarts,
            attack_lr=attack_lr,
            tv=tv,
            optimizer=optimizer,
            seed=seed,
        )
        config.settings()
    except ValidationError as exc:
        _fail(_validation_sentence(exc))
    except ConfigError as exc:
        _fail(str(exc))
    figure = out_file.with_suffix(".png")
    with _progress(quiet) as bar:
        try:
            result = run_attack_experiment(config, figure=figure, progress=phase_progress(bar))
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
    _print_attack(result)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out_file} and {figure}")


def _print_attack(result: dict[str, Any]) -> None:
    how = f", {result['order']} order" if result["order"] else ""
    acc = result["global_accuracy"]
    table = Table(
        title=(
            f"{result['attack']} vs {result['strategy']}{how} on {result['dataset']}/"
            f"{result['model']}, batch {result['batch_size']}, round {result['captured_round']}"
            + (f" (global accuracy {acc:.2f})" if acc is not None else "")
        )
    )
    for col in ("client", "budget", "HE ratio", "MI bits", "LeAcc", "LnAcc", "IRec", "PSNR dB", "SSIM", "IIP"):
        table.add_column(col, justify="right")
    for c in result["clients"]:
        table.add_row(
            c["id"], _fmt(c["encryption_budget"]), _fmt(c["he_ratio"]), _fmt(c["mi"], 2),
            _fmt(c["leacc"], 2), _fmt(c["lnacc"], 2), _fmt(c["irec"], 2), _fmt(c["psnr"], 1),
            _fmt(c["ssim"], 2), _fmt(c["iip"], 2),
        )
    out.print(table)


@attack_app.command()
def sweep(
    dataset: Annotated[str, typer.Option(help="digits | mnist5k | idx:<dir> | synthetic.")] = "digits",
    model: Annotated[str, typer.Option(help="mlp | simplecnn | lenet5 | linear.")] = "lenet5",
    activation: Annotated[Optional[str], typer.Option(help="lenet5 activation: sigmoid (default here), tanh, relu.")] = None,
    clients: Annotated[int, typer.Option(help="Clients of the App. H fleet.")] = 10,
    partition: Annotated[str, typer.Option(help="iid | dirichlet:ALPHA | categories:K.")] = "iid",
    round_: Annotated[int, typer.Option("--round", help="Captured round; rounds before it are trained.")] = 2,
    local_epochs: Annotated[int, typer.Option(help="Local epochs in the trained rounds.")] = 1,
    train_batch_size: Annotated[int, typer.Option(help="Local minibatch size in the trained rounds.")] = 16,
    lr: Annotated[float, typer.Option(help="Local SGD learning rate.")] = 0.1,
    label_batch: Annotated[int, typer.Option(help="Batch behind the update iLRG attacks.")] = 30,
    image_batch: Annotated[int, typer.Option(help="Batch behind the update the image attack gets.")] = 1,
    image_attack: Annotated[str, typer.Option(help="inverting | idlg | none (PSNR panel).")] = "inverting",
    ratios: Annotated[str, typer.Option(help="Encryption ratios, comma-separated, in [0, 1].")] = "0,0.01,0.02,0.03,0.05,0.1,0.2,0.4,0.6,0.8",
    orders: Annotated[str, typer.Option(help="Selections, comma-separated: high, random, low.")] = "high,random,low",
    trials: Annotated[int, typer.Option(help="Captured batches per point.")] = 3,
    victim: Annotated[int, typer.Option(help="Client attacked in the ratio sweep.")] = 0,
    heterogeneity: Annotated[bool, typer.Option("--heterogeneity/--no-heterogeneity", help="Also run the extreme-heterogeneity check.")] = True,
    cpus: Annotated[str, typer.Option(help="CPUs of the SenseCrypt clients in the heterogeneity check (a reference client without HE is added).")] = "32,24,16,12,10,8,2,1",
    bandwidth: Annotated[float, typer.Option(help="Bandwidth (MB/s) of every client in the heterogeneity check.")] = 50.0,
    security_c: Annotated[float, typer.Option(help="C in the security level 1 - C exp(-B alpha).")] = 0.5,
    security_b: Annotated[float, typer.Option(help="B in the security level 1 - C exp(-B alpha).")] = 2.0,
    eta_mi: Annotated[float, typer.Option(help="Mutual-information bound in bits (SenseCrypt eq. 8).")] = 2.0,
    score: Annotated[Optional[str], typer.Option(help="Score that orders 'high' and 'low' and SenseCrypt's masks: taylor (default) | fisher | grad_delta | leakage.")] = None,
    plain_noise: Annotated[float, typer.Option(help="SenseCrypt hybrid: noise of this times the plaintext part's norm on what stays visible (0 = off).")] = 0.0,
    iterations: Annotated[int, typer.Option(help="Optimiser steps of the image attack.")] = 600,
    restarts: Annotated[int, typer.Option(help="Random restarts of the image attack.")] = 1,
    attack_lr: Annotated[float, typer.Option(help="Step size of the image attack's optimiser.")] = 0.3,
    tv: Annotated[float, typer.Option(help="Total-variation weight (inverting).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed; the same seed gives the same result.")] = 0,
    out_file: Annotated[Path, typer.Option("--out", help="Result JSON; the plots go next to it (-sweep.png, -heterogeneity.png).")] = Path("attack-sweep.json"),
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """SenseCrypt App. H: attack success against the encryption ratio, three selections."""
    from senseshield.attacks.experiment import SweepConfig, run_sweep
    from senseshield.strategies import StrategyOptions

    try:
        config = SweepConfig(
            dataset=dataset,
            model=model,
            activation=activation,
            clients=clients,
            partition=partition,
            round=round_,
            local_epochs=local_epochs,
            train_batch_size=train_batch_size,
            lr=lr,
            label_batch=label_batch,
            image_batch=image_batch,
            image_attack=None if image_attack == "none" else image_attack,
            ratios=_numbers(ratios, "--ratios", float, "0,0.05,0.1"),
            orders=[o.strip() for o in orders.split(",") if o.strip()],
            trials=trials,
            victim=victim,
            heterogeneity=heterogeneity,
            cpus=_numbers(cpus, "--cpus", float, "32,16,1"),
            bandwidth=bandwidth,
            options=StrategyOptions(security_c=security_c, security_b=security_b, eta_mi=eta_mi, score=score,
                                    plain_noise=plain_noise),
            iterations=iterations,
            restarts=restarts,
            attack_lr=attack_lr,
            tv=tv,
            seed=seed,
        )
        config.settings()
    except ValidationError as exc:
        _fail(_validation_sentence(exc))
    except ConfigError as exc:
        _fail(str(exc))
    with _progress(quiet) as bar:
        try:
            result = run_sweep(config, figure_prefix=out_file.with_suffix(""), progress=phase_progress(bar))
        except ConfigError as exc:
            bar.stop()
            _fail(str(exc))
    _print_sweep(result)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out_file} and {', '.join(result['figures'])}")


def _print_sweep(result: dict[str, Any]) -> None:
    table = Table(title=result["title"])
    for col in ("order", "ratio", "MI bits", "LeAcc", "LnAcc", "IRec", "PSNR dB", "IIP"):
        table.add_column(col, justify="right")
    for p in result["points"]:
        table.add_row(p["order"], f"{p['ratio']:g}", _fmt(p["mi"], 2), _fmt(p["leacc"], 2),
                      _fmt(p["lnacc"], 2), _fmt(p["irec"], 2), _fmt(p["psnr"], 1), _fmt(p["iip"], 2))
    b = result["blind"]
    table.add_row("blind", "all", _fmt(b["mi"], 2), _fmt(b["leacc"], 2), _fmt(b["lnacc"], 2),
                  _fmt(b["irec"], 2), _fmt(b["psnr"], 1), _fmt(b["iip"], 2))
    out.print(table)
    het = result.get("heterogeneity")
    if het:
        table = Table(title=het["title"])
        for col in ("client", "CPUs", "budget", "HE ratio", "LeAcc", "LnAcc", "IRec", "PSNR dB", "IIP"):
            table.add_column(col, justify="right")
        for c in het["clients"]:
            table.add_row(
                c["id"] + (" (no HE)" if c["unprotected"] else ""), f"{c['cpu']:g}",
                _fmt(c["encryption_budget"]), _fmt(c["he_ratio"]), _fmt(c["leacc"], 2),
                _fmt(c["lnacc"], 2), _fmt(c["irec"], 2), _fmt(c["psnr"], 1), _fmt(c["iip"], 2),
            )
        out.print(table)
