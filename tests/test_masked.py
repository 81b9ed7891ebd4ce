"""The masked scheme (issue 22): one-time pads agreed with the key server, sums modulo 2^64
or 2^32 (the ring a job's round chose, ``ring_bits``).

Properties against brute force (integers), in both rings: whatever values in range, weights
and subset of contributors, unmasking the coordinator's sum gives exactly Σ w · round(x · 2^f)
(f = 24 in the 64-bit ring, 15 in the 32-bit ring, whose values are clipped to ±1). Every
aggregate that is not the sum of exactly the named contributions is refused; what the
coordinator holds of one contribution is uniform noise, fresh every round.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError
from senseshield.he import SCHEMES, generate_keys
from senseshield.he.base import CipherPart, PlainPart, round_context
from senseshield.he.masked import (
    FRACTION_BITS,
    MAX_TOTAL_WEIGHT,
    RING32,
    RINGS,
    VALUE_LIMIT,
    ClippingWarning,
    MaskedPublicKey,
    choose_ring,
    ring_of,
    decode,
    encode,
)
from senseshield.runtime.identity import Identity

SECRET = generate_keys("masked")
PUBLIC = SECRET.public_key
AGENTS = [Identity.generate(f"c{i:03d}") for i in range(5)]
CONTEXT = round_context("fleet", "run-1", 3, 0)


def _mask(agent: Identity, values, positions, context=CONTEXT, bits=64):  # noqa: ANN001, ANN202
    return PUBLIC.for_contributor(agent.exchange, context, ring_bits=bits).encrypt(np.asarray(values, float),
                                                                                    np.asarray(positions))


def _unmask(vector, named, context=CONTEXT) -> np.ndarray:  # noqa: ANN001
    SECRET.bind_contributions(vector, [(AGENTS[i].box_key, w) for i, w in named], context)
    return SECRET.decrypt(vector)


def _fixed(x, bits=64) -> np.ndarray:  # noqa: ANN001
    """Brute force: the integer fixed-point encoding, one value at a time."""
    ring = RINGS[bits]
    return np.array([round(max(-ring.value_limit, min(ring.value_limit, float(v))) * 2**ring.fraction_bits) if ring.clips
                     else round(float(v) * 2**ring.fraction_bits) for v in x], dtype=object)


values = {64: st.lists(st.floats(-VALUE_LIMIT + 1, VALUE_LIMIT - 1, allow_nan=False), min_size=1, max_size=40),
          32: st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=40)}
spread = {64: 100.0, 32: 1.0}  # the values' range in the subset property (32: the clip)


@pytest.mark.parametrize("bits", [64, 32])
@given(data=st.data(), n=st.integers(1, 40), subset=st.sets(st.integers(0, 4), min_size=1),
       weights=st.lists(st.integers(1, 5000), min_size=5, max_size=5))
@settings(max_examples=60, deadline=None)
def test_any_subset_unmasks_to_the_exact_weighted_fixed_point_sum(bits, data, n, subset, weights):
    xs = {i: np.array(data.draw(st.lists(st.floats(-spread[bits], spread[bits], allow_nan=False), min_size=n,
                                         max_size=n)))
          for i in subset}
    positions = np.arange(n)
    aggregate = PUBLIC.aggregate([CipherPart(_mask(AGENTS[i], xs[i], positions, bits=bits), weights[i])
                                  for i in sorted(subset)], positions)
    got = _unmask(aggregate, [(i, weights[i]) for i in sorted(subset)])
    expected = sum(weights[i] * _fixed(xs[i], bits) for i in subset)
    assert [int(round(g * 2**RINGS[bits].fraction_bits)) for g in got] == list(expected)


@pytest.mark.parametrize("bits", [64, 32])
@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_mask_then_unmask_round_trips_every_value_in_range(bits, data):
    x = data.draw(values[bits])
    positions = np.arange(len(x))
    vector = _mask(AGENTS[0], x, positions, bits=bits)
    assert vector.payload.dtype == RINGS[bits].dtype
    got = _unmask(PUBLIC.aggregate([CipherPart(vector, 1)], positions), [(0, 1)])
    assert np.array_equal(decode(encode(np.array(x), RINGS[bits])), got)
    assert np.max(np.abs(got - x)) <= 2.0 ** -(RINGS[bits].fraction_bits + 1)


def test_the_streaming_sum_does_not_depend_on_arrival_order_and_plaintext_parts_add_in():
    positions = np.arange(6)
    parts = [CipherPart(_mask(AGENTS[i], np.full(6, 0.25 * i), positions), i + 1) for i in range(3)]
    plain = PlainPart(np.arange(10), np.linspace(-1, 1, 10), 7)  # only positions 0..5 are used
    a, b = PUBLIC.accumulator(10), PUBLIC.accumulator(10)
    for part in [*parts, plain]:
        a.add(part)
    for part in [plain, *reversed(parts)]:
        b.add(part)
    va, vb = a.result(positions), b.result(positions)
    assert np.array_equal(va.payload, vb.payload)
    got = _unmask(va, [(0, 1), (1, 2), (2, 3)])
    assert np.allclose(got, sum((i + 1) * 0.25 * i for i in range(3)) + 7 * np.linspace(-1, 1, 10)[:6], atol=1e-6)


@pytest.mark.parametrize("bits", [64, 32])
@pytest.mark.parametrize("forgery", ["one left out", "one unnamed added", "a word altered", "another round",
                                     "another cluster", "weights changed"])
def test_an_aggregate_that_is_not_the_named_sum_is_refused(forgery, bits):
    positions = np.arange(2000)
    rng = np.random.default_rng(1)
    xs = [rng.normal(0, 0.01, positions.size) for _ in range(3)]
    named = [(0, 10), (1, 20), (2, 30)]
    parts = [CipherPart(_mask(AGENTS[i], xs[i], positions, bits=bits), w) for i, w in named]
    if forgery == "one left out":
        parts = parts[:2]
    elif forgery == "one unnamed added":
        parts.append(CipherPart(_mask(AGENTS[3], xs[0], positions, bits=bits), 5))
    elif forgery == "another round":
        parts[1] = CipherPart(_mask(AGENTS[1], xs[1], positions, round_context("fleet", "run-1", 2, 0), bits), 20)
    elif forgery == "another cluster":
        parts[1] = CipherPart(_mask(AGENTS[1], xs[1], positions, round_context("fleet", "run-1", 3, 1), bits), 20)
    elif forgery == "weights changed":
        parts[2] = CipherPart(parts[2].vector, 31)
    aggregate = PUBLIC.aggregate(parts, positions)
    if forgery == "a word altered":
        aggregate.payload[17] += RINGS[bits].dtype(1 << (bits - 2))  # (a small change: the fingerprints)
    with pytest.raises(ProtocolError, match="not the sum of exactly the named contributions"):
        _unmask(aggregate, named)
    # the honest aggregate goes through
    honest = PUBLIC.aggregate([CipherPart(_mask(AGENTS[i], xs[i], positions, bits=bits), w) for i, w in named], positions)
    assert np.allclose(_unmask(honest, named), sum(w * xs[i] for i, w in named),
                       atol=60 * 2.0 ** -RINGS[bits].fraction_bits)


def test_overflow_is_refused_before_it_can_happen():
    with pytest.raises(ValueError, match=r"Value 4096.0 at index 1 is outside the masked encoding's range \|x\| < 4096"):
        _mask(AGENTS[0], [0.0, 4096.0], [0, 1])
    positions = np.arange(4)
    vector = _mask(AGENTS[0], np.zeros(4), positions)
    with pytest.raises(ProtocolError, match=f"above the 64-bit masked head-room's remaining weight .*{MAX_TOTAL_WEIGHT}"):
        PUBLIC.aggregate([CipherPart(vector, MAX_TOTAL_WEIGHT + 1)], positions)
    with pytest.raises(ProtocolError, match="Part 1 has weight 33554432, above .* 33554431"):  # the sum would reach it
        PUBLIC.aggregate([CipherPart(vector, MAX_TOTAL_WEIGHT // 2)] * 2, positions)
    aggregate = PUBLIC.aggregate([CipherPart(vector, 1)], positions)
    with pytest.raises(ProtocolError, match="allows fewer than 67108864"):  # named weights beyond it
        _unmask(aggregate, [(0, MAX_TOTAL_WEIGHT // 2), (0, MAX_TOTAL_WEIGHT // 2)])


def test_the_32_bit_ring_clips_to_one_and_refuses_what_would_overflow_its_words():
    """The 32-bit ring's head-room: |enc(x)| <= 2^15 (x clipped to [-1, 1], counted) times a
    total weight below 2^16 stays below 2^31; beyond it a part is refused alone, and the key
    server refuses named weights beyond it."""
    positions = np.arange(4)
    with pytest.warns(ClippingWarning, match="2 of 4 values .* were clipped"):
        vector = _mask(AGENTS[0], [0.5, -3.0, 7.0, 1.0], positions, bits=32)
    assert list(_unmask(PUBLIC.aggregate([CipherPart(vector, 1)], positions), [(0, 1)])) == [0.5, -1.0, 1.0, 1.0]
    limit = RING32.max_total_weight
    full = _mask(AGENTS[0], np.ones(4), positions, bits=32)  # the largest word, 2^15, everywhere
    got = _unmask(PUBLIC.aggregate([CipherPart(full, limit - 1)], positions), [(0, limit - 1)])
    assert list(got) == [float(limit - 1)] * 4  # the largest genuine sum reads back exactly: no overflow
    with pytest.raises(ProtocolError, match=f"above the 32-bit masked head-room's remaining weight .*{limit}"):
        PUBLIC.aggregate([CipherPart(full, limit)], positions)
    with pytest.raises(ProtocolError, match="Part 1 has weight 2, above"):
        PUBLIC.aggregate([CipherPart(full, limit - 2), CipherPart(full, 2)], positions)
    with pytest.raises(ProtocolError, match="32-bit masked encoding's head-room allows fewer than 65536"):
        _unmask(PUBLIC.aggregate([CipherPart(full, 1)], positions), [(0, limit // 2), (0, limit // 2)])


def test_the_ring_is_chosen_from_the_job_option_the_cluster_weight_and_the_strategy():
    assert choose_ring("auto", 65_535) == 32 and choose_ring("auto", 65_536) == 64
    assert choose_ring("auto", 10, bounded=False) == 64  # noise shares (masked-dp) are not clipped
    assert choose_ring(64, 10) == 64 and choose_ring("32", 10**6) == 32  # forced (over-weight parts are refused)
    with pytest.raises(ConfigError, match=r"^ring_bits=16 is not allowed; use auto, 32 or 64\.$"):
        choose_ring(16, 10)
    with pytest.raises(ConfigError, match="ring_bits=32 is not allowed for a strategy that adds noise"):
        choose_ring(32, 10, bounded=False)
    from senseshield.strategies import STRATEGIES, StrategyOptions

    masked = STRATEGIES.get("masked")(StrategyOptions())
    assert masked.ring_bits([60] * 1000) == 32 and masked.ring_bits([66] * 1000) == 64
    assert STRATEGIES.get("masked-dp")(StrategyOptions()).ring_bits([60] * 1000) == 64
    assert STRATEGIES.get("masked")(StrategyOptions(ring_bits=64)).ring_bits([1]) == 64
    with pytest.raises(ValueError, match="ring_bits='huge' is not allowed; use auto, 32 or 64"):
        StrategyOptions(ring_bits="huge")  # (pydantic wraps the sentence)


def test_parts_of_two_rings_or_a_wrong_length_are_refused_with_one_sentence():
    positions = np.arange(8)
    v32, v64 = _mask(AGENTS[0], np.zeros(8), positions, bits=32), _mask(AGENTS[1], np.zeros(8), positions)
    with pytest.raises(ProtocolError, match=r"^Part 1 is masked modulo 2\^64; the aggregate's other parts are modulo "
                                            r"2\^32, and every part of one aggregate must be in one ring\.$"):
        PUBLIC.aggregate([CipherPart(v32, 1), CipherPart(v64, 1)], positions)
    data = PUBLIC.ciphertext_bytes(v32)
    assert len(data) == 25 + 16 + 4 * 8  # header, one run, 4 bytes a word
    back = PUBLIC.vector_from_bytes(data)
    assert back.payload.dtype == np.uint32 and np.array_equal(back.payload, v32.payload)
    assert back.meta["ring_bits"] == 32
    as64 = data[:4] + bytes([1]) + data[5:]  # the same words announced as the 64-bit ring
    with pytest.raises(ProtocolError, match=r"^Masked vector has 73 bytes; its header announces 105 \(8 words of 8 "
                                            r"bytes, the 64-bit ring\)\.$"):
        PUBLIC.vector_from_bytes(as64)
    with pytest.raises(ConfigError, match="ring_bits=16 is not allowed"):
        PUBLIC.for_contributor(AGENTS[0].exchange, CONTEXT, ring_bits=16)


def test_the_coordinators_view_is_uniform_noise_fresh_every_round():
    positions = np.arange(20_000)
    signal = np.sin(np.arange(20_000) / 50.0)  # a strongly structured update
    for x in (np.zeros(20_000), signal):
        words = _mask(AGENTS[0], x, positions).payload
        top = (words >> np.uint64(56)).astype(np.int64)  # the top byte of every word
        assert stats.chisquare(np.bincount(top, minlength=256)).pvalue > 1e-4
        assert abs(np.corrcoef(words[:-1].astype(np.float64), words[1:].astype(np.float64))[0, 1]) < 0.03
        assert abs(np.corrcoef(decode(words), x + 1e-12 * positions)[0, 1]) < 0.03  # nothing of x shows
    again = _mask(AGENTS[0], signal, positions, round_context("fleet", "run-1", 4, 0)).payload
    assert np.mean(again == _mask(AGENTS[0], signal, positions).payload) < 1e-3  # new pads each round


def test_the_wire_format_round_trips_and_bad_input_is_one_sentence():
    positions = np.array([0, 1, 2, 7, 8, 20])
    vector = _mask(AGENTS[0], np.linspace(-1, 1, 6), positions)
    data = PUBLIC.ciphertext_bytes(vector)
    assert len(data) == 25 + 16 * 3 + 8 * 6  # header, three runs of positions, one word each
    back = PUBLIC.vector_from_bytes(data)
    assert np.array_equal(back.positions, positions) and np.array_equal(back.payload, vector.payload)
    full = _mask(AGENTS[0], np.zeros(50_826), np.arange(50_826))
    assert len(PUBLIC.ciphertext_bytes(full)) / 50_826 < 8.001  # 8 bytes per parameter
    full32 = _mask(AGENTS[0], np.zeros(50_826), np.arange(50_826), bits=32)
    assert len(PUBLIC.ciphertext_bytes(full32)) / 50_826 < 4.001  # 4 bytes per parameter
    with pytest.raises(ProtocolError, match="shorter than its header"):
        PUBLIC.vector_from_bytes(data[:10])
    with pytest.raises(ProtocolError, match="its header announces"):
        PUBLIC.vector_from_bytes(data[:-1])
    with pytest.raises(KeyMismatchError, match="not the current key"):
        generate_keys("masked").public_key.vector_from_bytes(data)
    with pytest.raises(ConfigError, match="bind the key with for_contributor"):
        PUBLIC.encrypt(np.zeros(2), np.arange(2))
    with pytest.raises(ProtocolError, match="must not"):
        MaskedPublicKey.from_bytes(b'{"scheme": "masked", "box": "00", "fraction_bits": 24, "secret": "x"}')
    assert SCHEMES.get("masked").public_key_from_bytes(PUBLIC.to_bytes()).key_id == PUBLIC.key_id


def test_the_key_server_and_the_agent_derive_the_same_pads_and_nobody_else_does():
    positions = np.arange(100)
    vector = _mask(AGENTS[0], np.zeros(100), positions)
    # the agent's identity and the key server's secret agree; another identity's pads do not
    assert np.allclose(_unmask(PUBLIC.aggregate([CipherPart(vector, 1)], positions), [(0, 1)]), 0.0)
    with pytest.raises(ProtocolError, match="not the sum"):
        _unmask(PUBLIC.aggregate([CipherPart(vector, 1)], positions), [(1, 1)])
    # the secret key is only serialised when asked to
    with pytest.raises(Exception, match="include_secret=True"):
        SECRET.to_bytes()
    assert SCHEMES.get("masked").secret_key_from_bytes(SECRET.to_bytes(include_secret=True)).public_key.key_id == PUBLIC.key_id


@given(data=st.data(), n=st.integers(1, 30), agents=st.integers(1, 5), k=st.integers(1, 3),
       ring_bits=st.sampled_from([32, 64]))
@settings(max_examples=60, deadline=None)
def test_ragged_masks_with_the_k_rule_match_brute_force(data, n, agents, k, ring_bits):
    """SenseCrypt over `masked` (issue 22): each agent masks its own positions and sends the
    rest in plaintext; the coordinator's ragged sum, unmasked by the key server where at
    least k agents masked, gives per position the weighted mean of every sender; where 1..k-1
    masked, the plaintext senders' mean alone (0 if none): brute force, value by value."""
    from senseshield.engine.aggregation import aggregate_updates, decrypt_aggregate, protect_update

    key = PUBLIC.for_masks(True)
    assert key.ragged_masks and not PUBLIC.ragged_masks
    masks = [np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n))) for _ in range(agents)]
    bound = 100.0 if ring_bits == 64 else 1.0  # the 32-bit ring clips to [-1, 1]
    xs = [np.array(data.draw(st.lists(st.floats(-bound, bound, allow_nan=False), min_size=n, max_size=n)))
          for _ in range(agents)]
    weights = data.draw(st.lists(st.integers(1, 5000 if ring_bits == 64 else 10), min_size=agents, max_size=agents))
    ring = ring_of(ring_bits)
    updates = [protect_update(xs[i], masks[i], key.for_contributor(AGENTS[i].exchange, CONTEXT, ring_bits=ring_bits),
                              client_id=f"c{i}",
                              round=3, cluster=0, n_samples=weights[i]) for i in range(agents)]
    aggregate = aggregate_updates(updates, key, round=3, cluster=0, min_encryptors=k, streaming=data.draw(st.booleans()))
    if aggregate.ciphertext is not None:
        SECRET.bind_contributions(aggregate.ciphertext, [(AGENTS[i].box_key, weights[i]) for i in range(agents)],
                                  CONTEXT, masks=[aggregate.masks[f"c{i}"] for i in range(agents)])
    got = decrypt_aggregate(aggregate, SECRET)
    for j in range(n):
        maskers = [i for i in range(agents) if masks[i][j]]
        plain = [i for i in range(agents) if not masks[i][j]]
        senders = plain if 0 < len(maskers) < k else range(agents)
        value = lambda i: (float(decode(encode(np.array([xs[i][j]]), ring))[0]) if masks[i][j]  # noqa: E731
                           else float(np.float32(xs[i][j])))
        den = sum(weights[i] for i in senders)
        want = sum(weights[i] * value(i) for i in senders) / den if den else 0.0
        assert got[j] == pytest.approx(want, abs=1e-6 if ring_bits == 64 else 1e-4), (j, maskers, k)


@pytest.mark.parametrize("ragged", [False, True])
def test_unmasking_on_several_processes_gives_the_same_sum(ragged):
    """The key server spreads the contributors' pads over processes (``threads``): the same
    words, bit for bit, as on one, with shared and with per-client masks."""
    from senseshield.he.masked import PADS_PER_PROCESS

    n, size = 2 * PADS_PER_PROCESS + 3, 50
    agents = [Identity.generate(f"p{i:03d}") for i in range(n)]
    rng = np.random.default_rng(5)
    key = PUBLIC.for_masks(ragged)
    positions = np.arange(size)
    masks = [np.packbits(rng.random(size) < 0.7) if ragged else None for _ in range(n)]
    total = None
    for i, agent in enumerate(agents):
        where = np.flatnonzero(np.unpackbits(masks[i])[:size]) if ragged else positions
        words = np.zeros(size, dtype=np.uint64)
        part = key.for_contributor(agent.exchange, CONTEXT).encrypt(rng.uniform(-1, 1, where.size), where)
        words[where] = np.asarray(part.payload) * np.uint64(i % 3 + 1)
        total = words if total is None else total + words
    from senseshield.he.base import EncryptedVector

    results = []
    for threads in (1, 2):
        vector = EncryptedVector("masked", PUBLIC.key_id, positions, total.copy(), total.nbytes)
        SECRET.bind_contributions(vector, [(a.box_key, i % 3 + 1) for i, a in enumerate(agents)], CONTEXT,
                                  masks=masks if ragged else None)
        results.append(SECRET.decrypt(vector, threads=threads))
    assert results[0].tobytes() == results[1].tobytes()
    assert np.all(np.abs(results[0]) <= sum(i % 3 + 1 for i in range(n)))


def test_pad_workers_end_with_the_process_that_started_them(tmp_path):
    """A key server stopped on a signal leaves with ``os._exit`` (no clean-up): its pad
    processes see it gone and end too, instead of staying behind."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = (
        "import os, sys\n"
        "from senseshield.he import generate_keys\n"
        "from senseshield.he.masked import _pad_pool\n"
        "pool = _pad_pool(generate_keys('masked')._export(), 2)\n"
        "assert pool.submit(int, 1).result() == 1\n"
        "open(sys.argv[1], 'w').write(' '.join(str(p) for p in pool._processes))\n"
        "os._exit(0)\n"
    )
    log, found = tmp_path / "out.txt", tmp_path / "pids.txt"
    # the pids go to a file of their own: what else lands in the log (the resource tracker's
    # note on the pool's semaphores, written once the process is gone) comes when it comes
    with log.open("w") as out:  # a file: the workers inherit it, and a pipe would wait for them
        subprocess.run([sys.executable, "-c", script, str(found)], stdout=out, stderr=subprocess.STDOUT,
                       timeout=120, check=True)
    pids = [int(p) for p in found.read_text().split()]
    assert pids, log.read_text()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"

    end = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "pad workers outlived their key server"
