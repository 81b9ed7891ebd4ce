"""A site's partial sum: a running aggregate that travels from one process to another.

With one-time pads agreed with the key server, a sum of masked updates is itself a masked
update: a site aggregator folds its site's updates as they arrive
(:class:`~senseshield.engine.aggregation.StreamingAggregate`) and forwards one partial sum per
cluster; the coordinator folds partial sums (:meth:`StreamingAggregate.merge`) as it folds
updates. The result is the aggregate of every update, bit for bit, however they were split
among sites (property-tested against folding them all in one place), because every part of a
running aggregate adds exactly: masked words modulo the ring, plaintext in the exact
per-slice sums of :class:`~senseshield.engine.aggregation.ExactSum`, integer weights.

:func:`partial_state` gives what travels: JSON fields and 1-D arrays (packed by
:func:`pack_arrays`, an ``.npz`` without pickles); :func:`partial_from_state` reads it back,
checking every field against the model's size and the job's key. Schemes whose running
aggregate cannot travel (per-value Paillier and CKKS keep every part) raise
:class:`~senseshield.errors.ProtocolError` saying so. Pure: numpy only, no I/O.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np

from senseshield.engine.aggregation import ExactSum, StreamingAggregate, _SLICES
from senseshield.errors import ProtocolError
from senseshield.he.base import PublicKey

_DTYPES = {np.dtype(t) for t in (np.uint8, np.uint32, np.uint64, np.int32, np.int64, np.float32, np.float64)}


def partial_state(running: StreamingAggregate) -> tuple[dict, dict[str, np.ndarray]]:
    """What travels of ``running``: (fields, arrays). The contributors are in sorted order;
    per-contributor arrays (masks, plaintext parts) follow that order."""
    names = sorted(running.contributors)
    fields: dict = {"contributors": names, "total_weight": int(running.total_weight),
                    "withheld": bool(running.withheld), "slices": sorted(running.plain.slices),
                    "masks": bool(running.masks), "plains": running.plains is not None}
    arrays: dict[str, np.ndarray] = {
        "union": np.packbits(running.union), "position_weight": running.position_weight,
        "encryptors": running.encryptors, "plain_weight": running.plain_weight,
    }
    for i, part in running.plain.slices.items():
        arrays[f"slice_{i}"] = part
    if running.masks:
        arrays["masks"] = np.concatenate([running.masks[a] for a in names])
    if running.plains is not None:
        withheld = [running.plains[a][0] for a in names]
        values = [np.asarray(running.plains[a][1], dtype=np.float32) for a in names]
        arrays["plain_has_withheld"] = np.array([w is not None for w in withheld], dtype=np.uint8)
        arrays["plain_withheld"] = (np.concatenate([np.packbits(w) for w in withheld if w is not None])
                                    if any(w is not None for w in withheld) else np.zeros(0, np.uint8))
        arrays["plain_lengths"] = np.array([v.size for v in values], dtype=np.int64)
        arrays["plain_values"] = np.concatenate(values) if values else np.zeros(0, np.float32)
    if running.accumulator is not None:
        acc_fields, acc_arrays = running.accumulator.state()
        fields["accumulator"] = acc_fields
        arrays.update({f"acc_{name}": value for name, value in acc_arrays.items()})
    return fields, arrays


def partial_from_state(public_key: PublicKey | None, fields: dict, arrays: dict[str, np.ndarray], *, size: int,
                       round: int, cluster: int, min_encryptors: int = 1) -> StreamingAggregate:
    """The running aggregate :func:`partial_state` described, checked against the model's
    ``size`` and ``public_key`` (None: plaintext); :class:`ProtocolError` naming what does not fit."""
    running = StreamingAggregate(public_key, size=size, round=round, cluster=cluster, min_encryptors=min_encryptors)
    names = fields.get("contributors")
    if not isinstance(names, list) or not names or not all(isinstance(a, str) and a for a in names) \
            or names != sorted(set(names)):
        raise ProtocolError("A partial sum names its contributors once each, sorted, at least one.")
    weight = fields.get("total_weight")
    if not isinstance(weight, int) or isinstance(weight, bool) or not len(names) <= weight:
        raise ProtocolError(f"A partial sum of {len(names)} contributors cannot weigh {weight!r}.")

    def need(name: str, n: int, dtype: type) -> np.ndarray:
        value = arrays.get(name)
        if value is None or value.shape != (n,) or value.dtype != np.dtype(dtype):
            raise ProtocolError(f"A partial sum's {name} must be {n} values of {np.dtype(dtype).name}.")
        return value

    union = np.unpackbits(need("union", -(-size // 8), np.uint8))
    if union[size:].any():
        raise ProtocolError("A partial sum's union has padding bits set.")
    running.union = union[:size].astype(bool)
    running.position_weight = need("position_weight", size, np.int64).copy()
    running.encryptors = need("encryptors", size, np.int32).copy()
    running.plain_weight = need("plain_weight", size, np.int64).copy()
    if np.any(running.position_weight < 0) or np.any(running.position_weight > weight) \
            or np.any(running.plain_weight < 0) or np.any(running.encryptors < 0) \
            or np.any(running.encryptors > len(names)):
        raise ProtocolError("A partial sum's position weights and encryptor counts are out of range.")
    slices = fields.get("slices")
    if not isinstance(slices, list) or not all(isinstance(i, int) and 0 <= i < len(_SLICES) for i in slices):
        raise ProtocolError(f"A partial sum's slices must be indices in 0..{len(_SLICES) - 1}.")
    running.plain = ExactSum(size)
    for i in slices:
        part = need(f"slice_{i}", size, np.float64)
        if not np.all(np.isfinite(part)):
            raise ProtocolError("A partial sum holds NaN or inf in its plaintext sums.")
        running.plain.slices[i] = part.copy()
    if fields.get("masks"):
        if not running.ragged:
            raise ProtocolError("A partial sum carries per-client masks; the job's key masks one set of positions.")
        per = -(-size // 8)
        packed = need("masks", per * len(names), np.uint8)
        running.masks = {a: packed[j * per:(j + 1) * per].copy() for j, a in enumerate(names)}
    if fields.get("plains") != (running.plains is not None):
        raise ProtocolError("A partial sum must carry its contributors' plaintext parts exactly when the job's key is "
                            "verifiable.")
    if running.plains is not None:
        has = need("plain_has_withheld", len(names), np.uint8)
        lengths = need("plain_lengths", len(names), np.int64)
        values = arrays.get("plain_values")
        withheld = arrays.get("plain_withheld")
        per = -(-size // 8)
        if values is None or values.dtype != np.float32 or np.any(lengths < 0) or values.size != int(lengths.sum()) \
                or withheld is None or withheld.dtype != np.uint8 or withheld.size != per * int(has.sum()):
            raise ProtocolError("A partial sum's plaintext parts are inconsistent with their lengths.")
        starts, w = np.concatenate([[0], np.cumsum(lengths)]), 0
        for j, a in enumerate(names):
            mask = None
            if has[j]:
                mask = np.unpackbits(withheld[w * per:(w + 1) * per])[:size].astype(bool)
                w += 1
            running.plains[a] = (mask, values[starts[j]:starts[j + 1]])
    if fields.get("withheld") not in (True, False):
        raise ProtocolError("A partial sum says whether a contributor withheld positions (true or false).")
    running.withheld = fields["withheld"]
    if public_key is not None:
        acc = fields.get("accumulator")
        if not isinstance(acc, dict):
            raise ProtocolError("A partial sum under the job's key carries its running ciphertext sum.")
        running.accumulator = public_key.accumulator_from_state(
            size, acc, {name[4:]: value for name, value in arrays.items() if name.startswith("acc_")})
    elif "accumulator" in fields:
        raise ProtocolError("A partial sum of a plaintext job carries a ciphertext sum.")
    running.total_weight = weight
    running.contributors = list(names)
    return running


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """1-D arrays as one compressed ``.npz`` (no pickles), names sorted: the same arrays, the same
    bytes. Counts and weights that are the same everywhere cost almost nothing; masked words
    do not compress."""
    out = io.BytesIO()
    np.savez_compressed(out, **{name: np.ascontiguousarray(arrays[name]) for name in sorted(arrays)})
    return out.getvalue()


def unpack_arrays(data: bytes, *, limit: int = 256) -> dict[str, np.ndarray]:
    """The arrays of :func:`pack_arrays`; ProtocolError for anything but at most ``limit``
    1-D arrays of plain numeric dtypes (never a pickle)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if len(npz.files) > limit:
                raise ProtocolError(f"A partial sum carries {len(npz.files)} arrays; at most {limit} are allowed.")
            arrays = {name: npz[name] for name in npz.files}
    except ProtocolError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ProtocolError(f"A partial sum's arrays do not decode ({exc}).") from None
    for name, value in arrays.items():
        if value.ndim != 1 or value.dtype not in _DTYPES:
            raise ProtocolError(f"A partial sum's array {name!r} must be 1-D of a numeric type, got {value.dtype} "
                                f"{value.shape}.")
    return arrays
