"""A coordinator that lies, against the real services: the project's malicious-coordinator suite.

One fleet for the whole module: a real Mosquitto, the real key server (in a thread, so the
test can read its secret as ground truth) and three real agents (``edge-agent join``
processes with their own identities, a signed trust file, declared profiles and shards of
digits). The test itself is the coordinator: it holds only the coordinator's identity, the
broker and the job files the operator signed, and it deviates. It signs and publishes
``fleet/config``, round plans, ``keyserver/rounds``, notices and aggregate requests, and it
keeps every frame the agents and the key server send.

Each test plays one attack and asserts (a) the refusal, with its sentence (an agent's log,
the key server's announcement or verdict), and (b) that the attacker code below recovers
nothing: it subtracts every two masked vectors one agent sent and solves every model the key
server released for individual updates; both are scored against the true updates, which only
the test knows (the key server's secret removes each vector's pads).

The job is the worst case for differencing: a batch that covers each device's shard (one
full-batch step a round), so a device's update from a given model is the same in every round
and every re-run of the job, and two sums of it in other pairings would solve it exactly.

The tests play one story in file order on the module's fleet (a job's state carries from one
test to the next), 20 to 40 s on two busy cores. Each attack's outcome goes into a table
printed at the end of the module (and kept in ``OUTCOMES``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from edge_agent.padlog import ALREADY_SENT
from keyserver.service import KeyServer
from senseshield.development import DEVELOPMENT_ENV, development_mode
from senseshield.engine.aggregation import aggregate_updates
from senseshield.he import SCHEMES
from senseshield.he.base import job_key, model_digest, round_context
from senseshield.he.masked import decode, pads, ring_of
from senseshield.job import Job, initial_model, with_shape
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.jobsig import sign_job, signed_nonce
from senseshield.runtime.protocol.envelope import decode_frame
from senseshield.runtime.protocol.messages import (
    AggregateResult,
    Challenge,
    ClusterModel,
    FleetConfig,
    Hello,
    Notice,
    PublicKeyAnnouncement,
    Receipt,
    RoundOpen,
    RoundPlan,
    UpdateMessage,
    aggregate_to_message,
    from_frame,
    to_frame,
    update_from_message,
)
from senseshield.runtime.transport import Link
from senseshield.strategies import StrategyOptions
from tests.broker import Mosquitto
from tests.test_keyserver import Harness, out_of_range

ROOT = Path(__file__).resolve().parents[1]
FLEET = "liar"
AGENTS = ["c000", "c001", "c002"]
WAIT = 120.0  # the most any one event is waited for (a busy machine); events end every wait
# full-batch steps: a device's update depends only on the model it starts from (see the docstring)
JOB = with_shape(Job(strategy="masked", model="mlp", dataset="digits", clients=len(AGENTS), min_devices=len(AGENTS),
                     rounds=5, local_epochs=1, batch_size=512, lr=0.5, round_deadline=60.0))
SIZE = 50_826
OUTCOMES: list[tuple[str, str, str, str]] = []  # attack, refused by, message, fraction of values recovered


# ---- the attacker's code ----------------------------------------------------------------------
@dataclass
class Sent:
    """One masked vector an agent sent, as the coordinator holds it."""

    agent: str
    run: str
    round: int
    cluster: int
    n: int
    plan_digest: str
    start_digest: str
    words: np.ndarray  # uint32 or uint64: the ring
    positions: np.ndarray
    ciphertext: bytes
    message: UpdateMessage
    receipt: bytes

    @property
    def ring(self) -> int:
        return 32 if self.words.dtype == np.uint32 else 64


def subtract_pairs(sent: list[Sent]) -> list[tuple[Sent, Sent, np.ndarray]]:
    """The attacker: every two different masked vectors of one agent (any job, round, ring),
    subtracted word by word, ``(v1, v2, what the attacker reads)``. Same ring: ``v1 - v2``,
    the difference of the two values wherever the pads were the same (with a second value of
    about 0, lr 1e-30, the first value itself). A 64-bit and a 32-bit vector: the low half of
    each 64-bit word minus the 32-bit word of the same keystream bytes (a keystream read both
    ways leaves the difference of the values)."""
    out = []
    by_agent: dict[str, dict[bytes, Sent]] = {}
    for s in sent:
        by_agent.setdefault(s.agent, {}).setdefault(s.ciphertext, s)  # a re-sent frame is no new vector
    for vectors in by_agent.values():
        for v1, v2 in itertools.combinations(vectors.values(), 2):
            if v1.ring == 32 and v2.ring == 64:
                v1, v2 = v2, v1
            out.append((v1, v2, _difference(v1.words, v2.words)))
    return out


def _difference(w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """``w1 - w2`` in the ring, or, for a 64-bit ``w1`` and a 32-bit ``w2``, the low half of
    ``w1[i]`` minus ``w2[2i]`` (the keystream's first four bytes of word i) modulo 2^32."""
    with np.errstate(over="ignore"):
        if w1.dtype == w2.dtype:
            return w1 - w2
        half = min(w1.size, (w2.size + 1) // 2)  # word i of 64 bits holds the bytes of 32-bit words 2i, 2i + 1
        return (w1[:half] & np.uint64(0xFFFFFFFF)).astype(np.uint32) - w2[: 2 * half : 2]


def pads_cancelled(pairs: list[tuple[Sent, Sent, np.ndarray]], truth) -> float:  # noqa: ANN001
    """The largest fraction of positions, over the attacker's pairs, at which its difference is
    the true difference of the two encoded values: where the pads cancelled, the attacker has
    the values. ``truth``: a vector's pad-free words (ground truth, not the attacker's)."""
    best = 0.0
    for v1, v2, read in pairs:
        exact = _difference(truth(v1), truth(v2))
        best = max(best, float(np.mean(read == exact)))
    return best


@dataclass
class Released:
    """A model the key server released: the aggregate the attacker sent for it and the model."""

    contributors: dict[tuple[str, str], int]  # (agent, start digest) -> its weight
    start: np.ndarray
    model: np.ndarray


def solve_released(released: list[Released]) -> dict[tuple[str, str], np.ndarray]:
    """The attacker: each released model is ``start + Σ n_a x_a / Σ n_a``; a device's update
    from one starting model is the same in every round and job (full-batch steps), so every
    (agent, starting model) is one unknown. Returns the unknowns the released sums determine
    (least squares where the unknown is in the equations' row space)."""
    unknowns = sorted({u for rel in released for u in rel.contributors})
    if not unknowns:
        return {}
    A = np.array([[rel.contributors.get(u, 0) for u in unknowns] for rel in released], dtype=np.float64)
    rhs = np.stack([(rel.model.astype(np.float64) - rel.start.astype(np.float32).astype(np.float64))
                    * sum(rel.contributors.values()) for rel in released])
    solved = {}
    for j, u in enumerate(unknowns):
        e = np.eye(len(unknowns))[j]
        y, *_ = np.linalg.lstsq(A.T, e, rcond=None)
        if np.allclose(A.T @ y, e, atol=1e-9):  # x_u is a combination of the released sums
            solved[u] = y @ rhs
    return solved


def recovered_fraction(solved: dict[tuple[str, str], np.ndarray], truth: dict[tuple[str, str], np.ndarray]) -> float:
    """Of the informative true values (|x| >= 1e-3) of every unknown, the fraction the
    attacker's solution gives to within 1e-4."""
    hits = total = 0
    for u, x in truth.items():
        informative = np.abs(x) >= 1e-3
        total += int(informative.sum())
        if u in solved:
            hits += int(np.sum(informative & (np.abs(solved[u] - x) <= 1e-4)))
    return hits / max(total, 1)


# ---- the fleet and the lying coordinator ------------------------------------------------------
def wait_for(what: str, condition, timeout: float = WAIT):  # noqa: ANN001, ANN201
    """Poll ``condition`` until it is truthy (returned); AssertionError naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class World:
    """The module's fleet, and the coordinator's view of it (what it sent and received)."""

    out: Path
    broker: Mosquitto = None  # type: ignore[assignment]
    ids: dict[str, Identity] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    hellos: list[tuple[str, str]] = field(default_factory=list)  # (agent, run)
    announcements: list[tuple[PublicKeyAnnouncement, bytes]] = field(default_factory=list)
    results: list[tuple[int, AggregateResult]] = field(default_factory=list)
    models: list[tuple[int, ClusterModel]] = field(default_factory=list)
    challenges: list[tuple[int, str]] = field(default_factory=list)  # (round, run)
    released: list[Released] = field(default_factory=list)
    cluster_models: dict[tuple[str, int], tuple[int, np.ndarray]] = field(default_factory=dict)  # (run, k) -> latest
    errors: list[str] = field(default_factory=list)

    def start(self) -> "World":
        self.broker = Mosquitto(self.out / "broker").start()
        self.url = self.broker.url
        files = {"keyserver": self.out / "ids" / "keyserver.key", "coordinator": self.out / "ids" / "coordinator.key",
                 "operator": self.out / "ids" / "operator.key",
                 **{a: self.out / "agents" / a / "identity" / "agent.key" for a in AGENTS}}
        self.id_files = files
        self.ids = {n: Identity.load_or_create(n, p) for n, p in files.items()}
        roles = {n: (n if n in ("keyserver", "coordinator", "operator") else "agent") for n in files}
        trust = Trust.for_identities({n: (i, roles[n]) for n, i in self.ids.items()}, fleet=FLEET)
        trust.sign(self.ids["operator"], serial=1)
        self.trust_file = trust.save(self.out / "trust.json")
        self.trust = Trust.load(self.trust_file, fleet=FLEET)
        self.keyserver = KeyServer(self.url, fleet=FLEET, key_dir=self.out / "keys", identity=self.ids["keyserver"],
                                   trust=self.trust)
        assert self.keyserver.require_signed_jobs
        self.thread = threading.Thread(target=self.keyserver.run, daemon=True)
        self.thread.start()
        self.link = Link(self.url, client_id="coordinator", fleet=FLEET, on_frame=self._on_frame)
        for suffix in ("agents/+/hello", "agents/+/update", "keys/public", "keyserver/results",
                       "keyserver/challenges", "clusters/+/model"):
            self.link.subscribe(suffix)
        self.link.start()
        (self.out / "logs").mkdir(exist_ok=True)
        for i in range(len(AGENTS)):
            self.spawn(i)
        wait_for("the key server's connection", lambda: self.keyserver.link.connected)
        return self

    def spawn(self, i: int) -> None:
        """Start agent ``i`` (again): ``edge-agent join`` with its identity, the trust file, a
        declared profile and shard i/N of digits; it keeps taking jobs."""
        a = AGENTS[i]
        argv = [sys.executable, "-m", "edge_agent.cli", "join", "--broker", self.url, "--fleet", FLEET,
                "--agent-id", a, "--profile", "x86", "--shard", f"{i}/{len(AGENTS)}", "--dataset", "digits",
                "--threads", "1", "--identity", str(self.id_files[a]), "--trust", str(self.trust_file),
                "--model-dir", str(self.out / "agents" / a / "models")]
        env = {k: v for k, v in os.environ.items() if k != DEVELOPMENT_ENV}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with (self.out / "logs" / f"{a}.log").open("ab") as log:
            self.procs[a] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.link.stop()
        self.keyserver.stopping.set()
        self.thread.join(15)
        self.broker.stop()

    # -- what arrives ---------------------------------------------------------------------
    def _on_frame(self, topic: str, frame) -> None:  # noqa: ANN001
        try:
            msg = from_frame(frame)
            if isinstance(msg, Hello):
                self.hellos.append((frame.sender, msg.run_id))
            elif isinstance(msg, UpdateMessage):
                receipt_frame = decode_frame(msg.receipt)
                receipt: Receipt = from_frame(receipt_frame)  # type: ignore[assignment]
                vector = self.public_of(receipt.run_id).vector_from_bytes(msg.ciphertext)
                self.sent.append(Sent(frame.sender, receipt.run_id, frame.round, receipt.cluster, receipt.n_samples,
                                      receipt.plan_digest, receipt.start_digest, np.asarray(vector.payload),
                                      np.asarray(vector.positions), bytes(msg.ciphertext), msg, msg.receipt))
            elif isinstance(msg, PublicKeyAnnouncement):
                self.announcements.append((msg, frame.raw))
            elif isinstance(msg, AggregateResult):
                self.results.append((frame.round, msg))
            elif isinstance(msg, ClusterModel):
                self.models.append((frame.round, msg))
            elif isinstance(msg, Challenge):
                self.challenges.append((frame.round, msg.run_id))
        except Exception as exc:  # noqa: BLE001 - a test's capture must never kill paho's thread
            self.errors.append(f"{topic}: {type(exc).__name__}: {exc}")

    def public_of(self, run: str):  # noqa: ANN201
        """The masked key the key server announced for ``run`` (the coordinator's unbound key)."""
        for msg, _ in reversed(self.announcements):
            if msg.run_id == run and msg.scheme:
                return job_key(SCHEMES.get(msg.scheme).public_key_from_bytes(msg.key), per_client_masks=False)
        raise AssertionError(f"no key announced for run {run}")

    def announcement(self, run: str, after: int = 0) -> PublicKeyAnnouncement:
        return wait_for(f"the key server's announcement for run {run}", lambda: next(
            (m for m, _ in self.announcements[after:] if m.run_id == run), None))

    def log(self, agent: str) -> str:
        return (self.out / "logs" / f"{agent}.log").read_text(errors="replace")

    def marks(self) -> dict[str, int]:
        """Where every agent's log ends now (to look only at what follows)."""
        return {a: len(self.log(a)) for a in AGENTS}

    def said(self, agent: str, needle: str, after: dict[str, int]) -> str:
        """The first line of ``agent``'s log after ``after`` that holds ``needle`` (waited for)."""
        def line() -> str | None:
            for text in self.log(agent)[after[agent]:].splitlines():
                if needle in text:
                    return text
            return None
        return wait_for(f"{agent} to log {needle!r}", line)

    # -- what the coordinator sends -------------------------------------------------------
    def send(self, suffix: str, msg, round: int = 0, *, retain: bool = False) -> None:  # noqa: ANN001
        self.link.publish(suffix, to_frame(msg, fleet=FLEET, sender="coordinator", round=round,
                                           signer=self.ids["coordinator"]), retain=retain)

    def config(self, run: str, job: Job, submission: bytes, *, initial: np.ndarray | None = None) -> None:
        """``fleet/config`` (retained, as the coordinator publishes it): ``job`` as run ``run``
        with the operator's ``submission`` (b"": none) and ``initial`` (default: the job's)."""
        if initial is None:
            initial = initial_model(job, tuple(job.input_shape), job.num_classes)[1]
        self.send("fleet/config", FleetConfig(run_id=run, config=job.model_dump(mode="json"),
                                              input_shape=list(job.input_shape), num_classes=job.num_classes,
                                              round_deadline=job.round_deadline, initial=initial,
                                              submission=submission), retain=True)

    def join(self, run: str, job: Job, submission: bytes, agents: list[str] = AGENTS, *, new: bool = True) -> None:
        """A genuine config of ``run``; waits for the key (``new``: the key server announces a
        new run) and every agent's hello for it."""
        before = {a: self.hellos.count((a, run)) for a in agents}
        start = len(self.announcements)
        self.config(run, job, submission)
        if new:
            announced = self.announcement(run, start)
            assert not announced.refused, announced.refused
        wait_for(f"{agents}' hellos for {run}", lambda: all(self.hellos.count((a, run)) > before[a] for a in agents))
        self.initial = initial_model(job, tuple(job.input_shape), job.num_classes)[1]

    def open_round(self, run: str, r: int, clusters: dict[int, list[str]]) -> None:
        """``keyserver/rounds``; waits for the key server's sealed challenge of the round."""
        self.send("keyserver/rounds", RoundOpen(run_id=run, clusters={str(k): v for k, v in clusters.items()}), round=r)
        wait_for(f"round {r}'s challenge", lambda: (r, run) in self.challenges)

    def start_of(self, run: str, k: int) -> tuple[int, np.ndarray]:
        """(model round, weights) cluster ``k`` of ``run`` is at (0, the initial model: none released)."""
        return self.cluster_models.get((run, k), (0, self.initial))

    def plan(self, r: int, agent: str, k: int, *, run: str, ring_bits: int, participants: int = 1,
             model_round: int | None = None) -> None:
        """Agent ``agent``'s round plan (cluster ``k``, from the cluster's latest model unless
        ``model_round`` says which)."""
        if model_round is None:
            model_round, _ = self.start_of(run, k)
        self.send(f"agents/{agent}/inbox", RoundPlan(
            cluster=k, encryption_budget=1.0, deadline=time.time() + 60, block_size=1, size=SIZE,
            model_round=model_round, participants=participants, ring_bits=ring_bits,
            shared_mask=np.zeros(0, np.uint8)), round=r)

    def play(self, run: str, r: int, clusters: dict[int, list[str]], *, ring_bits: int) -> dict[str, Sent]:
        """Open round ``r``, plan it to every member, wait for their updates."""
        self.open_round(run, r, clusters)
        for k, members in clusters.items():
            for a in members:
                self.plan(r, a, k, run=run, ring_bits=ring_bits, participants=len(members))
        members = [a for v in clusters.values() for a in v]
        wait_for(f"round {r}'s updates of {members}", lambda: all(self.update(run, r, a) for a in members))
        return {a: self.update(run, r, a) for a in members}

    def update(self, run: str, r: int, agent: str) -> Sent | None:
        return next((s for s in self.sent if (s.run, s.round, s.agent) == (run, r, agent)), None)

    def updates(self, run: str, r: int, agent: str) -> list[Sent]:
        return [s for s in self.sent if (s.run, s.round, s.agent) == (run, r, agent)]

    def aggregate(self, run: str, r: int, k: int, parts: list[Sent], *,  # noqa: ANN201
                  contributors: list[str] | None = None):
        """The aggregate request of ``parts`` for cluster ``k`` (``contributors``: another list)."""
        public = self.public_of(run)
        updates = [update_from_message(s.message, public, client_id=s.agent, round=s.round, size=SIZE) for s in parts]
        updates = [u if (u.cluster, u.round) == (k, r) else _recluster(u, k, r) for u in updates]
        msg = aggregate_to_message(aggregate_updates(updates, public, round=r, cluster=k), public, run_id=run,
                                   receipts=[s.receipt for s in parts])
        return msg if contributors is None else msg.model_copy(update={"contributors": contributors})

    def verdict(self, r: int, msg, parts: list[Sent] = ()) -> AggregateResult:  # noqa: ANN001
        """Send ``msg`` for round ``r``; the key server's verdict (an accepted one's model is
        waited for and kept, with what the attacker knows of the sum it released)."""
        before = len(self.results)
        self.link.publish("keyserver/requests", to_frame(msg, fleet=FLEET, sender="coordinator", round=r,
                                                         signer=self.ids["coordinator"]))
        result = wait_for(f"the verdict on round {r} cluster {msg.cluster}", lambda: next(
            (res for rr, res in self.results[before:] if rr == r and res.cluster == msg.cluster
             and res.run_id == msg.run_id), None))
        if result.accepted and parts:
            model = wait_for("the released model", lambda: next(
                (m for rr, m in self.models if rr == r and m.cluster == msg.cluster and m.run_id == msg.run_id), None))
            _, start = self.start_of(msg.run_id, msg.cluster)
            self.released.append(Released({(s.agent, s.start_digest): s.n for s in parts}, start, model.weights))
            self.cluster_models[(msg.run_id, msg.cluster)] = (r, model.weights.astype(np.float64))
        return result

    # -- ground truth (the key server's secret: never the attacker's) -----------------------
    def truth_words(self, s: Sent) -> np.ndarray:
        """``s``'s encoded values: its words minus the pads the key server derives for it."""
        ring = ring_of(s.ring)
        context = round_context(FLEET, s.run, s.round, s.cluster, s.plan_digest)
        key = self.keyserver.state.secret.contributor_pad_key(self.ids[s.agent].box_key, context, ring)
        with np.errstate(over="ignore"):
            return s.words - pads(key, s.positions, ring)

    def truth(self) -> dict[tuple[str, str], np.ndarray]:
        """Every (agent, starting model)'s true update, from its first vector."""
        out: dict[tuple[str, str], np.ndarray] = {}
        for s in self.sent:
            out.setdefault((s.agent, s.start_digest), decode(self.truth_words(s)))
        return out

    def recovered(self) -> float:
        """What the attacker gets from everything so far: the largest of its two readings."""
        by_pairs = pads_cancelled(subtract_pairs(self.sent), self.truth_words)
        by_models = recovered_fraction(solve_released(self.released), self.truth())
        return max(by_pairs, by_models)


def _recluster(update, k: int, r: int):  # noqa: ANN001, ANN202
    """``update`` summed into cluster ``k`` of round ``r`` (what a coordinator that replays it does)."""
    import dataclasses

    return dataclasses.replace(update, cluster=k, round=r)


def outcome(attack: str, refused_by: str, message: str, world: World) -> None:
    """Record the attack's row (with what the attacker gets from everything sent so far) and
    check the attacker got nothing: no more than chance (a 32-bit pad word coincides with
    probability 2^-32 per position)."""
    fraction = world.recovered()
    OUTCOMES.append((attack, refused_by, message.strip(), f"{fraction:.4f}"))
    assert fraction < 1e-3, f"{attack}: the attacker recovered {fraction:.2%} of the values"


def _table() -> str:
    rows = [("attack", "refused by", "message", "recovered"), *OUTCOMES]
    lines = []
    for attack, by, message, frac in rows:
        short = message if len(message) <= 150 else message[:147] + "..."
        lines.append(f"| {attack} | {by} | {short} | {frac} |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def world(tmp_path_factory, request):
    """The fleet, and the genuine start of job A: every agent joins, round 1 is planned to all
    three in cluster 0 (32-bit ring, as the job's ``auto`` gives), c000 + c001 are unmasked."""
    assert not development_mode(), f"{DEVELOPMENT_ENV} is set: the services' secure defaults would be relaxed"
    w = World(tmp_path_factory.mktemp("liar")).start()
    t0 = time.monotonic()
    try:
        w.job_a = sign_job(JOB, w.ids["operator"], fleet=FLEET)
        w.run_a = signed_nonce(w.job_a)
        w.join(w.run_a, JOB, w.job_a)
        w.round1 = w.play(w.run_a, 1, {0: AGENTS}, ring_bits=32)
        parts = [w.round1["c000"], w.round1["c001"]]
        result = w.verdict(1, w.aggregate(w.run_a, 1, 0, parts), parts)
        assert result.accepted, result.reason
        for s in w.round1.values():  # the ground truth is right: in range, not noise
            x = decode(w.truth_words(s))
            assert np.abs(x).max() <= 1.0 and np.abs(x).max() > 1e-3
        yield w
    finally:
        w.stop()
        table = _table()
        (w.out / "outcomes.md").write_text(table + "\n")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line("")
                reporter.write_line(f"malicious coordinator: outcomes ({time.monotonic() - t0:.0f} s after the fleet "
                                    f"started; 'recovered': what the attacker code gets from everything sent so far)")
                for line in table.splitlines():
                    reporter.write_line(line)
        assert not w.errors, w.errors


# ---- the attacker code, checked where it must succeed -------------------------------------------
def test_the_attacker_code_recovers_values_under_a_reused_pad_and_from_three_pair_sums():
    """Without the services: two vectors of one agent under one pad key (one ring, or one
    keystream read as 64- and as 32-bit words) give the attacker every value; three pair sums
    of three agents solve all three, two solve none. So a 0 in the table is the defences', not
    a blind attacker's."""
    from senseshield.he.masked import RING32, RING64, encode

    rng = np.random.default_rng(0)
    x1, x2, y = (rng.normal(size=SIZE) * 0.05 for _ in range(3))
    positions = np.arange(SIZE)
    key = os.urandom(32)

    def vector(words: np.ndarray) -> Sent:
        return Sent("a", "run", 1, 0, 1, "", "", words, positions, words.tobytes(), None, b"")  # type: ignore[arg-type]

    with np.errstate(over="ignore"):
        for ring, first, second in ((RING64, x1, x2), (RING32, x1, x2)):
            e1, e2 = encode(first, ring), encode(second, ring)
            v1, v2 = vector(e1 + pads(key, positions, ring)), vector(e2 + pads(key, positions, ring))
            truth = {id(v1): e1, id(v2): e2}
            pairs = subtract_pairs([v1, v2])
            assert pads_cancelled(pairs, lambda v: truth[id(v)]) == 1.0
            np.testing.assert_allclose(decode(pairs[0][2]), decode(e1 - e2), atol=0)
        e64, e32 = encode(x1, RING64), encode(y, RING32)
        v64, v32 = vector(e64 + pads(key, positions, RING64)), vector(e32 + pads(key, positions, RING32))
        truth = {id(v64): e64, id(v32): e32}
        assert pads_cancelled(subtract_pairs([v32, v64]), lambda v: truth[id(v)]) == 1.0
        other = vector(e32 + pads(os.urandom(32), positions, RING32))  # another pad key: nothing
        truth[id(other)] = e32
        assert pads_cancelled(subtract_pairs([v64, other]), lambda v: truth[id(v)]) < 1e-3

    start = np.zeros(SIZE)
    xs = {"a": x1, "b": x2, "c": y}
    n = {"a": 3, "b": 5, "c": 7}

    def release(*agents: str) -> Released:
        total = sum(n[a] for a in agents)
        model = (start + sum(n[a] * xs[a] for a in agents) / total).astype(np.float32)
        return Released({(a, "m0"): n[a] for a in agents}, start, model)

    truth_x = {(a, "m0"): x for a, x in xs.items()}
    assert recovered_fraction(solve_released([release("a", "b"), release("a", "c")]), truth_x) == 0.0
    assert recovered_fraction(solve_released([release("a", "b"), release("a", "c"), release("b", "c")]),
                              truth_x) > 0.99


# ---- the attacks --------------------------------------------------------------------------------


def test_round_1_re_planned_in_the_64_bit_ring_gets_the_update_already_sent(world):
    """Attack 2 (one process): the genuine round 1 (32-bit ring) planned again at 64 bits, so
    that the same keystream would be read as 64-bit words. Each agent answers with the update
    it already sent, unchanged: no second vector."""
    run = world.run_a
    before = {a: len(world.updates(run, 1, a)) for a in AGENTS}
    for a in AGENTS:
        world.plan(1, a, 0, run=run, ring_bits=64, participants=3, model_round=0)
    wait_for("the agents' answers to the re-plan",
             lambda: all(len(world.updates(run, 1, a)) > before[a] for a in AGENTS))
    for a in AGENTS:
        answers = world.updates(run, 1, a)
        assert {s.ciphertext for s in answers} == {world.round1[a].ciphertext} and {s.ring for s in answers} == {32}
    outcome("round 1 re-planned at ring_bits=64 (same process)",
            "edge_agent/service.py `_do_round` (a round already sent: its saved update again)",
            "(no refusal needed: each agent re-sent its 32-bit round-1 update, byte for byte)", world)


def test_cancel_then_the_same_run_id_unsigned_or_changed_is_refused_and_round_1_is_never_masked_again(world, caplog):
    """Attack 1: a ``cancelled`` notice, then ``fleet/config`` under the same run id without
    the operator's signature (lr 1e-30), then with it but lr 1e-30: every agent and the key
    server refuse both. The genuine config again (the same nonce) and round 1's plan again:
    every agent refuses from its pad log; and so does an agent killed and started again with
    its identity directory (round 1 planned at 64 bits)."""
    run = world.run_a
    mark = world.marks()
    world.send("fleet/control", Notice(run_id=run, kind="cancelled", reason="cancelled by the coordinator"))
    for a in AGENTS:
        world.said(a, f"job {run}: the job was cancelled", mark)
    tiny = JOB.model_copy(update={"lr": 1e-30})
    cases = [
        ("cancel, then the same run id unsigned (lr 1e-30)", b"",
         "it carries no job signed by an operator of fleet 'liar'"),
        ("cancel, then the same run id, the genuine signature, lr 1e-30", world.job_a,
         "its configuration is not the job 'operator' signed (lr is 1e-30, signed 0.5)"),
    ]
    for attack, submission, why in cases:
        start = len(world.announcements)
        with caplog.at_level("ERROR", logger="senseshield.keyserver"):
            world.config(run, tiny, submission)
            # the key server refuses it in its log; the run it serves stays announced as it was
            wait_for("the key server's refusal", lambda: f"Job {run} is refused: {why}" in caplog.text)
        assert "(the run it serves goes on unchanged)" in caplog.text
        assert not [m for m, _ in world.announcements[start:] if m.run_id == run]
        lines = [world.said(a, f"not taking it: Job {run} is refused: {why}", mark) for a in AGENTS]
        outcome(attack, "edge_agent/service.py `_on_config` and keyserver/service.py `_on_config` (`job_refusal`)",
                lines[0].split("not taking it: ", 1)[1], world)
    assert not any(s.run == run and s.round == 1 and s.ciphertext != world.round1[s.agent].ciphertext
                   for s in world.sent)

    # the genuine config again: every agent takes the job again, and refuses its round 1 again
    world.join(run, JOB, world.job_a, new=False)
    mark = world.marks()
    sent = len(world.sent)
    for a in AGENTS:
        world.plan(1, a, 0, run=run, ring_bits=32, participants=3, model_round=0)
    lines = [world.said(a, f"round 1 of job {run}: {ALREADY_SENT}", mark) for a in AGENTS]
    assert len(world.sent) == sent
    outcome("the genuine config again (same nonce), round 1 planned again",
            "edge_agent/padlog.py `PadLog` (checked in edge_agent/service.py `_do_round`)",
            lines[0].split(": ", 1)[1] if ": " in lines[0] else lines[0], world)

    # an agent process killed and started again (same identity directory, its pad log)
    hellos = world.hellos.count(("c002", run))
    world.procs["c002"].kill()
    world.procs["c002"].wait()
    mark = world.marks()
    world.spawn(2)
    wait_for("c002's hello after its restart", lambda: world.hellos.count(("c002", run)) > hellos)
    world.plan(1, "c002", 0, run=run, ring_bits=64, participants=3, model_round=0)
    line = world.said("c002", f"round 1 of job {run}: {ALREADY_SENT}", mark)
    assert len(world.sent) == sent
    assert [s.ciphertext for s in world.sent if (s.agent, s.run, s.round) == ("c002", run, 1)] == \
        [world.round1["c002"].ciphertext] * 2  # round 1 and the re-plan of the test before
    outcome("... after the agent process was killed and restarted (round 1 at ring_bits=64)",
            "edge_agent/padlog.py (the fsynced `pads-used-ID.log` beside the identity)",
            line.split(": ", 1)[1] if ": " in line else line, world)


def test_overlapping_single_ghost_and_replayed_aggregates_are_refused_and_release_nothing(world, caplog):
    """Attack 4: overlapping subsets in one round (c001 + c002 after c000 + c001 in round 1's
    cluster 0; and under a cluster the round's plan does not have), a single contributor, a
    ghost contributor without a receipt, and round 1's receipts offered in round 2: no second
    model of round 1, none of round 2."""
    run, r1 = world.run_a, world.round1
    first = next(m for rr, m in world.models if rr == 1 and m.run_id == run and m.cluster == 0)
    with caplog.at_level("INFO", logger="senseshield.keyserver"):
        result = world.verdict(1, world.aggregate(run, 1, 0, [r1["c001"], r1["c002"]]))
    recorded = "round 1 cluster 0: re-sent request; answering with the recorded verdict"
    assert recorded in caplog.text and result.accepted  # the verdict on c000 + c001, nothing decrypted
    same = [m for rr, m in world.models if rr == 1 and m.run_id == run and m.cluster == 0]
    assert all(np.array_equal(m.weights, first.weights) for m in same)
    outcome("overlapping subset in one round: c001 + c002 after c000 + c001 (round 1, cluster 0)",
            "keyserver/service.py `_on_request` (one verdict per round and cluster)",
            recorded + " (c000 + c001's; no second model)", world)
    result = world.verdict(1, world.aggregate(run, 1, 7, [r1["c001"], r1["c002"]]))
    assert not result.accepted and "cluster 7 is not in round 1's plan" in result.reason
    outcome("overlapping subset under a cluster id not in the round's plan", "keyserver/verify.py `verify`",
            result.reason, world)

    parts = world.play(run, 2, {0: ["c000"], 1: ["c001"], 2: ["c002"]}, ring_bits=32)
    attacks = [
        ("a single contributor", world.aggregate(run, 2, 0, [parts["c000"]]),
         "1 distinct contributor(s) ['c000'], fewer than the minimum 2"),
        ("a ghost contributor (not in the plan, no receipt)",
         world.aggregate(run, 2, 1, [parts["c001"]], contributors=["c001", "c009"]),
         "the contributor list ['c001', 'c009'] is not the signed receipts' ['c001']"),
        ("round 1's updates and receipts offered in round 2", world.aggregate(run, 2, 2, [r1["c000"], r1["c001"]]),
         f"the receipt of 'c000' is for round 1 of run '{run}'"),
    ]
    for attack, msg, why in attacks:
        result = world.verdict(2, msg)
        assert not result.accepted and why in result.reason, result.reason
        outcome(attack, "keyserver/verify.py `verify`", result.reason, world)
    assert not any(rr == 2 and m.run_id == run for rr, m in world.models)


def test_fresh_clusters_cannot_pair_one_starting_models_updates_again_within_the_job(world):
    """A lying coordinator's fresh cluster ids start from the initial model, and full-batch
    updates from one model are the same in every round: round 3 pairs c000 with c002, round 4
    c001 with c002, which with round 1's c000 + c001 would solve all three. The key server
    refuses a contribution from a starting model whose sum it already released in the job."""
    run = world.run_a
    parts = world.play(run, 3, {5: ["c000", "c002"], 6: ["c001"]}, ring_bits=64)
    again = decode(world.truth_words(parts["c000"]))
    assert np.abs(again - decode(world.truth_words(world.round1["c000"]))).max() < 2e-5  # the premise
    pair = [parts["c000"], parts["c002"]]
    third = world.verdict(3, world.aggregate(run, 3, 5, pair), pair)
    parts = world.play(run, 4, {7: ["c001", "c002"]}, ring_bits=64)
    pair = [parts["c001"], parts["c002"]]
    fourth = world.verdict(4, world.aggregate(run, 4, 7, pair), pair)
    outcome("fresh cluster id from the initial model: c000 + c002 (round 3), c001 + c002 (round 4)",
            "keyserver/verify.py `verify` (the ledger, within the job too)", third.reason or "accepted", world)
    why = "the contribution of 'c000' from this starting model was already released in this job (round 1, cluster 0)"
    assert not third.accepted and why in third.reason, third.reason
    assert not fourth.accepted and "the contribution of 'c001' from this starting model was already released" \
        in fourth.reason, fourth.reason
    assert not any(rr in (3, 4) and m.run_id == run for rr, m in world.models)


def test_a_round_beyond_the_signed_jobs_rounds_is_neither_opened_nor_trained(world):
    """The operator signed 5 rounds; round 6 would be one more sum than it signed for (under a
    DP strategy, privacy budget beyond the job's epsilon). The key server does not open it and
    no agent trains for it."""
    run, n = world.run_a, JOB.rounds + 1
    rejected = world.keyserver.rejected_total
    mark = world.marks()
    world.send("keyserver/rounds", RoundOpen(run_id=run, clusters={"0": AGENTS}), round=n)
    why = f"job {run} has {JOB.rounds} rounds"
    refused = wait_for("the key server's refusal of the round", lambda: world.keyserver.rejected_total > rejected and next(
        (x for x in list(world.keyserver.rejected) if f"Round plan {n}" in x and why in x), None))
    for a in AGENTS:
        world.plan(n, a, 0, run=run, ring_bits=32, participants=3, model_round=1)
    lines = [world.said(a, f"Round plan for round {n}; {why}", mark) for a in AGENTS]
    assert not any(s.run == run and s.round == n for s in world.sent) and (n, run) not in world.challenges
    outcome(f"round {n} of a job the operator signed with {JOB.rounds} rounds",
            "keyserver/service.py `_on_round_open`, edge_agent/service.py `_on_plan`",
            f"{refused} / {lines[0].split('rejected message on ', 1)[-1]}", world)


def test_a_second_signature_of_the_job_cannot_pair_its_updates_again(world):
    """Attack 4 (re-run): the operator signs the same job again (job B: a new nonce, the same
    initial model); the coordinator pairs c000 with c002. The key server's cross-job ledger
    refuses c000's contribution from that model, decrypted in job A."""
    world.job_b = sign_job(JOB, world.ids["operator"], fleet=FLEET)
    run_b = world.run_b = signed_nonce(world.job_b)
    world.join(run_b, JOB, world.job_b)
    parts = world.play(run_b, 1, {0: ["c000", "c002"], 1: ["c001"]}, ring_bits=32)
    pair = [parts["c000"], parts["c002"]]
    result = world.verdict(1, world.aggregate(run_b, 1, 0, pair), pair)
    why = (f"the contribution of 'c000' from this starting model was already decrypted in job {world.run_a} "
           "(round 1, cluster 0)")
    assert not result.accepted and why in result.reason, result.reason
    assert not any(m.run_id == run_b for _, m in world.models)
    outcome("the same job signed again (new nonce), c000 + c002", "keyserver/verify.py `verify` (the ledger)",
            result.reason, world)


def test_the_signed_job_under_another_run_id_another_initial_model_or_again_is_refused(world):
    """Attack 3: job A's signed frame under a new run id; under its own nonce with the initial
    model moved by one float32 ULP; and as signed, once more: the key server announces a
    refusal of each, the agents refuse the first two themselves and join none."""
    run_a = world.run_a
    renamed = f"j-{os.urandom(8).hex()}"
    moved = world.initial.copy()
    moved[7] = np.nextafter(np.float32(moved[7]), np.float32(np.inf))  # one float32 ULP in one weight
    joined_a = world.hellos.count
    hellos_a = {a: joined_a((a, run_a)) for a in AGENTS}
    cases = [
        ("job A's signature under a new run id", renamed, None,
         f"'operator' signed this job as run {run_a}; a coordinator cannot run a signed job under another id"),
        ("job A under its nonce, initial model moved by one float32 ULP", run_a, moved,
         f"its initial model (SHA-256 {model_digest(moved)[:16]}...) is not the one 'operator' signed"),
    ]
    for attack, run, initial, why in cases:
        mark, start = world.marks(), len(world.announcements)
        world.config(run, JOB, world.job_a, initial=initial)
        announced = world.announcement(run, start)
        assert why in announced.refused, announced.refused
        lines = [world.said(a, f"not taking it: Job {run} is refused: {why}", mark) for a in AGENTS]
        outcome(attack, "edge_agent/service.py and keyserver/service.py `_on_config` (`job_refusal`)",
                lines[0].split("not taking it: ", 1)[1], world)
    mark, start = world.marks(), len(world.announcements)
    world.config(run_a, JOB, world.job_a)
    announced = world.announcement(run_a, start)
    why = f"Job {run_a} is refused: this key server already served it"
    assert announced.refused.startswith(why), announced.refused
    for a in AGENTS:
        world.said(a, f"the key server refuses job {run_a}: {why}", mark)
    assert not any(run == renamed for _, run in world.hellos)  # nobody joined any of them
    assert {a: joined_a((a, run_a)) for a in AGENTS} == hellos_a
    outcome("job A's signed config again (its nonce, its model)", "keyserver/service.py `_served_elsewhere`",
            announced.refused, world)


def test_a_job_that_fixes_the_32_bit_ring_is_never_masked_at_64_bits(world):
    """Attack 2 (the plan): a job whose ``ring_bits`` is 32, its round 1 planned at 64 bits:
    every agent refuses the plan (`plan_refusal`) and sends nothing."""
    job_c = JOB.model_copy(update={"options": StrategyOptions(ring_bits=32)})
    signed = sign_job(job_c, world.ids["operator"], fleet=FLEET)
    run_c = signed_nonce(signed)
    world.join(run_c, job_c, signed)
    world.open_round(run_c, 1, {0: AGENTS})
    mark = world.marks()
    for a in AGENTS:
        world.plan(1, a, 0, run=run_c, ring_bits=64, participants=3)
    why = "refusing the coordinator's plan: the plan's ring is 64 bits, but the job (ring_bits 32"
    lines = [world.said(a, f"round 1 of job {run_c}: {why}", mark) for a in AGENTS]
    assert not any(s.run == run_c for s in world.sent)
    outcome("a job with ring_bits 32 planned at 64", "edge_agent/round.py `plan_refusal`",
            lines[0].split(f"round 1 of job {run_c}: ", 1)[1], world)


def test_no_agent_ever_masked_two_vectors_under_one_pad(world):
    """Over everything the attacks made the agents send: one masked vector per (agent, job,
    round), each recorded in its agent's pad log, and no two vectors of one agent whose pads
    cancel anywhere (the ground truth: the keystreams themselves)."""
    slots: dict[tuple[str, str, int], set[bytes]] = {}
    for s in world.sent:
        slots.setdefault((s.agent, s.run, s.round), set()).add(s.ciphertext)
    assert slots and all(len(v) == 1 for v in slots.values()), {k: len(v) for k, v in slots.items() if len(v) > 1}
    for a in AGENTS:
        log = world.id_files[a].parent / f"pads-used-{a}.log"
        assert len(log.read_text().splitlines()) == sum(1 for (agent, _, _) in slots if agent == a)
    pairs = subtract_pairs(world.sent)
    assert len(pairs) >= 3 * 5  # every agent sent vectors in several rounds and jobs
    assert pads_cancelled(pairs, world.truth_words) < 1e-4  # a 32-bit pad coincides with probability 2^-32
    outcome("every two vectors of one agent, subtracted (all of the above)", "—",
            f"{len(pairs)} pairs; {len(slots)} (agent, job, round) slots, one vector each", world)


def test_a_sum_released_in_the_job_bars_its_starting_model_even_after_a_refused_round(mosquitto, tmp_path):
    """The ledger's rule within a job, on the key server alone (tests/test_keyserver.py's
    harness, whose test signs as the agents too): round 1's aggregate of a and b is refused at
    unmasking (b's words are not its pads plus a value: nothing released), round 2 trains
    again from the same model and is unmasked, and a fresh cluster that pairs a with c from
    that model in round 3 is refused, naming round 2."""
    h = Harness(mosquitto.url, tmp_path / "keys")
    try:
        h.start_run("masked")
        h.open_round(1, {0: ["a", "b"], 1: ["c", "d"]})
        a, b = (h.contribution(x, 1, 0) for x in "ab")
        result = h.verdict(1, h.request(1, 0, [a, out_of_range(h, b, 1)]))
        assert not result.accepted and "not the sum of exactly the named contributions" in result.reason
        h.open_round(2, {0: ["a", "b"], 1: ["c", "d"]})
        result = h.verdict(2, h.request(2, 0, [h.contribution(x, 2, 0) for x in "ab"]))
        assert result.accepted, result.reason
        h.open_round(3, {0: ["b"], 5: ["a", "c"]})
        result = h.verdict(3, h.request(3, 5, [h.contribution(x, 3, 5) for x in "ac"]))
        why = "the contribution of 'a' from this starting model was already released in this job (round 2, cluster 0)"
        assert not result.accepted and why in result.reason, result.reason
    finally:
        h.stop()
