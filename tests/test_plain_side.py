"""The key server's recomputation of an aggregate's plaintext side
(``senseshield.engine.aggregation.recompute_plain_side``, ``Accumulator.fold``).

Property, for every verifiable scheme with per-client masks (per-value Paillier, packed
Paillier, the masked scheme in both rings): whatever masks, withheld zones, weights, values
and k, what the key server rebuilds from the contributors' plaintext parts (as the aggregate
request carries them, through the wire format of ``plain_part``) is what the coordinator's
aggregate holds, bit for bit: the fold of every ciphertext unit, the plaintext sums, the
position weights, the sealed positions and their sums, packed Paillier's block weights; the
coordinator's running and batch aggregates alike. One changed plaintext value changes it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from senseshield.engine.aggregation import PlainContribution, aggregate_updates, protect_update, recompute_plain_side
from senseshield.errors import ProtocolError
from senseshield.he import generate_keys
from senseshield.he.base import job_key, round_context
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.messages import pack_mask, parse_plain_part, plain_part

AGENTS = [Identity.generate(f"c{i}") for i in range(4)]
SCHEMES = ["paillier", "packed-paillier", "masked-64", "masked-32"]
_KEYS: dict[str, object] = {}


def _secret(name: str):  # noqa: ANN202
    scheme = name.split("-")[0] if name.startswith("masked") else name
    if scheme not in _KEYS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params = {"paillier": {"key_bits": 512}, "packed-paillier": {"key_bits": 512, "clip": 8.0}}.get(scheme, {})
            _KEYS[scheme] = generate_keys(scheme, **params)
    return _KEYS[scheme]


def _public(name: str):  # noqa: ANN202
    """The key as a per-client-mask job uses it (the masked scheme: ragged)."""
    return job_key(_secret(name).public_key, per_client_masks=True)


@st.composite
def fleets(draw, scheme: str):  # noqa: ANN001, ANN201
    """Per agent: a block-granular mask, a withheld zone (whole blocks, outside the mask), a
    weight and values (in the 32-bit ring's clip range for masked-32)."""
    B = _public(scheme).block_size
    blocks = draw(st.integers(1, 6))
    size = blocks * B - draw(st.integers(0, B - 1))  # the last block may be partial
    agents = draw(st.integers(1, 4))
    bound = 1.0 if scheme == "masked-32" else 6.0
    out = []
    for _ in range(agents):
        kind = draw(st.lists(st.sampled_from("emw"), min_size=blocks, max_size=blocks))  # encrypted, plain, withheld
        mask = np.repeat(np.array([c == "e" for c in kind]), B)[:size]
        withheld = np.repeat(np.array([c == "w" for c in kind]), B)[:size]
        values = np.array(draw(st.lists(st.floats(-bound, bound, allow_nan=False), min_size=size, max_size=size)))
        out.append((mask, withheld if withheld.any() else None, values, draw(st.integers(1, 400))))
    if not any(m.any() for m, *_ in out):  # an encrypted aggregate: someone encrypts something
        mask, withheld, values, w = out[0]
        mask = np.ones(size, bool)
        out[0] = (mask, None, values, w)
    return size, out


def _updates(scheme: str, fleet) -> list:  # noqa: ANN001
    size, agents = fleet
    public, ring = _public(scheme), 32 if scheme == "masked-32" else 64
    updates = []
    for i, (mask, withheld, values, w) in enumerate(agents):
        key = public.for_contributor(AGENTS[i].exchange, round_context("f", "run", 1, 0), ring_bits=ring)
        updates.append(protect_update(values, mask, key, client_id=f"c{i}", round=1, cluster=0, n_samples=w,
                                      withheld=withheld))
    return updates


def _key_servers_parts(aggregate, updates) -> list[PlainContribution]:  # noqa: ANN001
    """What the key server holds: each contributor's signed count and mask, and its plaintext
    part as the aggregate request carries it (the bytes its receipt's digest covers)."""
    parts = []
    for u in updates:
        withheld, plaintext = aggregate.plains[u.client_id]
        wire = plain_part(pack_mask(withheld) if withheld is not None else np.zeros(0, np.uint8), plaintext)
        parts.append(PlainContribution(u.client_id, u.n_samples, u.mask, *parse_plain_part(wire, u.size)))
    return parts


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("streaming", [True, False])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), k=st.integers(1, 3))
def test_the_key_servers_recomputation_is_the_coordinators_aggregate_bit_for_bit(scheme, streaming, data, k):
    public = _public(scheme)
    updates = _updates(scheme, data.draw(fleets(scheme)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (packed: clipping warnings of the plaintext parts)
        aggregate = aggregate_updates(updates, public, round=1, cluster=0, streaming=streaming, min_encryptors=k)
    side = recompute_plain_side(public, aggregate, _key_servers_parts(aggregate, updates), min_encryptors=k)
    assert side.fold == public.plain_fold(aggregate.ciphertext)
    np.testing.assert_array_equal(side.union, aggregate.union_mask)
    np.testing.assert_array_equal(side.plain_sum, aggregate.plain_sum)
    for ours, theirs in ((side.position_weight, aggregate.position_weight), (side.thin_mask, aggregate.thin_mask),
                         (side.thin_sum, aggregate.thin_sum)):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            np.testing.assert_array_equal(ours, theirs)
    carried = public.unit_weights(aggregate.ciphertext)
    if carried is not None:  # packed Paillier's block weights
        np.testing.assert_array_equal(side.unit_weights, carried)
    # the parts one at a time in client-id order (as the key server makes them) give the same side
    ordered = sorted(_key_servers_parts(aggregate, updates), key=lambda p: p.client_id)
    lazy = recompute_plain_side(public, aggregate, iter(ordered), min_encryptors=k)
    assert lazy.fold == side.fold and np.array_equal(lazy.plain_sum, side.plain_sum)
    if len(ordered) > 1:
        with pytest.raises(ProtocolError, match="out of client-id order"):
            recompute_plain_side(public, aggregate, iter(ordered[::-1]), min_encryptors=k)
    # one plaintext value changed by the coordinator is seen by the key server
    plain = next((u for u in updates if u.plaintext.size), None)
    if plain is not None:
        parts = _key_servers_parts(aggregate, updates)
        i = next(i for i, p in enumerate(parts) if p.client_id == plain.client_id)
        bent = parts[i].plaintext.copy()
        bent[0] += np.float32(-0.5 if bent[0] > 0 else 0.5)  # (inside every clip range)
        parts[i] = PlainContribution(parts[i].client_id, parts[i].n_samples, parts[i].mask, parts[i].withheld, bent)
        other = recompute_plain_side(public, aggregate, parts, min_encryptors=k)
        differs = other.fold != side.fold or not np.array_equal(other.plain_sum, side.plain_sum) or (
            side.thin_sum is not None and not np.array_equal(other.thin_sum, side.thin_sum))
        assert differs


def test_a_shared_mask_aggregate_folds_nothing_and_a_bad_part_is_one_sentence():
    """``masked`` (shared masks, every contributor masks every position): the recomputed fold
    is empty whatever the values; a part whose values do not fit its mask is refused."""
    public = _secret("masked").public_key
    size = 12
    updates = [protect_update(np.full(size, 0.25 * (i + 1)), np.ones(size, bool),
                              public.for_contributor(AGENTS[i].exchange, b"ctx"), client_id=f"c{i}", round=1,
                              cluster=0, n_samples=5) for i in range(3)]
    aggregate = aggregate_updates(updates, public, round=1, cluster=0)
    parts = _key_servers_parts(aggregate, updates)
    side = recompute_plain_side(public, aggregate, parts)
    assert side.fold == b"" == public.plain_fold(aggregate.ciphertext) and side.plain_sum.size == 0
    wrong = PlainContribution("c0", 5, np.zeros(size, bool), None, np.zeros(size - 1, np.float32))
    with pytest.raises(ProtocolError, match="The plaintext part of 'c0' has 11 plaintext values; its masks leave 12"):
        recompute_plain_side(public, aggregate, [wrong, *parts[1:]])
