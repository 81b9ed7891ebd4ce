"""ONNX export: a model and its flat parameter vector to an ONNX file and its sidecar
(:func:`export_onnx`), and a fleet run's cluster models (:func:`export_run`). What the
exported graph and the sidecar hold is described in :mod:`senseshield.inference`, which
also re-exports both functions and opens the files with onnxruntime."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from senseshield.errors import ConfigError
from senseshield.inference import (
    EXPORTERS,
    INPUT_NAME,
    OPSET,
    OUTPUT_NAME,
    Sidecar,
    _sha256,
    sidecar_path,
)
from senseshield.shapes import check_input_shape

__all__ = ["export_onnx", "export_run"]


@contextlib.contextmanager
def _quiet_torch_onnx() -> Iterator[None]:
    """Silence the exporters' warnings, log lines and progress prints for one export."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo",
                                               "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _json_model_args(model_args: Any) -> dict[str, Any]:
    """``model_args`` as the JSON object the sidecar records (tuples become lists), so the
    architecture exported is the one a reader of the sidecar rebuilds."""
    if model_args is None:
        return {}
    if not isinstance(model_args, Mapping):
        raise ConfigError(
            f"model_args={model_args!r} is not allowed; it must be a mapping of keyword "
            f"arguments."
        )
    try:
        return json.loads(json.dumps(dict(model_args), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"model_args={dict(model_args)!r} is not allowed; the sidecar records them, so "
            f"they must be JSON values (numbers, strings, booleans, lists, objects) ({exc})."
        ) from None


def export_onnx(
    model_name: str,
    input_shape: Sequence[int],
    num_classes: int,
    weights: np.ndarray,
    out_path: Path | str,
    *,
    fleet: str,
    cluster: int,
    round: int,
    class_labels: Optional[Sequence[str]] = None,
    opset: int = OPSET,
    model_args: Optional[Mapping[str, Any]] = None,
    exporter: str = "torchscript",
) -> Sidecar:
    """Export model ``model_name`` with flat parameter vector ``weights`` to ``out_path``.

    Writes the ONNX file and its sidecar :func:`sidecar_path` (``<out_path>.json``), both
    atomically, and returns the sidecar. ``model_name`` is anything
    :func:`senseshield.models.build_model` resolves (a built-in name, an entry point, or an
    import path ``pkg.mod:fn`` / ``file.py:fn``), ``input_shape`` has any rank (``(C, L)``,
    ``(F,)``, ``(C, H, W)``), and ``model_args`` are the keywords the model was trained with
    (e.g. lenet5's ``activation``, har_cnn's ``channels``): the same architecture is rebuilt
    from them, and they are recorded in the sidecar, so they must be JSON values.
    ``class_labels`` defaults to ``"0"``, ``"1"``, ... Bad names, shapes, labels, model_args
    or a vector of the wrong size raise :class:`ConfigError`. The caller's torch RNG state
    is left untouched.

    ``exporter="torchscript"`` (the default) uses torch's TorchScript-based exporter
    (``dynamo=False``): on these small ``nn.Sequential`` models it is about ten times
    faster than the torch.export-based one (~0.1 s instead of 0.6-2 s per export), writes a
    single self-contained file, is byte-deterministic and gives the same operators. It is
    deprecated since torch 2.9 but present in every torch the project allows (< 2.14);
    ``exporter="dynamo"`` selects the torch.export-based exporter, and is used automatically
    if the TorchScript one fails.
    """
    import torch

    from senseshield.models import check_weights, model_with_weights, num_values
    from senseshield.training import set_vector

    if exporter not in EXPORTERS:
        raise ConfigError(
            f"exporter={exporter!r} is not allowed; choose one of: {', '.join(EXPORTERS)}."
        )
    if isinstance(opset, bool) or not isinstance(opset, int) or not 13 <= opset <= 20:
        raise ConfigError(f"opset={opset!r} is not allowed; it must be an integer in [13, 20].")
    for name, value in (("cluster", cluster), ("round", round)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"{name}={value!r} is not allowed; it must be an integer >= 0.")
    if not isinstance(fleet, str) or not fleet:
        raise ConfigError(f"fleet={fleet!r} is not allowed; it must be a non-empty string.")
    args = _json_model_args(model_args)
    shape = check_input_shape(input_shape)
    key = (model_name, shape, num_classes, json.dumps(args, sort_keys=True), opset)
    template = _TEMPLATES.get(key) if exporter == "torchscript" else None
    if template is None:  # a fresh module with the weights (the model a run's result gives)
        model = model_with_weights(model_name, shape, num_classes, weights, model_args=args)
    else:  # the graph's module, built at its first export; its weights are replaced below
        model = template[2]
        what = f"model {model_name!r} on input shape {shape} with {num_classes} classes"
        vector = check_weights(weights, num_values(model), what)
    num_classes = int(num_classes)
    if class_labels is None:
        labels = tuple(str(i) for i in range(num_classes))
    else:
        labels = tuple(class_labels)
        if len(labels) != num_classes or not all(isinstance(s, str) for s in labels):
            raise ConfigError(
                f"class_labels={list(labels)!r} is not allowed; it must be {num_classes} strings."
            )

    out_path = Path(out_path)
    if out_path.is_dir():
        raise ConfigError(
            f"Output {str(out_path)!r} is a directory; give a file path such as "
            f"{str(out_path / 'model.onnx')!r}."
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    used = exporter
    with _EXPORTING:  # a template's module is shared by every export of its graph
        if template is not None:  # the same graph again: only the weights change
            set_vector(model, vector)
            model.eval()
            data = _refill(template, model)
        else:
            if exporter == "torchscript":
                try:
                    data = _export_torchscript(model, shape, opset)
                except Exception:  # noqa: BLE001 - e.g. a torch without the legacy exporter
                    used = "dynamo"
            if used == "dynamo":
                data = _export_dynamo(model, shape, opset)
            elif key not in _TEMPLATES:
                _TEMPLATES[key] = _template(data, model)
    data = _finish_proto(data, {
        "senseshield.runtime.fleet": fleet,
        "senseshield.cluster": str(int(cluster)),
        "senseshield.round": str(int(round)),
        "senseshield.model": model_name,
        "senseshield.class_labels": json.dumps(list(labels)),
    })

    sidecar = Sidecar(
        fleet=fleet,
        cluster=int(cluster),
        round=int(round),
        model=model_name,
        input_shape=shape,  # type: ignore[arg-type]
        num_classes=num_classes,
        class_labels=labels,
        opset=opset,
        sha256=_sha256(data),
        model_args=args,
        exporter=used,
        torch_version=torch.__version__,
    )
    from senseshield.runtime.files import write_atomic

    # an export is the publishing step: the model is written for the runtimes that serve it
    write_atomic(out_path, data, mode=0o644)
    write_atomic(sidecar_path(out_path), sidecar.to_json().encode("utf-8"), mode=0o644)
    return sidecar


# (model, input shape, classes, model_args, opset) -> a TorchScript export of that graph, the
# names of its initialisers that are the model's floating state and the module (later exports
# set its weights instead of building it again, ~2 ms of LeNet-5's 5), or None when the
# initialisers are not exactly the state (constant folding derived one from the weights): see _template
_TEMPLATES: dict[tuple, tuple[bytes, frozenset[str], Any] | None] = {}
_EXPORTING = threading.Lock()


def _template(data: bytes, model: Any) -> tuple[bytes, frozenset[str], Any] | None:
    """``data`` (an export of ``model``) as a template for later exports of the same graph, if
    every floating initialiser is one of the model's floating state tensors, by name, shape
    and value, stored as raw float32, and every such tensor is an initialiser: then an export
    of other weights differs from ``data`` only in those initialisers' bytes (the exporter is
    byte-deterministic), and :func:`_refill` writes them instead of tracing and exporting
    again (25 ms to a few on an idle x86 core for LeNet-5; 20x that on a device at 5 % of a
    CPU). None otherwise, and every export of that graph runs the exporter."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load_model_from_string(data)
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items() if v.is_floating_point()}
    names = set()
    for init in proto.graph.initializer:
        if init.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                  onnx.TensorProto.BFLOAT16):
            continue
        value = state.get(init.name)
        if (value is None or init.data_type != onnx.TensorProto.FLOAT or not init.raw_data
                or not np.array_equal(numpy_helper.to_array(init), value)):
            return None
        names.add(init.name)
    if names != set(state):
        return None
    return data, frozenset(names), model


def _refill(template: tuple[bytes, frozenset[str], Any], model: Any) -> bytes:
    """The template's export with ``model``'s weights in its initialisers (see :func:`_template`)."""
    import onnx

    data, names, _ = template
    proto = onnx.load_model_from_string(data)
    state = model.state_dict()
    for init in proto.graph.initializer:
        if init.name in names:
            init.raw_data = state[init.name].detach().cpu().numpy().astype("<f4").tobytes()
    return proto.SerializeToString()


def _export_torchscript(model: Any, shape: tuple[int, ...], opset: int) -> bytes:
    import torch

    buffer = io.BytesIO()
    with _quiet_torch_onnx(), torch.no_grad():
        torch.onnx.export(
            model,
            (torch.zeros((2, *shape)),),  # batch 2: nothing gets specialised to batch 1
            buffer,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
        )
    return buffer.getvalue()


def _export_dynamo(model: Any, shape: tuple[int, ...], opset: int) -> bytes:
    import torch

    with tempfile.TemporaryDirectory() as tmp, _quiet_torch_onnx():
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            model,
            (torch.zeros((2, *shape)),),
            str(path),
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
            opset_version=opset,
            external_data=False,
            verbose=False,
        )
        return path.read_bytes()


def _finish_proto(data: bytes, metadata: dict[str, str]) -> bytes:
    """Name the batch axis ``batch``, record ``metadata`` in the model, and check it."""
    import onnx

    proto = onnx.load_model_from_string(data)
    for value in (*proto.graph.input, *proto.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.dim_param = "batch"
    keep = [p for p in proto.metadata_props if not p.key.startswith("senseshield.")]
    del proto.metadata_props[:]
    proto.metadata_props.extend(keep)
    for key, value in sorted(metadata.items()):
        proto.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


# --------------------------------------------------------------------------------- runs


def _load_report(run: Path) -> dict[str, Any]:
    if not run.is_dir():
        raise ConfigError(f"Run directory {str(run)!r} does not exist.")
    report_file = run / "report.json"
    try:
        report = json.loads(report_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"Run directory {str(run)!r} has no report.json; is it a fleet run directory?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"Cannot read {str(report_file)!r} as JSON ({exc}).") from None
    if not isinstance(report, dict):
        raise ConfigError(f"{str(report_file)!r} is not a JSON object.")
    missing = [k for k in ("model", "fleet", "input_shape", "num_classes") if k not in report]
    if missing:
        raise ConfigError(f"{str(report_file)!r} lacks the field(s) {', '.join(missing)}.")
    return report


def _run_model_args(report: dict[str, Any], run: Path) -> Any:
    """The job's ``model_args`` from a report's ``config`` ({} for a job without them, as
    before jobs had them); :func:`export_onnx` checks them."""
    config = report.get("config", {})
    if not isinstance(config, dict):
        raise ConfigError(
            f"{str(run / 'report.json')!r} has config={config!r}; it must be a JSON object (the job)."
        )
    return config.get("model_args", {})


def _numbered(directory: Path, pattern: str) -> dict[int, Path]:
    regex = re.compile(pattern)
    found: dict[int, Path] = {}
    if directory.is_dir():
        for entry in directory.iterdir():
            match = regex.fullmatch(entry.name)
            if match:
                found[int(match.group(1))] = entry
    return found


def _listing(numbers: Sequence[int]) -> str:
    return ", ".join(map(str, sorted(numbers))) if numbers else "none"


def export_run(
    run: Path | str, cluster: int, round: Optional[int], out: Path | str
) -> tuple[Sidecar, Path]:
    """Export cluster ``cluster``'s model of ``round`` (default: the highest round) of a run.

    The run directory holds ``report.json`` (at least ``model``, ``fleet``, ``input_shape``
    of any rank and ``num_classes``; optionally ``class_labels``, and ``config``, the job,
    whose ``model_args`` rebuild the run's architecture) and the flat parameter vectors
    ``models/round-<R>/cluster-<K>.npy``. Without ``round`` the highest
    round directory present is used, and the cluster must exist there. A missing run,
    round or cluster raises :class:`ConfigError` naming what exists. Returns the sidecar
    and the round directory used.
    """
    run = Path(run)
    report = _load_report(run)
    models_dir = run / "models"
    rounds = _numbered(models_dir, r"round-(\d+)")
    if not rounds:
        raise ConfigError(f"Run {str(run)!r} has no saved models (no {str(models_dir)}/round-<R>/).")
    if round is None:
        round = max(rounds)
    elif round not in rounds:
        raise ConfigError(
            f"round={round} is not in run {str(run)!r}; saved rounds: {_listing(list(rounds))}."
        )
    clusters = _numbered(rounds[round], r"cluster-(\d+)\.npy")
    if cluster not in clusters:
        elsewhere = [r for r in rounds if (rounds[r] / f"cluster-{cluster}.npy").is_file()]
        hint = f"; cluster {cluster} is saved in round(s) {_listing(elsewhere)}" if elsewhere else ""
        raise ConfigError(
            f"cluster={cluster} has no model in round {round} of run {str(run)!r}; clusters "
            f"in that round: {_listing(list(clusters))}{hint}."
        )
    try:
        weights = np.load(clusters[cluster], allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Cannot read {str(clusters[cluster])!r} as a .npy array ({exc}).") from None
    sidecar = export_onnx(
        str(report["model"]),
        report["input_shape"],
        report["num_classes"],
        weights,
        out,
        fleet=str(report["fleet"]),
        cluster=cluster,
        round=round,
        class_labels=report.get("class_labels"),
        model_args=_run_model_args(report, run),
    )
    return sidecar, rounds[round]


