"""What one device sending a bad-fingerprint update every round costs a fleet (issue 23 item 1).

A `Fleet` on a real Mosquitto (``--agents`` agents in one cluster, linear model, ``--rounds``
rounds) per strategy, with c002 (its genuine key, senseshield_checks.bad_contribution)
sending before its real update of every round from round 2 on its previous round's update
re-signed for the round (the fingerprint of another challenge). Prints per strategy the
rounds attacked, the rounds c002's cluster lost (its model unchanged; and any cluster's: a
cluster of one device is refused by the minimum of contributors, attack or not), the rounds
whose notes name
c002, the mean round seconds, and the final accuracy next to the simulator's.

``--bad c001 c002``: two bad devices at once (in one cluster for ``masked``; the rounds lost
and named are then counted for each).

    python benchmarks/bench_bad_contribution.py [--rounds 5] [--agents 4] [--strategies masked sensecrypt] [--bad c002]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from senseshield.job import Job
from senseshield.runtime.broker import MosquittoProcess
from senseshield.runtime.fleet import Fleet, FleetOptions
from senseshield.simulation import run_simulation
from senseshield_checks.bad_contribution import BadDevice, named, rounds_lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=["masked", "sensecrypt"])
    parser.add_argument("--bad", nargs="+", default=["c002"], help="the devices sending a bad update every round")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bad-contribution-"))
    (tmp / "broker").mkdir()
    broker = MosquittoProcess(tmp / "broker")
    broker.start()
    try:
        for strategy in args.strategies:
            config = Job(strategy=strategy, model="linear", clients=args.agents, rounds=args.rounds, key_bits=2048)
            options = FleetOptions(agents=args.agents, out=tmp / strategy, broker=broker.url, fleet=f"bad-{strategy}",
                                   round_deadline=60, min_contributors=2)
            t0 = time.time()
            with Fleet(config, options) as fleet:
                fleet.start()
                bad = [BadDevice(broker.url, f"bad-{strategy}", d, fleet.out / "identities" / f"{d}.key")
                       for d in args.bad]
                try:
                    report = fleet.wait(timeout=900)
                finally:
                    for device in bad:
                        device.stop()
            figures = {
                "strategy": strategy, "agents": args.agents, "rounds": args.rounds, "bad": args.bad,
                "attacked": {d.device: d.sent for d in bad},
                "rounds_lost": {d: rounds_lost(report, d) for d in args.bad}, "rounds_lost_any_cluster": rounds_lost(report),
                "named_in_rounds": {d: named(report, d) for d in args.bad},
                "mean_round_s": round(sum(r["seconds"] for r in report["rounds"]) / len(report["rounds"]), 2),
                "final_accuracy": round(report["final_accuracy"], 4),
                "simulator_accuracy": round(run_simulation(config).final_accuracy, 4),
                "run_s": round(time.time() - t0, 1),
            }
            print(json.dumps(figures), flush=True)
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
