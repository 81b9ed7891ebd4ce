"""Packed Paillier: exact sums of quantised values, head-room, clipping, blocks, wire format.

Hypothesis properties use 1024-bit keys (insecure, fast; the warning is silenced); one test
generates a default 2048-bit key.
"""

from __future__ import annotations

import copy
import json
import pickle
import warnings

import gmpy2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from senseshield.engine.aggregation import aggregate_updates, decrypt_aggregate, protect_update
from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError, SecretKeyExportError
from senseshield.he import SCHEMES, CipherPart, PlainPart, generate_keys
from senseshield.he.base import EncryptedVector
from senseshield.he.packed import (
    DEFAULT_CLIP,
    DEFAULT_MAX_TOTAL_WEIGHT,
    DEFAULT_VALUE_BITS,
    ClippingWarning,
    PackedPaillierPublicKey,
    PackedPaillierScheme,
    PackedPaillierSecretKey,
    PackedPayload,
)
from senseshield.he.paillier import InsecureKeyWarning

pytestmark = pytest.mark.filterwarnings("ignore::senseshield.he.paillier.InsecureKeyWarning")

TEST_KEY_BITS = 1024
SMALL_HEADROOM = 12  # max_total_weight of the key used to hit the head-room exactly


def _generate(**params: object) -> PackedPaillierSecretKey:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)
        key = PackedPaillierScheme.generate(
            key_bits=TEST_KEY_BITS, **params  # type: ignore[arg-type]
        )
    key.public_key.window_bits = 6  # small table: fast tests
    return key


@pytest.fixture(scope="module", params=["subgroup", "standard"])
def key(request) -> PackedPaillierSecretKey:  # noqa: ANN001
    """Every property holds for both key structures (short subgroup exponents, and standard)."""
    return _generate(structure=request.param)


@pytest.fixture(scope="module")
def other_key() -> PackedPaillierSecretKey:
    return _generate()


@pytest.fixture(scope="module")
def small() -> PackedPaillierSecretKey:
    """Head-room of 12 samples per block, 8-bit values in [-2, 2]."""
    return _generate(max_total_weight=SMALL_HEADROOM, value_bits=8, clip=2.0)


def _block_positions(blocks: list[int], block_size: int, size: int) -> np.ndarray:
    if not blocks:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(
        [np.arange(b * block_size, min((b + 1) * block_size, size)) for b in sorted(blocks)]
    ).astype(np.int64)


def _fleet_parts(
    public: PackedPaillierPublicKey,
    size: int,
    clients: list[tuple[np.ndarray, list[int], int]],
) -> tuple[list[CipherPart | PlainPart], np.ndarray]:
    """Cipher parts for each client's blocks, plain parts for the union blocks it skipped
    (what the coordinator builds)."""
    B = public.block_size
    union_blocks = sorted({b for _, blocks, _ in clients for b in blocks})
    union = _block_positions(union_blocks, B, size)
    parts: list[CipherPart | PlainPart] = []
    for values, blocks, weight in clients:
        pos = _block_positions(blocks, B, size)
        if pos.size:
            parts.append(CipherPart(public.encrypt(values[pos], pos), weight))
        rest = np.setdiff1d(union, pos)
        if rest.size:
            parts.append(PlainPart(rest, values[rest], weight))
    return parts, union


@st.composite
def fleets(draw: st.DrawFn, block_size: int, clip: float, max_weight: int) -> tuple:
    """(size, [(values, blocks, weight)]) with total weight <= max_weight; values include
    the extremes of the clip range, zero and values just inside it."""
    nblocks = draw(st.integers(1, 4))
    size = (nblocks - 1) * block_size + draw(st.integers(1, block_size))
    nclients = draw(st.integers(1, min(6, max_weight)))
    budget = max_weight
    clients = []
    special = st.sampled_from([clip, -clip, 0.0, clip * (1 - 1e-12), -clip * (1 - 1e-12)])
    value = st.one_of(special, st.floats(-clip, clip, allow_nan=False))
    for i in range(nclients):
        remaining = nclients - i - 1
        weight = draw(st.integers(1, max(1, budget - remaining)))
        budget -= weight
        values = np.array(draw(st.lists(value, min_size=size, max_size=size)))
        blocks = draw(st.lists(st.integers(0, nblocks - 1), unique=True, max_size=nblocks))
        clients.append((values, blocks, weight))
    if not any(blocks for _, blocks, _ in clients):
        clients[0] = (clients[0][0], [0], clients[0][2])
    return size, clients


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sum_of_quantised_values_is_exact(
    small: PackedPaillierSecretKey, data: st.DataObject
) -> None:
    public = small.public_key
    lay = public.layout
    size, clients = data.draw(fleets(public.block_size, lay.clip, lay.max_total_weight))
    parts, union = _fleet_parts(public, size, clients)
    aggregate = public.aggregate(parts, union)
    expected = sum(w * lay.quantise(v)[0] for v, _, w in clients)
    np.testing.assert_array_equal(small.decrypt_integers(aggregate), expected[union])
    np.testing.assert_array_equal(small.decrypt(aggregate), lay.dequantise(expected[union]))
    assert aggregate.payload.clipped == 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sum_is_exact_with_default_layout(
    key: PackedPaillierSecretKey, data: st.DataObject
) -> None:
    public = key.public_key
    lay = public.layout
    size, clients = data.draw(fleets(public.block_size, lay.clip, 2000))
    parts, union = _fleet_parts(public, size, clients)
    expected = sum(w * lay.quantise(v)[0] for v, _, w in clients)
    np.testing.assert_array_equal(
        key.decrypt_integers(public.aggregate(parts, union)), expected[union]
    )


@pytest.mark.parametrize("extreme", [2.0, -2.0, 0.0])
def test_headroom_is_reached_exactly_and_not_exceeded(
    small: PackedPaillierSecretKey, extreme: float
) -> None:
    public = small.public_key
    B = public.block_size
    pos = np.arange(2 * B)
    vector = public.encrypt(np.full(pos.size, extreme), pos)
    parts = [CipherPart(vector, 1) for _ in range(SMALL_HEADROOM)]
    q = public.layout.quantise(np.array([extreme]))[0][0]
    out = small.decrypt_integers(public.aggregate(parts, pos))
    np.testing.assert_array_equal(out, np.full(pos.size, SMALL_HEADROOM * q))
    with pytest.raises(ProtocolError, match=r"max_total_weight=12"):
        public.aggregate(parts + [CipherPart(vector, 1)], pos)


def test_weighted_headroom_names_the_numbers(small: PackedPaillierSecretKey) -> None:
    public = small.public_key
    pos = np.arange(public.block_size)
    vector = public.encrypt(np.zeros(pos.size), pos)
    with pytest.raises(ProtocolError, match=r"13.*max_total_weight=12"):
        public.aggregate([CipherPart(vector, 7), PlainPart(pos, np.zeros(pos.size), 6)], pos)
    with pytest.raises(ProtocolError, match="max_total_weight"):
        public.aggregate([CipherPart(vector, 13)], pos)
    # an aggregate re-used as a part carries its weights
    agg = public.aggregate([CipherPart(vector, 4)], pos)
    np.testing.assert_array_equal(agg.payload.weights, [4])
    public.aggregate([CipherPart(agg, 3)], pos)  # 12: fine
    with pytest.raises(ProtocolError, match="16"):
        public.aggregate([CipherPart(agg, 4)], pos)


def test_weights_must_be_positive_integers(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    pos = np.arange(public.block_size)
    vector = public.encrypt(np.zeros(pos.size), pos)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ProtocolError):
            public.aggregate([CipherPart(vector, bad)], pos)  # type: ignore[arg-type]


def test_clipping_is_counted_warned_and_applied(small: PackedPaillierSecretKey) -> None:
    public = small.public_key
    B = public.block_size
    pos = np.arange(B)
    values = np.linspace(-3.0, 3.0, B)
    outside = int(np.count_nonzero(np.abs(values) > 2.0))
    with pytest.warns(ClippingWarning, match=f"{outside} of {B} values"):
        vector = public.encrypt(values, pos)
    assert vector.payload.clipped == outside
    out = small.decrypt(vector)
    np.testing.assert_array_equal(out, public.layout.dequantise(public.layout.quantise(values)[0]))
    assert out.max() == pytest.approx(2.0) and out.min() == pytest.approx(-2.0)
    # plaintext contributions are clipped and counted too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ClippingWarning)
        other = public.encrypt(np.zeros(B), pos)
    with pytest.warns(ClippingWarning, match="Plaintext part 1"):
        agg = public.aggregate([CipherPart(other, 1), PlainPart(pos, values, 2)], pos)
    assert agg.payload.clipped == outside
    np.testing.assert_array_equal(
        small.decrypt_integers(agg), 2 * public.layout.quantise(values)[0]
    )


def test_no_warning_inside_the_clip_range(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    pos = np.arange(public.block_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClippingWarning)
        vector = public.encrypt(np.linspace(-1, 1, pos.size), pos)
    assert vector.payload.clipped == 0


# -- blocks ------------------------------------------------------------------------------


def test_encrypt_requires_whole_blocks(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    B = public.block_size
    with pytest.raises(ValueError, match="block 0"):
        public.encrypt(np.zeros(B - 1), np.arange(1, B))  # not from the block start
    with pytest.raises(ValueError, match="block 0"):
        public.encrypt(np.zeros(B + 3), np.arange(B + 3) + np.r_[np.zeros(B - 1), [1] * 4])
    with pytest.raises(ValueError, match="highest block"):
        public.encrypt(np.zeros(3), np.array([B, B + 1, B + 3]))
    # the highest block may be partial (the model's end)
    partial = public.encrypt(np.full(B + 5, 0.5), np.arange(B + 5))
    assert len(partial.payload) == 2 and partial.nbytes == 2 * public.ciphertext_nbytes
    np.testing.assert_allclose(key.decrypt(partial), 0.5, atol=public.layout.step / 2)
    empty = public.encrypt(np.zeros(0), np.zeros(0, dtype=np.int64))
    assert len(empty.payload) == 0 and key.decrypt(empty).size == 0
    with pytest.raises(ValueError):
        public.encrypt(np.array([np.nan] * B), np.arange(B))


def test_aggregate_checks_block_coverage(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    B = public.block_size
    full = np.arange(2 * B)
    first = public.encrypt(np.zeros(B), np.arange(B))
    with pytest.raises(ProtocolError, match="not covered by any ciphertext"):
        public.aggregate([CipherPart(first, 1), PlainPart(full, np.zeros(2 * B), 1)], full)
    with pytest.raises(ProtocolError, match="whole blocks"):
        public.aggregate(
            [CipherPart(first, 1), PlainPart(np.arange(5), np.zeros(5), 1)], np.arange(B)
        )
    with pytest.raises(ProtocolError, match="outside"):
        public.aggregate([CipherPart(first, 1)], np.arange(B, 2 * B))
    with pytest.raises(ProtocolError, match="Aggregate positions"):
        public.aggregate([CipherPart(first, 1)], np.arange(1, B))
    with pytest.raises(ProtocolError, match="partial block"):
        public.aggregate([CipherPart(first, 1)], np.arange(B - 1))
    # a partial last block must be the same for every contributor
    short = public.encrypt(np.zeros(B + 3), np.arange(B + 3))
    longer = public.encrypt(np.zeros(B + 4), np.arange(B + 4))
    with pytest.raises(ProtocolError, match="partial block"):
        public.aggregate([CipherPart(short, 1), CipherPart(longer, 1)], np.arange(B + 4))
    # plaintext positions outside the union are ignored
    agg = public.aggregate(
        [CipherPart(first, 1), PlainPart(np.arange(B, 2 * B), np.ones(B), 1)], np.arange(B)
    )
    np.testing.assert_array_equal(agg.payload.weights, [1])


# -- keys, wire format, validation ---------------------------------------------------------


def test_different_keys_refuse_to_mix(
    key: PackedPaillierSecretKey, other_key: PackedPaillierSecretKey
) -> None:
    B = key.public_key.block_size
    pos = np.arange(B)
    mine = key.public_key.encrypt(np.zeros(B), pos)
    theirs = other_key.public_key.encrypt(np.zeros(B), pos)
    with pytest.raises(KeyMismatchError):
        key.public_key.aggregate([CipherPart(mine, 1), CipherPart(theirs, 1)], pos)
    with pytest.raises(KeyMismatchError):
        key.decrypt(theirs)
    with pytest.raises(KeyMismatchError):
        key.public_key.vector_from_bytes(other_key.public_key.ciphertext_bytes(theirs))
    with pytest.raises(ConfigError):
        key.public_key.encrypt(np.zeros(B), pos, pool=other_key.public_key.make_pool(4))
    with pytest.raises(ConfigError):
        key.public_key.attach_pool(other_key.public_key.make_pool(4))


def test_key_id_covers_the_layout(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    same = PackedPaillierPublicKey(public.n, public.hs)
    assert same.key_id == public.key_id
    for change in ({"clip": 0.5}, {"value_bits": 14}, {"max_total_weight": 1000}):
        assert PackedPaillierPublicKey(public.n, public.hs, **change).key_id != public.key_id
    # exponent length does not change what decrypts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)
        shorter = PackedPaillierPublicKey(public.n, public.hs, exponent_bits=256)
    assert shorter.key_id == public.key_id
    vector = shorter.encrypt(np.full(public.block_size, 0.25), np.arange(public.block_size))
    np.testing.assert_allclose(key.decrypt(vector), 0.25, atol=public.layout.step / 2)


def test_wire_format_roundtrip_and_rejections(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    B = public.block_size
    pos = np.r_[np.arange(B), np.arange(3 * B, 4 * B + 7)]
    vector = public.encrypt(np.linspace(-1, 1, pos.size), pos)
    agg = public.aggregate([CipherPart(vector, 5)], pos)
    data = public.ciphertext_bytes(agg)
    back = public.vector_from_bytes(data)
    np.testing.assert_array_equal(back.positions, pos)
    np.testing.assert_array_equal(back.payload.weights, agg.payload.weights)
    np.testing.assert_array_equal(key.decrypt_integers(back), key.decrypt_integers(agg))
    width = public.ciphertext_nbytes
    header = 29  # magic 4, version 1, key id 8, blocks 8, last length 4, width 4
    assert len(data) == header + 3 * (8 + width)
    with pytest.raises(ProtocolError, match="bytes"):
        public.vector_from_bytes(data[:-1])
    with pytest.raises(ProtocolError, match="bytes"):
        public.vector_from_bytes(data + b"\0")
    with pytest.raises(ProtocolError, match="shorter than its header"):
        public.vector_from_bytes(data[:10])
    with pytest.raises(ProtocolError, match="magic"):
        public.vector_from_bytes(b"XXXX" + data[4:])
    nsquare = public.n**2
    for bad in (0, nsquare, nsquare + 5):
        raw = bytearray(data)
        raw[-width:] = int(bad % 2 ** (8 * width)).to_bytes(width, "big")
        with pytest.raises(ProtocolError, match="Z_"):
            public.vector_from_bytes(bytes(raw))
    raw = bytearray(data)
    raw[header + 12 : header + 16] = (0).to_bytes(4, "big")  # weight of the first block -> 0
    with pytest.raises(ProtocolError, match="weights"):
        public.vector_from_bytes(bytes(raw))
    raw = bytearray(data)
    raw[header : header + 4] = (9).to_bytes(4, "big")  # blocks out of order
    with pytest.raises(ProtocolError, match="sorted"):
        public.vector_from_bytes(bytes(raw))
    raw = bytearray(data)
    raw[header - 4 : header] = (width - 1).to_bytes(4, "big")  # width field -> wrong
    with pytest.raises(ProtocolError, match="width"):
        public.vector_from_bytes(bytes(raw))


def test_in_memory_payload_is_validated(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    B = public.block_size
    pos = np.arange(B)
    good = public.encrypt(np.zeros(B), pos)

    def forged(**change: object) -> EncryptedVector:
        fields: dict[str, object] = {
            "blocks": good.payload.blocks,
            "ciphertexts": list(good.payload.ciphertexts),
            "weights": good.payload.weights,
            **change,
        }
        payload = PackedPayload(**fields)  # type: ignore[arg-type]
        return EncryptedVector(good.scheme, good.key_id, pos, payload, good.nbytes)

    for vector in (
        forged(ciphertexts=[public.n**2]),
        forged(ciphertexts=[0]),
        forged(ciphertexts=[]),
        forged(weights=np.array([0])),
        forged(blocks=np.array([1])),
    ):
        with pytest.raises(ProtocolError):
            key.decrypt(vector)
        with pytest.raises(ProtocolError):
            public.aggregate([CipherPart(vector, 1)], pos)
    wrong = EncryptedVector(good.scheme, good.key_id, pos, list(good.payload.ciphertexts), 0)
    with pytest.raises(ProtocolError, match="payload"):
        key.decrypt(wrong)


def test_out_of_range_plaintexts_are_detected(small: PackedPaillierSecretKey) -> None:
    """A ciphertext of a slot above the head-room (a malicious client) is not decoded."""
    public = small.public_key
    lay = public.layout
    B = public.block_size
    n, nsquare = public.n, public.n**2
    good = public.encrypt(np.zeros(B), np.arange(B))

    def encrypt_raw(m: int) -> EncryptedVector:
        c = int((1 + m * n) * public.new_obfuscator() % nsquare)
        payload = PackedPayload(good.payload.blocks, [c], good.payload.weights)
        return EncryptedVector(good.scheme, good.key_id, good.positions, payload, good.nbytes)

    with pytest.raises(ProtocolError, match="outside"):
        small.decrypt(encrypt_raw(lay.u_max + 1))  # slot 0 above one client's range
    with pytest.raises(ProtocolError, match="above its"):
        small.decrypt(encrypt_raw(1 << (B * lay.slot_bits)))
    partial = public.encrypt(np.zeros(5), np.arange(5))
    c = int((1 + (1 << (6 * lay.slot_bits)) * n) * public.new_obfuscator() % nsquare)
    forged = EncryptedVector(
        partial.scheme,
        partial.key_id,
        partial.positions,
        PackedPayload(partial.payload.blocks, [c], partial.payload.weights),
        partial.nbytes,
    )
    with pytest.raises(ProtocolError, match="unused slot"):
        small.decrypt(forged)


def test_secret_key_guards(key: PackedPaillierSecretKey) -> None:
    with pytest.raises(SecretKeyExportError):
        pickle.dumps(key)
    with pytest.raises(SecretKeyExportError):
        copy.deepcopy(key)
    with pytest.raises(SecretKeyExportError):
        key.to_bytes()
    text = repr(key) + str(key)
    assert key.public_key.key_id in text
    primes = key._PackedPaillierSecretKey__primes  # type: ignore[attr-defined]
    assert str(int(primes.p))[:12] not in text and format(int(primes.p), "x")[:12] not in text
    assert "primes" in repr(primes) and str(int(primes.p))[:12] not in repr(primes)
    restored = PackedPaillierSecretKey.from_bytes(key.to_bytes(include_secret=True))
    assert restored.public_key == key.public_key
    pos = np.arange(key.public_key.block_size)
    vector = key.public_key.encrypt(np.full(pos.size, -0.75), pos)
    np.testing.assert_array_equal(restored.decrypt(vector), key.decrypt(vector))
    with pytest.raises(ProtocolError):
        PackedPaillierSecretKey.from_bytes(b"{}")


def test_public_key_serialisation(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    data = public.to_bytes()
    assert b'"p"' not in data and b'"q"' not in data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)
        back = SCHEMES.get("packed-paillier").public_key_from_bytes(data)
        again = pickle.loads(pickle.dumps(public))
    assert back == public and back.key_id == public.key_id and again == public
    obj = json.loads(data)
    forged = [json.dumps({**obj, change: value}).encode() for change, value in
              (("hs", "1"), ("n", "10"), ("clip", -1.0), ("value_bits", 99), ("scheme", "ckks"))]
    for bad in (b"", b"{}", b"[1]", b"\xff", *forged):
        with pytest.raises(ProtocolError):
            PackedPaillierPublicKey.from_bytes(bad)


def test_generate_validates_parameters() -> None:
    with pytest.raises(ConfigError, match="Unknown"):
        PackedPaillierScheme.generate(key_bits=512, precision_bits=3)
    with pytest.raises(ConfigError):
        PackedPaillierScheme.generate(key_bits=511)
    with pytest.raises(ConfigError):
        PackedPaillierScheme.generate(key_bits=512, value_bits=40)
    with pytest.raises(ConfigError):
        PackedPaillierScheme.generate(key_bits=512, clip=0.0)
    with pytest.raises(ConfigError):
        PackedPaillierScheme.generate(key_bits=512, max_total_weight=0)
    with pytest.raises(ConfigError, match="slot"):
        PackedPaillierScheme.generate(key_bits=512, value_bits=32, max_total_weight=2**31)


def test_scheme_is_registered_with_block_size(key: PackedPaillierSecretKey) -> None:
    factory = SCHEMES.get("packed-paillier")
    assert factory is PackedPaillierScheme and factory.ragged_masks
    info = factory.info()
    assert info.params["value_bits"] == DEFAULT_VALUE_BITS
    assert info.params["clip"] == DEFAULT_CLIP
    assert info.params["max_total_weight"] == DEFAULT_MAX_TOTAL_WEIGHT
    assert info.params["exponent_bits"] == 1024
    public = key.public_key
    assert public.block_size == public.layout.slots == (TEST_KEY_BITS - 1) // 31


def test_pool_feeds_encryption(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    B = public.block_size
    pos = np.arange(3 * B)
    values = np.linspace(-0.9, 0.9, pos.size)
    pool = public.make_pool(capacity=8, start=True, attach=True)
    try:
        assert pool.wait_until(8, timeout=10)
        vector = public.encrypt(values, pos)
        assert pool.served == 3 and pool.misses == 0
        pool.stop()
        pool.clear()
        again = public.encrypt(values, pos)  # empty pool: computed inline, counted
        assert pool.misses == 3
    finally:
        pool.stop()
        public.detach_pool()
    assert public.pool is None
    q = public.layout.quantise(values)[0]
    np.testing.assert_array_equal(key.decrypt_integers(vector), q)
    np.testing.assert_array_equal(key.decrypt_integers(again), q)
    assert vector.payload.ciphertexts != again.payload.ciphertexts  # fresh randomness


def test_threaded_decryption_matches(key: PackedPaillierSecretKey) -> None:
    public = key.public_key
    pos = np.arange(9 * public.block_size)
    vector = public.encrypt(np.linspace(-1, 1, pos.size), pos)
    np.testing.assert_array_equal(
        key.decrypt_integers(vector, threads=3), key.decrypt_integers(vector)
    )


def test_engine_aggregation_with_block_masks(key: PackedPaillierSecretKey) -> None:
    """protect_update -> aggregate_updates -> decrypt_aggregate with block-aligned masks."""
    public = key.public_key
    B = public.block_size
    size = 4 * B + 10
    rng = np.random.default_rng(3)
    deltas = [rng.uniform(-0.5, 0.5, size) for _ in range(3)]
    weights = [30, 50, 20]
    block_masks = [[True, False, False, True, True], [False, True, False, True, False],
                   [False, False, False, False, False]]
    updates = []
    for i, (delta, bm, w) in enumerate(zip(deltas, block_masks, weights)):
        mask = np.repeat(np.array(bm), B)[:size]
        updates.append(
            protect_update(delta, mask, public, client_id=f"c{i}", round=1, cluster=0, n_samples=w)
        )
    aggregate = aggregate_updates(updates, public, round=1, cluster=0)
    mean = decrypt_aggregate(aggregate, key)
    exact = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    step = public.layout.step
    union = aggregate.union_mask
    assert np.max(np.abs(mean[union] - exact[union])) <= step / 2 + 1e-12
    np.testing.assert_allclose(mean[~union], exact[~union], atol=1e-6)  # float32 plaintext


def test_default_2048_bit_key() -> None:
    secret = generate_keys("packed-paillier")
    public = secret.public_key
    assert isinstance(public, PackedPaillierPublicKey)
    assert public.key_bits == 2048 and public.exponent_bits == 1024
    assert public.block_size == 66 and public.bytes_per_param <= 8
    B = public.block_size
    pos = np.arange(2 * B)
    values = np.linspace(-1, 1, pos.size)
    vector = public.encrypt(values, pos)
    assert vector.nbytes / pos.size <= 8
    agg = public.aggregate([CipherPart(vector, 100), PlainPart(pos, -values, 28)], pos)
    q = public.layout.quantise(values)[0]
    np.testing.assert_array_equal(secret.decrypt_integers(agg), 72 * q)
    assert gmpy2.is_prime(secret._PackedPaillierSecretKey__primes.p)  # type: ignore[attr-defined]


def test_the_subgroup_key_decrypts_with_short_exponents_and_refuses_to_mix():
    """The subgroup key's obfuscator base has the secret prime orders (h_s^alpha = 1 mod p^2
    and q^2), decryption agrees with the standard formula, and a standard key's primes cannot
    be combined with subgroup orders (the key refuses)."""
    sub, std = _generate(structure="subgroup"), _generate(structure="standard")
    assert (sub.structure, std.structure) == ("subgroup", "standard")
    exported = json.loads(sub.to_bytes(include_secret=True))
    p, q = int(exported["p"], 16), int(exported["q"], 16)
    a_p, a_q = int(exported["alpha_p"], 16), int(exported["alpha_q"], 16)
    assert (p - 1) % a_p == 0 and (q - 1) % a_q == 0 and a_p.bit_length() == TEST_KEY_BITS // 4
    hs = sub.public_key.hs
    assert pow(hs, a_p, p * p) == 1 and pow(hs, a_q, q * q) == 1 and pow(hs, a_p, q * q) != 1
    # the same ciphertexts decrypt alike with the subgroup exponents and with p - 1, q - 1
    public = sub.public_key
    positions = np.arange(3 * public.block_size)
    values = np.random.default_rng(3).uniform(-0.9, 0.9, positions.size)
    vector = public.encrypt(values, positions)
    as_standard = PackedPaillierSecretKey(p, q, public)
    assert np.array_equal(sub.decrypt(vector), as_standard.decrypt(vector))
    assert np.array_equal(sub.decrypt(vector, threads=2), sub.decrypt(vector))
    # a standard key with claimed subgroup orders: refused, on construction and on import
    std_fields = json.loads(std.to_bytes(include_secret=True))
    with pytest.raises(ConfigError, match="subgroup orders do not fit the key"):
        PackedPaillierSecretKey(int(std_fields["p"], 16), int(std_fields["q"], 16), std.public_key, (a_p, a_q))
    forged = dict(std_fields, alpha_p=exported["alpha_p"], alpha_q=exported["alpha_q"])
    with pytest.raises(ProtocolError, match="subgroup orders do not fit"):
        PackedPaillierScheme.secret_key_from_bytes(json.dumps(forged).encode())
    with pytest.raises(ConfigError, match="structure='tiny' is not allowed"):
        PackedPaillierScheme.generate(key_bits=1024, structure="tiny")


@given(st.lists(st.integers(0, 300), max_size=60), st.booleans())
@settings(max_examples=80, deadline=None)
def test_the_linear_time_group_and_repeat_checks_agree_with_numpy(values, sort):
    """The O(n) paths for sorted positions give np.unique's answers."""
    from senseshield.he.base import repeats
    from senseshield.he.encoding import groups

    keys = np.array(sorted(values) if sort else values, dtype=np.int64)
    expected = np.unique(keys, return_counts=True)
    got = groups(keys)
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert repeats(keys) == (np.unique(keys).size != keys.size)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 500), min_size=1, max_size=4), st.integers(0, 2**31))
def test_a_weight_folded_in_by_the_encryptor_aggregates_like_an_exponent(small, weights, seed):
    """Issue 22 item 5: ``encrypt(..., weight=w)`` then one multiplication equals encrypting
    the value and raising the ciphertext to ``w``, slot for slot after decryption; a part
    that says it is folded but weighs otherwise is refused."""
    public = small.public_key
    pos = np.arange(public.block_size)
    rng = np.random.default_rng(seed)
    values = [rng.uniform(-1, 1, pos.size) for _ in weights]
    weights = [min(w, public.layout.max_total_weight // len(weights)) for w in weights]
    folded = public.aggregate([CipherPart(public.encrypt(v, pos, weight=w), w, folded=True)
                               for v, w in zip(values, weights)], pos)
    exponent = public.aggregate([CipherPart(public.encrypt(v, pos), w) for v, w in zip(values, weights)], pos)
    np.testing.assert_array_equal(small.decrypt_integers(folded), small.decrypt_integers(exponent))
    np.testing.assert_array_equal(folded.payload.weights, exponent.payload.weights)
    if max(weights) > 1:
        w = max(weights)
        with pytest.raises(ProtocolError, match="folded in"):
            public.aggregate([CipherPart(public.encrypt(values[0], pos), w, folded=True)], pos)
