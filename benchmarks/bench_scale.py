"""Scale: N agents per round against a real key server, coordinator and Mosquitto.

The key server and the coordinator are the real services as OS processes (``Fleet`` without
its agent processes). A load generator plays N agents over one MQTT link per broker (in this
process, or spread over ``--loadgen-processes`` forked processes, each with its own links),
speaking the real protocol: every frame signed by that agent's own identity (listed in the
fleet's trust file), hello, bootstrap vector, proposal, update with a signed receipt whose
fingerprint answers the round's sealed challenge, metrics. Their updates are real: a few
template clients (one per planted category) train the job's model on their own shard once
(round 1; each agent's bootstrap vector is its template's with 10 % seeded jitter, so
the coordinator clusters N distinct devices), and each protected update is encrypted under the announced public key once per
(template, cluster, budget, shared mask) and replayed by every agent of that template with
its own id, round and receipt; the key server verifies and decrypts them for real. Like a
real agent, each generated agent re-sends its hello until the coordinator acknowledges it,
asks again (a hello) for a round plan that is overdue, and re-sends its update until it is
acknowledged (docs/protocol.md, "Re-sending"), on the agents' jittered backoff.

For each N and strategy it reports the median round seconds (rounds 2..), the coordinator's
aggregation seconds per cluster (streamed over the arrivals, and the close), the key
server's verify and decrypt seconds per cluster, the clusters, the coordinator's and the key
server's peak RSS, the MB published through the broker, whether every update sent was
counted in an accepted aggregate, the clients the broker dropped messages for (its log) and
how often the generated agents repeated a hello, a plan request or an update.

For each N the strategies run alternated ``--repeats`` times; a strategy's ratio to plaintext
is taken within each repeat and the median reported, beside the CPU seconds of the
coordinator and the key server. ``masked`` and ``plaintext`` form one cluster each (the same
baseline); SenseCrypt clusters the three planted categories (three clusters), so its ratio
also carries three aggregates per round. The masked scheme's agents each mask with their own
pads (its updates cannot be replayed across agents), so the load generator masks N updates
per round.

    python benchmarks/bench_scale.py [--agents 10,100,1000] [--strategies plaintext,masked,sensecrypt]
        [--rounds 4] [--repeats 2] [--model mlp] [--key-bits 2048] [--out benchmarks/results/scale.json] [--quick]
        [--max-queued N]  (the broker's max_queued_messages; default: sized for the largest N)
        [--loadgen-processes P]  (the agents spread over P load-generator processes; default 1)
        [--keep DIR]  (keep every run's fleet directory: the services' logs, report.json)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from senseshield.data import load_dataset  # noqa: E402
from senseshield.data.shards import shards  # noqa: E402
from senseshield.bench.machine import cpu_model as _cpu_model  # noqa: E402
from senseshield.he import SCHEMES  # noqa: E402
from senseshield.he.base import model_digest, round_context  # noqa: E402
from senseshield.job import Job, announced_run, build_job_model, train_config  # noqa: E402
from senseshield.processes import running  # noqa: E402
from senseshield.device_noise import DeviceNoise  # noqa: E402
from senseshield.rounds import choice_report, client_bootstrap, client_seed, local_update, protect_local  # noqa: E402
from senseshield.runtime.broker import MosquittoProcess  # noqa: E402
from senseshield.runtime.fleet import Fleet, FleetOptions, agent_ids  # noqa: E402
from senseshield.runtime.identity import SEALED_SEED_BYTES, b64, check_frame, unb64  # noqa: E402
from senseshield.runtime.protocol.messages import (  # noqa: E402
    Ack,
    BootstrapVector,
    Challenge,
    ClusterModel,
    FleetConfig,
    Hello,
    MaskDecision,
    Metrics,
    Notice,
    Proposal,
    PublicKeyAnnouncement,
    Receipt,
    RoundPlan,
    from_frame,
    pack_mask,
    plain_digest,
    to_frame,
    unpack_mask,
    update_to_message,
)
from senseshield.runtime.service import Backoff  # noqa: E402
from senseshield.runtime.sites import SITE_PREFIX  # noqa: E402
from senseshield.runtime.transport import PREFIX, Link  # noqa: E402
from edge_agent.service import repeat_delays  # noqa: E402
from senseshield.strategies import ClientContext  # noqa: E402
from senseshield.training import set_vector  # noqa: E402

PROFILES = [(50.0, 24.0), (45.0, 16.0), (40.0, 12.0), (35.0, 10.0), (30.0, 8.0)]  # SenseCrypt: MB/s, CPUs
TEMPLATES = 3  # template clients, one per planted category (partition categories:3)
JITTER = 0.1  # relative spread of each agent's bootstrap vector around its template's


class ScaleFleet(Fleet):
    """The fleet's key server and coordinator; its agents are the load generator's."""

    def spawn_agent(self, i: int) -> str:
        return agent_ids(self.options.agents)[i]

    def _profiles(self) -> list[Path]:
        self.categories = {}
        return []


class LoadGenerator:
    """N agents over one MQTT link per broker (see the module docstring); ``part`` = (w, W):
    this generator plays every W-th agent from the w-th (one of W processes, :func:`generate`)."""

    def __init__(self, fleet: ScaleFleet, part: tuple[int, int] = (0, 1)) -> None:
        self.fleet = fleet
        self.name = fleet.options.fleet
        self.all_agents = agent_ids(fleet.options.agents)  # their indices, templates and sample counts
        self.agents = self.all_agents[part[0]::part[1]]
        self.part = part
        self.ids = {a: fleet.identities[a][0] for a in self.agents}
        self.trust = fleet.trust
        self.inbox: queue.Queue = queue.Queue()
        # N devices' inboxes over one link per broker (the hub's, or each site's) that drains at
        # network speed: the broker may have as many in flight toward it as MQTT 5 allows (a
        # device has a queue of its own). With sites, every site's broker gets every plan (the
        # bridge brings agents/+/inbox in): each link keeps its own agents' inboxes, and the
        # fleet-wide messages are taken from the first link only.
        self.broker_of = {a: fleet.agent_broker.get(i, fleet.url) for i, a in enumerate(self.agents)}
        urls = sorted(set(self.broker_of.values()))
        self.links = {}
        for j, url in enumerate(urls):
            mine = {a for a, u in self.broker_of.items() if u == url}
            name = f"loadgen-{j}" if part[1] == 1 else f"loadgen-{part[0]}-{j}"
            link = Link(url, client_id=name, fleet=self.name, protocol=fleet.mqtt, receive_maximum=65535,
                        on_frame=lambda topic, frame, mine=mine, first=(j == 0): self._on_frame(topic, frame, mine, first))
            for suffix in ("fleet/config", "fleet/control", "keys/public", "keyserver/challenges", "agents/+/inbox",
                           "clusters/+/model"):
                link.subscribe(suffix)
            self.links[url] = link
        self.link = self.links[urls[0]]
        self.sent_updates: dict[int, set[str]] = {}
        self.bytes_sent = 0
        self.done = threading.Event()
        self.run_id: str | None = None
        self.starts: dict[tuple[int, int], str] = {}  # (cluster, round) -> model_digest of its model
        self.waiting_model: dict[tuple[int, int], list] = {}  # updates waiting for the model they start from
        self.public = None
        self.key_seen = False
        self.seeds: dict[tuple[str, int], bytes] = {}
        self.waiting: dict[int, list[tuple[str, RoundPlan, np.ndarray | None]]] = {}  # round -> updates awaiting its challenge
        self.plans: dict[tuple[str, int], RoundPlan] = {}
        self.cache: dict[tuple, tuple] = {}
        self.proposals: dict[tuple[int, int], np.ndarray] = {}
        self.fingerprints: dict[tuple, bytes] = {}
        self.cluster_of: dict[tuple[str, int], int] = {}
        self.accuracy: dict[tuple[int, int], float] = {}
        self.joined = False
        self.errors: list[str] = []
        # re-sending, as the agents do (edge_agent.service): agent -> its backoff (and what it re-sends)
        self.rng = __import__("random").Random(0)
        self.hello_wait: dict[str, Backoff] = {}
        self.plan_wait: dict[str, Backoff] = {}
        self.update_wait: dict[str, tuple[Backoff, bytes, int, float]] = {}  # (backoff, frame, round, deadline)
        self.newest_plan: dict[str, int] = {}
        self.repeats = {"hello": 0, "plan": 0, "update": 0}
        self._ticked = 0.0
        # a context manager around the fleet's burst of hellos (tests squeeze the broker there)
        self.around_join: Callable[[], AbstractContextManager] | None = None

    # -- wire -----------------------------------------------------------------------------
    def _on_frame(self, topic: str, frame, mine: set[str], first: bool) -> None:  # noqa: ANN001 - network thread
        suffix = topic.removeprefix(f"{PREFIX}/{self.name}/")
        if suffix.startswith("agents/"):
            if suffix.split("/")[1] not in mine:
                return  # another broker's agent (its plans reach every site)
        elif not first:
            return  # a fleet-wide message: taken from the first link
        check_frame(self.trust, frame)
        self.inbox.put((suffix, frame, from_frame(frame)))

    def publish(self, agent: str, suffix: str, frame: bytes, wait: bool = True) -> None:
        self.links[self.broker_of[agent]].publish(suffix, frame, wait=wait)

    def send(self, agent: str, suffix: str, message, round: int = 0, wait: bool = True) -> bytes:  # noqa: ANN001
        frame = to_frame(message, fleet=self.name, sender=agent, round=round, signer=self.ids[agent])
        self.publish(agent, suffix, frame, wait=wait)
        self.bytes_sent += len(frame)
        return frame

    def _hello(self, agent: str, wait: bool = True) -> None:
        i = self.all_agents.index(agent)
        t = self.template(agent)
        bandwidth, cpu = PROFILES[(i // TEMPLATES) % len(PROFILES)]
        self.send(agent, f"agents/{agent}/hello", Hello(
            run_id=self.run_id, agent_id=agent, n_samples=self.samples(t), bandwidth=bandwidth,
            cpu_speed=cpu, profile={"board": "load generator"}, key_id=self.key_id, index=i,
            box_key=b64(self.ids[agent].box_key)), wait=wait)
        if self.vectors[t] is not None:  # its template's, with the device's own 10 % jitter (seeded)
            jitter = np.random.default_rng([self.config.seed, i]).normal(1.0, JITTER, self.vectors[t].size)
            self.send(agent, f"agents/{agent}/bootstrap",
                      BootstrapVector(sensitivity=self.vectors[t] * np.abs(jitter)), wait=wait)

    def _await_plan(self, agent: str, after: float = 0.0) -> None:
        if self.newest_plan.get(agent, 0) < self.config.rounds:
            b = self.plan_wait.setdefault(agent, Backoff(*repeat_delays("plan", self.deadline_s), rng=self.rng))
            b.arm(first=max(after, 0.0) + b.first)

    def _tick(self) -> None:
        """Re-send what was not acknowledged (each agent's backoff), at most every 0.5 s."""
        now = time.monotonic()
        if now - self._ticked < 0.5 or self.run_id is None:
            return
        self._ticked = now
        for agent, b in list(self.hello_wait.items()):
            if b.due(now):
                self.repeats["hello"] += 1
                self._hello(agent, wait=False)
        for agent, (b, frame, r, deadline) in list(self.update_wait.items()):
            if time.time() > deadline:
                del self.update_wait[agent]
                self._await_plan(agent)
            elif b.due(now):
                self.repeats["update"] += 1
                self.publish(agent, f"agents/{agent}/update", frame, wait=False)
        for agent, b in list(self.plan_wait.items()):
            if b.due(now):
                if self.newest_plan.get(agent, 0) >= self.config.rounds:
                    del self.plan_wait[agent]
                    continue
                self.repeats["plan"] += 1
                self._hello(agent, wait=False)

    def run(self, timeout: float) -> None:
        for link in self.links.values():
            link.start()
        end = time.monotonic() + timeout
        while not self.done.is_set() and time.monotonic() < end:
            self._tick()
            try:
                suffix, frame, msg = self.inbox.get(timeout=0.5)
            except queue.Empty:
                # not poll(): a forked load-generator process cannot wait for it (not its child)
                if not running(self.fleet.processes["coordinator"].pid):
                    break
                continue
            try:
                self._handle(suffix, frame, msg)
            except Exception as exc:  # noqa: BLE001 - keep going, report at the end
                self.errors.append(f"{type(msg).__name__}: {exc}")
        for link in self.links.values():
            link.stop()

    # -- the agents' side of the protocol ------------------------------------------------
    def _handle(self, suffix: str, frame, msg) -> None:  # noqa: ANN001
        if isinstance(msg, FleetConfig):
            if msg.run_id != self.run_id:
                self._prepare(msg)
        elif isinstance(msg, PublicKeyAnnouncement):
            if msg.run_id == self.run_id or not msg.run_id:
                self.public = SCHEMES.get(msg.scheme).public_key_from_bytes(msg.key) if msg.scheme else None
                self.key_id = msg.key_id  # "none" when the run encrypts nothing
                self.key_seen = True
        elif isinstance(msg, Ack):
            agent = suffix.split("/")[1]
            if msg.run_id != self.run_id:
                return
            if msg.of == "hello":
                if self.hello_wait.pop(agent, None) is not None and not self.newest_plan.get(agent):
                    self._await_plan(agent)
            elif agent in self.update_wait and self.update_wait[agent][2] == frame.round:
                _, _, r, deadline = self.update_wait.pop(agent)
                if msg.reason:
                    self.errors.append(f"update of {agent} round {r} not counted: {msg.reason}")
                self._await_plan(agent, deadline - time.time())
        elif isinstance(msg, RoundPlan):
            agent = suffix.split("/")[1]
            self.hello_wait.pop(agent, None)
            self.plan_wait.pop(agent, None)
            self.newest_plan[agent] = max(self.newest_plan.get(agent, 0), frame.round)
            if agent in self.sent_updates.get(frame.round, ()):  # a plan again: the update again
                waiting = self.update_wait.get(agent)
                if waiting is not None:
                    self.publish(agent, f"agents/{agent}/update", waiting[1], wait=False)
                return
            self.plans[(agent, frame.round)] = msg
            self.cluster_of[(agent, frame.round)] = msg.cluster
            if msg.negotiate:  # the template's proposal, computed once (it depends on its sensitivity only)
                t = self.template(agent)
                if (t, msg.block_size) not in self.proposals:
                    self.proposals[(t, msg.block_size)] = pack_mask(
                        self.strategy.propose(self.local[t].sensitivity, block_size=msg.block_size))
                self.send(agent, f"agents/{agent}/proposal",
                          Proposal(cluster=msg.cluster, size=msg.size, proposal=self.proposals[(t, msg.block_size)]),
                          frame.round)
            else:
                self._update(agent, frame.round, msg, msg.mask())
        elif isinstance(msg, MaskDecision):
            agent = suffix.split("/")[1]
            plan = self.plans.get((agent, frame.round))
            if plan is not None:
                self._update(agent, frame.round, plan, unpack_mask(msg.shared_mask, msg.size))
        elif isinstance(msg, Challenge):
            if msg.run_id != self.run_id:
                return
            context = f"{self.name}/{msg.run_id}/{frame.round}".encode()
            box = unb64(msg.box_key, "box key")
            for agent, sealed in msg.sealed.items():
                if agent in self.ids:
                    self.seeds[(agent, frame.round)] = self.ids[agent].open(
                        unb64(sealed, "sealed seed", size=SEALED_SEED_BYTES), box, context)
            for agent, plan, shared in self.waiting.pop(frame.round, []):
                self._update(agent, frame.round, plan, shared)
        elif isinstance(msg, ClusterModel):
            if msg.run_id == self.run_id:
                self.starts[(msg.cluster, frame.round)] = model_digest(msg.weights)
                for agent, r, plan, shared in self.waiting_model.pop((msg.cluster, frame.round), []):
                    self._update(agent, r, plan, shared)
                self._metrics(msg.cluster, frame.round, msg.weights)
        elif isinstance(msg, Notice):
            if msg.run_id == self.run_id and msg.kind in ("done", "cancelled"):
                self.done.set()
        if self.run_id is not None and self.key_seen and not self.joined:
            self._join()

    def template(self, agent: str) -> int:
        return self.all_agents.index(agent) % TEMPLATES

    def samples(self, t: int) -> int:
        """An agent's sample count: its share of its template's shard, as if the dataset were
        split N ways (the packed key's head-room, max_total_weight = 65,536 samples per
        cluster aggregate, would refuse 1,000 agents claiming the template's ~480 each)."""
        return max(1, self.data[t].n_train * TEMPLATES // len(self.all_agents))

    def _prepare(self, msg: FleetConfig) -> None:
        """The run's templates: data, one real round-1 training each, bootstrap vectors."""
        config, strategy, _ = announced_run(msg.config)
        self.run_id, self.config, self.strategy, self.initial = msg.run_id, config, strategy, msg.initial.astype(np.float64)
        self.deadline_s = msg.round_deadline
        self.joined = False
        local_config = config.model_copy(update={"clients": TEMPLATES, "partition": f"categories:{TEMPLATES}"})
        self.data = [s.data for s in shards(local_config, load_dataset(config.dataset, seed=config.seed))]
        self.model = build_job_model(config, tuple(msg.input_shape), msg.num_classes)
        self.vectors, self.local = [], []
        for t, data in enumerate(self.data):
            self.vectors.append(client_bootstrap(config, strategy, self.model, self.initial, data, t)
                                if strategy.needs_bootstrap_sensitivity else None)
            self.local.append(local_update(strategy, self.model, self.initial, data, train=train_config(config),
                                           seed=client_seed(config.seed, 1, t), round=1))

    def _join(self) -> None:
        self.joined = True
        with self.around_join() if self.around_join is not None else nullcontext():
            for agent in self.agents:
                self._hello(agent)
                self.hello_wait[agent] = Backoff(*repeat_delays("hello", self.deadline_s), rng=self.rng)
                self.hello_wait[agent].arm()

    def _update(self, agent: str, r: int, plan: RoundPlan, shared: np.ndarray | None) -> None:
        verifiable = self.public is not None and self.public.verifiable
        if verifiable and (agent, r) not in self.seeds:
            self.waiting.setdefault(r, []).append((agent, plan, shared))
            return
        start = self.starts.get((plan.cluster, plan.model_round)) if plan.model_round else model_digest(self.initial)
        if start is None:  # the model it starts from has not arrived yet
            self.waiting_model.setdefault((plan.cluster, plan.model_round), []).append((agent, r, plan, shared))
            return
        t = self.template(agent)
        digest = hashlib.sha256(np.packbits(shared).tobytes()).hexdigest() if shared is not None else ""
        key = (t, plan.cluster, plan.encryption_budget, plan.block_size, digest)
        own = self.public is not None and self.public.needs_contributors  # masked: every agent's own pads
        if own:
            key = (*key, agent, r)
        if key not in self.cache:  # encrypt this template's update once; every agent replays it
            context = ClientContext(f"template-{t}", 1, plan.cluster, plan.encryption_budget, shared, plan.block_size,
                                    participants=plan.participants, noise_multiplier=plan.noise_multiplier)
            public = (self.public.for_contributor(self.ids[agent].exchange,
                                                  round_context(self.name, self.run_id, r, plan.cluster, plan.digest()),
                                                  ring_bits=plan.ring_bits)
                      if own else self.public)
            update, choice = protect_local(self.strategy, context, self.local[t], public,
                                           n_samples=self.samples(t), rng=DeviceNoise().generator("protect", round=1, index=t))
            self.cache[key] = (update, update_to_message(update, self.public, report=choice_report(choice)))
        update, message = self.cache.pop(key) if own else self.cache[key]
        fp = b""
        if verifiable and update.ciphertext is not None:
            seed = self.seeds[(agent, r)]
            if (key, seed) not in self.fingerprints:
                self.fingerprints[(key, seed)] = self.public.fingerprint(update.ciphertext, seed)
            fp = self.fingerprints[(key, seed)]
        receipt = Receipt(
            run_id=self.run_id, cluster=plan.cluster, n_samples=update.n_samples,
            key_id=self.public.key_id if self.public is not None else "",
            mask_digest=hashlib.sha256(message.mask.tobytes()).hexdigest(),
            ciphertext_digest=hashlib.sha256(message.ciphertext).hexdigest() if message.ciphertext else "",
            fingerprint=fp, plain_digest=plain_digest(message.withheld, message.plaintext),
            # replayed template updates: the digest names the cluster model of the round they stand for
            start_digest=start, plan_digest=plan.digest())
        signed = to_frame(receipt, fleet=self.name, sender=agent, round=r, signer=self.ids[agent])
        sent = self.send(agent, f"agents/{agent}/update", message.model_copy(update={"receipt": signed}), r)
        self.sent_updates.setdefault(r, set()).add(agent)
        b = Backoff(*repeat_delays("update", self.deadline_s), rng=self.rng)
        b.arm()
        self.update_wait[agent] = (b, sent, r, plan.deadline)

    def _metrics(self, cluster: int, r: int, weights: np.ndarray) -> None:
        if (cluster, r) in self.accuracy:
            return
        set_vector(self.model, weights.astype(np.float64))
        data = self.data[0]
        import torch

        with torch.no_grad():
            predicted = self.model(torch.as_tensor(data.x_test, dtype=torch.float32)).argmax(1).numpy()
        accuracy = float(np.mean(predicted == data.y_test)) if len(data.y_test) else 0.0
        self.accuracy[(cluster, r)] = accuracy
        for agent in sorted(self.sent_updates.get(r, ())):
            if self.cluster_of.get((agent, r)) == cluster:
                self.send(agent, f"agents/{agent}/metrics",
                          Metrics(cluster=cluster, metric=accuracy, n_test=len(data.y_test)), r)


class Generated(NamedTuple):
    """What the load generator's processes sent, together: each round's senders, bytes, the
    errors, re-sends and CPU seconds."""

    sent_updates: dict[int, set[str]]
    bytes_sent: int
    errors: list[str]
    repeats: dict[str, int]
    cpu_s: float


def _play(fleet: ScaleFleet, part: tuple[int, int], timeout: float, around_join) -> Generated:  # noqa: ANN001
    """One load generator's agents (``part``, see :class:`LoadGenerator`) to the job's end."""
    load = LoadGenerator(fleet, part)
    if around_join is not None:
        load.around_join = around_join
    cpu = time.process_time()
    load.run(timeout)
    return Generated(load.sent_updates, load.bytes_sent, load.errors, load.repeats, time.process_time() - cpu)


def _play_forked(fleet: ScaleFleet, part: tuple[int, int], timeout: float, around_join, out) -> None:  # noqa: ANN001
    """:func:`_play` in a forked process; what it sent (or why it stopped) goes to ``out``."""
    try:
        out.put(_play(fleet, part, timeout, around_join))
    except Exception as exc:  # noqa: BLE001 - said in the summary
        out.put(Generated({}, 0, [f"process {part[0]}: {type(exc).__name__}: {exc}"], {}, 0.0))


def generate(fleet: ScaleFleet, timeout: float, *, processes: int = 1, around_join=None) -> Generated:  # noqa: ANN001
    """Play the fleet's N agents from ``processes`` load-generator processes (1: this one),
    each with its own MQTT links, every W-th agent each, to the job's end."""
    if processes == 1:
        return _play(fleet, (0, 1), timeout, around_join)
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # the fleet (identities, trust, processes) as it is
    out = ctx.Queue()
    workers = [ctx.Process(target=_play_forked, args=(fleet, (w, processes), timeout, around_join, out), daemon=True)
               for w in range(processes)]
    for w in workers:
        w.start()
    parts = []
    end = time.monotonic() + timeout + 60
    while len(parts) < processes and time.monotonic() < end:
        try:
            parts.append(out.get(timeout=1.0))
        except queue.Empty:
            if not any(w.is_alive() for w in workers) and out.empty():
                break
    for w in workers:
        w.join(5)
        if w.is_alive():
            w.kill()
    sent: dict[int, set[str]] = {}
    for p in parts:
        for r, agents in p.sent_updates.items():
            sent.setdefault(r, set()).update(agents)
    missing = [f"{processes - len(parts)} of {processes} load-generator processes said nothing"] if len(parts) < processes else []
    return Generated(sent, sum(p.bytes_sent for p in parts), missing + [e for p in parts for e in p.errors],
                     {k: sum(p.repeats.get(k, 0) for p in parts) for k in ("hello", "plan", "update")},
                     sum(p.cpu_s for p in parts))


UPSTREAM = {"hello", "bootstrap", "proposal", "update", "metrics", "status", "failure", "decline", "partial"}
"""The last part of the topics devices and site aggregators publish toward the servers (the
services' own status is counted too: a few bytes)."""


class Sampler:
    """Peak RSS of the key server and coordinator (VmRSS every 0.2 s, and VmHWM), and the bytes
    of every message published in the fleet's topics (a subscriber sees each once)."""

    def __init__(self, fleet: ScaleFleet) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        services = ["coordinator", "keyserver", *(n for n in fleet.processes if n.startswith(SITE_PREFIX))]
        self.fleet, self.peak = fleet, {name: 0 for name in services}
        self.cpu = {name: 0.0 for name in services}  # user + system seconds, last reading
        self.bytes = 0
        self.hub_in = 0  # what devices and sites say to the servers, as the hub's broker carries it
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        host, port = fleet.url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="scale-sniffer")
        self.client.on_message = lambda c, u, m: self._count(m)
        self.client.connect(host, int(port))
        self.client.subscribe(f"{PREFIX}/{fleet.options.fleet}/#", qos=0)
        self.client.loop_start()
        self.thread.start()

    def _count(self, message) -> None:  # noqa: ANN001
        self.bytes += len(message.payload)
        if message.topic.rsplit("/", 1)[-1] in UPSTREAM:
            self.hub_in += len(message.payload)

    def _read(self, name: str) -> None:
        proc = self.fleet.processes.get(name)
        if proc is None or proc.poll() is not None:
            return
        try:
            text = Path(f"/proc/{proc.pid}/status").read_text()
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        self.cpu[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for line in text.splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                self.peak[name] = max(self.peak[name], int(line.split()[1]) * 1024)

    def _poll(self) -> None:
        while not self.stop_event.wait(0.2):
            for name in self.peak:
                self._read(name)

    def stop(self) -> None:
        for name in self.peak:
            self._read(name)
        self.stop_event.set()
        self.thread.join(2)
        self.client.loop_stop()
        self.client.disconnect()


def run_scale(agents: int, strategy: str, *, rounds: int = 3, key_bits: int = 2048, out: Path,
              broker_url: str, timeout: float = 3600.0, model: str = "linear", repeat: int = 0,
              broker: MosquittoProcess | None = None, sites: int = 0,
              around_join: Callable[[ScaleFleet], AbstractContextManager] | None = None, processes: int = 1) -> dict:
    """One (N, strategy) point; returns its summary (see the module docstring). ``broker``:
    the Mosquitto behind ``broker_url``, whose log says whom it dropped messages for;
    ``around_join(fleet)``: a context manager the agents' burst of hellos runs in;
    ``processes``: load-generator processes (:func:`generate`)."""
    drops_before = len(broker.dropped()) if broker is not None else 0
    config = Job(strategy=strategy, rounds=rounds, dataset="digits", model=model, partition=f"categories:{TEMPLATES}",
                 key_bits=key_bits, scheme=None if strategy in ("plaintext", "masked") else "packed-paillier",
                 round_deadline=max(120.0, agents * 0.6), clients=agents)
    options = FleetOptions(agents=agents, out=out, broker=broker_url, fleet=f"scale-{strategy}-{agents}-{sites}-{repeat}",  # a run never reads the last one's retained frames
                           join_timeout=timeout, log_level=os.environ.get("SCALE_LOG_LEVEL", "warning"),
                           sites={f"site{k + 1}": list(range(k, agents, sites)) for k in range(sites)})
    started = time.time()
    with ScaleFleet(config, options) as fleet:
        fleet.start()
        sampler = Sampler(fleet)
        load = generate(fleet, timeout, processes=processes,
                        around_join=(lambda: around_join(fleet)) if around_join is not None else None)
        sampler.stop()  # before the services exit: their last CPU reading
        report = fleet.wait(60)
    rounds_ = report["rounds"][1:] or report["rounds"]
    per_cluster = {"aggregate_streamed": [], "aggregate": [], "verify": [], "decrypt": []}
    counted = True
    for rec in report["server"]:
        r = rec["round"]
        contributors = set()
        for c in rec["clusters"].values():
            if c.get("accepted"):
                contributors |= set(c.get("updates", []))
            if r > 1 or len(report["server"]) == 1:
                for p in per_cluster:
                    if p in c.get("timings", {}):
                        per_cluster[p].append(c["timings"][p])
        counted &= contributors == load.sent_updates.get(r, set())
    return {
        "agents": agents,
        "strategy": strategy,
        "model": model,
        "rounds": rounds,
        "round_s": statistics.median(r["seconds"] for r in rounds_),
        "clusters": report["num_clusters"],
        **{f"{p}_s": (float(np.mean(v)) if v else 0.0) for p, v in per_cluster.items()},
        "coordinator_cpu_s": sampler.cpu["coordinator"],
        "keyserver_cpu_s": sampler.cpu["keyserver"],
        "loadgen_cpu_s": load.cpu_s,
        "loadgen_processes": processes,
        "coordinator_peak_rss_mb": sampler.peak["coordinator"] / 1e6,
        "keyserver_peak_rss_mb": sampler.peak["keyserver"] / 1e6,
        "sites": sites,
        "site_peak_rss_mb": max((v for k, v in sampler.peak.items() if k.startswith(SITE_PREFIX)), default=0) / 1e6,
        "sites_cpu_s": sum(v for k, v in sampler.cpu.items() if k.startswith(SITE_PREFIX)),
        "broker_mb": sampler.bytes / 1e6,
        "hub_in_mb_per_round": sampler.hub_in / 1e6 / max(len(report["rounds"]), 1),
        "loadgen_mb_sent": load.bytes_sent / 1e6,
        "updates_sent": sum(len(v) for v in load.sent_updates.values()),
        "every_update_counted": bool(counted),
        "he_ratio": float(np.mean([r["he_ratio_mean"] for r in rounds_])),
        "final_accuracy": report["final_accuracy"],
        "loadgen_errors": load.errors[:5],
        "broker_dropped_for": sorted(set(broker.dropped()[drops_before:])) if broker is not None else None,
        "repeats": dict(load.repeats),
        "seconds": time.time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="10,100,1000")
    parser.add_argument("--strategies", default="plaintext,masked,sensecrypt")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (round time: median of rounds 2..)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every strategy, alternated (ratios are taken "
                        "within a repeat, then the median)")
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scale.json")
    parser.add_argument("--model", default="mlp", help="the job's model (mlp: 50,826 parameters; linear: 650)")
    parser.add_argument("--quick", action="store_true", help="N = 6 and 20, 2 rounds, 1 repeat, 1024-bit (a smoke run)")
    parser.add_argument("--sites", default="0", help="site counts to run, e.g. 0,1,4: the agents spread over that many "
                        "sites (a Mosquitto bridged to the hub's and a site aggregator each; 0: every agent on the hub)")
    parser.add_argument("--max-queued", type=int, default=None,
                        help="the broker's max_queued_messages per client (default: sized for the largest N, "
                             "senseshield.runtime.broker.queue_limits); a small one shows the devices re-sending")
    parser.add_argument("--loadgen-processes", type=int, default=1,
                        help="processes the load generator spreads the agents over (each with its own MQTT links; "
                             "with --sites K, K processes give each site its own)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="write every run's fleet (its services' logs, report.json) under DIR and keep it "
                             "(default: a temporary directory, removed at the end)")
    args = parser.parse_args()
    if args.loadgen_processes < 1:
        parser.error(f"--loadgen-processes {args.loadgen_processes} is not allowed; give 1 or more")
    counts = [6, 20] if args.quick else [int(x) for x in args.agents.split(",")]
    rounds, key_bits, repeats = (2, 1024, 1) if args.quick else (args.rounds, args.key_bits, args.repeats)
    runs = []
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with nullcontext(str(args.keep)) if args.keep is not None else tempfile.TemporaryDirectory() as tmp:
        broker = MosquittoProcess(Path(tmp) / "broker", fleet_size=max(counts),
                                  max_queued_messages=args.max_queued).start()
        try:
            for n in counts:
                for rep in range(repeats):
                    for sites in [int(x) for x in args.sites.split(",")]:
                        for strategy in args.strategies.split(","):
                            row = run_scale(n, strategy, rounds=rounds, key_bits=key_bits,
                                            out=Path(tmp) / f"{strategy}-{n}-{sites}-{rep}", broker_url=broker.url,
                                            model=args.model, repeat=rep, broker=broker, sites=sites,
                                            processes=args.loadgen_processes)
                            row["repeat"] = rep
                            runs.append(row)
                            print(json.dumps(row), flush=True)
        finally:
            broker.stop()
    rows = summarise(runs)
    result = {"benchmark": "scale", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "model": f"{args.model}, digits, categories:3", "key_bits": key_bits, "rounds": rounds,
              "repeats": repeats, "rows": rows, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(rich_table(result))
    print(markdown_table(rows))  # the rows of docs/results.md (Scale: measured), to paste


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (N, strategy): medians over the repeats; the ratio to plaintext is taken
    within each repeat (the runs beside each other), then its median; CPU seconds summed
    over the coordinator and the key server (the load generator's, the agents' side, apart)."""
    out = []
    keys = sorted({(r["agents"], r.get("sites", 0), r["strategy"]) for r in runs},
                  key=lambda k: (k[0], k[1], [r["strategy"] for r in runs].index(k[2])))
    for n, sites, strategy in keys:
        mine = [r for r in runs if (r["agents"], r.get("sites", 0), r["strategy"]) == (n, sites, strategy)]
        ratios = []
        for r in mine:
            base = next((b["round_s"] for b in runs if b["agents"] == n and b["strategy"] == "plaintext"
                         and b.get("sites", 0) == sites and b["repeat"] == r["repeat"]), None)
            if base:
                ratios.append(r["round_s"] / base)
        row = {k: (statistics.median(x[k] for x in mine) if isinstance(v, float) else v) for k, v in mine[0].items()
               if k not in ("repeat", "loadgen_errors")}
        row.setdefault("sites", 0)
        row["round_s_runs"] = [x["round_s"] for x in mine]
        row["round_ratio_to_plaintext"] = statistics.median(ratios) if ratios else None
        row["round_ratios"] = ratios
        row["services_cpu_s"] = statistics.median(x["coordinator_cpu_s"] + x["keyserver_cpu_s"] for x in mine)
        row["every_update_counted"] = all(x["every_update_counted"] for x in mine)
        row["loadgen_errors"] = [e for x in mine for e in x["loadgen_errors"]][:5]
        out.append(row)
    return out


HEADER = ["N", "sites", "strategy", "round s (runs)", "x plaintext (median)", "services CPU s", "clusters",
          "aggregate streamed / close s", "verify s", "decrypt s", "coordinator RSS MB", "key server RSS MB",
          "site RSS MB", "into the hub MB/round", "broker MB", "every update counted"]


def cells(r: dict) -> list[str]:
    """One row of the table, formatted (the rich and the markdown table share it)."""
    ratio = f"{r['round_ratio_to_plaintext']:.2f}" if r.get("round_ratio_to_plaintext") else "–"
    runs = " / ".join(f"{x:.2f}" for x in r.get("round_s_runs", [r["round_s"]]))
    sited = r.get("sites", 0)
    return [str(r["agents"]), str(sited), r["strategy"], runs, ratio, f"{r.get('services_cpu_s', 0.0):.1f}",
            str(r["clusters"]), f"{r['aggregate_streamed_s']:.3f} / {r['aggregate_s']:.3f}", f"{r['verify_s']:.3f}",
            f"{r['decrypt_s']:.3f}", f"{r['coordinator_peak_rss_mb']:.0f}", f"{r['keyserver_peak_rss_mb']:.0f}",
            f"{r.get('site_peak_rss_mb', 0):.0f}" if sited else "–", f"{r.get('hub_in_mb_per_round', 0):.1f}",
            f"{r['broker_mb']:.1f}", "yes" if r["every_update_counted"] else "NO"]


def rich_table(result: dict):  # noqa: ANN201 - rich.table.Table, imported lazily
    from rich.table import Table

    machine = result["machine"]
    table = Table(title=f"Scale: {result['model']}, {result['key_bits']}-bit key, {result['rounds']} rounds x "
                        f"{result.get('repeats', 1)} alternated repeats (round s: median of rounds 2..; aggregate, "
                        "verify, decrypt: s per cluster and round)",
                  caption=f"{machine['cpu']}, {machine['cores']} cores, {result['date']}")
    for i, header in enumerate(HEADER):
        table.add_column(header, justify="left" if i == 2 else "right")
    for r in result["rows"]:
        table.add_row(*cells(r), style=None if r["every_update_counted"] else "red")
    return table


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" if i == 2 else "---:" for i in range(len(HEADER))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in rows])


if __name__ == "__main__":
    main()
