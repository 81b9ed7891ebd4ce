"""Partial sums (a site's running aggregate, senseshield.engine.partial): folding every update
in one place and folding them in any split among sites, each site's running aggregate sent
through its wire state (partial_state -> pack_arrays -> unpack_arrays -> partial_from_state)
and merged, give the same aggregate bit for bit: plaintext, the masked scheme with a shared
mask (both rings), and per-client masks with the k rule. What does not fit is refused and
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.engine.aggregation import StreamingAggregate, protect_update
from senseshield.engine.partial import pack_arrays, partial_from_state, partial_state, unpack_arrays
from senseshield.errors import ProtocolError
from senseshield.he import SCHEMES, generate_keys
from senseshield.he.base import round_context
from senseshield.runtime.identity import Identity

SECRET = generate_keys("masked")
AGENTS = [Identity.generate(f"c{i:03d}") for i in range(6)]
CONTEXT = round_context("fleet", "run-1", 2, 0)


def _travel(running: StreamingAggregate, public, size: int) -> StreamingAggregate:  # noqa: ANN001
    fields, arrays = partial_state(running)
    return partial_from_state(public, fields, unpack_arrays(pack_arrays(arrays)), size=size, round=2, cluster=0,
                              min_encryptors=running.min_encryptors)


def _same(a, b) -> None:  # noqa: ANN001
    assert a.contributors == b.contributors and a.total_weight == b.total_weight
    np.testing.assert_array_equal(a.union_mask, b.union_mask)
    assert a.plain_sum.tobytes() == b.plain_sum.tobytes()
    for name in ("position_weight", "thin_mask", "thin_sum"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y)
    assert (a.ciphertext is None) == (b.ciphertext is None)
    if a.ciphertext is not None:
        np.testing.assert_array_equal(a.ciphertext.positions, b.ciphertext.positions)
        assert np.asarray(a.ciphertext.payload).tobytes() == np.asarray(b.ciphertext.payload).tobytes()
    assert (a.masks or {}).keys() == (b.masks or {}).keys()
    for name in a.masks or {}:
        np.testing.assert_array_equal(a.masks[name], b.masks[name])
    assert (a.plains is None) == (b.plains is None)
    for name in a.plains or {}:
        (wa, va), (wb, vb) = a.plains[name], b.plains[name]
        assert (wa is None) == (wb is None) and (wa is None or np.array_equal(wa, wb))
        np.testing.assert_array_equal(np.asarray(va, np.float32), np.asarray(vb, np.float32))


@st.composite
def rounds(draw):
    kind = draw(st.sampled_from(["plaintext", "masked64", "masked32", "ragged"]))
    size = draw(st.integers(1, 40))
    agents = draw(st.integers(1, 6))
    bound = 1.0 if kind == "masked32" else 50.0
    values = st.floats(-bound, bound, allow_nan=False, allow_infinity=False, width=32)
    shared = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    specs = []
    for i in range(agents):
        delta = np.array(draw(st.lists(values, min_size=size, max_size=size)), dtype=np.float64)
        mask = (np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))) if kind == "ragged"
                else np.zeros(size, bool) if kind == "plaintext" else shared)
        withheld = None
        if draw(st.booleans()):
            withheld = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))) & ~mask
        specs.append((i, delta, mask, withheld, draw(st.integers(1, 10 if kind == "masked32" else 3000))))
    sites = draw(st.lists(st.integers(0, 3), min_size=agents, max_size=agents))  # 0: straight to the centre
    return kind, size, specs, sites, draw(st.integers(1, 3))


@settings(max_examples=80, deadline=None)
@given(case=rounds())
def test_any_split_among_sites_gives_the_aggregate_of_every_update(case):
    kind, size, specs, sites, k = case
    if kind == "plaintext":
        public = None
    else:
        public = SECRET.public_key.for_masks(kind == "ragged")
    bits = 32 if kind == "masked32" else 64
    updates = []
    for i, delta, mask, withheld, weight in specs:
        key = public.for_contributor(AGENTS[i].exchange, CONTEXT, ring_bits=bits) if public is not None else None
        updates.append(protect_update(delta, mask, key, client_id=f"c{i:03d}", round=2, cluster=0, n_samples=weight,
                                      withheld=withheld))
    min_enc = k if kind == "ragged" else 1
    whole = StreamingAggregate(public, size=size, round=2, cluster=0, min_encryptors=min_enc)
    for update in updates:
        whole.add(update)
    centre = StreamingAggregate(public, size=size, round=2, cluster=0, min_encryptors=min_enc)
    parts: dict[int, StreamingAggregate] = {}
    for update, site in zip(updates, sites):
        if site == 0:
            centre.add(update)
        else:
            parts.setdefault(site, StreamingAggregate(public, size=size, round=2, cluster=0,
                                                      min_encryptors=min_enc)).add(update)
    for site in sorted(parts, reverse=True):
        centre.merge(_travel(parts[site], public, size))
    _same(whole.result(), centre.result())


def _masked_update(i: int, size: int = 8, *, bits: int = 64, public=None):  # noqa: ANN001, ANN202
    public = public or SECRET.public_key
    key = public.for_contributor(AGENTS[i].exchange, CONTEXT, ring_bits=bits)
    return protect_update(np.full(size, 0.25 * (i + 1)), np.ones(size, bool), key, client_id=f"c{i:03d}", round=2,
                          cluster=0, n_samples=3)


def test_a_contributor_in_two_partial_sums_is_refused_and_changes_nothing():
    public = SECRET.public_key
    a = StreamingAggregate(public, size=8, round=2, cluster=0)
    a.add(_masked_update(0))
    b = StreamingAggregate(public, size=8, round=2, cluster=0)
    b.add(_masked_update(0))
    b.add(_masked_update(1))
    before = a.result()
    with pytest.raises(ProtocolError, match="repeats contributor"):
        a.merge(_travel(b, public, 8))
    _same(before, a.result())


def test_partial_sums_in_two_rings_or_of_another_round_do_not_join():
    public = SECRET.public_key
    a = StreamingAggregate(public, size=8, round=2, cluster=0)
    a.add(_masked_update(0, bits=64))
    b = StreamingAggregate(public, size=8, round=2, cluster=0)
    b.add(_masked_update(1, bits=32))
    with pytest.raises(ProtocolError, match="one ring"):
        a.merge(_travel(b, public, 8))
    c = StreamingAggregate(public, size=8, round=3, cluster=0)
    with pytest.raises(ProtocolError, match="cannot join round 2"):
        a.merge(c)


@pytest.mark.parametrize("tamper, match", [
    (lambda f, a: a.update(union=a["union"][:-1]), "union must be"),
    (lambda f, a: f.update(contributors=["c001", "c000"]), "sorted"),
    (lambda f, a: f.update(total_weight=0), "cannot weigh"),
    (lambda f, a: a.update(acc_total=a["acc_total"].astype(np.uint32)), "needs uint64 words"),
    (lambda f, a: f["accumulator"].update(ring_bits=16), "rings of 32 and 64"),
    (lambda f, a: a.update(slice_3=np.full(8, np.nan)), "NaN"),
    (lambda f, a: a.update(acc_positions=a["acc_positions"][:-1].copy()), "bitset of the model's 8 positions"),
    (lambda f, a: a.update(acc_positions=np.zeros(1, np.uint8)), "8 masked words for 0 positions"),
])
def test_a_partial_sum_that_does_not_describe_an_aggregate_is_refused(tamper, match):
    public = SECRET.public_key
    running = StreamingAggregate(public, size=8, round=2, cluster=0)
    running.add(_masked_update(0))
    running.add(_masked_update(1))
    fields, arrays = partial_state(running)
    arrays.setdefault("slice_3", np.zeros(8))
    fields["slices"] = sorted(set(fields["slices"]) | {3})
    tamper(fields, arrays)
    with pytest.raises(ProtocolError, match=match):
        partial_from_state(public, fields, arrays, size=8, round=2, cluster=0)


def test_arrays_travel_without_pickles():
    data = pack_arrays({"a": np.arange(3, dtype=np.int64)})
    assert unpack_arrays(data)["a"].tolist() == [0, 1, 2]
    import io

    out = io.BytesIO()
    np.savez(out, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ProtocolError, match="do not decode"):
        unpack_arrays(out.getvalue())
    with pytest.raises(ProtocolError, match="do not decode"):
        unpack_arrays(b"not an npz")


def test_schemes_whose_running_sum_cannot_travel_say_so():  # per-value Paillier and CKKS keep their parts
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        public = SCHEMES.get("paillier").generate(key_bits=512).public_key
    running = StreamingAggregate(public, size=4, round=2, cluster=0)
    with pytest.raises(ProtocolError, match="cannot be folded at a site"):
        partial_state(running)


@pytest.fixture(scope="module")
def packed():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SCHEMES.get("packed-paillier").generate(key_bits=512)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_packed_paillier_partial_sums_give_the_aggregate_of_every_update(packed, data):
    """Packed Paillier (per-client block masks, plaintext parts, withheld blocks): running
    products merged per block, sums added: the same aggregate, integer for integer."""
    public = packed.public_key
    block = public.block_size
    blocks = data.draw(st.integers(1, 3))
    size = data.draw(st.integers((blocks - 1) * block + 1, blocks * block))
    agents = data.draw(st.integers(1, 5))
    values = st.floats(-1, 1, allow_nan=False, allow_infinity=False, width=32)
    updates = []
    for i in range(agents):
        delta = np.array(data.draw(st.lists(values, min_size=size, max_size=size)), dtype=np.float64)
        mask = np.repeat(np.array(data.draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks))), block)[:size]
        updates.append(protect_update(delta, mask, public, client_id=f"c{i}", round=2, cluster=0,
                                      n_samples=data.draw(st.integers(1, 200))))
    sites = data.draw(st.lists(st.integers(0, 2), min_size=agents, max_size=agents))
    whole = StreamingAggregate(public, size=size, round=2, cluster=0)
    centre = StreamingAggregate(public, size=size, round=2, cluster=0)
    parts: dict[int, StreamingAggregate] = {}
    for update, site in zip(updates, sites):
        whole.add(update)
        (centre if site == 0 else parts.setdefault(site, StreamingAggregate(public, size=size, round=2,
                                                                              cluster=0))).add(update)
    for site in sorted(parts):
        centre.merge(_travel(parts[site], public, size))
    a, b = whole.result(), centre.result()
    assert a.contributors == b.contributors and a.total_weight == b.total_weight
    np.testing.assert_array_equal(a.union_mask, b.union_mask)
    assert a.plain_sum.tobytes() == b.plain_sum.tobytes()
    assert (a.ciphertext is None) == (b.ciphertext is None)
    if a.ciphertext is not None:
        assert a.ciphertext.payload.ciphertexts == b.ciphertext.payload.ciphertexts
        np.testing.assert_array_equal(a.ciphertext.payload.weights, b.ciphertext.payload.weights)
