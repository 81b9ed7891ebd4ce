"""What trust on the wire costs (issue 14): signatures per message, fingerprints per round,
and a SenseCrypt fleet round before and after the change, in the same run.

Part 1 (in process): Ed25519 sign + verify of frames of typical sizes; for packed Paillier
(2048-bit) on the MLP and LeNet-5 at three budgets, an agent's fingerprint (from its
encryption's openings) against its encryption, and the key server's check against its
decryption of a 6-agent aggregate.

Part 2 (fleet): `make demo`'s job (6 agents, SenseCrypt, digits, MLP, 4 rounds, 2048-bit)
with this checkout and with the baseline commit (a git worktree), alternately, ``--repeats``
times each; round seconds (rounds 2..4), the agents' receipt phase and the key server's
verify phase, as seconds and percent of the round.

    python benchmarks/bench_trust.py [--baseline 6f4d682] [--repeats 2] [--out benchmarks/results/trust.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _best(fn, repeats: int = 5) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def signatures() -> list[dict]:
    from senseshield.runtime.identity import Identity, Trust, check_frame
    from senseshield.runtime.protocol.envelope import decode_frame, encode_frame

    me = Identity.generate("c000")
    trust = Trust({"c000": me.principal("agent")})
    rows = []
    for label, size in (("hello / plan (1 KB)", 1_000), ("MLP update (50 KB)", 50_000),
                        ("LeNet-5 update (500 KB)", 500_000), ("large update (5 MB)", 5_000_000)):
        blob = os.urandom(size)

        def make(signed: bool) -> bytes:
            return encode_frame(schema="update", version=2, fleet="f", sender="c000", round=1, fields={},
                                sections={"x": blob}, signer=me if signed else None)

        plain, signed = _best(lambda: make(False)), _best(lambda: make(True))
        frame = make(True)
        decode_plain = _best(lambda: decode_frame(make(False)))
        verify = _best(lambda: check_frame(trust, decode_frame(frame))) - decode_plain
        rows.append({"message": label, "bytes": size, "encode_s": plain, "sign_s": signed - plain,
                     "verify_s": max(verify, 0.0)})
    return rows


def fingerprints(key_bits: int) -> list[dict]:
    from senseshield.he import SCHEMES, CipherPart
    from senseshield.models import build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        secret = SCHEMES.get("packed-paillier").generate(key_bits=key_bits)
    public = secret.public_key
    B = public.block_size
    rows = []
    rng = np.random.default_rng(0)
    for model, shape in (("mlp", (1, 8, 8)), ("lenet5", (1, 28, 28))):
        size = sum(p.numel() for p in build_model(model, input_shape=shape, num_classes=10).parameters())
        blocks = -(-size // B)
        for budget in (1 / 32, 1 / 8, 1.0):
            k = max(1, round(blocks * budget))
            pos = np.arange(min(k * B, size))
            vectors, enc = [], []
            for i in range(6):
                t = time.perf_counter()
                vectors.append(public.encrypt(rng.normal(0, 0.01, pos.size), pos))
                enc.append(time.perf_counter() - t)
            seed = os.urandom(32)
            fp = []
            for v in vectors:
                t = time.perf_counter()
                public.fingerprint(v, seed)
                fp.append(time.perf_counter() - t)
            aggregate = public.aggregate([CipherPart(v, 100 + i) for i, v in enumerate(vectors)], pos)
            contributions = [(public.fingerprint(v, seed), 100 + i) for i, v in enumerate(vectors)]
            plain = public.plain_fold(aggregate)
            check = _best(lambda: secret.verify_aggregate(aggregate, seed, contributions, plain), 3)
            decrypt = _best(lambda: secret.decrypt(aggregate), 2)
            rows.append({"model": model, "params": size, "budget": budget, "blocks": int(k),
                         "agent_encrypt_s": float(np.median(enc)), "agent_fingerprint_s": float(np.median(fp)),
                         "keyserver_check_s": check, "keyserver_decrypt_s": decrypt})
    return rows


def fleet_run(source: Path, out: Path, rounds: int) -> dict:
    """`make demo`'s job with the code in ``source`` (a checkout), as a subprocess."""
    cmd = [sys.executable, "-c", "from senseshield.cli import main; main()", "fleet", "up", "--agents", "6",
           "--strategy", "sensecrypt", "--dataset", "digits", "--model", "mlp", "--partition", "categories:3",
           "--rounds", str(rounds), "--profile-file", str(ROOT / "profiles/sensecrypt-system-heterogeneity.yaml"),
           "--out", str(out), "--no-report"]
    env = dict(os.environ, PYTHONPATH=str(source))
    subprocess.run(cmd, cwd=source, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = json.loads((out / "report.json").read_text())
    rounds_ = report["rounds"][1:]
    receipt = [rec["phases"].get("receipt") for a in report["agents"] for r, rec in a["rounds"].items()
               if int(r) > 1 and "receipt" in rec["phases"]]
    verify, decrypt = [], []
    for rec in report["server"][1:]:
        for c in rec["clusters"].values():
            if "verify" in c["timings"]:
                verify.append(c["timings"]["verify"])
            if "decrypt" in c["timings"]:
                decrypt.append(c["timings"]["decrypt"])
    return {"round_s": float(np.mean([r["seconds"] for r in rounds_])), "accuracy": report["final_accuracy"],
            "receipt_s": float(np.mean(receipt)) if receipt else 0.0,
            "verify_s": float(np.mean(verify)) if verify else 0.0,
            "decrypt_s": float(np.mean(decrypt)) if decrypt else 0.0}


def fleets(baseline: str, repeats: int, rounds: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-trust-"))
    base = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), baseline], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"baseline": [], "signed": []}
    try:
        for i in range(repeats):
            for name, source in (("baseline", base), ("signed", ROOT)):
                runs[name].append(fleet_run(source, work / f"{name}-{i}", rounds))
                print(name, i, runs[name][-1], flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    summary = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
    s, b = summary["signed"], summary["baseline"]
    summary["round_ratio_signed_to_baseline"] = s["round_s"] / b["round_s"]
    summary["receipt_percent_of_round"] = 100 * s["receipt_s"] / s["round_s"]
    summary["verify_percent_of_round"] = 100 * s["verify_s"] / s["round_s"]
    summary["runs"] = runs
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="6f4d682", help="commit before signed frames")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/trust.json"))
    args = parser.parse_args()
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d"), "signatures": signatures()}
    for row in result["signatures"]:
        print(f"{row['message']:>26}: sign {row['sign_s'] * 1e3:.3f} ms, verify {row['verify_s'] * 1e3:.3f} ms")
    result["fingerprints"] = fingerprints(args.key_bits)
    for row in result["fingerprints"]:
        print(f"{row['model']:>7} {row['blocks']:4d} blocks: agent fingerprint {row['agent_fingerprint_s'] * 1e3:.1f} ms "
              f"= {100 * row['agent_fingerprint_s'] / row['agent_encrypt_s']:.1f} % of encryption; key server check "
              f"{row['keyserver_check_s'] * 1e3:.1f} ms = {100 * row['keyserver_check_s'] / row['keyserver_decrypt_s']:.1f} % "
              "of decryption")
    if not args.skip_fleet:
        result["fleet"] = fleets(args.baseline, args.repeats, args.rounds)
        f = result["fleet"]
        print(f"fleet round: {f['baseline']['round_s']:.2f} s before, {f['signed']['round_s']:.2f} s after "
              f"(x{f['round_ratio_signed_to_baseline']:.2f}); receipt {f['receipt_percent_of_round']:.1f} %, "
              f"verify {f['verify_percent_of_round']:.1f} % of the round")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
