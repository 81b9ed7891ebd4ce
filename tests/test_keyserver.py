"""The key server against a real broker: key files, public material only, the contributor rule."""

from __future__ import annotations

import stat
import threading
import time

import numpy as np
import pytest

from keyserver.service import KeyServer
from senseshield.engine.aggregation import aggregate_updates, protect_update
from senseshield.he import SCHEMES
from senseshield.runtime.protocol.messages import (
    AggregateResult,
    ClusterModel,
    FleetConfig,
    PublicKeyAnnouncement,
    aggregate_to_message,
    from_frame,
    to_frame,
)
from senseshield.job import Job
from senseshield.runtime.transport import Link


@pytest.fixture
def keyserver(mosquitto, tmp_path):
    server = KeyServer(mosquitto.url, fleet="ks", key_dir=tmp_path / "keys", min_contributors=2)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    time.sleep(0.5)
    yield server
    server.stopping.set()
    thread.join(10)


class Peer:
    """A test client speaking as the coordinator."""

    def __init__(self, url: str) -> None:
        self.got: list[tuple[str, object, int]] = []
        self.link = Link(url, client_id="coordinator", fleet="ks",
                         on_frame=lambda t, f: self.got.append((t, from_frame(f), f.round)))
        for suffix in ("keys/public", "keyserver/results", "clusters/+/model"):
            self.link.subscribe(suffix)
        self.link.start()

    def send(self, suffix: str, msg, round: int = 0) -> None:  # noqa: ANN001
        self.link.publish(suffix, to_frame(msg, fleet="ks", sender="coordinator", round=round))

    def wait(self, cls, timeout: float = 60):  # noqa: ANN001
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for _, msg, r in self.got:
                if isinstance(msg, cls):
                    self.got = [g for g in self.got if g[1] is not msg]
                    return msg, r
            time.sleep(0.05)
        raise AssertionError(f"no {cls.__name__} within {timeout} s")


def _config(strategy: str, size: int) -> FleetConfig:
    config = Job(strategy=strategy, model="linear", clients=2, key_bits=1024,
                              scheme="packed-paillier" if strategy != "plaintext" else None)
    return FleetConfig(run_id="run-1", config=config.model_dump(mode="json"), input_shape=[1, 8, 8],
                       num_classes=10, round_deadline=30, initial=np.zeros(size))


def test_keys_are_private_on_disk_and_only_public_material_is_announced(mosquitto, keyserver, tmp_path):
    peer = Peer(mosquitto.url)
    peer.send("fleet/config", _config("sensecrypt", 650))
    announcement, _ = peer.wait(PublicKeyAnnouncement)
    key_dir = tmp_path / "keys"
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    (secret_file,) = key_dir.glob("*.key")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert announcement.scheme == "packed-paillier"
    public = SCHEMES.get("packed-paillier").public_key_from_bytes(announcement.key)
    assert public.key_id == announcement.key_id
    import json

    primes = json.loads(secret_file.read_bytes())
    assert format(int(primes["p"], 16), "x").encode() not in announcement.key
    peer.link.stop()


def test_an_aggregate_of_fewer_than_min_contributors_is_refused_and_said_so(mosquitto, keyserver):
    peer = Peer(mosquitto.url)
    size = 650
    peer.send("fleet/config", _config("plaintext", size))
    peer.wait(PublicKeyAnnouncement)
    rng = np.random.default_rng(0)

    def request(clients: list[str], round: int):  # noqa: ANN202
        updates = [protect_update(rng.normal(size=size) * 0.01, np.zeros(size, bool), None, client_id=c, round=round,
                                  cluster=0, n_samples=10) for c in clients]
        return aggregate_to_message(aggregate_updates(updates, None, round=round, cluster=0), None, run_id="run-1")

    peer.send("keyserver/requests", request(["a"], 1), round=1)
    result, r = peer.wait(AggregateResult)
    assert (result.accepted, r) == (False, 1)
    assert "1 distinct contributor" in result.reason and "minimum 2" in result.reason
    # the same contributor named twice is still one
    forged = request(["a"], 2).model_copy(update={"contributors": ["a", "a"]})
    peer.send("keyserver/requests", forged, round=2)
    result, r = peer.wait(AggregateResult)
    assert (result.accepted, r) == (False, 2)
    peer.send("keyserver/requests", request(["a", "b"], 3), round=3)
    result, r = peer.wait(AggregateResult)
    assert result.accepted and r == 3 and result.timings["decrypt"] >= 0
    model, r = peer.wait(ClusterModel)
    assert r == 3 and model.weights.size == size and np.any(model.weights != 0)
    # a request from someone who is not the coordinator is rejected, the server keeps running
    stranger = Link(mosquitto.url, client_id="mallory", fleet="ks", on_frame=lambda t, f: None)
    stranger.start()
    stranger.publish("keyserver/requests", to_frame(request(["x", "y"], 4), fleet="ks", sender="mallory", round=4))
    time.sleep(0.5)
    assert any("only the coordinator" in r for r in keyserver.rejected)
    stranger.stop()
    peer.link.stop()
