#!/usr/bin/env bash
# Registers (or removes) a binfmt_misc handler that runs aarch64 ELF programs with
# qemu-aarch64-static, so an emulated arm64 program can start another one (the agent's
# `edge-agent profile` measures matmul speed in a child process; prove_arm64_fleet.sh).
#
#   sudo deploy/pi/binfmt.sh register      # idempotent: does nothing if already registered
#   sudo deploy/pi/binfmt.sh unregister    # idempotent: removes only this script's entry
#   deploy/pi/binfmt.sh status             # prints "registered" or "not registered"
#
# The entry is named `senseshield-aarch64` (so `unregister` never touches a handler someone
# else registered, e.g. Debian's `qemu-aarch64` from binfmt-support) and uses the magic and
# mask of Debian's qemu-user-static (/usr/lib/binfmt.d/qemu-aarch64.conf). Its flag is `F`:
# the kernel opens the interpreter at registration, so it works inside a chroot that has no
# qemu of its own. Without `P`, the program's argv[0] becomes its full path.
#
# qemu-user takes its CPU model from the environment: run programs with QEMU_CPU=cortex-a72
# (the Pi 4's core; qemu's default `max` has ARMv8.1 atomics the Pi 4 lacks). A child
# inherits the variable, so it runs under the same model.
#
# Environment: QEMU (default: `command -v qemu-aarch64-static`), BINFMT (default
# /proc/sys/fs/binfmt_misc: mounted if it is not).
set -euo pipefail

name=senseshield-aarch64
dir=${BINFMT:-/proc/sys/fs/binfmt_misc}
qemu=${QEMU:-$(command -v qemu-aarch64-static || true)}
magic='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'

mounted() { [ -e "$dir/register" ]; }

case ${1:-} in
register)
    [ "$(id -u)" = 0 ] || { echo "binfmt.sh: run as root (it writes $dir/register)" >&2; exit 2; }
    [ -n "$qemu" ] && [ -x "$qemu" ] || {
        echo "binfmt.sh: qemu-aarch64-static is not installed (apt-get install qemu-user-static)" >&2; exit 2; }
    if ! mounted; then
        mount -t binfmt_misc binfmt_misc "$dir"
    fi
    if [ -e "$dir/$name" ]; then
        echo "binfmt.sh: $name already registered ($(sed -n 's/^interpreter //p' "$dir/$name"))"
        exit 0
    fi
    printf ':%s:M::%s:%s:%s:F' "$name" "$magic" "$mask" "$qemu" > "$dir/register"
    echo "binfmt.sh: registered $name -> $qemu (flags F)"
    ;;
unregister)
    [ "$(id -u)" = 0 ] || { echo "binfmt.sh: run as root (it writes $dir/$name)" >&2; exit 2; }
    if mounted && [ -e "$dir/$name" ]; then
        echo -1 > "$dir/$name"
        echo "binfmt.sh: unregistered $name"
    else
        echo "binfmt.sh: $name was not registered"
    fi
    ;;
status)
    if mounted && [ -e "$dir/$name" ]; then echo registered; else echo "not registered"; fi
    ;;
*)
    echo "usage: binfmt.sh register|unregister|status" >&2
    exit 2
    ;;
esac
