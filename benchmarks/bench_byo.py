"""Bring your own model and data, measured: the worked example (examples/har) on a fleet.

(i)  The worked example (``examples/har/job.yaml``: the 1-D CNN ``har_cnn`` on synthetic
     accelerometer windows, one ``.npz`` per device from ``make_data.py``), N devices and R
     rounds, plaintext vs sensecrypt (packed Paillier 2048) through ``fleet up`` (every role
     an OS process, embedded broker, agent i with ``--data device-i.npz --index i``): final
     accuracy, mean round seconds (round 1 excluded: warm-up), MB up/down per round; and the
     same job and files in the simulator (``run_simulation(job, devices=...)``), which must
     give the same accuracies.
(ii) Agent memory: the RSS of every agent process (psutil, sampled every 50 ms) during the
     runs, for the HAR CNN on its own data and for the built-in MLP on digits shards (same
     strategy, sensecrypt, same N and R).

    python benchmarks/bench_byo.py [--devices 6] [--rounds 5] [--out benchmarks/results/byo.json]

Writes JSON and prints Markdown tables. The machine is shared: ratios next to absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_fleet import summarise  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from senseshield.bench.machine import cpu_model as _cpu_model  # noqa: E402
from senseshield.data.local import load_local_data  # noqa: E402
from senseshield.job import Job, job_from_dict, job_shape, with_shape  # noqa: E402
from senseshield.runtime.fleet import FleetOptions, fleet_up  # noqa: E402
from senseshield.simulation import run_simulation  # noqa: E402

EXAMPLE = ROOT / "examples" / "har"
SAMPLE_S = 0.05


class RssSampler:
    """RSS of this process's agent children (``edge_agent.cli``) every 50 ms, with the fleet's
    progress (agents joined, rounds finished) at each sample."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int, dict[int, int]]] = []  # (t, joined, rounds done, pid -> rss)
        self.joined = self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def progress(self, phase: str, done: int, total: int) -> None:
        if phase == "join":
            self.joined = max(self.joined, done)
        elif phase == "round":
            self.rounds = max(self.rounds, done)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            rss = {}
            for child in me.children(recursive=True):
                try:
                    if "edge_agent.cli" in child.cmdline():
                        rss[child.pid] = child.memory_info().rss
                except psutil.Error:
                    continue
            if rss:
                self.samples.append((time.monotonic(), self.joined, self.rounds, rss))
            self._stop.wait(SAMPLE_S)

    def summary(self, agents: int, rounds: int) -> dict:
        """MB: each agent's RSS when the whole fleet had joined, its peak while rounds
        2..R ran (after round 1's result, before round R's), and its peak over the run."""
        mb = 1 / 2**20
        joined = next((rss for _, j, _, rss in self.samples if j >= agents and len(rss) == agents), {})
        in_rounds: dict[int, int] = {}
        for _, _, done, rss in self.samples:
            if 1 <= done < rounds:
                for pid, value in rss.items():
                    in_rounds[pid] = max(in_rounds.get(pid, 0), value)
        peak: dict[int, int] = {}
        for *_, rss in self.samples:
            for pid, value in rss.items():
                peak[pid] = max(peak.get(pid, 0), value)
        return {
            "samples": len(self.samples),
            "at_join_mb_mean": float(np.mean(list(joined.values())) * mb) if joined else None,
            "in_rounds_peak_mb_mean": float(np.mean(list(in_rounds.values())) * mb) if in_rounds else None,
            "in_rounds_peak_mb_max": float(max(in_rounds.values()) * mb) if in_rounds else None,
            "run_peak_mb_max": float(max(peak.values()) * mb) if peak else None,
        }


def har_job(strategy: str, rounds: int, devices: int) -> Job:
    """examples/har/job.yaml for ``strategy`` (sensecrypt as written: packed Paillier 2048)."""
    data = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    data.update(strategy=strategy, rounds=rounds, min_devices=devices, clients=devices, name=f"har-{strategy}")
    return job_from_dict(data, where="examples/har/job.yaml")


def run_fleet(job: Job, agents: int, files: list[Path] | None, tag: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp, RssSampler() as sampler:
        t = time.monotonic()
        report = fleet_up(job, FleetOptions(agents=agents, out=Path(tmp), fleet=f"byo-{tag}", data=files),
                          sampler.progress, timeout=1800)
        wall = time.monotonic() - t
    assert all(code == 0 for code in report["exit_codes"].values()), report["exit_codes"]
    result = summarise(report)
    result.update(wall_seconds=wall, accuracies=[r["accuracy"] for r in report["rounds"]],
                  num_params=report["num_params"], rss=sampler.summary(agents, job.rounds),
                  declined=report["declined"])
    return result


def run_sim(job: Job, files: list[Path]) -> dict:
    shape, classes = job_shape(job)
    devices = [load_local_data(f, input_shape=shape, num_classes=classes, test_fraction=job.test_fraction, seed=job.seed)
               for f in files]
    t = time.monotonic()
    result = run_simulation(job, devices=devices)
    wall = time.monotonic() - t
    rounds = result.rounds[1:] or result.rounds
    return {
        "final_accuracy": result.final_accuracy,
        "accuracies": [r.accuracy for r in result.rounds],
        "round_seconds": float(np.mean([r.seconds for r in rounds])),
        "mb_up_per_round": float(np.mean([r.bytes_up for r in rounds]) / 1e6),
        "mb_down_per_round": float(np.mean([r.bytes_down for r in rounds]) / 1e6),
        "wall_seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "byo.json")
    args = parser.parse_args()
    os.chdir(ROOT)  # the job names its model by a path from the repository root
    load = {"start": os.getloadavg()}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--devices", str(args.devices), "--out", tmp,
                        "--seed", "0"], check=True, capture_output=True)
        files = sorted(Path(tmp).glob("device-*.npz"))
        for strategy in ("plaintext", "sensecrypt"):
            job = har_job(strategy, args.rounds, args.devices)
            results[f"fleet/har/{strategy}"] = run_fleet(job, args.devices, files, f"har-{strategy}")
            print(strategy, "fleet", json.dumps(results[f"fleet/har/{strategy}"]), flush=True)
            results[f"sim/har/{strategy}"] = run_sim(job, files)
            print(strategy, "sim", json.dumps(results[f"sim/har/{strategy}"]), flush=True)
    mlp = with_shape(Job(strategy="sensecrypt", model="mlp", dataset="digits", partition="iid", rounds=args.rounds,
                         clients=args.devices, min_devices=args.devices))
    results["fleet/mlp-digits/sensecrypt"] = run_fleet(mlp, args.devices, None, "mlp")
    print("mlp fleet", json.dumps(results["fleet/mlp-digits/sensecrypt"]), flush=True)
    load["end"] = os.getloadavg()

    for kind in ("fleet", "sim"):
        base = results[f"{kind}/har/plaintext"]
        for strategy in ("plaintext", "sensecrypt"):
            r = results[f"{kind}/har/{strategy}"]
            r["round_ratio_to_plaintext"] = r["round_seconds"] / base["round_seconds"]
            r["mb_up_ratio_to_plaintext"] = r["mb_up_per_round"] / base["mb_up_per_round"]
        for strategy in ("plaintext", "sensecrypt"):
            results[f"fleet/har/{strategy}"]["same_accuracies_as_sim"] = bool(np.allclose(
                results[f"fleet/har/{strategy}"]["accuracies"], results[f"sim/har/{strategy}"]["accuracies"], atol=1e-9, rtol=0))
    out = {"machine": {"cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)), "shared": True,
                       "load_average_1_5_15": load, "python": sys.version.split()[0]},
           "devices": args.devices, "rounds": args.rounds, "broker": "embedded (amqtt)",
           "rss_sample_seconds": SAMPLE_S, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}\n")
    print(tables(out))


def tables(out: dict) -> str:
    """The Markdown tables of a result file (docs/results.md and docs/your-model-and-data.md)."""
    res = out["results"]
    lines = [f"{out['devices']} devices, {out['rounds']} rounds, one `.npz` per device (240 training windows); "
             "round seconds: mean of\nrounds 2..R; MB per round: all devices together.", "",
             "| run | final accuracy | round s | x plaintext | MB up / round | x plaintext | MB down / round |",
             "|---|---|---|---|---|---|---|"]
    for kind, label in (("fleet", "`fleet up`"), ("sim", "simulator")):
        for strategy in ("plaintext", "sensecrypt"):
            r = res[f"{kind}/har/{strategy}"]
            lines.append(f"| {label}, {strategy} | {r['final_accuracy']:.3f} | {r['round_seconds']:.2f} | "
                         f"{r['round_ratio_to_plaintext']:.2f} | {r['mb_up_per_round']:.3f} | "
                         f"{r['mb_up_ratio_to_plaintext']:.1f} | {r['mb_down_per_round']:.3f} |")
    mlp, har = res["fleet/mlp-digits/sensecrypt"]["rss"], res["fleet/har/sensecrypt"]["rss"]
    lines += ["", "| agent RSS (sensecrypt, `fleet up`) | model values | at join, MB | peak in rounds 2..R, MB (mean / max of agents) | x MLP |",
              "|---|---|---|---|---|"]
    for name, key, rss in (("built-in `mlp` on digits shards", "fleet/mlp-digits/sensecrypt", mlp),
                           ("`har_cnn` on its own `.npz`", "fleet/har/sensecrypt", har)):
        lines.append(f"| {name} | {res[key]['num_params']} | {rss['at_join_mb_mean']:.0f} | "
                     f"{rss['in_rounds_peak_mb_mean']:.0f} / {rss['in_rounds_peak_mb_max']:.0f} | "
                     f"{rss['in_rounds_peak_mb_mean'] / mlp['in_rounds_peak_mb_mean']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
