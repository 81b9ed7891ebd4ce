"""The coordinator's union-block attack on selective HE (issue 22 item 2), written apart
from the privacy engine.

Selective HE with per-client masks (SenseCrypt) decrypts the *union* of the clients' masks:
at a position only agent A encrypted, the other agents' values travel in plaintext and are
folded into the ciphertext, so the decrypted mean there is ``(w_A x_A + sum_{i != A} w_i x_i)
/ W``. The coordinator knows every plaintext ``x_i`` and every weight, and reads the mean
from the published model, so it solves for ``x_A``. This module is that coordinator: it
takes only what the coordinator holds (each update's mask, plaintext part and sample count,
and the published mean update) and returns, per agent, its recovered values at the
positions it alone encrypted. Scoring needs the agents' true updates, which only the
experimenter has.

Against the k rule (``min_encryptors = 2``) the mean at such a position is the plaintext
senders' mean alone, so the equation above has no ``x_A`` in it: what the attacker "solves"
is unrelated to A's value (scored by the same tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Seen:
    """One update as the coordinator sees it."""

    client_id: str
    n_samples: int
    mask: np.ndarray  # encrypted positions
    plaintext: np.ndarray  # values at ~mask, in position order


def recover(seen: Sequence[Seen], mean: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per agent: (positions it alone encrypted, the value the attacker solves there)."""
    size = mean.size
    masks = np.stack([s.mask for s in seen])
    counts = masks.sum(axis=0)
    total = float(sum(s.n_samples for s in seen))
    plain_sum = np.zeros(size)
    for s in seen:
        full = np.zeros(size)
        full[~s.mask] = s.plaintext
        plain_sum += s.n_samples * full
    out = {}
    for s, m in zip(seen, masks):
        alone = np.flatnonzero(m & (counts == 1))
        out[s.client_id] = (alone, (mean[alone] * total - plain_sum[alone]) / s.n_samples)
    return out


def others_mean(seen: Sequence[Seen], where: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The chance baseline: guess the other agents' plaintext mean at each such position."""
    size = seen[0].mask.size
    out = {}
    for s in seen:
        num, den = np.zeros(size), 0.0
        for o in seen:
            if o is not s:
                full = np.zeros(size)
                full[~o.mask] = o.plaintext
                num += o.n_samples * full
                den += o.n_samples
        w = where[s.client_id]
        out[s.client_id] = (w, num[w] / den if den else np.zeros(w.size))
    return out


def score(recovered: dict[str, tuple[np.ndarray, np.ndarray]], truth: dict[str, np.ndarray],
          *, tolerance: float = 0.01, floor: float = 3e-4) -> dict[str, tuple[int, int]]:
    """Per agent, (values recovered, values attacked): recovered means within ``tolerance``
    of the true value relative to its size, or within ``floor`` absolutely (the packed
    encoding's step, about 3e-5, scaled by W / w_A in the solve)."""
    out = {}
    for cid, (where, values) in recovered.items():
        actual = truth[cid][where]
        ok = np.abs(values - actual) <= np.maximum(tolerance * np.abs(actual), floor)
        out[cid] = (int(ok.sum()), int(where.size))
    return out


@dataclass
class Tally:
    """The attack over many cluster rounds: values attacked (``alone``: encrypted by one agent
    only), recovered, recovered by the chance baseline, and every encrypted value."""

    recovered: int = 0
    alone: int = 0
    chance: int = 0
    encrypted: int = 0

    def observe(self, r: int, cluster: int, updates, mean: np.ndarray, truth: dict[str, np.ndarray]) -> None:  # noqa: ANN001
        """One cluster round as ``run_simulation(observe=)`` hands it over: attack and score it."""
        seen = [Seen(u.client_id, u.n_samples, u.mask, u.plaintext.astype(np.float64)) for u in updates]
        got = recover(seen, mean)
        for hit, n in score(got, truth).values():
            self.recovered += hit
            self.alone += n
        self.chance += sum(hit for hit, _ in score(others_mean(seen, {c: w for c, (w, _) in got.items()}), truth).values())
        self.encrypted += int(sum(int(u.mask.sum()) for u in updates))
