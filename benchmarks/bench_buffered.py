"""Buffered rounds against synchronous rounds and partial work, with one device 20x slower.

A local fleet (`fleet up`'s processes: embedded broker, key server, coordinator, N agents)
runs the default `masked` strategy on digits with the MLP; the last agent runs under a cgroup
CPU quota (5 % of a CPU by default, from its start: the trials' way of making a device 20x
slower, :func:`senseshield.trials.emulation.quota_group`). Three runs, same seed, alternated per repeat:

* ``sync``: every round waits for every device (``--rounds`` rounds);
* ``partial``: partial work, ``straggle_limit=2`` (the slow device trains fewer steps);
* ``buffered``: ``buffer = N - 1``: a round closes at N - 1 updates, the slow device's work
  lands in later rounds weighted for its staleness (``--buffered-rounds`` rounds).

Per run: for every round, the seconds from the first round's start to the round's end (the
coordinator's record) and the accuracy of the key server's model of that round on the
devices' held-out samples (the union of the shards' test splits, evaluated here from
``OUT/models/round-R/cluster-0.npy``), and the CPU seconds of the machine over the run. The
figure of merit: wall seconds until a run's model first reaches the synchronous run's final
accuracy. Needs root and a writable cpu cgroup controller.

    python benchmarks/bench_buffered.py [--agents 4] [--rounds 10] [--buffered-rounds 30] [--quota 0.05]
        [--epochs N] [--repeats 1] [--out benchmarks/results/buffered.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from senseshield.bench.machine import cpu_model
from senseshield.errors import ConfigError
from senseshield.job import Job, initial_model, train_config
from senseshield.runtime.fleet import FleetOptions, agent_ids, fleet_up
from senseshield.strategies.base import StrategyOptions
from senseshield.trials.emulation import _remove_cgroup, in_cgroup, quota_group

RUNS = {
    "sync": lambda n: StrategyOptions(),
    "partial": lambda n: StrategyOptions(straggle_limit=2.0),
    "buffered": lambda n: StrategyOptions(buffer=max(n - 1, 2)),
}


def held_out(job: Job):  # noqa: ANN201 - (model, x, y, train config)
    """The job's model and the union of its shards' test splits (what the devices evaluate on)."""
    from senseshield.data.datasets import load_dataset
    from senseshield.simulation import build_clients

    dataset = load_dataset(job.dataset, seed=job.seed)
    clients = build_clients(job, dataset)
    x = np.concatenate([c.data.x_test for c in clients])
    y = np.concatenate([c.data.y_test for c in clients])
    model, _ = initial_model(job, dataset.input_shape, dataset.num_classes)
    return model, x, y, train_config(job)


def accuracies(out: Path, rounds: int, held) -> list[float | None]:  # noqa: ANN001
    """Accuracy of every round's cluster-0 model on the held-out samples (None: no model that round)."""
    from senseshield.training import evaluate_model, set_vector

    model, x, y, train = held
    found = []
    for r in range(1, rounds + 1):
        path = out / "models" / f"round-{r}" / "cluster-0.npy"
        if not path.exists():
            found.append(None)
            continue
        set_vector(model, np.load(path))
        found.append(round(float(evaluate_model(model, x, y, train)["accuracy"]), 4))
    return found


def cpu_seconds() -> float:
    """User + system CPU seconds of the machine so far (/proc/stat, all cores)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def run(name: str, agents: int, rounds: int, slow: str, group: Path, epochs: int | None, held) -> dict:  # noqa: ANN001
    more = {} if epochs is None else {"local_epochs": epochs}
    job = Job(strategy="masked", model="mlp", dataset="digits", partition="iid", clients=agents, rounds=rounds,
              seed=0, options=RUNS[name](agents), **more)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        options = FleetOptions(agents=agents, out=out, round_deadline=300, join_timeout=600, min_contributors=1,
                               wrap=lambda who, argv: in_cgroup(group, argv) if who == slow else argv)
        t, cpu = time.perf_counter(), cpu_seconds()
        report = fleet_up(job, options, timeout=3600)
        seconds, cpu = time.perf_counter() - t, cpu_seconds() - cpu
        found = accuracies(out, rounds, held)
    server = report["server"]
    t0 = server[0]["started_at"]
    ends = [round(s["finished_at"] - t0, 2) for s in server]
    slow_rounds = [int(r) for r, x in next(a for a in report["agents"] if a["id"] == slow)["rounds"].items()
                   if x.get("delivered")]
    return {"run": name, "options": job.options.model_dump(exclude_defaults=True), "rounds": rounds,
            "seconds_total": round(seconds, 1), "cpu_seconds": round(cpu, 1), "round_end_s": ends,
            "round_s_median": round(float(np.median(np.diff([0.0, *ends]))), 3), "accuracy": found,
            "slow_device_counted_in": slow_rounds, "final_accuracy": found[-1]}


def time_to(target: float, result: dict) -> float | None:
    """Seconds from the first round's start until the run's model first reaches ``target``."""
    for acc, end in zip(result["accuracy"], result["round_end_s"]):
        if acc is not None and acc >= target - 1e-9:
            return end
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the synchronous and partial-work runs")
    parser.add_argument("--buffered-rounds", type=int, default=30, help="rounds (buffers) of the buffered run")
    parser.add_argument("--quota", type=float, default=0.05, help="CPU share of the slow agent (0.05: 20x slower)")
    parser.add_argument("--epochs", type=int, default=None, help="local epochs per round (default: the job's)")
    parser.add_argument("--repeats", type=int, default=1, help="alternated repeats of the three runs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/buffered.json"))
    args = parser.parse_args()
    held = held_out(Job(strategy="masked", model="mlp", dataset="digits", partition="iid", clients=args.agents,
                        rounds=args.rounds, seed=0))
    slow = agent_ids(args.agents)[-1]
    result: dict = {"machine": f"{cpu_model()}, {os.cpu_count()} vCPUs, {platform.system()}",
                    "date": time.strftime("%Y-%m-%d"), "agents": args.agents, "slow_agent": slow, "quota": args.quota,
                    "epochs": args.epochs, "model": "mlp", "dataset": "digits", "strategy": "masked", "runs": []}
    try:
        group = quota_group(args.quota, name="buffered")
    except ConfigError as exc:
        raise SystemExit(f"bench_buffered: {exc}") from None
    try:
        for repeat in range(args.repeats):
            found = {}
            for name in RUNS:
                rounds = args.buffered_rounds if name == "buffered" else args.rounds
                found[name] = run(name, args.agents, rounds, slow, group, args.epochs, held)
            target = found["sync"]["final_accuracy"]
            for name, x in found.items():
                x.update(repeat=repeat, target=target, seconds_to_target=time_to(target, x))
                result["runs"].append(x)
                print(f"repeat {repeat} {name:8s}: {x['rounds']} rounds in {x['round_end_s'][-1]:.1f} s (median round "
                      f"{x['round_s_median']:.2f} s, {x['cpu_seconds']:.0f} CPU s), final accuracy {x['final_accuracy']}, "
                      f"reaches {target} after {x['seconds_to_target']} s; slow device counted in rounds "
                      f"{x['slow_device_counted_in']}", flush=True)
    finally:
        _remove_cgroup(group)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
