"""`senseshield attack` and `senseshield attack sweep`: real tiny runs and one-sentence errors."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from senseshield.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str):
    return CliRunner().invoke(app, ["attack", *args])


def test_attack_writes_metrics_per_trial_and_a_png(tmp_path):
    target = tmp_path / "run" / "ilrg.json"
    out = invoke(
        "--attack", "ilrg", "--strategy", "sensecrypt", "--cpu", "32,1", "--victims", "0,1",
        "--batch-size", "10", "--trials", "2", "--round", "1", "--quiet", "--out", str(target),
    )
    assert out.exit_code == 0, out.output
    data = json.loads(target.read_text())
    assert data["attack"] == "ilrg" and data["strategy"] == "sensecrypt"
    assert len(data["trials"]) == 4 and {t["client"] for t in data["trials"]} == {"c000", "c001"}
    for t in data["trials"]:
        assert sum(t["true_counts"]) == 10 and len(t["restored_counts"]) == 10
        assert 0 <= t["lnacc"] <= 1 and 0 <= t["leacc"] <= 1 and t["psnr"] is None
    slow = next(c for c in data["clients"] if c["id"] == "c001")
    assert slow["encryption_budget"] == pytest.approx(1 / 32)
    assert 0 < slow["he_ratio"] <= 1 / 32 + 1e-9
    assert (tmp_path / "run" / "ilrg.png").read_bytes().startswith(PNG)
    assert "LnAcc" in out.stdout


def test_image_attack_with_order_reports_image_metrics(tmp_path):
    target = tmp_path / "inv.json"
    out = invoke(
        "--attack", "inverting", "--strategy", "plaintext", "--order", "random", "--he-ratio",
        "0.05", "--batch-size", "2", "--trials", "1", "--round", "1", "--iterations", "20",
        "--quiet", "--out", str(target),
    )
    assert out.exit_code == 0, out.output
    trial = json.loads(target.read_text())["trials"][0]
    assert trial["he_ratio"] == pytest.approx(0.05, abs=1e-4)
    assert trial["psnr"] is not None and 0 <= trial["iip"] <= 1 and -1 <= trial["ssim"] <= 1
    assert target.with_suffix(".png").read_bytes().startswith(PNG)


def test_sweep_writes_points_heterogeneity_and_plots(tmp_path):
    target = tmp_path / "sweep.json"
    out = invoke(
        "sweep", "--ratios", "0,0.05", "--orders", "high,random", "--trials", "1",
        "--label-batch", "8", "--iterations", "10", "--cpus", "2,1", "--round", "1",
        "--quiet", "--out", str(target),
    )
    assert out.exit_code == 0, out.output
    data = json.loads(target.read_text())
    assert [(p["order"], p["ratio"]) for p in data["points"]] == [
        ("high", 0.0), ("high", 0.05), ("random", 0.0), ("random", 0.05)
    ]
    assert all(p["mi"] is not None and p["psnr"] is not None for p in data["points"])
    assert data["blind"]["mi"] == 0.0
    clients = data["heterogeneity"]["clients"]
    assert [c["unprotected"] for c in clients] == [False, False, True]
    assert clients[2]["he_ratio"] == 0.0 and clients[1]["encryption_budget"] == pytest.approx(0.5)
    for name in ("sweep-sweep.png", "sweep-heterogeneity.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--attack", "dlg"], "Unknown attack 'dlg'; choose one of"),
        (["--strategy", "nope"], "Unknown strategy 'nope'"),
        (["--order", "middle"], "--order='middle' is not allowed"),
        (["--he-ratio", "0"], "he-ratio"),
        (["--victims", "x"], "--victims 'x' is not a comma-separated list"),
        (["--victims", "99"], "--victims value 99 is not allowed"),
        (["--batch-size", "100000"], "--batch-size=100000 is not allowed"),
        (["--trials", "0"], "--trials=0"),
        (["--model", "mlp", "--activation", "tanh"], "only lenet5 has an activation"),
        (["--activation", "swish"], "activation='swish' is not allowed"),
        (["--optimizer", "sgd"], "optimizer='sgd' is not allowed"),
        (["--dataset", "nope"], "Unknown dataset 'nope'"),
        (["sweep", "--ratios", "0,1.5"], "--ratios value 1.5 is not allowed"),
        (["sweep", "--orders", "high,up"], "--orders value 'up' is not allowed"),
        (["sweep", "--image-attack", "ilrg"], "does not reconstruct images"),
        (["sweep", "--cpus", "1,-2"], "--cpus value -2.0 is not allowed"),
        (["sweep", "--plain-noise", "-1"], "plain_noise=-1.0 is not allowed; use a noise-to-signal ratio"),
        (["sweep", "--score", "loud"], "score='loud' is not allowed; choose one of"),
    ],
)
def test_user_mistakes_exit_2_with_one_sentence(args, message):
    out = invoke("--quiet", "--round", "1", *args) if args[0] != "sweep" else invoke(*args, "--quiet")
    assert out.exit_code == 2, out.output
    assert message in out.stderr
    assert out.exception is None or isinstance(out.exception, SystemExit)
    assert len(out.stderr.strip().splitlines()) == 1


def test_entry_point_reports_bad_attack_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "senseshield.cli", "attack", "--attack", "nope"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: Unknown attack 'nope'")
    assert "Traceback" not in out.stderr
