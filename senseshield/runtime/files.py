"""The one way SenseShield writes a file: atomically, or not at all.

:func:`write_atomic` writes to a temporary file in the same directory (created with
``O_EXCL | O_NOFOLLOW``, so a planted file or link is never written through), flushes and
fsyncs it, renames it over the target (``os.replace``) and fsyncs the directory. A reader
sees the old file or the new one, never a part; a crash or a full disk leaves the old file
and no temporary one. Any OS error becomes :class:`~senseshield.errors.StorageError`, one
sentence naming the path and the reason, which stops a service (exit 74) instead of letting
it go on with files it could not save.

Every file the services write goes through here: the coordinator's report, cluster models,
checkpoint and job book, the key server's checkpoint, ledger and secret key files, the agents'
ONNX models.

A new file is 0600 unless the caller says otherwise: only its owner can read it, whatever
the directory it lands in. A file meant to be read by others (a report, a public key, a trust
file, a signed job, an exported model) is written with ``mode=0o644`` at its call site.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from senseshield.errors import StorageError


def write_atomic(path: str | Path, data: bytes | str, *, mode: int = 0o600) -> Path:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically; its directory is created if
    missing. ``mode`` is the new file's permission before the umask: by default 0600, so the
    file is never readable by others, not even for a moment (a key server's checkpoint and
    ledger, a coordinator's checkpoint); ``0o644`` only for a file meant to be read by others.
    The file is created anew, so the old file's mode is not kept. :class:`StorageError` if
    anything fails; then ``path`` is as it was and no temporary file is left."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return _replace(Path(path), lambda fh: fh.write(raw), mode)


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = None, mode: int = 0o600) -> Path:  # noqa: ANN401
    """:func:`write_atomic` of ``obj`` as JSON, encoded straight into the file piece by piece
    (a large report is never one string in memory beside its objects)."""

    def write(fh: BinaryIO) -> None:
        text = io.TextIOWrapper(fh, encoding="utf-8", write_through=False)
        json.dump(obj, text, indent=indent)
        text.flush()
        text.detach()

    return _replace(Path(path), write, mode)


def write_with_atomic(path: str | Path, write: Callable[[BinaryIO], Any], *, mode: int = 0o600) -> Path:
    """:func:`write_atomic` of what ``write(fh)`` writes to the new file's handle, piece by
    piece (a large checkpoint is never one byte string in memory)."""
    return _replace(Path(path), write, mode)


def json_pieces(obj: Any, *, depth: int = 2) -> Iterator[str]:  # noqa: ANN401
    """``obj`` as compact JSON (``json.dumps``'s separators), in pieces: the dicts and lists of
    its first ``depth`` levels piece by piece, each value below them in one piece encoded by
    the C encoder. A large state (a fleet's per-device records) is then never one string in
    memory, nor the pure-Python encoder's millions of tokens. Within those levels any mapping
    is written as an object and any iterator (a generator) as an array, read as they are
    written: a state may hand its largest parts over lazily. At the last of those levels the
    entries go through the C encoder in batches of about :data:`JSON_BATCH_CHARS` characters
    (:func:`_batches`): a fleet's worth of small values is then not a million Python-level
    pieces."""
    if depth == 1 and isinstance(obj, Mapping):
        yield "{"
        yield from _batches(iter(obj.items()), dict)
        yield "}"
    elif depth == 1 and isinstance(obj, (list, tuple, Iterator)):
        yield "["
        yield from _batches(iter(obj), list)
        yield "]"
    elif depth > 0 and isinstance(obj, Mapping):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield f"{', ' if i else ''}{json.dumps({key: 0})[1:-4]}: "  # the key as json.dumps writes it
            yield from json_pieces(value, depth=depth - 1)
        yield "}"
    elif depth > 0 and isinstance(obj, (list, tuple, Iterator)):
        yield "["
        for i, value in enumerate(obj):
            if i:
                yield ", "
            yield from json_pieces(value, depth=depth - 1)
        yield "]"
    else:
        yield json.dumps(obj)


class View(Mapping):
    """A mapping read lazily, for :func:`json_pieces`: its keys sorted (``ordered``) or as
    they are, its values through ``value`` (e.g. a box key's bytes as hex, a device's record
    as JSON) as they are read, so a large state is never converted whole."""

    def __init__(self, raw: Mapping[Any, Any], *, ordered: bool = False,
                 value: Callable[[Any], Any] = lambda v: v) -> None:
        self.raw, self.ordered, self.value = raw, ordered, value

    def __getitem__(self, key: Any) -> Any:  # noqa: ANN401
        return self.value(self.raw[key])

    def __iter__(self) -> Iterator[Any]:
        return iter(sorted(self.raw) if self.ordered else self.raw)

    def __len__(self) -> int:
        return len(self.raw)


JSON_BATCH = 1024
"""Most entries :func:`json_pieces` encodes at once at its last level."""
JSON_BATCH_CHARS = 1 << 20
"""About the most characters of one such batch: a batch of large values is cut down."""


def _batches(entries: Iterator[Any], kind: type) -> Iterator[str]:  # noqa: ANN401
    """The entries (``kind``: dict for (key, value) pairs, list for values) as
    ``json.dumps`` writes them inside their brackets, a batch at a time: 8 entries first, then
    as many as keep a batch near :data:`JSON_BATCH_CHARS` (at most :data:`JSON_BATCH`)."""
    size, sep = min(8, JSON_BATCH), ""
    while batch := kind(itertools.islice(entries, size)):
        text = json.dumps(batch)[1:-1]
        yield sep + text
        sep = ", "
        per = max(len(text), 1) / len(batch)
        size = max(1, min(JSON_BATCH, int(JSON_BATCH_CHARS / per)))


def write_pieces(pieces: Iterable[str], fh: BinaryIO, *, batch: int = 1 << 20) -> int:
    """Write ``pieces`` (str) to ``fh`` as UTF-8, about ``batch`` characters at a time;
    returns the bytes written."""
    written, held, size = 0, [], 0
    for piece in pieces:
        held.append(piece)
        size += len(piece)
        if size >= batch:
            written += fh.write("".join(held).encode())
            held, size = [], 0
    if held:
        written += fh.write("".join(held).encode())
    return written


def _replace(path: Path, write: Callable[[BinaryIO], Any], mode: int) -> Path:
    """The file ``path`` replaced by what ``write`` writes (see :func:`write_atomic`)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    created = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
        created = True
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        created = False
        _sync_dir(path.parent)
    except OSError as exc:
        raise StorageError.writing(path, exc) from None
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def npy_bytes(array) -> bytes:  # noqa: ANN001 - a numpy array
    """``array`` as the bytes of a ``.npy`` file (for :func:`write_atomic`)."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npz_bytes(**arrays) -> bytes:  # noqa: ANN003 - numpy arrays
    """``arrays`` as the bytes of an uncompressed ``.npz`` file (for :func:`write_atomic`)."""
    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _sync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: some file systems cannot fsync a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
