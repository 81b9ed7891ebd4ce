#!/usr/bin/env bash
# What prove_arm64.sh leaves unproven, on its emulated arm64 root (docs/pi.md): the agent as
# a process on aarch64, in a fleet with x86 services, and the Ansible role's torch choice.
#
#   sudo deploy/pi/prove_arm64_fleet.sh [WORKDIR]     # default WORKDIR: /tmp/senseshield-arm64
#
# `FLEET=1 deploy/pi/prove_arm64.sh WORKDIR` runs it after its own steps (one command).
# Needs the root and venv of `AGENT=1 deploy/pi/prove_arm64.sh WORKDIR` (Debian bookworm
# arm64, /opt/agent with torch 2.9.1, the agent and its `lab` extra: c000's shard of the
# built-in digits data is read from scikit-learn's data file), mosquitto, and this checkout's x86
# interpreter ($X86_PYTHON) with its dev extras (ansible-core). Not part of `make test`:
# about 4 minutes per CPU model on a shared 2-core machine. It runs itself at nice 10. Steps:
#   1. registers a binfmt_misc handler for aarch64 (deploy/pi/binfmt.sh: flag F, so it works
#      in the chroot) and checks that qemu honours QEMU_CPU=$CPU (deploy/pi/lse_probe.py: on
#      cortex-a72 the child running an ARMv8.1 atomic must die with SIGILL). From here an
#      arm64 program can start another (the profile's matmul child, Ansible's modules);
#   2. tops the root up with what the agent's and Ansible's programs call and prove_arm64.sh's
#      minimal root lacks: coreutils and dash (`uname`, /bin/sh) and python3-packaging
#      (Ansible's pip module), extracted by mmdebstrap, existing files left alone;
#   3. mounts /proc in the root (psutil needs it; the mount point is made if the root lacks
#      it: `--variant=extract` makes none). Not /sys: under qemu-user it is the x86 host's,
#      and onnxruntime 1.32's cpuinfo dies with SIGSEGV at import on it;
#   4. reinstalls this checkout's wheel in /opt/agent if the installed agent differs from it
#      (`pip install --no-deps --force-reinstall`, then `pip check`);
#   5. starts mosquitto on a free port of 127.0.0.1 (the chroot shares the network);
#   6. `edge-agent profile --quick --broker ...` (what `join --profile auto` measures) under
#      QEMU_CPU=$CPU and on x86, side by side;
#   7. deploy/pi/arm64_idle.py: an idle `edge-agent join` in the root with `--profile rpi4`
#      and with `--profile auto`: seconds to online, resident memory 2 s after (qemu's
#      process: the emulator's own memory included);
#   8. deploy/pi/arm64_fleet.py, once per ring in $RINGS: a $STRATEGY job (MLP, $ROUNDS
#      rounds, `ring_bits` that ring) on $AGENTS agents, c000 in the root, the rest and both
#      services on x86, with the fleet's signed trust file; compares the fleet with the
#      simulator (x86): clusters, budgets and masks equal; round 1's model within c000's
#      share of one ring step plus ATOL (compare.masked_round_tolerance); later rounds within
#      ATOL on the 64-bit ring (fixed point 2^-24: a bit-level check of the float
#      arithmetic), reported only on the 32-bit ring (2^-15, what `auto` takes for this job:
#      round 1's step moves every agent's start of round 2);
#   9. deploy/pi/torch_by_arch.yml: the senseshield role's two torch tasks (`--tags
#      senseshield_torch`) with the root's python3 as the host's interpreter (connection
#      local, each module run as `chroot ROOT python3`): applied (expect ok, changed=0:
#      torch==2.9.1 is there), in --check with another pin (expect changed=1), and on this
#      x86 machine (expect the install skipped), and in --check with the example inventory's
#      jetson_orin group variables (expect both tasks skipped: NVIDIA's wheel comes from
#      senseshield_pip_pre_packages); each checked on the play's recap;
#  10. on exit (also on SIGINT/SIGTERM): stops mosquitto, unmounts /proc, unregisters the
#      handler unless it was registered before or KEEP_BINFMT=1 (and unmounts binfmt_misc
#      if binfmt.sh mounted it and no other handler is registered).
# Ends with "== done: all passed"; a failed check exits 1 before it.
#
# Environment: CPU (default cortex-a72), STRATEGY (masked), AGENTS (3), ROUNDS (3), RINGS
# ("64 auto"), ATOL (1e-6: the float difference allowed; mlp_check.py measures ~1.6e-7),
# X86_PYTHON (default .venv/bin/python of this checkout), KEEP_BINFMT (0).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${1:-/tmp/senseshield-arm64}
root=$work/root
venv=/opt/agent
CPU=${CPU:-cortex-a72}
STRATEGY=${STRATEGY:-masked}
AGENTS=${AGENTS:-3}
ROUNDS=${ROUNDS:-3}
RINGS=${RINGS:-"64 auto"}
ATOL=${ATOL:-1e-6}
X86_PYTHON=${X86_PYTHON:-$repo/.venv/bin/python}
KEEP_BINFMT=${KEEP_BINFMT:-0}

[ "$(id -u)" = 0 ] || { echo "prove_arm64_fleet.sh: run as root (binfmt_misc, chroot, mount)" >&2; exit 2; }
[ -x "$root$venv/bin/python" ] || {
    echo "prove_arm64_fleet.sh: no arm64 agent in $root$venv; run AGENT=1 deploy/pi/prove_arm64.sh $work first" >&2
    exit 2; }
command -v mosquitto >/dev/null || { echo "prove_arm64_fleet.sh: mosquitto is not installed" >&2; exit 2; }
renice -n 10 -p $$ >/dev/null
export PYTHONPATH=$repo
chroot_bin=$(command -v chroot)

mosquitto_pid= mounted_proc= registered=
binfmt_dir=/proc/sys/fs/binfmt_misc
binfmt_mounted_before=0
mountpoint -q "$binfmt_dir" && binfmt_mounted_before=1
cleanup() {
    [ -z "$mosquitto_pid" ] || kill "$mosquitto_pid" 2>/dev/null || true
    [ -z "$mounted_proc" ] || umount "$root/proc" || true
    if [ -n "$registered" ] && [ "$KEEP_BINFMT" != 1 ]; then
        "$here/binfmt.sh" unregister
        # binfmt.sh mounted binfmt_misc if it was not: unmount it again when no handler is left
        if [ "$binfmt_mounted_before" = 0 ] && mountpoint -q "$binfmt_dir" \
            && [ -z "$(ls "$binfmt_dir" | grep -vx 'register\|status')" ]; then
            umount "$binfmt_dir" && echo "unmounted $binfmt_dir (it was not mounted before)"
        fi
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# arm PROGRAM ARGS...: an aarch64 program in the root under binfmt_misc, CPU model from QEMU_CPU
# (children inherit it), with a clean environment.
arm() {
    env -i PATH=$venv/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 QEMU_CPU="$CPU" "$chroot_bin" "$root" "$@"
}

echo "== 1. binfmt_misc handler for aarch64"
[ "$("$here/binfmt.sh" status)" = registered ] || registered=1
"$here/binfmt.sh" register
cp "$here/lse_probe.py" "$root/tmp/"
echo "QEMU_CPU=$CPU: $(arm /usr/bin/python3 /tmp/lse_probe.py 2>&1 | grep -v '^qemu: uncaught target signal')"

echo "== 2. coreutils, dash, python3-packaging in the root"
if [ ! -x "$root/bin/uname" ] || [ ! -e "$root/bin/sh" ] || [ ! -d "$root/usr/lib/python3/dist-packages/packaging" ]; then
    mmdebstrap --arch=arm64 --variant=extract --include=coreutils,dash,python3-packaging bookworm "$work/topup.tar"
    tar -C "$root" --skip-old-files -xf "$work/topup.tar"
    rm -f "$work/topup.tar"
fi
arm /bin/sh -c 'echo "uname -m in the root: $(uname -m)"'

echo "== 3. /proc in the root"
mkdir -p "$root/proc" "$root/sys" "$root/root" "$root/run" "$root/dev/shm"
if ! mountpoint -q "$root/proc"; then
    mount -t proc proc "$root/proc"
    mounted_proc=1
fi
if mountpoint -q "$root/sys"; then
    echo "warning: $root/sys is mounted; onnxruntime dies with SIGSEGV at import on the x86 host's /sys" >&2
fi

echo "== 4. this checkout's agent in $venv"
site=$root$venv/lib/python3.11/site-packages
stale=0
for pkg in senseshield edge_agent coordinator keyserver; do
    diff -rq --exclude=__pycache__ "$repo/$pkg" "$site/$pkg" >/dev/null || stale=1
done
if [ "$stale" = 1 ]; then
    rm -rf "$work/wheel"
    "$X86_PYTHON" -m pip wheel "$repo" --no-deps --no-build-isolation -q -w "$work/wheel"
    whl=$(cd "$work/wheel" && ls senseshield-*.whl)
    cp "$work/wheel/$whl" "$root/tmp/"
    start=$(date +%s)
    arm "$venv/bin/python" -m pip install -q --no-cache-dir --no-deps --force-reinstall "/tmp/$whl"
    echo "reinstalled $whl in $(($(date +%s) - start)) s under emulation"
    arm "$venv/bin/python" -m pip check
else
    echo "the installed agent is this checkout's"
fi

echo "== 5. mosquitto"
port=$("$X86_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mosquitto -p "$port" > "$work/mosquitto.log" 2>&1 &
mosquitto_pid=$!
broker=mqtt://127.0.0.1:$port
"$X86_PYTHON" - "$port" <<'PY'
import socket, sys, time
for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()
        break
    except OSError:
        time.sleep(0.1)
PY
echo "mosquitto $(mosquitto -h 2>/dev/null | head -1 | cut -d' ' -f3) on $broker (pid $mosquitto_pid)"

echo "== 6. edge-agent profile --quick --broker $broker (QEMU_CPU=$CPU, then x86)"
t0=$EPOCHREALTIME
arm "$venv/bin/edge-agent" profile --quick --broker "$broker" > "$work/profile-arm64.json" 2> "$work/profile-arm64.err" \
    || { tail -5 "$work/profile-arm64.err" >&2; exit 1; }
t1=$EPOCHREALTIME
"$X86_PYTHON" -m edge_agent.cli profile --quick --broker "$broker" > "$work/profile-x86.json" 2> "$work/profile-x86.err"
t2=$EPOCHREALTIME
"$X86_PYTHON" - "$work/profile-arm64.json" "$work/profile-x86.json" "$t0" "$t1" "$t2" "$CPU" <<'PY'
import json, sys
a, x = (json.load(open(p)) for p in sys.argv[1:3])
t0, t1, t2 = map(float, sys.argv[3:6])
print(f"{'':28} {'arm64 (' + sys.argv[6] + ')':>20} {'x86':>12}")
rows = [("board (from /proc/cpuinfo)", "board"), ("cores", "cores"), ("cpu_speed (GHz x cores)", "cpu_speed"),
        ("matmul GFLOP/s (median)", "gflops"), ("packed-Paillier values/s", "he_encryptions_per_s"),
        ("bandwidth MB/s (loopback)", "bandwidth_up_mbps")]
for label, key in rows:
    f = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    print(f"{label:28} {f(a[key]):>20} {f(x[key]):>12}")
for key in ("torch_import", "matmul", "he_keygen", "he_encrypt", "total"):
    print(f"{'timing ' + key + ' (s)':28} {a['timings'][key]:>20.1f} {x['timings'][key]:>12.1f}")
print(f"{'wall, process start to end (s)':28} {t1 - t0:>20.1f} {t2 - t1:>12.1f}")
PY

echo "== 7. an idle arm64 agent ($CPU): --profile rpi4 and --profile auto"
"$X86_PYTHON" "$here/arm64_idle.py" "$root" "$broker" --cpu "$CPU" > "$work/idle-$CPU.log" \
    || { cat "$work/idle-$CPU.log"; echo "FAIL: an idle arm64 agent did not come online" >&2; exit 1; }
tail -1 "$work/idle-$CPU.log" | "$X86_PYTHON" -c '
import json, sys
r = json.loads(sys.stdin.read())
for p, m in r["profiles"].items():
    print("--profile {}: first line {first_line_s} s, online {online_s} s, idle RSS {idle_rss_mb} MB (peak {peak_rss_mb} MB), "
          "SIGTERM to exit {sigterm_s} s, exit code {exit_code}".format(p, **m))
'

for ring in $RINGS; do
    echo "== 8. a $STRATEGY job, ring_bits $ring, MLP, $ROUNDS rounds, $AGENTS agents: c000 on arm64 ($CPU), the rest on x86"
    status=0
    "$X86_PYTHON" "$here/arm64_fleet.py" "$root" "$broker" --cpu "$CPU" --agents "$AGENTS" --rounds "$ROUNDS" \
        --strategy "$STRATEGY" --ring "$ring" --atol "$ATOL" > "$work/fleet-$CPU-ring$ring.json" || status=$?
    tail -1 "$work/fleet-$CPU-ring$ring.json" | "$X86_PYTHON" -c '
import json, sys
r = json.loads(sys.stdin.read())
print("exit codes:", r["exit_codes"])
print("seconds from start to first log line / connected / joined the job:", r["ready_s"])
print("round seconds:", r["round_seconds"], " train seconds per agent:", r["train_s"])
print("accuracy fleet:", r["accuracy"]["fleet"], " simulator:", r["accuracy"]["simulator"])
print("ring:", r["ring_bits"], "bits; samples per agent:", r["weights"])
for k, d in r["max_diff_per_round"].items():
    t = r["tolerance_per_round"][k]
    print(f"round {k}: max |fleet - simulator| {d:.3g} (float32 models); tolerance "
          + (f"{t:.4g}: " + ("pass" if d <= t else "FAIL") if t is not None else "none (reported only)"))
print("key server float64 model vs simulator: {:.3g}".format(r["max_diff_final_keyserver"]), " masks equal:", r["masks_equal"],
      " budgets equal:", r["budgets_equal"], " first difference (clusters, budgets, masks):", r["first_difference"])
print("fleet", r["fleet_seconds"], "s, simulator", r["simulator_seconds"], "s; failed:", r["failed"] or "nothing")
' || { tail -20 "$work/fleet-$CPU-ring$ring.json"; status=1; }
    [ "$status" = 0 ] || { echo "FAIL: the fleet with an arm64 agent differs from the simulator beyond the tolerance (or a process failed)" >&2; exit 1; }
done

echo "== 9. the senseshield role's torch tasks (--tags senseshield_torch)"
interp=$work/arm64-python
printf '#!/bin/sh\nexec env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 QEMU_CPU=%s %s %s /usr/bin/python3 "$@"\n' \
    "$CPU" "$chroot_bin" "$root" > "$interp"
chmod 755 "$interp"
playbook() {  # EXPECT ARGS...: runs the play, prints what it did, checks its recap line against EXPECT
    local expect=$1 out
    shift
    out=$(cd "$here" && ANSIBLE_ROLES_PATH=../ansible/roles ANSIBLE_LOCALHOST_WARNING=false ANSIBLE_NOCOLOR=1 \
        "$(dirname "$X86_PYTHON")/ansible-playbook" --tags senseshield_torch -c local -e ansible_pipelining=true \
        "$@" torch_by_arch.yml) || true
    printf '%s\n' "$out" | grep -E '^(ok|changed|skipping|fatal|failed):|"msg"|^[a-z0-9]+ +: ok='
    printf '%s\n' "$out" | grep -E '^[a-z0-9]+ +: ok=' | grep -Eq "$expect" \
        || { echo "FAIL: expected a recap with $expect" >&2; exit 1; }
}
echo "-- arm64 root, applied (torch==2.9.1 is installed: expect ok, nothing changed)"
playbook 'changed=0 .*failed=0 .*skipped=0' -i arm64root, -e ansible_python_interpreter="$interp" -e senseshield_venv=$venv
echo "-- arm64 root, --check with senseshield_torch_by_arch {aarch64: torch==2.5.1} (expect changed)"
playbook 'changed=1 .*failed=0' -i arm64root, -e ansible_python_interpreter="$interp" -e senseshield_venv=$venv --check \
    -e '{"senseshield_torch_by_arch": {"aarch64": "torch==2.5.1"}}'
echo "-- this x86 machine, --check (expect the install skipped: x86_64 is not pinned)"
playbook 'changed=0 .*failed=0 .*skipped=1' -i x86host, -e ansible_python_interpreter="$X86_PYTHON" \
    -e senseshield_venv="$(dirname "$(dirname "$X86_PYTHON")")" --check
echo "-- arm64 root with the jetson_orin group's variables (example inventory), --check (expect both torch tasks"
echo "   skipped: an Orin gets NVIDIA's wheel from senseshield_pip_pre_packages, never PyPI's torch)"
playbook 'changed=0 .*failed=0 .*skipped=2' -i arm64root, -e ansible_python_interpreter="$interp" -e senseshield_venv=$venv \
    --check -e "@$repo/deploy/ansible/inventory/example/group_vars/jetson_orin.yml"
echo "== done: all passed (CPU $CPU)"
