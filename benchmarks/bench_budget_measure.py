"""Encryption-rate measurements of processes started together, and the budgets they lead to (no fleet).

Each trial starts N processes at once (default 3, optionally beside a CPU hog pinned to CPU 0);
each generates its own 2048-bit packed-Paillier key, as an agent does at join, then measures its
encryption rate with `edge_agent.probes.measure_encryption` at the join's settings (0.15 s of
CPU), and with --before-tree also with the measure_encryption of an older checkout of the code
(e.g. `git worktree add /tmp/before COMMIT`, or `git archive COMMIT | tar -x -C /tmp/before`),
the two in alternating order. The parent turns each method's figures and [min, max] into
budgets the coordinator's way (measured mode, the default tolerance: figures pooled by
`stable_inputs`, then `measured_cluster_budgets`; snapped for the current method, not for the
one before, as the coordinator before did not snap) and reports budget max/min per trial. Seconds per trial, not a fleet's 20.

    python benchmarks/bench_budget_measure.py [--trials 60] [--processes 3] [--hog]
        [--before-tree /tmp/before] [--out benchmarks/results/budget-measure.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from bench_budgets import machine

CHILD = r"""
import importlib.util, json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from edge_agent.probes import measure_encryption
from senseshield.he import SCHEMES
methods = {"after": measure_encryption}
tree, first = sys.argv[1], sys.argv[2]
if tree:
    old = Path(tree) / "edge_agent" / "probes.py"  # the measuring's module (profile.py in older trees)
    spec = importlib.util.spec_from_file_location(
        "profile_before", old if old.exists() else Path(tree) / "edge_agent" / "profile.py")
    module = sys.modules["profile_before"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    methods["before"] = module.measure_encryption
public = SCHEMES.get("packed-paillier").generate(key_bits=2048).public_key
out = {}
for name in sorted(methods, key=lambda m: m != first):
    he = methods[name](public_key=public, budget_s=0.15)
    out[name] = {"rate": he.encryptions_per_s, "min": he.spread.low, "max": he.spread.high,
                 "median": he.spread.median, "bursts": he.spread.probes}
print(json.dumps(out))
"""


def budgets_of(figures: dict[str, dict], *, snap: bool) -> dict[str, float]:
    """The coordinator's measured budgets of one cluster from these figures and intervals:
    pooled with the default tolerance, then snapped (``snap``) or not (the code before)."""
    from senseshield.strategies.base import (BootstrapReport, EncryptionRate, StrategyOptions,
                                             measured_cluster_budgets, stable_inputs)

    tolerance = StrategyOptions().budget_tolerance
    reports = [BootstrapReport(p, 100, 1000.0, 4.6, encryption=EncryptionRate(f["rate"], "packed-paillier/2048", 7.9),
                               intervals={"he_encryptions_per_s": (f["min"], f["max"])}) for p, f in figures.items()]
    pooled, _ = stable_inputs(reports, tolerance=tolerance)
    return measured_cluster_budgets(pooled, tolerance=tolerance if snap else None)[0]


def main() -> None:
    from senseshield.bench.budgets import cpu_hog, spread

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--hog", action="store_true", help="beside a busy-looping process pinned to CPU 0")
    parser.add_argument("--before-tree", type=Path, default=None, help="a checkout of the code before, to compare")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/budget-measure.json"))
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    trials = []
    with cpu_hog(0) if args.hog else nullcontext():
        for t in range(args.trials):
            first = "before" if t % 2 else "after"
            procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(args.before_tree or ""), first], env=env,
                                      stdout=subprocess.PIPE, text=True) for _ in range(args.processes)]
            results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            trial = {"first": first, "load1": os.getloadavg()[0]}
            for method in results[0]:
                figures = {f"p{i}": r[method] for i, r in enumerate(results)}
                budgets = budgets_of(figures, snap=method == "after")
                trial[method] = {"figures": figures, "budgets": budgets, "max_over_min": spread(budgets),
                                 "rate_max_over_min": spread({p: f["rate"] for p, f in figures.items()})}
            trials.append(trial)
            line = []
            for m in results[0]:
                rates = " ".join(f"{f['rate'] / 1000:.1f}k" for f in trial[m]["figures"].values())
                line.append(f"{m}: budgets max/min {trial[m]['max_over_min']:.3f} rates {rates}")
            print(f"trial {t + 1:3d}  " + "  ".join(line), flush=True)
    summary = {}
    for method in trials[0]:
        if method in ("first", "load1"):
            continue
        mm = [t[method]["max_over_min"] for t in trials]
        raw = [t[method]["rate_max_over_min"] for t in trials]
        summary[method] = {"trials": len(mm), "over_1_10": sum(x > 1.10 for x in mm), "worst": max(mm),
                           "raw_rates_over_1_10": sum(x > 1.10 for x in raw), "raw_worst": max(raw)}
        print(f"{method:6s}: budget max/min > 1.10 in {summary[method]['over_1_10']} of {len(mm)} trials "
              f"(worst {max(mm):.3f}); raw rates > 1.10 apart in {summary[method]['raw_rates_over_1_10']} "
              f"(worst {max(raw):.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine(), "processes": args.processes, "hog": args.hog, "before_tree": str(args.before_tree or ""),
        "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "trials": trials}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
