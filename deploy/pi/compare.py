"""Max absolute difference between two or more mlp_check.py results (the first is the reference).

    python compare.py REF.json OTHER.json... [--atol 1e-5]

Also the tolerance a masked fleet's model is held to against the simulator's when some of
its agents compute on another CPU (:func:`masked_round_tolerance`, used by arm64_fleet.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping

import numpy as np

KEYS = ("logits0", "grads", "params", "logits1")


def masked_round_tolerance(fraction_bits: int, weights: Mapping[str, float], clusters: Mapping[str, int],
                           differing: Iterable[str], *, float_atol: float, largest: float,
                           server_lr: float = 1.0) -> float:
    """How far a masked round's model may lie from the simulator's when the agents in
    ``differing`` (e.g. the one on arm64) compute their updates with float arithmetic that
    differs by at most ``float_atol`` per value, all starting from the same model (round 1).

    An agent sends ``round(x · 2^fraction_bits)``; a value that differs by ``float_atol`` may
    round to a neighbouring word (one ring step, ``2^-fraction_bits``; more only if
    ``float_atol`` exceeds a step), so its encoded value moves by at most ``float_atol + step``.
    The cluster's mean update weighs it by ``w_a / Σ w`` (``weights``: samples per agent,
    ``clusters``: agent -> cluster) and the server applies it times ``server_lr``; the sum
    with the float32 model adds at most 2 float32 ulps of its largest weight (``largest``).
    Returns the worst cluster's bound."""
    step = 2.0 ** -fraction_bits
    differing = set(differing)
    shares = []
    for k in set(clusters.values()):
        members = [a for a, c in clusters.items() if c == k]
        total = sum(weights[a] for a in members)
        shares.append(sum(weights[a] for a in members if a in differing) / total)
    ulps = 2.0 * float(np.spacing(np.float32(abs(largest))))
    return server_lr * max(shares, default=0.0) * (step + float_atol) + ulps


def max_differences(ref: dict, other: dict) -> dict[str, float]:
    """Max absolute difference per key of two mlp_check.py results (and the losses)."""
    out = {key: max(abs(a - b) for a, b in zip(ref[key], other[key], strict=True)) for key in KEYS}
    for key in ("loss0", "loss1"):
        out[key] = abs(ref[key] - other[key])
    return out


def main(argv: list[str]) -> int:
    atol = 1e-5
    if "--atol" in argv:
        i = argv.index("--atol")
        atol = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    ref_path, *others = argv
    ref = json.load(open(ref_path))
    worst = 0.0
    for path in others:
        other = json.load(open(path))
        diffs = max_differences(ref, other)
        worst = max(worst, *diffs.values())
        rel = abs(ref["big_matmul_sum"] - other["big_matmul_sum"]) / abs(ref["big_matmul_sum"])
        print(f"{path} vs {ref_path}: " + " ".join(f"{k} {d:.2e}" for k, d in diffs.items())
              + f" 512x512 matmul sum rel {rel:.1e}")
    print(f"max abs difference over logits, grads, params, losses: {worst:.2e} (tolerance {atol:g}: "
          f"{'pass' if worst < atol else 'FAIL'})")
    return 0 if worst < atol else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
