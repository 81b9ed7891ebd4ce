"""Budget stability: 6 identical agents on this machine, max/min encryption budget per join.

Each join is a real fleet (keyserver, coordinator and 6 `edge-agent join --profile auto`
processes on the embedded broker of `fleet up`, or --broker), SenseCrypt in the default budget mode,
stopped as soon as every agent has its Assignment (no training rounds). Joins alternate
between the old path ("before": one short best-of-two bandwidth probe, figures used as
reported) and the current one ("after": medians of several probes of a minimum duration,
devices whose probe intervals overlap pooled), so both see the same machine noise.

    python benchmarks/bench_budgets.py [--joins 5] [--agents 6] [--broker mqtt://...] [--out benchmarks/results/budgets.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from edge_agent.profile import cpu_name
from senseshield.bench.budgets import join_budgets, spread

PATHS = {"before": {"probe": "single", "tolerance": None}, "after": {"probe": "robust", "tolerance": 0.05}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--joins", type=int, default=5)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--broker", default=None, help="mqtt://HOST:PORT (default: the embedded broker)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/budgets.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in PATHS}
    for j in range(1, args.joins + 1):
        for name, path in PATHS.items():
            t = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                budgets = join_budgets(args.agents, Path(tmp), broker=args.broker, fleet=f"budgets-{name}-{j}", **path)
            runs[name].append({"budgets": budgets, "max_over_min": spread(budgets), "seconds": time.perf_counter() - t})
            print(f"join {j} {name:6s} max/min {spread(budgets):6.3f}  budgets "
                  f"{' '.join(f'{b:.3f}' for b in budgets.values())}  ({time.perf_counter() - t:.0f} s)", flush=True)
    summary = {}
    for name, joins in runs.items():
        values = [b for run in joins for b in run["budgets"].values()]
        summary[name] = {"worst_join_max_over_min": max(r["max_over_min"] for r in joins),
                         "per_join": [round(r["max_over_min"], 4) for r in joins],
                         "min_budget": min(values), "max_budget": max(values)}
        print(f"{name:6s}: worst join max/min {summary[name]['worst_join_max_over_min']:.3f}; "
              f"budgets over all joins {min(values):.3f} .. {max(values):.3f}")
    machine = f"{cpu_name()}, {os.cpu_count()} vCPUs, {platform.system()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "agents": args.agents, "joins": args.joins,
                                    "broker": args.broker or "embedded", "summary": summary, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
