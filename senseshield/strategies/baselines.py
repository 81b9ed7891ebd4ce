"""Baselines: plaintext FedAvg, full per-parameter Paillier, and every parameter masked."""

from __future__ import annotations

import numpy as np

from senseshield.strategies.base import STRATEGIES, ClientContext, MaskChoice, Strategy


@STRATEGIES.register("plaintext")
class Plaintext(Strategy):
    """FedAvg (McMahan et al. 2017) with nothing encrypted: the accuracy and speed ceiling."""

    name = "plaintext"
    summary = "FedAvg in plaintext, nothing encrypted (baseline)"
    scheme = None

    def select_mask(
        self, context: ClientContext, *, sensitivity: np.ndarray, weights: np.ndarray
    ) -> MaskChoice:
        return MaskChoice(np.zeros(weights.size, dtype=bool))

    def encryption_floor(self, budget: float, *, size: int, block_size: int = 1) -> float:
        return 0.0  # nothing, by design (even with a --scheme override)


@STRATEGIES.register("paillier-full")
class PaillierFull(Strategy):
    """Every parameter Paillier-encrypted: the papers' "Baseline" (stock python-paillier)."""

    name = "paillier-full"
    summary = "every parameter encrypted with Paillier (the papers' Baseline)"

    def select_mask(
        self, context: ClientContext, *, sensitivity: np.ndarray, weights: np.ndarray
    ) -> MaskChoice:
        return MaskChoice(np.ones(weights.size, dtype=bool))

    def encryption_floor(self, budget: float, *, size: int, block_size: int = 1) -> float:
        return 1.0  # every parameter, whatever the budget


@STRATEGIES.register("masked")
class MaskedFull(PaillierFull):
    """Every parameter masked with one-time pads agreed with the key server
    (:mod:`senseshield.he.masked`): the coordinator sees no individual value, at about the
    cost of plaintext FedAvg. Needs the non-colluding key server the design assumes. The
    mask is paillier-full's (everything); only the scheme differs."""

    name = "masked"
    summary = "every parameter masked with one-time pads agreed with the key server (about plaintext cost)"
    scheme = "masked"
