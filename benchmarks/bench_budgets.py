"""Budget stability: identical agents started together on this machine, max/min encryption budget per join.

Each join is a real fleet (keyserver, coordinator and N `edge-agent join --profile auto`
processes on the embedded broker of `fleet up`, or --broker), SenseCrypt, stopped as soon as
every agent has its Assignment (no training rounds). By default the budgets are the default
`budget_mode` (measured: from the encryption rate every agent measured at start-up) and every
join runs twice, alternating: with the machine as it is ("idle") and beside a CPU hog (a
busy-looping process pinned to CPU 0, `--hogs 0` to skip), so both see the same machine
noise. `--compare-probes` runs the old comparison of the bandwidth probe instead: one short
best-of-two probe, figures as reported ("before") against medians of several probes with
agreeing devices pooled ("after"), alternating.

    python benchmarks/bench_budgets.py [--joins 5] [--agents 3] [--mode measured|paper|calibrated]
        [--hogs 1] [--label after] [--append] [--broker mqtt://...] [--out benchmarks/results/budgets-measured.json]

`--append` adds the joins to those already in --out (same agents and mode): two code trees can
be measured alternately, one join each (PYTHONPATH=tree), into two files.
    python benchmarks/bench_budgets.py --compare-probes --mode paper --agents 6 --out benchmarks/results/budgets.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from edge_agent.probes import cpu_name
from senseshield.bench.budgets import cpu_hog, join, spread

PROBES = {"before": {"probe": "single", "tolerance": None}, "after": {"probe": "robust", "tolerance": 0.05}}


def machine() -> dict:
    """CPU, vCPUs, the first lines of `lscpu` and the load when the benchmark started."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()[:20]
    except (OSError, subprocess.SubprocessError):
        lscpu = []
    return {"cpu": f"{cpu_name()}, {os.cpu_count()} vCPUs, {platform.system()}", "lscpu": lscpu,
            "load_at_start": list(os.getloadavg())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--joins", type=int, default=5)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--mode", default="measured", help="budget_mode of the job (default: measured, the default)")
    parser.add_argument("--hogs", type=int, default=1, choices=(0, 1),
                        help="1: every join also beside a busy-looping process pinned to CPU 0; 0: idle only")
    parser.add_argument("--compare-probes", action="store_true",
                        help="old single bandwidth probe vs robust probes with pooling (no hog)")
    parser.add_argument("--label", default="", help="what code this run measures (e.g. before, after), kept in the JSON")
    parser.add_argument("--broker", default=None, help="mqtt://HOST:PORT (default: the embedded broker)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/budgets-measured.json"))
    parser.add_argument("--append", action="store_true", help="add to the joins already in --out")
    args = parser.parse_args()
    if args.compare_probes:
        setups = {name: {"hog": False, **path} for name, path in PROBES.items()}
    else:
        setups = {"idle": {"hog": False}, **({"hog": {"hog": True}} if args.hogs else {})}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    started = machine()
    if args.append and args.out.exists():
        before = json.loads(args.out.read_text())
        if (before.get("agents"), before.get("budget_mode"), before.get("compare_probes")) != (
                args.agents, args.mode, args.compare_probes):
            parser.error(f"--append: {args.out} holds joins of another setup (agents, mode, --compare-probes)")
        runs = {name: before["runs"].get(name, []) for name in setups}
        started = before["machine"]
        started.setdefault("loads_at_start", [started.get("load_at_start")]).append(list(os.getloadavg()))
    first = 1 + max((len(r) for r in runs.values()), default=0)
    for j in range(first, first + args.joins):
        for name, setup in setups.items():
            t = time.perf_counter()
            options = {k: v for k, v in setup.items() if k != "hog"}
            with tempfile.TemporaryDirectory() as tmp, (cpu_hog(0) if setup["hog"] else nullcontext()):
                load = os.getloadavg()[0]
                result = join(args.agents, Path(tmp), broker=args.broker, budget_mode=args.mode,
                              fleet=f"budgets-{name}-{j}", timeout=300, notes=True, **options)
            budgets, rates = result.budgets, result.rates
            runs[name].append({"budgets": budgets, "max_over_min": spread(budgets), "rates": rates,
                               "rate_max_over_min": spread(rates) if rates else None, "summaries": result.summaries,
                               "notes": result.notes, "load1": load, "seconds": time.perf_counter() - t})
            print(f"join {j} {name:6s} max/min {spread(budgets):6.3f}  budgets "
                  f"{' '.join(f'{b:.3f}' for b in budgets.values())}  rates "
                  f"{' '.join(f'{r / 1000:.1f}k' for r in rates.values())}  load {load:.1f}  "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    summary = {}
    for name, joins in runs.items():
        values = [b for run in joins for b in run["budgets"].values()]
        summary[name] = {"worst_join_max_over_min": max(r["max_over_min"] for r in joins),
                         "per_join": [round(r["max_over_min"], 4) for r in joins],
                         "joins_within_1_10": sum(r["max_over_min"] <= 1.10 for r in joins),
                         "min_budget": min(values), "max_budget": max(values)}
        print(f"{name:6s}: worst join max/min {summary[name]['worst_join_max_over_min']:.3f}; "
              f"{summary[name]['joins_within_1_10']} of {len(joins)} joins within 1.10; "
              f"budgets over all joins {min(values):.3f} .. {max(values):.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "label": args.label, "machine": started, "agents": args.agents, "joins": max(len(r) for r in runs.values()),
        "budget_mode": args.mode,
        "compare_probes": args.compare_probes, "broker": args.broker or "embedded",
        "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
