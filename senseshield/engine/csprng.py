"""Gaussian and uniform draws from a cryptographic keystream (ChaCha20), for privacy noise.

A differential-privacy guarantee holds only while the noise is unknown to the adversary.
NumPy's and torch's generators are fast but not cryptographic (PCG64 and Mersenne Twister
states can be recovered from enough outputs), and a generator seeded from values the server
knows (the job's seed, the round, the device's index) is no secret at all: the server
regenerates the noise and subtracts it. :class:`ChaChaGenerator` turns a 256-bit key into
a ChaCha20 keystream (RFC 8439, through ``cryptography``/OpenSSL) and that keystream into
the draws the mechanisms need, with the subset of :class:`numpy.random.Generator`'s
interface they use (:class:`NoiseSource`), so the pure mechanisms take either.

Without the key, the keystream is indistinguishable from uniform bits (ChaCha20's PRF
security), so the draws are independent of anything the server holds. Where the key comes
from is the caller's choice: :meth:`ChaChaGenerator.fresh` takes 32 bytes from the OS CSPRNG
(``secrets``); :meth:`ChaChaGenerator.from_seed` derives them from a seed and a label
(SHA-256) for tests and reproducible experiments only: anyone who knows that seed can replay
the noise.

Conversions (float64, as NumPy's own): uniforms ``(u >> 11) · 2^-53`` from 64-bit words;
normals by Box-Muller, both outputs of a pair used, ``u1`` taken in (0, 1] so ``log`` is
finite. Floating-point sampling has the usual caveat of every float DP implementation (the
low bits of a sample are not exactly Gaussian; Mironov 2012 for the Laplace case); no
snapping is applied.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

KEY_BYTES = 32  # ChaCha20's key (256 bits)
_TWO_PI = 2.0 * math.pi


class NoiseSource(Protocol):
    """What a privacy mechanism draws from: a :class:`ChaChaGenerator` (devices) or a
    :class:`numpy.random.Generator` (experiments that want NumPy's streams)."""

    def standard_normal(self, size: int | tuple[int, ...] | None = None) -> np.ndarray: ...

    def normal(self, loc: float = 0.0, scale: float | np.ndarray = 1.0,
               size: int | tuple[int, ...] | None = None) -> np.ndarray: ...


def _count(size: int | tuple[int, ...] | None) -> tuple[int, tuple[int, ...]]:
    shape: tuple[int, ...] = () if size is None else ((int(size),) if np.isscalar(size) else tuple(int(s) for s in size))  # type: ignore[arg-type]
    if any(s < 0 for s in shape):
        raise ValueError(f"size={size!r} is not allowed; give non-negative dimensions.")
    return int(np.prod(shape, dtype=np.int64)) if shape else 1, shape


class ChaChaGenerator:
    """Uniform and Gaussian float64 draws from the ChaCha20 keystream of ``key`` (32 bytes).

    The same key gives the same stream; keys from :meth:`fresh` are never repeated in practice
    (2^-128 collision odds per pair). One generator serves one stream of draws (one mechanism
    of one round); it is not thread-safe.
    """

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"a ChaCha20 key is {KEY_BYTES} bytes; got {len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}.")
        # 16-byte nonce field of cryptography's ChaCha20: 32-bit block counter (0) + 96-bit nonce (0);
        # the key is used for this one stream only, so a fixed nonce is safe
        self._stream = Cipher(algorithms.ChaCha20(bytes(key), b"\x00" * 16), mode=None).encryptor()
        self.secret = True  # callers that derived the key from a public seed say otherwise

    @classmethod
    def fresh(cls) -> "ChaChaGenerator":
        """A generator keyed with 256 bits from the OS CSPRNG: nobody can replay its draws."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: int, *labels: object) -> "ChaChaGenerator":
        """A replayable generator: key = SHA-256 of the seed and the labels. For tests and
        reproducible experiments only; whoever knows ``seed`` can regenerate every draw."""
        text = "senseshield-noise-v1|" + "|".join(str(x) for x in (int(seed), *labels))
        generator = cls(hashlib.sha256(text.encode()).digest())
        generator.secret = False
        return generator

    def _words(self, n: int) -> np.ndarray:
        return np.frombuffer(self._stream.update(bytes(8 * n)), dtype="<u8")

    def random(self, size: int | tuple[int, ...] | None = None) -> np.ndarray | float:
        """Uniform draws in [0, 1) with 53 random bits each."""
        n, shape = _count(size)
        values = (self._words(n) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return float(values[0]) if size is None else values.reshape(shape)

    def standard_normal(self, size: int | tuple[int, ...] | None = None) -> np.ndarray | float:
        """N(0, 1) draws (Box-Muller over pairs of uniforms)."""
        n, shape = _count(size)
        pairs = (n + 1) // 2
        words = self._words(2 * pairs) >> np.uint64(11)
        u1 = (words[:pairs].astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]
        u2 = words[pairs:].astype(np.float64) * 2.0**-53
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = _TWO_PI * u2
        values = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
        return float(values[0]) if size is None else values.reshape(shape)

    def normal(self, loc: float = 0.0, scale: float | np.ndarray = 1.0,
               size: int | tuple[int, ...] | None = None) -> np.ndarray | float:
        """N(loc, scale²) draws; ``scale`` >= 0 (a scalar or an array broadcast to ``size``)."""
        scale_arr = np.asarray(scale, dtype=np.float64)
        if np.any(scale_arr < 0) or not np.all(np.isfinite(scale_arr)):
            raise ValueError(f"scale={scale!r} is not allowed; give a finite standard deviation >= 0.")
        if size is None and scale_arr.ndim:
            size = scale_arr.shape
        return loc + scale_arr * self.standard_normal(size)

    def torch_seed(self) -> int:
        """A 63-bit seed for a torch.Generator drawn from this stream (for libraries, such as
        Opacus, that take a torch generator; see :mod:`senseshield.device_noise`)."""
        return int(self._words(1)[0] >> np.uint64(1))
