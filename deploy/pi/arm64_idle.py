"""An idle agent on emulated arm64: its start and resident memory (run by prove_arm64_fleet.sh).

For each ``--profile`` (``rpi4``: declared, this checkout's profiles/rpi4.yaml copied into the
root and given as a file, as the Ansible role does; ``auto``: measured, the default of ``join``),
starts ``edge-agent join --insecure-dev`` (no trust file: start-up cost only) in the arm64
root (``chroot ROOT /opt/agent/bin/python -m edge_agent.cli``, qemu-user via binfmt_misc,
``QEMU_CPU=CPU``) on the broker, as benchmarks/bench_process.py does on x86: seconds from the
process start to its first output line and to its retained status on the broker, and its
resident memory (VmRSS, and its peak VmHWM) 2 s after that, then SIGTERM. The process is
qemu-aarch64-static running the agent, so its VmRSS includes qemu's own memory (its
translated-code cache): an upper bound of what the agent takes on a board.

    python arm64_idle.py ROOT BROKER_URL [--cpu cortex-a72] [--profile rpi4 --profile auto]

Prints one JSON object as its last line; exit 1 if an agent never came online.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_process  # noqa: E402

VENV = "/opt/agent"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("broker")
    ap.add_argument("--cpu", default="cortex-a72")
    ap.add_argument("--profile", action="append")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    root = args.root.resolve()
    out = root / "tmp" / "arm64-idle"  # c000 sees it as /tmp/arm64-idle
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    results = {}
    ok = True
    for profile in args.profile or ["rpi4", "auto"]:
        fleet = f"idle-{profile}-{int(time.time())}"
        inside = f"/tmp/arm64-idle/{profile}"
        (out / profile).mkdir()
        argv = ["env", "-i", f"PATH={VENV}/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8", f"QEMU_CPU={args.cpu}",
                "PYTHONUNBUFFERED=1", shutil.which("chroot") or "/usr/sbin/chroot", str(root),
                f"{VENV}/bin/python", "-m", "edge_agent.cli", "join", "--broker", args.broker, "--fleet", fleet,
                "--insecure-dev", "--agent-id", "a0", "--shard", "0/3", "--model-dir", f"{inside}/agent"]
        if profile != "auto":  # a declared profile as the Ansible role installs it: a file
            shutil.copy(REPO / "profiles" / f"{profile}.yaml", out / f"{profile}.yaml")
            argv += ["--profile", f"/tmp/arm64-idle/{profile}.yaml"]
        watcher = bench_process.StatusWatcher(args.broker, fleet)
        service = bench_process.Service(argv, out / profile / "agent.log")
        ready = watcher.wait("agents/a0/status", timeout=args.timeout)
        service.first_line.wait(60)
        rss = hwm = float("nan")
        if ready is not None:
            time.sleep(2.0)
            rss, hwm = bench_process.rss_mb(service.proc.pid), bench_process.rss_mb(service.proc.pid, "VmHWM")
        stop_s, code = service.terminate()
        watcher.stop()
        results[profile] = {"first_line_s": round((service.first or float("nan")) - service.t0, 1),
                            "online_s": round(ready - service.t0, 1) if ready is not None else None,
                            "idle_rss_mb": round(rss, 1), "peak_rss_mb": round(hwm, 1),
                            "sigterm_s": round(stop_s, 1) if stop_s is not None else None, "exit_code": code}
        print(profile, results[profile], flush=True)
        if ready is None:
            ok = False
            print(f"agent with --profile {profile} was not online within {args.timeout:.0f} s; see "
                  f"{out / profile / 'agent.log'}", file=sys.stderr)
    print(json.dumps({"cpu": args.cpu, "profiles": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
