"""What the key server's recomputation of an aggregate's plaintext side costs: the extra
bytes of the aggregate request (every contributor's plaintext part) and the seconds of the
check (``keyserver.verify.check_plain_side``: digests, parsing, the recomputation with the
coordinator's code, the comparisons), against the whole verification and the decryption.

    python benchmarks/bench_plain_side.py [--agents 6] [--budgets 0.1 0.5 0.9] [--repeats 5]
        [--key-bits 2048] [--out benchmarks/results/plain-side.json]

The digits MLP (50,826 parameters); SenseCrypt's per-client masks over ``masked`` (64-bit
ring, position granularity) and over packed Paillier (subgroup key, block granularity):
each agent encrypts a random ``budget`` share of the blocks, the rest goes in plaintext;
sample counts 400-445 as digits devices have; the key server's default k = 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyserver.state import KeyServerState  # noqa: E402
from keyserver.verify import Rules, check_plain_side, verify  # noqa: E402
from senseshield.bench.machine import cpu_model as _cpu_model  # noqa: E402
from senseshield.engine.aggregation import aggregate_updates, decrypt_aggregate, protect_update  # noqa: E402
from senseshield.he import generate_keys  # noqa: E402
from senseshield.he.base import job_key, model_digest, round_context  # noqa: E402
from senseshield.runtime.identity import Identity, Trust  # noqa: E402
from senseshield.runtime.protocol.envelope import decode_frame  # noqa: E402
from senseshield.runtime.protocol.messages import (  # noqa: E402
    Receipt,
    aggregate_from_message,
    aggregate_to_message,
    from_frame,
    pack_mask,
    plain_digest,
    to_frame,
)

SIZE = 50_826  # the digits MLP
FLEET, RUN, R = "bench", "run-1", 1
INITIAL = np.zeros(SIZE, np.float32)  # the cluster's current model, which every receipt signs


def _round(secret, public, ids, budget: float, rng):  # noqa: ANN001, ANN202
    """Every agent's update and signed receipt, the coordinator's aggregate and its request."""
    B = public.block_size
    blocks = -(-SIZE // B)
    seed = bytes(range(32))
    parts = []
    for i, (name, ident) in enumerate(ids.items()):
        chosen = rng.choice(blocks, size=max(1, round(budget * blocks)), replace=False)
        mask = np.zeros(blocks * B, bool)
        for b in chosen:
            mask[b * B : (b + 1) * B] = True
        mask = mask[:SIZE]
        key = public.for_contributor(ident.exchange, round_context(FLEET, RUN, R, 0))
        w = 400 + 9 * i
        update = protect_update(rng.normal(size=SIZE) * 0.01, mask, key, client_id=name, round=R, cluster=0, n_samples=w)
        cipher = public.ciphertext_bytes(update.ciphertext)
        receipt = Receipt(run_id=RUN, cluster=0, n_samples=w, key_id=public.key_id,
                          mask_digest=hashlib.sha256(pack_mask(mask).tobytes()).hexdigest(),
                          ciphertext_digest=hashlib.sha256(cipher).hexdigest(),
                          fingerprint=public.fingerprint(update.ciphertext, seed), start_digest=model_digest(INITIAL),
                          plain_digest=plain_digest(np.zeros(0, np.uint8), update.plaintext))
        parts.append((update, to_frame(receipt, fleet=FLEET, sender=name, round=R, signer=ident)))
    aggregate = aggregate_updates([u for u, _ in parts], public, round=R, cluster=0, min_encryptors=2)
    return aggregate_to_message(aggregate, public, run_id=RUN, receipts=[f for _, f in parts]), seed


def measure(scheme: str, secret, ids, budgets: list[float], repeats: int) -> list[dict]:  # noqa: ANN001
    public = job_key(secret.public_key, per_client_masks=True)
    trust = Trust.for_identities({a: (i, "agent") for a, i in ids.items()}, fleet=FLEET)
    coordinator = Identity.generate("coordinator")
    rows = []
    for budget in budgets:
        msg, seed = _round(secret, public, ids, budget, np.random.default_rng(int(budget * 100)))
        state = KeyServerState(key_dir=ROOT, fleet=FLEET, run_id=RUN, initial=INITIAL, public=public, secret=secret,
                               plans={R: {0: list(ids)}}, seeds={R: seed}, boxes={R: {a: i.box_key for a, i in ids.items()}})
        rules = Rules(trust=trust, min_contributors=2, min_fraction=0.0, min_encryptors=2)
        receipts = {a: from_frame(decode_frame(f)) for a, f in zip(sorted(ids), _frames(msg))}
        plain_s, verify_s = [], []
        for _ in range(repeats):
            aggregate = aggregate_from_message(msg, public, round=R, size=SIZE)
            t = time.perf_counter()
            assert check_plain_side(state, rules, msg, aggregate, receipts) is None
            plain_s.append(time.perf_counter() - t)
            aggregate = aggregate_from_message(msg, public, round=R, size=SIZE)
            t = time.perf_counter()
            refusal, weights, _ = verify(state, rules, R, 0, msg, aggregate, {}, {}, [])
            verify_s.append(time.perf_counter() - t)
            assert refusal is None, refusal
        if public.needs_contributors:
            masks = msg.contributor_masks()
            secret.bind_contributions(aggregate.ciphertext, [(ids[a].box_key, weights[a]) for a in sorted(weights)],
                                      round_context(FLEET, RUN, R, 0), masks=[masks[a] for a in sorted(weights)])
        t = time.perf_counter()
        decrypt_aggregate(aggregate, secret)
        decrypt_s = time.perf_counter() - t
        with_plains = len(to_frame(msg, fleet=FLEET, sender="coordinator", round=R, signer=coordinator))
        without = len(to_frame(msg.model_copy(update={"plains": b""}), fleet=FLEET, sender="coordinator", round=R,
                               signer=coordinator))
        row = {"scheme": scheme, "budget": budget, "agents": len(ids),
               "union_share": float(np.unpackbits(msg.union_mask, count=SIZE).mean()),
               "request_bytes_before": without, "plains_bytes": with_plains - without,
               "extra_percent": 100 * (with_plains - without) / without,
               "check_plain_side_ms": 1000 * min(plain_s), "verify_ms": 1000 * statistics.median(verify_s),
               "decrypt_ms": 1000 * decrypt_s}
        row["check_share_of_verify_and_decrypt_percent"] = 100 * row["check_plain_side_ms"] / (
            row["verify_ms"] + row["decrypt_ms"])
        rows.append(row)
        print(f"{scheme:16s} budget {budget:.1f}: request {without / 1e6:6.2f} MB + {row['plains_bytes'] / 1e6:5.2f} MB "
              f"plaintext parts (+{row['extra_percent']:5.1f} %); check {row['check_plain_side_ms']:7.1f} ms of verify "
              f"{row['verify_ms']:7.1f} ms, decrypt {row['decrypt_ms']:8.1f} ms "
              f"({row['check_share_of_verify_and_decrypt_percent']:.1f} % of both)", flush=True)
    return rows


def _frames(msg) -> list[bytes]:  # noqa: ANN001
    from senseshield.runtime.protocol.messages import unpack_frames

    return unpack_frames(msg.receipts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/plain-side.json")
    a = ap.parse_args()
    ids = {f"c{i:03d}": Identity.generate(f"c{i:03d}") for i in range(a.agents)}
    rows = []
    for scheme in ("masked", "packed-paillier"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            secret = generate_keys(scheme, **({"key_bits": a.key_bits} if scheme != "masked" else {}))
            rows += measure(scheme, secret, ids, a.budgets, a.repeats)
    result = {"benchmark": "plain-side", "date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "size": SIZE,
              "key_bits": a.key_bits, "repeats": a.repeats, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
