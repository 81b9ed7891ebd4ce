"""The `senseshield` CLI: help, listings, a real run, and one-sentence errors (exit 2)."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from senseshield.cli import app

CLI = [sys.executable, "-m", "senseshield.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_strategies_lists_every_registered_strategy():
    out = run("strategies")
    assert out.returncode == 0
    for name in ("plaintext", "paillier-full", "maskcrypt", "fedml-he", "sensecrypt"):
        assert name in out.stdout


def test_simulate_writes_the_result_contract(tmp_path):
    target = tmp_path / "r.json"
    out = run(
        "simulate", "--strategy", "maskcrypt", "--dataset", "synthetic", "--model", "linear",
        "--clients", "3", "--rounds", "2", "--key-bits", "512", "--quiet", "--out", str(target),
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(target.read_text())
    assert data["strategy"] == "maskcrypt" and len(data["rounds"]) == 2 and len(data["clients"]) == 3
    assert "final accuracy" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "nope"], "Unknown strategy 'nope'; choose one of"),
        (["--dataset", "nope"], "Unknown dataset 'nope'"),
        (["--model", "nope", "--dataset", "synthetic"], "Unknown model 'nope'"),
        (["--partition", "dirichlet:0", "--dataset", "synthetic"], "alpha"),
        (["--partition", "dirichlet:-1", "--dataset", "synthetic"], "alpha"),
        (["--clients", "5000", "--dataset", "synthetic"], "5000"),
        (["--dataset", "idx:/no/such/dir"], "/no/such/dir"),
        (["--clients", "0"], "--clients=0"),
        (["--bandwidth", "50,abc"], "--bandwidth"),
        (["--cpu", "0,1"], "cpu"),
        (["--he-ratio", "2"], "he-ratio"),
        (["--strategy", "sensecrypt", "--scheme", "ckks"], "needs every client to encrypt the same positions"),
        (["--scheme", "rot13"], "Unknown HE scheme 'rot13'"),
        (["--plain-noise", "-2"], "plain_noise=-2.0 is not allowed; use a noise-to-signal ratio in [0, 10]"),
        (["--plain-noise", "nan"], "plain_noise=nan is not allowed"),
        (["--strategy", "masked-dp", "--dp-quorum", "0"], "dp_quorum=0.0 is not allowed; give a fraction"),
    ],
)
def test_user_mistakes_exit_2_with_one_sentence(args, message):
    out = CliRunner().invoke(app, ["simulate", "--quiet", "--rounds", "1", *args])
    assert out.exit_code == 2, out.output
    assert message in out.stderr
    assert out.exception is None or isinstance(out.exception, SystemExit)
    assert len(out.stderr.strip().splitlines()) == 1


def test_entry_point_reports_user_mistake_without_traceback():
    out = run("simulate", "--quiet", "--strategy", "nope")
    assert out.returncode == 2
    assert out.stderr.startswith("error: Unknown strategy 'nope'")
    assert "Traceback" not in out.stderr


def test_a_services_python_warnings_are_one_log_line_without_a_source_path(capsys):
    """Issue 25's small trap: a raw InsecureKeyWarning with its source path in a service log."""
    import warnings

    from senseshield.cli.run import setup_logging
    from senseshield.he.paillier import InsecureKeyWarning

    before = warnings.showwarning
    try:
        setup_logging("info", "keyserver")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("A 1024-bit Paillier modulus is insecure.", InsecureKeyWarning)
    finally:
        warnings.showwarning = before
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "insecure" in line]
    assert len(lines) == 1 and "keyserver WARNING InsecureKeyWarning: A 1024-bit" in lines[0]
    assert ".py" not in err
