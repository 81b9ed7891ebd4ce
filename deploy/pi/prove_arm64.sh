#!/usr/bin/env bash
# Proves under emulation that the edge agent's aarch64 torch pin (docs/pi.md) installs and
# trains on the CPUs of the boards the project names, and matches x86.
#
#   sudo deploy/pi/prove_arm64.sh [WORKDIR]        # default WORKDIR: /tmp/senseshield-arm64
#   sudo AGENT=1 FLEET=1 deploy/pi/prove_arm64.sh  # everything, prove_arm64_fleet.sh included
#
# What it does, on a Debian/Ubuntu x86_64 host, as root, with the Debian mirror and PyPI
# reachable (not part of `make test`: it downloads torch's 104 MB wheel, the agent's
# dependencies and a few Debian packages; AGENT=1 FLEET=1 with two fleet CPU models took 15
# minutes from nothing on a shared 2-core machine):
#   1. apt-get installs qemu-user-static and mmdebstrap if missing;
#   2. builds a Debian bookworm arm64 root with `mmdebstrap --variant=extract` (unpacks
#      python3, python3-venv and libstdc++6 (torch needs it) without running anything, so
#      it needs no binfmt_misc) and makes the /proc, /sys, /root, /run and /dev/shm that
#      variant lacks;
#   3. copies qemu-aarch64-static into it and runs every arm64 program as
#      `chroot ROOT /usr/bin/qemu-aarch64-static -cpu CPU PROGRAM`: no binfmt_misc
#      registration needed (none was registered on the machine this was written on), and an
#      explicit CPU model, because qemu's default model (`max`) has ARMv8.1 atomics and
#      hides the Cortex-A72's lack of them (the SIGILL of torch 2.13);
#   4. in that root, under -cpu cortex-a72: a venv, `pip install torch==$TORCH` from PyPI
#      (with its dependencies, so the resolver shows whether any nvidia-* wheel comes along),
#      the venv's size and its package list;
#   5. under each CPU model in $CPUS, first deploy/pi/lse_probe.py, the control: it shows
#      whether that model has ARMv8.1 atomics (cortex-a72/a57: a child running `ldaddal`
#      dies with SIGILL; cortex-a76: it runs), then deploy/pi/mlp_check.py (64->256->128->10
#      MLP, forward, cross-entropy, backward, one SGD step, second forward, a 512x512 matmul;
#      torch.set_num_threads(2)); and mlp_check.py on x86 with $X86_PYTHON;
#   6. prints the max absolute difference (deploy/pi/compare.py; exits 1 above 1e-5);
#   7. with AGENT=1: builds this checkout's wheel on x86, pip-installs it in the same venv
#      under -cpu cortex-a72 (the aarch64 interpreter evaluates pyproject's torch markers and
#      resolves the agent's other dependencies from PyPI), prints the venv's size (the lean
#      device install, `pip install senseshield`), adds the `lab` extra (simulate and the
#      built-in digits data need scikit-learn), prints the size again, and runs
#      deploy/pi/simulate_check.py (the project's own training: simulate of a 3-client,
#      2-round MLP job, train_threads 2) under cortex-a72 and on x86; the final models must
#      agree within SIM_ATOL. Sizes (deploy/pi/venv_sizes.py: `du -sm` and the ten largest
#      distributions) after the lean install and after [lab], each before and after
#      the prune (with PRUNE=1, the default: the Ansible role's
#      roles/senseshield/files/prune-venv.sh, run on the venv from the host side: torch's
#      C++ headers and CMake files, the packages' test directories); simulate_check.py and
#      the fleet below run on the pruned venv;
#   8. with FLEET=1 (implies AGENT=1): deploy/pi/prove_arm64_fleet.sh WORKDIR once per CPU
#      model in FLEET_CPUS: the agent as a process in a fleet with x86 services, its idle
#      memory, and the Ansible role's torch choice.
# It ends with "all passed" and the wall time; any failed check exits non-zero before that.
# It registers no binfmt_misc handler itself (prove_arm64_fleet.sh registers one and removes
# it on exit); on exit it removes senseshield's handler if one appeared during the run.
#
# Environment: TORCH (default 2.9.1), CPUS (default "cortex-a72 cortex-a76 cortex-a57"),
# THREADS (default 2), AGENT (default 0), PRUNE (default 1), SIM_ATOL (default 1e-6), FLEET
# (default 0), FLEET_CPUS (default cortex-a72), X86_PYTHON (default .venv/bin/python of
# this checkout: the x86 reference).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${1:-/tmp/senseshield-arm64}
root=$work/root
TORCH=${TORCH:-2.9.1}
CPUS=${CPUS:-"cortex-a72 cortex-a76 cortex-a57"}
THREADS=${THREADS:-2}
X86_PYTHON=${X86_PYTHON:-$repo/.venv/bin/python}
AGENT=${AGENT:-0}
PRUNE=${PRUNE:-1}
SIM_ATOL=${SIM_ATOL:-1e-6}
FLEET=${FLEET:-0}
FLEET_CPUS=${FLEET_CPUS:-cortex-a72}
[ "$FLEET" != 1 ] || AGENT=1
began=$(date +%s)

[ "$(id -u)" = 0 ] || { echo "prove_arm64.sh: run as root (chroot, apt-get)" >&2; exit 2; }
[ "$(uname -m)" = x86_64 ] || { echo "prove_arm64.sh: meant for an x86_64 host" >&2; exit 2; }

if ! command -v qemu-aarch64-static >/dev/null || ! command -v mmdebstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static mmdebstrap
fi
echo "== $(qemu-aarch64-static --version | head -1)"
binfmt_before=$("$here/binfmt.sh" status)
on_exit() {
    # a safety net: prove_arm64_fleet.sh removes its handler itself, unless it was killed
    if [ "$binfmt_before" != registered ] && [ "$("$here/binfmt.sh" status)" = registered ]; then
        "$here/binfmt.sh" unregister
    fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM HUP

mkdir -p "$work"
if [ ! -x "$root/usr/bin/python3" ]; then
    echo "== mmdebstrap: Debian bookworm arm64 (extract) into $root"
    mmdebstrap --arch=arm64 --variant=extract \
        --include=python3,python3-venv,libstdc++6,ca-certificates bookworm "$root"
fi
install -m 755 "$(command -v qemu-aarch64-static)" "$root/usr/bin/qemu-aarch64-static"
# The extract variant makes no /proc, /sys, /root or /run: mount points and HOME.
mkdir -p "$root/proc" "$root/sys" "$root/root" "$root/run" "$root/dev/shm"
# The extract variant runs no maintainer scripts: give pip the host's CA bundle and DNS.
mkdir -p "$root/etc/ssl/certs" "$root/tmp"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
cp -L /etc/resolv.conf "$root/etc/resolv.conf"

# arm CPU PROGRAM ARGS...: one aarch64 program under qemu with that CPU model, in the root,
# with a clean environment (no host pip configuration leaks in).
arm() {
    local cpu=$1
    shift
    env -i PATH=/opt/agent/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
        "$chroot_bin" "$root" /usr/bin/qemu-aarch64-static -cpu "$cpu" "$@"
}

chroot_bin=$(command -v chroot)
venv=/opt/agent
if [ ! -x "$root$venv/bin/pip" ]; then
    echo "== venv $venv with pip (cortex-a72)"
    rm -rf "${root:?}$venv"
    # --without-pip: ensurepip would start python3 in a child process, and a child aarch64
    # program cannot start without binfmt_misc; pip is installed from Debian's wheel instead.
    arm cortex-a72 /usr/bin/python3 -m venv --without-pip "$venv"
    pipwhl=$(cd "$root" && ls usr/share/python-wheels/pip-*.whl | head -1)
    arm cortex-a72 "$venv/bin/python" "/$pipwhl/pip" install -q --no-cache-dir "/$pipwhl"
fi
if ! arm cortex-a72 "$venv/bin/python" -m pip show -q torch 2>/dev/null; then
    echo "== pip install torch==$TORCH (cortex-a72, from PyPI, with dependencies)"
    start=$(date +%s)
    arm cortex-a72 "$venv/bin/python" -m pip install --no-cache-dir --progress-bar off \
        "torch==$TORCH"
    echo "pip install took $(($(date +%s) - start)) s under emulation"
fi
echo "== packages in the venv"
arm cortex-a72 "$venv/bin/python" -m pip list --format=freeze | tee "$work/pip-list.txt"
if grep -qi '^nvidia-\|^triton' "$work/pip-list.txt"; then
    echo "FAIL: nvidia-*/triton wheels in the aarch64 venv" >&2
    exit 1
fi
echo "no nvidia-* or triton wheels"
torch_mb=$(du -sm "$root$venv/lib/python3.11/site-packages/torch" | cut -f1)
echo "venv size: $(du -sm "$root$venv" | cut -f1) MB ($torch_mb MB of it torch)"

cp "$here/mlp_check.py" "$here/lse_probe.py" "$root/tmp/"
results=()
for cpu in $CPUS; do
    echo "== -cpu $cpu: ARMv8.1 atomics control"
    arm "$cpu" /usr/bin/python3 /tmp/lse_probe.py 2>&1 | grep -v '^qemu: uncaught target signal'
    echo "== mlp_check under -cpu $cpu, $THREADS threads"
    arm "$cpu" "$venv/bin/python" /tmp/mlp_check.py "/tmp/arm64-$cpu.json" "$THREADS"
    cp "$root/tmp/arm64-$cpu.json" "$work/"
    results+=("$work/arm64-$cpu.json")
done
echo "== mlp_check on x86 ($X86_PYTHON)"
"$X86_PYTHON" "$here/mlp_check.py" "$work/x86.json" "$THREADS"
echo "== max difference, x86 as reference"
"$X86_PYTHON" "$here/compare.py" "$work/x86.json" "${results[@]}"

[ "$AGENT" = 1 ] || { echo "== prove_arm64.sh: all passed in $(($(date +%s) - began)) s"; exit 0; }
echo "== the agent: this checkout's wheel, installed under -cpu cortex-a72"
rm -rf "$work/wheel"
"$X86_PYTHON" -m pip wheel "$repo" --no-deps --no-build-isolation -q -w "$work/wheel"
whl=$(cd "$work/wheel" && ls senseshield-*.whl)
cp "$work/wheel/$whl" "$root/tmp/"
start=$(date +%s)
arm cortex-a72 "$venv/bin/python" -m pip install --no-cache-dir --progress-bar off "/tmp/$whl" \
    | grep -v '^ *\(Downloading\|━\)'
# pip keeps an installed agent of the same version ("Requirement already satisfied"): replace
# it with this checkout's build, as the Ansible role does
arm cortex-a72 "$venv/bin/python" -m pip install -q --no-cache-dir --no-deps --force-reinstall "/tmp/$whl"
echo "pip install of the agent took $(($(date +%s) - start)) s under emulation"
arm cortex-a72 "$venv/bin/python" -m pip list --format=freeze > "$work/pip-list-agent.txt"
if grep -qi '^nvidia-\|^triton' "$work/pip-list-agent.txt"; then
    echo "FAIL: nvidia-*/triton wheels in the aarch64 venv" >&2
    exit 1
fi
grep -i '^torch==' "$work/pip-list-agent.txt"
if grep -qi '^scikit-learn==' "$work/pip-list-agent.txt"; then
    echo "note: this venv already holds [lab] (an earlier run): its size is not the lean install's; use a new WORKDIR"
fi
prune_venv=$repo/deploy/ansible/roles/senseshield/files/prune-venv.sh
sizes() {  # LABEL [ARGS]: the venv's size and its ten largest distributions
    local label=$1
    shift
    "$X86_PYTHON" "$here/venv_sizes.py" "$root$venv" --label "$label" --json "$work/sizes-${label// /-}.json" "$@"
}
echo "== sizes of the lean device install (pip install senseshield)"
sizes "lean" --only "$work/pip-list-agent.txt"
if [ "$PRUNE" = 1 ]; then
    echo "-- prune-venv.sh: $("$prune_venv" "$root$venv")"
    sizes "lean pruned" --only "$work/pip-list-agent.txt"
fi
echo "== the lab extra (simulate_check.py: scikit-learn for the digits data and clustering)"
arm cortex-a72 "$venv/bin/python" -m pip install -q --no-cache-dir --progress-bar off "/tmp/$whl[lab]"
arm cortex-a72 "$venv/bin/python" -m pip list --format=freeze > "$work/pip-list-lab.txt"
sizes "lab"
if [ "$PRUNE" = 1 ]; then
    echo "-- prune-venv.sh: $("$prune_venv" "$root$venv")"
    sizes "lab pruned"
fi
arm cortex-a72 "$venv/bin/python" -m pip check
cp "$here/simulate_check.py" "$root/tmp/"
arm cortex-a72 "$venv/bin/python" /tmp/simulate_check.py /tmp/sim-arm64.json
cp "$root/tmp/sim-arm64.json" "$work/"
"$X86_PYTHON" "$here/simulate_check.py" "$work/sim-x86.json"
"$X86_PYTHON" - "$work/sim-x86.json" "$work/sim-arm64.json" "$SIM_ATOL" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
atol = float(sys.argv[3])
d = max(abs(x - y) for x, y in zip(a["model"], b["model"], strict=True))
ok = d <= atol and a["rounds"] == b["rounds"]
print(f"simulate, x86 vs aarch64: {a['metric']} per round {a['rounds']} vs {b['rounds']}, "
      f"max weight difference {d:.2e} (tolerance {atol:g}: {'pass' if ok else 'FAIL'})")
sys.exit(0 if ok else 1)
PY

if [ "$FLEET" = 1 ]; then
    for cpu in $FLEET_CPUS; do
        echo "== prove_arm64_fleet.sh under $cpu"
        CPU=$cpu X86_PYTHON=$X86_PYTHON "$here/prove_arm64_fleet.sh" "$work"
    done
fi
echo "== prove_arm64.sh: all passed in $(($(date +%s) - began)) s (AGENT=$AGENT PRUNE=$PRUNE FLEET=$FLEET)"
