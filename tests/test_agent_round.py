"""One device's round without the transport (edge_agent.round): the simulator's training from
the plan's start model, the mask under the device's encryption floor, the encrypted update
message and the facts its receipt states; the same inputs and noise seed give the same bytes."""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from edge_agent.dataspec import DataSpec
from edge_agent.prepare import prepare
from edge_agent.round import DeviceRound, needs_fingerprint, receipt, round_key
from senseshield.device_noise import DeviceNoise
from senseshield.he.base import model_digest
from senseshield.job import Job, initial_model, key_pair
from senseshield.rounds import ClientState
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.messages import FleetConfig, RoundPlan, plain_part

JOB = Job(strategy="sensecrypt", model="linear", clients=4, rounds=2, scheme="masked")
IDENTITY = Identity.generate("a1")


def _round(public, *, budget: float, min_he_ratio: float = 0.0):
    _, initial = initial_model(JOB, (1, 8, 8), 10)
    msg = FleetConfig(run_id="j-1", config=JOB.model_dump(mode="json"), input_shape=[1, 8, 8], num_classes=10,
                      round_deadline=30, initial=initial)
    prepared = prepare(msg, DataSpec(shard=(1, 4)), "a1")
    plan = RoundPlan(cluster=0, encryption_budget=budget, deadline=0.0, block_size=8, size=initial.size,
                     shared_mask=np.zeros(0, np.uint8))
    state, noise = ClientState(), DeviceNoise(replay_seed=7)
    device = DeviceRound(prepared.strategy, prepared.config, plan, 1, 1, "a1", state, prepared.data, noise,
                         public=public, min_he_ratio=min_he_ratio)
    local = device.train(prepared.model, initial)
    key = round_key(public, IDENTITY.exchange, "f", "j-1", 1, plan)
    protected = device.protect(local, plan.mask(), key)
    return plan, initial, local, protected


def test_a_round_gives_the_same_update_from_the_same_inputs_and_its_receipt_states_it():
    public, _ = key_pair("masked", 0)
    plan, initial, local, protected = _round(public, budget=0.25)
    again = _round(public, budget=0.25)[3]
    assert local.metrics and protected is not None and protected.serialize_s >= 0
    message = protected.message
    assert message.ciphertext and message.ciphertext == again.message.ciphertext
    assert message.mask.tobytes() == again.message.mask.tobytes()
    assert 0 < float(protected.update.mask.mean()) < 1
    assert needs_fingerprint(protected.update, public) and not needs_fingerprint(protected.update, None)
    fp = public.fingerprint(protected.update.ciphertext, bytes(32))
    stated = receipt("j-1", plan, protected.update, message, initial, public, fp)
    assert stated.fingerprint == fp
    assert stated.start_digest == model_digest(initial) and stated.key_id == public.key_id
    assert stated.ciphertext_digest == hashlib.sha256(message.ciphertext).hexdigest()
    assert stated.plain_digest == hashlib.sha256(plain_part(message.withheld, message.plaintext)).hexdigest()
    assert stated.n_samples == protected.update.n_samples


def test_the_devices_encryption_floor_raises_the_coordinators_budget(caplog):
    public, _ = key_pair("masked", 0)
    with caplog.at_level(logging.WARNING, logger="senseshield.agent"):
        protected = _round(public, budget=0.0, min_he_ratio=0.5)[3]
    assert "encryption budget 0.0000 is below this device's minimum 0.5000" in caplog.text
    assert protected is not None and float(protected.update.mask.mean()) >= 0.5


def test_a_nested_mask_of_the_least_sensitive_blocks_leaves_the_devices_top_blocks_encrypted(caplog):
    """The coordinator writes the device's least sensitive 5 % of blocks as its nested mask
    (the measured attack): the device still encrypts its own most sensitive blocks up to its
    budget (raised to its --min-he-ratio floor), keeps the coordinator's blocks, and says so
    in one warning line."""
    from senseshield.engine.masks import block_scores
    from senseshield.runtime.protocol.messages import pack_mask

    job = JOB.model_copy(update={"options": JOB.options.model_copy(update={"masks": "nested"})})
    public, _ = key_pair("masked", 0)
    _, initial = initial_model(job, (1, 8, 8), 10)
    msg = FleetConfig(run_id="j-1", config=job.model_dump(mode="json"), input_shape=[1, 8, 8], num_classes=10,
                      round_deadline=30, initial=initial)
    prepared = prepare(msg, DataSpec(shard=(1, 4)), "a1")
    state, noise = ClientState(), DeviceNoise(replay_seed=7)
    probe = RoundPlan(cluster=0, encryption_budget=0.1, deadline=0.0, block_size=8, size=initial.size,
                      shared_mask=np.zeros(0, np.uint8))
    local = DeviceRound(prepared.strategy, prepared.config, probe, 1, 1, "a1", state, prepared.data, noise).train(
        prepared.model, initial)
    per_block = block_scores(local.sensitivity, block_size=8)
    order = np.argsort(-per_block, kind="stable")
    worst = np.zeros(per_block.size, bool)
    worst[order[-max(1, int(0.05 * per_block.size)):]] = True
    hostile = np.repeat(worst, 8)[: initial.size]
    plan = probe.model_copy(update={"has_shared_mask": True, "shared_mask": pack_mask(hostile)})
    key = round_key(public, IDENTITY.exchange, "f", "j-1", 1, plan)
    with caplog.at_level(logging.WARNING, logger="senseshield.agent"):
        device = DeviceRound(prepared.strategy, prepared.config, plan, 1, 1, "a1", state, prepared.data, noise,
                             public=public, min_he_ratio=0.25)
        protected = device.protect(local, plan.mask(), key)
    assert protected is not None
    sent = protected.update.mask
    own = np.repeat(np.isin(np.arange(per_block.size), order[:int(0.25 * per_block.size)]), 8)[: initial.size]
    assert sent[own].all() and sent[hostile].all()  # its top blocks at the floor, and the given ones
    assert "left out" in caplog.text and "most sensitive blocks" in caplog.text
    assert len([line for line in caplog.text.splitlines() if "nested mask" in line]) == 1
