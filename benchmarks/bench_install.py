"""What an install costs on disk and at an agent's start, one virtualenv against another.

For each ``--venv NAME=PYTHON`` (the virtualenv's interpreter; repeatable):

- its site-packages: disk usage (``du -sm``, MiB) and the largest distributions (MB, 10^6
  bytes, of the files each one's RECORD lists, ``.pyc`` files included);
- an idle agent started with that interpreter (``PYTHON -m edge_agent.cli join``, the code
  installed in that virtualenv), with a declared profile (``--profile rpi4``) and with the
  default ``--profile auto``: seconds from the process start to its first output line and to
  its retained status "online" on a Mosquitto on the loopback, and its resident memory
  (VmRSS) 2 s after that (:func:`bench_process.one_service`). The virtualenvs alternate in
  every repeat, so each sees the same load; medians are reported.

Prints a table and writes ``benchmarks/results/install.json`` (``--out``).

    python benchmarks/bench_install.py --venv full=/tmp/full/bin/python --venv lean=/tmp/lean/bin/python [--repeats 3] [--top 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_process  # noqa: E402

from senseshield.runtime.broker import MosquittoProcess  # noqa: E402

SIZES = r"""
import json, sys, sysconfig
from importlib import metadata
from pathlib import Path
site = Path(sysconfig.get_path("purelib"))
sizes = {}
for dist in metadata.distributions(path=[str(site)]):
    total = 0
    for f in dist.files or []:
        try:
            total += (site / f).resolve().stat().st_size
        except OSError:
            pass
    sizes[dist.metadata["Name"]] = total
print(json.dumps({"site": str(site), "sizes": sizes}))
"""


def install_size(python: str) -> dict:
    """site-packages of ``python``: its path, ``du -sm`` and bytes per distribution."""
    data = json.loads(subprocess.run([python, "-c", SIZES], capture_output=True, text=True, check=True).stdout)
    du = subprocess.run(["du", "-sm", data["site"]], capture_output=True, text=True, check=True).stdout
    data["du_mib"] = int(du.split()[0])
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", action="append", required=True, help="NAME=PYTHON (repeatable).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="Distributions listed per virtualenv.")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "install.json")
    args = parser.parse_args()
    venvs = dict(v.split("=", 1) for v in args.venv)
    sizes = {name: install_size(python) for name, python in venvs.items()}
    for name, data in sizes.items():
        ranked = sorted(data["sizes"].items(), key=lambda kv: -kv[1])
        print(f"\n{name}: {data['site']}: {data['du_mib']} MiB (du -sm), {len(ranked)} distributions")
        for dist, size in ranked[:args.top]:
            print(f"  {size / 1e6:8.1f} MB  {dist}")

    # the installed code, not this checkout's; named profiles from this checkout's profiles/
    os.environ.pop("PYTHONPATH", None)
    os.environ["SENSESHIELD_PROFILES"] = str(HERE.parent / "profiles")
    tmp = Path(tempfile.mkdtemp(prefix="bench-install-"))
    broker = MosquittoProcess(tmp / "broker").start()
    roles = ("agent_rpi4", "agent")
    runs: dict[str, dict[str, list[dict]]] = {name: {role: [] for role in roles} for name in venvs}
    loads = []
    try:
        for n in range(args.repeats):
            for name, python in venvs.items():
                bench_process.PYTHON = python
                loads.append(os.getloadavg()[0])
                for role in roles:
                    runs[name][role].append(bench_process.one_service(role, broker, tmp, f"{name}-{n}"))
                    print(name, role, runs[name][role][-1], flush=True)
    finally:
        broker.stop()
    medians = {name: {role: {key: statistics.median(r[key] for r in rs)
                             for key in ("first_line_s", "ready_s", "idle_rss_mb")}
                      for role, rs in by_role.items()} for name, by_role in runs.items()}
    print(f"\n{'venv':<10} {'profile':<8} {'first line s':>12} {'online s':>9} {'idle RSS MB':>12}  (median of {args.repeats})")
    for name, by_role in medians.items():
        for role, m in by_role.items():
            print(f"{name:<10} {'rpi4' if role == 'agent_rpi4' else 'auto':<8} {m['first_line_s']:>12.2f} "
                  f"{m['ready_s']:>9.2f} {m['idle_rss_mb']:>12.0f}")
    result = {"machine": f"{bench_process.cpu_model()}, {os.cpu_count()} vCPUs", "venvs": venvs,
              "sizes": {name: {"site": d["site"], "du_mib": d["du_mib"],
                               "top": sorted(d["sizes"].items(), key=lambda kv: -kv[1])[:args.top],
                               "distributions": len(d["sizes"])} for name, d in sizes.items()},
              "load_1min_at_each_repeat": loads, "repeats": args.repeats, "median": medians, "runs": runs,
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
