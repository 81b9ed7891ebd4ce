"""Buffered rounds: the pure rules of a job with ``options.buffer`` set (FedBuff, Nguyen et
al. 2022, on top of the synchronous protocol).

A *buffer* is a round of the protocol: it closes as soon as ``buffer`` updates of a cluster
are in (or every planned one, or its deadline), its sum is unmasked by the key server like a
round's, and the key server applies the weighted mean update to the cluster's newest model.
A device that has not finished when its buffer closes is *carried*: it keeps training from
the model it started from and contributes to the next buffer that plans it, with a staleness
``tau`` = (the buffer it lands in) - 1 - (the round of the model it started from); a device
that keeps up always has ``tau`` = 0 and the job is a synchronous one.

Every buffer is a round to the key server and the devices, so nothing of the protocol's
guarantees changes: a device's pads are derived for one (run, round, cluster, plan) and used
once, the k rule counts the distinct contributors of each buffer, and the ledger decrypts a
contribution of one (device, starting model) in one aggregate only, so a carried device's
work enters one buffer however often it is planned.

Staleness weighting: an update's weight is its data weight ``n_i`` times
``(1 + tau) ** -exponent`` (FedBuff's polynomial staleness function), rounded to an integer
(the masked ring carries integer weights), never below 1. The device computes it from its
plan (the plan's round and model round, which its receipt signs) and the job's exponent, the
coordinator checks the update claims exactly that, and the key server divides the sum by the
signed weights as for any round. A coordinator that lies about ``tau`` can only make a
device count less: what a device reveals does not depend on it.

Pure functions, no I/O.
"""

from __future__ import annotations

import math


def staleness(buffer: int, model_round: int) -> int:
    """Rounds between the model an update was trained from (``model_round``, 0: the initial
    model) and the one its ``buffer`` updates (``buffer - 1``): 0 for a device that kept up."""
    if buffer < 1 or model_round < 0 or model_round >= buffer:
        raise ValueError(f"an update of buffer {buffer} cannot start from model round {model_round}; "
                         "buffers start at 1 from an earlier model.")
    return buffer - 1 - model_round


def staleness_weight(weight: int, tau: int, *, exponent: float) -> int:
    """The integer weight of an update of data weight ``weight`` that is ``tau`` rounds stale:
    ``round(weight * (1 + tau) ** -exponent)``, at least 1; ``weight`` itself when ``tau`` is
    0 or ``exponent`` is 0 (no discount)."""
    if weight < 1 or tau < 0 or not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"weight {weight}, staleness {tau} and exponent {exponent} must be >= 1, >= 0 and >= 0.")
    if tau == 0 or exponent == 0:
        return int(weight)
    return max(1, int(math.floor(weight * (1.0 + tau) ** -exponent + 0.5)))

