"""``senseshield bench he``: encryption, aggregation and decryption speed of the HE schemes.

One run measures, on the same machine and with the same key size:

* ``phe`` -- stock python-paillier, one ``public_key.encrypt(float)`` per parameter, the
  aggregate ``acc + enc * w`` per client and parameter, ``private_key.decrypt`` per parameter
  (on ``phe_params`` parameters: it is ~1000x slower, the rates are per second);
* ``packed-paillier`` -- the packed scheme (default subgroup key), obfuscators computed
  inline (fixed-base table);
* ``packed-paillier (standard key)`` -- the same with ``structure="standard"`` (decryption
  exponent ``p - 1`` instead of the 256-bit subgroup order);
* ``packed-paillier+pool`` -- the same with a pre-filled :class:`ObfuscatorPool`: the
  encryption rate is the *online* cost (quantise, pack, one multiplication per block); the
  offline cost of filling the pool is reported in ``details.pool_fill_params_per_s``;
* ``ckks`` -- the default CKKS context (weights applied by the coordinator);
* ``ckks-sum`` -- the sum-only CKKS context (clients pre-scale, the coordinator adds).

For every scheme: ``encrypt_params_per_s`` (one client encrypting its vector),
``aggregate_params_per_s`` (parameters times clients added, per second of ``aggregate``),
``decrypt_params_per_s`` (one decryption of the aggregate), ``bytes_per_param`` (a fresh
client ciphertext, ``EncryptedVector.nbytes / params``) and ``speedup_vs_phe``: the ratio to
stock ``phe`` measured in the same run, ``{"encrypt", "aggregate", "decrypt"}`` as rate
ratios and ``"bytes"`` as ``phe bytes / scheme bytes``. Setup (key generation, the
fixed-base table) is reported apart in ``details``, not in the rates. Each rate is the best
of several timed repetitions, as ``timeit`` reports (background load only slows a repetition
down): one per client vector for encryption (phe: slices of 40 parameters), 3 aggregations,
4 slices of whole blocks for packed decryption (phe: 5 slices; CKKS: 3 runs); the medians
are in ``details.median_params_per_s``. The repetitions of each phase run round-robin over
the schemes, so that a load spike does not fall on one scheme only. Every scheme's
aggregate is decrypted and compared with the plaintext weighted sum; the error is reported
on the weighted mean (``details.max_abs_error_of_mean``, sum error / total weight).

Run it pinned to one core for the single-core figures: ``OMP_NUM_THREADS=1 taskset -c 0
senseshield bench he --out he.json``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.table import Table

from senseshield.bench.machine import cpu_model
from senseshield.errors import ConfigError
from senseshield.he.base import CipherPart
from senseshield.he.ckks import CKKSScheme, CKKSSumScheme
from senseshield.he.obfuscation import DEFAULT_WINDOW_BITS
from senseshield.he.packed import PackedPaillierScheme
from senseshield.he.paillier import InsecureKeyWarning

__all__ = ["TARGETS", "render_he_table", "run_he_bench"]

Progress = Callable[[str], None]

TARGETS: dict[str, str] = {
    "packed_encrypt_speedup": (
        ">= 1000x stock phe encryption (one core, 2048-bit, default exponent)"
    ),
    "pool_online_us_per_param": "< 1 us online encryption cost per parameter with the pool",
    "paillier_bytes_per_param": "<= 8 bytes per encrypted parameter (packed Paillier)",
    "ckks_bytes_per_param": "<= 32 bytes per encrypted parameter (ckks-sum)",
    "packed_decrypt_speedup": ">= 100x stock phe decryption per parameter (one thread)",
}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _rate(count: int, seconds: float) -> float:
    return float(count) / seconds if seconds > 0 else float("inf")




def _machine() -> dict[str, Any]:
    import gmpy2
    import phe
    import tenseal

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": cores,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "phe": getattr(phe, "__version__", "?"),
        "gmpy2": gmpy2.version(),
        "gmp": gmpy2.mp_version(),
        "tenseal": getattr(tenseal, "__version__", "?"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


class _Samples:
    """Timed repetitions of one operation; the reported rate is the best one (as ``timeit``
    does: background load only ever slows a repetition down), the median is kept too."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def time(self, count: int, fn: Callable[[], Any]) -> Any:
        out, seconds = _timed(fn)
        self.rates.append(_rate(count, seconds))
        return out

    @property
    def best(self) -> float:
        return max(self.rates)

    @property
    def median(self) -> float:
        return float(np.median(self.rates))


def _slices(count: int, parts: int) -> list[slice]:
    size = max(1, -(-count // parts))
    return [slice(i, min(i + size, count)) for i in range(0, count, size)]


class _Runner(ABC):
    """One scheme under test. The orchestrator calls ``setup``, then the repetitions of each
    phase round-robin over all runners (so every scheme is timed under the same load), then
    ``result``."""

    name: str

    def __init__(self, values: np.ndarray, weights: list[int]) -> None:
        self.values = values
        self.weights = weights
        self.clients, self.count = values.shape
        self.positions = np.arange(self.count, dtype=np.int64)
        self.expected = sum(w * row for w, row in zip(weights, values))
        self.samples = {phase: _Samples() for phase in ("encrypt", "aggregate", "decrypt")}
        self.details: dict[str, Any] = {}
        self.bytes_per_param = float("nan")

    def setup(self) -> None: ...

    @abstractmethod
    def reps(self, phase: str) -> int:
        """How many repetitions of ``phase`` make one timing sample."""

    @abstractmethod
    def step(self, phase: str, rep: int) -> None:
        """Run repetition ``rep`` of ``phase`` (encrypt, aggregate or decrypt)."""

    def check(self, out: np.ndarray) -> None:
        total = sum(self.weights)
        self.details["max_abs_error_of_mean"] = float(np.max(np.abs(out - self.expected))) / total

    def result(self) -> dict[str, Any]:
        enc, agg, dec = (self.samples[p] for p in ("encrypt", "aggregate", "decrypt"))
        return {
            "name": self.name,
            "encrypt_params_per_s": enc.best,
            "aggregate_params_per_s": agg.best,
            "decrypt_params_per_s": dec.best,
            "bytes_per_param": float(self.bytes_per_param),
            "speedup_vs_phe": {},
            "details": {
                "params": self.count,
                "repetitions": {p: len(v.rates) for p, v in self.samples.items()},
                "median_params_per_s": {p: v.median for p, v in self.samples.items()},
                **self.details,
            },
        }


class _Phe(_Runner):
    """Stock python-paillier, used as its documentation shows (floats in, floats out). Two
    distinct client vectors are encrypted, in 5 slices each; the aggregation alternates
    between them (the cost of ``acc + enc * w`` does not depend on which ciphertexts)."""

    name = "phe"

    def __init__(self, values: np.ndarray, weights: list[int], key_bits: int) -> None:
        super().__init__(values, weights)
        self.key_bits = key_bits
        self.expected = sum(w * values[i % 2] for i, w in enumerate(weights))
        self.enc_slices = [(row, part) for row in range(min(2, self.clients))
                           for part in _slices(self.count, 5)]
        self.dec_slices = _slices(self.count, 5)
        self.details["note"] = "2 distinct client vectors, aggregation alternates between them"

    def setup(self) -> None:
        from phe import paillier

        (self.public, self.private), self.details["keygen_s"] = _timed(
            lambda: paillier.generate_paillier_keypair(n_length=self.key_bits)
        )
        self.encrypted: list[list[Any]] = [[] for _ in range(min(2, self.clients))]
        self.out: list[float] = []
        self.bytes_per_param = 2 * ((self.public.n.bit_length() + 7) // 8)  # Z_{n^2}

    def reps(self, phase: str) -> int:
        return {"encrypt": len(self.enc_slices), "aggregate": self.clients,
                "decrypt": len(self.dec_slices)}[phase]

    def step(self, phase: str, rep: int) -> None:
        s = self.samples[phase]
        if phase == "encrypt":
            row, part = self.enc_slices[rep]
            values = self.values[row, part]
            encrypt = self.public.encrypt
            self.encrypted[row] += s.time(values.size, lambda: [encrypt(float(v)) for v in values])
        elif phase == "aggregate":
            src, w = self.encrypted[rep % 2], self.weights[rep]
            if rep == 0:
                self.acc = s.time(self.count, lambda: [c * w for c in src])
            else:
                acc = self.acc
                self.acc = s.time(self.count, lambda: [a + c * w for a, c in zip(acc, src)])
        else:
            part = self.dec_slices[rep]
            decrypt, acc = self.private.decrypt, self.acc[part]
            self.out += s.time(len(acc), lambda: [decrypt(c) for c in acc])
            if rep == len(self.dec_slices) - 1:
                self.check(np.array(self.out))


def _block_slices(vector: Any, block_size: int, parts: int) -> list[tuple[int, Any]]:
    """Split a packed vector into ``parts`` vectors of whole blocks: ``(params, vector)``."""
    from senseshield.he.base import EncryptedVector
    from senseshield.he.packed import PackedPayload

    payload = vector.payload
    block_of = vector.positions // block_size
    out = []
    for part in _slices(len(payload), parts):
        lo, hi = np.searchsorted(
            block_of, [payload.blocks[part.start], payload.blocks[part.stop - 1] + 1]
        )
        sub = EncryptedVector(
            vector.scheme,
            vector.key_id,
            vector.positions[lo:hi],
            PackedPayload(payload.blocks[part], payload.ciphertexts[part], payload.weights[part]),
            (part.stop - part.start) * (vector.nbytes // len(payload)),
        )
        out.append((int(hi - lo), sub))
    return out


class _Packed(_Runner):
    """Packed Paillier; ``pooled`` takes obfuscators from a pool filled during setup (the
    online cost), else computes them inline. Decryption is timed on 4 slices of whole
    blocks of the aggregate; the decrypted integers must equal the exact weighted sum of the
    quantised values."""

    def __init__(
        self,
        values: np.ndarray,
        weights: list[int],
        *,
        key_bits: int,
        window_bits: int,
        exponent_bits: int | None,
        share: "_Packed | None" = None,
        structure: str = "subgroup",
    ) -> None:
        super().__init__(values, weights)
        self.pooled = share is not None
        self.structure = structure
        self.name = "packed-paillier+pool" if self.pooled else "packed-paillier"
        if structure != "subgroup":
            self.name += f" ({structure} key)"
        self.key_bits, self.window_bits, self.exponent_bits = key_bits, window_bits, exponent_bits
        self.share = share
        self.vectors: list[Any] = []

    def setup(self) -> None:
        if self.share is not None:  # same key and table as the runner without the pool
            self.secret, self.details = self.share.secret, dict(self.share.base_details)
        else:
            self.secret, keygen_s = _timed(lambda: PackedPaillierScheme.generate(
                key_bits=self.key_bits, exponent_bits=self.exponent_bits, structure=self.structure))
            self.secret.public_key.window_bits = self.window_bits
            table, table_s = _timed(self.secret.public_key.obfuscator_table)
            lay = self.secret.public_key.layout
            self.base_details = {
                "structure": self.structure,
                "keygen_s": keygen_s,
                "table_build_s": table_s,
                "table_mbytes": table.nbytes / 1e6,
                "window_bits": table.window_bits,
                "exponent_bits": self.secret.public_key.exponent_bits,
                "slots": self.secret.public_key.block_size,
                "value_bits": lay.value_bits,
                "clip": lay.clip,
                "max_total_weight": lay.max_total_weight,
                "blocks_per_client": -(-self.count // self.secret.public_key.block_size),
            }
            self.details = dict(self.base_details)
        self.public = self.secret.public_key
        self.pool = None
        if self.pooled:
            blocks = self.details["blocks_per_client"] * self.clients
            self.pool = self.public.make_pool(capacity=blocks)
            _, fill_s = _timed(self.pool.fill)
            self.details["pool_fill_params_per_s"] = _rate(blocks * self.public.block_size, fill_s)
        lay = self.public.layout
        self.expected_ints = sum(
            w * lay.quantise(row)[0] for w, row in zip(self.weights, self.values)
        )

    def reps(self, phase: str) -> int:
        return {"encrypt": self.clients, "aggregate": 3, "decrypt": 4}[phase]

    def step(self, phase: str, rep: int) -> None:
        s = self.samples[phase]
        public = self.public
        if phase == "encrypt":
            row = self.values[rep]
            self.vectors.append(
                s.time(self.count, lambda: public.encrypt(row, self.positions, pool=self.pool))
            )
            self.bytes_per_param = self.vectors[0].nbytes / self.count
        elif phase == "aggregate":
            parts = [CipherPart(v, w) for v, w in zip(self.vectors, self.weights)]
            self.aggregate = s.time(
                self.count * self.clients, lambda: public.aggregate(parts, self.positions)
            )
            if rep == 0:
                self.slices = _block_slices(self.aggregate, public.block_size, 4)
                self.ints: list[np.ndarray] = [None] * len(self.slices)  # type: ignore[list-item]
        elif rep < len(self.slices):
            size, sub = self.slices[rep]
            self.ints[rep] = s.time(size, lambda: self.secret.decrypt_integers(sub))
            if rep == len(self.slices) - 1:
                self.finish()

    def finish(self) -> None:
        ints = np.concatenate(self.ints)
        if not np.array_equal(ints, self.expected_ints):
            raise RuntimeError(f"{self.name}: the decrypted aggregate differs from the exact sum.")
        self.details["exact_sum_of_quantised"] = True
        self.check(self.public.layout.dequantise(ints))
        if self.pool is not None:
            self.details["online_us_per_param"] = 1e6 / self.samples["encrypt"].best
            self.details["pool_misses"] = self.pool.misses
        else:
            threaded = _Samples()
            for size, sub in self.slices:
                threaded.time(size, lambda sub=sub: self.secret.decrypt_integers(sub, threads=2))
            self.details["decrypt_params_per_s_2_threads"] = threaded.best


class _CKKS(_Runner):
    """The default CKKS context (the coordinator weights) or ``ckks-sum`` (clients
    pre-scale by their weight, the coordinator adds)."""

    def __init__(self, values: np.ndarray, weights: list[int], name: str) -> None:
        super().__init__(values, weights)
        self.name = name
        self.vectors: list[Any] = []

    def setup(self) -> None:
        factory = CKKSSumScheme if self.name == "ckks-sum" else CKKSScheme
        self.secret, self.details["keygen_s"] = _timed(factory.generate)
        self.public = self.secret.public_key
        params = self.public.params
        self.details.update(
            slots=params["slots"],
            poly_modulus_degree=params["poly_modulus_degree"],
            coeff_modulus_bits=params["coeff_modulus_bits"],
        )

    def reps(self, phase: str) -> int:
        return {"encrypt": self.clients, "aggregate": 3, "decrypt": 3}[phase]

    def step(self, phase: str, rep: int) -> None:
        s = self.samples[phase]
        public = self.public
        if phase == "encrypt":
            row, w = self.values[rep], self.weights[rep]
            if self.name == "ckks-sum":
                vec = s.time(self.count, lambda: public.encrypt(row, self.positions, weight=w))
            else:
                vec = s.time(self.count, lambda: public.encrypt(row, self.positions))
            self.vectors.append(vec)
            self.bytes_per_param = self.vectors[0].nbytes / self.count
        elif phase == "aggregate":
            parts = [CipherPart(v, w) for v, w in zip(self.vectors, self.weights)]
            self.aggregate = s.time(
                self.count * self.clients, lambda: public.aggregate(parts, self.positions)
            )
        else:
            out = s.time(self.count, lambda: self.secret.decrypt(self.aggregate))
            self.check(out)


def _targets(schemes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    packed, pooled = schemes["packed-paillier"], schemes["packed-paillier+pool"]
    rows = [
        ("packed_encrypt_speedup", packed["speedup_vs_phe"]["encrypt"], 1000.0, "ge"),
        ("pool_online_us_per_param", pooled["details"]["online_us_per_param"], 1.0, "lt"),
        ("paillier_bytes_per_param", packed["bytes_per_param"], 8.0, "le"),
        ("ckks_bytes_per_param", schemes["ckks-sum"]["bytes_per_param"], 32.0, "le"),
        ("packed_decrypt_speedup", packed["speedup_vs_phe"]["decrypt"], 100.0, "ge"),
    ]
    out = []
    for name, measured, bound, op in rows:
        met = {"ge": measured >= bound, "lt": measured < bound, "le": measured <= bound}[op]
        out.append(
            {"name": name, "target": TARGETS[name], "measured": measured, "met": bool(met)}
        )
    return out


def run_he_bench(
    *,
    params: int = 65_536,
    clients: int = 8,
    key_bits: int = 2048,
    seed: int = 0,
    phe_params: int = 200,
    window_bits: int = DEFAULT_WINDOW_BITS,
    exponent_bits: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the HE benchmark and return the JSON-ready result (see the module docstring).

    ``params``: parameters per client vector for the packed and CKKS schemes;
    ``phe_params``: the (smaller) count for stock phe; ``clients``: contributions per
    aggregate (sample-count weights drawn in ``[50, 500]`` with ``seed``); ``key_bits``:
    Paillier modulus for phe and packed; ``window_bits``/``exponent_bits``: packed
    obfuscator settings (defaults: table window 10, exponent ``key_bits // 2``);
    ``progress``: called with a short message before each stage.
    """
    for label, value, low in (
        ("params", params, 1),
        ("clients", clients, 1),
        ("phe_params", phe_params, 1),
        ("key_bits", key_bits, 512),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{label} is {value!r}; it must be an integer >= {low}.")
    say: Progress = progress or (lambda _msg: None)
    rng = np.random.default_rng(seed)
    weights = [int(w) for w in rng.integers(50, 501, size=clients)]
    values = rng.uniform(-1.0, 1.0, size=(clients, params))
    phe_values = values[:, :phe_params] if phe_params <= params else rng.uniform(
        -1.0, 1.0, size=(clients, phe_params)
    )
    started = time.perf_counter()
    runners: list[_Runner] = [_Phe(phe_values, weights, key_bits)]
    plain = _Packed(values, weights, key_bits=key_bits, window_bits=window_bits,
                    exponent_bits=exponent_bits)
    runners += [
        plain,
        _Packed(values, weights, key_bits=key_bits, window_bits=window_bits,
                exponent_bits=exponent_bits, share=plain),
        _Packed(values, weights, key_bits=key_bits, window_bits=window_bits,
                exponent_bits=exponent_bits, structure="standard"),
        _CKKS(values, weights, "ckks"),
        _CKKS(values, weights, "ckks-sum"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyWarning)  # key_bits < 2048 in quick runs
        for runner in runners:
            say(f"{runner.name}: setup (keys, tables, pool)")
            runner.setup()
        for phase in ("encrypt", "aggregate", "decrypt"):
            say(f"{phase}: repetitions round-robin over {len(runners)} schemes")
            for rep in range(max(r.reps(phase) for r in runners)):
                for runner in runners:
                    if rep < runner.reps(phase):
                        runner.step(phase, rep)
    entries = [runner.result() for runner in runners]
    phe_entry = entries[0]
    for entry in entries:
        entry["speedup_vs_phe"] = {
            "encrypt": entry["encrypt_params_per_s"] / phe_entry["encrypt_params_per_s"],
            "aggregate": entry["aggregate_params_per_s"] / phe_entry["aggregate_params_per_s"],
            "decrypt": entry["decrypt_params_per_s"] / phe_entry["decrypt_params_per_s"],
            "bytes": phe_entry["bytes_per_param"] / entry["bytes_per_param"],
        }
    by_name = {e["name"]: e for e in entries}
    return {
        "benchmark": "he",
        "machine": _machine(),
        "config": {
            "params": params,
            "phe_params": phe_params,
            "clients": clients,
            "key_bits": key_bits,
            "seed": seed,
            "weights": weights,
            "total_weight": int(sum(weights)),
            "values": "uniform in [-1, 1]",
        },
        "schemes": entries,
        "targets": _targets(by_name),
        "seconds": time.perf_counter() - started,
    }


def _fmt_rate(value: float) -> str:
    if not math.isfinite(value):
        return "inf"
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e3:
        return f"{value / 1e3:.1f} k"
    return f"{value:.0f}"


def _fmt_ratio(value: float) -> str:
    return f"{value:,.0f}x" if value >= 10 else f"{value:.2f}x"


def render_he_table(result: dict[str, Any]) -> Table:
    """A rich table of ``run_he_bench``'s result: rates (params/s), bytes, ratios to phe."""
    machine = result.get("machine", {})
    config = result.get("config", {})
    table = Table(
        title=(
            f"HE benchmark: {config.get('key_bits', '?')}-bit Paillier, "
            f"{config.get('params', '?'):,} params x {config.get('clients', '?')} clients "
            f"(phe: {config.get('phe_params', '?')} params)"
        ),
        caption=f"{machine.get('cpu_model', '?')}, {machine.get('cpus_usable', '?')} usable CPU(s)",
    )
    for header in (
        "scheme",
        "encrypt/s",
        "aggregate/s",
        "decrypt/s",
        "B/param",
        "enc vs phe",
        "agg vs phe",
        "dec vs phe",
    ):
        table.add_column(header, justify="left" if header == "scheme" else "right")
    for entry in result.get("schemes", []):
        ratios = entry.get("speedup_vs_phe", {})
        table.add_row(
            entry["name"],
            _fmt_rate(entry["encrypt_params_per_s"]),
            _fmt_rate(entry["aggregate_params_per_s"]),
            _fmt_rate(entry["decrypt_params_per_s"]),
            f"{entry['bytes_per_param']:.2f}",
            _fmt_ratio(ratios.get("encrypt", float("nan"))),
            _fmt_ratio(ratios.get("aggregate", float("nan"))),
            _fmt_ratio(ratios.get("decrypt", float("nan"))),
        )
    return table
