"""``senseshield export`` and ``edge-agent predict``: the command lines of
:mod:`senseshield.inference` (exporting a run's model to ONNX, classifying with one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from senseshield.errors import ConfigError
from senseshield.inference import export_run, load_input, load_session, sidecar_path


def predict_command(
    input: Path = typer.Argument(
        ...,
        help="A .npy array of one sample of the model's input shape (e.g. (3, 64), (20,) or "
        "(1, 8, 8)) or a batch (N, ...) of them, scaled as in training; or, for image models "
        "(C, H, W) only, an image (png, jpg) that is converted to grayscale (RGB for 3 "
        "channels), resized to the model's input size and scaled to [0, 1] (bytes / 255), "
        "like the datasets.",
        show_default=False,
    ),
    model: Path = typer.Option(
        ..., "--model", "-m",
        help="Exported ONNX model; its sidecar MODEL.json must sit next to it.",
        show_default=False,
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (all scores) instead of a table."
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1,
        help="onnxruntime intra-op threads (default: one per physical core).",
    ),
    invert: bool = typer.Option(
        False, "--invert",
        help="Invert values (v -> 1 - v): for dark ink on a light background; the "
        "datasets have bright ink on black.",
    ),
    top: int = typer.Option(3, "--top", min=1, help="Classes shown per sample in the table."),
) -> None:
    """Classify INPUT with an exported model (onnxruntime, CPU) and print class and scores."""
    from senseshield.cli.common import fail, out

    try:
        session = load_session(model, threads=threads)
        x = load_input(input, session.input_shape, invert=invert)
        classes, scores = session.predict(x)
    except ConfigError as exc:
        fail(str(exc))
        return
    side = session.sidecar
    labels = side.class_labels
    if as_json:
        payload = {
            "model": str(model),
            "fleet": side.fleet,
            "cluster": side.cluster,
            "round": side.round,
            "predictions": [
                {
                    "class": int(k),
                    "label": labels[int(k)],
                    "score": float(s[int(k)]),
                    "scores": [round(float(v), 6) for v in s],
                }
                for k, s in zip(classes, scores)
            ],
        }
        typer.echo(json.dumps(payload, indent=2))
        return

    from rich.table import Table

    table = Table(title=f"{side.model} - fleet {side.fleet}, cluster {side.cluster}, "
                        f"round {side.round}")
    for col, justify in (("sample", "right"), ("class", "right"), ("label", "left"),
                         ("score", "right"), ("next best", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, (k, s) in enumerate(zip(classes, scores)):
        order = np.argsort(-s, kind="stable")[1:top]
        runners = ", ".join(f"{labels[j]} ({s[j]:.3f})" for j in order)
        table.add_row(str(i), str(int(k)), labels[int(k)], f"{s[int(k)]:.3f}", runners)
    out.print(table)


def export_command(
    run: Path = typer.Option(
        ..., "--run",
        help="Fleet run directory (`fleet up --out` / `coordinator serve --out`): report.json (model, input shape, and the job's model_args under config) and models/round-<R>/cluster-<K>.npy.",
        show_default=False,
    ),
    cluster: int = typer.Option(
        ..., "--cluster", "-k", min=0, help="Cluster whose model to export.", show_default=False
    ),
    round: Optional[int] = typer.Option(
        None, "--round", "-r", min=0,
        help="Round to export (default: the highest round saved in the run).",
    ),
    out: Path = typer.Option(
        ..., "--out", "-o",
        help="ONNX file to write; the sidecar goes to OUT.json next to it.",
        show_default=False,
    ),
) -> None:
    """Export a cluster's model of a fleet run to ONNX (opset 18) with a JSON sidecar."""
    from senseshield.cli.common import console, fail, storage_stop
    from senseshield.errors import StorageError

    try:
        sidecar, _ = export_run(run, cluster, round, out)
    except StorageError as exc:
        storage_stop(exc, "export", "nothing was written")
    except ConfigError as exc:
        fail(str(exc))
        return
    console.print(
        f"wrote {out} ({sidecar.model}, fleet {sidecar.fleet}, cluster {sidecar.cluster}, "
        f"round {sidecar.round}, opset {sidecar.opset}, sha256 {sidecar.sha256[:16]}...) "
        f"and {sidecar_path(out)}",
        highlight=False, soft_wrap=True,
    )
