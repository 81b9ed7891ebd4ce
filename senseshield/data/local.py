"""A device's own data, read from a local file, checked against the job.

:func:`load_local_data` reads ``source`` in one of the formats of :data:`FORMATS` and returns
a :class:`senseshield.data.shards.LocalData` with ``x`` float32 of shape ``(n, *input_shape)`` and
``y`` as the job's task wants it (:mod:`senseshield.tasks`): classification int64 in
``0..num_classes-1``; regression float32 ``(n, num_classes)`` targets; multi-label float32
``(n, num_classes)`` of 0/1. Nothing is sent anywhere. Given the job
(``load_local_data(path, job)``) it takes the job's shape, classes, task, test fraction and
seed, so the Python API splits a device's data exactly as the fleet's agent does. Formats (chosen from the
source unless ``format=`` names one):

* ``npz``     a ``.npz`` file with arrays ``x`` and ``y``, optionally ``x_test``/``y_test``.
* ``csv``     a ``.csv`` file with a header row; a label column and feature columns, named in a
              sidecar ``<file>.yaml`` (keys ``label_column``, ``feature_columns``,
              ``delimiter``) or by the same options (options win). Default label column:
              ``label``; default features: every other column, in file order.
* ``folder``  a directory with one sub-folder of images per class; the class order is
              ``classes.txt`` (one name per line) if present, else the sorted sub-folder
              names. Images of any size and mode are converted to the job's channels
              (1: Pillow mode ``L``, 3: ``RGB``) and resized to its ``H x W`` (bilinear,
              aspect ratio not kept).
* ``python``  ``python:package.module:function`` or ``python:path/to/file.py:function``,
              called with the format options as keywords (plus ``input_shape``,
              ``num_classes``, ``seed`` if it takes them), returning ``(x, y)``,
              ``(x, y, x_test, y_test)`` or a ``LocalData``.

Normalisation: ``uint8`` arrays (and every image) are divided by 255 into ``[0, 1]``; every
other dtype (floats, other integers, bools) is converted to float32 unchanged. ``x`` may be
exactly ``(n, *input_shape)``, flat rows ``(n, prod(input_shape))`` (reshaped in C order) or
differ only by dimensions of size 1 (``(n, 28, 28)`` for ``(1, 28, 28)``). Labels must be
integer-valued (any dtype). Without a test set, a seeded split keeps ``test_fraction`` of
the samples for testing (:func:`senseshield.data.partition.split_train_test`).

Every problem is a :class:`ConfigError` of one sentence naming the file and the mismatch.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from senseshield.callables import IMPORT_PATH_FORMS, call_with_job, resolve_import_path
from senseshield.data.partition import split_train_test
from senseshield.errors import ConfigError
from senseshield.registry import Registry
from senseshield.data.shards import LocalData
from senseshield.shapes import check_input_shape, check_num_classes

__all__ = ["FORMATS", "DataFormat", "DataSummary", "describe_data", "load_local_data"]

#: Fewest samples a device needs: two to train on, one to test on.
MIN_TRAIN, MIN_TEST = 2, 1

PYTHON_PREFIX = "python:"


@dataclass(frozen=True)
class Job:
    """What a loader needs to know about the job."""

    input_shape: tuple[int, ...]
    num_classes: int
    seed: int
    task: str = "classification"


@dataclass(frozen=True)
class Raw:
    """Arrays as a format read them, before conversion and checks."""

    x: Any
    y: Any
    x_test: Any = None
    y_test: Any = None


@dataclass(frozen=True)
class DataFormat:
    """A data format: which sources it claims, how it loads them, which options it takes.

    ``options`` lists the keyword options it accepts; ``None`` means any (the Python loader
    passes them on to the user's function). ``on_disk``: the source is a path that must
    exist.
    """

    name: str
    forms: str
    claims: Callable[[str], bool]
    load: Callable[[str, Job, dict[str, Any]], Raw]
    options: tuple[str, ...] | None = ()
    on_disk: bool = True


#: Data formats by name; the first (by name) whose ``claims`` accepts a source reads it.
FORMATS: Registry[DataFormat] = Registry("data format")


def load_local_data(
    source: str | Path, job: Any = None, *, input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None, test_fraction: float | None = None, seed: int | None = None,
    task: str | None = None, format: str | None = None, **options: Any,
) -> LocalData:
    """Read a device's data from ``source`` and check it against the job.

    ``job``: a :class:`senseshield.Job` giving ``input_shape``, ``num_classes``, ``task``,
    ``test_fraction`` and ``seed`` (what a fleet's agent uses); each keyword given here
    overrides the job's. Without a job, ``input_shape`` and ``num_classes`` are needed and
    the split uses ``seed`` 0, ``test_fraction`` 0.2, task classification.
    ``format`` forces a format of :data:`FORMATS` (else it is chosen from the source);
    ``options`` are that format's options. ``seed`` drives the train/test split (and is
    offered to Python loaders). Raises :class:`ConfigError` naming the file and the problem.
    """
    def pick(value: Any, key: str, default: Any) -> Any:
        if value is not None:
            return value
        found = getattr(job, key, None) if job is not None else None
        return default if found is None else found

    input_shape, num_classes = pick(input_shape, "input_shape", None), pick(num_classes, "num_classes", None)
    if input_shape is None or num_classes is None:
        raise ConfigError(
            f"Reading {str(source)!r} needs the job's input_shape and num_classes; give job= (a Job "
            f"that has them) or input_shape= and num_classes=.")
    test_fraction = pick(test_fraction, "test_fraction", 0.2)
    task = pick(task, "task", "classification")
    from senseshield.tasks import TASKS

    job = Job(check_input_shape(input_shape),
              check_num_classes(num_classes, minimum=TASKS.get(task).min_outputs),
              int(pick(seed, "seed", 0)), task)
    text = str(source)
    fmt = FORMATS.get(format) if format is not None else _detect(text)
    if fmt.options is not None:
        unknown = sorted(set(options) - set(fmt.options))
        if unknown:
            raise ConfigError(
                f"Option(s) {unknown} are not allowed for {fmt.name} data {text!r}; it takes: "
                f"{', '.join(fmt.options) or 'none'}."
            )
    if fmt.on_disk and not Path(text).exists():
        raise ConfigError(f"Data file {text!r} does not exist.")
    raw = fmt.load(text, job, dict(options))
    return _finish(text, raw, job, test_fraction)


def check_source(source: str | Path) -> str:
    """Read a device's data source once, before any job (``edge-agent join`` at start): its
    format must be known and, for files read without the job's shape (npz, csv), ``x`` and
    ``y`` must load as non-empty numeric arrays. :class:`ConfigError` naming the file and
    what is wrong. What depends on the job (shape, classes, NaN after conversion) is checked
    when a job arrives. Returns a short description, e.g. ``npz, 300 samples``."""
    text = str(source)
    fmt = _detect(text)
    if fmt.name not in ("npz", "csv"):  # images and Python loaders need the job's shape
        return fmt.name
    raw = fmt.load(text, Job((1,), 2, 0), {})  # these formats do not use the job
    x = _as_array("x", raw.x, text)
    _as_array("y", raw.y, text)
    n = len(x) if x.ndim else 0
    if n == 0:
        raise ConfigError(f"Data {text!r} holds no samples.")
    return f"{fmt.name}, {n} samples"


def _detect(text: str) -> DataFormat:
    for _, fmt in FORMATS.items():
        if fmt.claims(text):
            return fmt
    if not Path(text).exists():
        raise ConfigError(f"Data file {text!r} does not exist.")
    forms = "; ".join(f"{f.forms} ({name})" for name, f in FORMATS.items())
    raise ConfigError(
        f"Data file {text!r} has an unknown format; give one of: {forms}, or name the format "
        f"with format=."
    )


# --- conversion and checks shared by every format ------------------------------------------


def _as_array(name: str, value: Any, text: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:
        raise ConfigError(f"{name} of {text!r} cannot be read as an array: {exc}.") from exc
    if arr.dtype.kind not in "biuf":
        raise ConfigError(
            f"{name} of {text!r} has dtype {arr.dtype}; it must be numeric (bool, int or float)."
        )
    return arr


def _features(text: str, name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` as float32 ``(n, *shape)``: uint8 scaled by 1/255, everything else as given."""
    n = x.shape[0] if x.ndim else 0
    rest = tuple(x.shape[1:])
    if x.ndim == 1:
        rest = (1,)
    size = int(np.prod(shape))
    fits = rest == shape or (len(rest) == 1 and rest[0] == size) or (
        tuple(d for d in rest if d != 1) == tuple(d for d in shape if d != 1))
    if x.ndim == 0 or not fits:
        hint = ""
        if len(rest) == len(shape) >= 2 and rest == (*shape[1:], shape[0]):
            hint = " (it looks channels-last; transpose it to channels-first)"
        raise ConfigError(
            f"{name} of {text!r} has shape {tuple(x.shape)}; the job's input_shape {shape} "
            f"needs (n, {', '.join(map(str, shape))}) or flat rows (n, {size}){hint}."
        )
    with np.errstate(over="ignore"):  # values beyond float32 become inf, refused later
        scaled = x.astype(np.float32) / np.float32(255) if x.dtype == np.uint8 else x
        return np.ascontiguousarray(scaled, dtype=np.float32).reshape(n, *shape)


def _targets(text: str, name: str, y: np.ndarray, n: int, job: Job) -> np.ndarray:
    """Regression targets or multi-label 0/1 labels as float32 ``(n, num_classes)``."""
    k = job.num_classes
    if y.ndim == 1 and k == 1:
        y = y[:, None]
    if y.ndim != 2 or y.shape != (n, k):
        raise ConfigError(
            f"{name} of {text!r} has shape {tuple(y.shape)}; task {job.task!r} with num_classes={k} "
            f"needs one row of {k} value(s) per sample, shape ({n}, {k})"
            f"{' or (' + str(n) + ',)' if k == 1 else ''}.")
    out = y.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
    if len(bad):
        raise ConfigError(f"Data {text!r} has a non-finite target in {name} at row {int(bad[0])}; targets must be finite numbers.")
    if job.task == "multilabel":
        off = np.flatnonzero(~np.isin(out, (0.0, 1.0)).all(axis=1))
        if len(off):
            raise ConfigError(f"Data {text!r} has a label other than 0 or 1 in {name} at row {int(off[0])}; "
                              f"multi-label targets are 0/1 per label.")
    return out


def _labels(text: str, name: str, y: np.ndarray, n: int, job: Job | None = None) -> np.ndarray:
    if job is not None and job.task != "classification":
        return _targets(text, name, y, n, job)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != n:
        raise ConfigError(
            f"{name} of {text!r} has shape {tuple(y.shape)}; it must hold one label per "
            f"sample, shape ({n},)."
        )
    if y.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if len(bad):
            raise ConfigError(
                f"Data {text!r} has label {float(y[bad[0]]):g} in {name} at index "
                f"{int(bad[0])}; labels must be integers."
            )
    return y.astype(np.int64)


def _finish(text: str, raw: Raw, job: Job, test_fraction: float) -> LocalData:
    if (raw.x_test is None) != (raw.y_test is None):
        raise ConfigError(
            f"{text!r} has only one of x_test and y_test; give both or neither."
        )
    parts = {"x": _as_array("x", raw.x, text), "y": _as_array("y", raw.y, text)}
    if raw.x_test is not None:
        parts["x_test"] = _as_array("x_test", raw.x_test, text)
        parts["y_test"] = _as_array("y_test", raw.y_test, text)
    n = len(parts["x"]) if parts["x"].ndim else 0
    if n == 0:
        raise ConfigError(f"Data {text!r} holds no samples.")
    x = _features(text, "x", parts["x"], job.input_shape)
    y = _labels(text, "y", parts["y"], n, job)
    if raw.x_test is not None:
        n_test = len(parts["x_test"]) if parts["x_test"].ndim else 0
        x_test = _features(text, "x_test", parts["x_test"], job.input_shape)
        y_test = _labels(text, "y_test", parts["y_test"], n_test, job)
        where = {"x": "x", "x_test": "x_test", "y": "y", "y_test": "y_test"}
    else:
        train, test = split_train_test(np.arange(n), test_fraction=test_fraction, seed=job.seed)
        x, x_test, y, y_test = x[train], x[test], y[train], y[test]
        where = {"x": "x (training split)", "x_test": "x (test split)",
                 "y": "y (training split)", "y_test": "y (test split)"}
    if len(y) < MIN_TRAIN or len(y_test) < MIN_TEST:
        raise ConfigError(
            f"Data {text!r} has {len(y)} training and {len(y_test)} test samples; at least "
            f"{MIN_TRAIN} and {MIN_TEST} are needed."
        )
    for key, labels in (("y", y), ("y_test", y_test)) if job.task == "classification" else ():
        outside = np.flatnonzero((labels < 0) | (labels >= job.num_classes))
        if len(outside):
            raise ConfigError(
                f"Data {text!r} has {len(outside)} label(s) in {where[key]} outside the job's "
                f"classes 0..{job.num_classes - 1}, the first being label "
                f"{int(labels[outside[0]])}."
            )
    bad = {where[k]: int(np.count_nonzero(~np.isfinite(a)))
           for k, a in (("x", x), ("x_test", x_test))}
    if any(bad.values()):
        counts = " and ".join(f"{c} in {w}" for w, c in bad.items() if c)
        raise ConfigError(
            f"Data {text!r} has non-finite values (NaN or inf, after conversion to float32): "
            f"{counts}."
        )
    return LocalData(x, y, x_test, y_test)


# --- npz ------------------------------------------------------------------------------------


def _has_suffix(*suffixes: str) -> Callable[[str], bool]:
    return lambda text: not text.startswith(PYTHON_PREFIX) and Path(text).is_file() and \
        Path(text).suffix.lower() in suffixes


def _load_npz(text: str, job: Job, options: dict[str, Any]) -> Raw:
    import zipfile

    if not zipfile.is_zipfile(text):  # numpy would try it as a pickle and say so
        raise ConfigError(
            f"Data file {text!r} is not a .npz archive (not a zip file: damaged, cut short or "
            f"another format); write it with numpy.savez(path, x=..., y=...)."
        )
    try:
        with np.load(text, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except ValueError as exc:
        if "pickle" not in str(exc):
            raise ConfigError(f"Data file {text!r} holds an array numpy cannot read; write it again with "
                              "numpy.savez(path, x=..., y=...).") from None
        raise ConfigError(
            f"Data file {text!r} holds an array of Python objects; only numeric arrays (x, y, "
            f"optionally x_test and y_test) are allowed."
        ) from None
    except Exception:  # noqa: BLE001 - a damaged member: our sentence, not numpy's
        raise ConfigError(
            f"Data file {text!r} is a damaged .npz archive (an array in it cannot be read); write "
            f"it again with numpy.savez(path, x=..., y=...)."
        ) from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ConfigError(
            f"Data file {text!r} has no array {missing[0]!r}; it holds "
            f"{', '.join(sorted(arrays)) or 'nothing'} and must hold x and y (optionally "
            f"x_test and y_test)."
        )
    return Raw(arrays["x"], arrays["y"], arrays.get("x_test"), arrays.get("y_test"))


FORMATS.add("npz", DataFormat("npz", "a .npz file", _has_suffix(".npz"), _load_npz))


# --- csv ------------------------------------------------------------------------------------

CSV_OPTIONS = ("label_column", "feature_columns", "delimiter")


def _csv_settings(text: str, options: dict[str, Any]) -> dict[str, Any]:
    sidecar = Path(text + ".yaml")
    settings: dict[str, Any] = {}
    if sidecar.is_file():
        import yaml

        try:
            loaded = yaml.safe_load(sidecar.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"Sidecar {str(sidecar)!r} is not valid YAML: {exc}.") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"Sidecar {str(sidecar)!r} must be a mapping of {CSV_OPTIONS}.")
        unknown = sorted(set(loaded) - set(CSV_OPTIONS))
        if unknown:
            raise ConfigError(
                f"Sidecar {str(sidecar)!r} has unknown key(s) {unknown}; allowed: "
                f"{', '.join(CSV_OPTIONS)}."
            )
        settings.update(loaded)
    settings.update(options)
    return settings


def _load_csv(text: str, job: Job, options: dict[str, Any]) -> Raw:
    settings = _csv_settings(text, options)
    label = settings.get("label_column", "label")
    delimiter = settings.get("delimiter", ",")
    with open(text, newline="") as fh:
        reader = csv.reader(fh, delimiter=delimiter)
        header = next(reader, None)
        rows = [(reader.line_num, row) for row in reader if row]
    if not header:
        raise ConfigError(f"Data file {text!r} is empty; it needs a header row naming the columns.")
    header = [h.strip() for h in header]
    if all(_is_number(h) for h in header):
        raise ConfigError(
            f"Data file {text!r} has no header row (its first row is all numbers); add one "
            f"naming the columns."
        )
    labels = [label] if isinstance(label, str) else [str(c) for c in label]
    label = next((c for c in labels if c not in header), labels[-1])
    if label not in header:
        raise ConfigError(
            f"Data file {text!r} has no label column {label!r}; its columns are "
            f"{', '.join(header)}; name the label column with label_column (option or "
            f"{Path(text).name + '.yaml'})."
        )
    features = settings.get("feature_columns") or [h for h in header if h not in labels]
    missing = [c for c in features if c not in header]
    if missing:
        raise ConfigError(
            f"Data file {text!r} has no feature column {missing[0]!r}; its columns are "
            f"{', '.join(header)}."
        )
    columns = [header.index(c) for c in features] + [header.index(c) for c in labels]
    values = np.empty((len(rows), len(columns)), dtype=np.float64)
    for i, (line, row) in enumerate(rows):
        if len(row) != len(header):
            raise ConfigError(
                f"Data file {text!r} line {line} has {len(row)} cells; the header has "
                f"{len(header)}."
            )
        for j, col in enumerate(columns):
            try:
                values[i, j] = float(row[col])
            except ValueError:
                raise ConfigError(
                    f"Data file {text!r} line {line}, column {header[col]!r}: {row[col]!r} "
                    f"is not a number."
                ) from None
    nf = len(features)
    return Raw(values[:, :nf], values[:, nf] if len(labels) == 1 else values[:, nf:])


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


FORMATS.add("csv", DataFormat("csv", "a .csv file with a header row", _has_suffix(".csv"),
                              _load_csv, CSV_OPTIONS))


# --- image folder ---------------------------------------------------------------------------

CLASSES_FILE = "classes.txt"
_MODES = {1: "L", 3: "RGB"}


def _class_names(root: Path, options: dict[str, Any]) -> list[str]:
    listed = root / CLASSES_FILE
    subdirs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if options.get("classes") is not None:
        names, origin = [str(c) for c in options["classes"]], "the classes option"
    elif listed.is_file():
        names = [s.strip() for s in listed.read_text().splitlines() if s.strip()]
        origin = str(listed)
    else:
        return subdirs
    if len(set(names)) != len(names):
        raise ConfigError(f"{origin!r} lists a class twice; each class must appear once.")
    extra = [d for d in subdirs if d not in names]
    if extra:
        raise ConfigError(
            f"Image folder {str(root)!r} has sub-folder {extra[0]!r}, which {origin} does not "
            f"list."
        )
    return names


def _load_folder(text: str, job: Job, options: dict[str, Any]) -> Raw:
    from PIL import Image, UnidentifiedImageError

    root = Path(text)
    shape = job.input_shape
    if len(shape) != 3 or shape[0] not in _MODES:
        raise ConfigError(
            f"Image folder {text!r} cannot feed input_shape {shape}; images need (1, H, W) "
            f"(grey) or (3, H, W) (RGB)."
        )
    names = _class_names(root, options)
    if len(names) > job.num_classes:
        raise ConfigError(
            f"Image folder {text!r} has {len(names)} classes ({', '.join(names)}); the job has "
            f"num_classes={job.num_classes}."
        )
    known = set(Image.registered_extensions())
    mode, (c, h, w) = _MODES[shape[0]], shape
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, name in enumerate(names):
        folder = root / name
        files = sorted(p for p in folder.rglob("*") if p.is_file()
                       and not p.name.startswith(".") and p.suffix.lower() in known) \
            if folder.is_dir() else []
        for path in files:
            try:
                with Image.open(path) as img:
                    pixels = np.asarray(img.convert(mode).resize((w, h), Image.BILINEAR))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise ConfigError(f"Image {str(path)!r} cannot be read: {exc}.") from exc
            images.append(pixels.reshape(h, w, c).transpose(2, 0, 1))
            labels.append(label)
    if not images:
        raise ConfigError(
            f"Image folder {text!r} holds no images in class sub-folders "
            f"({', '.join(names) or 'none found'})."
        )
    return Raw(np.stack(images).astype(np.uint8), np.asarray(labels, dtype=np.int64))


FORMATS.add("folder", DataFormat("folder", "a folder with one sub-folder of images per class",
                                 lambda text: Path(text).is_dir(), _load_folder, ("classes",)))


# --- python loader --------------------------------------------------------------------------


def _load_python(text: str, job: Job, options: dict[str, Any]) -> Raw:
    spec = text.removeprefix(PYTHON_PREFIX)
    fn = resolve_import_path(spec, what="data loader", label=text)
    out = call_with_job(fn, text, {"input_shape": job.input_shape,
                                   "num_classes": job.num_classes, "seed": job.seed},
                        options, what="data loader")
    if isinstance(out, LocalData):
        return Raw(out.x_train, out.y_train, out.x_test, out.y_test)
    if isinstance(out, (tuple, list)) and len(out) in (2, 4):
        return Raw(*out)
    raise ConfigError(
        f"Data loader {text!r} returned {type(out).__name__}"
        f"{f' of length {len(out)}' if isinstance(out, (tuple, list)) else ''}; it must "
        f"return (x, y), (x, y, x_test, y_test) or a LocalData."
    )


FORMATS.add("python", DataFormat(
    "python", f"python:{IMPORT_PATH_FORMS.replace(' or ', ' or python:')}",
    lambda text: text.startswith(PYTHON_PREFIX), _load_python, None, on_disk=False))


# --- summary --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSummary:
    """What a device holds: sample counts, input shape, classes present, per-class counts."""

    n_train: int
    n_test: int
    input_shape: tuple[int, ...]
    train_counts: dict[int, int] = field(default_factory=dict)
    test_counts: dict[int, int] = field(default_factory=dict)

    @property
    def classes(self) -> list[int]:
        """Labels present in the training or test part."""
        return sorted(set(self.train_counts) | set(self.test_counts))

    def line(self) -> str:
        """One log line, e.g. ``240 train + 60 test samples of shape (3, 64); 3 classes
        present; train per class 0:80 2:100 5:60``."""
        per_class = " ".join(f"{k}:{v}" for k, v in sorted(self.train_counts.items()))
        if not self.train_counts and not self.test_counts:  # regression / multi-label targets
            return f"{self.n_train} train + {self.n_test} test samples of shape {self.input_shape}"
        return (f"{self.n_train} train + {self.n_test} test samples of shape "
                f"{self.input_shape}; {len(self.classes)} classes present; train per class "
                f"{per_class}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (class labels as string keys)."""
        return {"n_train": self.n_train, "n_test": self.n_test,
                "input_shape": list(self.input_shape), "classes": self.classes,
                "train_counts": {str(k): v for k, v in sorted(self.train_counts.items())},
                "test_counts": {str(k): v for k, v in sorted(self.test_counts.items())}}


def _counts(y: np.ndarray) -> dict[int, int]:
    if np.asarray(y).dtype.kind == "f":  # regression or multi-label targets: no classes to count
        return {}
    labels, counts = np.unique(np.asarray(y), return_counts=True)
    return {int(k): int(v) for k, v in zip(labels, counts)}


def describe_data(data: LocalData) -> DataSummary:
    """Summarise ``data`` (counts only: safe to log, nothing about the samples themselves)."""
    return DataSummary(len(data.y_train), len(data.y_test), tuple(data.x_train.shape[1:]),
                       _counts(data.y_train), _counts(data.y_test))
