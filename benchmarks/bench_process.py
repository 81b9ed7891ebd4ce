"""Start and stop of the three services as real processes (issue 23 item 6, issue 25 item 5).

Starts a Mosquitto on a free loopback port, then each service (`keyserver serve`,
`coordinator serve`, `edge-agent join` with the default ``--profile auto`` and with a declared
profile, ``--profile rpi4``) alone, as its own OS process, and measures:

- first line: seconds from the process start to its first output line;
- ready: seconds to its retained status "online" on the broker (for the agent that is after
  its device profile is measured and it is connected);
- idle RSS: the process's resident memory (VmRSS in /proc) 2 s after ready;
- training RSS (agent): VmRSS of agent c000 of the fleet below 1 s into its round-2 training,
  and its peak so far (VmHWM: rounds 1 and 2, evaluation included);
- SIGTERM idle: seconds from SIGTERM to the process's exit, with its exit code.

Then a 3-agent fleet (`senseshield.runtime.fleet.Fleet`, plaintext, enough local epochs
that local training takes several seconds) and, once agent c000 has round 2's plan and has
not sent its update, SIGTERM to c000: seconds to its exit, mid-round. Each measure is
repeated ``--repeats`` times (median reported). Prints a table and writes
``benchmarks/results/process.json`` (``--out``).

``--tree NAME=DIR`` (repeatable) runs the services from that source tree (PYTHONPATH=DIR),
alternating the trees in every repeat, so a before/after comparison sees the same load.

    python benchmarks/bench_process.py [--repeats 3] [--epochs 300] [--agents-only] [--tree before=/tmp/old --tree after=.]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from senseshield.bench.machine import cpu_model
from senseshield.runtime.broker import MosquittoProcess

PYTHON = sys.executable




def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of a process in MB (``VmHWM``: its peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class StatusWatcher:
    """A plain paho client that notes when each retained status topic of a fleet first says
    anything (a service publishes "online" once it is connected and ready)."""

    def __init__(self, url: str, fleet: str) -> None:
        import paho.mqtt.client as mqtt

        host, port = url.removeprefix("mqtt://").split(":")
        self.seen: dict[str, float] = {}
        self.event = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-watch-{fleet}")
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        for topic in (f"ss/v1/{fleet}/+/status", f"ss/v1/{fleet}/agents/+/status"):
            self.client.subscribe(topic, qos=1)
        self.client.loop_start()
        self.prefix = f"ss/v1/{fleet}/"

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        with self.event:
            self.seen.setdefault(msg.topic.removeprefix(self.prefix), time.monotonic())
            self.event.notify_all()

    def wait(self, topic: str, timeout: float) -> float | None:
        with self.event:
            self.event.wait_for(lambda: topic in self.seen, timeout)
            return self.seen.get(topic)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Service:
    """One service process; its output is read line by line with the time of each line."""

    def __init__(self, argv: list[str], log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = log.open("w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, text=True)
        self.first: float | None = None
        self.first_line = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if self.first is None:
                self.first = time.monotonic()
                self.first_line.set()
            self.log.write(line)
        self.first_line.set()

    def terminate(self, timeout: float = 60.0) -> tuple[float | None, int | None]:
        """Seconds from SIGTERM to exit and the exit code; (None, None) for a hang (no exit
        within ``timeout``: SIGKILLed)."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
            took: float | None = time.monotonic() - t
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            took, code = None, None
        self.reader.join(5)
        self.log.close()
        return took, code


def one_service(role: str, broker: MosquittoProcess, tmp: Path, n: int | str) -> dict:
    fleet = f"bench-{role}-{n}"
    common = ["--broker", broker.url, "--fleet", fleet, "--insecure-dev"]  # start-up cost only: no trust file
    work = tmp / fleet
    work.mkdir()
    if role == "keyserver":
        argv, topic = [PYTHON, "-m", "keyserver.cli", "serve", *common, "--key-dir", str(work / "keys")], "keyserver/status"
    elif role == "coordinator":
        argv, topic = [PYTHON, "-m", "coordinator.cli", "serve", *common, "--state-dir", str(work / "state")], \
            "coordinator/status"
    else:  # agent: --profile auto (the default: measures this device), agent_rpi4: a declared profile
        profile = ["--profile", "rpi4"] if role == "agent_rpi4" else []
        argv, topic = [PYTHON, "-m", "edge_agent.cli", "join", *common, "--agent-id", "a0", "--shard", "0/3",
                       "--model-dir", str(work / "agent"), *profile], "agents/a0/status"
    watcher = StatusWatcher(broker.url, fleet)
    service = Service(argv, work / f"{role}.log")
    ready = watcher.wait(topic, timeout=300)
    service.first_line.wait(60)
    if ready is None:
        raise RuntimeError(f"{role} was not ready within 300 s; see {work / (role + '.log')}")
    time.sleep(2.0)
    rss = rss_mb(service.proc.pid)
    stop_s, code = service.terminate()
    watcher.stop()
    return {"first_line_s": (service.first or float("nan")) - service.t0, "ready_s": ready - service.t0,
            "idle_rss_mb": rss, "sigterm_idle_s": stop_s, "exit_code": code}


def mid_round(broker: MosquittoProcess, tmp: Path, n: int | str, epochs: int) -> dict:
    """SIGTERM agent c000 while it trains round 2 (its plan arrived, its update not sent)."""
    from senseshield.job import Job
    from senseshield.runtime.fleet import Fleet, FleetOptions
    from senseshield.runtime.transport import Link

    fleet_name = f"bench-round-{n}"
    seen: list[tuple[str, str, int, float]] = []
    watcher = Link(broker.url, client_id=f"bench-round-watch-{n}", fleet=fleet_name,
                   on_frame=lambda t, f: seen.append((t.rsplit("/", 1)[-1], f.schema, f.round, time.monotonic())))
    watcher.subscribe("agents/c000/inbox")
    watcher.subscribe("agents/c000/update")
    watcher.start()
    config = Job(strategy="plaintext", model="mlp", clients=3, rounds=4, local_epochs=epochs, round_deadline=600)
    options = FleetOptions(agents=3, out=tmp / fleet_name, broker=broker.url, fleet=fleet_name, min_contributors=1)
    with Fleet(config, options) as fleet:
        fleet.start()
        end = time.monotonic() + 600
        while not any(s == "round-plan" and r == 2 for _, s, r, _ in seen):
            if time.monotonic() > end:
                raise RuntimeError("round 2 never started")
            time.sleep(0.02)
        plan_at = next(t for _, s, r, t in seen if s == "round-plan" and r == 2)
        time.sleep(1.0)  # well inside local training (several seconds)
        agent = fleet.processes["c000"]
        training_rss, training_peak = rss_mb(agent.pid), rss_mb(agent.pid, "VmHWM")
        t = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(120)
        took = time.monotonic() - t
        updates = [(r, at) for _, s, r, at in seen if s == "update" and r == 2]
        fleet.stop(grace=0.0)
    watcher.stop()
    round1 = [at for _, s, r, at in seen if s == "update" and r == 1]
    plan1 = [at for _, s, r, at in seen if s == "round-plan" and r == 1]
    return {"sigterm_round_s": took, "training_rss_mb": training_rss, "training_peak_rss_mb": training_peak, "exit_code": code, "update_sent_before_sigterm": bool(updates and updates[0][1] < t),
            "sigterm_after_plan_s": t - plan_at,
            "round1_plan_to_update_s": (round1[0] - plan1[0]) if round1 and plan1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=300, help="Local epochs of the mid-round job.")
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=DIR: run the services from this source tree (repeatable; default: this one).")
    parser.add_argument("--agents-only", action="store_true", help="Measure the agent alone (skip the servers).")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "process.json")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": None}
    tmp = Path(tempfile.mkdtemp(prefix="bench-process-"))
    broker = MosquittoProcess(tmp / "broker").start()
    roles = ("keyserver", "coordinator", "agent", "agent_rpi4", "agent_mid_round")
    if args.agents_only:
        roles = roles[2:]
    services = roles[:-1]
    runs: dict[str, dict[str, list[dict]]] = {name: {role: [] for role in roles} for name in trees}
    loads = []
    try:
        for n in range(args.repeats):
            for name, tree in trees.items():
                if tree is not None:
                    os.environ["PYTHONPATH"] = str(Path(tree).resolve())
                loads.append(os.getloadavg()[0])
                for role in services:
                    runs[name][role].append(one_service(role, broker, tmp, f"{name}-{n}"))
                    print(name, role, runs[name][role][-1], flush=True)
                runs[name]["agent_mid_round"].append(mid_round(broker, tmp, f"{name}-{n}", args.epochs))
                print(name, "agent mid-round", runs[name]["agent_mid_round"][-1], flush=True)
    finally:
        broker.stop()

    summaries = {}
    for name, by_role in runs.items():
        def median(role: str, key: str) -> float | None:
            values = [r[key] for r in by_role[role] if r.get(key) is not None]
            return statistics.median(values) if values else None

        summary = {role: {key: median(role, key) for key in ("first_line_s", "ready_s", "idle_rss_mb", "sigterm_idle_s")}
                   for role in services}
        for role in services:
            summary[role]["hangs"] = sum(r["sigterm_idle_s"] is None for r in by_role[role])
        for key in ("sigterm_round_s", "training_rss_mb", "training_peak_rss_mb"):
            summary["agent"][key] = median("agent_mid_round", key)
        summaries[name] = summary
        codes = {role: sorted({r["exit_code"] for r in rs}) for role, rs in by_role.items()}
        print(f"\n{name} (median of {args.repeats})")
        print(f"{'service':<12} {'first line s':>12} {'ready s':>8} {'idle RSS MB':>12} {'SIGTERM idle s':>15} "
              f"{'SIGTERM in round s':>19}  exit codes")
        for role in services:
            s = summary[role]
            in_round = f"{s['sigterm_round_s']:.2f}" if s.get("sigterm_round_s") is not None else "-"
            extra = codes[role] + (codes["agent_mid_round"] if role == "agent" else [])
            idle = f"{s['sigterm_idle_s']:.2f}" + (f" ({s['hangs']} hung)" if s["hangs"] else "")
            print(f"{role:<12} {s['first_line_s']:>12.2f} {s['ready_s']:>8.2f} {s['idle_rss_mb']:>12.0f} "
                  f"{idle:>15} {in_round:>19}  {sorted(set(extra), key=str)}")
        a = summary["agent"]
        print(f"agent training the MLP: RSS {a['training_rss_mb']:.0f} MB, peak {a['training_peak_rss_mb']:.0f} MB")
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} vCPUs", "trees": trees,
        "load_1min_at_each_repeat": loads, "repeats": args.repeats, "mid_round_epochs": args.epochs,
        "median": summaries, "runs": runs, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
