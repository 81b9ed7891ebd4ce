"""Max absolute difference between two or more mlp_check.py results (the first is the reference)."""

import json
import sys

ref_path, *others = sys.argv[1:]
ref = json.load(open(ref_path))
worst = 0.0
for path in others:
    other = json.load(open(path))
    line = [f"{path} vs {ref_path}:"]
    for key in ("logits0", "grads", "params", "logits1"):
        d = max(abs(a - b) for a, b in zip(ref[key], other[key], strict=True))
        worst = max(worst, d)
        line.append(f"{key} {d:.2e}")
    for key in ("loss0", "loss1"):
        d = abs(ref[key] - other[key])
        worst = max(worst, d)
        line.append(f"{key} {d:.2e}")
    rel = abs(ref["big_matmul_sum"] - other["big_matmul_sum"]) / abs(ref["big_matmul_sum"])
    line.append(f"512x512 matmul sum rel {rel:.1e}")
    print(" ".join(line))
print(f"max abs difference over logits, grads, params, losses: {worst:.2e}")
sys.exit(0 if worst < 1e-5 else 1)
