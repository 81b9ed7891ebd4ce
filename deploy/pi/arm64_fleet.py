"""A fleet with one agent on emulated arm64: run by deploy/pi/prove_arm64_fleet.sh (x86 side).

Starts a key server, a coordinator and agents c001.. on x86 (this checkout) and agent c000
inside the arm64 root (its venv's python under qemu-aarch64-static via binfmt_misc, with
QEMU_CPU=CPU), through `senseshield fleet up`'s own launcher (senseshield.runtime.fleet:
its identities, signed trust file listing c000, signed job, one profile per agent); its
`wrap` hook rewrites c000's command line into `chroot ROOT /opt/agent/bin/python -m
edge_agent.cli join ...`. The run directory lies inside the root, so c000 reads its
identity, trust file and profile at the same path minus the root prefix. Then it runs the
simulator (x86) on the same job and compares the two: clusters, budgets and masks must be
equal, and each round's model (and the key server's float64 models) must lie within a
tolerance that says what it allows.

A masked job sends fixed-point words: an update value rounds to a step of 2^-24 (64-bit
ring) or 2^-15 (32-bit ring, which ``ring_bits: auto``, the default, takes for a job this
small). c000's float arithmetic on arm64 differs from x86's by ~1e-7 (mlp_check.py), so
a few of its values round to the neighbouring step. Hence:

- round 1 (every agent starts from the same model): within
  ``compare.masked_round_tolerance`` (c000's share of its cluster's weight × (one ring step
  + ATOL) + 2 float32 ulps): 1.054e-5 for 3 equal agents on the 32-bit ring, 3.83e-7 on 64
  bits (ATOL 1e-6, the MLP's largest weight in [1, 2));
- later rounds on the 64-bit ring: within ATOL (default 1e-6, the float difference allowed);
- later rounds on the 32-bit ring: reported, not checked: every agent starts from a model
  that already differs by up to a third of a step (1e-5), and training moves that further.

    python arm64_fleet.py ROOT BROKER_URL [--cpu cortex-a72] [--agents 3] [--rounds 3] [--ring 64] [--atol 1e-6]

Prints one JSON object (the measurements) as its last line; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from compare import masked_round_tolerance
from senseshield import Job
from senseshield.he.masked import RINGS
from senseshield.strategies import build_strategy
from senseshield.determinism import first_difference, fleet_trace
from senseshield.runtime.fleet import FleetOptions, fleet_up
from senseshield.simulation import run_simulation

ARM_AGENT = "c000"
VENV = "/opt/agent"


def _stamp(line: str, day: datetime) -> float:
    """The epoch time of a log line's leading HH:MM:SS.mmm (today, local time)."""
    t = datetime.strptime(line[:12], "%H:%M:%S.%f").time()
    return datetime.combine(day.date(), t).timestamp()


def ready_seconds(log: Path, spawned: float) -> tuple[float, float, float]:
    """Seconds from the process's start to its first log line, to `connected to fleet`, and to
    joining the job (torch and the training code load when it checks its first job)."""
    day = datetime.fromtimestamp(spawned)
    lines = log.read_text(errors="replace").splitlines()
    first = next(_stamp(x, day) for x in lines if re.match(r"\d\d:\d\d:\d\d\.\d{3} ", x))
    ready = next(_stamp(x, day) for x in lines if "connected to fleet" in x)
    joined = next(_stamp(x, day) for x in lines if " joined job " in x)
    return first - spawned, ready - spawned, joined - spawned


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("broker")
    ap.add_argument("--cpu", default="cortex-a72")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategy", default="masked")
    ap.add_argument("--ring", default="auto", help="the job's ring_bits (masked): auto, 32 or 64")
    ap.add_argument("--atol", type=float, default=1e-6,
                    help="float difference allowed between arm64's and x86's arithmetic")
    ap.add_argument("--fleet", default="arm64")
    args = ap.parse_args()

    root = args.root.resolve()
    out = root / "tmp" / "arm64-fleet"  # inside the root: c000 sees it as /tmp/arm64-fleet
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spawned: dict[str, float] = {}
    threads = 1

    def wrap(name: str, argv: list[str]) -> list[str]:
        spawned[name] = time.time()
        if name != ARM_AGENT:
            return argv
        assert argv[1:3] == ["-m", "edge_agent.cli"], argv
        inside = [a[len(str(root)):] if a.startswith(str(root) + "/") else a for a in argv[3:]]
        return ["env", "-i", "PATH=/opt/agent/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8",
                f"QEMU_CPU={args.cpu}", "PYTHONUNBUFFERED=1", f"OMP_NUM_THREADS={threads}",
                shutil.which("chroot") or "/usr/sbin/chroot", str(root),
                f"{VENV}/bin/python", "-m", "edge_agent.cli", *inside]

    options = {"ring_bits": args.ring} if args.strategy.startswith("masked") else {}
    config = Job(strategy=args.strategy, model="mlp", clients=args.agents, rounds=args.rounds, options=options)
    began = time.time()
    report = fleet_up(config, FleetOptions(agents=args.agents, out=out, broker=args.broker, fleet=args.fleet,
                                           threads=threads, round_deadline=900, join_timeout=900,
                                           wrap=wrap), timeout=3600)
    fleet_s = time.time() - began
    began = time.time()
    sim = run_simulation(config, trace=True)
    sim_s = time.time() - began

    fleet = fleet_trace(out)
    per_round = {r: max(float(np.max(np.abs(fleet.models[r][k].astype(np.float64) - w.astype(np.float64))))
                        for k, w in sim.trace.models[r].items()) for r in sorted(sim.trace.models)}
    with np.load(out / "keys" / f"models-{args.fleet}.npz") as data:
        meta = json.loads(bytes(data["meta"]).decode())
        ks = {int(k): data[f"c{k}"].copy() for k in meta["rounds"]}
    final = max(float(np.max(np.abs(ks[k] - np.asarray(w, dtype=np.float64)))) for k, w in sim.models.items())

    # the ring the coordinator planned (the simulator computes it from the same numbers)
    weights = {c.id: c.n_train for c in sim.clients}
    clusters = {c.id: c.cluster for c in sim.clients}
    strategy = build_strategy(config.strategy, config.options)
    ring = None
    if args.strategy.startswith("masked"):
        ring = max(strategy.ring_bits([weights[a] for a in clusters if clusters[a] == k]) for k in set(clusters.values()))
    largest = max(float(np.max(np.abs(w))) for w in sim.trace.models[1].values())
    first_tol = (masked_round_tolerance(RINGS[ring].fraction_bits, weights, clusters, [ARM_AGENT],
                                        float_atol=args.atol, largest=largest, server_lr=config.options.server_lr)
                 if ring else args.atol)
    tolerance = {r: (first_tol if r == 1 else args.atol if ring != 32 else None) for r in per_round}
    # clusters, budgets and masks exactly; the models per round by tolerance (below)
    difference = first_difference(sim.trace, fleet, ("simulator", "fleet"), atol=float("inf"))
    failed = [r for r, d in per_round.items() if tolerance[r] is not None and d > tolerance[r]]
    final_tol = tolerance[max(per_round)]
    if final_tol is not None and final > final_tol:
        failed.append("key server")

    agents = {a["id"]: a for a in report["agents"]}
    result = {
        "machine": "x86 coordinator/key server/agents + arm64 " + ARM_AGENT + f" (QEMU_CPU={args.cpu})",
        "strategy": args.strategy, "agents": args.agents, "rounds": args.rounds,
        "exit_codes": report["exit_codes"],
        "fleet_seconds": round(fleet_s, 1), "simulator_seconds": round(sim_s, 1),
        "ready_s": {a: [round(x, 1) for x in ready_seconds(out / "logs" / f"{a}.log", spawned[a])]
                    for a in sorted(spawned) if a.startswith("c") and a != "coordinator"},
        "round_seconds": [round(r["seconds"], 1) for r in report["rounds"]],
        "accuracy": {"fleet": [r["accuracy"] for r in report["rounds"]], "simulator": [r.accuracy for r in sim.rounds]},
        "train_s": {a: [round(agents[a]["rounds"].get(str(r), {}).get("phases", {}).get("train", float("nan")), 2)
                        for r in range(1, args.rounds + 1)] for a in sorted(agents)},
        "ring_bits": ring, "weights": weights,
        "max_diff_per_round": {str(r): d for r, d in per_round.items()},
        "tolerance_per_round": {str(r): t for r, t in tolerance.items()},
        "failed": [str(f) for f in failed],
        "max_diff_final_keyserver": final,
        "masks_equal": fleet.masks == sim.trace.masks, "budgets_equal": fleet.budgets == sim.trace.budgets,
        "first_difference": difference,
        "atol": args.atol, "largest_weight_round1": largest,
    }
    print(json.dumps(result))
    ok = difference is None and not failed and all(c == 0 for c in report["exit_codes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
