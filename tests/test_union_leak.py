"""Issue 22 item 2: the coordinator's union-block attack (senseshield_checks.union_leak,
written apart from the engine) against SenseCrypt in the real simulator: under the papers'
rule (k = 1) it solves every value an agent alone encrypted; under the default k = 2 it does
no better than guessing the other agents' mean."""

import pytest

from senseshield.job import Job
from senseshield.simulation import run_simulation
from senseshield_checks.union_leak import Tally


def _attack(k: int) -> tuple[int, int, int]:
    tally = Tally()
    job = Job(strategy="sensecrypt", dataset="digits", model="mlp", clients=4, rounds=1, seed=1, partition="iid",
              cpu=[8.0, 8.0, 8.0, 0.08], bandwidth=[100.0, 100.0, 100.0, 1.0], options={"min_encryptors": k})
    run_simulation(job, noise_seed=1, observe=tally.observe)
    return tally.recovered, tally.alone, tally.chance


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2])  # k=1: the papers' rule, make test-slow
def test_the_union_block_attack_is_at_chance_under_the_k_rule(k):
    hits, attacked, chance = _attack(k)
    assert attacked > 20  # the fleet has single-encryptor positions to attack
    if k == 1:
        assert hits == attacked  # every one solved
    else:
        assert hits == chance < attacked / 2  # what is left is the guess of the others' mean


def test_nested_masks_leave_only_the_devices_own_additions_sealed_and_the_attack_at_chance():
    """masks=nested: every block of the plan's prefixes has two encryptors, slow partner
    included; what is left with one encryptor is what a device added of its own most
    sensitive blocks (its floor, which the coordinator's prefix cannot lower), all sealed by
    the k rule, so the attacker does no better than guessing the others' mean."""
    tally = Tally()
    job = Job(strategy="sensecrypt", dataset="digits", model="mlp", clients=4, rounds=1, seed=1, partition="iid",
              cpu=[8.0, 8.0, 8.0, 0.08], bandwidth=[100.0, 100.0, 100.0, 1.0], options={"masks": "nested"})
    result = run_simulation(job, noise_seed=1, observe=tally.observe)
    assert tally.encrypted > 0 and tally.alone < 0.05 * tally.encrypted
    assert result.rounds[0].sealed_positions == tally.alone  # every single-encryptor position is sealed
    assert tally.recovered == tally.chance
