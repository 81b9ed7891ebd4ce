"""A fleet with one agent on emulated arm64: run by deploy/pi/prove_arm64_fleet.sh (x86 side).

Starts a key server, a coordinator and agents c001.. on x86 (this checkout) and agent c000
inside the arm64 root (its venv's python under qemu-aarch64-static via binfmt_misc, with
QEMU_CPU=CPU), through `senseshield fleet up`'s own launcher (senseshield.runtime.fleet:
its identities, signed trust file listing c000, signed job, one profile per agent); its
`wrap` hook rewrites c000's command line into `chroot ROOT /opt/agent/bin/python -m
edge_agent.cli join ...`. The run directory lies inside the root, so c000 reads its
identity, trust file and profile at the same path minus the root prefix. Then it runs the
simulator (x86) on the same job and compares: the trace (clusters, budgets, masks, each
round's model) within ATOL, and the key server's float64 models.

    python arm64_fleet.py ROOT BROKER_URL [--cpu cortex-a72] [--agents 3] [--rounds 3] [--atol 1e-5]

Prints one JSON object (the measurements) as its last line; exit 1 if the fleet's model
differs from the simulator's by more than ATOL.
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

from senseshield import Job
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
    ap.add_argument("--atol", type=float, default=1e-5)
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

    config = Job(strategy=args.strategy, model="mlp", clients=args.agents, rounds=args.rounds)
    began = time.time()
    report = fleet_up(config, FleetOptions(agents=args.agents, out=out, broker=args.broker, fleet=args.fleet,
                                           threads=threads, round_deadline=900, join_timeout=900,
                                           wrap=wrap), timeout=3600)
    fleet_s = time.time() - began
    began = time.time()
    sim = run_simulation(config, trace=True)
    sim_s = time.time() - began

    fleet = fleet_trace(out)
    difference = first_difference(sim.trace, fleet, ("simulator", "fleet"), atol=args.atol)
    per_round = {r: max(float(np.max(np.abs(fleet.models[r][k].astype(np.float64) - w.astype(np.float64))))
                        for k, w in sim.trace.models[r].items()) for r in sorted(sim.trace.models)}
    with np.load(out / "keys" / f"models-{args.fleet}.npz") as data:
        meta = json.loads(bytes(data["meta"]).decode())
        ks = {int(k): data[f"c{k}"].copy() for k in meta["rounds"]}
    final = max(float(np.max(np.abs(ks[k] - np.asarray(w, dtype=np.float64)))) for k, w in sim.models.items())

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
        "max_diff_per_round": {str(r): d for r, d in per_round.items()},
        "max_diff_final_keyserver": final,
        "masks_equal": fleet.masks == sim.trace.masks, "budgets_equal": fleet.budgets == sim.trace.budgets,
        "first_difference": difference,
        "atol": args.atol,
    }
    print(json.dumps(result))
    ok = difference is None and final <= args.atol and all(c == 0 for c in report["exit_codes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
