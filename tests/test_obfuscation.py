"""Fixed-base short-exponent obfuscators and the background obfuscator pool."""

from __future__ import annotations

import random
import threading
import time
import warnings

import gmpy2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.errors import ConfigError
from senseshield.he.obfuscation import (
    FixedBaseTable,
    ObfuscatorPool,
    ShortExponentWarning,
    default_exponent_bits,
    random_exponent,
)
from senseshield.he.packed import PackedPaillierScheme
from senseshield.he.paillier import InsecureKeyWarning

pytestmark = pytest.mark.filterwarnings("ignore::senseshield.he.paillier.InsecureKeyWarning")

# A fixed 1024-bit-ish modulus is enough to test the arithmetic (no key needed).
_P = int(gmpy2.next_prime(2**511 + 12345))
_Q = int(gmpy2.next_prime(2**511 + 987654321))
_N = _P * _Q
_NSQUARE = _N * _N
_BASE = int(gmpy2.powmod(7, _N, _NSQUARE))


@pytest.fixture(scope="module")
def table() -> FixedBaseTable:
    return FixedBaseTable(_BASE, _NSQUARE, exponent_bits=512, window_bits=5)


@settings(max_examples=60, deadline=None)
@given(exponent=st.integers(0, 2**512 - 1))
def test_table_power_matches_powmod(table: FixedBaseTable, exponent: int) -> None:
    assert table.pow(exponent) == gmpy2.powmod(_BASE, exponent, _NSQUARE)


@pytest.mark.parametrize("exponent", [0, 1, 2**5 - 1, 2**5, 2**511, 2**512 - 1])
def test_table_power_edges(table: FixedBaseTable, exponent: int) -> None:
    assert table.pow(exponent) == gmpy2.powmod(_BASE, exponent, _NSQUARE)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_sizes_agree(window: int) -> None:
    t = FixedBaseTable(_BASE, _NSQUARE, exponent_bits=100, window_bits=window)
    assert t.windows == -(-100 // window)
    for e in (0, 1, 2**100 - 1, 0x123456789ABCDEF):
        assert t.pow(e) == gmpy2.powmod(_BASE, e, _NSQUARE)


def test_table_rejects_out_of_range_exponents(table: FixedBaseTable) -> None:
    with pytest.raises(ValueError):
        table.pow(2**512)
    with pytest.raises(ValueError):
        table.pow(-1)
    with pytest.raises(TypeError):
        table.pow(1.5)  # type: ignore[arg-type]


def test_table_parameters_are_validated() -> None:
    with pytest.raises(ConfigError):
        FixedBaseTable(_BASE, _NSQUARE, exponent_bits=0)
    with pytest.raises(ConfigError):
        FixedBaseTable(_BASE, _NSQUARE, exponent_bits=64, window_bits=17)
    with pytest.raises(ConfigError):
        FixedBaseTable(0, _NSQUARE, exponent_bits=64)


def test_random_powers_use_the_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exponent comes from `secrets`; seeding `random` must not make it repeat."""
    t = FixedBaseTable(_BASE, _NSQUARE, exponent_bits=128, window_bits=4)
    random.seed(1)
    first = t.random_power()
    random.seed(1)
    second = t.random_power()
    assert first != second
    bits = [random_exponent(128).bit_length() for _ in range(50)]
    assert max(bits) <= 128 and max(bits) >= 120


def test_default_exponent_is_half_the_modulus() -> None:
    assert default_exponent_bits(2048) == 1024
    assert default_exponent_bits(1024) == 512


def test_short_exponent_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        key = PackedPaillierScheme.generate(key_bits=512, exponent_bits=128)
    assert any(issubclass(w.category, ShortExponentWarning) for w in caught)
    assert key.public_key.exponent_bits == 128
    with pytest.raises(ConfigError):
        PackedPaillierScheme.generate(key_bits=512, exponent_bits=16)
    assert issubclass(ShortExponentWarning, InsecureKeyWarning)


# -- the pool ---------------------------------------------------------------------------


class _Counter:
    def __init__(self, delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.value = 0
        self.delay = delay

    def __call__(self) -> int:
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.value += 1
            return self.value


def test_pool_fills_in_the_background_and_is_bounded() -> None:
    produce = _Counter()
    pool: ObfuscatorPool[int] = ObfuscatorPool(produce, capacity=16)
    with pool:
        assert pool.running
        assert pool.wait_until(16, timeout=5.0)
        time.sleep(0.05)
        assert len(pool) == 16  # never more than the capacity
        items = pool.take(10)
    assert not pool.running
    assert len(items) == 10 and len(set(items)) == 10  # each obfuscator is handed out once
    assert pool.misses == 0 and pool.served == 10


def test_pool_computes_inline_and_counts_misses_when_empty() -> None:
    produce = _Counter()
    pool: ObfuscatorPool[int] = ObfuscatorPool(produce, capacity=4)
    pool.fill(3)  # synchronous, no thread
    items = pool.take(7)
    assert len(items) == 7 and len(set(items)) == 7
    assert pool.served == 3 and pool.misses == 4
    assert pool.stats()["misses"] == 4
    assert pool.take(0) == []
    with pytest.raises(ValueError):
        pool.take(-1)


def test_pool_refills_after_take_and_stops_promptly() -> None:
    pool: ObfuscatorPool[int] = ObfuscatorPool(_Counter(delay=0.001), capacity=8).start()
    try:
        assert pool.wait_until(8, timeout=5.0)
        pool.take(8)
        assert pool.wait_until(8, timeout=5.0)  # refilled
    finally:
        started = time.perf_counter()
        pool.stop()
        assert time.perf_counter() - started < 2.0
    assert not pool.running
    pool.start()  # restartable
    assert pool.running
    pool.stop()


def test_pool_paused_does_not_fill_and_resumes() -> None:
    """A device's round pauses the pool (its CPU is the round's); take still serves and
    computes the rest inline; resume refills."""
    produce = _Counter()
    pool: ObfuscatorPool[int] = ObfuscatorPool(produce, capacity=8).start()
    try:
        assert pool.wait_until(8, timeout=5.0)
        pool.pause()
        assert pool.paused
        assert len(pool.take(10)) == 10 and pool.served == 8 and pool.misses == 2
        assert not pool.wait_until(1, timeout=5.0)  # paused: no waiting for what will not come
        time.sleep(0.2)  # a running filler refills 8 in well under a millisecond
        assert len(pool) == 0 and pool.produced == 8
        pool.resume()
        assert pool.wait_until(8, timeout=5.0) and pool.produced == 16
    finally:
        pool.stop()


def test_pool_surfaces_producer_errors() -> None:
    calls = {"n": 0}

    def produce() -> int:
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("boom")
        return calls["n"]

    pool: ObfuscatorPool[int] = ObfuscatorPool(produce, capacity=10).start()
    deadline = time.monotonic() + 5
    while pool.running and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="boom"):
        pool.take(1)
    pool.stop()


def test_pool_validates_its_arguments() -> None:
    with pytest.raises(ConfigError):
        ObfuscatorPool(_Counter(), capacity=0)
    with pytest.raises(ConfigError):
        ObfuscatorPool(42, capacity=1)  # type: ignore[arg-type]


def test_pool_is_thread_safe_under_concurrent_takes() -> None:
    pool: ObfuscatorPool[int] = ObfuscatorPool(_Counter(), capacity=32).start()
    results: list[list[int]] = []
    lock = threading.Lock()

    def worker() -> None:
        got = pool.take(50)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.stop()
    flat = [x for r in results for x in r]
    assert len(flat) == 200 and len(set(flat)) == 200
    assert pool.served + pool.misses == 200
