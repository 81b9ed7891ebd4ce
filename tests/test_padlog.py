"""A device's pad log (edge_agent.padlog) and its check of the coordinator's round plan
(edge_agent.round.plan_refusal): a slot is masked in once, across restarts and cut lines;
the plan's job-derived fields are the device's own computation; every field that shapes a
pad gives another pad."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.padlog import LINE_BYTES, PadLog, slot_of
from edge_agent.round import pad_context, plan_refusal
from senseshield.errors import ConfigError
from senseshield.he import SCHEMES
from senseshield.he.base import round_context
from senseshield.he.masked import pads, pad_key, RING32, RING64
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.messages import RoundPlan
from senseshield.strategies import build_strategy
from senseshield.strategies.base import StrategyOptions


def test_a_slot_takes_one_vector_ever_and_the_same_one_again(tmp_path):
    log = PadLog(tmp_path / "pads-used.log")
    slot = slot_of("f", "j-0123456789abcdef", 1, "a")
    assert log.refusal(slot, b"ctx", b"vector-1") is None
    log.record(slot, b"ctx", b"vector-1")
    assert log.refusal(slot, b"ctx", b"vector-1") is None  # the saved frame again (a re-sent plan)
    assert "already sent a masked update in this round" in log.refusal(slot, b"ctx", b"vector-2")
    assert "already sent" in log.refusal(slot, b"other plan", b"vector-1")  # another plan, same round
    assert log.refusal(slot_of("f", "j-0123456789abcdef", 2, "a"), b"ctx", b"vector-2") is None
    assert log.refusal(slot_of("f", "j-fedcba9876543210", 1, "a"), b"ctx", b"vector-2") is None
    assert log.refusal(slot_of("f", "j-0123456789abcdef", 1, "b"), b"ctx", b"vector-2") is None  # another agent
    # durable: a restarted device (a new PadLog on the same file) refuses the same
    again = PadLog(tmp_path / "pads-used.log")
    assert "already sent" in again.refusal(slot, b"ctx", b"vector-2")
    assert stat.S_IMODE(os.stat(tmp_path / "pads-used.log").st_mode) == 0o600


def test_a_line_cut_by_a_crash_is_dropped_and_the_next_record_starts_a_line(tmp_path):
    path = tmp_path / "pads-used.log"
    log = PadLog(path)
    log.record(slot_of("f", "j", 1, "a"), b"c", b"v")
    with open(path, "a") as fh:
        fh.write("0123456789abcdef 00")  # a crash mid-line, before the fsync: that frame was never sent
    again = PadLog(path)
    assert len(again.used) == 1
    again.record(slot_of("f", "j", 2, "a"), b"c", b"v")
    assert len(PadLog(path).used) == 2
    path.write_text("garbage\n")
    with pytest.raises(ConfigError, match="broken line 1"):
        PadLog(path)


def test_the_log_grows_by_one_line_of_fixed_size_a_round(tmp_path):
    log = PadLog(tmp_path / "pads-used.log")
    for r in range(1, 1001):
        log.record(slot_of("fleet", "j-0123456789abcdef", r, "a"), b"context", b"ciphertext %d" % r)
    assert (tmp_path / "pads-used.log").stat().st_size == 1000 * LINE_BYTES == 147_000


def _plan(**over) -> RoundPlan:  # noqa: ANN003
    fields = dict(cluster=0, encryption_budget=1.0, deadline=0.0, block_size=1, size=100,
                  shared_mask=np.zeros(0, np.uint8), ring_bits=32)
    return RoundPlan(**{**fields, **over})


def test_every_field_that_shapes_a_pad_gives_an_independent_pad():
    """HKDF info binds fleet, job, round, cluster, plan digest and ring: changing any one of
    them (the coordinator's choices included) gives pads unrelated to the first."""
    secret = SCHEMES.get("masked").generate()
    agent = Identity.generate("a")
    shared = agent.exchange(secret.public_key.box)
    plan = _plan()
    base = round_context("f", "j-1", 1, 0, plan.digest())
    variants = [round_context("g", "j-1", 1, 0, plan.digest()), round_context("f", "j-2", 1, 0, plan.digest()),
                round_context("f", "j-1", 2, 0, plan.digest()), round_context("f", "j-1", 1, 1, plan.digest()),
                round_context("f", "j-1", 1, 0, _plan(encryption_budget=0.5).digest())]
    positions = np.arange(64)
    first = pads(pad_key(shared, base, RING64), positions, RING64)
    for context in variants:
        assert not np.array_equal(pads(pad_key(shared, context, RING64), positions, RING64), first)
    # the same context in the other ring: its 32-bit words are not the halves of the 64-bit ones
    halves = first.view(np.uint32)
    other = pads(pad_key(shared, base, RING32), np.arange(128), RING32)
    assert not np.any(other == halves)
    # a re-sent plan with another deadline is the same plan
    assert _plan(deadline=5.0).digest() == plan.digest()
    assert pad_context("f", "j-1", 1, plan) == base


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70_000), option=st.sampled_from(["auto", 32, 64]), bits=st.sampled_from([32, 64]))
def test_the_ring_is_the_devices_own_computation(n, option, bits):
    """A plan's ring is refused unless the job allows it for this device: the job's ring
    when it names one, and 32 bits only while this device's own weight fits its head-room."""
    strategy = build_strategy("masked", StrategyOptions(ring_bits=option))
    public = SCHEMES.get("masked").generate().public_key
    refusal = plan_refusal(strategy, public, _plan(ring_bits=bits), n)
    allowed = {option} if option != "auto" else ({32, 64} if n < 1 << 16 else {64})
    assert (refusal is None) == (bits in allowed), refusal
    if refusal is not None:
        assert f"the plan's ring is {bits} bits" in refusal


def test_a_plan_with_another_block_size_or_consensus_step_is_refused():
    strategy = build_strategy("masked", StrategyOptions())
    public = SCHEMES.get("masked").generate().public_key
    assert plan_refusal(strategy, public, _plan(), 10) is None
    assert "block size 2 is not the job key's 1" in plan_refusal(strategy, public, _plan(block_size=2), 10)
    assert "asks for a consensus mask" in plan_refusal(strategy, public, _plan(negotiate=True), 10)


def test_a_plan_with_less_noise_than_the_job_calibrates_is_refused():
    """DP strategies: the plan's noise multipliers are the job's, computed by the device from
    the job and its own sample count; a coordinator that plans less (or no) noise is refused."""
    from edge_agent.round import expected_noise
    from senseshield.job import Job

    job = Job(strategy="dp-fedavg", model="linear", options={"target_epsilon": 4.0}, rounds=3)
    strategy = build_strategy(job.strategy, job.options)
    user, record = expected_noise(job, strategy, 300)
    assert user is not None and user > 0
    honest = _plan(noise_multiplier=user, record_noise=record, ring_bits=64)
    assert plan_refusal(strategy, None, honest, 300, noise=(user, record)) is None
    for over in ({"noise_multiplier": user / 10}, {"noise_multiplier": None}):
        refusal = plan_refusal(strategy, None, _plan(**{**honest.model_dump(), **over}), 300, noise=(user, record))
        assert refusal is not None and "a coordinator does not choose how much noise a device adds" in refusal
    assert expected_noise(Job(strategy="masked", model="linear"), build_strategy("masked", StrategyOptions()), 300) == \
        (None, None)
