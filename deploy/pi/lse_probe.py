"""Does this (emulated) aarch64 CPU have ARMv8.1 atomics (LSE)? A control for prove_arm64.sh.

torch 2.13 died on a Cortex-A72 with SIGILL at `ldaddal`, an ARMv8.1 atomic that the A72
(Pi 4, Jetson Nano) lacks and the A76 (Pi 5) has. This prints the kernel's HWCAP_ATOMICS bit
and runs one `ldaddal` in a forked child: under `qemu-aarch64-static -cpu cortex-a72` the
child must die with SIGILL, under `-cpu cortex-a76` it must return. So a torch that passes
mlp_check.py under cortex-a72 did run where torch 2.13's BLAS would have trapped.

    python lse_probe.py          # prints one line; exit 0 when bit and behaviour agree
"""

import ctypes
import mmap
import os
import resource
import signal
import sys

AT_HWCAP, HWCAP_ATOMICS = 16, 1 << 8
libc = ctypes.CDLL(None)
libc.getauxval.restype = ctypes.c_ulong
hwcap_atomics = bool(libc.getauxval(AT_HWCAP) & HWCAP_ATOMICS)

# int f(int *p) { return atomic_fetch_add(p, 1); } with an LSE instruction:
#   mov w1, #1 ; ldaddal w1, w2, [x0] ; mov w0, w2 ; ret
code = b"".join(
    i.to_bytes(4, "little") for i in (0x52800021, 0xB8E10002, 0x2A0203E0, 0xD65F03C0)
)
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the SIGILL
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(addr)
    cell = ctypes.c_int(41)
    old = fn(ctypes.byref(cell))
    os._exit(0 if (old, cell.value) == (41, 42) else 3)
_, status = os.waitpid(pid, 0)
if os.WIFSIGNALED(status):
    ran = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    executed = False
else:
    ran = f"ran (exit {os.WEXITSTATUS(status)})"
    executed = os.WEXITSTATUS(status) == 0
print(f"HWCAP_ATOMICS={int(hwcap_atomics)}; ldaddal in a child: {ran}")
sys.exit(0 if executed == hwcap_atomics else 1)
