"""SenseCrypt (Li et al.): sensitivity-guided selective HE per client, Algorithm 1.

1. Bootstrap: each client trains briefly and reports its sensitivity vector Γ_i (eq. 2),
   optionally clipped per sample and Gaussian-noised (Alg. 2), with its bandwidth r_i and
   CPU speed v_i.
2. The coordinator clusters the vectors with affinity propagation (sec. 3.1) and computes
   the encryption budget α_i of each client within its cluster (sec. 3.2).
3. Every round, each client recomputes Γ_i on its trained model and solves the
   multi-objective mask problem (eqs. 4-9) under its own budget; clients of a cluster each
   encrypt their own mask and the coordinator aggregates them per cluster, decrypting only
   the union mask (sec. 3.3).

Hybrid (``--set plain_noise=R``): the plaintext part of each update gets
Gaussian noise of norm R times its own before it is sent (``engine.dp.relative_noise``).
Encryption at a slow device's budget cannot hide a one-image update: every visible fully
connected layer's gradient is a rank-one product of the back-propagated error and the
layer's input, so any visible row gives the input up to scale, and gradient matching (DLG,
Inverting Gradients with a label search) recovers the image from the plaintext alone
(docs/attacks.md). Noise on every plaintext coordinate degrades exactly the signal those
attacks match, while the encrypted part (``score=leakage``: output layer first, against
label restoration) stays exact. It is a noise-to-signal ratio, not differential privacy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from senseshield.engine.clustering import cluster_clients
from senseshield.engine.dp import relative_noise
from senseshield.engine.masks import nested_block_masks, solve_block_mask, with_own_blocks
from senseshield.strategies.base import (
    STRATEGIES,
    BootstrapReport,
    ClientContext,
    FleetPlan,
    MaskChoice,
    Strategy,
    budgets_per_cluster,
)


@STRATEGIES.register("sensecrypt")
class SenseCrypt(Strategy):
    """Clustering + per-client budgets + per-client masks + union-mask decryption."""

    name = "sensecrypt"
    summary = "clusters by sensitivity, per-client budgets and masks (SenseCrypt Alg. 1)"
    scheme = "packed-paillier"  # block-granular per-client masks; `--scheme paillier` = per value
    clusters_clients = True
    needs_bootstrap_sensitivity = True
    per_client_masks = True

    def plan_fleet(
        self, reports: Sequence[BootstrapReport], *, size: int, block_size: int = 1
    ) -> FleetPlan:
        vectors = np.stack(
            [r.sensitivity if r.sensitivity is not None else np.zeros(size) for r in reports]
        )
        labels = cluster_clients(vectors)
        cluster_of = {r.client_id: int(k) for r, k in zip(reports, labels)}
        budgets, notes = self.budgets_for(reports, cluster_of, size=size, block_size=block_size)
        plan = FleetPlan(cluster_of, budgets, budget_notes={"mode": self.options.budget_mode, "clusters": notes})
        if self.options.masks == "nested":
            for k in plan.clusters:  # the cluster's one ranking: its members' mean sensitivity
                rows = [r.sensitivity for r in reports if cluster_of[r.client_id] == k and r.sensitivity is not None]
                plan.rankings[k] = np.abs(np.mean(rows, axis=0)) if rows else np.zeros(size)
        return plan

    def planned_mask(self, plan, client_id, members, *, size, block_size=1):  # type: ignore[no-untyped-def]
        """Nested masks (``masks='nested'``): ``client_id``'s prefix of its cluster's ranking,
        capped among the round's ``members`` (:func:`~senseshield.engine.masks.nested_block_masks`).
        The device adds its own top blocks to it (:meth:`select_mask`): a floor this mask
        cannot lower."""
        if self.options.masks != "nested":
            return super().planned_mask(plan, client_id, members, size=size, block_size=block_size)
        k = plan.cluster_of[client_id]
        ids = sorted(set(members) | {client_id})
        alphas = tuple(plan.budget_of[a] for a in ids)
        key = (k, tuple(ids), alphas, block_size)
        cache = self.__dict__.setdefault("_nested", {})
        if key not in cache:
            o = self.options
            cache.clear()  # one round's cluster at a time
            ranking = plan.rankings.get(k, np.zeros(size))
            cache[key] = dict(zip(ids, nested_block_masks(
                ranking, alphas, block_size=block_size, min_encryptors=o.min_encryptors,
                c=o.security_c, b=o.security_b)))
        return cache[key][client_id]

    def budgets_for(
        self, reports: Sequence[BootstrapReport], cluster_of: dict[str, int], *, size: int, block_size: int = 1
    ) -> tuple[dict[str, float], dict]:
        """Paper or calibrated budgets per cluster (calibrated: from each device's predicted
        solver fractions, kept for :meth:`rebudget`)."""
        mode = self.options.budget_mode
        notes: dict = {}
        fractions = self._solver_fractions(reports, size, block_size) if mode == "calibrated" else None
        self._fractions = fractions
        budgets = budgets_per_cluster(
            reports, cluster_of, mode=mode, size=size, block_size=block_size,
            deadline=self.fleet_context.round_deadline, fractions=fractions, notes=notes,
            tolerance=self.options.budget_tolerance,
        )
        return budgets, notes

    def rebudget(
        self,
        reports: Sequence[BootstrapReport],
        cluster_of: dict[str, int],
        *,
        size: int,
        block_size: int = 1,
        observed: dict[str, tuple[float, float]] | None = None,
    ) -> tuple[dict[str, float], dict] | None:
        """Calibrated mode, between rounds: budgets from refined costs (``reports[].costs``).

        The solver fractions predicted at bootstrap are corrected by what each device really
        encrypted: ``observed[id] = (budget, encrypted fraction)`` scales its curve (clamped to
        [0.5, 2]), never above the budget itself. Measured mode: :meth:`Strategy.rebudget`;
        None in paper mode (budgets stay fixed).
        """
        if self.options.budget_mode != "calibrated":
            return super().rebudget(reports, cluster_of, size=size, block_size=block_size, observed=observed)
        base = getattr(self, "_fractions", None) or {}
        grid = np.linspace(0.0, 1.0, 21)
        fractions = {}
        for r in reports:
            curve = base.get(r.client_id, grid)
            if observed and r.client_id in observed:
                alpha, seen = observed[r.client_id]
                predicted = float(np.interp(alpha, grid, curve))
                if predicted > 0 and seen > 0:
                    curve = np.minimum(grid, curve * float(np.clip(seen / predicted, 0.5, 2.0)))
            fractions[r.client_id] = curve
        notes: dict = {}
        budgets = budgets_per_cluster(
            reports, cluster_of, mode="calibrated", size=size, block_size=block_size,
            deadline=self.fleet_context.round_deadline, fractions=fractions, notes=notes,
            tolerance=self.options.budget_tolerance,
        )
        return budgets, {"mode": "calibrated", "clusters": notes}

    def _solver_fractions(
        self, reports: Sequence[BootstrapReport], size: int, block_size: int, samples: int = 21
    ) -> dict[str, np.ndarray]:
        """Per client, the share of the model the mask solver encrypts at budgets
        ``linspace(0, 1, samples)``, predicted from its bootstrap sensitivity (eqs. 4-7; the
        MI constraint is left out: the coordinator has no client weights). Clients whose
        vector is not a full sensitivity vector (DP sketches) are left out."""
        o = self.options
        out: dict[str, np.ndarray] = {}
        for r in reports:
            if r.sensitivity is None or r.sensitivity.size != size:
                continue
            g = np.abs(np.asarray(r.sensitivity, dtype=np.float64))
            out[r.client_id] = np.array([
                solve_block_mask(g, block_size=block_size, alpha=float(a), c=o.security_c, b=o.security_b,
                                 eta_mi=None).he_ratio
                for a in np.linspace(0.0, 1.0, samples)
            ])
        return out

    def select_mask(
        self, context: ClientContext, *, sensitivity: np.ndarray, weights: np.ndarray
    ) -> MaskChoice:
        o = self.options
        solution = solve_block_mask(
            sensitivity,
            block_size=context.block_size,
            alpha=context.encryption_budget,
            weights=weights,
            c=o.security_c,
            b=o.security_b,
            eta_mi=o.eta_mi,
            bins=o.mi_bins,
        )
        if o.masks == "nested":
            assert context.shared_mask is not None, "nested masks come with the round plan"
            # The coordinator's prefix can add to this device's protection, never replace it:
            # what its own solver picks (raised to its floor) is encrypted whatever the plan says.
            given = np.asarray(context.shared_mask, dtype=bool)
            mask, added = with_own_blocks(given, solution.mask, sensitivity, alpha=context.encryption_budget,
                                          floor=context.min_encrypted, block_size=context.block_size)
            nested: dict = {"nested": True}
            if added:
                nested["own_blocks_added"] = [added, float(given.mean()), float(mask.mean())]
            return MaskChoice(mask, nested)
        info = {
            "feasible": solution.feasible,
            "violations": list(solution.violations),
            "security_level": solution.security_level,
            "required_security": solution.required_security,
            "mutual_information": solution.mutual_information,
        }
        return MaskChoice(solution.mask, info)

    def privatise(self, context, delta, choice, *, sensitivity, rng):  # type: ignore[no-untyped-def]
        if self.options.plain_noise == 0:
            return delta, {}
        out, report = relative_noise(delta, np.flatnonzero(~choice.mask), ratio=self.options.plain_noise, rng=rng)
        return out, {"noised": report.count, "noise_std": report.noise_std_mean}
