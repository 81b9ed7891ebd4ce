"""One MLP training step, for comparing torch on aarch64 (under emulation) with x86.

Run by deploy/pi/prove_arm64.sh on both sides; the same seed and float32 everywhere. It
builds a 64->256->128->10 MLP, runs a forward pass, cross-entropy, backward and one SGD step
with torch.set_num_threads(THREADS) (torch 2.13 on a Cortex-A72 died with SIGILL in a
multi-threaded matrix multiply), then a second forward pass, and writes every number that
matters to a JSON file. Only torch and the standard library: no numpy in the arm64 venv.

    python mlp_check.py OUT.json [THREADS]
"""

import json
import platform
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

import_s = time.perf_counter() - t0

out_path = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(threads)

g = torch.Generator().manual_seed(0)


def uniform(*shape, bound):
    # Drawn from one explicit generator, not nn.Linear's default init, so both sides start
    # from the same weights whatever torch version each has.
    return (torch.rand(*shape, generator=g, dtype=torch.float32) * 2 - 1) * bound


model = torch.nn.Sequential(
    torch.nn.Linear(64, 256),
    torch.nn.ReLU(),
    torch.nn.Linear(256, 128),
    torch.nn.ReLU(),
    torch.nn.Linear(128, 10),
)
with torch.no_grad():
    for p in model.parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 64
        p.copy_(uniform(*p.shape, bound=1.0 / fan_in**0.5))

x = torch.rand(512, 64, generator=g, dtype=torch.float32)
y = torch.randint(0, 10, (512,), generator=g)

t1 = time.perf_counter()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
logits0 = model(x)
loss0 = torch.nn.functional.cross_entropy(logits0, y)
opt.zero_grad()
loss0.backward()
grads = [p.grad.detach().clone() for p in model.parameters()]
opt.step()
with torch.no_grad():
    logits1 = model(x)
    loss1 = torch.nn.functional.cross_entropy(logits1, y)
# A bigger multi-threaded matmul as well (the SIGILL case), checked by its sum.
with torch.no_grad():
    a = torch.rand(512, 512, generator=g)
    big = (a @ a).sum().item()
step_s = time.perf_counter() - t1


def flat(ts):
    return [float(v) for t in ts for v in t.detach().reshape(-1).tolist()]


json.dump(
    {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "import_s": round(import_s, 2),
        "step_s": round(step_s, 2),
        "loss0": loss0.detach().item(),
        "loss1": loss1.item(),
        "big_matmul_sum": big,
        "logits0": flat([logits0]),
        "logits1": flat([logits1]),
        "grads": flat(grads),
        "params": flat(model.parameters()),
    },
    open(out_path, "w"),
)
print(
    f"{platform.machine()} torch {torch.__version__} (cuda {torch.version.cuda}) "
    f"threads {torch.get_num_threads()}: import {import_s:.1f} s, step {step_s:.1f} s, "
    f"loss {loss0.detach().item():.6f} -> {loss1.item():.6f}"
)
