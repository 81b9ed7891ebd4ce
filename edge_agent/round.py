"""One device's round, the simulator's steps (:mod:`senseshield.rounds`) with the
simulator's seeds, as one object (:class:`DeviceRound`): :meth:`~DeviceRound.train` from the
cluster model the plan names, then (after the service has negotiated the cluster's mask, if
the plan asks) :meth:`~DeviceRound.protect`: the device's encryption floor, the mask, DP
noise, encryption and the update message; then the facts the update's signed
:func:`receipt` states. No transport: the service waits for the model,
the consensus mask and the challenge, signs and sends. The client state (personalised
zone, DP history) is updated as the simulator updates it."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from senseshield.device_noise import DeviceNoise
from senseshield.engine.buffered import staleness
from senseshield.he import PublicKey
from senseshield.he.base import model_digest, round_context
from senseshield.job import Job, train_config
from senseshield.rounds import (
    ClientState,
    LocalData,
    choice_report,
    client_seed,
    keep_personal,
    local_update,
    merge_personal,
    protect_local,
)
from senseshield.runtime.protocol.messages import Receipt, RoundPlan, UpdateMessage, plain_digest, update_to_message
from senseshield.strategies import ClientContext

log = logging.getLogger("senseshield.agent")


def round_key(public: PublicKey | None, exchange, fleet: str, run_id: str, r: int, plan: RoundPlan):  # noqa: ANN001, ANN201
    """The key this device encrypts round ``r`` with: the masked scheme's pads are this
    device's (``exchange``) and the key server's alone, for this round, cluster, plan and
    ring; None: no encryption."""
    if public is None:
        return None
    return public.for_contributor(exchange, pad_context(fleet, run_id, r, plan), ring_bits=plan.ring_bits)


def pad_context(fleet: str, run_id: str, r: int, plan: RoundPlan) -> bytes:
    """The context this device's pads of round ``r`` are derived in (the receipt signs the plan's digest)."""
    return round_context(fleet, run_id, r, plan.cluster, plan.digest())


def plan_refusal(strategy, public: PublicKey | None, plan: RoundPlan, n_samples: int,  # noqa: ANN001
                 noise: tuple[float | None, float | None] | None = None) -> str | None:
    """Why this device refuses ``plan`` (one sentence, without the round), or None: every
    field the job decides is what this device computes from the job itself. The coordinator
    chooses the cluster, the budget (raised to the device's floor), the deadline and the
    steps; it does not choose the key's block size, the consensus step, the DP noise or the
    masked ring. ``noise``: this device's (user-level, record-level) noise multipliers of the
    job (:func:`expected_noise`); the plan must carry exactly these. The ring must be the job's
    ``ring_bits`` when it names one, 64 for a strategy that adds noise to what it masks, and
    may be 32 only while this device's own weight fits the 32-bit head-room (the members'
    total, which the device cannot see, is the key server's to check)."""
    block = public.block_size if public is not None else 1
    if public is not None and plan.block_size != block:
        return f"the plan's block size {plan.block_size} is not the job key's {block}"
    if plan.negotiate != strategy.negotiates:
        return (f"the plan {'asks for' if plan.negotiate else 'skips'} a consensus mask, which the job's strategy "
                f"{strategy.name!r} {'does not use' if plan.negotiate else 'needs'}")
    if public is not None and public.needs_contributors:  # the masked scheme: its ring
        alone = strategy.ring_bits([n_samples])  # the ring of a cluster of this device alone
        option = strategy.options.ring_bits
        allowed = {alone} if option != "auto" or alone == 64 else {32, 64}
        if plan.ring_bits not in allowed:
            return (f"the plan's ring is {plan.ring_bits} bits, but the job (ring_bits {option!r}, strategy "
                    f"{strategy.name!r}, this device's {n_samples} samples) allows {sorted(allowed)}")
    if noise is not None:
        for what, got, want in (("noise multiplier", plan.noise_multiplier, noise[0]),
                                ("DP-SGD noise multiplier", plan.record_noise, noise[1])):
            if not _same_sigma(got, want):
                return (f"the plan's {what} is {got!r}, but the job calibrates {want!r} for this device; a "
                        "coordinator does not choose how much noise a device adds")
    return None


def expected_noise(config: Job, strategy, n_samples: int) -> tuple[float | None, float | None]:  # noqa: ANN001
    """This device's (user-level, record-level) noise multipliers of ``config``: what the
    coordinator computes for it (:func:`senseshield.job.noise_multipliers`, from the job and
    this device's own sample count), so its plans must carry them."""
    from senseshield.job import noise_multipliers

    if strategy.dp_level is None:
        return None, None
    user, record = noise_multipliers(config, strategy, {"me": int(n_samples)})
    return user, record.get("me")


def _same_sigma(got: float | None, want: float | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0)


@dataclass(frozen=True)
class Protected:
    """A protected update ready to sign and send: ``message`` (without its receipt) and the
    seconds it took to serialize."""

    update: object  # senseshield.rounds ProtectedUpdate
    message: UpdateMessage
    serialize_s: float


@dataclass(frozen=True)
class DeviceRound:
    """One device's round ``r`` of a job: the job's ``strategy`` and ``config``, the
    coordinator's ``plan``, the device's client ``index`` (the simulator's seeds), its client
    ``state`` (personalised zone, DP history, updated as the simulator updates it), ``data``,
    privacy ``noise``, the job's ``public`` key (None: nothing encrypted) and the device's
    encryption floor ``min_he_ratio``. :meth:`train`, then :meth:`protect`."""

    strategy: Any
    config: Job
    plan: RoundPlan
    r: int
    index: int
    agent_id: str
    state: ClientState
    data: LocalData
    noise: DeviceNoise
    public: PublicKey | None = None
    min_he_ratio: float = 0.0

    def train(self, model: Any, start: np.ndarray) -> Any:
        """The local update from the cluster model ``start`` (its personalised zone merged
        in), with the plan's record noise and steps (a :class:`senseshield.rounds` local update)."""
        return local_update(
            self.strategy, model, merge_personal(start, self.state),
            self.data, train=train_config(self.config), seed=client_seed(self.config.seed, self.r, self.index),
            round=self.r, state=self.state, noise_multiplier=self.plan.record_noise, noise=self.noise,
            index=self.index, steps=self.plan.local_steps,
        )

    def protect(self, local: Any, shared: np.ndarray | None, key: Any) -> Protected | None:
        """The update from ``local`` under the cluster's mask ``shared``: the plan's
        encryption budget (raised to this device's floor when the job encrypts), DP noise
        from the device's noise, encrypted with ``key``, weighted for its staleness in a
        buffered job (the plan's round against the model round it names); None (said in the log) when the
        job's strategy encrypts less than the floor and its scheme needs the cluster's
        common mask (the update is not sent)."""
        plan, r, public, floor = self.plan, self.r, self.public, self.min_he_ratio
        budget = plan.encryption_budget
        if public is not None and budget < floor:
            log.warning("round %d: the coordinator's encryption budget %.4f is below this device's minimum "
                        "%.4f (--min-he-ratio); encrypting at least the minimum", r, budget, floor)
            budget = floor
        context = ClientContext(
            self.agent_id, r, plan.cluster, budget, shared, plan.block_size,
            participants=plan.participants, noise_multiplier=plan.noise_multiplier,
            min_encrypted=floor if public is not None else 0.0,
        )
        update, choice = protect_local(
            self.strategy, context, local, key, n_samples=self.data.n_train,
            rng=self.noise.generator("protect", round=r, index=self.index), min_encrypted=floor if public else 0.0,
            staleness=staleness(r, plan.model_round),  # counts in a buffered job only (update_weight)
        )
        if "own_blocks_added" in choice.info:
            blocks, given, after = choice.info["own_blocks_added"]
            log.warning("round %d: the coordinator's nested mask (%.4f of the parameters) left out %d of this "
                        "device's most sensitive blocks (its own mask at budget %.4f); encrypting them too (%.4f of "
                        "the parameters)", r, given, blocks, budget, after)
        if "topped_up" in choice.info:
            before, after = choice.info["topped_up"]
            log.warning("round %d: the mask encrypted %.4f; topped up to %.4f with the most sensitive blocks "
                        "(--min-he-ratio %.4f)", r, before, after, floor)
        encrypted = float(update.mask.mean())
        if public is not None and encrypted + plan.block_size / update.size < floor:
            log.warning("round %d: the job's strategy encrypts %.4f of this update, below this device's minimum "
                        "%.4f (--min-he-ratio), and its scheme needs the cluster's common mask; the update "
                        "is not sent", r, encrypted, floor)
            return None
        keep_personal(self.state, local, choice.withheld)
        t = time.perf_counter()
        message = update_to_message(update, public, report=choice_report(choice))
        return Protected(update, message, time.perf_counter() - t)


def needs_fingerprint(update, public: PublicKey | None) -> bool:  # noqa: ANN001
    """Whether the update's receipt carries its ciphertext's fingerprint (a verifiable
    scheme's ciphertext: the key server's challenge of the round is needed)."""
    return update.ciphertext is not None and public is not None and public.verifiable


def receipt(run_id: str, plan: RoundPlan, update, message: UpdateMessage, start: np.ndarray,  # noqa: ANN001
            public: PublicKey | None, fingerprint: bytes) -> Receipt:
    """What the update's signed receipt states: its job, cluster, sample count, key, the
    digests of its mask, ciphertext and plaintext part, the ciphertext's ``fingerprint``
    under the round's challenge, and the digest of the cluster model ``start`` it was
    trained from."""
    return Receipt(
        run_id=run_id, cluster=plan.cluster, n_samples=update.n_samples,
        key_id=public.key_id if public is not None else "",
        mask_digest=hashlib.sha256(message.mask.tobytes()).hexdigest(),
        ciphertext_digest=hashlib.sha256(message.ciphertext).hexdigest() if message.ciphertext else "",
        fingerprint=fingerprint, start_digest=model_digest(start), shares=int(message.report.get("shares", 0)),
        plan_digest=plan.digest(),
        plain_digest=plain_digest(message.withheld, message.plaintext),
    )
