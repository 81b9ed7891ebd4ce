"""Same seed, same result: traces of a run and the first place two traces differ.

A :class:`Trace` is what decides a run, in the order it is decided: every client's cluster
and encryption budget (the fleet plan), then per round every client's protection mask (a
digest of its encrypted and withheld positions) and every cluster's published model (as
the float32 vector devices receive). The simulator records one when asked
(``run_simulation(config, trace=True)``); a fleet run's is read back from ``report.json``
(``agents[].rounds[r].mask_sha256``) and ``models/round-R/cluster-K.npy``.

:func:`first_difference` walks two traces in that order and names the first thing that
differs (round, client, budget, mask, weight), so a broken promise says where it broke.
The promise, on one machine: the same config (seed and ``train_threads`` included) and the
same test-only device-noise seed (:mod:`senseshield.device_noise`; devices otherwise draw
their privacy noise from secret OS entropy) give the same trace bit for bit, in the
simulator and on a fleet; CKKS strategies differ by their encryption noise only (weights
within ~1e-8, masks and budgets equal).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def mask_digest(mask: np.ndarray, withheld: np.ndarray | None = None) -> str:
    """A short digest of which positions a client encrypted and which it withheld."""
    h = hashlib.sha256(np.packbits(np.asarray(mask, dtype=bool)).tobytes())
    if withheld is not None and np.any(withheld):
        h.update(b"|withheld|" + np.packbits(np.asarray(withheld, dtype=bool)).tobytes())
    return h.hexdigest()[:16]


@dataclass
class Trace:
    """What decided a run (see the module docstring); ``models`` hold float32 vectors."""

    clusters: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, float] = field(default_factory=dict)
    masks: dict[int, dict[str, str]] = field(default_factory=dict)  # round -> client -> digest
    models: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # round -> cluster -> weights

    def record_round(self, r: int, masks: dict[str, str], models: dict[int, np.ndarray]) -> None:
        self.masks[r] = dict(masks)
        self.models[r] = {k: np.asarray(w, dtype=np.float32).copy() for k, w in models.items()}


def fleet_trace(run_dir: Path) -> Trace:
    """The trace of a fleet run from its directory (``report.json`` and ``models/``)."""
    run_dir = Path(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    trace = Trace(
        clusters={c["id"]: int(c["cluster"]) for c in report["clients"]},
        budgets={c["id"]: float(c["encryption_budget"]) for c in report["clients"]},
    )
    for agent in report["agents"]:
        for r, rec in agent["rounds"].items():
            if rec.get("mask_sha256"):
                trace.masks.setdefault(int(r), {})[agent["id"]] = rec["mask_sha256"]
    for folder in sorted((run_dir / "models").glob("round-*")):
        r = int(folder.name.removeprefix("round-"))
        for path in sorted(folder.glob("cluster-*.npy")):
            k = int(path.stem.removeprefix("cluster-"))
            trace.models.setdefault(r, {})[k] = np.load(path).astype(np.float32)
    return trace


def first_difference(a: Trace, b: Trace, names: tuple[str, str] = ("a", "b"), *, atol: float = 0.0) -> str | None:
    """The first thing that differs between ``a`` and ``b``, as one sentence; None if nothing does.

    Weights are compared as float32 vectors with absolute tolerance ``atol`` (0: bit for bit).
    """
    x, y = names
    if sorted(a.clusters) != sorted(b.clusters):
        return f"clients differ: {x} has {sorted(a.clusters)}, {y} has {sorted(b.clusters)}"
    for c in sorted(a.clusters):
        if a.clusters[c] != b.clusters[c]:
            return f"client {c}: cluster {a.clusters[c]} in {x}, {b.clusters[c]} in {y}"
    for c in sorted(a.budgets):
        if a.budgets[c] != b.budgets.get(c):
            return f"client {c}: encryption budget {a.budgets[c]!r} in {x}, {b.budgets.get(c)!r} in {y}"
    rounds = sorted(set(a.masks) | set(a.models) | set(b.masks) | set(b.models))
    for r in rounds:
        ma, mb = a.masks.get(r, {}), b.masks.get(r, {})
        if sorted(ma) != sorted(mb):
            return f"round {r}: updates from {sorted(ma)} in {x}, from {sorted(mb)} in {y}"
        for c in sorted(ma):
            if ma[c] != mb[c]:
                return f"round {r}, client {c}: protection mask differs ({x} {ma[c]}, {y} {mb[c]})"
        wa, wb = a.models.get(r, {}), b.models.get(r, {})
        if sorted(wa) != sorted(wb):
            return f"round {r}: models of clusters {sorted(wa)} in {x}, {sorted(wb)} in {y}"
        for k in sorted(wa):
            if wa[k].shape != wb[k].shape:
                return f"round {r}, cluster {k}: {wa[k].size} weights in {x}, {wb[k].size} in {y}"
            diff = np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64))
            if diff.max(initial=0.0) > atol:
                i = int(np.argmax(diff))
                return (f"round {r}, cluster {k}: {int(np.sum(diff > atol))} weight(s) differ, the largest at "
                        f"index {i} by {diff[i]:.3g} ({x} {wa[k][i]!r}, {y} {wb[k][i]!r})")
    return None


def describe(trace: Trace) -> str:
    """One line: what a trace covers."""
    return (f"{len(trace.clusters)} clients, {len(set(trace.clusters.values()))} cluster(s), "
            f"{len(trace.models)} round(s)")
