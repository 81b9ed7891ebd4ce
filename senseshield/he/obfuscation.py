"""Fast Paillier obfuscators: short exponents over a fixed base, and a background pool.

What makes stock Paillier encryption slow is the obfuscator ``r^n mod n^2``: a 2048-bit
exponent modulo a 4096-bit number (about 8 ms here, see ``senseshield bench he``).

Short-exponent obfuscation (Damgard, Jurik and Nielsen)
-------------------------------------------------------
The key server draws a random unit ``x`` of ``Z_n``, sets ``h = -x^2 mod n`` and publishes
``h_s = h^n mod n^2`` with the public key. A client's obfuscator is ``h_s^a mod n^2`` for a
fresh exponent ``a`` drawn uniformly from ``[0, 2^exponent_bits)`` with :mod:`secrets` (the
operating system's CSPRNG). It is an ``n``-th residue like ``r^n`` (``h_s^a = (h^a)^n``), so
decryption is unchanged; semantic security rests on DCRA plus the assumption that such
short powers of ``h_s`` are indistinguishable from random ``n``-th residues (DJN, "A
generalization of Paillier's public-key system with applications to electronic voting",
Int. J. Inf. Secur. 2010).

Exponent length: :data:`DEFAULT_EXPONENT_BITS_FRACTION` = 1/2 of the modulus length, i.e. a
1024-bit ``a`` for a 2048-bit ``n``. That is what DJN use (``r`` of ``ceil(k/2)`` bits for a
``k``-bit modulus) and what the published implementations use (e.g. SecretFlow HEU's
Damgard-Jurik: ``r <- {0,1}^{ceil(k/2)}``). Shorter exponents are accepted down to
:data:`MIN_EXPONENT_BITS` but emit a :class:`ShortExponentWarning`: they are not covered by
those parameter choices.

Fixed-base window table
-----------------------
Because the base is fixed per key, :class:`FixedBaseTable` precomputes
``T[i][d] = h_s^(d * 2^(w*i)) mod n^2`` for every window ``i`` of ``w`` = ``window_bits``
bits and every digit ``d < 2^w``. Then ``h_s^a`` is the product of one entry per window of
``a``: ``ceil(exponent_bits / w) - 1`` multiplications modulo ``n^2`` and no squaring.
For a 2048-bit key and the default ``w`` = :data:`DEFAULT_WINDOW_BITS` = 10 that is 102
multiplications (~0.5 ms here, against ~8 ms for ``r^n``) and a table of
``102 * 1024 + 16`` entries of 512 bytes (~54 MB, built in ~0.5 s once per key and process).
``w`` = 8 needs ~17 MB and 127 multiplications (~13 % slower encryption without a pool);
choose it on memory-poor devices (``PackedPaillierPublicKey.window_bits``).

Obfuscator pool
---------------
:class:`ObfuscatorPool` fills a bounded queue of obfuscators in a daemon thread (start it
when the agent starts training) so that encryption on the critical path only multiplies:
``E(m) = (1 + m n) * obfuscator mod n^2``. :meth:`ObfuscatorPool.take` returns precomputed
obfuscators and computes the missing ones inline when the pool runs dry, counting them as
``misses``. Each obfuscator is handed out once (it is removed from the queue).

GIL: gmpy2 does not release the GIL for a 4096-bit multiplication, so the filling thread
competes with pure-Python work in the main thread; it runs in parallel with the C parts of
training (PyTorch, NumPy), which release the GIL.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import gmpy2

from senseshield.errors import ConfigError
from senseshield.he.paillier import InsecureKeyWarning

__all__ = [
    "DEFAULT_EXPONENT_BITS_FRACTION",
    "DEFAULT_POOL_CAPACITY",
    "DEFAULT_WINDOW_BITS",
    "MAX_WINDOW_BITS",
    "MIN_EXPONENT_BITS",
    "FixedBaseTable",
    "ObfuscatorPool",
    "ShortExponentWarning",
    "default_exponent_bits",
    "random_exponent",
]

DEFAULT_EXPONENT_BITS_FRACTION = 0.5
"""Default exponent length as a fraction of the modulus length (DJN; SecretFlow HEU)."""
MIN_EXPONENT_BITS = 64
"""Shortest exponent accepted at all (tests only; anything below the default warns)."""
DEFAULT_WINDOW_BITS = 10
"""Window of the fixed-base table: 2048-bit key -> ~57 MB, 102 multiplications per power."""
MAX_WINDOW_BITS = 16
DEFAULT_POOL_CAPACITY = 1024
"""Obfuscators kept ready (512 bytes each for a 2048-bit key)."""

T = TypeVar("T")


class ShortExponentWarning(InsecureKeyWarning):
    """Obfuscator exponents shorter than half the modulus length were requested."""


def default_exponent_bits(key_bits: int) -> int:
    """Half the modulus length, rounded up: 1024 for a 2048-bit ``n``."""
    return int(math.ceil(key_bits * DEFAULT_EXPONENT_BITS_FRACTION))


def random_exponent(bits: int) -> int:
    """Uniform integer in ``[0, 2^bits)`` from the operating system's CSPRNG."""
    return secrets.randbits(bits)


class FixedBaseTable:
    """Powers ``base^a mod modulus`` for ``a < 2^exponent_bits`` by table look-ups.

    ``rows[i][d] = base^(d * 2^(window_bits * i)) mod modulus``. Read-only after
    construction, so one table can serve several threads.
    """

    def __init__(
        self,
        base: int,
        modulus: int,
        exponent_bits: int,
        window_bits: int = DEFAULT_WINDOW_BITS,
    ) -> None:
        for name, value in (("exponent_bits", exponent_bits), ("window_bits", window_bits)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if window_bits > MAX_WINDOW_BITS:
            raise ConfigError(
                f"window_bits is {window_bits}; the table would hold 2^{window_bits} entries per "
                f"window. Choose 1..{MAX_WINDOW_BITS} (default {DEFAULT_WINDOW_BITS})."
            )
        modulus = gmpy2.mpz(modulus)
        base = gmpy2.mpz(base) % modulus
        if modulus < 3 or base == 0:
            raise ConfigError("A fixed-base table needs a modulus >= 3 and a non-zero base.")
        started = time.perf_counter()
        self._modulus = modulus
        self._exponent_bits = exponent_bits
        self._window_bits = window_bits
        windows = -(-exponent_bits // window_bits)
        self._shifts = [window_bits * i for i in range(windows)]
        self._mask = (1 << window_bits) - 1
        one = gmpy2.mpz(1)
        rows: list[list[Any]] = []
        step = base  # base^(2^(w*i)) for the current window i
        for i in range(windows):
            width = min(window_bits, exponent_bits - window_bits * i)  # last window: the rest
            row = [one, step]
            acc = step
            for _d in range(2, 1 << width):
                acc = acc * step % modulus
                row.append(acc)
            rows.append(row)
            if i + 1 < windows:
                step = acc * step % modulus  # base^(2^w * 2^(w*i))
        self._rows = rows
        self.build_seconds = time.perf_counter() - started

    @property
    def exponent_bits(self) -> int:
        return self._exponent_bits

    @property
    def window_bits(self) -> int:
        return self._window_bits

    @property
    def windows(self) -> int:
        """Table rows, i.e. ``multiplications per power + 1``."""
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """Approximate memory of the table entries (numbers only)."""
        entry = (self._modulus.bit_length() + 7) // 8
        return sum(len(row) for row in self._rows) * entry

    def pow(self, exponent: int) -> Any:
        """``base^exponent mod modulus`` (an ``mpz``) for ``0 <= exponent < 2^exponent_bits``."""
        if isinstance(exponent, bool) or not isinstance(exponent, int):
            raise TypeError(f"exponent must be an int, got {type(exponent).__name__}.")
        if not 0 <= exponent < (1 << self._exponent_bits):
            raise ValueError(
                f"exponent has {exponent.bit_length()} bits; this table covers "
                f"[0, 2^{self._exponent_bits})."
            )
        mask, modulus = self._mask, self._modulus
        acc = None
        for row, shift in zip(self._rows, self._shifts):
            digit = (exponent >> shift) & mask
            if digit:
                acc = row[digit] if acc is None else acc * row[digit] % modulus
        return gmpy2.mpz(1) if acc is None else acc

    def random_power(self) -> Any:
        """``base^a mod modulus`` for a fresh ``a`` uniform in ``[0, 2^exponent_bits)``."""
        return self.pow(random_exponent(self._exponent_bits))


class ObfuscatorPool(Generic[T]):
    """Bounded queue of precomputed obfuscators, filled by a background daemon thread.

    ``produce`` makes one obfuscator (e.g. ``key.new_obfuscator``); ``owner`` names what the
    obfuscators belong to (a public key's id) so a key can refuse another key's pool.
    Thread-safe; :meth:`start` and :meth:`stop` may be called repeatedly, and the pool is a
    context manager (``with key.make_pool() as pool: ...`` starts and stops it).
    """

    def __init__(
        self,
        produce: Callable[[], T],
        *,
        capacity: int = DEFAULT_POOL_CAPACITY,
        owner: str | None = None,
        name: str = "senseshield-obfuscators",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be a positive integer, got {capacity!r}.")
        if not callable(produce):
            raise ConfigError("produce must be a callable returning one obfuscator.")
        self._produce = produce
        self._capacity = capacity
        self._name = name
        self.owner = owner
        self._queue: deque[T] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._paused = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.produced = 0
        """Obfuscators made by the background thread (or :meth:`fill`)."""
        self.served = 0
        """Obfuscators handed out by :meth:`take` from the queue."""
        self.misses = 0
        """Obfuscators :meth:`take` had to compute inline because the queue was empty."""

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> "ObfuscatorPool[T]":
        """Start the filling thread (no-op if it runs). Returns the pool."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stop = False
            self._error = None
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the filling thread to stop and wait for it (it finishes the obfuscator it is
        computing, at most a few milliseconds). Obfuscators already queued stay usable."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cond:
            if self._thread is thread and (thread is None or not thread.is_alive()):
                self._thread = None

    def pause(self) -> None:
        """Stop filling until :meth:`resume` (the thread finishes the obfuscator it is
        computing): a device's round keeps its CPU -- under a CPU quota the filling thread
        would take the round's share, and gmpy2 holds the GIL -- and the pool refills while
        the device waits. :meth:`take` still serves what is queued (and computes the rest)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Fill again after :meth:`pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def __enter__(self) -> "ObfuscatorPool[T]":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and (self._paused or len(self._queue) >= self._capacity):
                        self._cond.wait()
                    if self._stop:
                        return
                item = self._produce()
                with self._cond:
                    if len(self._queue) < self._capacity:
                        self._queue.append(item)
                        self.produced += 1
                        self._cond.notify_all()
        except BaseException as exc:  # surfaced by take(); the thread ends
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    # -- use ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        """Obfuscators ready now."""
        return len(self._queue)

    def take(self, count: int) -> list[T]:
        """``count`` obfuscators: queued ones first, the rest computed inline (``misses``)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}.")
        with self._cond:
            if self._error is not None:
                raise RuntimeError(
                    f"The obfuscator pool's thread failed: {self._error!r}"
                ) from self._error
            ready = min(count, len(self._queue))
            items = [self._queue.popleft() for _ in range(ready)]
            self.served += ready
            self.misses += count - ready
            self._cond.notify_all()
        items.extend(self._produce() for _ in range(count - ready))
        return items

    def fill(self, count: int | None = None) -> int:
        """Synchronously add obfuscators in the calling thread until ``count`` are queued
        (default: capacity). Returns how many are queued."""
        target = self._capacity if count is None else min(int(count), self._capacity)
        while True:
            with self._cond:
                if len(self._queue) >= target:
                    return len(self._queue)
            item = self._produce()
            with self._cond:
                if len(self._queue) < self._capacity:
                    self._queue.append(item)
                    self.produced += 1

    def wait_until(self, count: int, timeout: float | None = None) -> bool:
        """Block until at least ``min(count, capacity)`` obfuscators are queued (needs the
        thread running); ``False`` on timeout or if the thread is not running or paused."""
        target = min(int(count), self._capacity)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._queue) < target:
                if self._error is not None or not self.running or self._paused:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.5)
            return True

    def clear(self) -> None:
        """Drop every queued obfuscator (e.g. after the key changed)."""
        with self._cond:
            self._queue.clear()
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "ready": len(self._queue),
                "capacity": self._capacity,
                "produced": self.produced,
                "served": self.served,
                "misses": self.misses,
            }

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"ObfuscatorPool({state}, ready={len(self._queue)}/{self._capacity}, "
            f"misses={self.misses}, owner={self.owner!r})"
        )
