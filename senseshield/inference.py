"""On-device inference: ONNX export of a cluster's model and onnxruntime on the edge agent.

* :func:`export_onnx` turns a model name (built-in, entry point or import path, see
  :mod:`senseshield.models`), its ``model_args``, its input shape (any rank: ``(C, L)``,
  ``(F,)``, ``(C, H, W)``) and class count and a flat parameter vector (the layout of
  :func:`senseshield.training.get_vector`) into an ONNX file plus a JSON *sidecar*
  describing it (:class:`Sidecar`).
* :func:`load_session` opens such a file with onnxruntime after checking it against its
  sidecar; :meth:`InferenceModel.predict` classifies samples.
* :func:`latency` measures p50/p95 forward latency of a torch module or an onnxruntime
  model at batch 1 and batch 32 (``benchmarks/bench_inference.py``, ``edge-agent profile``).
* the command lines ``senseshield export`` and ``edge-agent predict`` are in
  :mod:`senseshield.cli.inference`.

The export (:func:`export_onnx`, and :func:`export_run` for a fleet run's cluster models) is
in :mod:`senseshield.onnx_export`; both are importable from here.

The exported graph
------------------
One float32 input named ``"input"`` of shape ``(batch, *input_shape)`` (``(batch, C, L)``
for 1-D signals, ``(batch, F)`` for tabular rows, ``(batch, C, H, W)`` for images) and one
float32 output
named ``"logits"`` of shape ``(batch, num_classes)``; the batch axis is dynamic (named
``"batch"``). The graph uses the default ONNX domain at opset :data:`OPSET` (18).
BatchNorm is exported in inference mode (running statistics, folded into the convolution).

Inputs are what the model was trained on: the built-in image datasets of
:mod:`senseshield.data` are float32 in ``[0, 1]`` with 0 as background and 1 as full ink
(``digits``: counts 0..16 divided by 16; ``mnist5k``: bytes 0..255 divided by 255); images
given to ``edge-agent predict`` are scaled that way.

The sidecar
-----------
``<onnx file>.json`` next to the ONNX file (``model.onnx`` -> ``model.onnx.json``), a JSON
object with: ``format`` (:data:`SIDECAR_FORMAT`), ``fleet``, ``cluster``, ``round``,
``model``, ``model_args`` (the keywords the model was built with; sidecars written before
it was renamed call it ``model_options``, which is still read), ``input_shape`` (a list of
any rank, e.g. ``[3, 64]``, ``[20]``, ``[1, 8, 8]``), ``num_classes``,
``class_labels`` (one string per class), ``opset``, ``input_name``, ``output_name``,
``input_scaling``, ``exporter``, ``torch_version`` and ``sha256`` (hex SHA-256 of the ONNX
file's bytes). Export is deterministic: the same model, weights and metadata give
byte-identical ONNX and sidecar files (the sidecar holds no timestamp).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from senseshield.errors import ConfigError
from senseshield.shapes import check_input_shape

__all__ = [
    "EXPORTERS",
    "INPUT_NAME",
    "INPUT_SCALING",
    "OPSET",
    "OUTPUT_NAME",
    "SIDECAR_FORMAT",
    "InferenceModel",
    "Sidecar",
    "export_command",
    "export_onnx",
    "export_run",
    "latency",
    "load_input",
    "load_session",
    "predict_command",
    "sidecar_path",
]

#: ONNX opset of exported graphs (default domain). 18 is the lowest opset that torch's
#: torch.export-based exporter emits natively (so switching exporter does not change the
#: graph's opset), it covers every operator our models need (Conv, Gemm, MaxPool, Relu,
#: Sigmoid, Tanh, Flatten/Reshape), and every onnxruntime the project allows (>= 1.18,
#: which runs opsets up to 20) executes it with its full set of CPU kernels.
OPSET = 18

#: Name of the graph input, ``(batch, *input_shape)`` float32.
INPUT_NAME = "input"
#: Name of the graph output, ``(batch, num_classes)`` float32 logits.
OUTPUT_NAME = "logits"
#: Version tag of the sidecar layout.
SIDECAR_FORMAT = "senseshield-onnx/1"
#: How inputs are scaled (recorded in the sidecar; images given to ``edge-agent predict``
#: are converted this way; other inputs are as the model was trained on).
INPUT_SCALING = "float32 in [0, 1]: 0 = background, 1 = full ink (image bytes / 255)"
#: The torch exporters :func:`export_onnx` can use; the first is the default.
EXPORTERS = ("torchscript", "dynamo")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ----------------------------------------------------------------------------- sidecar


def sidecar_path(onnx_path: Path | str) -> Path:
    """The sidecar of ``onnx_path``: the same path with ``.json`` appended."""
    onnx_path = Path(onnx_path)
    return onnx_path.with_name(onnx_path.name + ".json")


@dataclass(frozen=True)
class Sidecar:
    """What an exported ONNX file is: whose model, which round, which inputs, which hash."""

    fleet: str
    cluster: int
    round: int
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    class_labels: tuple[str, ...]
    opset: int
    sha256: str
    model_args: dict[str, Any] = field(default_factory=dict)
    input_name: str = INPUT_NAME
    output_name: str = OUTPUT_NAME
    input_scaling: str = INPUT_SCALING
    exporter: str = EXPORTERS[0]
    torch_version: str = ""
    format: str = SIDECAR_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (lists instead of tuples)."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["class_labels"] = list(self.class_labels)
        return data

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, two-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "sidecar") -> "Sidecar":
        """Validate a parsed sidecar; anything malformed raises :class:`ConfigError`."""
        if not isinstance(data, dict):
            raise ConfigError(f"Sidecar {where!r} is not a JSON object.")
        if data.get("format") != SIDECAR_FORMAT:
            raise ConfigError(
                f"Sidecar {where!r} has format {data.get('format')!r}; "
                f"only {SIDECAR_FORMAT!r} is supported."
            )
        required = ("fleet", "cluster", "round", "model", "input_shape", "num_classes",
                    "class_labels", "opset", "sha256")
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"Sidecar {where!r} lacks the field(s) {', '.join(missing)}.")

        def bad(key: str, rule: str) -> ConfigError:
            return ConfigError(f"Sidecar {where!r} has {key}={data.get(key)!r}; it must be {rule}.")

        def integer(key: str, minimum: int) -> int:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise bad(key, f"an integer >= {minimum}")
            return value

        shape = data["input_shape"]
        if not (isinstance(shape, list) and len(shape) >= 1 and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
            raise bad("input_shape", "a non-empty list of positive integers such as [3, 64], "
                      "[20] or [1, 8, 8]")
        num_classes = integer("num_classes", 1)  # regression: 1 output
        labels = data["class_labels"]
        if not (isinstance(labels, list) and len(labels) == num_classes
                and all(isinstance(s, str) for s in labels)):
            raise bad("class_labels", f"a list of {num_classes} strings")
        if not (isinstance(data["sha256"], str) and _HEX64.match(data["sha256"])):
            raise bad("sha256", "64 lowercase hexadecimal digits")
        for key in ("fleet", "model"):
            if not isinstance(data[key], str) or not data[key]:
                raise bad(key, "a non-empty string")
        if "model_args" in data and "model_options" in data:
            raise ConfigError(
                f"Sidecar {where!r} has both model_args and model_options (its older name); "
                f"keep only model_args."
            )
        args_key = "model_options" if "model_options" in data else "model_args"
        model_args = data.get(args_key, {})
        if not isinstance(model_args, dict):
            raise bad(args_key, "a JSON object")
        return cls(
            fleet=data["fleet"],
            cluster=integer("cluster", 0),
            round=integer("round", 0),
            model=data["model"],
            input_shape=tuple(shape),
            num_classes=num_classes,
            class_labels=tuple(labels),
            opset=integer("opset", 1),
            sha256=data["sha256"],
            model_args=dict(model_args),
            input_name=str(data.get("input_name", INPUT_NAME)),
            output_name=str(data.get("output_name", OUTPUT_NAME)),
            input_scaling=str(data.get("input_scaling", INPUT_SCALING)),
            exporter=str(data.get("exporter", EXPORTERS[0])),
            torch_version=str(data.get("torch_version", "")),
        )

    @classmethod
    def read(cls, path: Path) -> "Sidecar":
        """Read and validate the sidecar file at ``path``."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"Sidecar {str(path)!r} does not exist.") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"Cannot read sidecar {str(path)!r}: {exc}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"Sidecar {str(path)!r} is not valid JSON ({exc.msg}).") from None
        return cls.from_dict(data, where=str(path))


# ------------------------------------------------------------------------------ hashes


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- inference


@dataclass(frozen=True, eq=False)
class InferenceModel:
    """An exported model opened with onnxruntime; build it with :func:`load_session`."""

    path: Path
    sidecar: Sidecar
    session: Any  # onnxruntime.InferenceSession
    threads: Optional[int]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample, any rank: ``(C, L)``, ``(F,)``, ``(C, H, W)``, ..."""
        return self.sidecar.input_shape

    @property
    def expected(self) -> str:
        """What :meth:`check_input` accepts, for messages: "one sample of shape (3, 64) or a
        batch of shape (N, 3, 64)"."""
        shape = self.input_shape
        return (f"one sample of shape {shape} or a batch of shape "
                f"(N, {', '.join(map(str, shape))})")

    @property
    def class_labels(self) -> tuple[str, ...]:
        return self.sidecar.class_labels

    def check_input(self, x: Any) -> np.ndarray:
        """``x`` as a float32 batch ``(N, *input_shape)``; a single sample of shape
        ``input_shape`` gets a batch axis. Anything else raises :class:`ConfigError` naming
        the expected shape."""
        try:
            array = np.asarray(x, dtype=np.float32)
        except (TypeError, ValueError):
            raise ConfigError(
                f"Input is not an array of numbers; model {self.sidecar.model!r} expects "
                f"float32 numbers, {self.expected}."
            ) from None
        shape = self.input_shape
        if array.shape == shape:
            array = array[None]
        if array.ndim != len(shape) + 1 or array.shape[1:] != shape or array.shape[0] < 1:
            raise ConfigError(
                f"Input of shape {tuple(array.shape)} does not fit model {self.sidecar.model!r}; "
                f"it expects {self.expected}."
            )
        if not np.all(np.isfinite(array)):
            raise ConfigError("Input contains NaN or infinite values; every value must be finite.")
        return np.ascontiguousarray(array)

    def logits(self, x: Any) -> np.ndarray:
        """Raw float32 logits ``(N, num_classes)`` for a sample or batch (see :meth:`check_input`)."""
        batch = self.check_input(x)
        return self.session.run([self.sidecar.output_name], {self.sidecar.input_name: batch})[0]

    def predict(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Classify a sample ``input_shape`` or a batch ``(N, *input_shape)``.

        Returns ``(classes, scores)``: int64 ``(N,)`` predicted class indices (``N`` = 1 for
        a single sample) and float32 ``(N, num_classes)`` softmax probabilities. A wrongly
        shaped input raises :class:`ConfigError` naming the expected shape.
        """
        logits = self.logits(x).astype(np.float64)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
        return logits.argmax(axis=1).astype(np.int64), scores


TELEMETRY_ENV = "ORT_DISABLE_TELEMETRY"


def onnxruntime() -> Any:
    """The ``onnxruntime`` module, imported with its telemetry off unless ``$ORT_DISABLE_TELEMETRY``
    is set: onnxruntime (>= 1.2x on Linux) otherwise writes a device id and an event store into
    ``~/.cache/Microsoft/DeveloperTools/.onnxruntime`` on import, and SenseShield writes nothing
    into the home directory without saying so."""
    os.environ.setdefault(TELEMETRY_ENV, "1")
    import onnxruntime as ort

    return ort


def load_session(onnx_path: Path | str, *, threads: Optional[int] = None) -> InferenceModel:
    """Open the exported model at ``onnx_path`` with onnxruntime (CPUExecutionProvider).

    Before anything runs, the file must match its sidecar (``<onnx_path>.json``): the
    SHA-256 of the bytes equals the recorded one, the bytes parse and pass the ONNX checker,
    and the graph's opset, input/output names and shapes are the ones the sidecar declares.
    A missing file or sidecar, a hash mismatch (corrupted, truncated or replaced file) or a
    file that is not ONNX raises :class:`ConfigError`. ``threads`` sets onnxruntime's
    intra-op threads (``None``: onnxruntime's default, one per physical core).
    """
    import onnx

    ort = onnxruntime()
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ConfigError(f"threads={threads!r} is not allowed; it must be an integer >= 1.")
    path = Path(onnx_path)
    side = sidecar_path(path)
    if not path.is_file():
        raise ConfigError(f"ONNX model file {str(path)!r} does not exist.")
    if not side.is_file():
        raise ConfigError(
            f"ONNX model {str(path)!r} has no sidecar {str(side)!r}; export the model again "
            f"so that both files are written."
        )
    sidecar = Sidecar.read(side)
    data = path.read_bytes()
    digest = _sha256(data)
    if digest != sidecar.sha256:
        raise ConfigError(
            f"ONNX model {str(path)!r} has SHA-256 {digest[:16]}... but its sidecar records "
            f"{sidecar.sha256[:16]}...; the file is corrupted or does not belong to this sidecar."
        )
    try:
        proto = onnx.load_model_from_string(data)
        onnx.checker.check_model(proto)
    except Exception as exc:  # noqa: BLE001 - protobuf DecodeError, ValidationError, ...
        raise ConfigError(
            f"File {str(path)!r} is not a valid ONNX model ({type(exc).__name__})."
        ) from None
    _check_graph(proto, sidecar, path)

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # errors only
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's InvalidGraph, Fail, ...
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"onnxruntime cannot load {str(path)!r}: {first}.") from None
    return InferenceModel(path=path, sidecar=sidecar, session=session, threads=threads)


def _check_graph(proto: Any, sidecar: Sidecar, path: Path) -> None:
    """The graph is the one the sidecar describes (opset, names, shapes)."""
    def dims(value: Any) -> list[Any]:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in value.type.tensor_type.shape.dim]

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    inputs, outputs = list(proto.graph.input), list(proto.graph.output)
    problems = []
    if opset != sidecar.opset:
        problems.append(f"opset {opset} instead of {sidecar.opset}")
    if len(inputs) != 1 or inputs[0].name != sidecar.input_name \
            or dims(inputs[0])[1:] != list(sidecar.input_shape):
        got = [(i.name, dims(i)) for i in inputs]
        problems.append(f"inputs {got} instead of {sidecar.input_name!r} (batch, "
                        f"{', '.join(map(str, sidecar.input_shape))})")
    if len(outputs) != 1 or outputs[0].name != sidecar.output_name \
            or dims(outputs[0])[1:] != [sidecar.num_classes]:
        got = [(o.name, dims(o)) for o in outputs]
        problems.append(f"outputs {got} instead of {sidecar.output_name!r} "
                        f"(batch, {sidecar.num_classes})")
    if problems:
        raise ConfigError(
            f"ONNX model {str(path)!r} does not match its sidecar: {'; '.join(problems)}."
        )


# ------------------------------------------------------------------------------ latency


def latency(
    session_or_model: Any,
    input_shape: Sequence[int],
    *,
    repeats: int,
    batch_sizes: Sequence[int] = (1, 32),
    warmup: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """p50/p95 wall-clock latency of one forward pass at each of ``batch_sizes``.

    ``session_or_model`` is a torch ``nn.Module`` (run in eval mode under
    ``torch.inference_mode``, with torch's current thread count), an :class:`InferenceModel`
    or a bare ``onnxruntime.InferenceSession`` (run with ``session.run``; threads as the
    session was built). Only the forward pass is timed, not input checks or softmax. Inputs
    are uniform random ``[0, 1)`` float32 of shape ``(batch, *input_shape)``, for an
    ``input_shape`` of any rank (``(C, L)``, ``(F,)``, ``(C, H, W)``); an
    :class:`InferenceModel` must be given its own recorded shape.

    Returns ``{"backend", "threads", "input_shape", "repeats", "warmup", "batches": {"1":
    {"p50_ms", "p95_ms", "p50_per_sample_ms"}, "32": {...}}}``.
    """
    import torch
    from torch import nn

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats={repeats!r} is not allowed; it must be an integer >= 1.")
    shape = check_input_shape(input_shape)
    rng = np.random.default_rng(seed)

    if isinstance(session_or_model, nn.Module):
        module = session_or_model.eval()
        backend, threads = "torch", torch.get_num_threads()

        def runner(x: np.ndarray) -> Any:
            tensor = torch.from_numpy(x)

            def run() -> None:
                with torch.inference_mode():
                    module(tensor)
            return run
    else:
        if isinstance(session_or_model, InferenceModel):
            session = session_or_model.session
            if session_or_model.input_shape != shape:
                raise ConfigError(
                    f"input_shape={shape} is not allowed for {str(session_or_model.path)!r}; "
                    f"the model expects {session_or_model.input_shape}."
                )
        elif hasattr(session_or_model, "run") and hasattr(session_or_model, "get_inputs"):
            session = session_or_model
        else:
            raise TypeError(
                f"latency() needs a torch module, an InferenceModel or an onnxruntime "
                f"InferenceSession, not {type(session_or_model).__name__}."
            )
        backend = "onnxruntime"
        threads = int(session.get_session_options().intra_op_num_threads) or None
        name = session.get_inputs()[0].name

        def runner(x: np.ndarray) -> Any:
            def run() -> None:
                session.run(None, {name: x})
            return run

    batches: dict[str, dict[str, float]] = {}
    for batch in batch_sizes:
        run = runner(rng.random((int(batch), *shape), dtype=np.float32))
        for _ in range(warmup):
            run()
        times = np.empty(repeats)
        for i in range(repeats):
            start = time.perf_counter()
            run()
            times[i] = time.perf_counter() - start
        p50, p95 = (float(v) * 1e3 for v in np.percentile(times, [50, 95]))
        batches[str(int(batch))] = {
            "p50_ms": p50, "p95_ms": p95, "p50_per_sample_ms": p50 / int(batch),
        }
    return {
        "backend": backend,
        "threads": threads,
        "input_shape": list(shape),
        "repeats": repeats,
        "warmup": warmup,
        "batches": batches,
    }


# ---------------------------------------------------------------------------- CLI parts


def load_input(path: Path | str, input_shape: Sequence[int], *, invert: bool = False) -> np.ndarray:
    """Read a prediction input: a ``.npy`` array (returned as stored, float32) or an image.

    A ``.npy`` array works for an ``input_shape`` of any rank; its shape is checked by
    :meth:`InferenceModel.check_input` (``input_shape`` or ``(N, *input_shape)``). Images
    are accepted only for image models (``input_shape`` ``(C, H, W)`` with C = 1 or 3); for
    any other shape a non-``.npy`` input raises :class:`ConfigError` saying so.

    Images (png, jpg, anything Pillow reads) are converted to grayscale (``L``; ``RGB`` for a
    3-channel model), resized to the model's ``H x W`` (box filter when shrinking, which
    averages pixel blocks as the 8x8 digits were made; bilinear when enlarging), and scaled
    like the datasets: bytes / 255 to ``[0, 1]``. The datasets have bright ink on a dark
    background; ``invert=True`` maps ``v`` to ``1 - v`` for dark-on-light pictures.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Input file {str(path)!r} does not exist.")
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"Cannot read {str(path)!r} as a .npy array ({exc}).") from None
        if not np.issubdtype(array.dtype, np.number):
            raise ConfigError(f"Array {str(path)!r} has dtype {array.dtype}; it must be numeric.")
        array = array.astype(np.float32)
        return 1.0 - array if invert else array
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3:
        batch = ", ".join(map(str, shape))
        raise ConfigError(
            f"Input {str(path)!r} is not a .npy file, and only models with image inputs "
            f"(C, H, W) also accept images; this model takes input_shape {shape}, so pass a "
            f".npy array of shape {shape} or (N, {batch})."
        )
    c, h, w = shape
    if c not in (1, 3):
        raise ConfigError(
            f"Image input needs a 1- or 3-channel model, this one has {c} channels; "
            f"pass a .npy array of shape {tuple(input_shape)} instead."
        )
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError("Image input needs Pillow (`pip install pillow`); or pass a .npy array.") from None
    try:
        with Image.open(path) as image:
            image = image.convert("L" if c == 1 else "RGB")
            shrink = image.width >= w and image.height >= h
            resample = Image.Resampling.BOX if shrink else Image.Resampling.BILINEAR
            pixels = np.asarray(image.resize((w, h), resample), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(
            f"Input {str(path)!r} is neither a .npy array nor an image Pillow can read "
            f"(png, jpg) ({type(exc).__name__})."
        ) from None
    array = pixels[None] if c == 1 else pixels.transpose(2, 0, 1)
    return np.ascontiguousarray(1.0 - array if invert else array)


def __getattr__(name: str) -> Any:
    """:func:`export_onnx` and :func:`export_run` live in :mod:`senseshield.onnx_export`
    (which imports this module); they are importable from here too."""
    if name in ("export_onnx", "export_run"):
        from senseshield import onnx_export

        return getattr(onnx_export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
