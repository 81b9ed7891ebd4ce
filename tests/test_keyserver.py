"""The key server against a real broker: key files, public material only, and what it agrees to
decrypt (issue 14: signed receipts, the round's pinned plan, one use per contribution, the
fingerprint equation). The test plays a deviating coordinator with the coordinator's real
identity, and honest agents with theirs; the key server is the real service."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import stat
import threading
import time

import numpy as np
import pytest

from keyserver.service import KeyServer
from senseshield.engine.aggregation import aggregate_updates, decrypt_aggregate, protect_update
from senseshield.rounds import apply_mean
from senseshield.errors import ConfigError
from senseshield.he import SCHEMES
from senseshield.he.base import job_key, model_digest, round_context
from senseshield.he.fingerprint import bytes_ints, ints_bytes
from senseshield.he.masked import encode, ring_of_words
from senseshield.he.encoding import pack
from senseshield.strategies import STRATEGIES
from senseshield.job import Job, initial_model
from senseshield.runtime.identity import Identity, Trust, unb64
from senseshield.runtime.jobsig import sign_job, signed_nonce
from senseshield.runtime.protocol.messages import (
    AggregateResult,
    Challenge,
    ClusterModel,
    FleetConfig,
    JobSubmit,
    PublicKeyAnnouncement,
    Receipt,
    ReceiptBatch,
    RoundOpen,
    aggregate_to_message,
    from_frame,
    pack_frames,
    pack_mask,
    plain_digest,
    to_frame,
)
from senseshield.runtime.identity import SEALED_SEED_BYTES
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.transport import Link

FLEET = "ks"
SIZE = 650
AGENTS = ["a", "b", "c", "d", "e"]


class Harness:
    """A key server with a trust file pinning the coordinator and five agents; the test holds
    their identities (so it can be an honest agent or a deviating coordinator)."""

    def __init__(self, url: str, key_dir, *, min_contributors: int = 2, min_fraction: float = 0.0,  # noqa: ANN001
                 workers: int | None = None, allow_unverifiable: bool = False,
                 ids: dict[str, Identity] | None = None) -> None:
        self.ids = ids or {n: Identity.generate(n) for n in ["keyserver", "coordinator", "operator", *AGENTS]}
        roles = {n: ("agent" if n in AGENTS else n) for n in self.ids}
        self.trust = Trust.for_identities({n: (i, roles[n]) for n, i in self.ids.items()}, fleet=FLEET)
        self.server = KeyServer(url, fleet=FLEET, key_dir=key_dir, min_contributors=min_contributors,
                                min_fraction=min_fraction, identity=self.ids["keyserver"], trust=self.trust,
                                workers=workers, allow_unverifiable=allow_unverifiable)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.got: list[tuple[str, object, int]] = []
        self.link = Link(url, client_id="coordinator", fleet=FLEET,
                         on_frame=lambda t, f: self.got.append((t, from_frame(f), f.round)))
        for suffix in ("keys/public", "keyserver/results", "clusters/+/model", "keyserver/challenges"):
            self.link.subscribe(suffix)
        self.link.start()
        end = time.monotonic() + 15  # the key server subscribes before anything is sent to it
        while not self.server.link.connected and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)
        self.rng = np.random.default_rng(0)
        self.run = "run-1"
        self.seeds: dict[int, bytes] = {}
        self.deltas: dict[tuple[str, int], np.ndarray] = {}

    def stop(self) -> None:
        self.link.stop()
        self.server.stopping.set()
        self.thread.join(10)

    def send(self, suffix: str, msg, round: int = 0, *, as_: str = "coordinator", signer: str | None = None) -> None:  # noqa: ANN001
        signing = self.ids[signer or as_] if signer != "" else None
        self.link.publish(suffix, to_frame(msg, fleet=FLEET, sender=as_, round=round, signer=signing))

    def wait(self, cls, timeout: float = 60):  # noqa: ANN001, ANN201
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for entry in list(self.got):
                if isinstance(entry[1], cls):
                    self.got.remove(entry)
                    return entry[1], entry[2]
            time.sleep(0.02)
        raise AssertionError(f"no {cls.__name__} within {timeout} s")

    # -- the run --------------------------------------------------------------------------
    def job(self, strategy: str = "sensecrypt", scheme: str | None = "packed-paillier", **over) -> Job:  # noqa: ANN003
        """The harness's job: the linear model on 8x8 inputs and 10 classes (SIZE parameters)."""
        return Job(strategy=strategy, model="linear", clients=2, key_bits=1024, input_shape=[1, 8, 8], num_classes=10,
                   scheme=None if strategy in ("plaintext", "masked") else scheme, **{"rounds": 10, **over})

    def start_run(self, strategy: str = "sensecrypt", run: str | None = None, scheme: str | None = "packed-paillier",
                  *, submission: bytes | None = None, config: Job | None = None, job: Job | None = None,
                  initial: np.ndarray | None = None) -> object:
        """Publish the run's fleet/config as the coordinator, with ``job`` (default :meth:`job`)
        as the operator signed it, under its nonce and its initial model (``submission``:
        other bytes; ``config``: another job than the signed one; ``run``: another run id;
        ``initial``: another initial model)."""
        job = job or self.job(strategy, scheme)
        if submission is None:
            submission = sign_job(job, self.ids["operator"], fleet=FLEET)
        self.run = run or signed_nonce(submission) or "run-unsigned"
        self.submission, self.signed = submission, job
        self.initial = initial if initial is not None else initial_model(job, (1, 8, 8), 10)[1]
        self.send("fleet/config", FleetConfig(run_id=self.run, config=(config or job).model_dump(mode="json"),
                                              input_shape=[1, 8, 8], num_classes=10, round_deadline=30,
                                              initial=self.initial, submission=submission))
        announcement, _ = self.wait(PublicKeyAnnouncement)
        while announcement.run_id != self.run:  # the retained announcement of an earlier run
            announcement, _ = self.wait(PublicKeyAnnouncement)
        self.public = SCHEMES.get(announcement.scheme).public_key_from_bytes(announcement.key) if announcement.scheme else None
        # as the coordinator aggregates: per-client masks on the masked scheme are ragged
        self.public = job_key(self.public, per_client_masks=STRATEGIES.get(job.strategy).per_client_masks)
        return announcement

    def resume(self) -> object:
        """The current job's fleet/config again (as a restarted coordinator sends it)."""
        return self.start_run(job=self.signed, submission=self.submission, run=self.run, initial=self.initial)

    def current(self, cluster: int) -> str:
        """model_digest of the key server's current model of ``cluster`` (what an honest round trains from)."""
        return model_digest(self.server.state.models.get(cluster, (0, self.initial))[1])

    def open_round(self, r: int, clusters: dict[int, list[str]]) -> None:
        self.send("keyserver/rounds", RoundOpen(run_id=self.run, clusters={str(k): v for k, v in clusters.items()}),
                  round=r)
        challenge, got_r = self.wait(Challenge)
        while challenge.run_id != self.run:  # a retained challenge of an earlier run
            challenge, got_r = self.wait(Challenge)
        assert got_r == r
        context = f"{FLEET}/{self.run}/{r}".encode()
        seeds = {a: self.ids[a].open(unb64(s, "sealed", SEALED_SEED_BYTES), unb64(challenge.box_key, "box"), context)
                 for a, s in challenge.sealed.items()}
        assert len(set(seeds.values())) == 1  # every agent of the round got the same seed
        assert sorted(seeds) == sorted(a for v in clusters.values() for a in v)
        self.seeds[r] = next(iter(seeds.values()))

    def contribution(self, agent: str, r: int, cluster: int, *, seed_round: int | None = None, n: int = 10,  # noqa: ANN201
                     start: str | None = None, blocks: range = range(4), shares: int = 0):
        """An honest agent's update (``blocks`` encrypted) and its signed receipt;
        ``start``: the digest of the model it trained from (default: the cluster's current model)."""
        mask = np.zeros(SIZE, bool)
        if self.public is not None:
            B = self.public.block_size
            for b in blocks:
                mask[b * B : (b + 1) * B] = True
        run = self.run
        key = self.public.for_contributor(self.ids[agent].exchange, round_context(FLEET, run, r, cluster)) \
            if self.public is not None else None  # the masked scheme's pads; others ignore it
        delta = self.rng.normal(size=SIZE) * 0.01
        self.deltas[(agent, r)] = delta
        update = protect_update(delta, mask, key, client_id=agent, round=r, cluster=cluster, n_samples=n)
        cipher = self.public.ciphertext_bytes(update.ciphertext) if update.ciphertext is not None else b""
        fp = self.public.fingerprint(update.ciphertext, self.seeds[seed_round or r]) if cipher and self.public.verifiable else b""
        receipt = Receipt(run_id=run, cluster=cluster, n_samples=n, key_id=self.public.key_id if self.public else "",
                          mask_digest=hashlib.sha256(pack_mask(mask).tobytes()).hexdigest(),
                          ciphertext_digest=hashlib.sha256(cipher).hexdigest() if cipher else "", fingerprint=fp,
                          start_digest=start or self.current(cluster),
                          shares=shares, plain_digest=plain_digest(np.zeros(0, np.uint8), update.plaintext))
        return update, to_frame(receipt, fleet=FLEET, sender=agent, round=r, signer=self.ids[agent])

    def request(self, r: int, cluster: int, parts: list, *, contributors: list[str] | None = None,  # noqa: ANN001
                receipts: list[bytes] | None = None, min_encryptors: int = 2):  # noqa: ANN201
        updates = [u for u, _ in parts]
        aggregate = aggregate_updates(updates, self.public, round=r, cluster=cluster, min_encryptors=min_encryptors)
        msg = aggregate_to_message(aggregate, self.public, run_id=self.run,
                                   receipts=receipts if receipts is not None else [rc for _, rc in parts])
        return msg if contributors is None else msg.model_copy(update={"contributors": contributors})

    def verdict(self, r: int, msg) -> AggregateResult:  # noqa: ANN001
        self.send("keyserver/requests", msg, round=r)
        result, got = self.wait(AggregateResult)
        assert got == r
        return result


@pytest.fixture
def harness(mosquitto, tmp_path):
    h = Harness(mosquitto.url, tmp_path / "keys")
    yield h
    h.stop()


def test_keys_are_private_on_disk_and_only_public_material_is_announced(harness, tmp_path):
    announcement = harness.start_run()
    key_dir = tmp_path / "keys"
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    (secret_file,) = key_dir.glob("packed-paillier-*.key")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert announcement.scheme == "packed-paillier"
    assert harness.public.key_id == announcement.key_id
    primes = json.loads(secret_file.read_bytes())
    assert format(int(primes["p"], 16), "x").encode() not in announcement.key


def test_the_checkpoint_and_ledger_are_private_and_the_public_key_is_public(harness, tmp_path):
    """The key server's checkpoint (its challenge seeds, sealed challenges, models) and its
    ledger are 0600 from their first write (write_atomic's default), not left to the key
    directory's 0700; only the public key file is written for others to read."""
    harness.start_run()
    harness.open_round(1, {0: ["a", "b"]})
    result = harness.verdict(1, harness.request(1, 0, [harness.contribution(x, 1, 0) for x in "ab"]))
    assert result.accepted, result.reason
    key_dir = tmp_path / "keys"
    for name in (f"models-{FLEET}.npz", f"ledger-{FLEET}.json"):
        assert stat.S_IMODE((key_dir / name).stat().st_mode) == 0o600, name
    assert json.loads((key_dir / f"ledger-{FLEET}.json").read_text())  # the round's contributions are in it
    (public_file,) = key_dir.glob("packed-paillier-*.pub")
    assert stat.S_IMODE(public_file.stat().st_mode) & 0o044  # readable by others (0644 before the umask)


def test_honest_aggregates_pass_and_each_attack_is_refused_with_its_reason(harness):
    """Forged contributor names, a single ciphertext under three genuine receipts, overlapping
    aggregates (a fresh cluster id; a contribution signed for another cluster), a replay into a
    later round, fingerprints of another round's challenge: each refused with its reason; the
    honest aggregates of the same rounds pass and their models are published. (A round's
    verdict per cluster is final, so every attack gets its own round or cluster.)"""
    harness.start_run()
    plan = {0: ["a", "b", "c"], 1: ["d", "e"]}
    harness.open_round(1, plan)
    a, b, c = (harness.contribution(x, 1, 0) for x in "abc")
    d, e = (harness.contribution(x, 1, 1) for x in "de")
    # one agent's ciphertext with two invented names (the attack of the issue)
    forged = harness.request(1, 0, [a], contributors=["a", "x", "y"]).model_copy(update={"total_weight": 30})
    result = harness.verdict(1, forged)
    assert not result.accepted and "not the signed receipts" in result.reason
    # the honest aggregate of cluster 1 passes, its model is published
    result = harness.verdict(1, harness.request(1, 1, [d, e]))
    assert result.accepted, result.reason
    model, r = harness.wait(ClusterModel)
    assert (model.cluster, r) == (1, 1)
    # overlapping aggregate under a fresh cluster id: outside the plan
    result = harness.verdict(1, harness.request(1, 7, [a, d]))
    assert not result.accepted and "cluster 7 is not in round 1's plan" in result.reason

    harness.open_round(2, plan)
    # one agent's ciphertext under three genuine receipts: the fingerprint equation fails
    a2, b2, c2 = (harness.contribution(x, 2, 0) for x in "abc")
    only_a = harness.request(2, 0, [a2], contributors=["a", "b", "c"], receipts=[a2[1], b2[1], c2[1]])
    result = harness.verdict(2, only_a.model_copy(update={"total_weight": 30}))
    assert not result.accepted and "not the product of the signed contributions" in result.reason
    # a replay of round 1's accepted aggregate into round 2
    result = harness.verdict(2, harness.request(1, 1, [d, e]))
    assert not result.accepted and "is for round 1" in result.reason

    harness.open_round(3, plan)
    # overlapping: d's contribution, signed for cluster 1, offered in cluster 0's aggregate
    a3, d3 = harness.contribution("a", 3, 0), harness.contribution("d", 3, 1)
    result = harness.verdict(3, harness.request(3, 0, [a3, d3]))
    assert not result.accepted and "'d' signed for cluster 1" in result.reason
    # round-3 receipts whose fingerprints were computed under round 2's challenge
    stale = [harness.contribution(x, 3, 1, seed_round=2) for x in "de"]
    result = harness.verdict(3, harness.request(3, 1, stale))
    assert not result.accepted and "not the product" in result.reason

    harness.open_round(4, plan)
    result = harness.verdict(4, harness.request(4, 0, [harness.contribution(x, 4, 0) for x in "abc"]))
    assert result.accepted, result.reason
    # the key server keeps the two latest rounds only: round 1's spending is forgotten (its
    # decrypted contributions stay barred by the ledger)
    assert harness.server.state.spent == {4: {"a": 0, "b": 0, "c": 0}}
    assert set(harness.server.state.plans) == {3, 4}
    assert sum(where.startswith(f"{harness.server.state.run_id}/1/") for where in harness.server.state.ledger.values()) == 2
    assert harness.thread.is_alive()


def test_masked_aggregates_unmask_only_as_the_signed_sum(harness):
    """The masked scheme (issue 22): an honest aggregate is unmasked and applied; one that
    leaves a signed contributor's update out, or offers a receipt of another mask, is
    refused with its reason, and what the key server would have decrypted is noise."""
    announcement = harness.start_run("masked")
    assert announcement.scheme == "masked"
    plan = {0: ["a", "b", "c"], 1: ["d", "e"]}
    harness.open_round(1, plan)
    a, b, c = (harness.contribution(x, 1, 0) for x in "abc")
    result = harness.verdict(1, harness.request(1, 0, [a, b, c]))
    assert result.accepted, result.reason
    model, _ = harness.wait(ClusterModel)
    expected = sum(harness.deltas[(x, 1)] for x in "abc") / 3  # equal weights: the plain mean
    assert np.allclose(model.weights - harness.initial, expected, atol=1e-6)
    # a forged subset: only d's update summed, but d's and e's receipts named: refused at the
    # fingerprint check, before any pad is removed (nothing unmasked, nothing spent)
    d, e = (harness.contribution(x, 1, 1) for x in "de")
    only_d = harness.request(1, 1, [d], contributors=["d", "e"], receipts=[d[1], e[1]])
    result = harness.verdict(1, only_d.model_copy(update={"total_weight": 20}))
    assert not result.accepted and result.retry and "not the product of the signed contributions" in result.reason
    assert 1 not in harness.server.state.spent or "d" not in harness.server.state.spent[1]
    # an update whose fingerprint matches its words but whose words are not its pads + a value
    # in range passes that check and is refused at unmasking: the refusal answered something
    # about d's and e's sum, so their contributions are spent (no oracle)
    result = harness.verdict(1, harness.request(1, 1, [d, out_of_range(harness, e, 1)]))
    assert not result.accepted and not result.retry and "not the sum of exactly the named contributions" in result.reason
    result = harness.verdict(1, harness.request(1, 1, [d, e]))
    assert not result.accepted and "not the sum of exactly the named contributions" in result.reason
    assert harness.server.state.spent[1] == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1}
    harness.open_round(2, plan)
    # a receipt that signs another mask than the aggregate's
    d2, e2 = (harness.contribution(x, 2, 1) for x in "de")
    other = e2[1]  # e2's own receipt (its fingerprint matches), signing another mask
    receipt = from_frame(decode_frame(other)).model_copy(update={"mask_digest": "0" * 64})
    forged_receipt = to_frame(receipt, fleet=FLEET, sender="e", round=2, signer=harness.ids["e"])
    result = harness.verdict(2, harness.request(2, 1, [d2, (e2[0], forged_receipt)]))
    assert not result.accepted and "sign another mask" in result.reason
    # cluster 1's model never moved (both rounds refused): round 3 trains from the same starting
    # model as round 1, and within one job that is a new contribution, accepted
    harness.open_round(3, plan)
    d3, e3 = (harness.contribution(x, 3, 1) for x in "de")
    result = harness.verdict(3, harness.request(3, 1, [d3, e3]))
    assert result.accepted, result.reason
    assert harness.thread.is_alive()


def out_of_range(harness, part, r: int):  # noqa: ANN001, ANN201
    """``part`` with 2^62 added to every masked word, fingerprint and receipt made to match
    (signed with its agent's key): what a device with a genuine key can send."""
    update, frame = part
    receipt = from_frame(decode_frame(frame))
    vector = update.ciphertext
    words = np.asarray(vector.payload, dtype=np.uint64) + np.uint64(1 << 62)
    bad = type(vector)(vector.scheme, vector.key_id, vector.positions, words, vector.nbytes)
    cipher = harness.public.ciphertext_bytes(bad)
    receipt = receipt.model_copy(update={"ciphertext_digest": hashlib.sha256(cipher).hexdigest(),
                                         "fingerprint": harness.public.fingerprint(bad, harness.seeds[r])})
    sender = decode_frame(frame).sender
    return dataclasses.replace(update, ciphertext=bad), to_frame(receipt, fleet=FLEET, sender=sender, round=r,
                                                                 signer=harness.ids[sender])


@pytest.mark.parametrize("strategy", ["sensecrypt", "masked"])
def test_a_bad_fingerprint_costs_only_its_sender(harness, strategy):
    """Issue 23 item 1: c's update does not match the fingerprint it signed (a flipped byte).
    The aggregate with it is refused at the fingerprint check with ``retry`` (nothing decrypted
    or spent); the same aggregate without c, or with c's later genuine update in its place, is
    accepted in the same round and the verdict names c; an attempt the key server already
    refused gets the same verdict again."""
    harness.start_run(strategy)
    harness.open_round(1, {0: ["a", "b", "c"], 1: ["d", "e"]})
    a, b, c = (harness.contribution(x, 1, 0) for x in "abc")
    receipt = from_frame(decode_frame(c[1]))
    flipped = bytes([receipt.fingerprint[0] ^ 1]) + receipt.fingerprint[1:]
    bad_c = (c[0], to_frame(receipt.model_copy(update={"fingerprint": flipped}), fleet=FLEET, sender="c",
                            round=1, signer=harness.ids["c"]))
    everyone = harness.request(1, 0, [a, b, bad_c])
    result = harness.verdict(1, everyone)
    assert not result.accepted and result.retry and "not the product" in result.reason
    assert not harness.server.state.spent.get(1)
    result = harness.verdict(1, everyone)  # the same attempt again: the same verdict
    assert not result.accepted and result.retry
    result = harness.verdict(1, harness.request(1, 0, [b, bad_c]))  # still with c: refused
    assert not result.accepted and result.retry
    result = harness.verdict(1, harness.request(1, 0, [a, b]))
    assert result.accepted, result.reason
    assert list(result.excluded) == ["c"] and "does not match the fingerprint it signed" in result.excluded["c"]
    model, _ = harness.wait(ClusterModel)
    expected = (harness.deltas[("a", 1)] + harness.deltas[("b", 1)]) / 2
    assert np.allclose(model.weights - harness.initial, expected, atol=1e-4)
    assert harness.server.state.spent[1] == {"a": 0, "b": 0}
    # cluster 1: e's first update is bad, its later genuine one replaces it
    d, e = (harness.contribution(x, 1, 1) for x in "de")
    receipt = from_frame(decode_frame(e[1]))
    bad_e = (e[0], to_frame(receipt.model_copy(update={"fingerprint": bytes(len(receipt.fingerprint))}),
                            fleet=FLEET, sender="e", round=1, signer=harness.ids["e"]))
    assert not harness.verdict(1, harness.request(1, 1, [d, bad_e])).accepted
    result = harness.verdict(1, harness.request(1, 1, [d, e]))
    assert result.accepted and "replaced by its later update" in result.excluded["e"]
    assert harness.thread.is_alive()


@pytest.mark.parametrize("strategy", ["masked", "sensecrypt"])
def test_a_rerun_job_cannot_have_the_same_contributions_decrypted_again(mosquitto, tmp_path, strategy):
    """Job 1 decrypts a+b and c+d from the initial model. The operator signs the same job
    again (job 2: same key, same initial model, a new nonce) and the coordinator pairs the
    agents otherwise: refused naming the agent and job 1, after a key server restart too.
    Job 1's own signed config again (its nonce) is refused: a job is served once. A job from
    another initial model (another seed) goes on."""
    h = Harness(mosquitto.url, tmp_path / "keys")
    ids = h.ids
    try:
        h.start_run(strategy)
        first, first_signed = h.run, h.submission
        h.open_round(1, {0: ["a", "b"], 1: ["c", "d"]})
        for cluster, pair in ((0, "ab"), (1, "cd")):
            parts = [h.contribution(x, 1, cluster) for x in pair]
            assert h.verdict(1, h.request(1, cluster, parts)).accepted
    finally:
        h.stop()
    h = Harness(mosquitto.url, tmp_path / "keys", ids=ids)  # restarted: the ledger is on disk
    try:
        h.start_run(strategy)
        assert h.run != first
        h.open_round(1, {0: ["a", "c"], 1: ["b", "d"]})
        result = h.verdict(1, h.request(1, 0, [h.contribution(x, 1, 0) for x in "ac"]))
        assert not result.accepted
        assert f"contribution of 'a' from this starting model was already decrypted in job {first}" in result.reason
        replayed = h.start_run(strategy, submission=first_signed, job=h.signed)
        assert replayed.refused.startswith(f"Job {first} is refused: this key server already served it")
        assert not h.start_run(strategy, job=h.job(strategy, seed=1)).refused  # another initial model
        h.open_round(1, {0: ["a", "c"], 1: ["b", "d"]})
        result = h.verdict(1, h.request(1, 1, [h.contribution(x, 1, 1) for x in "bd"]))
        assert result.accepted, result.reason
    finally:
        h.stop()


def test_a_contribution_enters_one_decrypted_aggregate_per_round_even_after_a_restart(mosquitto, tmp_path):
    h = Harness(mosquitto.url, tmp_path / "keys")
    try:
        h.start_run()
        h.open_round(1, {0: ["a", "b"], 1: ["c", "d"]})
        a, b = h.contribution("a", 1, 0), h.contribution("b", 1, 0)
        assert h.verdict(1, h.request(1, 0, [a, b])).accepted
        # the same round's plan again with another split is refused (pinned)
        h.send("keyserver/rounds", RoundOpen(run_id=h.run, clusters={"0": ["a", "c"], "1": ["b", "d"]}), round=1)
        time.sleep(0.5)
        assert any("already opened with another plan" in r for r in h.server.rejected)
    finally:
        h.stop()
    # the key server restarts from its checkpoint: what was spent stays spent
    again = KeyServer(mosquitto.url, fleet=FLEET, key_dir=tmp_path / "keys", identity=h.ids["keyserver"], trust=h.trust)
    thread = threading.Thread(target=again.run, daemon=True)
    thread.start()
    h.server, h.thread = again, thread
    h.link = Link(mosquitto.url, client_id="coordinator", fleet=FLEET,
                  on_frame=lambda t, f: h.got.append((t, from_frame(f), f.round)))
    for suffix in ("keys/public", "keyserver/results", "clusters/+/model", "keyserver/challenges"):
        h.link.subscribe(suffix)
    h.link.start()
    time.sleep(1.0)
    try:
        h.got.clear()
        h.resume()
        assert again.state.spent[1] == {"a": 0, "b": 0} and again.state.plans[1] == {0: ["a", "b"], 1: ["c", "d"]}
        # the re-sent request of round 1 cluster 0 gets the recorded verdict, not a second decryption
        assert h.verdict(1, h.request(1, 0, [a, b])).accepted
    finally:
        h.stop()


@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_clusters_decrypted_concurrently_give_the_models_of_a_serial_decryption(mosquitto, tmp_path, workers):
    """Three clusters' aggregates sent at once: the key server decrypts them on its workers
    while it keeps answering; every published model is bit for bit the serial computation
    (decrypt, then W + eta * mean) with the secret key from its key file."""
    h = Harness(mosquitto.url, tmp_path / "keys", workers=workers)
    try:
        h.start_run()
        plan = {0: ["a", "b"], 1: ["c", "d"], 2: ["e"]}
        h.open_round(1, plan)
        parts = {k: [h.contribution(x, 1, k) for x in v] for k, v in plan.items()}
        requests = {k: h.request(1, k, p) for k, p in parts.items()}
        for k in (0, 1, 0, 2):  # cluster 0's twice: a re-send is answered, never decrypted twice
            h.send("keyserver/requests", requests[k], round=1)
        verdicts: dict[int, list[AggregateResult]] = {}
        while set(verdicts) != {0, 1, 2}:
            result, _ = h.wait(AggregateResult)
            verdicts.setdefault(result.cluster, []).append(result)
        time.sleep(0.5)
        verdicts[0] += [m for _, m, _ in h.got if isinstance(m, AggregateResult)]
        assert all(v.accepted for v in verdicts[0] + verdicts[1])
        assert all(v == verdicts[0][0] for v in verdicts[0])  # the re-send: the recorded verdict
        assert not verdicts[2][0].accepted and "fewer than the minimum 2" in verdicts[2][0].reason
        models: dict[int, list[np.ndarray]] = {}
        for _, m, r in h.got:
            if isinstance(m, ClusterModel):
                models.setdefault(m.cluster, []).append(m.weights)
        assert sorted(models) == [0, 1]
        (key_file,) = (tmp_path / "keys").glob("packed-paillier-*.key")
        secret = SCHEMES.get("packed-paillier").secret_key_from_bytes(key_file.read_bytes())
        assert secret.structure == "subgroup"
        for k in (0, 1):
            aggregate = aggregate_updates([u for u, _ in parts[k]], h.public, round=1, cluster=k)
            serial = apply_mean(h.initial, decrypt_aggregate(aggregate, secret, threads=1), server_lr=1.0)
            assert all(np.array_equal(w, serial.astype(np.float32)) for w in models[k])
        assert h.server.state.spent == {1: {"a": 0, "b": 0, "c": 1, "d": 1}} and h.server.state.reserved == {1: {}}
        assert not h.server.state.pending and h.server.state.models[0][0] == 1
    finally:
        h.stop()


def test_the_minimum_is_per_cluster_absolute_and_relative(mosquitto, tmp_path):
    h = Harness(mosquitto.url, tmp_path / "keys", min_contributors=2, min_fraction=0.75)
    try:
        h.start_run("plaintext")
        h.open_round(1, {0: ["a", "b", "c", "d"], 1: ["e"]})
        two = [h.contribution(x, 1, 0) for x in "ab"]
        result = h.verdict(1, h.request(1, 0, two))
        assert not result.accepted and "fewer than the minimum 3" in result.reason and "--min-fraction 0.75" in result.reason
        result = h.verdict(1, h.request(1, 1, [h.contribution("e", 1, 1)]))
        assert not result.accepted and "fewer than the minimum 2" in result.reason
        h.open_round(2, {0: ["a", "b", "c", "d"]})
        result = h.verdict(2, h.request(2, 0, [h.contribution(x, 2, 0) for x in "abc"]))
        assert result.accepted, result.reason
    finally:
        h.stop()


def test_frames_not_signed_by_the_pinned_key_are_rejected_and_the_server_goes_on(harness):
    harness.start_run()
    harness.open_round(1, {0: ["a", "b"]})
    a, b = harness.contribution("a", 1, 0), harness.contribution("b", 1, 0)
    request = harness.request(1, 0, [a, b])
    harness.send("keyserver/requests", request, round=1, signer="")  # unsigned
    harness.send("keyserver/requests", request, round=1, signer="a")  # signed by an agent, sent as the coordinator
    harness.send("keyserver/requests", request, round=1, as_="a")  # an agent's own request
    time.sleep(0.8)
    reasons = list(harness.server.rejected)
    assert any("Unsigned 'aggregate-request' frame from 'coordinator'" in r for r in reasons), reasons
    assert any("not its pinned key" in r for r in reasons), reasons
    assert any("only the coordinator may send aggregates" in r for r in reasons), reasons
    assert not harness.server.state.results  # none of them reached a verdict
    assert harness.verdict(1, request).accepted
    # a receipt signed by b's key but naming a
    harness.open_round(2, {0: ["a", "b"]})
    a2, b2 = harness.contribution("a", 2, 0), harness.contribution("b", 2, 0)
    forged_receipt = to_frame(from_frame(decode_frame(a2[1])), fleet=FLEET, sender="a", round=2, signer=harness.ids["b"])
    result = harness.verdict(2, harness.request(2, 0, [a2, b2], receipts=[forged_receipt, b2[1]]))
    assert not result.accepted and "not its pinned key" in result.reason


def test_a_key_directory_that_is_a_file_stops_the_key_server(tmp_path, mosquitto):
    bad = tmp_path / "keys"
    bad.write_text("not a directory")
    with pytest.raises(ConfigError, match="is a file"):
        KeyServer(mosquitto.url, fleet=FLEET, key_dir=bad)


@pytest.mark.parametrize("scheme", ["packed-paillier", "masked"])
def test_a_block_fewer_than_k_agents_encrypted_is_never_decrypted(harness, caplog, scheme):
    """Issue 22 item 2 on the real service: a and b share blocks 0-1, a alone encrypts
    block 2 (the budget-0 partner's leak: its sum with b's plaintext is a's value). The
    honest aggregate leaves block 2 sealed and is applied, block 2 then averaging b alone;
    a coordinator that asks for block 2 (the papers' k = 1), or forwards a mask other than
    the signed one, is refused with the block and the agent named. ``masked``: SenseCrypt's
    per-client masks over pads (each agent's removed where its signed mask says)."""
    harness.start_run(scheme=scheme)
    plan = {0: ["a", "b"]}
    B = harness.public.block_size
    for r, attack in ((1, "k1"), (2, "mask"), (3, None)):
        harness.open_round(r, plan)
        a = harness.contribution("a", r, 0, blocks=range(3))
        b = harness.contribution("b", r, 0, blocks=range(2))
        if attack == "k1":
            result = harness.verdict(r, harness.request(r, 0, [a, b], min_encryptors=1))
            assert not result.accepted
            assert "block 2 encrypted only by ['a']" in result.reason and "fewer than 2 agents" in result.reason
        elif attack == "mask":  # claims b encrypted block 2 too, so that it would be decrypted
            msg = harness.request(r, 0, [a, b])
            per = (SIZE + 7) // 8
            forged = msg.masks.copy()
            forged[per:] = msg.masks[:per]
            result = harness.verdict(r, msg.model_copy(update={"masks": forged}))
            assert not result.accepted and "are not the ones their receipts sign" in result.reason
        else:
            with caplog.at_level("INFO", logger="senseshield.keyserver"):
                result = harness.verdict(r, harness.request(r, 0, [a, b]))
            assert result.accepted, result.reason
            model, got = harness.wait(ClusterModel)
            assert got == r
            weights = np.asarray(model.weights, dtype=np.float64) - harness.initial.astype(np.float32)
            sealed = slice(2 * B, 3 * B)
            # block 2: b's plaintext alone (float32 on the wire); a's value there never enters
            np.testing.assert_allclose(weights[sealed], harness.deltas[("b", r)][sealed].astype(np.float32), atol=1e-6)
            both = slice(0, 2 * B)
            mean = (harness.deltas[("a", r)][both] + harness.deltas[("b", r)][both]) / 2
            np.testing.assert_allclose(weights[both], mean, atol=1e-3)
            assert any("block 2 by ['a']" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("allow", [False, True])
def test_ckks_aggregates_are_decrypted_only_where_the_coordinator_is_trusted(mosquitto, tmp_path, allow):
    """Issue 22 item 4: a CKKS sum cannot be checked against fingerprints, so a key server
    refuses it with one sentence unless started with --allow-unverifiable."""
    h = Harness(mosquitto.url, tmp_path / "keys", allow_unverifiable=allow)
    try:
        h.start_run("fedml-he", scheme="ckks-sum")
        h.open_round(1, {0: ["a", "b"]})
        result = h.verdict(1, h.request(1, 0, [h.contribution(x, 1, 0) for x in "ab"]))
        if allow:
            assert result.accepted, result.reason
        else:
            assert not result.accepted and "--allow-unverifiable" in result.reason
            assert "cannot be checked" in result.reason
    finally:
        h.stop()


def test_only_a_job_an_operator_signed_is_served(harness, caplog):
    """Issue 22 item 3: the coordinator alone cannot start a job. A fleet/config without the
    operator's signed job, with a job the coordinator signed (under its own name, or under the
    operator's name with its own key), or whose config is not the signed job (another seed)
    is refused: the key server announces the refusal for that run in one sentence naming it
    and why, logs it, takes nothing of the run and keeps serving; the genuine job is served."""
    job = harness.job()
    coordinator, operator = harness.ids["coordinator"], harness.ids["operator"]
    submit = JobSubmit(request_id="r1", job=job.model_dump(mode="json"))
    genuine = sign_job(job, operator, fleet=FLEET)
    initial = initial_model(job, (1, 8, 8), 10)[1]
    moved = initial.copy()
    moved[7] = np.nextafter(np.float32(moved[7]), np.float32(np.inf))  # one float32 ULP in one weight
    cases = {
        "run-unsigned": ({"submission": b""}, "it carries no job signed by an operator of fleet 'ks'"),
        "run-by-coordinator": ({"submission": to_frame(submit, fleet=FLEET, sender="coordinator", round=0, signer=coordinator)},
                               "it is signed by 'coordinator', which the trust file pins as 'coordinator', not as an operator"),
        "run-posing": ({"submission": to_frame(submit, fleet=FLEET, sender="operator", round=0, signer=coordinator)},
                       "Frame from 'operator' is signed with key"),
        "run-other-fleet": ({"submission": sign_job(job, operator, fleet="other")},
                            "it is signed for fleet 'other', not 'ks'"),
        "run-seed": ({"config": job.model_copy(update={"seed": job.seed + 1})},
                     f"its configuration is not the job 'operator' signed (seed is {job.seed + 1}, signed {job.seed})"),
        "run-no-nonce": ({"submission": to_frame(submit, fleet=FLEET, sender="operator", round=0, signer=operator)},
                         "carries no nonce"),
        "run-renamed": ({"submission": genuine}, f"'operator' signed this job as run {signed_nonce(genuine)}"),
        signed_nonce(genuine): ({"submission": genuine, "initial": moved}, "is not the one 'operator' signed"),
    }
    for run, (kwargs, why) in cases.items():
        announcement = harness.start_run(run=run, job=job, **kwargs)
        assert (announcement.run_id, announcement.scheme, announcement.key) == (run, "", b"")
        assert announcement.refused.startswith(f"Job {run} is refused: ") and why in announcement.refused, announcement.refused
        assert announcement.refused in caplog.text
    assert harness.server.state.run_id is None and harness.thread.is_alive()  # nothing of a refused run was taken
    announcement = harness.start_run(job=job, submission=genuine)
    assert not announcement.refused and announcement.scheme == "packed-paillier"
    assert harness.server.state.run_id == signed_nonce(genuine)
    # the same run id again with a moved initial model: refused (logged), whatever the run id;
    # the run it serves goes on with its own initial model
    with caplog.at_level("ERROR", logger="senseshield.keyserver"):
        harness.send("fleet/config", FleetConfig(run_id=harness.run, config=job.model_dump(mode="json"),
                                                 input_shape=[1, 8, 8], num_classes=10, round_deadline=30,
                                                 initial=moved, submission=genuine))
        end = time.monotonic() + 30
        while "(the run it serves goes on unchanged)" not in caplog.text and time.monotonic() < end:
            time.sleep(0.05)
    assert "is not the one 'operator' signed (" in caplog.text and "(the run it serves goes on unchanged)" in caplog.text
    assert harness.server.state.run_id == signed_nonce(genuine) and np.array_equal(harness.server.state.initial, initial)


def test_a_sum_of_fewer_contributors_than_the_noise_shares_is_never_unmasked(harness):
    """Distributed DP (masked-dp): each receipt signs how many contributors its noise share
    was sized for; a sum of fewer would carry less than the job's noise, so the key server
    refuses it, whatever plan the coordinator published; as many or more pass."""
    harness.start_run()
    harness.open_round(1, {0: ["a", "b", "c"], 1: ["d", "e"]})
    short = [harness.contribution(x, 1, 0, shares=3) for x in "ab"]
    result = harness.verdict(1, harness.request(1, 0, short))
    assert not result.accepted and "fewer than the 3 the noise shares" in result.reason
    result = harness.verdict(1, harness.request(1, 1, [harness.contribution(x, 1, 1, shares=2) for x in "de"]))
    assert result.accepted, result.reason


def bent(harness, msg, shift: float):  # noqa: ANN001, ANN201
    """A deviating coordinator's aggregate: ``shift`` added to the mean at every encrypted
    position (the ciphertext changed by ``W · enc(shift)`` per position, ``W`` the total
    weight) and declared as plaintext folded in, so the fingerprint equation still holds."""
    public, W = harness.public, msg.total_weight
    vector = public.vector_from_bytes(msg.ciphertext)
    if public.scheme == "masked":
        ring = ring_of_words(vector.payload)
        d = encode(np.full(vector.positions.size, shift), ring) * ring.dtype(W)
        fold = (np.frombuffer(msg.plain_fold, dtype=f">u{ring.word_bytes}").astype(ring.dtype) if msg.plain_fold
                else np.zeros(vector.positions.size, ring.dtype))
        vector.payload = vector.payload + d
        declared = (fold + d).astype(f">u{ring.word_bytes}").tobytes()
    else:  # packed Paillier: every slot of every block moves by W · round(shift / step)
        lay, B, n, payload = public.layout, public.block_size, public.n, vector.payload
        lengths = np.bincount(np.searchsorted(payload.blocks, vector.positions // B), minlength=payload.blocks.size)
        sums = np.zeros((lengths.size, B), dtype=np.int64)
        for j, length in enumerate(lengths):
            sums[j, :length] = W * int(round(shift / lay.step))
        deltas = [int(d) for d in pack(sums, lay.slot_bits)]
        fold = bytes_ints(msg.plain_fold, public._key_bytes, lengths.size, "fold") if msg.plain_fold else [0] * lengths.size
        payload.ciphertexts = [c * (1 + d * n) % (n * n) for c, d in zip(payload.ciphertexts, deltas)]
        declared = ints_bytes([(f + d) % n for f, d in zip(fold, deltas)], public._key_bytes)
    return msg.model_copy(update={"ciphertext": public.ciphertext_bytes(vector), "plain_fold": declared})


def test_a_masked_aggregate_that_folds_plaintext_is_refused(harness):
    """With ``masked`` every contributor masks every position and nobody sends plaintext. The
    coordinator adds 0.3 to every value of the aggregate and declares the change as the
    plaintext it folded in (the fingerprint equation holds; before the key server recomputed
    the fold, this released a mean 0.300 higher at every parameter): refused in one
    sentence, nothing unmasked or spent. The honest aggregate of the other cluster passes."""
    harness.start_run("masked")
    harness.open_round(1, {0: ["a", "b", "c"], 1: ["d", "e"]})
    parts = [harness.contribution(x, 1, 0, blocks=range(SIZE)) for x in "abc"]  # every position masked
    result = harness.verdict(1, bent(harness, harness.request(1, 0, parts), 0.3))
    assert not result.accepted and not result.retry
    assert (f"folds plaintext into {SIZE} of its {SIZE} ciphertext units, positions every contributor encrypted"
            in result.reason), result.reason
    assert not harness.server.state.spent.get(1)
    result = harness.verdict(1, harness.request(1, 1, [harness.contribution(x, 1, 1, blocks=range(SIZE)) for x in "de"]))
    assert result.accepted, result.reason
    model, _ = harness.wait(ClusterModel)
    np.testing.assert_allclose(model.weights - harness.initial, (harness.deltas[("d", 1)] + harness.deltas[("e", 1)]) / 2, atol=1e-6)


@pytest.mark.parametrize("scheme", ["masked", "packed-paillier"])
def test_a_per_client_mask_aggregate_whose_plaintext_side_was_bent_is_refused(harness, tmp_path, scheme):
    """SenseCrypt's per-client masks over ``masked`` and over packed Paillier: a encrypts blocks
    0-2, b blocks 0-1, c block 0 (block 2 stays sealed: one encryptor). The key server
    recomputes what the aggregate adds in plaintext from the parts the receipts sign, so each
    bend is refused naming what differs: the fold shifted by 0.3 with the ciphertext (the
    fingerprints hold), the plaintext sums, the position weights, the sealed positions' sums,
    (packed) the block weights, a plaintext part that is not the signed one. The honest
    aggregate passes and its model is the serial decryption of the coordinator's aggregate,
    bit for bit."""
    harness.start_run(scheme=scheme)
    plan = {0: ["a", "b", "c"]}

    def sums(msg):  # noqa: ANN001, ANN202
        return msg.model_copy(update={"plain_sum": msg.plain_sum + 0.3 * msg.total_weight})

    def weights(msg):  # noqa: ANN001, ANN202
        w = msg.position_weight.copy()
        w[-1] -= 1
        return msg.model_copy(update={"position_weight": w})

    def sealed(msg):  # noqa: ANN001, ANN202
        return msg.model_copy(update={"thin_sum": msg.thin_sum + 0.3})

    def blocks(msg):  # noqa: ANN001, ANN202
        vector = harness.public.vector_from_bytes(msg.ciphertext)
        vector.payload.weights = np.asarray(vector.payload.weights) - 1
        return msg.model_copy(update={"ciphertext": harness.public.ciphertext_bytes(vector)})

    def part(msg):  # noqa: ANN001, ANN202
        plains = msg.contributor_plains()
        plains["b"] = plains["b"][:-4] + np.float32(0.3).tobytes()
        return msg.model_copy(update={"plains": pack_frames([plains[a] for a in sorted(plains)])})

    attacks = {
        "fold": (lambda msg: bent(harness, msg, 0.3),
                 "the plaintext folded into the aggregate's ciphertext differs from its contributors' signed plaintext"),
        "sums": (sums, "the aggregate's plaintext sums differ from its contributors' signed plaintext parts at"),
        "weights": (weights, "the aggregate's position weights differ from its contributors' signed masks"),
        "sealed": (sealed, "the plaintext senders' sums at the sealed positions differ from their signed plaintext"),
        "part": (part, "the plaintext parts of ['b'] are not the ones their receipts sign"),
    }
    if scheme == "packed-paillier":
        attacks["blocks"] = (blocks, "the aggregate's block weights differ from its contributors' signed sample counts")
    for r, (name, (attack, reason)) in enumerate([*attacks.items(), ("honest", (None, None))], start=1):
        harness.open_round(r, plan)
        parts = [harness.contribution(x, r, 0, blocks=range(n)) for x, n in (("a", 3), ("b", 2), ("c", 1))]
        honest = harness.request(r, 0, parts)
        assert honest.plain_fold and honest.thin_sum.size and honest.plain_sum.size  # every plaintext side in use
        if attack is not None:
            result = harness.verdict(r, attack(honest))
            assert not result.accepted and reason in result.reason, (name, result.reason)
            assert not harness.server.state.spent.get(r)
            continue
        result = harness.verdict(r, honest)
        assert result.accepted, result.reason
        model, got = harness.wait(ClusterModel)
        assert got == r
        (key_file,) = (tmp_path / "keys").glob(f"{scheme}*.key")
        secret = SCHEMES.get(scheme).secret_key_from_bytes(key_file.read_bytes())
        aggregate = aggregate_updates([u for u, _ in parts], harness.public, round=r, cluster=0, min_encryptors=2)
        if harness.public.needs_contributors:
            secret.bind_contributions(aggregate.ciphertext, [(harness.ids[a].box_key, 10) for a in "abc"],
                                      round_context(FLEET, harness.run, r, 0),
                                      masks=[aggregate.masks[a] for a in "abc"])
        serial = apply_mean(harness.initial, decrypt_aggregate(aggregate, secret), server_lr=1.0)
        np.testing.assert_array_equal(model.weights, serial.astype(np.float32))


def _rejected(h: Harness, needle: str, timeout: float = 60.0) -> None:
    """Wait until the key server has rejected a message for ``needle`` (an event, not a delay)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(needle in r for r in list(h.server.rejected)):
            return
        time.sleep(0.02)
    raise AssertionError(f"no rejection for {needle!r} within {timeout} s: {list(h.server.rejected)}")


def test_receipts_sent_ahead_in_batches_are_judged_as_the_request_would_judge_them(harness):
    """A large request's receipts come ahead of it in batches (ReceiptBatch), checked as they
    come: the verdict is the one the same receipts inline get (accepted and unmasked, or
    refused with the same reason); a request whose batches did not all come, a batch out of
    order and one from anyone but the coordinator get no verdict; a batch's receipts are kept
    only until their request is judged."""
    h = harness
    h.start_run("masked")
    plan = {0: ["a", "b", "c"], 1: ["d", "e"]}

    def batched(r: int, msg, parts: list[list[bytes]], attempt: str = "1" * 32, *, send: int | None = None):  # noqa: ANN001, ANN202
        for i, part in enumerate(parts[:send]):
            h.send("keyserver/requests", ReceiptBatch(run_id=h.run, cluster=msg.cluster, attempt=attempt, index=i,
                                                      receipts=pack_frames(part)), round=r)
        return msg.model_copy(update={"receipts": b"", "attempt": attempt, "batches": len(parts)})

    h.open_round(1, plan)
    a, b, c = (h.contribution(x, 1, 0) for x in "abc")
    result = h.verdict(1, batched(1, h.request(1, 0, [a, b, c]), [[a[1]], [b[1], c[1]]]))
    assert result.accepted, result.reason
    model, _ = h.wait(ClusterModel)
    assert np.allclose(model.weights - h.initial, sum(h.deltas[(x, 1)] for x in "abc") / 3, atol=1e-6)
    assert not h.server.state.staged

    h.open_round(2, plan)
    a2, d2 = h.contribution("a", 2, 0), h.contribution("d", 2, 1)
    inline = h.verdict(2, h.request(2, 0, [a2, d2]))
    h.open_round(3, plan)
    a3, d3 = h.contribution("a", 3, 0), h.contribution("d", 3, 1)
    result = h.verdict(3, batched(3, h.request(3, 0, [a3, d3]), [[a3[1]], [d3[1]]]))
    assert not result.accepted and "'d' signed for cluster 1" in result.reason
    assert result.reason == inline.reason

    b3, c3 = h.contribution("b", 3, 0), h.contribution("c", 3, 0)
    request = h.request(3, 0, [b3, c3])
    h.send("keyserver/requests", batched(3, request, [[b3[1]], [c3[1]], []], "2" * 32, send=2), round=3)
    _rejected(h, "came after 2 of its 3 receipt batches")
    h.send("keyserver/requests", ReceiptBatch(run_id=h.run, cluster=0, attempt="3" * 32, index=1,
                                              receipts=pack_frames([b3[1]])), round=3)
    _rejected(h, "came before its batch 0")
    h.send("keyserver/requests", ReceiptBatch(run_id=h.run, cluster=0, attempt="4" * 32, index=0,
                                              receipts=pack_frames([b3[1]])), round=3, as_="b")
    _rejected(h, "only the coordinator sends aggregates")
    assert (3, 0) in h.server.state.results  # the refusal above, and nothing since
    assert h.thread.is_alive()
