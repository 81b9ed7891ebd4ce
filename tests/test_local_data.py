"""Tests of senseshield.data.local: every format loads, every refusal is one sentence."""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from senseshield.data.local import FORMATS, describe_data, load_local_data
from senseshield.errors import ConfigError
from senseshield.rounds import LocalData

HAR = {"input_shape": (3, 4), "num_classes": 3}


def one_sentence(exc: ConfigError, *names: str) -> str:
    """The message, after checking it is one line naming ``names`` with no traceback."""
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg and msg.endswith(".")
    for name in names:
        assert name in msg, (name, msg)
    return msg


def refuse(source: object, *names: str, **kwargs: object) -> str:
    job = {**HAR, **kwargs}
    with pytest.raises(ConfigError) as info:
        load_local_data(source, **job)  # type: ignore[arg-type]
    return one_sentence(info.value, *names)


def rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3, 4)).astype(np.float64), rng.integers(0, 3, size=n)


# --- npz ------------------------------------------------------------------------------------


def test_npz_split_is_seeded_and_keeps_values(tmp_path: Path) -> None:
    x, y = rows(20)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y.astype(np.uint8))
    data = load_local_data(path, **HAR, test_fraction=0.25, seed=3)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.x_train.shape == (15, 3, 4) and data.x_test.shape == (5, 3, 4)
    # the split is a partition of the file's rows, values unchanged (float64 -> float32)
    got = np.concatenate([data.x_train, data.x_test]).reshape(20, -1)
    order = np.lexsort(got.T)
    np.testing.assert_array_equal(got[order], x.astype(np.float32).reshape(20, -1)[
        np.lexsort(x.astype(np.float32).reshape(20, -1).T)])
    again = load_local_data(path, **HAR, test_fraction=0.25, seed=3)
    np.testing.assert_array_equal(again.y_test, data.y_test)
    other = load_local_data(path, **HAR, test_fraction=0.25, seed=4)
    assert not np.array_equal(other.x_test, data.x_test)


def test_npz_with_test_arrays_uint8_and_flat_rows(tmp_path: Path) -> None:
    x = np.arange(6 * 12, dtype=np.uint8).reshape(6, 12)  # flat rows of 3*4 values
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=np.array([0, 1, 2, 0, 1, 2]), x_test=x[:2], y_test=np.array([2, 1]))
    data = load_local_data(path, **HAR)
    assert data.x_train.shape == (6, 3, 4) and data.x_test.shape == (2, 3, 4)
    np.testing.assert_allclose(data.x_train.reshape(6, 12), x / 255.0, rtol=1e-6)
    assert data.y_test.tolist() == [2, 1]


def test_npz_missing_channel_axis_and_float_labels(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((5, 8, 8), dtype=np.int16) * 300, y=np.array([0.0, 1, 1, 0, 1]))
    data = load_local_data(path, input_shape=(1, 8, 8), num_classes=2)
    assert data.x_train.shape[1:] == (1, 8, 8)
    assert float(data.x_train.max()) == 300.0  # int16 is not scaled
    assert data.y_train.dtype == np.int64


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       n=st.integers(3, 12), classes=st.integers(2, 5), flat=st.booleans(),
       dtype=st.sampled_from(["float32", "float64", "int32", "uint8", "bool"]))
def test_npz_any_shape_and_dtype(shape: tuple[int, ...], n: int, classes: int, flat: bool,
                                 dtype: str) -> None:
    rng = np.random.default_rng(n)
    x = (rng.random((n, *shape)) * 200).astype(dtype)
    y = rng.integers(0, classes, size=n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.npz"
        np.savez(path, x=x.reshape(n, -1) if flat else x, y=y)
        data = load_local_data(path, input_shape=shape, num_classes=classes)
    got = np.concatenate([data.x_train, data.x_test])
    assert got.shape == (n, *shape) and got.dtype == np.float32
    expected = x.astype(np.float32) / (255 if dtype == "uint8" else 1)
    np.testing.assert_allclose(np.sort(got.ravel()), np.sort(expected.ravel()), rtol=1e-6)
    assert sorted(np.concatenate([data.y_train, data.y_test]).tolist()) == sorted(y.tolist())


# --- csv ------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_csv_with_sidecar(tmp_path: Path) -> None:
    csv = write(tmp_path / "d.csv", """
        id,activity,a,b
        1,2,0.5,1.5
        2,0,1.0,2.0
        3,1,-1,3e2
        4,1,7,8
    """)
    write(tmp_path / "d.csv.yaml", "label_column: activity\nfeature_columns: [b, a]\n")
    data = load_local_data(csv, input_shape=(2,), num_classes=3, test_fraction=0.25)
    got = {tuple(r) for r in np.concatenate([data.x_train, data.x_test]).tolist()}
    assert got == {(1.5, 0.5), (2.0, 1.0), (300.0, -1.0), (8.0, 7.0)}  # b before a, id unused
    assert sorted(np.concatenate([data.y_train, data.y_test]).tolist()) == [0, 1, 1, 2]


def test_csv_options_override_sidecar_and_default_label(tmp_path: Path) -> None:
    csv = write(tmp_path / "d.csv", "f1;label;f2\n1;0;2\n3;1;4\n5;0;6\n")
    data = load_local_data(csv, input_shape=(2,), num_classes=2, delimiter=";")
    assert data.n_train + len(data.y_test) == 3
    write(tmp_path / "d.csv.yaml", "label_column: f2\ndelimiter: ';'\n")
    data = load_local_data(csv, input_shape=(1,), num_classes=3, label_column="label",
                           feature_columns=["f1"])
    assert sorted(np.concatenate([data.x_train, data.x_test]).ravel().tolist()) == [1, 3, 5]


def test_format_named_explicitly(tmp_path: Path) -> None:
    txt = write(tmp_path / "d.txt", "a,label\n1,0\n2,1\n3,1\n")
    refuse(txt, "d.txt", "unknown format", input_shape=(1,), num_classes=2)
    data = load_local_data(txt, input_shape=(1,), num_classes=2, format="csv")
    assert data.n_train == 2


def test_csv_refusals(tmp_path: Path) -> None:
    csv = write(tmp_path / "d.csv", "a,b,label\n1,2,0\n3,x,1\n5,6,0\n")
    one = refuse(csv, "d.csv", "line 3", "'b'", "'x'", input_shape=(2,), num_classes=2)
    assert "not a number" in one
    csv = write(tmp_path / "e.csv", "a,b,y\n1,2,0\n")
    refuse(csv, "e.csv", "'label'", "label_column", input_shape=(2,), num_classes=2)
    refuse(csv, "e.csv", "'zz'", input_shape=(1,), num_classes=2, label_column="y",
           feature_columns=["zz"])
    csv = write(tmp_path / "f.csv", "1,2,0\n3,4,1\n")
    refuse(csv, "f.csv", "header", input_shape=(2,), num_classes=2)
    csv = write(tmp_path / "g.csv", "a,b,label\n1,2,0\n3,4\n")
    refuse(csv, "g.csv", "line 3", "2 cells", input_shape=(2,), num_classes=2)
    csv = write(tmp_path / "h.csv", "a,label\n")
    refuse(csv, "h.csv", "no samples", input_shape=(1,), num_classes=2)
    csv = write(tmp_path / "i.csv", "a,label\n1,0\n2,1\n3,1\n")
    write(tmp_path / "i.csv.yaml", "label: a\n")
    refuse(csv, "i.csv.yaml", "'label'", "label_column", input_shape=(1,), num_classes=2)


# --- image folder ---------------------------------------------------------------------------


def image_folder(root: Path) -> Path:
    """Two classes of PNG/JPEG images of mixed sizes and modes; 'red' is listed first."""
    (root / "red").mkdir(parents=True)
    (root / "grey").mkdir()
    Image.new("RGB", (20, 10), (255, 0, 0)).save(root / "red" / "a.png")
    Image.new("RGBA", (5, 7), (255, 0, 0, 255)).save(root / "red" / "b.png")
    Image.new("P", (16, 16), 0).save(root / "red" / "c.png")  # palette, converted
    Image.new("L", (9, 9), 128).save(root / "grey" / "a.png")
    Image.new("RGB", (30, 30), (128, 128, 128)).save(root / "grey" / "b.jpg")
    (root / "grey" / "notes.txt").write_text("not an image, ignored")
    (root / "classes.txt").write_text("red\ngrey\n")
    return root


def test_image_folder_rgb_resizes_and_scales(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs")
    data = load_local_data(root, input_shape=(3, 8, 6), num_classes=2, test_fraction=0.2)
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    assert x.shape == (5, 3, 8, 6) and sorted(y.tolist()) == [0, 0, 0, 1, 1]
    assert 0.0 <= x.min() and x.max() <= 1.0
    red = x[y == 0].mean(axis=(2, 3))
    assert (red[:, 1] == 0).all() and sorted(red[:, 0].tolist())[1:] == [1.0, 1.0]
    grey = x[y == 1]
    np.testing.assert_allclose(grey, 128 / 255, atol=2 / 255)


def test_image_folder_grey_and_sorted_classes(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs")
    (root / "classes.txt").unlink()  # sorted names: grey = 0, red = 1
    data = load_local_data(root, input_shape=(1, 4, 4), num_classes=3)
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    assert x.shape == (5, 1, 4, 4)
    np.testing.assert_allclose(x[y == 0], 128 / 255, atol=2 / 255)
    red_l = round(0.299 * 255) / 255  # Pillow's L of pure red (ITU-R 601-2 luma)
    assert np.isclose(x[y == 1], red_l, atol=1 / 255).any()


def test_image_folder_refusals(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs")
    refuse(root, "imgs", "(3, 4)", "(1, H, W)")
    (root / "blue").mkdir()
    refuse(root, "imgs", "'blue'", "classes.txt", input_shape=(1, 4, 4), num_classes=3)
    (root / "blue").rmdir()
    (root / "classes.txt").write_text("red\ngrey\nblue\n")
    refuse(root, "imgs", "3 classes", "num_classes=2", input_shape=(1, 4, 4), num_classes=2)
    (root / "grey" / "broken.png").write_bytes(b"not a png")
    refuse(root, "broken.png", input_shape=(1, 4, 4), num_classes=3)
    empty = tmp_path / "empty"
    (empty / "a").mkdir(parents=True)
    refuse(empty, "empty", "no images", input_shape=(1, 4, 4), num_classes=3)


# --- python loader --------------------------------------------------------------------------


LOADER = '''
import numpy as np
from senseshield.rounds import LocalData

def pair(n=6, input_shape=None):
    x = np.arange(n * 12, dtype=np.float64).reshape(n, *input_shape)
    return x, np.arange(n) % 3

def four(num_classes, **kwargs):
    x = np.zeros((4, 12))
    return x, np.arange(4) % num_classes, x[:2], np.array([1, 2])

def local(seed):
    x = np.full((3, 3, 4), float(seed), dtype=np.float32)
    return LocalData(x, np.array([0, 1, 2]), x[:1], np.array([0]))

def broken():
    raise KeyError("no such sensor")

def wrong():
    return {"x": 1}
'''


@pytest.fixture()
def loader_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_loaders.py"
    path.write_text(LOADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_python_loaders(loader_module: Path) -> None:
    data = load_local_data("python:my_loaders:pair", **HAR, n=10)
    assert data.n_train + len(data.y_test) == 10 and data.x_train.shape[1:] == (3, 4)
    data = load_local_data("python:my_loaders:four", **HAR)
    assert data.y_test.tolist() == [1, 2] and data.x_train.shape == (4, 3, 4)
    data = load_local_data(f"python:{loader_module}:local", **HAR, seed=7)
    assert float(data.x_train[0, 0, 0]) == 7.0 and data.y_test.tolist() == [0]


def test_python_loader_refusals(loader_module: Path) -> None:
    refuse("python:my_loaders:broken", "python:my_loaders:broken", "KeyError", "no such sensor")
    refuse("python:my_loaders:wrong", "python:my_loaders:wrong", "dict", "(x, y)")
    refuse("python:my_loaders:absent", "'absent'")
    refuse("python:no_such_pkg.mod:f", "no_such_pkg")
    refuse("python:my_loaders:pair", "'bogus'", bogus=1)


# --- checks against the job -----------------------------------------------------------------


def test_missing_unknown_and_empty(tmp_path: Path) -> None:
    refuse(tmp_path / "nope.npz", "nope.npz", "does not exist")
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    msg = refuse(tmp_path / "d.parquet", "d.parquet", "unknown format")
    assert all(name in msg for name in FORMATS.names())
    np.savez(tmp_path / "e.npz", x=np.zeros((0, 3, 4)), y=np.zeros(0))
    refuse(tmp_path / "e.npz", "e.npz", "no samples")
    np.savez(tmp_path / "f.npz", a=np.zeros(3))
    refuse(tmp_path / "f.npz", "f.npz", "'x'", "x and y")
    (tmp_path / "g.npz").write_bytes(b"garbage")
    refuse(tmp_path / "g.npz", "g.npz", ".npz")
    refuse(tmp_path / "f.npz", "'fast'", fast=True)


def test_shape_labels_nan_and_size_refusals(tmp_path: Path) -> None:
    x, y = rows(10)
    path = tmp_path / "d.npz"
    np.savez(path, x=x[:, :, :3], y=y)
    refuse(path, "d.npz", "(10, 3, 3)", "(n, 3, 4)", "(n, 12)")
    np.savez(path, x=np.zeros((4, 8, 8, 3)), y=np.arange(4) % 3)
    refuse(path, "d.npz", "channels-last", input_shape=(3, 8, 8))
    np.savez(path, x=x, y=y[:9])
    refuse(path, "d.npz", "(9,)", "(10,)")
    y_bad = y.copy()
    y_bad[4] = 7
    np.savez(path, x=x, y=y_bad, x_test=x[:2], y_test=y[:2])
    refuse(path, "d.npz", "label 7", "0..2", "1 label(s) in y")
    np.savez(path, x=x, y=y, x_test=x[:2], y_test=np.array([0, -1]))
    refuse(path, "d.npz", "label -1", "y_test")
    y_half = y.astype(np.float64)
    y_half[3] = 0.5
    np.savez(path, x=x, y=y_half)
    refuse(path, "d.npz", "label 0.5", "index 3", "integers")
    x_nan = x.copy()
    x_nan[1, 0, 0] = np.nan
    x_nan[2, 1, 1] = np.inf
    np.savez(path, x=x_nan, y=y, x_test=np.full((2, 3, 4), np.nan), y_test=y[:2])
    refuse(path, "d.npz", "2 in x", "24 in x_test", "NaN")
    np.savez(path, x=np.full((3, 3, 4), 1e39), y=y[:3])  # overflows float32
    refuse(path, "d.npz", "non-finite")
    np.savez(path, x=x[:2], y=y[:2])
    refuse(path, "d.npz", "1 training and 1 test", "at least 2")
    np.savez(path, x=x, y=y, x_test=x[:2])
    refuse(path, "d.npz", "x_test and y_test")
    np.savez(path, x=np.array(["a"] * 4), y=np.arange(4) % 3)
    refuse(path, "d.npz", "dtype", "numeric")


def test_job_values_refused(tmp_path: Path) -> None:
    x, y = rows(10)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    refuse(tmp_path / "d.npz", "input_shape", input_shape=(3, 0))
    refuse(tmp_path / "d.npz", "num_classes=1", num_classes=1)
    refuse(tmp_path / "d.npz", "'hdf5'", format="hdf5")


def test_describe(tmp_path: Path) -> None:
    data = LocalData(np.zeros((5, 3, 4), np.float32), np.array([0, 0, 2, 2, 2]),
                     np.zeros((2, 3, 4), np.float32), np.array([1, 2]))
    summary = describe_data(data)
    assert summary.classes == [0, 1, 2]
    assert summary.train_counts == {0: 2, 2: 3} and summary.test_counts == {1: 1, 2: 1}
    assert summary.line() == ("5 train + 2 test samples of shape (3, 4); 3 classes present; "
                              "train per class 0:2 2:3")
    assert summary.to_dict()["train_counts"] == {"0": 2, "2": 3}


def test_a_corrupt_npz_is_our_sentence_and_stops_the_agent_at_start(tmp_path: Path) -> None:
    """Issue 23: a corrupt npz was reported only when a job arrived, with numpy's message
    ("Cannot load file containing pickled data when allow_pickle=False"). It is one sentence
    of ours naming the file, and `edge-agent join --data` refuses it at start (exit 2)."""
    from typer.testing import CliRunner

    from edge_agent.cli import app
    from senseshield.data.local import check_source

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x93NUMPY this is not a zip archive")
    cut = tmp_path / "cut.npz"
    np.savez(tmp_path / "whole.npz", x=np.zeros((40, 3)), y=np.zeros(40))
    cut.write_bytes((tmp_path / "whole.npz").read_bytes()[:300])
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}] * 3, dtype=object), y=np.zeros(3))
    for path, needle in ((garbage, "is not a .npz archive"), (cut, "is not a .npz archive"),
                         (objects, "holds an array of Python objects")):
        for check in (check_source, lambda p: load_local_data(p, input_shape=(3,), num_classes=2)):
            with pytest.raises(ConfigError) as caught:
                check(path)
            text = str(caught.value)
            assert str(path) in text and needle in text and "pickle" not in text, text
    assert check_source(tmp_path / "whole.npz") == "npz, 40 samples"
    result = CliRunner().invoke(app, ["join", "--broker", "mqtt://127.0.0.1:9", "--agent-id", "d1",
                                      "--profile", "rpi4", "--data", str(garbage), "--model-dir", str(tmp_path / "m"), "--insecure-dev"])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert f"{str(garbage)!r} is not a .npz archive" in output and "Traceback" not in output, output


def test_a_data_glob_skips_a_csvs_sidecar(tmp_path):
    """Issue 25's small trap: 'DIR/device-*' matched device-2.csv.yaml as a device of its own."""
    from senseshield.cli.run import data_files

    (tmp_path / "device-1.npz").write_bytes(b"x")
    (tmp_path / "device-2.csv").write_text("a,label\n1,0\n")
    (tmp_path / "device-2.csv.yaml").write_text("label_column: label\n")
    (tmp_path / "lonely.csv.yaml").write_text("label_column: label\n")  # no CSV beside it: kept, and refused later
    files = data_files([str(tmp_path / "device-*"), str(tmp_path / "lonely*")])
    assert [f.name for f in files] == ["device-1.npz", "device-2.csv", "lonely.csv.yaml"]
