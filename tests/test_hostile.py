"""Hostile traffic against a live fleet on a real Mosquitto: every service logs and rejects
what is malformed, invalid, replayed or for the wrong round, keeps running, and the run
ends with the simulator's result for the same seed (issue 17, items 0 and 3).

Every frame is signed (issue 14). The fuzzer plays a compromised participant: it signs what
it re-encodes with the key of the party that sent the original (from the fleet's identity
files), so its frames get past the signature check into the content checks; what it sends
must still be rejected (or be replays that change nothing), never valid forgeries for the
current round. Unsigned and wrongly signed frames are covered in test_keyserver/test_trust.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import threading
import time
import warnings
from collections import Counter

import numpy as np
import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.engine.aggregation import protect_update
from senseshield.runtime.fleet import Fleet, FleetOptions, agent_ids
from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.messages import UpdateMessage, pack_mask
from senseshield.runtime.protocol import CHUNK_SCHEMA, Frame, decode_frame, encode_frame
from senseshield.runtime.protocol.envelope import FRAME_VERSION, MAGIC
from senseshield.runtime.protocol.messages import from_frame
from senseshield.job import Job
from senseshield.simulation import run_simulation
from senseshield.runtime.transport import parse_broker
from tests.test_fleet import wait_for

SERVICES = ("coordinator", "keyserver")


class Wire:
    """Raw MQTT access to a fleet's topic tree: captures every valid frame (by schema) and
    publishes arbitrary bytes (QoS 0, never retained)."""

    def __init__(self, url: str, fleet: str, *, keep: int = 40) -> None:
        self.fleet, self.keep = fleet, keep
        self.frames: dict[str, list[tuple[str, bytes, Frame]]] = {}
        self.mine: set[bytes] = set()  # digests of what we published ourselves
        self.newest_plan = 0
        self.lock = threading.Lock()
        host, port = parse_broker(url)
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"wire-{fleet}")
        self.client.max_queued_messages_set(0)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"ss/v1/{fleet}/#", qos=1)
        self.client.connect(host, port)
        self.client.loop_start()
        time.sleep(0.3)

    def _on_message(self, client, userdata, message) -> None:  # noqa: ANN001
        payload = bytes(message.payload)
        if not payload or hashlib.sha256(payload).digest() in self.mine:
            return
        try:
            frame = decode_frame(payload)
            if frame.schema == CHUNK_SCHEMA or frame.fleet != self.fleet:
                return
            from_frame(frame)
        except Exception:  # noqa: BLE001 - not a valid frame: not material
            return
        suffix = message.topic.removeprefix(f"ss/v1/{self.fleet}/")
        with self.lock:
            bucket = self.frames.setdefault(frame.schema, [])
            bucket.append((suffix, payload, frame))
            del bucket[:-self.keep]
            if frame.schema == "round-plan":
                self.newest_plan = max(self.newest_plan, frame.round)

    def pick(self, rng: random.Random, *schemas: str) -> tuple[str, bytes, Frame] | None:
        with self.lock:
            pool = [f for s in (schemas or list(self.frames)) for f in self.frames.get(s, [])]
        return rng.choice(pool) if pool else None

    def publish(self, suffix: str, payload: bytes) -> None:
        self.mine.add(hashlib.sha256(payload).digest())
        self.client.publish(f"ss/v1/{self.fleet}/{suffix}", payload, qos=0)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


SIGNERS: dict[str, Identity] = {}  # a compromised fleet's keys, loaded by the tests that need them


def load_signers(fleet: Fleet) -> None:
    SIGNERS.clear()
    SIGNERS.update({p.stem: Identity.load_or_create(p.stem, p) for p in (fleet.out / "identities").glob("*.key")})


def reframe(frame: Frame, **changes) -> bytes:  # noqa: ANN003
    """``frame`` re-encoded with some header facts, fields or sections changed, signed with
    the key of its original sender (when the test holds it)."""
    args = dict(schema=frame.schema, version=frame.version, fleet=frame.fleet, sender=frame.sender,
                round=frame.round, fields=dict(frame.fields), sections=dict(frame.sections),
                signer=SIGNERS.get(frame.sender))
    args.update(changes)
    return encode_frame(**args)


def raw_frame(header: dict, blobs: list[bytes], *, version: int = FRAME_VERSION, magic: bytes = MAGIC) -> bytes:
    """A frame built by hand (NaN allowed in the JSON, any descriptor), of the frame version
    this build speaks (so it gets past the version check to the checks it is meant for)."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([struct.pack(">4sBI", magic, version, len(encoded)), encoded, *blobs])


def split_raw(payload: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from(">I", payload, 5)
    return json.loads(payload[9:9 + length]), payload[9 + length:]


class Fuzzer:
    """Seeded generator of hostile frames for every topic the services subscribe to."""

    KINDS = ("random-bytes", "truncated", "descriptor", "header", "nan-inf", "sample-count", "shape",
             "config-field", "replay")

    def __init__(self, wire: Wire, agents: list[str], seed: int) -> None:
        self.wire, self.agents = wire, agents
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.topics = ["fleet/config", "keyserver/requests", "keys/public", "keyserver/results", "clusters/0/model",
                       "fleet/control"]
        for a in agents:
            self.topics += [f"agents/{a}/{t}" for t in ("hello", "status", "bootstrap", "proposal", "update",
                                                        "metrics", "inbox")]

    # -- one message of each kind (None: no material captured yet) ---------------------------
    def random_bytes(self):  # noqa: ANN201
        n = self.rng.randrange(1, 2048)
        data = bytes(self.rng.getrandbits(8) for _ in range(n))
        if self.rng.random() < 0.3:
            data = MAGIC + data  # past the magic, into the prefix checks
        return self.rng.choice(self.topics), data

    def truncated(self):  # noqa: ANN201
        suffix, payload, _ = self.wire.pick(self.rng)
        return suffix, payload[: self.rng.randrange(1, len(payload))]

    def descriptor(self):  # noqa: ANN201
        picked = self.wire.pick(self.rng, *[s for s in self.wire.frames if s not in ("status", "hello", "notice",
                                                                                       "assignment", "metrics",
                                                                                       "aggregate-result")])
        suffix, payload, _ = picked
        header, body = split_raw(payload)
        d = self.rng.choice(header["sections"])
        how = self.rng.choice(["nbytes+", "nbytes-", "shape", "dtype", "duplicate", "negative"])
        if how == "nbytes+":
            d["nbytes"] += self.rng.randrange(1, 64)
        elif how == "nbytes-":
            d["nbytes"] = max(d["nbytes"] - self.rng.randrange(1, 64), 0) if d["nbytes"] else 1
        elif how == "shape":
            d["shape"] = [d["shape"][0] + 1, 2] if d["shape"] else [3]
        elif how == "dtype":
            d["dtype"] = self.rng.choice(["f16", "object", "f64" if d["dtype"] != "f64" else "u8"])
        elif how == "duplicate":
            header["sections"].append(dict(d))
        else:
            d["nbytes"] = -8
        return suffix, raw_frame(header, [body])

    def header(self):  # noqa: ANN201
        suffix, payload, frame = self.wire.pick(self.rng)
        how = self.rng.choice(["magic", "frame-version", "schema-version", "fleet", "sender", "round"])
        if how == "magic":
            return suffix, b"SSHX" + payload[4:]
        if how == "frame-version":
            return suffix, payload[:4] + bytes([self.rng.choice([0, 2, 255])]) + payload[5:]
        if how == "schema-version":
            return suffix, reframe(frame, version=frame.version + self.rng.choice([-1, 1, 7]))
        if how == "fleet":
            return suffix, reframe(frame, fleet="elsewhere")
        if how == "sender":
            others = [a for a in (*self.agents, "mallory", "coordinator", "keyserver") if a != frame.sender]
            return suffix, reframe(frame, sender=self.rng.choice(others))
        # wrong round: the past for the services' messages (already superseded), round 0 or
        # far in the future for the agents' (no such round)
        service = frame.sender in SERVICES
        return suffix, reframe(frame, round=0 if service else self.rng.choice([0, 10**6]))

    def nan_inf(self):  # noqa: ANN201
        value = self.rng.choice([float("nan"), float("inf"), float("-inf")])
        floats = ("update", "bootstrap", "cluster-model", "aggregate-request", "fleet-config")
        picked = self.wire.pick(self.rng, *floats) if self.rng.random() < 0.6 else None
        if picked is not None:
            suffix, _, frame = picked
            names = [n for n, v in frame.sections.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size]
            if names:
                name = self.rng.choice(names)
                arrays = {n: (v.copy() if isinstance(v, np.ndarray) else v) for n, v in frame.sections.items()}
                arrays[name][self.rng.randrange(arrays[name].size)] = value
                return suffix, reframe(frame, sections=arrays)
        suffix, payload, _ = self.wire.pick(self.rng, "metrics", "hello", "round-plan", "assignment")
        header, body = split_raw(payload)
        numeric = [k for k, v in header["fields"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        header["fields"][self.rng.choice(numeric)] = value
        return suffix, raw_frame(header, [body])

    def sample_count(self):  # noqa: ANN201
        suffix, _, frame = self.wire.pick(self.rng, "update", "hello")
        n = frame.fields["n_samples"]
        bad = self.rng.choice([-1, 0, 10**6, 2**40, n + 1, max(n - 1, 1) if n > 1 else n + 2])
        round_ = max(self.wire.newest_plan, 1) if frame.schema == "update" else frame.round
        return suffix, reframe(frame, round=round_, fields={**frame.fields, "n_samples": bad})

    def shape(self):  # noqa: ANN201
        suffix, _, frame = self.wire.pick(self.rng, "update", "bootstrap", "cluster-model", "aggregate-request",
                                          "round-plan")
        fields, sections = dict(frame.fields), dict(frame.sections)
        if frame.schema == "update":
            how = self.rng.choice(["plain-short", "plain-long", "mask", "withheld", "size", "cluster"])
            if how == "plain-short" and sections["plaintext"].size:
                sections["plaintext"] = sections["plaintext"][:-1]
            elif how in ("plain-long", "plain-short"):
                sections["plaintext"] = np.append(sections["plaintext"], np.float32(0.5))
            elif how == "mask":
                sections["mask"] = np.append(sections["mask"], np.uint8(0))
            elif how == "withheld":
                sections["withheld"] = np.ones(sections["mask"].size, np.uint8)
            elif how == "size":
                fields["size"] += self.rng.choice([-1, 1, 8])
            else:
                fields["cluster"] += 1
            return suffix, reframe(frame, round=max(self.wire.newest_plan, 1), fields=fields, sections=sections)
        if frame.schema == "round-plan":
            if self.rng.random() < 0.5:
                sections["shared_mask"] = np.ones(3, np.uint8)  # bytes without has_shared_mask
            else:
                fields["size"] += 1
            return suffix, reframe(frame, fields=fields, sections=sections)
        name = self.rng.choice([n for n, v in sections.items() if isinstance(v, np.ndarray) and v.size])
        sections[name] = sections[name][:-1] if self.rng.random() < 0.5 else np.append(sections[name], sections[name][:1])
        return suffix, reframe(frame, fields=fields, sections=sections)

    def config_field(self):  # noqa: ANN201
        """A new run announced with a field that is not allowed (never a valid new run)."""
        suffix, _, frame = self.wire.pick(self.rng, "fleet-config")
        config = json.loads(json.dumps(frame.fields["config"]))
        fields = dict(frame.fields, run_id=f"forged-{self.rng.randrange(10**6)}", config=config)
        how = self.rng.choice(["strategy", "rounds", "key_bits", "lr", "extra", "num_classes", "options"])
        if how == "num_classes":
            fields["num_classes"] = 1
        elif how == "extra":
            config["evil"] = True
        elif how == "options":
            config["options"] = {"no_such_option": 1}
        else:
            config[how] = {"strategy": "nope", "rounds": -1, "key_bits": 16, "lr": "fast"}[how]
        return suffix, reframe(frame, fields=fields)

    def replay(self):  # noqa: ANN201
        suffix, payload, _ = self.wire.pick(self.rng)
        return suffix, payload

    # -- large payloads -----------------------------------------------------------------------
    def large(self, suffix: str, mb: int, *, stream: bool) -> int:
        """One ``mb`` MB payload of random bytes, or an incomplete chunk stream announcing
        ``mb + 8`` MB and sending ``mb`` MB of it (1 MB chunks). Returns bytes sent."""
        rng = np.random.default_rng(self.rng.randrange(2**32))
        if not stream:
            self.wire.publish(suffix, rng.bytes(mb << 20))
            self.counts["large-payload"] += 1
            return mb << 20
        total, chunk = (mb + 8) << 20, 1 << 20
        message_id = f"{self.rng.randrange(16**16):016x}"
        for i in range(mb):
            frame = encode_frame(schema=CHUNK_SCHEMA, version=1, fleet=self.wire.fleet, sender="mallory", round=1,
                                 fields={"message_id": message_id, "index": i, "count": total // chunk,
                                         "total": total, "sha256": "0" * 64},
                                 sections={"data": rng.bytes(chunk)})
            self.wire.publish(suffix, frame)
            time.sleep(0.01)
        self.counts["incomplete-stream"] += 1
        return mb << 20

    def one(self, i: int) -> None:
        kind = self.KINDS[i % len(self.KINDS)]
        try:
            suffix, payload = getattr(self, kind.replace("-", "_"))()
        except (TypeError, IndexError, KeyError, StopIteration, ValueError):  # no material of that kind yet
            kind = "random-bytes"
            suffix, payload = self.random_bytes()
        self.wire.publish(suffix, payload)
        self.counts[kind] += 1


class RssSampler:
    """Peak resident memory of some processes, sampled every 0.1 s."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.baseline = {name: p.memory_info().rss for name, p in self.procs.items()}
        self.peak = dict(self.baseline)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            for name, p in self.procs.items():
                try:
                    self.peak[name] = max(self.peak[name], p.memory_info().rss)
                except psutil.Error:
                    pass

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def fuzz_fleet(mosquitto, tmp_path, config: Job, *, messages: int, rate: float,  # noqa: ANN001
               large: list[tuple[str, int, bool]], seed: int = 17) -> dict:
    fleet_name = "fuzz"
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet=fleet_name, round_deadline=120,
                           min_contributors=1, extra_coordinator_args=["--max-message-mb", "64"])
    wire = Wire(mosquitto.url, fleet_name)
    fuzzer = Fuzzer(wire, agent_ids(3), seed)
    t0 = time.monotonic()
    with Fleet(config, options) as fleet:
        fleet.start()
        load_signers(fleet)
        wait_for(lambda: wire.newest_plan >= 1, timeout=240)  # bootstrapped, round 1 under way
        rss = RssSampler({name: fleet.processes[name].pid for name in SERVICES})
        coordinator = fleet.processes["coordinator"]
        large_bytes = 0
        for i in range(messages):
            if coordinator.poll() is not None:
                break
            fuzzer.one(i)
            if i % 500 == 250 and large:
                suffix, mb, stream = large.pop(0)
                large_bytes += fuzzer.large(suffix, mb, stream=stream)
            time.sleep(1.0 / rate)
        sent = sum(fuzzer.counts.values())
        report = fleet.wait(timeout=400)
        rss.stop()
    wire.stop()
    codes = fleet.exit_codes
    figures = {
        "strategy": config.strategy, "messages": sent, "per_kind": dict(sorted(fuzzer.counts.items())),
        "large_mb": large_bytes >> 20, "crashes": sum(c != 0 for c in codes.values()), "exit_codes": codes,
        "rss_baseline_mb": {k: round(v / 2**20, 1) for k, v in rss.baseline.items()},
        "rss_peak_mb": {k: round(v / 2**20, 1) for k, v in rss.peak.items()},
        "rejected_total": report["rejected_total"], "final_accuracy": report["final_accuracy"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print("fuzz figures:", json.dumps(figures))
    (tmp_path / "fuzz-figures.json").write_text(json.dumps(figures, indent=2))
    return {"report": report, "figures": figures, "rss": rss}


def check_fuzzed_run(result: dict, config: Job, *, min_messages: int) -> None:
    report, figures, rss = result["report"], result["figures"], result["rss"]
    sim = run_simulation(config.model_copy(update={"clients": 3}))
    figures["final_accuracy_unfuzzed"] = sim.final_accuracy
    print("unfuzzed (simulator) final accuracy:", sim.final_accuracy)
    assert figures["messages"] >= min_messages
    assert figures["exit_codes"] == {name: 0 for name in figures["exit_codes"]}
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
    assert report["final_accuracy"] == pytest.approx(sim.final_accuracy, abs=1e-9)
    # the agents' own accuracies, not a forged report's
    assert [c["accuracy"] for c in report["clients"]] == pytest.approx([c.accuracy for c in sim.clients], abs=1e-9)
    # a third of the frames go to agents' or the key server's topics, a ninth are replays
    assert report["rejected_total"] >= figures["messages"] // 3
    for name in SERVICES:
        assert rss.peak[name] < rss.baseline[name] + (150 << 20), (name, figures["rss_peak_mb"])


FUZZ_CONFIGS = [
    Job(strategy="paillier-full", model="linear", clients=3, rounds=3, key_bits=1024),
    Job(strategy="plaintext", model="mlp", clients=3, rounds=3),
]


@pytest.mark.slow  # ~41 s; hostile frames stay in the default suite through the forged-keys and bad-update tests
@pytest.mark.parametrize("config", FUZZ_CONFIGS[:1], ids=lambda c: c.strategy)
def test_fuzzed_fleet_ends_like_the_simulator(mosquitto, tmp_path, config):
    """The short fuzz of the default suite: ~1,500 hostile frames, two large payloads, on the
    encrypted run (the plaintext run is fuzzed in the slow variant)."""
    large = [("agents/c000/update", 16, False), ("keyserver/requests", 24, True)]
    result = fuzz_fleet(mosquitto, tmp_path, config, messages=1500, rate=400, large=large)
    check_fuzzed_run(result, config, min_messages=500)


@pytest.mark.slow
@pytest.mark.parametrize("config", FUZZ_CONFIGS, ids=lambda c: c.strategy)
def test_fuzzed_fleet_ends_like_the_simulator_10k(mosquitto, tmp_path, config):
    """The long fuzz: 10,000+ hostile frames and several large payloads, over more rounds."""
    # enough rounds that the run outlasts 12,000 frames at this rate (a plaintext round is ~0.2 s)
    config = config.model_copy(update={"rounds": 80 if config.strategy == "plaintext" else 12})
    large = [("agents/c000/update", 24, False), ("agents/c001/update", 40, True), ("keyserver/requests", 32, True),
             ("agents/c002/metrics", 40, True), ("fleet/config", 24, False), ("agents/c000/hello", 40, True)]
    result = fuzz_fleet(mosquitto, tmp_path, config, messages=12_000, rate=1500, large=large)
    check_fuzzed_run(result, config, min_messages=10_000)


def test_the_fuzzers_descriptor_and_nan_frames_reach_the_checks_they_exercise():
    """Issue 23: the hand-built frames were of frame version 1, so every descriptor and
    header-NaN case was refused at the version check. Built from signed frames of the current
    versions, each is refused for what it breaks."""
    from senseshield.errors import ProtocolError
    from senseshield.runtime.protocol.messages import (
        Assignment, BootstrapVector, Hello, Metrics, RoundPlan, to_frame,
    )

    signer = Identity.generate("c000")
    material = [
        ("agents/c000/hello", Hello(run_id="r", agent_id="c000", n_samples=10, bandwidth=5.0, cpu_speed=2.0)),
        ("agents/c000/metrics", Metrics(cluster=0, metric=0.5, n_test=10)),
        ("agents/c000/inbox", Assignment(cluster=0, encryption_budget=0.25)),
        ("agents/c000/inbox", RoundPlan(cluster=0, encryption_budget=0.2, deadline=1e9, block_size=1, size=9,
                                        shared_mask=np.zeros(0, np.uint8))),
        ("agents/c000/bootstrap", BootstrapVector(sensitivity=np.linspace(0, 1, 9))),
    ]
    wire = Wire.__new__(Wire)  # no broker: the captured material is built here
    wire.fleet, wire.keep, wire.lock, wire.newest_plan, wire.mine = "f", 40, threading.Lock(), 0, set()
    wire.frames = {}
    for suffix, msg in material:
        payload = to_frame(msg, fleet="f", sender="c000", round=1, signer=signer)
        wire.frames.setdefault(msg.schema_name, []).append((suffix, payload, decode_frame(payload)))
    fuzzer = Fuzzer(wire, ["c000"], seed=3)
    reasons: Counter[str] = Counter()
    for kind in ("descriptor", "nan_inf"):
        for _ in range(60):
            _, payload = getattr(fuzzer, kind)()
            with pytest.raises(ProtocolError) as caught:
                from_frame(decode_frame(payload))
            reason = str(caught.value)
            assert "Frame version" not in reason, reason
            reasons[kind] += 1
            if kind == "descriptor":
                assert "Section" in reason or "section" in reason or "trailing bytes" in reason, reason
            else:
                assert "NaN" in reason or "Infinity" in reason or "inf" in reason, reason
    assert reasons == {"descriptor": 60, "nan_inf": 60}


# ---- regression tests of the defects of issue 17 ------------------------------------------------


def _update_frame(fleet: str, sender: str, round: int, *, size: int, n_samples: int, plain: int) -> bytes:
    """An agent's plaintext update built by hand (the message class would refuse it)."""
    return encode_frame(
        schema="update", version=UpdateMessage.version, fleet=fleet, sender=sender, round=round,
        fields={"cluster": 0, "n_samples": n_samples, "size": size, "has_withheld": False, "timings": {}, "report": {}},
        sections={"mask": np.zeros(-(-size // 8), np.uint8), "withheld": np.zeros(0, np.uint8),
                  "plaintext": np.full(plain, 0.01, np.float32), "ciphertext": b"", "receipt": b""},
        signer=SIGNERS.get(sender),
    )


def test_bad_updates_forged_configs_metrics_and_chunk_floods_stop_nothing(mosquitto, tmp_path):
    """An update one value short, one claiming 10^6 samples, a forged `fleet/config` with bad
    fields, metrics for a future round and a second report for a reported round, and
    incomplete chunk streams beyond the coordinator's buffer: each is rejected with its
    reason, no service stops, and the run ends with the simulator's result."""
    from senseshield.runtime.protocol.messages import Metrics, to_frame

    config = Job(strategy="plaintext", model="linear", clients=3, rounds=3)
    fleet_name = "hostile"
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet=fleet_name, round_deadline=60,
                           min_contributors=1, extra_coordinator_args=["--max-message-mb", "3"])
    wire = Wire(mosquitto.url, fleet_name)
    with Fleet(config, options) as fleet:
        fleet.start()
        load_signers(fleet)
        wait_for(lambda: wire.newest_plan >= 1, timeout=240)
        r = wire.newest_plan
        for n_samples, plain in ((400, 649), (10**6, 650)):  # one value short; 10^6 samples
            wire.publish("agents/c000/update", _update_frame(fleet_name, "c000", r, size=650, n_samples=n_samples,
                                                             plain=plain))
        _, _, real = wire.pick(random.Random(0), "fleet-config")
        bad_config = dict(real.fields, run_id="forged", config={**real.fields["config"], "strategy": "nope"})
        wire.publish("fleet/config", reframe(real, fields=bad_config))
        # three incomplete 1.5 MB streams into a 3 MB buffer: the oldest is evicted
        for stream in range(3):
            for i in range(3):
                wire.publish("agents/c001/update", encode_frame(
                    schema=CHUNK_SCHEMA, version=1, fleet=fleet_name, sender="c001", round=r,
                    fields={"message_id": f"flood{stream}", "index": i, "count": 4, "total": 2_000_000,
                            "sha256": "0" * 64},
                    sections={"data": bytes(500_000)}))
        wait_for(lambda: any(f.sender == "c000" and f.round == 1 for _, _, f in wire.frames.get("metrics", [])))
        forged = Metrics(cluster=0, metric=0.5, n_test=1)
        c000 = SIGNERS["c000"]
        wire.publish("agents/c000/metrics", to_frame(forged, fleet=fleet_name, sender="c000", round=1, signer=c000))  # reported
        wire.publish("agents/c000/metrics", to_frame(forged, fleet=fleet_name, sender="c000", round=99, signer=c000))  # future
        report = fleet.wait(timeout=300)
    wire.stop()
    assert fleet.exit_codes == {name: 0 for name in fleet.exit_codes}
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    for reason in ("has 649 plaintext values; its masks leave 650", "claims 1000000 samples",
                   "for round 99, in which cluster 0 got no model", "incomplete chunk stream(s) dropped"):
        assert reason in log, reason
    assert "Traceback" not in log
    for agent in agent_ids(3):
        agent_log = (tmp_path / "logs" / f"{agent}.log").read_text()
        assert "fleet/config field 'strategy'" in agent_log and "Traceback" not in agent_log
    assert "fleet/config field 'strategy'" in (tmp_path / "logs" / "keyserver.log").read_text()
    sim = run_simulation(config)
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)
    assert [c["accuracy"] for c in report["clients"]] == pytest.approx([c.accuracy for c in sim.clients], abs=1e-9)
    assert report["rejected_total"] >= 4 and len(report["rejected_messages"]) <= 1000


def test_an_agent_rejects_a_bad_config_keeps_running_and_joins_a_valid_one(mosquitto, tmp_path):
    from edge_agent.service import EdgeAgent
    from senseshield.runtime.protocol.messages import FleetConfig, Hello, PublicKeyAnnouncement, to_frame
    from senseshield.job import initial_model
    from senseshield.runtime.transport import Link

    hellos: list[Hello] = []
    declines: list = []
    peer = Link(mosquitto.url, client_id="coordinator", fleet="cfg",
                on_frame=lambda t, f: (hellos if t.endswith("/hello") else declines).append(from_frame(f)))
    peer.subscribe("agents/+/hello")
    peer.subscribe("agents/+/decline")
    peer.start()
    agent = EdgeAgent(mosquitto.url, fleet="cfg", agent_id="a1", bandwidth=1, cpu_speed=1, model_dir=tmp_path / "m")
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        peer.publish("keys/public", to_frame(PublicKeyAnnouncement(scheme="", key_id="none", key=b""), fleet="cfg",
                                             sender="keyserver", round=0, signer=Identity.generate("keyserver")))
        config = Job(strategy="plaintext", model="linear", clients=1, rounds=1)
        _, initial = initial_model(config, (1, 8, 8), 10)
        good = FleetConfig(run_id="good", config=config.model_dump(mode="json"), input_shape=[1, 8, 8],
                           num_classes=10, round_deadline=30, initial=initial)
        bad = [
            good.model_copy(update={"run_id": "bad1", "config": {**good.config, "rounds": -1}}),
            good.model_copy(update={"run_id": "bad2", "config": {**good.config, "no_such_field": 1}}),
            good.model_copy(update={"run_id": "bad3", "input_shape": [3, 32, 32]}),  # not this device's data
            good.model_copy(update={"run_id": "bad4", "initial": initial[:-1]}),  # not the model's size
        ]
        coordinator = Identity.generate("coordinator")
        for msg in [*bad, good]:
            peer.publish("fleet/config", to_frame(msg, fleet="cfg", sender="coordinator", round=0, signer=coordinator))
        wait_for(lambda: hellos, timeout=60)
        assert [h.run_id for h in hellos] == ["good"]
        assert thread.is_alive()
        # a broken or forged config is rejected; a valid job this device cannot take is declined
        reasons = " | ".join(agent.rejected)
        for needle in ("'rounds'", "'no_such_field'"):
            assert needle in reasons, needle
        declined = {d.run_id: d.reason for d in declines}
        assert sorted(declined) == ["bad3", "bad4"]
        assert "inputs (1, 8, 8)" in declined["bad3"] and "649 parameters" in declined["bad4"]
    finally:
        agent.stopping.set()
        thread.join(15)
        peer.stop()


def test_the_key_server_checks_an_aggregate_completely_before_decrypting(mosquitto, tmp_path):
    """Wrong model size, a ciphertext with fewer blocks than the union mask, a truncated
    ciphertext, weights above the total: rejected without an answer; a good one still works."""
    from senseshield.runtime.protocol.messages import AggregateResult
    from tests.test_keyserver import Harness

    h = Harness(mosquitto.url, tmp_path / "keys")
    try:
        h.start_run()
        h.open_round(1, {0: ["a", "b"]})
        parts = [h.contribution(x, 1, 0) for x in "ab"]
        good = h.request(1, 0, parts)
        mask = np.zeros(650, bool)
        mask[: h.public.block_size] = True
        one_block = [(protect_update(np.zeros(650), mask, h.public, client_id=x, round=1, cluster=0, n_samples=10), rc)
                     for x, (_, rc) in zip("ab", parts)]
        short = h.request(1, 0, one_block)
        bad = {
            "does not match its union mask": good.model_copy(update={"ciphertext": short.ciphertext}),
            "bytes; its header announces": good.model_copy(update={"ciphertext": good.ciphertext[:-5]}),
            "position weights must be integers": good.model_copy(update={"position_weight": np.full(650, 99.0)}),
            "has 651 parameters": good.model_copy(update={"size": 651, "union_mask": pack_mask(np.r_[
                np.repeat(True, 4 * h.public.block_size), np.zeros(651 - 4 * h.public.block_size, bool)]),
                "plain_sum": np.zeros(651 - 4 * h.public.block_size)}),
        }
        for msg in bad.values():
            h.send("keyserver/requests", msg, round=1)
        h.send("keyserver/requests", good, round=1)
        result, r = h.wait(AggregateResult)
        h.got.append(("", result, r))
        time.sleep(0.5)
        results = [m for _, m, _ in h.got if isinstance(m, AggregateResult)]
        assert len(results) == 1 and results[0].accepted, [m.reason for m in results]  # no answer to the bad ones
        reasons = " | ".join(h.server.rejected)
        for needle in bad:
            assert needle in reasons, needle
    finally:
        h.stop()


def test_forged_keys_models_configs_and_impersonated_updates_are_rejected(mosquitto, tmp_path):
    """Issue 14 against a live SenseCrypt fleet: an attacker's public key announced as the key
    server (unsigned, then signed with its own key), a cluster model signed with an agent's key
    under the key server's name, an unsigned fleet/config, and an update signed by c000 but sent
    as c001: each rejected with its reason where it arrives; the run goes on and ends with the
    simulator's result."""
    from senseshield.he import SCHEMES
    from senseshield.runtime.protocol.messages import ClusterModel, FleetConfig, PublicKeyAnnouncement, to_frame

    config = Job(strategy="sensecrypt", model="mlp", clients=3, rounds=3, key_bits=1024)
    fleet_name = "forge"
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet=fleet_name, round_deadline=60,
                           min_contributors=1)
    wire = Wire(mosquitto.url, fleet_name)
    attacker = Identity.generate("keyserver")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evil = SCHEMES.get("packed-paillier").generate(key_bits=1024).public_key
    with Fleet(config, options) as fleet:
        fleet.start()
        load_signers(fleet)
        wait_for(lambda: wire.newest_plan >= 1, timeout=240)
        _, _, real_config = wire.pick(random.Random(0), "fleet-config")
        run_id = real_config.fields["run_id"]
        announce = PublicKeyAnnouncement(scheme="packed-paillier", key_id=evil.key_id, key=evil.to_bytes(), run_id=run_id)
        wire.publish("keys/public", to_frame(announce, fleet=fleet_name, sender="keyserver", round=0))
        wire.publish("keys/public", to_frame(announce, fleet=fleet_name, sender="keyserver", round=0, signer=attacker))
        model = ClusterModel(run_id=run_id, cluster=0, model="mlp", weights=np.zeros(real_config.sections["initial"].size, np.float32))
        wire.publish("clusters/0/model", to_frame(model, fleet=fleet_name, sender="keyserver", round=9, signer=SIGNERS["c000"]))
        forged = FleetConfig(**{**real_config.fields, "run_id": "forged"}, initial=real_config.sections["initial"])
        wire.publish("fleet/config", to_frame(forged, fleet=fleet_name, sender="coordinator", round=0))
        wait_for(lambda: wire.frames.get("update"), timeout=120)
        _, _, update = wire.pick(random.Random(1), "update")
        other = "c001" if update.sender != "c001" else "c000"
        wire.publish(f"agents/{other}/update", reframe(update, sender=other))  # signed by update.sender's key
        report = fleet.wait(timeout=300)
    wire.stop()
    assert fleet.exit_codes == {name: 0 for name in fleet.exit_codes}
    for agent in agent_ids(3):
        log = (tmp_path / "logs" / f"{agent}.log").read_text()
        assert "Unsigned 'public-key' frame from 'keyserver'" in log, agent
        assert "Frame from 'keyserver' is signed with key" in log and "not its pinned key" in log, agent
        assert "Unsigned 'fleet-config' frame from 'coordinator'" in log, agent
        assert "Traceback" not in log
    coordinator_log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert f"Frame from '{other}' is signed with key" in coordinator_log
    sim = run_simulation(config)
    assert [r["accuracy"] for r in report["rounds"]] == pytest.approx([r.accuracy for r in sim.rounds], abs=1e-9)


@pytest.mark.slow  # ~12 s (make test-slow: the default suite stays under 8 min on 2 cores)
def test_a_participating_device_never_appears_under_declined(mosquitto, tmp_path):
    """Issue 23: a device that took part in the job sends (signed with its own key) a decline
    of that job mid-run, as a buggy or compromised device can; the coordinator rejects it
    with its reason, the device stays in the rounds, and the report does not list it under
    ``declined``."""
    from senseshield.runtime.protocol.messages import Decline, to_frame

    config = Job(strategy="plaintext", model="linear", clients=3, rounds=3)
    fleet_name = "decline"
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet=fleet_name, round_deadline=60,
                           min_contributors=1)
    wire = Wire(mosquitto.url, fleet_name)
    with Fleet(config, options) as fleet:
        fleet.start()
        load_signers(fleet)
        wait_for(lambda: wire.newest_plan >= 1, timeout=240)
        _, _, real = wire.pick(random.Random(0), "fleet-config")
        decline = Decline(run_id=real.fields["run_id"], reason="changed my mind", selected=True)
        wire.publish("agents/c000/decline", to_frame(decline, fleet=fleet_name, sender="c000", round=0,
                                                     signer=SIGNERS["c000"]))
        report = fleet.wait(timeout=300)
    wire.stop()
    assert report["declined"] == {}
    assert "c000" in {c["id"] for c in report["clients"]}
    assert all("c000" in r["clusters"]["0"]["updates"] for r in report["server"])
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "Decline of job" in log and "from 'c000', which takes part in it; ignored" in log


@pytest.mark.parametrize("strategy,bad_devices", [("masked", ["c001", "c002"]),
                                                  pytest.param("sensecrypt", ["c002"], marks=pytest.mark.slow)])
def test_devices_sending_a_bad_fingerprint_every_round_cost_only_themselves(mosquitto, tmp_path, strategy,
                                                                            bad_devices):
    """Issue 23 item 1 on a real fleet: each bad device (its genuine key,
    senseshield_checks.bad_contribution) sends before its real update of every round from 2 on
    its previous round's update re-signed for the round (the fingerprint of another challenge).
    No round is lost: the key server refuses the aggregate at the fingerprint check, the
    coordinator aggregates again with the bad devices' later genuine updates in place (two in
    one retry), or without them, the key server names every bad device in its verdict, and the
    round's notes say so."""
    from senseshield_checks.bad_contribution import BadDevice, named, rounds_lost

    config = Job(strategy=strategy, model="linear", clients=3, rounds=3, key_bits=1024)
    options = FleetOptions(agents=3, out=tmp_path, broker=mosquitto.url, fleet="badfp", round_deadline=60,
                           min_contributors=1)
    with Fleet(config, options) as fleet:
        fleet.start()
        bad = [BadDevice(mosquitto.url, "badfp", d, fleet.out / "identities" / f"{d}.key") for d in bad_devices]
        try:
            report = fleet.wait(timeout=300)
        finally:
            for device in bad:
                device.stop()
    assert all(device.sent == [2, 3] for device in bad), [device.sent for device in bad]
    notes = [r["notes"] for r in report["rounds"]]
    assert rounds_lost(report) == 0, notes
    for device in bad_devices:
        assert named(report, device) == [2, 3], notes
        note = next(n for r in report["rounds"] for n in r["notes"] if f"refused the update of {device}" in n)
        assert "does not match the fingerprint it signed" in note
    server = {rec["round"]: rec for rec in report["server"]}
    assert all(c["accepted"] for rec in server.values() for c in rec["clusters"].values())
    assert fleet.exit_codes == {name: 0 for name in fleet.exit_codes}
    keyserver_log = (tmp_path / "logs" / "keyserver.log").read_text()
    assert all(f"{d}'s update refused" in keyserver_log for d in bad_devices) and "Traceback" not in keyserver_log
