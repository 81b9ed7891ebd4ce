"""A virtualenv's size and its largest distributions, read from the outside (any architecture).

    python venv_sizes.py VENV [--top 10] [--only pip-list.txt] [--json OUT.json] [--label TEXT]

Prints ``du -sm`` of VENV (MB of 2^20 bytes, as du counts) and its site-packages, then the
``--top`` largest distributions in MB (10^6 bytes) of the files each one's RECORD lists that
exist (``.pyc`` included; a pruned file no longer counts), as benchmarks/bench_install.py
does. ``--only``: count only the distributions named in that ``pip list --format=freeze``
file. Reads the files only: prove_arm64.sh runs it on x86 against the arm64 root's venv.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from importlib import metadata
from pathlib import Path


def du_mib(path: Path) -> int:
    return int(subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def dist_sizes(site: Path) -> dict[str, int]:
    sizes = {}
    for dist in metadata.distributions(path=[str(site)]):
        total = 0
        for f in dist.files or []:
            p = site / f
            if p.is_file():
                total += p.stat().st_size
        sizes[dist.metadata["Name"]] = total
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=Path)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--only", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    site = next(args.venv.glob("lib/python3*/site-packages"))
    sizes = dist_sizes(site)
    if args.only:
        names = {line.split("==")[0].lower().replace("_", "-") for line in args.only.read_text().split() if "==" in line}
        sizes = {n: s for n, s in sizes.items() if n.lower().replace("_", "-") in names}
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    venv_mib, site_mib = du_mib(args.venv), du_mib(site)
    print(f"{args.label or args.venv}: venv {venv_mib} MiB, site-packages {site_mib} MiB (du -sm), "
          f"{len(ranked)} distributions{' (those of ' + args.only.name + ')' if args.only else ''}; "
          f"RECORD total {sum(sizes.values()) / 1e6:.0f} MB")
    print("  largest: " + ", ".join(f"{n} {s / 1e6:.0f}" for n, s in ranked[:args.top]) + " (MB)")
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "venv_mib": venv_mib, "site_mib": site_mib,
                                         "distributions": len(ranked), "record_mb": round(sum(sizes.values()) / 1e6, 1),
                                         "top": [[n, round(s / 1e6, 1)] for n, s in ranked[:args.top]]}))


if __name__ == "__main__":
    main()
